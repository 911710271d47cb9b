//! The tables as one write batch sees them, in two kinds that are different types:
//!
//! - [`Direct`]: redb's tables in a write transaction, begun after the overlay was flushed into
//!   them. Scans of the expiry index (sweeps, making room under a quota) exist only here.
//! - [`Layered`]: redb's records as of the last commit, the overlay over them, and the batch's
//!   own changes over both (see `overlay`). Nothing can scan here, so a batch that may scan
//!   cannot be written against it.
//!
//! Every mutation goes through [`Tables`], which keeps the usage counters and the changes for
//! the write-ahead log, so that none escapes the log.

use std::cell::RefCell;

use redb::WriteTransaction;

use crate::api::clock::Timestamp;
use crate::api::key::Key;
use crate::api::record::{Record, State};
use crate::engine::contain::from_storage;
use crate::engine::effects::{ReadRows, Registry, Row};
use crate::engine::meta::Usage;
use crate::engine::overlay::{self, Overlay, Shared};
use crate::engine::snapshot::{Snapshot, Snapshots};
use crate::engine::tables::{self, EXPIRY, ExpiryTable, RecordsMut};
use crate::engine::wal::Change;
use crate::error::Error;

/// Why an operation failed: on its own (the batch goes on), or for the whole batch. Each site
/// says which: a storage error may leave the shared transaction half-written, so it fails the
/// batch (the `From` below); an operation's own failure must be marked `Fail::Op`.
#[derive(Debug)]
pub(crate) enum Fail {
    Op(Error),
    Batch(Error),
}

impl From<redb::StorageError> for Fail {
    fn from(err: redb::StorageError) -> Self {
        Fail::Batch(from_storage("writing a batch", err))
    }
}

/// The time and settings one batch works with, and the token counter it advances.
pub(crate) struct Ctx {
    pub now: Timestamp,
    pub lease_ms: u64,
    pub retention_ms: u64,
    pub next_token: u64,
}

/// Storage limits for new claims (see `StoreBuilder::max_records`). A store with a quota
/// writes every batch directly: making room scans the expiry index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Quota {
    pub max_records: Option<u64>,
    pub max_bytes: Option<u64>,
    pub evict_completed: bool,
}

impl Quota {
    /// The limit that one more record would break, if any.
    pub(crate) fn exceeded(&self, usage: Usage) -> Option<Error> {
        let over = |used: u64, max: Option<u64>, limit| {
            max.filter(|&max| used >= max)
                .map(|max| Error::QuotaExceeded { limit, used, max })
        };
        over(usage.records, self.max_records, "max_records")
            .or_else(|| over(usage.bytes, self.max_bytes, "max_bytes"))
    }
}

/// redb's tables in a write transaction, and the store's quota if it has one.
pub(crate) struct Direct<'a> {
    txn: &'a WriteTransaction,
    registry: &'a Registry,
    pub records: RecordsMut<'a>,
    pub expiry: ExpiryTable<'a>,
    pub quota: Option<Quota>,
}

/// redb's records as of a snapshot, the shared overlay, and this batch's own changes.
pub(crate) struct Layered<'a> {
    snapshot: &'a Snapshot,
    overlay: &'a Shared,
    batch: Overlay,
    /// The last key read or written, its hash and its record's length: a write call reads its
    /// key, then writes it, and the write needs the old length, which would otherwise cost the
    /// same lookups again (two hashes and a copy of the record, or a descent of redb's tree).
    last: RefCell<Option<Last>>,
}

/// See [`Layered::last`].
struct Last {
    key: Vec<u8>,
    hash: u64,
    len: Option<usize>,
}

