//! A sweep deletes expired records without a log entry, so a crash before the next merge
//! brings them back. Each must come back expired (no call answers with it, a sweep deletes it
//! again), `verify` must find nothing wrong, and a claim made after the sweep over a key whose
//! old record came back must keep its new record, with the usage counters and the expiry index
//! as if the old record had never been there. The crash is a power cut on a simulated disk:
//! only what was synced survives, so nothing the sweep deleted reached redb durably.

use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{
    Claim, Fingerprint, Key, ManualClock, RecordState, Response, Result, Store, Timestamp,
};

use crate::common::disk::SimDisk;

const RETENTION: Duration = Duration::from_secs(3600);
/// Fewer than a generation of the overlay: nothing is flushed or merged before the cut.
const RECORDS: u64 = 200;

fn open(disk: SimDisk, clock: &ManualClock) -> Result<Store> {
    Store::builder()
        .retention(RETENTION)
        .clock(clock.clone())
        .open_with_backend(disk)
}

fn fp(name: &str) -> Fingerprint {
    Fingerprint::of(["POST", name])
}

/// Claims and completes `name` with `body`; the claim must be a first attempt.
fn store_new(store: &Store, name: &str, body: &str) -> Result<()> {
    let claim = store.claim(&Key::new(name)?, fp(name))?;
    let Claim::Acquired(lease) = claim else {
        panic!("{name}: not acquired: {claim:?}");
    };
    assert_eq!(lease.attempt(), 1, "{name}: a first attempt");
    store.complete(&lease, Response::new(200, body))
}

fn body_of(store: &Store, name: &str) -> Result<Option<Vec<u8>>> {
    Ok(
        match store.lookup(&Key::new(name)?)?.map(|view| view.state) {
            Some(RecordState::Completed { response, .. }) => Some(response.body.to_vec()),
            Some(other) => panic!("{name}: {other:?}"),
            None => None,
        },
    )
}

/// A store that held `RECORDS` completed `old-` records, merged into redb, and has swept them
/// all without a log entry: written, closed, reopened with the clock past their expiry, and
/// swept. Also its clock and disk, for the cut that follows.
fn swept_store() -> Result<(ManualClock, SimDisk, Store)> {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let disk = SimDisk::default();
    let store = open(disk.clone(), &clock)?;
    for i in 0..RECORDS {
        store_new(&store, &format!("old-{i}"), "old")?;
    }
    store.close()?;
    clock.advance(RETENTION + Duration::from_secs(1));
    let store = open(disk.clone(), &clock)?;
    assert_eq!(store.sweep_all()?, RECORDS);
    Ok((clock, disk, store))
}

#[test]
fn records_swept_without_a_log_entry_come_back_expired_and_are_swept_again() -> Result<()> {
    let (clock, disk, store) = swept_store()?;
    // After the sweep: an old key claimed again, and a new one, both acknowledged.
    store_new(&store, "old-0", "again")?;
    store_new(&store, "new", "new")?;
    let cut = SimDisk::of(disk.sim().crash_image(|| false), ());
    drop(store);

    let store = open(cut, &clock)?;
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    let stats = store.stats()?;
    assert_eq!(
        stats.expired,
        RECORDS - 1,
        "the swept records came back, expired (else the sweep was logged)"
    );
    assert_eq!(stats.completed, 2);
    assert_eq!(body_of(&store, "old-0")?.as_deref(), Some(&b"again"[..]));
    assert_eq!(body_of(&store, "new")?.as_deref(), Some(&b"new"[..]));
    assert_eq!(
        body_of(&store, "old-1")?,
        None,
        "an expired record answered"
    );
    // A claim over a record that came back is a first attempt, as over any expired record.
    store_new(&store, "old-1", "third")?;
    assert_eq!(store.sweep_all()?, RECORDS - 2);
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    let stats = store.stats()?;
    assert_eq!((stats.expired, stats.completed), (0, 3));
    store.close()
}

/// The same cut after claims of every third swept key, each then completed or released: the
/// log holds claims, completions and deletions of keys whose old records come back, and the
/// replay must end with the new record or none, never the old one.
#[test]
fn claims_and_releases_over_records_swept_without_a_log_entry_replay_cleanly() -> Result<()> {
    let (clock, disk, store) = swept_store()?;
    let (mut kept, mut claimed) = (Vec::new(), 0);
    for i in (0..RECORDS).step_by(3) {
        claimed += 1;
        let name = format!("old-{i}");
        let Claim::Acquired(lease) = store.claim(&Key::new(&name)?, fp(&name))? else {
            panic!("{name}: not acquired");
        };
        if i % 2 == 0 {
            store.release(&lease)?;
        } else {
            store.complete(&lease, Response::new(201, name.as_str()))?;
            kept.push(name);
        }
    }
    let cut = SimDisk::of(disk.sim().crash_image(|| false), ());
    drop(store);

    let store = open(cut, &clock)?;
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    for name in &kept {
        assert_eq!(
            body_of(&store, name)?,
            Some(name.as_bytes().to_vec()),
            "{name}"
        );
    }
    let stats = store.stats()?;
    assert_eq!(stats.completed, kept.len() as u64);
    // A released key's logged deletion took its old record too; the unclaimed ones came
    // back, expired, and are swept again.
    for i in (0..RECORDS).step_by(6) {
        let name = format!("old-{i}");
        assert!(
            store.inspect(&Key::new(&name)?)?.is_none(),
            "{name} came back"
        );
    }
    assert_eq!(stats.expired, RECORDS - claimed);
    assert_eq!(store.sweep_all()?, RECORDS - claimed);
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    store.close()
}
