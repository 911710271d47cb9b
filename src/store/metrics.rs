//! `Store::metrics`: the store's counters with the engine's, and the background sweeper's
//! last round.

use std::time::SystemTime;

use parking_lot::Mutex;

use crate::api::metrics::Metrics;
use crate::api::publish;
use crate::api::series;
use crate::api::trace;
use crate::error::Error;
use crate::store::Store;
use crate::store::builder::StoreBuilder;

/// What the background sweeper last did, for [`Store::metrics`].
#[derive(Debug, Default)]
pub(crate) struct SweeperState {
    last_run: Mutex<Option<SystemTime>>,
    last_error: Mutex<Option<String>>,
}

impl SweeperState {
    /// A round finished: every expired record due was deleted.
    pub(crate) fn ran(&self) {
        *self.last_run.lock() = Some(SystemTime::now());
    }

    /// A round failed with `err`; the sweeper retries after a backoff.
    pub(crate) fn failed(&self, err: &Error) {
        trace::sweeper_failed(err);
        *self.last_error.lock() = Some(err.to_string());
    }
}

impl StoreBuilder {
    /// Whether `tracing` events (feature `tracing`) may show keys. Keys can be personal data,
    /// so by default events say `<hidden>` instead. Defaults to false.
    pub fn trace_keys(&mut self, show: bool) -> &mut Self {
        self.settings.trace_keys = show;
        self
    }
}

impl Store {
    /// What this store has done since it was opened: claims by outcome, settling calls,
    /// errors by kind, latencies, and the engine's batches, log writes and merges. Cheap: it
    /// reads counters (and the file's size) and walks no table; for counts of records by
    /// state use [`stats`](Store::stats).
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, Key, Response, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("order-1")?;
    /// let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["a"]))? else { panic!() };
    /// store.complete(&lease, Response::new(201, "created"))?;
    /// let _ = store.claim(&key, Fingerprint::of(["a"]))?;
    /// let metrics = store.metrics();
    /// assert_eq!((metrics.claims.acquired, metrics.claims.replayed, metrics.completes), (1, 1, 1));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    #[must_use]
    pub fn metrics(&self) -> Metrics {
        let mut engine = self.engine.metrics();
        engine.file_bytes = self
            .path()
            .and_then(|path| std::fs::metadata(path).ok())
            .map(|meta| meta.len());
        engine.sweeper_last_run = *self.sweeper.last_run.lock();
        engine
            .sweeper_last_error
            .clone_from(&self.sweeper.last_error.lock());
        publish::level(&series::OVERLAY_RECORDS, engine.overlay_records);
        publish::level(&series::OVERLAY_BYTES, engine.overlay_bytes);
        if let Some(bytes) = engine.file_bytes {
            publish::level(&series::FILE_BYTES, bytes);
        }
        Metrics {
            engine: Some(engine),
            ..self.metrics.snapshot()
        }
    }
}
