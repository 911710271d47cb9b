//! Writing changes into redb's tables: a generation's or a batch's records, expiry entries
//! and effect rows, the records in the order in which sweeps delete them.

use std::collections::{HashMap, HashSet};

use redb::WriteTransaction;

use crate::engine::effects::Registry;
use crate::engine::overlay::{Changes, EffectChange};
use crate::engine::tables::{self, EXPIRY, RecordsMut};
use crate::error::{Error, Result};

/// Writes `changes` into redb's tables in `txn`, and each effect table's rows in one go. The
/// records go in the order of their expiry entries, `(expires_at, key hash)`, which is the order
/// in which sweeps delete them: new records are numbered in that order, so that a sweep's
/// deletions come one after another in the records table instead of scattering over the pages
/// a merge appended. Records with no new expiry entry (deletions, and records whose expiry did
/// not move) go last.
pub(crate) fn write(
    txn: &WriteTransaction,
    changes: &mut Changes<'_>,
    registry: &Registry,
) -> Result<()> {
    let expiring: HashMap<&[u8], u64> = changes
        .index
        .iter()
        .filter(|&&(_, _, present)| present)
        .map(|&(expires_at, key, _)| (key, expires_at))
        .collect();
    let mut filed: Vec<_> = changes
        .records
        .iter()
        .map(|&(key, record)| {
            let expires_at = expiring.get(key).copied().unwrap_or(u64::MAX);
            ((expires_at, tables::key_hash(key)), key, record)
        })
        .collect();
    filed.sort_unstable_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
    let mut records = RecordsMut::open(txn)?;
    let unfiled = write_records(&mut records, &filed)?;
    let mut expiry = txn.open_table(EXPIRY)?;
    for &(expires_at, key, present) in &changes.index {
        if present {
            tables::index(&mut expiry, expires_at, key)?;
            continue;
        }
        let hash = tables::key_hash(key);
        if unfiled.contains(&hash) {
            expiry.remove((expires_at, hash))?;
        } else {
            tables::unindex(&mut expiry, &records, expires_at, key)?;
        }
    }
    write_effects(txn, &mut changes.effects, registry)
}

/// A record change in the order `write` files it: its expiry entry, its key and its bytes.
type Filed<'a> = ((u64, u64), &'a [u8], Option<&'a [u8]>);

/// Files `filed` in `records`. Deleted records go last, in the order of their numbers: a
/// sweep's deletions are filed in the order of their key hashes, which scatters them over
/// the records table, and a merge that deletes them in that order reads and copies its
/// pages many times over. Returns the hashes under which no key has a record left: a
/// deletion's expiry entry under one goes without a look for other keys under it.
fn write_records(records: &mut RecordsMut<'_>, filed: &[Filed<'_>]) -> Result<HashSet<u64>> {
    let (mut numbers, mut unfiled) = (Vec::new(), HashSet::new());
    for &((_, hash), key, record) in filed {
        match record {
            Some(bytes) => {
                unfiled.remove(&hash);
                records.put_hashed(hash, key, bytes)?;
            }
            None => {
                if let Some((number, alone)) = records.unfile(hash, key)? {
                    numbers.push(number);
                    if alone {
                        unfiled.insert(hash);
                    } else {
                        unfiled.remove(&hash);
                    }
                }
            }
        }
    }
    numbers.sort_unstable();
    records.remove_numbers(&numbers)?;
    Ok(unfiled)
}

