//! `Store::cached_replay`, the replays the tower layer answers without the blocking pool:
//! the same answer as a claim, never after expiry, never for another fingerprint, counted as
//! a replay, bounded, and off where completed records can be evicted.
//!
//! A test binary of its own: its races give their threads windows of a few milliseconds,
//! which, run beside the store binary's 64-thread tests (concurrency, memory's child) on a
//! loaded two-core machine, closed before the threads ran (two failures in two runs).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idempotency_store::{
    Claim, Fingerprint, IdempotencyStore, Key, ManualClock, Response, Store, StoreBuilder,
    Timestamp, WhenFull,
};

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(60);

fn builder(clock: &ManualClock) -> StoreBuilder {
    let mut builder = Store::builder();
    builder
        .lease(LEASE)
        .retention(RETENTION)
        .clock(clock.clone());
    builder
}

fn clock() -> ManualClock {
    ManualClock::new(Timestamp::from_millis(1_700_000_000_000))
}

/// Claims and completes `key`, then replays it once through `claim`.
fn complete_and_replay(store: &Store, key: &Key, fp: Fingerprint, body: &str) {
    let Ok(Claim::Acquired(lease)) = store.claim(key, fp) else {
        panic!("expected Acquired")
    };
    store
        .complete(&lease, Response::new(201, body))
        .expect("complete");
    assert!(matches!(store.claim(key, fp), Ok(Claim::Completed(_))));
}

#[test]
fn answers_as_a_claim_would_and_counts_as_a_replay() {
    let clock = clock();
    let store = builder(&clock).open_in_memory().expect("open");
    let (key, fp) = (Key::new("k").expect("key"), Fingerprint::of(["a"]));
    assert!(
        store.cached_replay(&key, fp).is_none(),
        "nothing replayed yet"
    );
    complete_and_replay(&store, &key, fp, "first");
    let Ok(Claim::Completed(claimed)) = store.claim(&key, fp) else {
        panic!("expected Completed")
    };
    let replays_before = store.metrics().claims.replayed;
    for _ in 0..5 {
        assert_eq!(store.cached_replay(&key, fp), Some(claimed.clone()));
    }
    assert_eq!(store.metrics().claims.replayed, replays_before + 5);
    assert!(store.cached_replay(&key, Fingerprint::of(["b"])).is_none());
    assert!(
        matches!(
            store.claim(&key, Fingerprint::of(["b"])),
            Ok(Claim::Mismatch { .. })
        ),
        "a miss still goes to claim, which answers the mismatch"
    );
}

#[test]
fn never_answers_once_the_record_expired_and_then_follows_the_new_record() {
    let clock = clock();
    let store = builder(&clock).open_in_memory().expect("open");
    let (key, fp) = (Key::new("k").expect("key"), Fingerprint::of(["a"]));
    assert!(
        store.cached_replay(&key, fp).is_none(),
        "asked once: filled from here on"
    );
    complete_and_replay(&store, &key, fp, "first");
    clock.advance(RETENTION - Duration::from_millis(1));
    assert!(
        store.cached_replay(&key, fp).is_some(),
        "1 ms before expiry"
    );
    clock.advance(Duration::from_millis(1));
    assert!(store.cached_replay(&key, fp).is_none(), "at expiry");
    assert_eq!(store.sweep_all().expect("sweep"), 1);
    assert!(store.cached_replay(&key, fp).is_none(), "after the sweep");
    complete_and_replay(&store, &key, fp, "second");
    let cached = store
        .cached_replay(&key, fp)
        .expect("the new record's replay");
    assert_eq!(cached.response.body, b"second");
}

#[test]
fn keeps_nothing_when_off_or_when_completed_records_can_be_evicted() {
    let (key, fp) = (Key::new("k").expect("key"), Fingerprint::of(["a"]));
    let clock = clock();
    let off = builder(&clock)
        .replay_cache(0)
        .open_in_memory()
        .expect("open");
    let evicting = builder(&clock)
        .max_records(10)
        .when_full(WhenFull::EvictOldestCompleted)
        .open_in_memory()
        .expect("open");
    for store in [&off, &evicting] {
        assert!(store.cached_replay(&key, fp).is_none());
        complete_and_replay(store, &key, fp, "x");
        assert!(store.cached_replay(&key, fp).is_none());
    }
}

#[test]
fn through_the_trait_and_its_pointers() {
    let clock = clock();
    let store = Arc::new(builder(&clock).open_in_memory().expect("open"));
    let (key, fp) = (Key::new("k").expect("key"), Fingerprint::of(["a"]));
    let shared: Arc<dyn IdempotencyStore> = store.clone();
    assert!(shared.cached_replay(&key, fp).is_none());
    complete_and_replay(&store, &key, fp, "x");
    assert!(shared.cached_replay(&key, fp).is_some());
    assert!(
        (&*store as &dyn IdempotencyStore)
            .cached_replay(&key, fp)
            .is_some()
    );
}

