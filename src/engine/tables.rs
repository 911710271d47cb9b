//! redb's tables and how keys are laid out in them.
//!
//! A record is filed under a sequence number, handed out when its key's record first reaches
//! redb (merge by merge, and within a merge in the order of expiry, see `apply::write`),
//! beside its stored key; an index of `(key hash, number)` finds it by key. Fresh keys so
//! append to the records table, whose last pages a merge has copied already, instead of
//! landing on a leaf of their own: filed under their hash (format 3), each fresh record cost
//! its merge a 4 KiB leaf copied, checksummed and written, and the index's 16-byte entries
//! share a leaf among hundreds (BENCHMARKS.md, "Figures behind the defaults"). A record keeps its
//! number while it lives; a deleted record's number is not handed out again, unless no record
//! with a higher number is left when a transaction next files one (no index entry names it
//! then).
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

use crate::error::Result;

/// A records-table value: the stored key's length (`u16`, big-endian), the stored key and the
/// versioned record bytes. Plain bytes rather than a redb tuple, whose decoding trusts its
/// length prefix: a damaged one would panic inside redb instead of failing with an error.
pub(crate) type Entry = &'static [u8];

/// Sequence number → stored key and record bytes (see [`Entry`]).
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

/// The records-table value of `stored`'s record `bytes`. A stored key is at most 511 bytes
/// (`Key`), so its length fits.
fn entry(stored: &[u8], bytes: &[u8]) -> Vec<u8> {
    let len = u16::try_from(stored.len()).unwrap_or(u16::MAX);
    let mut out = Vec::with_capacity(2 + stored.len() + bytes.len());
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(stored);
    out.extend_from_slice(bytes);
    out
}

