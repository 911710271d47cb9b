//! Deleting expired records: bounded sweeps, and an opt-in background sweeper.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::api::backend::SWEEP_BATCH;
use crate::error::{Error, Result};
use crate::store::Store;

impl Store {
    /// Deletes up to `limit` expired records, oldest expiry first, in one bounded write
    /// transaction, and returns how many it deleted. Records that expire in the same
    /// millisecond go in key-hash order, so a sweep reads at most `limit` index entries
    /// (`docs/design.md`, "Sweep").
    ///
    /// # Errors
    /// [`Error::Storage`] if the transaction fails (nothing is deleted then).
    pub fn sweep(&self, limit: usize) -> Result<usize> {
        self.sweep_batch(limit).map(|(deleted, _)| deleted)
    }

    /// One sweep transaction: records deleted, and whether expired entries may remain.
    fn sweep_batch(&self, limit: usize) -> Result<(usize, bool)> {
        let _span = crate::api::trace::enter!("sweep", "redb");
        if limit == 0 {
            return Ok((0, false));
        }
        let swept = self.engine.sweep(limit)?;
        self.metrics
            .swept(u64::try_from(swept.deleted).unwrap_or(u64::MAX));
        Ok((swept.deleted, swept.more))
    }

    /// Deletes every expired record, in transactions of [`SWEEP_BATCH`](crate::SWEEP_BATCH) so
    /// that other writers get the writer between them. Returns the total deleted.
    ///
    /// # Errors
    /// As for [`sweep`](Store::sweep); records deleted by earlier batches stay deleted.
    pub fn sweep_all(&self) -> Result<u64> {
        let mut total = 0;
        loop {
            let (deleted, more) = self.sweep_batch(SWEEP_BATCH)?;
            total += deleted as u64;
            if !more {
                return Ok(total);
            }
        }
    }

    /// Starts a background thread that sweeps expired records every `interval`, in
    /// transactions of at most `batch` records, giving the writer back to claims between
    /// transactions. Never started implicitly.
    ///
    /// The returned [`Sweeper`] stops and joins the thread when dropped;
    /// [`Sweeper::stop`] does the same and reports the first error the thread met (the thread
    /// stops at its first error).
    ///
    /// ```
    /// use std::{sync::Arc, time::Duration};
    /// use idempotency_store::Store;
    ///
    /// let store = Arc::new(Store::builder().open_in_memory()?);
    /// let sweeper = store.start_sweeper(Duration::from_secs(60), 1024);
    /// let swept = sweeper.stop()?;
    /// assert_eq!(swept, 0);
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    #[must_use = "dropping the Sweeper stops it"]
    pub fn start_sweeper(self: &Arc<Self>, interval: Duration, batch: usize) -> Sweeper {
        let signal = Arc::new(Signal::default());
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

#[derive(Default)]
struct Signal {
    stopped: Mutex<bool>,
    wake: Condvar,
}

fn sweep_loop(store: &Store, signal: &Signal, interval: Duration, batch: usize) -> Result<u64> {
    let mut total = 0;
    loop {
        loop {
            if *signal.stopped.lock() {
                return Ok(total);
            }
            let (deleted, more) = store
                .sweep_batch(batch)
                .inspect_err(|err| store.sweeper.failed(err))?;
            total += deleted as u64;
            if !more {
                break;
            }
        }
        store.sweeper.ran();
        let mut stopped = signal.stopped.lock();
        if !*stopped {
            signal.wake.wait_for(&mut stopped, interval);
        }
        if *stopped {
            return Ok(total);
        }
    }
}

/// A running background sweeper, from [`Store::start_sweeper`]. Dropping it stops and joins
/// the thread.
#[derive(Debug)]
pub struct Sweeper {
    signal: Arc<Signal>,
    thread: Option<Result<JoinHandle<Result<u64>>>>,
}

impl std::fmt::Debug for Signal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signal").finish_non_exhaustive()
    }
}

impl Sweeper {
    /// Stops the sweeper, waits for its thread, and returns how many records it deleted.
    ///
    /// # Errors
    /// The error that stopped the thread early, if any ([`Error::Storage`] if the thread could
    /// not be started or panicked).
    pub fn stop(mut self) -> Result<u64> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<u64> {
        *self.signal.stopped.lock() = true;
        self.signal.wake.notify_all();
        match self.thread.take() {
            Some(Ok(handle)) => handle.join().unwrap_or_else(|_| {
                Err(Error::storage(
                    "sweeping",
                    std::io::Error::other("the sweeper thread panicked"),
                ))
            }),
            Some(Err(err)) => Err(err),
            None => Ok(0),
        }
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        // Drop cannot report; `stop` is the way to see the error.
        let _ = self.shutdown();
    }
}
