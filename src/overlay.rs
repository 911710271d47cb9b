//! Changes that the log has made durable but redb's tables do not hold yet.
//!
//! A redb commit, even without a sync, copies every page a batch touches, checksums them and
//! writes new roots: the biggest part of the group-commit leader's serial work, and the leader
//! is what limits throughput with many threads (BENCHMARKS.md). So a batch of claims and
//! settlements applies to this overlay instead of to redb: its changes go to the log and, once
//! synced, into the overlay, where readers look first. A checkpoint (the log is full), a batch
//! that must scan the tables (a sweep, a store with quotas), an effect of `complete_with`, or
//! a reader that walks the tables writes the overlay into redb in one transaction and empties
//! it. The overlay therefore never holds more than the log since its last checkpoint.
//!
//! Readers look here first and then in redb; writers hold the writer lock, so the overlay only
//! changes under it.

use std::collections::HashMap;

use redb::WriteTransaction;

use crate::error::Result;
use crate::ops::{EXPIRY, RECORDS};

#[derive(Debug, Default)]
pub(crate) struct Overlay {
    /// Stored key → record bytes, `None` where the record was deleted.
    records: HashMap<Vec<u8>, Option<Vec<u8>>>,
    /// Expiry-index entries `(due second, stored key)`: added (true) or removed (false).
    index: HashMap<(u64, Vec<u8>), bool>,
}

impl Overlay {
    /// What the overlay knows of `key`: `None` if nothing (look in redb), `Some(None)` if the
    /// record was deleted.
    pub(crate) fn record(&self, key: &[u8]) -> Option<Option<&[u8]>> {
        self.records.get(key).map(Option::as_deref)
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.records.is_empty() && self.index.is_empty()
    }

    pub(crate) fn set_record(&mut self, key: &[u8], record: Option<Vec<u8>>) {
        self.records.insert(key.to_vec(), record);
    }

    pub(crate) fn set_index(&mut self, due: u64, key: &[u8], present: bool) {
        self.index.insert((due, key.to_vec()), present);
    }

    /// Takes in `newer` (a committed batch's changes), which win over the overlay's own.
    pub(crate) fn absorb(&mut self, newer: Overlay) {
        self.records.extend(newer.records);
        self.index.extend(newer.index);
    }

    /// Writes the overlay into redb's tables in `txn`. The overlay keeps its contents until
    /// the caller has committed and calls `clear`, so that readers never miss a change.
    pub(crate) fn write_to(&self, txn: &WriteTransaction) -> Result<()> {
        if self.is_empty() {
            return Ok(());
        }
        let mut records = txn.open_table(RECORDS)?;
        for (key, record) in &self.records {
            match record {
                Some(bytes) => drop(records.insert(key.as_slice(), bytes.as_slice())?),
                None => drop(records.remove(key.as_slice())?),
            }
        }
        let mut expiry = txn.open_table(EXPIRY)?;
        for ((due, key), &present) in &self.index {
            if present {
                drop(expiry.insert((*due, key.as_slice()), ())?);
            } else {
                drop(expiry.remove((*due, key.as_slice()))?);
            }
        }
        Ok(())
    }

    pub(crate) fn clear(&mut self) {
        self.records.clear();
        self.index.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_changes_win_and_deletions_are_remembered() {
        let mut overlay = Overlay::default();
        overlay.set_record(b"a", Some(b"1".to_vec()));
        overlay.set_record(b"b", Some(b"2".to_vec()));
        let mut batch = Overlay::default();
        batch.set_record(b"a", None);
        batch.set_record(b"b", Some(b"3".to_vec()));
        overlay.absorb(batch);
        assert_eq!(overlay.record(b"a"), Some(None));
        assert_eq!(overlay.record(b"b"), Some(Some(&b"3"[..])));
        assert_eq!(overlay.record(b"c"), None);
        overlay.clear();
        assert!(overlay.is_empty());
    }
}
