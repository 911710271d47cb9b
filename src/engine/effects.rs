//! Effects: the caller's own rows (a ledger, an outbox) written by the batch that stores the
//! response, through the same log entry, so they share its group commit and its fate.
//!
//! A caller's closure gets an [`Effects`] writer. Its inserts and removals are buffered, and
//! applied to the batch only when the closure returns `Ok`: a failing closure leaves nothing,
//! with no rollback, and the rest of the batch commits. Applied rows travel like records:
//! into the log entry (as [`Change::Effect`](crate::engine::wal::Change), by table name), then
//! the overlay, then redb with the next flush, and a crash redoes them from the log at open.
//! Redo needs each table's types, so the tables are registered when the store is opened
//! ([`Registry`]).
//!
//! The closure runs on the batch leader's thread, in batch order, so its reads see the rows
//! of every earlier call in the batch, as well as its own writes; that makes a read-modify-
//! write (a balance) safe without a lock of the caller's.

use std::any::Any;
use std::borrow::Borrow;
use std::marker::PhantomData;
use std::sync::Arc;

use redb::{
    Key as RedbKey, ReadTransaction, ReadableTable, TableDefinition, TableHandle, TypeName, Value,
    WriteTransaction,
};

use crate::error::{Error, Result};

/// A row change of an effect table: the key's bytes, and the value's (`None`: removed).
pub(crate) type RowChange<'a> = (&'a [u8], Option<&'a [u8]>);

/// A table registered for effects, its key and value types erased to bytes.
pub(crate) trait EffectTable: Send + Sync {
    fn name(&self) -> &str;
    fn types(&self) -> (TypeName, TypeName);
    /// The row's value bytes, in a write transaction.
    fn get_in(&self, txn: &WriteTransaction, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// The row's value bytes, in a read transaction (a table never written has no rows).
    fn get_at(&self, txn: &ReadTransaction, key: &[u8]) -> Result<Option<Vec<u8>>>;
    /// Applies `rows` in order.
    fn write(&self, txn: &WriteTransaction, rows: &[RowChange<'_>]) -> Result<()>;
}

/// A table's name and types (a `TableDefinition` is `Send` only if its types are).
struct Typed<K, V> {
    name: String,
    types: PhantomData<fn() -> (K, V)>,
}

impl<K: RedbKey + 'static, V: Value + 'static> Typed<K, V> {
    fn definition(&self) -> TableDefinition<'_, K, V> {
        TableDefinition::new(&self.name)
    }

    /// Bytes from the log or the overlay are the bytes `as_bytes` made, but a file written by
    /// a build with other types for this table must fail here, not panic in `from_bytes`.
    fn check(&self, bytes: &[u8], width: Option<usize>) -> Result<()> {
        match width {
            Some(width) if width != bytes.len() => Err(Error::EffectTable {
                table: self.name.clone(),
                reason: format!(
                    "a stored row has {} bytes where its type has {width}; the table was \
                     registered with other types than it was written with",
                    bytes.len()
                ),
            }),
            _ => Ok(()),
        }
    }

    fn value_bytes(value: &V::SelfType<'_>) -> Vec<u8> {
        V::as_bytes(value).as_ref().to_vec()
    }
}

impl<K: RedbKey + 'static, V: Value + 'static> EffectTable for Typed<K, V> {
    fn name(&self) -> &str {
        &self.name
    }

    fn types(&self) -> (TypeName, TypeName) {
        (K::type_name(), V::type_name())
    }

    fn get_in(&self, txn: &WriteTransaction, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.check(key, K::fixed_width())?;
        let table = txn.open_table(self.definition())?;
        let row = table.get(K::from_bytes(key))?;
        Ok(row.map(|guard| Self::value_bytes(&guard.value())))
    }

    fn get_at(&self, txn: &ReadTransaction, key: &[u8]) -> Result<Option<Vec<u8>>> {
        self.check(key, K::fixed_width())?;
        let table = match txn.open_table(self.definition()) {
            Ok(table) => table,
            Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
            Err(err) => return Err(err.into()),
        };
        let row = table.get(K::from_bytes(key))?;
        Ok(row.map(|guard| Self::value_bytes(&guard.value())))
    }

    fn write(&self, txn: &WriteTransaction, rows: &[RowChange<'_>]) -> Result<()> {
        let mut table = txn.open_table(self.definition())?;
        for &(key, value) in rows {
            self.check(key, K::fixed_width())?;
            match value {
                Some(value) => {
                    self.check(value, V::fixed_width())?;
                    drop(table.insert(K::from_bytes(key), V::from_bytes(value))?);
                }
                None => drop(table.remove(K::from_bytes(key))?),
            }
        }
        Ok(())
    }
}

/// The tables a store was opened with for effects, in registration order (a table's position
/// names it in the overlay; its name names it in the log, which outlives the order).
#[derive(Clone, Default)]
pub(crate) struct Registry {
    tables: Vec<Arc<dyn EffectTable>>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.tables.iter().map(|t| t.name()))
            .finish()
    }
}

impl Registry {
    /// Adds `table`, replacing an earlier registration of the same name.
    pub(crate) fn register<K: RedbKey + 'static, V: Value + 'static>(
        &mut self,
        table: TableDefinition<'_, K, V>,
    ) {
        self.tables.retain(|t| t.name() != table.name());
        self.tables.push(Arc::new(Typed::<K, V> {
            name: table.name().to_owned(),
            types: PhantomData,
        }));
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.tables.iter().map(|t| t.name())
    }

