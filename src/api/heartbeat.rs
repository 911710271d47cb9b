//! Heartbeats: a lease extended in the background while its operation runs, so that a live
//! operation of any length keeps its key and only a dead one's lease lapses.

use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::api::clock::Timestamp;
use crate::api::outcome::Lease;
use crate::error::{Error, Result};

/// The call that extends a lease: a store's `heartbeat`. A function, not the store, so that
/// this file needs nothing of the store's trait, which runs heartbeats in `execute`.
pub(crate) type Extend<'a> = &'a (dyn Fn(&mut Lease) -> Result<Timestamp> + Sync);

/// The shortest heartbeat period, so that a tiny lease does not turn into a busy loop.
const MIN_PERIOD: Duration = Duration::from_millis(10);

/// A third of the time left on the lease as of `now`, at least [`MIN_PERIOD`]: two beats
/// may fail or come late before the lease lapses.
pub(crate) fn period(lease: &Lease, now: Timestamp) -> Duration {
    (lease.lease_until().saturating_duration_since(now) / 3).max(MIN_PERIOD)
}

/// One heartbeat; `false` when the beating should stop (the lease is lost, and `lost` has
/// been called).
pub(crate) fn beat(extend: Extend<'_>, twin: &mut Lease, lost: &(dyn Fn() + Sync)) -> bool {
    match extend(twin) {
        Ok(_) => true,
        Err(Error::LeaseLost) => {
            lost();
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

/// Sets the stop flag when dropped: after the work returns or while it unwinds.
struct StopOnDrop<'a>(&'a Stop);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        *self.0.stopped.lock() = true;
        self.0.changed.notify_all();
    }
}

/// Runs `work` while a thread heartbeats `twin` every `period`; the thread stops (and is
/// joined) when `work` returns or unwinds, or after calling `lost`.
pub(crate) fn run_beating<T>(
    extend: Extend<'_>,
    mut twin: Lease,
    period: Duration,
    lost: &(dyn Fn() + Sync),
    work: impl FnOnce() -> T,
) -> T {
    let stop = Stop::default();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let mut stopped = stop.stopped.lock();
            // The flag is checked before each wait: the work may have returned before this
            // thread first took the lock, and its notification is then long gone.
            while !*stopped {
                let _ = stop.changed.wait_for(&mut stopped, period);
                if *stopped {
                    return;
                }
                // Not under the lock: the work may finish meanwhile.
                let go_on = parking_lot::MutexGuard::unlocked(&mut stopped, || {
                    beat(extend, &mut twin, lost)
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
