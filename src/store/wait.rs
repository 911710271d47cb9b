//! In-process waiting for a key that another thread holds (`claim_wait`).
//!
//! One gate per key that has waiters. A settling commit bumps the key's generation and wakes
//! only that key's waiters; a waiter reads the generation *before* it claims, so a completion
//! that lands between its claim and its wait is never missed.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::Claim;
use crate::api::store::IdempotencyStore;
use crate::error::Result;
use crate::store::Store;

#[derive(Default)]
pub(crate) struct Waiters {
    /// Each key with waiters: its gate and how many wait on it. The count, not the `Arc`'s
    /// strong count, decides when the entry goes: a wake-up holds a clone of the gate for a
    /// moment, and a waiter leaving just then would otherwise leave the entry behind for good
    /// (with unique keys the map only grew).
    gates: Mutex<HashMap<Key, (Arc<Gate>, usize)>>,
    /// Times a waiter was woken by a settling call (not by a timeout); for tests and stats.
    wakeups: AtomicU64,
}

#[derive(Default)]
struct Gate {
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Waiters {
    fn enter(&self, key: &Key) -> Arc<Gate> {
        let mut gates = self.gates.lock();
        let (gate, waiting) = gates.entry(key.clone()).or_default();
        *waiting += 1;
        Arc::clone(gate)
    }

    fn leave(&self, key: &Key) {
        let mut gates = self.gates.lock();
        if let Some((_, waiting)) = gates.get_mut(key) {
            *waiting -= 1;
            if *waiting == 0 {
                gates.remove(key);
            }
        }
    }

    /// Wakes the waiters of `key`, if it has any.
    pub(crate) fn wake(&self, key: &Key) {
        let gate = self.gates.lock().get(key).map(|(gate, _)| Arc::clone(gate));
        if let Some(gate) = gate {
            *gate.generation.lock() += 1;
            gate.changed.notify_all();
        }
    }
}

impl Gate {
    fn generation(&self) -> u64 {
        *self.generation.lock()
    }

    /// Waits until the generation moves past `seen` or `until` passes (`None`: no time
    /// limit); true if woken.
    fn wait_past(&self, seen: u64, until: Option<Instant>) -> bool {
        let mut generation = self.generation.lock();
        while *generation == seen {
            match until {
                Some(until) => {
                    if self.changed.wait_until(&mut generation, until).timed_out() {
                        return *generation != seen;
                    }
                }
                None => self.changed.wait(&mut generation),
            }
        }
        true
    }
}

impl Store {
    /// `claim_wait` ([`IdempotencyStore::claim_wait`]): woken by the settling call in this
    /// process (a condvar, not polling); waiters on other keys are not woken. A lease lapse is
    /// noticed when the lease's deadline, read from the store's clock, passes in real time.
    pub(crate) fn wait_for(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        timeout: Duration,
    ) -> Result<Claim> {
        // None: beyond what an `Instant` can hold, so never.
        let deadline = Instant::now().checked_add(timeout);
        let gate = self.waiters.enter(key);
        let result = loop {
            let seen = gate.generation();
            let claim = match IdempotencyStore::claim(self, key, fingerprint) {
                Ok(claim) => claim,
                Err(err) => break Err(err),
            };
            let Claim::InProgress { lease_until, .. } = claim else {
                break Ok(claim);
            };
            let now = Instant::now();
            if deadline.is_some_and(|deadline| now >= deadline) {
                self.meter.waited(true);
                break Ok(claim);
            }
            let lapse = now.checked_add(lease_until.saturating_duration_since(self.engine.now()));
            let until = match (deadline, lapse) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            self.meter.waited(false);
            if gate.wait_past(seen, until) {
                self.waiters.wakeups.fetch_add(1, Ordering::Relaxed);
            }
        };
        drop(gate);
        self.waiters.leave(key);
        result
    }

    /// How many times a [`claim_wait`](crate::IdempotencyStore::claim_wait) caller has been woken by a settling
    /// call since the store was opened (timeouts not counted).
    #[cfg(feature = "__test-hooks")]
    #[doc(hidden)]
    #[must_use]
    pub fn wait_wakeups(&self) -> u64 {
        self.waiters.wakeups.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use crate::api::fingerprint::Fingerprint;
    use crate::api::key::Key;
    use crate::api::outcome::Claim;
    use crate::api::response::Response;
    use crate::api::store::IdempotencyStore;
    use crate::store::Store;

    fn keys_waited_on(store: &Store) -> usize {
        store.waiters.gates.lock().len()
    }

    /// 10^5 unique keys with `IDEMPOTENCY_TEST_SCALE=full` (as CI runs it), 10^4 under `cargo
    /// test`, each waited on by one thread while another completes it: every wait ends with a
    /// wake-up racing the waiter's exit, and the map must end empty.
    #[test]
    fn the_waiter_map_is_empty_after_many_unique_keys() {
        let store = Arc::new(Store::builder().open_in_memory().expect("open"));
        let fp = Fingerprint::of(["w"]);
        let threads = 4;
        let full = std::env::var("IDEMPOTENCY_TEST_SCALE").is_ok_and(|v| v == "full");
        let per_thread = if full { 25_000 } else { 2_500 };
        std::thread::scope(|s| {
            for t in 0..threads {
                let store = Arc::clone(&store);
                s.spawn(move || {
                    for i in 0..per_thread {
                        let key = Key::new(&format!("w{t}-{i}")).expect("key");
                        let Ok(Claim::Acquired(lease)) = store.claim(&key, fp) else {
                            panic!("fresh key not acquired");
                        };
                        std::thread::scope(|s| {
                            s.spawn(|| {
                                let got = store.claim_wait(&key, fp, Duration::from_secs(30));
                                assert!(matches!(got, Ok(Claim::Completed(_))), "{got:?}");
                            });
                            store
                                .complete(&lease, Response::new(200, "ok"))
                                .expect("complete");
                        });
                    }
                });
            }
        });
        assert_eq!(keys_waited_on(&store), 0, "the waiter map leaked");
        assert!(store.wait_wakeups() > 0, "no wait was ever woken");
    }

    #[test]
    fn claim_wait_takes_any_duration() {
        let store = Arc::new(Store::builder().open_in_memory().expect("open"));
        let key = Key::new("max").expect("key");
        let fp = Fingerprint::of(["max"]);
        let Ok(Claim::Acquired(lease)) = store.claim(&key, fp) else {
            panic!("not acquired");
        };
        std::thread::scope(|s| {
            let waiter = s.spawn(|| store.claim_wait(&key, fp, Duration::MAX));
            // Completes only once the waiter is waiting, so the wait really has no limit.
            while keys_waited_on(&store) == 0 {
                std::thread::yield_now();
            }
            store
                .complete(&lease, Response::new(200, "done"))
                .expect("complete");
            let got = waiter.join().expect("waiter");
            assert!(matches!(got, Ok(Claim::Completed(_))), "{got:?}");
        });
        // And a completed key answers at once, with no overflow either.
        let again = store.claim_wait(&key, fp, Duration::MAX);
        assert!(matches!(again, Ok(Claim::Completed(_))), "{again:?}");
        assert_eq!(keys_waited_on(&store), 0);
    }
}
