//! Redo of the log's entries at open: the changes they hold applied to redb's tables in the
//! open's transaction, which then commits as a merge (see `wal`). Redo is physical (the bytes
//! a batch wrote), so an entry whose effect redb already holds changes nothing.

use redb::WriteTransaction;

use crate::engine::effects::Registry;
use crate::engine::kept::{self, Unregistered};
use crate::engine::meta::META;
use crate::engine::tables::{self, EXPIRY, RecordsMut};
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
    for change in entries.into_iter().flatten() {
        match change {
            Change::Put { key, record } => drop(records.put(&key, &record)?),
            Change::Delete { key } => drop(records.remove(&key)?),
            Change::Index { expires_at, key } => tables::index(&mut expiry, expires_at, &key)?,
            Change::Unindex { expires_at, key } => {
                tables::unindex(&mut expiry, &records, expires_at, &key)?;
            }
            Change::DropEntry { expires_at, hash } => drop(expiry.remove((expires_at, hash))?),
            Change::Counter { counter, value } => drop(meta.insert(counter.name(), value)?),
            // Without its table's types a row cannot be redone; the store's own tables never
            // depend on it.
            Change::Effect { table, key, value } => {
                effects.row(&table, &key, value.as_deref())?;
            }
        }
    }
    effects.finish()
}