/// Reading and writing one key's record and index entry, whichever the kind of batch.
pub(crate) trait Access {
    /// The key's record bytes.
    fn bytes(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Fail>;
    /// Like `bytes`, for a key that a read found absent from redb at the snapshot counter
    /// `absent_at` (see `ops::ClaimKey::absent_at`).
    fn bytes_unless_absent(
        &self,
        key: &[u8],
        absent_at: Option<u64>,
    ) -> Result<Option<Vec<u8>>, Fail> {
        let _ = absent_at;
        self.bytes(key)
    }
    /// Like `bytes`, for a key a sweep found holding `scanned` in redb at the snapshot counter
    /// `at` (see `sweep::Scan`).
    fn bytes_as_scanned(
        &self,
        key: &[u8],
        at: u64,
        scanned: &[u8],
    ) -> Result<Option<Vec<u8>>, Fail> {
        let _ = (at, scanned);
        self.bytes(key)
    }
    /// Sets (or with `None` deletes) the key's record bytes; returns the old length.
    fn set(&mut self, key: &[u8], record: Option<&[u8]>) -> Result<Option<usize>, Fail>;
    /// Files (`present`) or unfiles the key under `expires_at` in the expiry index.
    fn set_index(&mut self, expires_at: u64, key: &[u8], present: bool) -> Result<(), Fail>;
    /// The tables registered for effects.
    fn registry(&self) -> &Registry;
    /// The value bytes of `key` in the effect table at `table`.
    fn effect_bytes(&self, table: usize, key: &[u8]) -> Result<Option<Vec<u8>>, Error>;
    /// Applies an effect's row.
    fn set_effect(&mut self, row: &Row) -> Result<(), Fail>;
    /// Makes room for one more record under the batch's quota, or fails closed; see
    /// `ops::make_room`. A layered batch has no quota.
    fn make_room(tables: &mut Tables<Self>, now: Timestamp) -> Result<(), Fail>
    where
        Self: Sized;
}

/// The tables of a batch, their usage counters, and the changes made so far.
pub(crate) struct Tables<A> {
    pub(crate) access: A,
    pub usage: Usage,
    pub changes: Vec<Change>,
    /// Whether the changes are collected for the log (see [`unlogged`](Tables::unlogged)).
    pub logged: bool,
    /// Expired records deleted without a change for a log the batch writes (see
    /// [`delete_expired`](Tables::delete_expired)).
    pub expired_unlogged: usize,
}

impl<A> Tables<A> {
    fn new(access: A) -> Self {
        Tables {
            access,
            usage: Usage::default(),
            changes: Vec::new(),
            logged: true,
            expired_unlogged: 0,
        }
    }

    /// Collects no changes: for a batch that writes no log entry (a store in memory), which
    /// then copies no keys or records for one.
    pub(crate) fn unlogged(mut self) -> Self {
        self.logged = false;
        self
    }

    /// Records a change for the log, if the batch has one.
    fn log(&mut self, change: impl FnOnce() -> Change) {
        if self.logged {
            self.changes.push(change());
        }
    }
}

impl<'a> Tables<Direct<'a>> {
    /// The tables of the write transaction `txn`, under `quota`.
    pub(crate) fn direct(
        txn: &'a WriteTransaction,
        registry: &'a Registry,
        quota: Option<Quota>,
    ) -> Result<Self, Error> {
        Ok(Self::new(Direct {
            txn,
            registry,
            records: RecordsMut::open(txn)?,
            expiry: txn.open_table(EXPIRY)?,
            quota,
        }))
    }

    /// Drops a stale index entry. Only scans find those.
    pub(crate) fn drop_entry(&mut self, expires_at: u64, hash: u64) -> Result<(), Fail> {
        self.access.expiry.remove((expires_at, hash))?;
        self.log(|| Change::DropEntry { expires_at, hash });
        Ok(())
    }
}

impl Layered<'_> {
    /// Remembers `key` (whose hash is `hash`) with its record's length as this batch now sees
    /// it (see `last`).
    fn remember(&self, key: &[u8], hash: u64, len: Option<usize>) {
        let mut last = self.last.borrow_mut();
        match &mut *last {
            Some(kept) if kept.key == key => kept.len = len,
            _ => {
                *last = Some(Last {
                    key: key.to_vec(),
                    hash,
                    len,
                })
            }
        }
    }

    /// The key's record bytes as this batch sees them. `seen` is what a read outside the
    /// batch found in redb (`None`: absent) at a snapshot counter: taken as it is if redb has
    /// not changed since and the overlay knows nothing of the key.
    fn bytes_seen(
        &self,
        key: &[u8],
        seen: Option<(u64, Option<&[u8]>)>,
    ) -> Result<Option<Vec<u8>>, Fail> {
        let hash = overlay::key_hash(key);
        let known = match self.batch.record_hashed(key, hash) {
            Some(known) => Some(known.map(<[u8]>::to_vec)),
            None => self
                .overlay
                .with_record_hashed(key, hash, |known| known.map(<[u8]>::to_vec)),
        };
        let bytes = match (known, seen) {
            (Some(known), _) => known,
            // The batch's snapshot is current under the writer lock: the same counter means
            // redb has not changed under the overlay since the read saw the key.
            (None, Some((at, seen))) if at == Snapshots::epoch(self.snapshot) => {
                seen.map(<[u8]>::to_vec)
            }
            (None, _) => self.snapshot.records.get(key)?,
        };
        self.remember(key, hash, bytes.as_ref().map(Vec::len));
        Ok(bytes)
    }
}

