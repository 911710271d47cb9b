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
use crate::error::Result;
use crate::store::Store;

#[derive(Default)]
pub(crate) struct Waiters {
    gates: Mutex<HashMap<Key, Arc<Gate>>>,
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
        Arc::clone(self.gates.lock().entry(key.clone()).or_default())
    }

    fn leave(&self, key: &Key, gate: Arc<Gate>) {
        let mut gates = self.gates.lock();
        // The map's reference and ours: nobody else waits on this key.
        if Arc::strong_count(&gate) == 2 {
            gates.remove(key);
        }
    }

    /// Wakes the waiters of `key`, if it has any.
    pub(crate) fn wake(&self, key: &Key) {
        let gate = self.gates.lock().get(key).cloned();
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

    /// Waits until the generation moves past `seen` or `until` passes; true if woken.
    fn wait_past(&self, seen: u64, until: Instant) -> bool {
        let mut generation = self.generation.lock();
        while *generation == seen {
            if self.changed.wait_until(&mut generation, until).timed_out() {
                return *generation != seen;
            }
        }
        true
    }
}

impl Store {
    /// Like [`claim`](Store::claim), but while the key is in progress, waits for it to settle
    /// instead of answering [`Claim::InProgress`] at once.
    ///
    /// Returns the replay as soon as the holder completes, [`Claim::Acquired`] as soon as it
    /// releases or its lease lapses, and [`Claim::InProgress`] if `timeout` passes first. The
    /// wait is woken by the settling call in this process (a condvar, not polling); waiters on
    /// other keys are not woken. A lease lapse is noticed when the lease's deadline, read from
    /// the store's clock, passes in real time.
    ///
    /// # Errors
    /// As for [`claim`](Store::claim).
    pub fn claim_wait(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        timeout: Duration,
    ) -> Result<Claim> {
        let deadline = Instant::now() + timeout;
        let gate = self.waiters.enter(key);
        let result = loop {
            let seen = gate.generation();
            let claim = match self.claim(key, fingerprint) {
                Ok(claim) => claim,
                Err(err) => break Err(err),
            };
            let Claim::InProgress { lease_until, .. } = claim else {
                break Ok(claim);
            };
            let now = Instant::now();
            if now >= deadline {
                self.metrics.waited(true);
                break Ok(claim);
            }
            let lapse = now + lease_until.saturating_duration_since(self.now());
            self.metrics.waited(false);
            if gate.wait_past(seen, deadline.min(lapse)) {
                self.waiters.wakeups.fetch_add(1, Ordering::Relaxed);
            }
        };
        self.waiters.leave(key, gate);
        result
    }

    /// How many times a [`claim_wait`](Store::claim_wait) caller has been woken by a settling
    /// call since the store was opened (timeouts not counted).
    #[cfg(feature = "__test-hooks")]
    #[must_use]
    pub fn wait_wakeups(&self) -> u64 {
        self.waiters.wakeups.load(Ordering::Relaxed)
    }
}
