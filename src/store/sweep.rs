//! Deleting expired records: bounded sweeps, and an opt-in background sweeper.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::api::backend::Swept;
use crate::api::backoff;
use crate::api::store::counted_sweep;
use crate::error::{Error, Result};
use crate::store::Store;

impl Store {
    /// Deletes at most `limit` records, in steps that ride claims' batches. Records that
    /// expire in the same millisecond go in key-hash order, so a step reads at most its own
    /// number of index entries (`docs/design.md`, "Sweep").
    pub(crate) fn sweep_round(&self, limit: usize) -> Result<Swept> {
        if limit == 0 {
            return Ok(Swept {
                deleted: 0,
                more: false,
            });
        }
        let swept = self.engine.sweep(limit)?;
        Ok(Swept {
            deleted: swept.deleted,
            more: swept.more,
        })
    }

    /// Starts a background thread that sweeps expired records every `interval`, in rounds
    /// of at most `batch` records, each in steps that ride claims' batches (as `sweep_all`).
    /// `start_sweeper(Duration::from_secs(60), 1024)` keeps claims inside their targets
    /// during a mass expiry without tuning (BENCHMARKS.md, "Sweep, space, recovery"). Never
    /// started implicitly.
    ///
    /// A failed sweep does not end the thread: it retries after a backoff that starts at
    /// 10 ms and doubles up to `interval`, and [`Sweeper::last_error`] and
    /// [`Sweeper::errors`] show what it met. A poisoned store keeps failing until it is
    /// reopened, so a sweeper that keeps reporting [`Error::Poisoned`] calls for a reopen.
    ///
    /// On a store opened read-only no thread starts: [`Sweeper::last_error`] and
    /// [`Sweeper::stop`] give [`Error::ReadOnly`].
    ///
    /// The returned [`Sweeper`] stops and joins the thread when dropped; [`Sweeper::stop`]
    /// does the same and reports the outcome.
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotency_store::Store;
    ///
    /// let store = Arc::new(Store::builder().open_in_memory()?);
    /// let sweeper = store.start_sweeper(Duration::from_secs(60), 1024);
    /// assert!(sweeper.last_error().is_none());
    /// let swept = sweeper.stop()?;
    /// assert_eq!(swept, 0);
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    #[must_use = "dropping the Sweeper stops it"]
    pub fn start_sweeper(self: &Arc<Self>, interval: Duration, batch: usize) -> Sweeper {
        let signal = Arc::new(Signal::default());
        if let Err(err) = self.engine.writable() {
            // Every sweep would fail: no thread, and the error where the sweeper shows its own.
            signal.health.lock().last_error = Some(err.clone());
            return Sweeper {
                signal,
                thread: Some(Err(err)),
            };
        }
        let store = Arc::clone(self);
        let thread_signal = Arc::clone(&signal);
        let thread = std::thread::Builder::new()
            .name("idempotency-sweeper".into())
            .spawn(move || sweep_loop(&store, &thread_signal, interval, batch.max(1)));
        Sweeper {
            signal,
            thread: Some(thread.map_err(|e| Error::storage("starting the sweeper thread", e))),
        }
    }
}

/// The first wait after a failed sweep; it doubles with each failure in a row, up to the
/// sweeper's interval.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);

#[derive(Default)]
struct Signal {
    stopped: Mutex<bool>,
    wake: Condvar,
    /// The error of the last sweep if it failed (`None` once one succeeds), and the number
    /// of failed sweeps.
    health: Mutex<Health>,
}

#[derive(Default)]
struct Health {
    last_error: Option<Error>,
    errors: u64,
}

impl Signal {
    /// Waits up to `pause` or until stopped; true if stopped.
    fn rest(&self, pause: Duration) -> bool {
        let mut stopped = self.stopped.lock();
        if !*stopped {
            self.wake.wait_for(&mut stopped, pause);
        }
        *stopped
    }
}

fn sweep_loop(store: &Store, signal: &Signal, interval: Duration, batch: usize) -> u64 {
    let mut total = 0;
    let mut backoff = backoff::doubling(FIRST_BACKOFF.min(interval), interval);
    loop {
        if *signal.stopped.lock() {
            return total;
        }
        let pause = match counted_sweep(store, batch) {
            Ok(Swept { deleted, more }) => {
                total += deleted as u64;
                signal.health.lock().last_error = None;
                backoff = backoff::doubling(FIRST_BACKOFF.min(interval), interval);
                if more {
                    continue;
                }
                store.sweeper.ran();
                interval
            }
            Err(err) => {
                store.sweeper.failed(&err);
                let mut health = signal.health.lock();
                health.last_error = Some(err);
                health.errors += 1;
                backoff.next().unwrap_or(interval)
            }
        };
        if signal.rest(pause) {
            return total;
        }
    }
}

/// A running background sweeper, from [`Store::start_sweeper`]. Dropping it stops and joins
/// the thread.
#[derive(Debug)]
pub struct Sweeper {
    signal: Arc<Signal>,
    thread: Option<Result<JoinHandle<u64>>>,
}

impl std::fmt::Debug for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signal").finish_non_exhaustive()
    }
}

impl Sweeper {
    /// The error of the sweeper's last sweep, if it failed; `None` once a sweep succeeds
    /// again. The thread goes on retrying (see [`Store::start_sweeper`]).
    #[must_use]
    pub fn last_error(&self) -> Option<Error> {
        self.signal.health.lock().last_error.clone()
    }

    /// How many of the sweeper's sweeps have failed since it started.
    #[must_use]
    pub fn errors(&self) -> u64 {
        self.signal.health.lock().errors
    }

    /// Stops the sweeper, waits for its thread, and returns how many records it deleted.
    ///
    /// # Errors
    /// The error of the last sweep, if it failed; [`Error::Storage`] if the thread could not
    /// be started or panicked.
    pub fn stop(mut self) -> Result<u64> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<u64> {
        *self.signal.stopped.lock() = true;
        self.signal.wake.notify_all();
        let deleted = match self.thread.take() {
            Some(Ok(handle)) => handle.join().map_err(|_| {
                Error::storage(
                    "sweeping",
                    std::io::Error::other("the sweeper thread panicked"),
                )
            })?,
            Some(Err(err)) => return Err(err),
            None => 0,
        };
        match self.last_error() {
            Some(err) => Err(err),
            None => Ok(deleted),
        }
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        // Drop cannot report; `stop` and `last_error` are the ways to see the error.
        let _ = self.shutdown();
    }
}
