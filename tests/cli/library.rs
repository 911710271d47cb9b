//! The library operations behind `list`, `get` and `release`.

use std::time::Duration;

use idempotency_store::{IdempotencyStore, Key, ManualClock, Response, Store, Timestamp};

use super::claim;

#[test]
fn force_release_deletes_only_in_progress_records_and_keeps_the_store_consistent() {
    use idempotency_store::{Error, admin::ForceRelease};
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let store = Store::builder()
        .lease(Duration::from_secs(10))
        .retention(Duration::from_secs(100))
        .clock(clock.clone())
        .open_in_memory()
        .expect("store");
    let key = |k: &str| Key::new(k).expect("key");
    let stuck = Key::scoped("t", "stuck").expect("key");
    let _old = claim(&store, &key("old"));
    clock.advance(Duration::from_secs(200));
    let stuck_lease = claim(&store, &stuck);
    let live_lease = claim(&store, &key("live"));
    let done = claim(&store, &key("done"));
    store
        .complete(&done, Response::new(201, "ok"))
        .expect("complete");
    clock.advance(Duration::from_secs(20));

    let release = |k: &Key| store.force_release(k).expect("force_release");
    assert_eq!(release(&key("done")), ForceRelease::Completed);
    assert_eq!(release(&key("old")), ForceRelease::NotFound, "expired");
    assert_eq!(release(&key("none")), ForceRelease::NotFound);
    assert!(matches!(
        release(&stuck),
        ForceRelease::Released { attempt: 1, .. }
    ));
    assert!(matches!(
        release(&key("live")),
        ForceRelease::Released { attempt: 1, .. }
    ));
    let report = store.verify().expect("verify");
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.records, 2, "done and the expired old remain");

    // The old holders are fenced off; the keys run afresh.
    assert!(matches!(store.release(&stuck_lease), Err(Error::LeaseLost)));
    assert!(matches!(
        store.complete(&live_lease, Response::new(200, "late")),
        Err(Error::LeaseLost)
    ));
    assert_eq!(claim(&store, &stuck).attempt(), 1);
    assert!(store.verify().expect("verify").is_clean());
    assert_eq!(store.sweep_all().expect("sweep"), 1);
    assert!(store.verify().expect("verify").is_clean());
}

#[test]
fn records_and_inspect_include_expired_records() {
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let store = Store::builder()
        .retention(Duration::from_secs(100))
        .clock(clock.clone())
        .open_in_memory()
        .expect("store");
    let a = Key::new("a").expect("key");
    let lease = claim(&store, &a);
    store
        .complete(&lease, Response::new(200, "a"))
        .expect("complete");
    let _b = claim(&store, &Key::scoped("s", "b").expect("key"));
    clock.advance(Duration::from_secs(1_000));
    let all: Vec<_> = store
        .records()
        .expect("records")
        .collect::<Result<_, _>>()
        .expect("no damage");
    let keys: Vec<String> = all.iter().map(|r| r.key.to_string()).collect();
    assert_eq!(keys, ["a", "s/b"]);
    assert!(
        all.iter()
            .all(|r| r.record.expires_at <= store.now().expect("now"))
    );
    assert!(store.lookup(&a).expect("lookup").is_none());
    assert!(store.inspect(&a).expect("inspect").is_some());
}
