//! Effect rows kept for a later open: what an open does with the log's rows of effect tables it
//! did not register.
//!
//! Redo writes an effect row into its table, which needs the table's key and value types, and
//! the merge that ends the open retires the log entry that held the row. An operator tool (the
//! CLI's `sweep` and `release`) knows no application's tables, yet must not lose their rows.
//! With [`Unregistered::Keep`] the open moves such rows, in the merge's own transaction, into
//! the store's table [`KEPT`], in log order; the next open that registers their table applies
//! them before the log's rows, which are newer. While rows wait there, the file's format
//! version is [`KEPT_FORMAT`](crate::engine::meta::KEPT_FORMAT), so that a build that does not
//! know the table refuses the file instead of losing them.

use redb::{ReadableTable, ReadableTableMetadata, TableDefinition, TableHandle, WriteTransaction};

use crate::engine::effects::Registry;
use crate::error::{Error, Result};

/// Kept rows in log order: ordinal → postcard `(table name, key bytes, value bytes or None)`.
pub(crate) const KEPT: TableDefinition<u64, &[u8]> =
    TableDefinition::new("idempotency_kept_effects");

/// What an open does with an effect row of a table it did not register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Unregistered {
    /// Fail with `Error::EffectTable`: a service must not lose its own rows.
    Refuse,
    /// Leave it out: a read-only open, whose replay never reaches the file.
    Skip,
    /// Move it into [`KEPT`] for an open that registers its table.
    Keep,
}

/// A kept row: the table's name, the key's bytes and the value's (`None`: removed).
type Row = (String, Vec<u8>, Option<Vec<u8>>);

/// The effect rows of one open's redo, kept rows first (see the module docs).
pub(crate) struct Redo<'t> {
    txn: &'t WriteTransaction,
    registry: &'t Registry,
    unregistered: Unregistered,
    /// The ordinal of the next row kept.
    next: u64,
}

impl<'t> Redo<'t> {
    /// Applies the rows earlier opens kept whose tables are registered now, in the order they
    /// were kept, and deletes them; rows of tables still not registered wait, unless
    /// `unregistered` refuses them.
    pub(crate) fn start(
        txn: &'t WriteTransaction,
        registry: &'t Registry,
        unregistered: Unregistered,
    ) -> Result<Self> {
        let mut redo = Redo {
            txn,
            registry,
            unregistered,
            next: 0,
        };
        if !has_kept_table(txn)? {
            return Ok(redo);
        }
        let mut kept = txn.open_table(KEPT)?;
        let mut applied = Vec::new();
        for entry in kept.iter()? {
            let (ordinal, bytes) = entry?;
            let (table, key, value): Row = postcard::from_bytes(bytes.value()).map_err(|err| {
                Error::corrupted(format!("a kept effect row does not decode ({err})"))
            })?;
            redo.next = after(ordinal.value())?;
            if redo.apply(&table, &key, value.as_deref())? {
                applied.push(ordinal.value());
            }
        }
        for ordinal in applied {
            kept.remove(ordinal)?;
        }
        Ok(redo)
    }

    /// Redoes one effect row of the log: into its table if it is registered, else as
    /// `unregistered` says.
    pub(crate) fn row(&mut self, table: &str, key: &[u8], value: Option<&[u8]>) -> Result<()> {
        if self.apply(table, key, value)? || self.unregistered == Unregistered::Skip {
            return Ok(());
        }
        let bytes = postcard::to_allocvec(&(table, key, value))
            .map_err(|err| Error::storage("keeping an effect row", std::io::Error::other(err)))?;
        self.txn
            .open_table(KEPT)?
            .insert(self.next, bytes.as_slice())?;
        self.next = after(self.next)?;
        Ok(())
    }

    /// Whether rows wait in [`KEPT`] once this redo is done; an emptied table is deleted, so
    /// that a file with nothing kept looks as it did before any was.
    pub(crate) fn finish(self) -> Result<bool> {
        if !has_kept_table(self.txn)? {
            return Ok(false);
        }
        if !self.txn.open_table(KEPT)?.is_empty()? {
            return Ok(true);
        }
        self.txn.delete_table(KEPT)?;
        Ok(false)
    }