    /// The position of the table named `name`.
    pub(crate) fn position(&self, name: &str) -> Result<usize> {
        self.tables
            .iter()
            .position(|t| t.name() == name)
            .ok_or_else(|| Error::EffectTable {
                table: name.to_owned(),
                reason: "it is not registered for effects: register it with \
                         `StoreBuilder::effect_table` before opening the store"
                    .to_owned(),
            })
    }

    pub(crate) fn table(&self, at: usize) -> Result<&dyn EffectTable> {
        self.tables
            .get(at)
            .map(|t| &**t)
            .ok_or_else(|| Error::corrupted(format!("no effect table at position {at}")))
    }

    /// The position of `table`, checked against the types it was registered with.
    pub(crate) fn typed<K: RedbKey + 'static, V: Value + 'static>(
        &self,
        table: &TableDefinition<'_, K, V>,
    ) -> Result<usize> {
        let at = self.position(table.name())?;
        if self.table(at)?.types() != (K::type_name(), V::type_name()) {
            return Err(Error::EffectTable {
                table: table.name().to_owned(),
                reason: "its key or value type differs from the registered table's".to_owned(),
            });
        }
        Ok(at)
    }
}

/// Reads of effect rows as the batch sees them: the batch's earlier rows, the overlay, redb.
pub(crate) trait ReadRows {
    fn row(&self, table: usize, key: &[u8]) -> Result<Option<Vec<u8>>>;
}

/// A row write buffered by [`Effects`], applied when its closure returns `Ok`.
#[derive(Debug)]
pub(crate) struct Row {
    pub table: usize,
    pub key: Vec<u8>,
    pub value: Option<Vec<u8>>,
}

/// The caller's writes in [`Store::complete_with_effects`](crate::Store::complete_with_effects):
/// inserts and removals on tables registered with
/// [`StoreBuilder::effect_table`](crate::StoreBuilder::effect_table), and reads that see every
/// acknowledged write, the rows of the calls before this one in its batch, and this closure's
/// own writes.
///
/// Writes are buffered: they reach the tables only if the closure returns `Ok`, together with
/// the stored response, in the same durable log write. A call that fails (an unregistered
/// table, a storage error) makes the whole effect fail with that error even if the closure
/// ignores it: nothing of it is written.
pub struct Effects<'a> {
    registry: &'a Registry,
    reader: &'a dyn ReadRows,
    rows: Vec<Row>,
    failed: Option<Error>,
}

impl<'a> Effects<'a> {
    pub(crate) fn new(registry: &'a Registry, reader: &'a dyn ReadRows) -> Self {
        Effects {
            registry,
            reader,
            rows: Vec::new(),
            failed: None,
        }
    }

    /// The buffered rows, or the first error any call met.
    pub(crate) fn finish(self) -> Result<Vec<Row>> {
        match self.failed {
            Some(err) => Err(err),
            None => Ok(self.rows),
        }
    }

    /// Sets `key` to `value` in `table`.
    ///
    /// # Errors
    /// [`Error::EffectTable`] if `table` was not registered, or with other types.
    pub fn insert<'k, 'v, K: RedbKey + 'static, V: Value + 'static>(
        &mut self,
        table: TableDefinition<'_, K, V>,
        key: impl Borrow<K::SelfType<'k>>,
        value: impl Borrow<V::SelfType<'v>>,
    ) -> Result<()> {
        let value = V::as_bytes(value.borrow()).as_ref().to_vec();
        self.put(&table, K::as_bytes(key.borrow()).as_ref(), Some(value))
    }

