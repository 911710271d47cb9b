//! Clock trouble. The rule: the store's time is `max(clock, highest time already used)`, and
//! the high-water mark is persisted. So a clock stepping backwards makes time stand still until
//! the clock catches up: no lease lapses early, no lease is handed out twice, and records are
//! not immortal (they expire once the clock passes their expiry again).

use std::time::Duration;

use idempotency_store::{Claim, Fingerprint, Key, ManualClock, Response, Result, Store, Timestamp};

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
        store.now(),
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
    assert_eq!(store.now(), Timestamp::from_millis(5_000_000));
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