/// Readers racing the clock past a key's expiry: no cached answer carries an expiry at or
/// before a time the store had already reached when the call began.
#[test]
fn racing_readers_never_see_a_replay_past_its_expiry() {
    for round in 0..20 {
        let clock = clock();
        let store = Arc::new(builder(&clock).open_in_memory().expect("open"));
        let fp = Fingerprint::of(["a"]);
        let keys: Vec<Key> = (0..8)
            .map(|i| Key::new(&format!("k{i}")).expect("key"))
            .collect();
        for key in &keys {
            let _ = store.cached_replay(key, fp);
            complete_and_replay(&store, key, fp, "x");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..4)
            .map(|_| {
                let (store, keys, stop) = (Arc::clone(&store), keys.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut served = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        for key in &keys {
                            let before = store.now().expect("the store's time");
                            if let Some(replay) = store.cached_replay(key, fp) {
                                assert!(
                                    replay.expires_at > before,
                                    "served at {before:?}: {replay:?}"
                                );
                                served += 1;
                            }
                        }
                    }
                    served
                })
            })
            .collect();
        for _ in 0..60 {
            clock.advance(Duration::from_millis(1000 + round));
            std::thread::sleep(Duration::from_micros(200));
        }
        stop.store(true, Ordering::SeqCst);
        let served: u64 = readers.into_iter().map(|r| r.join().expect("reader")).sum();
        assert!(served > 0, "the readers were served from the cache");
        assert!(
            store.cached_replay(&keys[0], fp).is_none(),
            "all expired by now"
        );
    }
}

/// Claims answer from the cache as well (no `cached_replay` call needed to fill it), and the
/// cache never outlives the record: threads claiming a set of keys while the clock passes
/// their expiry never get a replay at or past it, and once expired each key is acquired
/// afresh (its new completion replays, not the old one).
#[test]
fn claims_from_the_cache_never_replay_past_expiry_nor_an_old_record() {
    for round in 0..10 {
        let clock = clock();
        let store = Arc::new(builder(&clock).open_in_memory().expect("open"));
        let fp = Fingerprint::of(["a"]);
        let keys: Vec<Key> = (0..8)
            .map(|i| Key::new(&format!("k{i}")).expect("key"))
            .collect();
        for key in &keys {
            complete_and_replay(&store, key, fp, "old");
        }
        let stop = Arc::new(AtomicBool::new(false));
        let claimers: Vec<_> = (0..4)
            .map(|_| {
                let (store, keys, stop) = (Arc::clone(&store), keys.clone(), Arc::clone(&stop));
                std::thread::spawn(move || {
                    let mut replays = 0u64;
                    while !stop.load(Ordering::SeqCst) {
                        for key in &keys {
                            let before = store.now().expect("the store's time");
                            match store.claim(key, fp).expect("claim") {
                                Claim::Completed(replay) => {
                                    assert!(replay.expires_at > before, "{replay:?} at {before:?}");
                                    assert_eq!(replay.response.body, b"old");
                                    replays += 1;
                                }
                                // Past expiry: a fresh lease, left to lapse (no new completion).
                                Claim::Acquired(_) | Claim::InProgress { .. } => {}
                                other @ Claim::Mismatch { .. } => panic!("{other:?}"),
                            }
                        }
                    }
                    replays
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        clock.advance(RETENTION + Duration::from_millis(round));
        std::thread::sleep(Duration::from_millis(20));
        stop.store(true, Ordering::SeqCst);
        let replays: u64 = claimers
            .into_iter()
            .map(|c| c.join().expect("claimer"))
            .sum();
        assert!(replays > 0, "the claimers replayed before the expiry");
        assert!(
            store.metrics().claims.replayed >= replays,
            "replays from the cache are counted"
        );
        // Every key now holds a live lease of a new attempt; settle one and see its answer.
        clock.advance(LEASE);
        let Ok(Claim::Acquired(lease)) = store.claim(&keys[0], fp) else {
            panic!("expected a takeover of the lapsed lease")
        };
        store
            .complete(&lease, Response::new(201, "new"))
            .expect("complete");
        for _ in 0..3 {
            let Ok(Claim::Completed(replay)) = store.claim(&keys[0], fp) else {
                panic!("expected Completed")
            };
            assert_eq!(replay.response.body, b"new");
        }
    }
}
