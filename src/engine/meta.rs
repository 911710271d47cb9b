//! The meta table: the store format version, the fencing-token counter, the clock's
//! high-water mark, the usage counters and how far the log is applied.

use redb::{ReadableTable, Table, TableDefinition, WriteTransaction};
use serde::{Deserialize, Serialize};

use crate::engine::contain::from_storage;
use crate::error::Error;

/// Format version, the fencing-token counter, the clock's high-water mark and usage counters.
pub(crate) const META: TableDefinition<&str, u64> = TableDefinition::new("idempotency_meta");

pub(crate) const META_FORMAT: &str = "format_version";
/// The layout of the tables and the record format they hold (each record also carries its own
/// version byte). 3: records filed under their key's hash, the expiry index by `(time, hash)`.
/// 5: records filed in claim order with a key index (see `tables`); an open moves a format-3
/// file's records (one transaction, see `tables::create_or_migrate`).
pub(crate) const STORE_FORMAT: u64 = 5;
/// [`STORE_FORMAT`] with effect rows waiting in the `kept` table for an open that registers
/// their table: a build that does not know that table would never apply them, so it must
/// refuse the file.
pub(crate) const KEPT_FORMAT: u64 = 6;
/// Format 3, and format 3 with kept effect rows: read by moving their records.
pub(crate) const HASHED_FORMATS: [u64; 2] = [3, 4];
pub(crate) const META_NEXT_TOKEN: &str = "next_token";
pub(crate) const META_CLOCK: &str = "clock_high_water_ms";
pub(crate) const META_RECORDS: &str = "record_count";
pub(crate) const META_BYTES: &str = "record_bytes";
/// The last write-ahead log entry that a durable commit covers (see `wal`).
pub(crate) const META_LOG_SEQ: &str = "log_applied_seq";

/// The metadata values a batch sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Counter {
    NextToken,
    Clock,
    Records,
    Bytes,
}

impl Counter {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Counter::NextToken => META_NEXT_TOKEN,
            Counter::Clock => META_CLOCK,
            Counter::Records => META_RECORDS,
            Counter::Bytes => META_BYTES,
        }
    }
}

/// What the records table holds: record count, and bytes of stored keys plus record values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub records: u64,
    pub bytes: u64,
}

impl Usage {
    pub(crate) fn replaced(&mut self, key: usize, new: usize, old: Option<usize>) {
        self.removed(key, old);
        // Saturating: a damaged counter must not overflow (verify reports the mismatch).
        self.records = self.records.saturating_add(1);
        self.bytes = self.bytes.saturating_add((key + new) as u64);
    }

    pub(crate) fn removed(&mut self, key: usize, old: Option<usize>) {
        if let Some(old) = old {
            self.records = self.records.saturating_sub(1);
            self.bytes = self.bytes.saturating_sub((key + old) as u64);
        }
    }
}

/// The counters of the meta table. They live in memory between merges: a batch logs the
/// token counter and the clock when it changes them (`Change::Counter`) and only a merge
/// writes them to the table, so that most commits leave the meta table out (a tree fewer to
/// rewrite per commit). The usage counters are not logged: a sweep deletes expired records
/// without a trace in the log, so a logged count could not match the records a replay leaves;
/// the replay counts what it writes instead (see `redo`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub next_token: u64,
    /// The clock's high-water mark (ms).
    pub clock: u64,
    pub usage: Usage,
}

impl Counters {
    pub(crate) fn load(meta: &Table<'_, &'static str, u64>) -> Result<Counters, Error> {
        let stored = |k| -> Result<u64, Error> {
            Ok(meta
                .get(k)
                .map_err(|e| from_storage("reading the metadata", e))?
                .map_or(0, |v| v.value()))
        };
        Ok(Counters {
            next_token: stored(META_NEXT_TOKEN)?.max(1),
            clock: stored(META_CLOCK)?,
            usage: Usage {
                records: stored(META_RECORDS)?,
                bytes: stored(META_BYTES)?,
            },
        })
    }

    pub(crate) fn save(&self, meta: &mut Table<'_, &'static str, u64>) -> Result<(), Error> {
        for (counter, value) in self.values() {
            meta.insert(counter.name(), value)
                .map_err(|e| from_storage("writing the metadata", e))?;
        }
        Ok(())
    }

    /// Makes `txn` a merge: it writes these counters and records that the log is applied
    /// up to entry `seq` (and, with `quick_repair`, redb's allocator state).
    pub(crate) fn merge(
        &self,
        txn: &mut WriteTransaction,
        seq: u64,
        quick_repair: bool,
    ) -> Result<(), Error> {
        txn.set_quick_repair(quick_repair);
        let mut meta = txn.open_table(META)?;
        self.save(&mut meta)?;
        meta.insert(META_LOG_SEQ, seq)
            .map_err(|e| from_storage("writing the metadata", e))?;
        Ok(())
    }

    /// The logged counters (the token counter and the clock) that differ from `before`, with
    /// their new values, for the log.
    pub(crate) fn changed_since(&self, before: &Counters) -> impl Iterator<Item = (Counter, u64)> {
        self.values()
            .into_iter()
            .zip(before.values())
            .filter(|((counter, _), _)| matches!(counter, Counter::NextToken | Counter::Clock))
            .filter(|(now, then)| now != then)
            .map(|(now, _)| now)
    }

    fn values(&self) -> [(Counter, u64); 4] {
        [
            (Counter::NextToken, self.next_token),
            (Counter::Clock, self.clock),
            (Counter::Records, self.usage.records),
            (Counter::Bytes, self.usage.bytes),
        ]
    }
}
