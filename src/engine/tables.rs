//! redb's tables and how keys are laid out in them.
//!
//! A record is filed under a sequence number, handed out when its key's record first reaches
//! redb (merge by merge, and within a merge in the order of expiry, see `overlay::write`),
//! beside its stored key; an index of `(key hash, number)` finds it by key. Fresh keys so
//! append to the records table, whose last pages a merge has copied already, instead of
//! landing on a leaf of their own: filed under their hash (format 3), each fresh record cost
//! its merge a 4 KiB leaf copied, checksummed and written, and the index's 16-byte entries
//! share a leaf among hundreds (BENCHMARKS.md, "Records in claim order"). A record keeps its
//! number while it lives; a deleted record's number is not handed out again, except the
//! highest one, by the next transaction that files a record (no index entry names it then).
//!
//! The expiry index holds `(expires_at, hash)`: 16 fixed-width bytes an entry instead of the
//! time and the whole key. It is written in time order, so redb's splits leave its pages half
//! full; small entries are what keeps it small (BENCHMARKS.md, "Figures behind the defaults").
//!
//! Two keys may share a hash (by chance or by design: it is not keyed). Both have entries in
//! the key index under it, told apart by the stored key beside each record. An expiry entry
//! then stands for every record under its hash that expires at its time; removing one key's
//! entry leaves it in place while another key has that hash, and a sweep drops an entry that
//! no record claims any more. Entries never go missing, at worst one outlives its record.

use redb::{
    AccessGuard, ReadOnlyTable, ReadTransaction, ReadableTable, StorageError, Table,
    TableDefinition, TableError, TableHandle, WriteTransaction,
};

use crate::error::{Error, Result};

/// A records-table value: the stored key and the versioned record bytes.
pub(crate) type Entry = (&'static [u8], &'static [u8]);

/// Sequence number → (stored key, record bytes).
pub(crate) const RECORDS: TableDefinition<u64, Entry> =
    TableDefinition::new("idempotency_records_by_number");
/// `(key hash, sequence number)` → `()`: how a key finds its record.
pub(crate) const KEYS: TableDefinition<(u64, u64), ()> = TableDefinition::new("idempotency_keys");
/// `(expires_at_ms, key hash)` → `()`: at least one entry per record (see the module docs).
pub(crate) const EXPIRY: TableDefinition<(u64, u64), ()> =
    TableDefinition::new("idempotency_expiry");
/// Formats 3 and 4 filed records under their key's hash followed by the key; an open moves
/// them into [`RECORDS`] and [`KEYS`] ([`migrate`]).
const HASHED: TableDefinition<&[u8], &[u8]> = TableDefinition::new("idempotency_records");

pub(crate) type ExpiryTable<'a> = Table<'a, (u64, u64), ()>;

const PREFIX: usize = 8;

/// A stored key's hash in the key index and the expiry index: the first 8 bytes of its BLAKE3
/// digest, big-endian.
pub(crate) fn key_hash(stored: &[u8]) -> u64 {
    let digest = blake3::hash(stored);
    let mut first = [0u8; PREFIX];
    first.copy_from_slice(&digest.as_bytes()[..PREFIX]);
    u64::from_be_bytes(first)
}

/// A stored key and its record bytes.
pub(crate) type Filed = (Vec<u8>, Vec<u8>);

/// The records and the key index, as of one transaction.
pub(crate) struct Records<K, R> {
    keys: K,
    records: R,
    /// The next sequence number to hand out, once this transaction has needed one.
    next: Option<u64>,
}

/// The records of a write transaction.
pub(crate) type RecordsMut<'t> = Records<Table<'t, (u64, u64), ()>, Table<'t, u64, Entry>>;
/// The records of a read transaction.
pub(crate) type RecordsRead = Records<ReadOnlyTable<(u64, u64), ()>, ReadOnlyTable<u64, Entry>>;

impl<'t> RecordsMut<'t> {
    pub(crate) fn open(txn: &'t WriteTransaction) -> Result<Self, TableError> {
        Ok(Records {
            keys: txn.open_table(KEYS)?,
            records: txn.open_table(RECORDS)?,
            next: None,
        })
    }
}

impl RecordsRead {
    pub(crate) fn open(txn: &ReadTransaction) -> Result<Self, TableError> {
        Ok(Records {
            keys: txn.open_table(KEYS)?,
            records: txn.open_table(RECORDS)?,
            next: None,
        })
    }
}