    /// Writes the row into its table if that is registered (true); false if it may wait, an
    /// error if it may not.
    fn apply(&self, table: &str, key: &[u8], value: Option<&[u8]>) -> Result<bool> {
        match self.registry.position(table) {
            Ok(at) => {
                self.registry.table(at)?.write(self.txn, &[(key, value)])?;
                Ok(true)
            }
            Err(err) if self.unregistered == Unregistered::Refuse => Err(err),
            Err(_) => Ok(false),
        }
    }
}

/// The ordinal after `ordinal`; only a damaged table can run out of them.
fn after(ordinal: u64) -> Result<u64> {
    ordinal
        .checked_add(1)
        .ok_or_else(|| Error::corrupted("the kept effect rows' ordinals are exhausted"))
}

/// Whether the file has a [`KEPT`] table (opening it in a write transaction would create it).
fn has_kept_table(txn: &WriteTransaction) -> Result<bool> {
    Ok(txn.list_tables()?.any(|t| t.name() == KEPT.name()))
}

#[cfg(test)]
mod tests {
    use redb::backends::InMemoryBackend;
    use redb::{Database, ReadableDatabase};

    use super::*;

    const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("ledger");

    fn registry(with_ledger: bool) -> Registry {
        let mut registry = Registry::default();
        if with_ledger {
            registry.register(LEDGER);
        }
        registry
    }

    /// Redoes `rows` of the ledger in one transaction as `unregistered` says, with or without
    /// the ledger registered; returns whether rows wait.
    fn redo(
        db: &Database,
        with_ledger: bool,
        unregistered: Unregistered,
        rows: &[(&str, Option<u64>)],
    ) -> Result<bool> {
        let txn = db.begin_write()?;
        let registry = registry(with_ledger);
        let mut redo = Redo::start(&txn, &registry, unregistered)?;
        for (key, value) in rows {
            let value = value.map(u64::to_le_bytes);
            redo.row("ledger", key.as_bytes(), value.as_ref().map(|v| &v[..]))?;
        }
        let waiting = redo.finish()?;
        txn.commit()?;
        Ok(waiting)
    }

    fn ledger(db: &Database) -> Result<Vec<(String, u64)>> {
        let txn = db.begin_read()?;
        let table = match txn.open_table(LEDGER) {
            Ok(table) => table,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
            Err(err) => return Err(err.into()),
        };
        let mut rows = Vec::new();
        for entry in table.iter()? {
            let (key, value) = entry?;
            rows.push((key.value().to_owned(), value.value()));
        }
        Ok(rows)
    }

    #[test]
    fn kept_rows_wait_for_an_open_that_registers_their_table_and_apply_first() -> Result<()> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        let rows = [("a", Some(1)), ("b", Some(2)), ("a", None)];
        assert!(redo(&db, false, Unregistered::Keep, &rows)?);
        assert!(redo(&db, false, Unregistered::Keep, &[("b", Some(3))])?);
        assert_eq!(ledger(&db)?, []);
        // A service's open refuses rather than drop them without their table...
        let refused = redo(&db, false, Unregistered::Refuse, &[]);
        assert!(matches!(refused, Err(Error::EffectTable { table, .. }) if table == "ledger"));
        // ...and with it applies them in order, then the log's newer rows.
        assert!(!redo(&db, true, Unregistered::Refuse, &[("c", Some(4))])?);
        assert_eq!(ledger(&db)?, [("b".to_owned(), 3), ("c".to_owned(), 4)]);
        let txn = db.begin_write()?;
        assert!(!has_kept_table(&txn)?, "an emptied table is deleted");
        Ok(())
    }

    #[test]
    fn a_read_only_redo_leaves_rows_out_and_keeps_nothing() -> Result<()> {
        let db = Database::builder().create_with_backend(InMemoryBackend::new())?;
        assert!(!redo(&db, false, Unregistered::Skip, &[("a", Some(1))])?);
        assert!(!has_kept_table(&db.begin_write()?)?);
        Ok(())
    }
}
