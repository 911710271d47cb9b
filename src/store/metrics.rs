//! The redb store's metrics: its counters with the engine's, and the background sweeper's
//! last round.

use std::time::SystemTime;

use parking_lot::Mutex;

use crate::api::metrics::EngineMetrics;
use crate::api::publish;
use crate::api::series;
use crate::api::trace;
use crate::error::Error;
use crate::store::Store;

/// What the background sweeper last did, for the store's metrics.
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

/// The redb store's own figures for [`IdempotencyStore::metrics`](crate::IdempotencyStore::metrics):
/// the engine's, the sweeper's last round and the file's size (the counters of the calls
/// come from the shared meter).
pub(super) fn engine(store: &Store) -> EngineMetrics {
    let mut engine = store.engine.metrics();
    engine.file_bytes = store
        .path()
        .and_then(|path| std::fs::metadata(path).ok())
        .map(|meta| meta.len());
    engine.sweeper_last_run = *store.sweeper.last_run.lock();
    engine
        .sweeper_last_error
        .clone_from(&store.sweeper.last_error.lock());
    publish::level(&series::OVERLAY_RECORDS, engine.overlay_records);
    publish::level(&series::OVERLAY_BYTES, engine.overlay_bytes);
    if let Some(bytes) = engine.file_bytes {
        publish::level(&series::FILE_BYTES, bytes);
    }
    engine
}