/// The stored key and record bytes of record `number`'s value.
pub(crate) fn split(number: u64, value: &[u8]) -> Result<(&[u8], &[u8]), StorageError> {
    let parts = value
        .split_first_chunk::<2>()
        .and_then(|(len, rest)| rest.split_at_checked(usize::from(u16::from_be_bytes(*len))));
    parts.ok_or_else(|| {
        StorageError::Corrupted(format!(
            "record {number}: its stored key's length runs past the value's {} bytes",
            value.len()
        ))
    })
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
                && split(number, entry.value())?.0 == stored
            {
                return Ok(Some((number, entry)));
            }
        }
        Ok(None)
    }

    /// The number of `stored`'s record.
    pub(crate) fn number(&self, stored: &[u8]) -> Result<Option<u64>, StorageError> {
        Ok(self
            .find(key_hash(stored), stored)?
            .map(|(number, _)| number))
    }

    /// Calls `f` with `stored`'s record bytes, if it has a record.
    pub(crate) fn with<T>(
        &self,
        stored: &[u8],
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<Option<T>, StorageError> {
        match self.find(key_hash(stored), stored)? {
            Some((number, entry)) => Ok(Some(f(split(number, entry.value())?.1))),
            None => Ok(None),
        }
    }

    /// `stored`'s record bytes.
    pub(crate) fn get(&self, stored: &[u8]) -> Result<Option<Vec<u8>>, StorageError> {
        self.with(stored, <[u8]>::to_vec)
    }

    /// The records under `hash`, by stored key. An index entry without its record, or with a
    /// value whose key cannot be read, is damage (`verify` reports it; a lookup of a key under
    /// the hash fails on the latter); it is left out, so that a sweep drops the expiry entry
    /// and goes on.
    pub(crate) fn under_hash(&self, hash: u64) -> Result<Vec<Filed>, StorageError> {
        let mut found = Vec::new();
        for number in self.keys.range((hash, 0)..=(hash, u64::MAX))? {
            let number = number?.0.value().1;
            if let Some(entry) = self.records.get(number)?
                && let Ok((key, bytes)) = split(number, entry.value())
            {
                found.push((key.to_vec(), bytes.to_vec()));
            }
        }
        Ok(found)
    }

    /// Whether a key other than `stored` has a record under `hash`.
    fn hash_shared(&self, hash: u64, stored: &[u8]) -> Result<bool, StorageError> {
        for number in self.keys.range((hash, 0)..=(hash, u64::MAX))? {
            let number = number?.0.value().1;
            if let Some(entry) = self.records.get(number)?
                && split(number, entry.value())?.0 != stored
            {
                return Ok(true);
            }
        }
        Ok(false)
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
        self.put_hashed(key_hash(stored), stored, bytes)
    }

    /// [`put`](Self::put), for a key whose [`key_hash`] is `hash`.
    pub(crate) fn put_hashed(
        &mut self,
        hash: u64,
        stored: &[u8],
        bytes: &[u8],
    ) -> Result<Option<usize>, StorageError> {
        let old = match self.find(hash, stored)? {
            Some((number, entry)) => Some((number, split(number, entry.value())?.1.len())),
            None => None,
        };
        let number = match old {
            Some((number, _)) => number,
            None => {
                let number = self.next_number()?;
                self.keys.insert((hash, number), ())?;
                number
            }
        };
        self.records
            .insert(number, entry(stored, bytes).as_slice())?;
        Ok(old.map(|(_, len)| len))
    }

    /// Deletes `stored`'s record. Returns its length.
    pub(crate) fn remove(&mut self, stored: &[u8]) -> Result<Option<usize>, StorageError> {
        let hash = key_hash(stored);
        let Some((number, entry)) = self.find(hash, stored)? else {
            return Ok(None);
        };
        let len = split(number, entry.value())?.1.len();
        drop(entry);
        self.keys.remove((hash, number))?;
        self.records.remove(number)?;
        Ok(Some(len))
    }

    /// Takes `stored`'s entry out of the key index and leaves its record for
    /// [`remove_numbers`](Self::remove_numbers), so that a merge can delete records in the
    /// order of their numbers. Returns the record's number, and whether the key was the only
    /// one with an entry under `hash`.
    pub(crate) fn unfile(
        &mut self,
        hash: u64,
        stored: &[u8],
    ) -> Result<Option<(u64, bool)>, StorageError> {
        let (mut mine, mut others) = (None, false);
        for number in self.keys.range((hash, 0)..=(hash, u64::MAX))? {
            let number = number?.0.value().1;
            match self.records.get(number)? {
                Some(entry) if mine.is_none() && split(number, entry.value())?.0 == stored => {
                    mine = Some(number);
                }
                _ => others = true,
            }
        }
        let Some(number) = mine else {
            return Ok(None);
        };
        self.keys.remove((hash, number))?;
        Ok(Some((number, !others)))
    }

    /// Deletes the records [`unfile`](Self::unfile) left, `numbers` in ascending order.
    pub(crate) fn remove_numbers(&mut self, numbers: &[u64]) -> Result<(), StorageError> {
        for &number in numbers {
            self.records.remove(number)?;
        }
        Ok(())
    }

    fn next_number(&mut self) -> Result<u64, StorageError> {
        let next = match self.next {
            Some(next) => Some(next),
            None => self
                .records
                .last()?
                .map_or(Some(1), |(n, _)| n.value().checked_add(1)),
        };
        // Only a damaged file gets there: numbers grow by one a record.
        let after = next.and_then(|n| n.checked_add(1)).ok_or_else(|| {
            StorageError::Corrupted("the records table holds a record numbered u64::MAX".into())
        })?;
        self.next = Some(after);
        Ok(after - 1)
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

/// What [`create_or_migrate`] moved, and what it left out.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Moved {
    pub records: u64,
    /// Records filed under a hash that was not their key's: no lookup reached them, and the
    /// earlier release's `verify` reported each. Their count and bytes (as the usage counters
    /// count them) leave the counters with them.
    pub dropped: u64,
    pub dropped_bytes: u64,
}

/// Creates the records tables, and if `hashed` (a format-3 or 4 file) moves the records of the
/// old table into them, in `txn`: all or, if it does not commit, none.
pub(crate) fn create_or_migrate(txn: &WriteTransaction, hashed: bool) -> Result<Moved> {
    let mut records = RecordsMut::open(txn)?;
    let mut moved = Moved::default();
    if !hashed || !txn.list_tables()?.any(|t| t.name() == HASHED.name()) {
        return Ok(moved);
    }
    {
        let old = txn.open_table(HASHED)?;
        for filed in old.iter()? {
            let (key, bytes) = filed?;
            match stored_key(key.value()) {
                Some(stored) => {
                    records.put(stored, bytes.value())?;
                    moved.records += 1;
                }
                None => {
                    moved.dropped += 1;
                    let len = key.value().len().saturating_sub(PREFIX) + bytes.value().len();
                    moved.dropped_bytes += len as u64;
                }
            }
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
    use crate::error::Error;
    use redb::backends::InMemoryBackend;
    use redb::{Database, ReadableDatabase, ReadableTableMetadata};

    /// Two keys that share a hash, as a collision would file them: `b` is filed under `a`'s.
    fn collide(records: &mut RecordsMut<'_>) -> Result<(), redb::Error> {
        records.put(b"\0a", b"1")?;
        let number = records.next_number()?;
        records.keys.insert((key_hash(b"\0a"), number), ())?;
        records
            .records
            .insert(number, entry(b"\0b", b"2").as_slice())?;
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
                records.records.get(2)?.map(|e| e.value()[4..].to_vec()),
                Some(b"2".to_vec())
            );
            assert_eq!(records.remove(b"\0a")?, Some(3));
            assert_eq!(records.get(b"\0a")?, None);
            assert_eq!(
                records.records.get(2)?.map(|e| e.value()[2..4].to_vec()),
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
            .map(|e| e.map(|(n, v)| (n.value(), v.value()[2..4].to_vec())))
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
        assert_eq!(create_or_migrate(&txn, true)?.records, 3);
        assert!(!txn.list_tables()?.any(|t| t.name() == HASHED.name()));
        let records = RecordsMut::open(&txn)?;
        for key in [&b"\0a"[..], b"\0b", b"\0c"] {
            assert_eq!(records.get(key)?.as_deref(), Some(key));
        }
        drop(records);
        assert_eq!(
            create_or_migrate(&txn, true)?,
            Moved::default(),
            "nothing left"
        );
        Ok(())
    }

    #[test]
    fn a_format_3_record_under_a_wrong_hash_is_left_out_and_counted() -> Result<(), Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut old = txn.open_table(HASHED)?;
            old.insert(&b"12345678\0a"[..], &b"123"[..])?;
            let filed = [&key_hash(b"\0b").to_be_bytes()[..], b"\0b"].concat();
            old.insert(filed.as_slice(), &b"1"[..])?;
        }
        let moved = create_or_migrate(&txn, true)?;
        let expected = Moved {
            records: 1,
            dropped: 1,
            dropped_bytes: 5,
        };
        assert_eq!(moved, expected);
        assert_eq!(RecordsMut::open(&txn)?.get(b"\0a")?, None);
        Ok(())
    }

    #[test]
    fn a_table_of_the_old_name_in_a_format_5_file_is_left_alone() -> Result<(), Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        txn.open_table(HASHED)?
            .insert(&b"12345678\0a"[..], &b"1"[..])?;
        assert_eq!(create_or_migrate(&txn, false)?, Moved::default());
        assert!(txn.list_tables()?.any(|t| t.name() == HASHED.name()));
        Ok(())
    }

    #[test]
    fn a_damaged_value_is_an_error_not_a_panic() -> Result<(), redb::Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        let mut records = RecordsMut::open(&txn)?;
        records.put(b"\0a", b"1")?;
        records.records.insert(1, &[0xff, 0xff, 0, b'a'][..])?;
        let err = records.get(b"\0a").expect_err("a damaged length");
        assert!(
            matches!(&err, StorageError::Corrupted(r) if r.contains("record 1")),
            "{err:?}"
        );
        records.records.insert(u64::MAX, &entry(b"\0z", b"2")[..])?;
        drop(records);
        // A transaction's first new record looks up the highest number.
        let mut records = RecordsMut::open(&txn)?;
        assert!(matches!(
            records.put(b"\0b", b"3"),
            Err(StorageError::Corrupted(_))
        ));
        Ok(())
    }
}