impl<K, R> Records<K, R>
where
    K: ReadableTable<(u64, u64), ()>,
    R: ReadableTable<u64, Entry>,
{
    /// `stored`'s record: its number and entry.
    fn find(
        &self,
        hash: u64,
        stored: &[u8],
    ) -> Result<Option<(u64, AccessGuard<'_, Entry>)>, StorageError> {
        for number in self.keys.range((hash, 0)..=(hash, u64::MAX))? {
            let number = number?.0.value().1;
            if let Some(entry) = self.records.get(number)?
                && entry.value().0 == stored
            {
                return Ok(Some((number, entry)));
            }
        }
        Ok(None)
    }

    /// Calls `f` with `stored`'s record bytes, if it has a record.
    pub(crate) fn with<T>(
        &self,
        stored: &[u8],
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<Option<T>, StorageError> {
        Ok(self
            .find(key_hash(stored), stored)?
            .map(|(_, entry)| f(entry.value().1)))
    }

    /// `stored`'s record bytes.
    pub(crate) fn get(&self, stored: &[u8]) -> Result<Option<Vec<u8>>, StorageError> {
        self.with(stored, <[u8]>::to_vec)
    }

    /// The records under `hash`, by stored key. An index entry without its record is damage no
    /// lookup reaches (`verify` reports it); it is left out.
    pub(crate) fn under_hash(&self, hash: u64) -> Result<Vec<Filed>, StorageError> {
        let mut found = Vec::new();
        for number in self.keys.range((hash, 0)..=(hash, u64::MAX))? {
            if let Some(entry) = self.records.get(number?.0.value().1)? {
                let (key, bytes) = entry.value();
                found.push((key.to_vec(), bytes.to_vec()));
            }
        }
        Ok(found)
    }

    /// Whether a key other than `stored` has a record under `hash`.
    fn hash_shared(&self, hash: u64, stored: &[u8]) -> Result<bool, StorageError> {
        Ok(self.under_hash(hash)?.iter().any(|(key, _)| key != stored))
    }

    /// The records table, in order of number.
    pub(crate) fn records(&self) -> &R {
        &self.records
    }

    /// The key index.
    pub(crate) fn keys(&self) -> &K {
        &self.keys
    }
}

impl RecordsMut<'_> {
    /// Files `bytes` as `stored`'s record, under the number it has or a new one. Returns the
    /// length of the record it replaces.
    pub(crate) fn put(
        &mut self,
        stored: &[u8],
        bytes: &[u8],
    ) -> Result<Option<usize>, StorageError> {
        let hash = key_hash(stored);
        let old = self
            .find(hash, stored)?
            .map(|(number, entry)| (number, entry.value().1.len()));
        let number = match old {
            Some((number, _)) => number,
            None => {
                let number = self.next_number()?;
                self.keys.insert((hash, number), ())?;
                number
            }
        };
        self.records.insert(number, (stored, bytes))?;
        Ok(old.map(|(_, len)| len))
    }

    /// Deletes `stored`'s record. Returns its length.
    pub(crate) fn remove(&mut self, stored: &[u8]) -> Result<Option<usize>, StorageError> {
        let hash = key_hash(stored);
        let Some((number, len)) = self
            .find(hash, stored)?
            .map(|(number, entry)| (number, entry.value().1.len()))
        else {
            return Ok(None);
        };
        self.keys.remove((hash, number))?;
        self.records.remove(number)?;
        Ok(Some(len))
    }

    fn next_number(&mut self) -> Result<u64, StorageError> {
        let next = match self.next {
            Some(next) => next,
            None => self.records.last()?.map_or(0, |(n, _)| n.value()) + 1,
        };
        self.next = Some(next + 1);
        Ok(next)
    }
}

/// Files `stored` under `expires_at` in the index.
pub(crate) fn index(
    expiry: &mut ExpiryTable<'_>,
    expires_at: u64,
    stored: &[u8],
) -> Result<(), StorageError> {
    expiry.insert((expires_at, key_hash(stored)), ())?;
    Ok(())
}

/// Takes `stored`'s entry at `expires_at` out of the index, unless another key with the same
/// hash has a record (which may expire then too; a sweep drops the entry if none does).
pub(crate) fn unindex<K, R>(
    expiry: &mut ExpiryTable<'_>,
    records: &Records<K, R>,
    expires_at: u64,
    stored: &[u8],
) -> Result<(), StorageError>
where
    K: ReadableTable<(u64, u64), ()>,
    R: ReadableTable<u64, Entry>,
{
    let hash = key_hash(stored);
    if !records.hash_shared(hash, stored)? {
        expiry.remove((expires_at, hash))?;
    }
    Ok(())
}

/// Creates the records tables, and moves the records of a format-3 or 4 file into them, in
/// `txn`: all or, if it does not commit, none. Returns how many moved.
pub(crate) fn create_or_migrate(txn: &WriteTransaction) -> Result<u64> {
    let mut records = RecordsMut::open(txn)?;
    let hashed = txn.list_tables()?.any(|t| t.name() == HASHED.name());
    if !hashed {
        return Ok(0);
    }
    let mut moved = 0;
    {
        let old = txn.open_table(HASHED)?;
        for filed in old.iter()? {
            let (key, bytes) = filed?;
            let stored = stored_key(key.value()).ok_or_else(|| {
                Error::corrupted(format!(
                    "moving records to format 5: the record {:?} is filed under a hash that is \
                     not its key's (the previous release's `verify` reports it)",
                    String::from_utf8_lossy(key.value())
                ))
            })?;
            if records.put(stored, bytes.value())?.is_some() {
                return Err(Error::corrupted(
                    "moving records to format 5: a key is filed twice",
                ));
            }
            moved += 1;
        }
    }
    txn.delete_table(HASHED)?;
    Ok(moved)
}