impl<'a> Tables<Layered<'a>> {
    /// The records of `snapshot` under `overlay`; the batch's changes go into `batch`, an
    /// empty overlay (see `Writer::batch`).
    pub(crate) fn layered(snapshot: &'a Snapshot, overlay: &'a Shared, batch: Overlay) -> Self {
        Self::new(Layered {
            snapshot,
            overlay,
            batch,
            last: RefCell::new(None),
        })
    }

    /// The batch's changes, for the overlay once the batch is durable.
    pub(crate) fn into_batch(self) -> Overlay {
        self.access.batch
    }
}

impl Access for Direct<'_> {
    fn bytes(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Fail> {
        Ok(self.records.get(key)?)
    }

    fn set(&mut self, key: &[u8], record: Option<&[u8]>) -> Result<Option<usize>, Fail> {
        Ok(match record {
            Some(bytes) => self.records.put(key, bytes)?,
            None => self.records.remove(key)?,
        })
    }

    fn set_index(&mut self, expires_at: u64, key: &[u8], present: bool) -> Result<(), Fail> {
        if present {
            tables::index(&mut self.expiry, expires_at, key)?;
        } else {
            tables::unindex(&mut self.expiry, &self.records, expires_at, key)?;
        }
        Ok(())
    }

    fn registry(&self) -> &Registry {
        self.registry
    }

    fn effect_bytes(&self, table: usize, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.registry.table(table)?.get_in(self.txn, key)
    }

    fn set_effect(&mut self, row: &Row) -> Result<(), Fail> {
        let table = self.registry.table(row.table).map_err(Fail::Batch)?;
        table
            .write(self.txn, &[(&row.key, row.value.as_deref())])
            .map_err(Fail::Batch)
    }

    fn make_room(tables: &mut Tables<Self>, now: Timestamp) -> Result<(), Fail> {
        match tables.access.quota {
            Some(quota) => tables.make_room(quota, now),
            None => Ok(()),
        }
    }
}

impl Access for Layered<'_> {
    fn bytes(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Fail> {
        self.bytes_unless_absent(key, None)
    }

    fn bytes_unless_absent(
        &self,
        key: &[u8],
        absent_at: Option<u64>,
    ) -> Result<Option<Vec<u8>>, Fail> {
        self.bytes_seen(key, absent_at.map(|at| (at, None)))
    }

    fn bytes_as_scanned(
        &self,
        key: &[u8],
        at: u64,
        scanned: &[u8],
    ) -> Result<Option<Vec<u8>>, Fail> {
        self.bytes_seen(key, Some((at, Some(scanned))))
    }

    fn set(&mut self, key: &[u8], record: Option<&[u8]>) -> Result<Option<usize>, Fail> {
        let remembered = match &*self.last.borrow() {
            Some(last) if last.key == key => Some((last.hash, last.len)),
            _ => None,
        };
        let (hash, old) = match remembered {
            Some(known) => known,
            None => (overlay::key_hash(key), self.bytes(key)?.map(|b| b.len())),
        };
        self.batch.set_record_hashed(key, hash, record);
        self.remember(key, hash, record.map(<[u8]>::len));
        Ok(old)
    }

    fn set_index(&mut self, expires_at: u64, key: &[u8], present: bool) -> Result<(), Fail> {
        self.batch.set_index(expires_at, key, present);
        Ok(())
    }

    fn registry(&self) -> &Registry {
        self.overlay.registry()
    }

    fn effect_bytes(&self, table: usize, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        let at = overlay::effect_key(table, key);
        let known = match self.batch.effect(&at) {
            Some(known) => Some(known.map(<[u8]>::to_vec)),
            None => self
                .overlay
                .with_effect(&at, |known| known.map(<[u8]>::to_vec)),
        };
        match known {
            Some(known) => Ok(known),
            None => self
                .registry()
                .table(table)?
                .get_at(&self.snapshot.txn, key),
        }
    }

    fn set_effect(&mut self, row: &Row) -> Result<(), Fail> {
        let at = overlay::effect_key(row.table, &row.key);
        self.batch.set_effect(&at, row.value.as_deref());
        Ok(())
    }

    fn make_room(_: &mut Tables<Self>, _: Timestamp) -> Result<(), Fail> {
        Ok(())
    }
}

impl<A: Access> ReadRows for Tables<A> {
    fn row(&self, table: usize, key: &[u8]) -> Result<Option<Vec<u8>>, Error> {
        self.access.effect_bytes(table, key)
    }
}

impl<A: Access> Tables<A> {
    pub(crate) fn get(&self, key: &Key) -> Result<Option<Record>, Fail> {
        self.get_unless_absent(key, None)
    }

