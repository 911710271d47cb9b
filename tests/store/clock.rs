//! Clock trouble. The rule: the store's time is `max(clock, highest time already used)`, and
//! the high-water mark is persisted. So a clock stepping backwards makes time stand still until
//! the clock catches up: no lease lapses early, no lease is handed out twice, and records are
//! not immortal (they expire once the clock passes their expiry again).

use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Fingerprint, Key, ManualClock, Response, Result, Store, Timestamp};

use crate::common::disk::{Faults, Op, SimDisk};

const T0: u64 = 1_700_000_000_000;
const LEASE: Duration = Duration::from_secs(60);

fn open(clock: &ManualClock) -> Result<Store> {
    Store::builder()
        .lease(LEASE)
        .retention(Duration::from_secs(3600))
        .clock(clock.clone())
        .open_in_memory()
}

fn fp() -> Fingerprint {
    Fingerprint::of(["r"])
}

#[test]
fn stepping_back_never_shortens_a_lease() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = open(&clock)?;
    let key = Key::new("k")?;
    let Claim::Acquired(_lease) = store.claim(&key, fp())? else {
        panic!()
    };
    clock.advance(Duration::from_secs(30));
    let _ = store.claim(&key, fp())?;
    clock.set(Timestamp::from_millis(T0 - 3_600_000));
    assert_eq!(
        store.now()?,
        Timestamp::from_millis(T0 + 30_000),
        "time stands still"
    );
    assert!(matches!(store.claim(&key, fp())?, Claim::InProgress { .. }));
    Ok(())
}

#[test]
fn stepping_back_never_hands_out_a_lease_twice() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = open(&clock)?;
    let key = Key::new("k")?;
    let Claim::Acquired(first) = store.claim(&key, fp())? else {
        panic!()
    };
    clock.advance(LEASE);
    let Claim::Acquired(second) = store.claim(&key, fp())? else {
        panic!("no takeover")
    };
    // The clock jumps back to before the first lease lapsed: the takeover must not repeat,
    // and the first holder stays fenced out.
    clock.set(Timestamp::from_millis(T0 + 1));
    assert!(matches!(
        store.claim(&key, fp())?,
        Claim::InProgress { attempt: 2, .. }
    ));
    assert!(store.complete(&first, Response::new(200, "stale")).is_err());
    store.complete(&second, Response::new(200, "fresh"))?;
    Ok(())
}

#[test]
fn stepping_back_only_delays_expiry() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = open(&clock)?;
    let key = Key::new("k")?;
    let Claim::Acquired(lease) = store.claim(&key, fp())? else {
        panic!()
    };
    store.complete(&lease, Response::new(200, "x"))?;
    clock.advance(Duration::from_secs(1800));
    let _ = store.lookup(&key)?;
    clock.set(Timestamp::from_millis(T0 - 86_400_000)); // a day back
    assert!(
        store.lookup(&key)?.is_some(),
        "expiry waits while time stands still"
    );
    // Once the clock is past the expiry again, the record expires as it would have.
    clock.set(Timestamp::from_millis(T0 + 3_600_000));
    assert_eq!(store.lookup(&key)?, None, "records are not immortal");
    assert_eq!(store.sweep_all()?, 1);
    Ok(())
}

#[test]
fn the_high_water_mark_survives_a_restart() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(Timestamp::from_millis(5_000_000));
    {
        let store = Store::builder().clock(clock.clone()).open(&path)?;
        let Claim::Acquired(_lease) = store.claim(&Key::new("k")?, fp())? else {
            panic!()
        };
    }
    clock.set(Timestamp::from_millis(1_000));
    let store = Store::builder().clock(clock.clone()).open(&path)?;
    assert_eq!(store.now()?, Timestamp::from_millis(5_000_000));
    assert!(matches!(
        store.claim(&Key::new("k")?, fp())?,
        Claim::InProgress { .. }
    ));
    Ok(())
}

/// A lookup saw a record expire; the store is closed and reopened with the clock 1 ms behind
/// that moment. The time the lookup used was persisted at the close, so the record stays
/// expired: it must not replay (and a claim runs afresh).
#[test]
fn a_time_seen_only_by_a_read_survives_a_reopen() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("clock.store");
    let retention = Duration::from_secs(3600);
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let open_file = |clock: &ManualClock| {
        Store::builder()
            .retention(retention)
            .clock(clock.clone())
            .open(&path)
    };
    let store = open_file(&clock)?;
    let key = Key::new("k")?;
    let Claim::Acquired(lease) = store.claim(&key, fp())? else {
        panic!("not acquired")
    };
    store.complete(&lease, Response::new(200, "once"))?;
    clock.advance(retention);
    assert_eq!(
        store.lookup(&key)?,
        None,
        "expired at completion + retention"
    );
    store.close()?;

    clock.set(Timestamp::from_millis(
        T0 + retention.as_millis() as u64 - 1,
    ));
    let store = open_file(&clock)?;
    assert_eq!(
        store.lookup(&key)?,
        None,
        "the expired record came back to life"
    );
    assert!(
        matches!(store.claim(&key, fp())?, Claim::Acquired(_)),
        "an expired record replayed"
    );
    Ok(())
}

