//! The engine's own counters (batches, log writes, merges), kept in atomics so that
//! `Store::metrics` reads them without taking the writer's lock.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::api::metrics::EngineMetrics;
use crate::api::publish;
use crate::api::series;
use crate::api::trace;

/// Counters updated by the batch leader and the flush thread.
#[derive(Debug, Default)]
pub(crate) struct EngineStats {
    batches: AtomicU64,
    batched_ops: AtomicU64,
    max_batch: AtomicU64,
    log_writes: AtomicU64,
    merges: AtomicU64,
    last_merge_ns: AtomicU64,
    max_merge_ns: AtomicU64,
    sweep_ns: AtomicU64,
    sweep_paced_ns: AtomicU64,
}

fn nanos(elapsed: Duration) -> u64 {
    u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
}

impl EngineStats {
    /// A batch of `ops` write calls is about to run.
    pub(crate) fn batch(&self, ops: usize) {
        let ops = u64::try_from(ops).unwrap_or(u64::MAX);
        trace::batch(usize::try_from(ops).unwrap_or(usize::MAX));
        self.batches.fetch_add(1, Relaxed);
        self.batched_ops.fetch_add(ops, Relaxed);
        publish::count(&series::BATCHES, 1);
        publish::count(&series::BATCHED_OPS, ops);
        self.max_batch.fetch_max(ops, Relaxed);
    }

    /// An entry went into the write-ahead log.
    pub(crate) fn log_write(&self) {
        self.log_writes.fetch_add(1, Relaxed);
        publish::count(&series::LOG_WRITES, 1);
    }

    /// A merge that started at `started` committed.
    pub(crate) fn merged(&self, started: Instant) -> Duration {
        let elapsed = started.elapsed();
        self.merges.fetch_add(1, Relaxed);
        self.last_merge_ns.store(nanos(elapsed), Relaxed);
        self.max_merge_ns.fetch_max(nanos(elapsed), Relaxed);
        publish::count(&series::MERGES, 1);
        publish::time(&series::MERGE_SECONDS, elapsed);
        trace::merged(elapsed);
        elapsed
    }

    /// A sweep call took `elapsed`.
    pub(crate) fn swept(&self, elapsed: Duration) {
        self.sweep_ns.fetch_add(nanos(elapsed), Relaxed);
    }

    /// A sweep step waited `elapsed` for the flush thread.
    pub(crate) fn paced(&self, elapsed: Duration) {
        self.sweep_paced_ns.fetch_add(nanos(elapsed), Relaxed);
    }

    /// The counters now; the caller fills in what the engine does not count itself.
    pub(crate) fn snapshot(&self) -> EngineMetrics {
        EngineMetrics {
            batches: self.batches.load(Relaxed),
            batched_ops: self.batched_ops.load(Relaxed),
            max_batch: self.max_batch.load(Relaxed),
            log_writes: self.log_writes.load(Relaxed),
            merges: self.merges.load(Relaxed),
            last_merge: Duration::from_nanos(self.last_merge_ns.load(Relaxed)),
            max_merge: Duration::from_nanos(self.max_merge_ns.load(Relaxed)),
            sweep_time: Duration::from_nanos(self.sweep_ns.load(Relaxed)),
            sweep_paced: Duration::from_nanos(self.sweep_paced_ns.load(Relaxed)),
            ..EngineMetrics::default()
        }
    }
}
