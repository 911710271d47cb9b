//! The overlay's generations: how many records and bytes the active one collects before it
//! is handed to the flush thread, scaled by the log's size or set for a store in memory.

/// How many records the overlay's active generation collects before it is handed to the
/// flush thread (see `flush`), per MiB of log. Each redb commit copies every page it touches,
/// and a new key lands on a leaf of its own: 128-record generations wrote more than a page per
/// record, whose pages redb keeps until the next merge, and the flushes' writes to the store
/// file slowed the log's `O_DSYNC` writes at 64 threads (BENCHMARKS.md, "Figures behind the
/// defaults"). A claim and its completion that meet in one generation reach redb once. A
/// generation is also bounded by the log: at a switch of its halves everything logged is
/// merged, so a larger log gets larger generations (see [`Generation`]).
pub(crate) const OVERLAY_RECORDS: usize = 1024;

/// The same limit in bytes of keys and records, per MiB of log: 1024 records of 1 MiB
/// responses would hold 1 GiB in each generation. 4 MiB is about 10,000 ordinary records, so
/// the record limit decides for them and this one only for large responses.
pub(crate) const OVERLAY_BYTES: usize = 4 << 20;

/// How many expired records sweeps may delete without a log entry (see
/// `Tables::delete_expired`) between two merges, per MiB of log. Such deletions fill no log,
/// so without a bound a store that only sweeps would never merge: redb reuses the pages that
/// commits without a sync free from its last durable state only after a durable commit, and
/// its file would grow by every page the sweep's flushes copied. Each merge syncs what the
/// flushes since the last wrote, while claims' log writes queue behind it, so the bound is
/// many generations: sweeps merge far less often than their deletions once filled the log.
pub(crate) const UNLOGGED_DELETIONS: usize = 64 * OVERLAY_RECORDS;

/// The most MiB of log that scale a generation: past 16, a log only merges less often.
pub(crate) const GENERATION_SCALE: u64 = 16;

/// The overlay's limits for a store whose log is `log_len` bytes: [`OVERLAY_RECORDS`] and
/// [`OVERLAY_BYTES`] per MiB of log (at least one, at most [`GENERATION_SCALE`]); a store in
/// memory has limits of its own ([`Generation::in_memory`]). Larger
/// generations share more of redb's leaves among their records, so each record costs fewer
/// page copies and fewer bytes written: at 64 threads a larger log makes more pairs/s, for a
/// longer file while open (redb reuses the pages unsynced commits free only after a merge) and
/// a higher peak RSS (BENCHMARKS.md, "Figures behind the defaults").
#[derive(Clone, Copy)]
pub(crate) struct Generation {
    /// The active generation's size at which it is handed to the flush thread.
    pub(crate) records: usize,
    pub(crate) bytes: usize,
    /// The unlogged deletions after which a batch merges (see [`UNLOGGED_DELETIONS`]).
    pub(crate) unlogged: usize,
}

impl Generation {
    pub(crate) fn for_log(log_len: u64) -> Self {
        let scale = usize::try_from((log_len >> 20).clamp(1, GENERATION_SCALE)).unwrap_or(1);
        Generation {
            records: scale * OVERLAY_RECORDS,
            bytes: scale * OVERLAY_BYTES,
            unlogged: scale * UNLOGGED_DELETIONS,
        }
    }

    /// A store in memory has no log to bound its generations, so it takes the most records a
    /// log could give it, whatever its `log_size`: more of a merge's records share each of
    /// the key index's leaves, which a merge copies once each. With 1024-record generations
    /// the key index's inserts took much of the flush thread's time in a benchmark of
    /// fresh-key POSTs through the layer (BENCHMARKS.md, "Figures behind the defaults"). Its
    /// bytes grow only fourfold: the overlay holds a second copy of what redb holds in the same
    /// memory, and with large responses up to [`OVERLAY_LIMIT`] generations of it.
    pub(crate) fn in_memory() -> Self {
        Generation {
            records: GENERATION_SCALE as usize * OVERLAY_RECORDS,
            bytes: 4 * OVERLAY_BYTES,
            // Nothing is logged in memory, so nothing counts as unlogged.
            unlogged: usize::MAX,
        }
    }

    /// Whether the active generation, at `records` and `bytes`, is this many generations full.
    pub(crate) fn reached(&self, generations: usize, (records, bytes): (usize, usize)) -> bool {
        records >= generations * self.records || bytes >= generations * self.bytes
    }
}

/// Expired records deleted without a log entry since the last merge (see
/// `Tables::delete_expired`), and how many make a merge due ([`Generation::unlogged`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unlogged {
    pub(crate) count: usize,
    pub(crate) bound: usize,
}

impl Unlogged {
    pub(crate) fn add(&mut self, deleted: usize) {
        self.count = self.count.saturating_add(deleted);
    }

    pub(crate) fn due(&self) -> bool {
        self.count >= self.bound
    }

    /// A merge was handed over or committed: it covers every deletion so far.
    pub(crate) fn merged(&mut self) {
        self.count = 0;
    }
}

/// How many generations the active one may grow to while the flush thread is still busy with
/// the last, before a batch writes the overlay itself.
pub(crate) const OVERLAY_LIMIT: usize = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generations_scale_with_the_log_from_one_to_sixteen_mib() {
        let records = |log_len: u64| Generation::for_log(log_len).records;
        assert_eq!(records(16 << 10), OVERLAY_RECORDS, "a small log, the least");
        assert_eq!(records(1 << 20), OVERLAY_RECORDS);
        assert_eq!(records((8 << 20) + 1), 8 * OVERLAY_RECORDS);
        assert_eq!(records(1 << 30), 16 * OVERLAY_RECORDS, "at most 16 MiB's");
        let memory = Generation::in_memory();
        assert_eq!(
            memory.records,
            records(16 << 20),
            "as many records as the largest log's"
        );
        assert_eq!(memory.bytes, 4 * OVERLAY_BYTES, "a fourth of its bytes");
        let large = Generation::for_log(4 << 20);
        assert_eq!(large.bytes, 4 * OVERLAY_BYTES);
        assert!(!large.reached(1, (4095, 0)) && large.reached(1, (4096, 0)));
        assert!(
            !large.reached(OVERLAY_LIMIT, (16383, 0))
                && large.reached(OVERLAY_LIMIT, (0, 64 << 20))
        );
    }
}
