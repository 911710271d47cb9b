//! Auto-heartbeat: the lease of a running handler is extended in the background, and a lost
//! lease is made visible to the handler through its [`LeaseWatch`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::api::backend::IdempotencyStore;
use crate::api::clock::Timestamp;
use crate::api::key::Key;
use crate::api::outcome::Lease;
use crate::error::Error;

/// The shortest heartbeat period, so that a tiny lease does not turn into a busy loop.
const MIN_PERIOD: Duration = Duration::from_millis(10);

/// What the handler of a covered request knows about its lease. [`handle`](super::handle)
/// and the tower layer put it into the request's extensions
/// (`request.extensions().get::<LeaseWatch>()`); cheap to clone.
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    key: Key,
    token: u64,
    attempt: u32,
    checkpoint: Option<Arc<[u8]>>,
    lost: Arc<AtomicBool>,
}

impl LeaseWatch {
    pub(crate) fn new(lease: &Lease) -> Self {
        LeaseWatch {
            key: lease.key().clone(),
            token: lease.token(),
            attempt: lease.attempt(),
            checkpoint: lease.checkpoint().map(Arc::from),
            lost: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The key the request holds.
    #[must_use]
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The lease's fencing token (see [`Lease::token`]).
    #[must_use]
    pub fn token(&self) -> u64 {
        self.token
    }

    /// 1 for a fresh key, n + 1 when this run took over attempt n.
    #[must_use]
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The checkpoint the attempt before this one left (see [`Lease::checkpoint`]).
    #[must_use]
    pub fn checkpoint(&self) -> Option<&[u8]> {
        self.checkpoint.as_deref()
    }

    /// `true` once a heartbeat found the lease taken over: another attempt owns the key,
    /// this run's answer will not be stored (the client gets 409). Check it before side
    /// effects in a long handler, and stop.
    #[must_use]
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }
}

/// A third of the time left on the lease as of `now`, at least [`MIN_PERIOD`].
pub(crate) fn period(lease: &Lease, now: Timestamp) -> Duration {
    (lease.lease_until().saturating_duration_since(now) / 3).max(MIN_PERIOD)
}

/// One heartbeat; `false` when the beating should stop (the lease is lost).
pub(crate) fn beat<S: IdempotencyStore + ?Sized>(
    store: &S,
    twin: &mut Lease,
    watch: &LeaseWatch,
) -> bool {
    match store.heartbeat(twin) {
        Ok(_) => true,
        Err(Error::LeaseLost) => {
            watch.mark_lost();
            false
        }
        // A storage error: the lease still runs; try again next period.
        Err(_) => true,
    }
}

#[derive(Default)]
struct Stop {
    stopped: Mutex<bool>,
    changed: Condvar,
}

/// Sets the stop flag when dropped: after the handler returns or while it unwinds.
struct StopOnDrop<'a>(&'a Stop);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        *self.0.stopped.lock() = true;
        self.0.changed.notify_all();
    }
}

/// Runs `work` while a thread heartbeats `twin` every `period`; the thread stops (and is
/// joined) when `work` returns or unwinds.
pub(crate) fn run_beating<S, T>(
    store: &S,
    mut twin: Lease,
    period: Duration,
    watch: &LeaseWatch,
    work: impl FnOnce() -> T,
) -> T
where
    S: IdempotencyStore + ?Sized,
{
    let stop = Stop::default();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut stopped = stop.stopped.lock();
            // The flag is checked before each wait: the handler may have returned before
            // this thread first took the lock, and its notification is then long gone.
            while !*stopped {
                let _ = stop.changed.wait_for(&mut stopped, period);
                if *stopped {
                    return;
                }
                // Not under the lock: the handler may finish meanwhile.
                let go_on = parking_lot::MutexGuard::unlocked(&mut stopped, || {
                    beat(store, &mut twin, watch)
                });
                if !go_on {
                    return;
                }
            }
        });
        let _guard = StopOnDrop(&stop);
        work()
    })
}
