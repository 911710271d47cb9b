//! Redo of the log's entries at open: the changes they hold applied to redb's tables in the
//! open's transaction, which then commits as a merge (see `wal`). Redo is physical (the bytes
//! a batch wrote), so an entry whose effect redb already holds changes nothing; the usage
//! counters count what redo writes, since the log does not hold them (see `meta::Counters`).

use redb::WriteTransaction;

use crate::api::record::Record;
use crate::engine::effects::Registry;
use crate::engine::kept::{self, Unregistered};
use crate::engine::meta::{Counter, Counters, META, Usage};
use crate::engine::tables::{self, EXPIRY, ExpiryTable, RecordsMut};
use crate::engine::wal::Change;
use crate::error::Result;

/// Applies logged changes in `txn`, in order, after the effect rows earlier opens kept. Rows
/// of effect tables not in `registry` are handled as `unregistered` says (see `kept`).
/// Returns whether effect rows wait in the `kept` table afterwards.
pub(crate) fn redo(
    txn: &WriteTransaction,
    entries: Vec<Vec<Change>>,
    registry: &Registry,
    unregistered: Unregistered,
) -> Result<bool> {
    let mut effects = kept::Redo::start(txn, registry, unregistered)?;
    let mut records = RecordsMut::open(txn)?;
    let mut expiry = txn.open_table(EXPIRY)?;
    let mut meta = txn.open_table(META)?;
    let mut usage = Counters::load(&meta)?.usage;
    for change in entries.into_iter().flatten() {
        match change {
            Change::Put { key, record } => {
                redo_put(&mut records, &mut expiry, &mut usage, &key, &record)?;
            }
            Change::Delete { key } => usage.removed(key.len(), records.remove(&key)?),
            Change::Index { expires_at, key } => tables::index(&mut expiry, expires_at, &key)?,
            Change::Unindex { expires_at, key } => {
                tables::unindex(&mut expiry, &records, expires_at, &key)?;
            }
            Change::DropEntry { expires_at, hash } => drop(expiry.remove((expires_at, hash))?),
            // Logged by earlier releases: the usage this redo counts replaces them.
            Change::Counter {
                counter: Counter::Records | Counter::Bytes,
                ..
            } => {}
            Change::Counter { counter, value } => drop(meta.insert(counter.name(), value)?),
            // Without its table's types a row cannot be redone; the store's own tables never
            // depend on it.
            Change::Effect { table, key, value } => {
                effects.row(&table, &key, value.as_deref())?;
            }
        }
    }
    meta.insert(Counter::Records.name(), usage.records)?;
    meta.insert(Counter::Bytes.name(), usage.bytes)?;
    effects.finish()
}

/// Redoes a `Put`, counting it in `usage`. The key may hold a record that the log never saw
/// deleted: a sweep deletes expired records without a log entry (`Tables::delete_expired`),
/// and a crash before the next merge brings them back, still expired. A claim that came
/// after such a deletion logged its record as a new one, with no `Unindex` of the old
/// record's expiry entry, which would be left naming no record; so the old record's entry
/// goes here when the new record expires at another time. Where the claim did log the
/// `Unindex` (the old record was still there), this one finds nothing more to take out.
fn redo_put(
    records: &mut RecordsMut<'_>,
    expiry: &mut ExpiryTable<'_>,
    usage: &mut Usage,
    key: &[u8],
    record: &[u8],
) -> Result<()> {
    let expiry_of = |bytes: &[u8]| Record::decode(key, bytes).ok().map(|r| r.expires_at);
    let before = records.with(key, expiry_of)?.flatten();
    usage.replaced(key.len(), record.len(), records.put(key, record)?);
    if let Some(before) = before
        && Some(before) != expiry_of(record)
    {
        tables::unindex(expiry, records, before, key)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Redo over a record the log never saw deleted (a sweep's, `Tables::delete_expired`): a
    /// claim logged as a new record replaces it and takes its expiry entry out, and the usage
    /// counters count what redo leaves, not what an earlier release logged.
    #[test]
    fn redo_replaces_a_record_swept_without_a_log_entry() -> Result<()> {
        use crate::api::clock::Timestamp;
        use crate::api::fingerprint::Fingerprint;
        use crate::api::record::Attempt;
        use redb::ReadableTable;
        let db = crate::engine::snapshot::tests::db();
        let key = b"\0swept".to_vec();
        let record = |at: u64| {
            let first = Attempt::first(Timestamp::from_millis(at));
            Record::claimed(Fingerprint::of(["x"]), first, None, 1, at + 10, 100).encode(&key)
        };
        let (old, new) = (record(1_000)?, record(5_000)?);
        let txn = db.begin_write()?;
        RecordsMut::open(&txn)?.put(&key, &old)?;
        tables::index(&mut txn.open_table(EXPIRY)?, 1_100, &key)?;
        let usage = |record: &[u8]| Usage {
            records: 1,
            bytes: (key.len() + record.len()) as u64,
        };
        let counters = Counters {
            usage: usage(&old),
            ..Counters::default()
        };
        counters.save(&mut txn.open_table(META)?)?;
        txn.commit()?;
        let claim = vec![
            Change::Index {
                expires_at: 5_100,
                key: key.clone(),
            },
            Change::Put {
                key: key.clone(),
                record: new.clone(),
            },
            Change::Counter {
                counter: Counter::Records,
                value: 2,
            },
        ];
        let txn = db.begin_write()?;
        redo(
            &txn,
            vec![claim],
            &Registry::default(),
            Unregistered::Refuse,
        )?;
        let entries = txn
            .open_table(EXPIRY)?
            .iter()?
            .map(|e| e.map(|(k, _)| k.value()))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        assert_eq!(entries, [(5_100, tables::key_hash(&key))]);
        assert_eq!(Counters::load(&txn.open_table(META)?)?.usage, usage(&new));
        Ok(())
    }
}
