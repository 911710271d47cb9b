//! What the engine needs of the store's settings, as the store's builder hands it over.

use std::sync::Arc;

use crate::api::clock::Clock;
use crate::engine::batch::Quota;
use crate::engine::effects::Registry;
use crate::engine::kept::Unregistered;

/// What the engine needs of the store's settings.
#[derive(Clone)]
pub(crate) struct Config {
    pub lease_ms: u64,
    pub retention_ms: u64,
    /// The most write calls in one group commit.
    pub max_batch: usize,
    /// Whether merges are two-phase redb commits with quick repair.
    pub quick_repair: bool,
    /// `None`: no quota, so batches may run layered.
    pub quota: Option<Quota>,
    /// redb's page cache, in bytes.
    pub cache_size: usize,
    /// The log size of a new file, in bytes.
    pub log_size: u64,
    pub clock: Arc<dyn Clock>,
    /// Whether opening a missing file creates it.
    pub create_if_missing: bool,
    /// The log handle syncs with `sync_data` rather than `O_DSYNC` (see
    /// `log_handle::open_log_writer`).
    pub portable_log_sync: bool,
    /// The caller's tables that effects write.
    pub effects: Arc<Registry>,
    /// Opened read-only: every write call is refused and the close merges nothing (see
    /// `open::open_read_only`).
    pub read_only: bool,
    /// What the open does with the log's rows of effect tables not in `effects` (see `kept`).
    pub unregistered: Unregistered,
    /// The storage is memory (`open_in_memory`): a batch never waits for I/O, so an async
    /// caller leads its batch on its own thread (see `Committer::enqueue_inline`), and a
    /// layered batch writes no log entry (see `write_layered`).
    pub in_memory: bool,
}