    /// Like `get`, for a key a read found absent at the snapshot counter `absent_at`.
    pub(crate) fn get_unless_absent(
        &self,
        key: &Key,
        absent_at: Option<u64>,
    ) -> Result<Option<Record>, Fail> {
        match self
            .access
            .bytes_unless_absent(key.as_stored(), absent_at)?
        {
            Some(bytes) => Record::decode(key.as_stored(), &bytes)
                .map(Some)
                .map_err(Fail::Op),
            None => Ok(None),
        }
    }

    /// Writes `record`, moving its expiry entry from `old_expires_at` if it had one and the
    /// time changed.
    pub(crate) fn put(
        &mut self,
        key: &Key,
        old_expires_at: Option<u64>,
        record: &Record,
    ) -> Result<(), Fail> {
        let bytes = record.encode(key.as_stored()).map_err(Fail::Op)?;
        let k = key.as_stored();
        let new = record.expires_at;
        if old_expires_at != Some(new) {
            if let Some(old) = old_expires_at {
                self.unindex(old, k)?;
            }
            self.access.set_index(new, k, true)?;
            self.log(|| Change::Index {
                expires_at: new,
                key: k.to_vec(),
            });
        }
        let old = self.access.set(k, Some(&bytes))?;
        self.usage.replaced(k.len(), bytes.len(), old);
        self.log(|| Change::Put {
            key: k.to_vec(),
            record: bytes,
        });
        Ok(())
    }

    pub(crate) fn delete(&mut self, key: &[u8], expires_at: u64) -> Result<(), Fail> {
        self.unindex(expires_at, key)?;
        let old = self.access.set(key, None)?;
        self.usage.removed(key.len(), old);
        self.log(|| Change::Delete { key: key.to_vec() });
        Ok(())
    }

    /// Deletes a record that expired at or before the batch's time, filed at `expires_at`,
    /// with no change for the log: lost in a crash, the record comes back still expired (the
    /// batch logs its time), answers no call, and a later sweep deletes it again. A sweep's
    /// deletions so take no room in the log, whose filling forces the merges that claims
    /// then queue behind. The log entries that meet such a record at the next open are
    /// redone over it (see `redo`).
    pub(crate) fn delete_expired(&mut self, key: &[u8], expires_at: u64) -> Result<(), Fail> {
        self.access.set_index(expires_at, key, false)?;
        let old = self.access.set(key, None)?;
        self.usage.removed(key.len(), old);
        if self.logged {
            self.expired_unlogged += 1;
        }
        Ok(())
    }

    /// Writes an effect's row, and logs it by its table's name (positions are the overlay's).
    pub(crate) fn set_effect(&mut self, row: Row) -> Result<(), Fail> {
        self.access.set_effect(&row)?;
        let table = self
            .access
            .registry()
            .table(row.table)
            .map_err(Fail::Batch)?;
        let table = table.name().to_owned();
        self.log(|| Change::Effect {
            table,
            key: row.key,
            value: row.value,
        });
        Ok(())
    }

    fn unindex(&mut self, expires_at: u64, key: &[u8]) -> Result<(), Fail> {
        self.access.set_index(expires_at, key, false)?;
        self.log(|| Change::Unindex {
            expires_at,
            key: key.to_vec(),
        });
        Ok(())
    }

    /// The record if `token` still holds it; otherwise the lease is lost.
    pub(crate) fn held(&self, key: &Key, token: u64, now: Timestamp) -> Result<Record, Fail> {
        match self.get(key)? {
            Some(record)
                if !record.is_expired(now)
                    && matches!(record.state, State::InProgress { token: t, .. } if t == token) =>
            {
                Ok(record)
            }
            _ => Err(Fail::Op(Error::LeaseLost)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::engine::snapshot::Snapshots;
    use crate::engine::snapshot::tests::db;

    /// `set` takes the old length from the last read or write of the key when it can; it must
    /// be the length the batch sees, also for writes with no read between them.
    #[test]
    fn a_layered_set_reports_the_length_the_batch_sees() -> Result<(), Fail> {
        let (db, snapshots) = (db(), Snapshots::default());
        let snapshot = snapshots.get(&db).map_err(Fail::Batch)?;
        let overlay = Shared::new(Arc::new(Registry::default()));
        let mut tables = Tables::layered(&snapshot, &overlay, Overlay::default());
        let access = &mut tables.access;
        assert_eq!(access.set(b"k", Some(b"abc"))?, None);
        assert_eq!(access.set(b"k", Some(b"abcdef"))?, Some(3));
        assert_eq!(access.set(b"other", Some(b"xy"))?, None);
        assert_eq!(access.set(b"k", None)?, Some(6));
        assert_eq!(access.bytes(b"k")?, None);
        assert_eq!(access.bytes(b"other")?, Some(b"xy".to_vec()));
        assert_eq!(access.set(b"other", Some(b"x"))?, Some(2));
        Ok(())
    }
}