type Merges = Box<dyn Fn() -> u64 + Send>;

#[derive(Default)]
struct Gate {
    armed: Option<(u64, Merges)>,
    image: Option<Vec<u8>>,
}

/// The fault of a [`GatedDisk`]: its gate.
#[derive(Clone, Default)]
struct Gated(std::sync::Arc<std::sync::Mutex<Gate>>);

/// A store's disk whose `gate`, while armed, holds a write from any thread but the flush
/// thread's until `merges` (the store's count of merges) passes the armed value, and keeps the
/// durable image of that moment: a power cut right after a merge, before the next log entry.
type GatedDisk = SimDisk<Gated>;

fn gate(disk: &GatedDisk) -> std::sync::Arc<std::sync::Mutex<Gate>> {
    std::sync::Arc::clone(&disk.sim().faults.0)
}

impl Faults for Gated {
    // Writes are durable once a sync returns; sizes at once.
    const SIZES_DURABLE: bool = true;

    /// Holds a write back until the merge in flight is durable; keeps that image.
    fn gate(disk: &GatedDisk, op: Op) {
        if op != Op::Write || std::thread::current().name() == Some("idempotency-store-flush") {
            return;
        }
        let gate = gate(disk);
        let mut gate = gate.lock().expect("gate");
        let Some((before, merges)) = gate.armed.take() else {
            return;
        };
        let started = std::time::Instant::now();
        while merges() <= before {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "no merge while the write waited: the workload no longer switches halves there"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        gate.image = Some(disk.sim().durable.clone());
    }
}

const RETENTION: Duration = Duration::from_secs(3600);

fn open_gated(disk: GatedDisk, clock: &ManualClock) -> Result<Store> {
    Store::builder()
        .retention(RETENTION)
        .lease(LEASE)
        .log_size(16 << 10)
        .clock(clock.clone())
        .open_with_backend(disk)
}

/// Claims a key of 200 bytes: about 80 of them fill a half of the 16 KiB log.
fn filler(store: &Store, i: usize) -> Result<()> {
    let key = Key::new(&format!("{i:0>200}"))?;
    let Claim::Acquired(_) = store.claim(&key, fp())? else {
        panic!("filler {i}: not acquired")
    };
    Ok(())
}

/// Completes "k" at `T0`; returns the store.
fn completed_k(disk: GatedDisk, clock: &ManualClock) -> Result<Store> {
    let store = open_gated(disk, clock)?;
    let Claim::Acquired(lease) = store.claim(&Key::new("k")?, fp())? else {
        panic!("k: not acquired")
    };
    store.complete(&lease, Response::new(200, "once"))?;
    Ok(store)
}

/// The filler claim during which the log switches halves and the flush thread merges.
fn first_merging_filler() -> Result<usize> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = completed_k(GatedDisk::default(), &clock)?;
    for i in 0..1000 {
        filler(&store, i)?;
        // Waits for the flush thread's report.
        store.stats()?;
        if merges_of(&store) > 0 {
            return Ok(i);
        }
    }
    panic!("no merge in 1000 claims");
}

/// A lookup saw "k" expire; the next write switches the log's halves, and the power fails
/// once the flush thread's merge is durable, before that write's log entry is written. The
/// merge persisted the time the lookup used, so at a reopen with the clock 1 ms behind that
/// moment "k" stays expired. (Every write after a read logs the read's time too, so only
/// this crash, between a merge and the entry of the write that asked for it, leaves the
/// merge as the one place that time was kept.)
#[test]
fn a_time_seen_only_by_a_read_survives_a_crash_after_a_merge() -> Result<()> {
    let trigger = first_merging_filler()?;
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let disk = GatedDisk::default();
    let store = std::sync::Arc::new(completed_k(disk.clone(), &clock)?);
    for i in 0..trigger {
        filler(&store, i)?;
    }
    assert_eq!(merges_of(&store), 0, "merged too early");
    clock.advance(RETENTION);
    assert_eq!(store.lookup(&Key::new("k")?)?, None, "expired");
    let watched = std::sync::Arc::downgrade(&store);
    let merges: Merges = Box::new(move || {
        watched
            .upgrade()
            .map_or(u64::MAX, |store| merges_of(&store))
    });
    gate(&disk).lock().expect("gate").armed = Some((0, merges));
    filler(&store, trigger)?;
    let image = gate(&disk).lock().expect("gate").image.take();
    let image = image.expect("the write after the lookup did not wait for a merge");
    drop(store);

    clock.set(Timestamp::from_millis(
        T0 + RETENTION.as_millis() as u64 - 1,
    ));
    let store = open_gated(GatedDisk::of(image, Gated::default()), &clock)?;
    assert_eq!(
        store.lookup(&Key::new("k")?)?,
        None,
        "the expired record came back to life"
    );
    assert!(
        matches!(store.claim(&Key::new("k")?, fp())?, Claim::Acquired(_)),
        "an expired record replayed"
    );
    Ok(())
}

fn merges_of(store: &Store) -> u64 {
    store.metrics().engine.map_or(0, |engine| engine.merges)
}