    /// Removes `key` from `table` (nothing happens if it is absent).
    ///
    /// # Errors
    /// As [`insert`](Effects::insert).
    pub fn remove<'k, K: RedbKey + 'static, V: Value + 'static>(
        &mut self,
        table: TableDefinition<'_, K, V>,
        key: impl Borrow<K::SelfType<'k>>,
    ) -> Result<()> {
        self.put(&table, K::as_bytes(key.borrow()).as_ref(), None)
    }

    /// The value of `key` in `table`, as this effect sees it (see [`Effects`]).
    ///
    /// # Errors
    /// As [`insert`](Effects::insert), and [`Error::Storage`] if the row cannot be read.
    pub fn get<'k, K: RedbKey + 'static, V: Value + 'static>(
        &mut self,
        table: TableDefinition<'_, K, V>,
        key: impl Borrow<K::SelfType<'k>>,
    ) -> Result<Option<EffectValue<V>>> {
        let key = K::as_bytes(key.borrow());
        let found = self.lookup(&table, key.as_ref());
        let bytes = self.noted(found)?;
        Ok(bytes.map(EffectValue::new))
    }

    fn lookup<K: RedbKey + 'static, V: Value + 'static>(
        &self,
        table: &TableDefinition<'_, K, V>,
        key: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let at = self.registry.typed(table)?;
        let own = self
            .rows
            .iter()
            .rev()
            .find(|r| r.table == at && r.key == key);
        match own {
            Some(row) => Ok(row.value.clone()),
            None => self.reader.row(at, key),
        }
    }

    fn put<K: RedbKey + 'static, V: Value + 'static>(
        &mut self,
        table: &TableDefinition<'_, K, V>,
        key: &[u8],
        value: Option<Vec<u8>>,
    ) -> Result<()> {
        let at = self.registry.typed(table);
        let at = self.noted(at)?;
        self.rows.push(Row {
            table: at,
            key: key.to_vec(),
            value,
        });
        Ok(())
    }

    /// `result`, remembering its error so that an effect that ignores it still fails.
    fn noted<T>(&mut self, result: Result<T>) -> Result<T> {
        if let Err(err) = &result {
            self.failed.get_or_insert_with(|| err.clone());
        }
        result
    }
}

impl std::fmt::Debug for Effects<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Effects")
            .field("tables", self.registry)
            .field("buffered_rows", &self.rows.len())
            .finish_non_exhaustive()
    }
}

/// A value read through [`Effects::get`], owned: [`value`](EffectValue::value) decodes it.
pub struct EffectValue<V: Value> {
    bytes: Vec<u8>,
    value: PhantomData<fn() -> V>,
}

impl<V: Value> EffectValue<V> {
    pub(crate) fn new(bytes: Vec<u8>) -> Self {
        EffectValue {
            bytes,
            value: PhantomData,
        }
    }

    /// The value, as the table's value type reads it.
    pub fn value(&self) -> V::SelfType<'_> {
        V::from_bytes(&self.bytes)
    }
}

impl<V: Value> std::fmt::Debug for EffectValue<V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&self.value(), f)
    }
}

/// What a caller gets back from an effect: the closure's result, or its panic to resume on
/// the caller's own thread.
pub(crate) type Ran<T, E> = std::result::Result<std::result::Result<T, E>, Box<dyn Any + Send>>;

thread_local! {
    /// Whether this thread is running an effect (`complete_with` or `complete_with_effects`),
    /// and so holds the writer.
    static IN_EFFECT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// `Err(Error::Reentrant)` on a thread running an effect: a call that needs the
/// writer would wait for itself forever. Checked by every entry point that takes the writer.
pub(crate) fn not_in_effect() -> Result<()> {
    if IN_EFFECT.with(std::cell::Cell::get) {
        return Err(Error::Reentrant);
    }
    Ok(())
}

/// Marks this thread as running an effect until dropped (also when the effect panics).
pub(crate) struct EffectScope;

impl EffectScope {
    pub(crate) fn enter() -> Self {
        IN_EFFECT.with(|inside| inside.set(true));
        EffectScope
    }
}

impl Drop for EffectScope {
    fn drop(&mut self) {
        IN_EFFECT.with(|inside| inside.set(false));
    }
}