/// The stored key inside a format-3 records-table key, if the prefix is that key's hash.
fn stored_key(filed: &[u8]) -> Option<&[u8]> {
    let (prefix, stored) = filed.split_at_checked(PREFIX)?;
    (prefix == key_hash(stored).to_be_bytes()).then_some(stored)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::backends::InMemoryBackend;
    use redb::{Database, ReadableDatabase, ReadableTableMetadata};

    /// Two keys that share a hash, as a collision would file them: `b` is filed under `a`'s.
    fn collide(records: &mut RecordsMut<'_>) -> Result<(), redb::Error> {
        records.put(b"\0a", b"1")?;
        let number = records.next_number()?;
        records.keys.insert((key_hash(b"\0a"), number), ())?;
        records.records.insert(number, (&b"\0b"[..], &b"2"[..]))?;
        Ok(())
    }

    #[test]
    fn an_entry_shared_by_two_keys_stays_until_neither_has_a_record() -> Result<(), redb::Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut records = RecordsMut::open(&txn)?;
            let mut expiry = txn.open_table(EXPIRY)?;
            collide(&mut records)?;
            index(&mut expiry, 7, b"\0a")?;
            unindex(&mut expiry, &records, 7, b"\0a")?;
            assert_eq!(expiry.len()?, 1, "b has the hash too");
            let hash = key_hash(b"\0a");
            records.keys.remove((hash, 2))?;
            records.records.remove(2)?;
            unindex(&mut expiry, &records, 7, b"\0a")?;
            assert_eq!(expiry.len()?, 0);
            assert_eq!(records.under_hash(hash)?.len(), 1);
        }
        txn.commit()?;
        Ok(())
    }

    #[test]
    fn keys_sharing_a_hash_keep_their_own_records() -> Result<(), redb::Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut records = RecordsMut::open(&txn)?;
            collide(&mut records)?;
            assert_eq!(records.get(b"\0a")?, Some(b"1".to_vec()));
            assert_eq!(records.put(b"\0a", b"one")?, Some(1));
            assert_eq!(records.get(b"\0a")?, Some(b"one".to_vec()));
            assert_eq!(
                records.records.get(2)?.map(|e| e.value().1.to_vec()),
                Some(b"2".to_vec())
            );
            assert_eq!(records.remove(b"\0a")?, Some(3));
            assert_eq!(records.get(b"\0a")?, None);
            assert_eq!(
                records.records.get(2)?.map(|e| e.value().0.to_vec()),
                Some(b"\0b".to_vec())
            );
            assert_eq!(records.keys.len()?, 1);
        }
        txn.commit()?;
        Ok(())
    }

    #[test]
    fn records_are_numbered_in_the_order_their_keys_first_got_one() -> Result<(), redb::Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        for keys in [[b"\0x", b"\0a"], [b"\0x", b"\0m"]] {
            let txn = db.begin_write()?;
            let mut records = RecordsMut::open(&txn)?;
            for key in keys {
                records.put(key, key)?;
            }
            drop(records);
            txn.commit()?;
        }
        let txn = db.begin_read()?;
        let records = RecordsRead::open(&txn)?;
        let order: Vec<(u64, Vec<u8>)> = records
            .records()
            .iter()?
            .map(|e| e.map(|(n, v)| (n.value(), v.value().0.to_vec())))
            .collect::<Result<_, _>>()?;
        assert_eq!(
            order,
            [
                (1, b"\0x".to_vec()),
                (2, b"\0a".to_vec()),
                (3, b"\0m".to_vec())
            ]
        );
        Ok(())
    }

    #[test]
    fn a_format_3_table_moves_whole_and_goes() -> Result<(), Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut old = txn.open_table(HASHED)?;
            for key in [&b"\0a"[..], b"\0b", b"\0c"] {
                let filed = [&key_hash(key).to_be_bytes()[..], key].concat();
                old.insert(filed.as_slice(), key)?;
            }
        }
        assert_eq!(create_or_migrate(&txn)?, 3);
        assert!(!txn.list_tables()?.any(|t| t.name() == HASHED.name()));
        let records = RecordsMut::open(&txn)?;
        for key in [&b"\0a"[..], b"\0b", b"\0c"] {
            assert_eq!(records.get(key)?.as_deref(), Some(key));
        }
        drop(records);
        assert_eq!(create_or_migrate(&txn)?, 0, "nothing left to move");
        Ok(())
    }

    #[test]
    fn a_format_3_record_under_a_wrong_hash_stops_the_move() -> Result<(), Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        txn.open_table(HASHED)?
            .insert(&b"12345678\0a"[..], &b"1"[..])?;
        let err = create_or_migrate(&txn).expect_err("a wrong hash");
        assert!(
            matches!(&err, Error::Corrupted { reason } if reason.contains("\\0a") || reason.contains("12345678")),
            "{err:?}"
        );
        Ok(())
    }
}