/// Writes effect rows, grouped by table (a row's overlay key starts with its table's position).
fn write_effects(
    txn: &WriteTransaction,
    effects: &mut [EffectChange<'_>],
    registry: &Registry,
) -> Result<()> {
    effects.sort_unstable_by_key(|&(at, _)| at);
    let mut rows = Vec::new();
    let mut rest = &effects[..];
    while let Some(&(first, _)) = rest.first() {
        let (table, _) = first
            .split_first_chunk::<4>()
            .ok_or_else(|| Error::corrupted("an effect row of the overlay has no table"))?;
        let run = rest
            .iter()
            .take_while(|(at, _)| at.starts_with(table))
            .count();
        rows.clear();
        rows.extend(rest[..run].iter().map(|&(at, value)| (&at[4..], value)));
        let at = usize::try_from(u32::from_be_bytes(*table)).unwrap_or(usize::MAX);
        registry.table(at)?.write(txn, &rows)?;
        rest = &rest[run..];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::overlay::Overlay;

    #[test]
    fn a_merge_numbers_new_records_in_the_order_of_their_expiry() -> Result<()> {
        use crate::engine::snapshot::tests::db;
        use crate::engine::tables::RECORDS;
        use redb::ReadableTable;
        let db = db();
        let mut batch = Overlay::default();
        for (key, expires_at) in [(b"\0a", 10), (b"\0b", 30), (b"\0c", 20)] {
            batch.set_record(key, Some(key));
            batch.set_index(expires_at, key, true);
        }
        batch.set_record(b"\0d", Some(b"no expiry entry of its own"));
        let txn = db.begin_write()?;
        write(&txn, &mut batch.changes(), &Registry::default())?;
        let records = txn.open_table(RECORDS)?;
        let order: Vec<Vec<u8>> = records
            .iter()?
            .map(|e| {
                let (number, value) = e?;
                Ok(tables::split(number.value(), value.value())?.0.to_vec())
            })
            .collect::<Result<_>>()?;
        assert_eq!(order, [&b"\0a"[..], b"\0c", b"\0b", b"\0d"]);
        Ok(())
    }

    /// `\0a` and `\0b` filed under one hash, as a collision would file them.
    fn collided(txn: &WriteTransaction) -> Result<u64> {
        let hash = tables::key_hash(b"\0a");
        let mut records = RecordsMut::open(txn)?;
        records.put_hashed(hash, b"\0a", b"1")?;
        records.put_hashed(hash, b"\0b", b"2")?;
        txn.open_table(EXPIRY)?.insert((7, hash), ())?;
        Ok(hash)
    }

    #[test]
    fn a_deleted_keys_expiry_entry_stays_while_another_key_has_its_hash() -> Result<()> {
        use redb::{ReadableTable, ReadableTableMetadata};
        let db = crate::engine::snapshot::tests::db();
        let txn = db.begin_write()?;
        let hash = collided(&txn)?;
        let mut batch = Overlay::default();
        batch.set_record(b"\0a", None);
        batch.set_index(7, b"\0a", false);
        write(&txn, &mut batch.changes(), &Registry::default())?;
        assert!(
            txn.open_table(EXPIRY)?.get((7, hash))?.is_some(),
            "b has it"
        );
        let records = RecordsMut::open(&txn)?;
        assert_eq!(
            records.under_hash(hash)?,
            [(b"\0b".to_vec(), b"2".to_vec())]
        );
        assert_eq!(records.records().len()?, 1);
        drop(records);
        // Alone under its hash, a deleted key's entry goes.
        let mut batch = Overlay::default();
        batch.set_record(b"\0c", Some(b"3"));
        batch.set_index(9, b"\0c", true);
        write(&txn, &mut batch.changes(), &Registry::default())?;
        let mut batch = Overlay::default();
        batch.set_record(b"\0c", None);
        batch.set_index(9, b"\0c", false);
        write(&txn, &mut batch.changes(), &Registry::default())?;
        let expiry = txn.open_table(EXPIRY)?;
        assert_eq!(expiry.len()?, 1);
        assert!(expiry.get((7, hash))?.is_some());
        Ok(())
    }

    #[test]
    fn a_hash_is_left_without_records_only_if_its_last_change_deleted_its_last_key() -> Result<()> {
        let db = crate::engine::snapshot::tests::db();
        let txn = db.begin_write()?;
        let hash = collided(&txn)?;
        let at = (u64::MAX, hash);
        let (a, b, c) = (&b"\0a"[..], &b"\0b"[..], &b"\0c"[..]);
        let mut records = RecordsMut::open(&txn)?;
        let unfiled = write_records(&mut records, &[(at, a, None)])?;
        assert!(!unfiled.contains(&hash), "b is left under it");
        let unfiled = write_records(&mut records, &[(at, b, None), (at, c, Some(b"3"))])?;
        assert!(
            !unfiled.contains(&hash),
            "c was filed under it after b went"
        );
        let unfiled = write_records(&mut records, &[(at, a, Some(b"1")), (at, c, None)])?;
        assert!(!unfiled.contains(&hash), "a is back under it");
        let unfiled = write_records(&mut records, &[(at, a, None)])?;
        assert!(unfiled.contains(&hash));
        assert!(records.under_hash(hash)?.is_empty());
        Ok(())
    }
}
