//! redb's tables and how keys are laid out in them.
//!
//! A record is stored under its key's 8-byte hash followed by the key, and the expiry index
//! holds `(expires_at, hash)`: 16 fixed-width bytes an entry instead of the time and the whole
//! key. The index is written in time order, so redb's splits leave its pages half full; small
//! entries are what keeps it small (BENCHMARKS.md, "Figures behind the defaults"). The prefix
//! costs each record 8 bytes and makes the records with one hash a short range of the table,
//! which is how a sweep finds an entry's record.
//!
//! Two keys may share a hash (by chance or by design: it is not keyed). An entry then stands
//! for every record under its hash that expires at its time; removing one key's entry leaves
//! it in place while another key has that hash, and a sweep drops an entry that no record
//! claims any more. Entries never go missing, at worst one outlives its record.

use redb::{ReadableTable, StorageError, Table, TableDefinition};

/// Hash-prefixed stored key (see [`record_key`]) → versioned record bytes.
pub(crate) const RECORDS: TableDefinition<&[u8], &[u8]> =
    TableDefinition::new("idempotency_records");
/// `(expires_at_ms, key hash)` → `()`: at least one entry per record (see the module docs).
pub(crate) const EXPIRY: TableDefinition<(u64, u64), ()> =
    TableDefinition::new("idempotency_expiry");

pub(crate) type ExpiryTable<'a> = Table<'a, (u64, u64), ()>;

const PREFIX: usize = 8;

/// The hash a stored key is filed under: the first 8 bytes of its BLAKE3 digest, big-endian,
/// so that the prefix bytes sort as the number does.
pub(crate) fn key_hash(stored: &[u8]) -> u64 {
    let digest = blake3::hash(stored);
    let mut first = [0u8; PREFIX];
    first.copy_from_slice(&digest.as_bytes()[..PREFIX]);
    u64::from_be_bytes(first)
}

/// The records table's key for the stored key `stored`.
pub(crate) fn record_key(stored: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(PREFIX + stored.len());
    out.extend_from_slice(&key_hash(stored).to_be_bytes());
    out.extend_from_slice(stored);
    out
}

/// The stored key inside a records-table key, if the prefix is that key's hash.
pub(crate) fn stored_key(record_key: &[u8]) -> Option<&[u8]> {
    let (prefix, stored) = record_key.split_at_checked(PREFIX)?;
    (prefix == key_hash(stored).to_be_bytes()).then_some(stored)
}

/// A records-table entry: the hash-prefixed key and the record bytes.
pub(crate) type Filed = (Vec<u8>, Vec<u8>);

/// The records under `hash`.
pub(crate) fn under_hash(
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    hash: u64,
) -> Result<Vec<Filed>, StorageError> {
    let prefix = hash.to_be_bytes();
    let mut found = Vec::new();
    for entry in records.range(&prefix[..]..)? {
        let (key, value) = entry?;
        if !key.value().starts_with(&prefix) {
            break;
        }
        found.push((key.value().to_vec(), value.value().to_vec()));
    }
    Ok(found)
}

/// Whether a key other than `stored` is filed under `hash`.
fn hash_shared(
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    hash: u64,
    stored: &[u8],
) -> Result<bool, StorageError> {
    let prefix = hash.to_be_bytes();
    for entry in records.range(&prefix[..]..)? {
        let key = entry?.0;
        match key.value().split_at_checked(PREFIX) {
            Some((p, other)) if p == prefix => {
                if other != stored {
                    return Ok(true);
                }
            }
            _ => return Ok(false),
        }
    }
    Ok(false)
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
pub(crate) fn unindex(
    expiry: &mut ExpiryTable<'_>,
    records: &impl ReadableTable<&'static [u8], &'static [u8]>,
    expires_at: u64,
    stored: &[u8],
) -> Result<(), StorageError> {
    let hash = key_hash(stored);
    if !hash_shared(records, hash, stored)? {
        expiry.remove((expires_at, hash))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use redb::backends::InMemoryBackend;
    use redb::{Database, ReadableTableMetadata};

    #[test]
    fn record_keys_carry_their_hash_and_reject_a_wrong_one() {
        let key = record_key(b"\0k");
        assert_eq!(key.len(), PREFIX + 2);
        assert_eq!(stored_key(&key), Some(&b"\0k"[..]));
        let mut wrong = key.clone();
        wrong[0] ^= 1;
        assert_eq!(stored_key(&wrong), None);
        assert_eq!(stored_key(b"short"), None);
    }

    #[test]
    fn an_entry_shared_by_two_keys_stays_until_neither_has_a_record() -> Result<(), redb::Error> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let txn = db.begin_write()?;
        {
            let mut records = txn.open_table(RECORDS)?;
            let mut expiry = txn.open_table(EXPIRY)?;
            // Two records filed under one hash, as a collision would file them.
            let hash = key_hash(b"\0a").to_be_bytes();
            let a = [&hash[..], b"\0a"].concat();
            let b = [&hash[..], b"\0b"].concat();
            records.insert(a.as_slice(), &b"1"[..])?;
            records.insert(b.as_slice(), &b"2"[..])?;
            index(&mut expiry, 7, b"\0a")?;
            unindex(&mut expiry, &records, 7, b"\0a")?;
            assert_eq!(expiry.len()?, 1, "b has the hash too");
            records.remove(b.as_slice())?;
            unindex(&mut expiry, &records, 7, b"\0a")?;
            assert_eq!(expiry.len()?, 0);
            assert_eq!(under_hash(&records, u64::from_be_bytes(hash))?.len(), 1);
        }
        txn.commit()?;
        Ok(())
    }
}
