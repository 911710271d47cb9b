//! What the drain tests of both frameworks share (`actix_drain`, `outlives_connection`): a
//! store on a file, waiting for the handlers to start, and the states of the keys in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotency_store::{IdempotencyStore, Key, RecordState, Store};

pub fn durable_store(dir: &tempfile::TempDir, lease: Duration) -> Arc<Store> {
    let path = dir.path().join("keys.redb");
    Arc::new(
        Store::builder()
            .lease(lease)
            .open(path)
            .expect("open store"),
    )
}

/// Waits until `started` (a handler's count of its runs) reaches `count`.
pub fn wait_for_runs(started: &AtomicUsize, count: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while started.load(Ordering::SeqCst) < count {
        assert!(Instant::now() < deadline, "the handlers never started");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// (completed, in progress, absent) among `prefix-0` .. `prefix-{count-1}`.
pub fn states(store: &Store, prefix: &str, count: usize) -> (usize, usize, usize) {
    let (mut completed, mut in_progress, mut absent) = (0, 0, 0);
    for i in 0..count {
        let key = Key::new(&format!("{prefix}-{i}")).expect("key");
        match store.lookup(&key).expect("lookup").map(|r| r.state) {
            Some(RecordState::Completed { .. }) => completed += 1,
            Some(RecordState::InProgress { .. }) => in_progress += 1,
            None => absent += 1,
            Some(other) => panic!("unexpected state {other:?}"),
        }
    }
    (completed, in_progress, absent)
}
