//! Effects: the caller's own rows written with the stored response, atomically.

use redb::WriteTransaction;

use crate::api::metrics::Call;
use crate::api::outcome::Lease;
use crate::api::response::Response;
use crate::engine::contain::contain;
use crate::engine::effects::{EffectValue, Effects};
use crate::engine::ops::{Complete, CompleteEffects};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::store::Store;

impl Store {
    /// Like [`complete`](crate::IdempotencyStore::complete), but first runs `effect`, whose writes to the
    /// caller's own tables (a ledger row, an outbox entry) commit together with the stored
    /// response or not at all, in the same group-commit batch as other calls: one durable log
    /// write for all of them. A crash can never leave a charge without its idempotency record,
    /// or the reverse.
    ///
    /// `effect` writes through [`Effects`], on tables registered at open with
    /// [`StoreBuilder::effect_table`](crate::StoreBuilder::effect_table). It runs only while
    /// the lease holds the key, on the thread leading the batch, in batch order: its reads see
    /// every acknowledged write, the effects of the calls before it in its batch, and its own
    /// writes, so a read-modify-write (a balance) needs no lock of yours. Its writes are
    /// buffered and applied only if it returns `Ok(value)`; the call then returns
    /// `Ok(Ok(value))` once the batch is durable. If it returns `Err(e)`, nothing of it and no
    /// response is written, the lease still holds (store the failure with `complete`, or
    /// `release`), and the call returns `Ok(Err(e))`. If it panics, nothing of it is written,
    /// the lease still holds, and the panic resumes on the calling thread.
    ///
    /// Keep `effect` short and free of I/O: the batch, and every caller in it, waits for it.
    /// A store call from inside it returns [`Error::Reentrant`]. It must be `Send + 'static`
    /// because another caller's thread may run it: move what it needs into it.
    ///
    /// ```
    /// use idempotency_store::{IdempotencyStore, Claim, Fingerprint, Key, Response, Store, redb};
    ///
    /// const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");
    /// let store = Store::builder().effect_table(LEDGER).open_in_memory()?;
    /// let key = Key::new("charge-1")?;
    /// let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["4999"]))? else { panic!() };
    /// store.complete_with_effects(&lease, Response::new(201, "charged"), |fx| {
    ///     fx.insert(LEDGER, "charge-1", 4999)?;
    ///     Ok::<_, idempotency_store::Error>(())
    /// })??;
    /// let rows = store.read_with(|txn| -> Result<u64, redb::Error> {
    ///     Ok(redb::ReadableTableMetadata::len(&txn.open_table(LEDGER)?)?)
    /// })??;
    /// assert_eq!(rows, 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// The outer result: [`Error::ResponseTooLarge`] or [`Error::LeaseLost`] (nothing ran),
    /// [`Error::EffectTable`] or a storage error that `effect` met and ignored (nothing
    /// written, the lease still holds), [`Error::Storage`] (the commit failed; outcome
    /// unknown). The inner result: `effect`'s own error.
    pub fn complete_with_effects<T, E, F>(
        &self,
        lease: &Lease,
        response: Response,
        effect: F,
    ) -> Result<std::result::Result<T, E>>
    where
        F: FnOnce(&mut Effects<'_>) -> std::result::Result<T, E> + Send + 'static,
        T: Send + 'static,
        E: Send + 'static,
    {
        let started = std::time::Instant::now();
        let _span = crate::api::trace::enter!("complete", "redb");
        let result = self.complete_with_effects_unmetered(lease, response, Box::new(effect));
        self.metered_effect(&result, started);
        result
    }

    fn complete_with_effects_unmetered<T: Send + 'static, E: Send + 'static>(
        &self,
        lease: &Lease,
        response: Response,
        effect: crate::engine::ops::Effect<T, E>,
    ) -> Result<std::result::Result<T, E>> {
        self.check_size(response.size())?;
        // Never a retry: a retry that found its completion could not give the effect's value
        // back. After an outcome-unknown error, settle with `complete` and the same response.
        let complete = Complete::of(lease, response, false);
        let ran = self.engine.write(CompleteEffects { complete, effect })?;
        let outcome = ran.unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        if outcome.is_ok() {
            self.waiters.wake(&lease.key);
        }
        Ok(outcome)
    }

    /// Counts a completion with an effect as a completion, unless the effect declined.
    fn metered_effect<T, E>(
        &self,
        result: &Result<std::result::Result<T, E>>,
        started: std::time::Instant,
    ) {
        let settled = result
            .as_ref()
            .map(|inner| inner.is_ok())
            .map_err(crate::error::Error::clone);
        if !matches!(settled, Ok(false)) {
            self.meter.settled(Call::Complete, &settled, started);
        }
    }

    /// The value of `key` in `table`, a table registered with
    /// [`StoreBuilder::effect_table`](crate::StoreBuilder::effect_table), as every
    /// acknowledged [`complete_with_effects`](Store::complete_with_effects) left it. The cheap
    /// read of effect rows: it looks in the store's overlay, then in redb, like
    /// [`lookup`](crate::IdempotencyStore::lookup), and never flushes or waits for writers (unlike
    /// [`read_with`](Store::read_with) while effect rows wait in memory). For range scans use
    /// `read_with`.
    ///
    /// ```
    /// use idempotency_store::{IdempotencyStore, Claim, Fingerprint, Key, Response, Store, redb};
    ///
    /// const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");
    /// let store = Store::builder().effect_table(LEDGER).open_in_memory()?;
    /// let key = Key::new("charge-1")?;
    /// let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["4999"]))? else { panic!() };
    /// store.complete_with_effects(&lease, Response::new(201, "charged"), |fx| {
    ///     fx.insert(LEDGER, "charge-1", 4999)
    /// })??;
    /// let amount = store.effect_row(LEDGER, "charge-1")?.map(|row| row.value());
    /// assert_eq!(amount, Some(4999));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::EffectTable`] if `table` was not registered (or with other types),
    /// [`Error::Storage`] if the row cannot be read.
    pub fn effect_row<'k, K: redb::Key + 'static, V: redb::Value + 'static>(
        &self,
        table: redb::TableDefinition<'_, K, V>,
        key: impl std::borrow::Borrow<K::SelfType<'k>>,
    ) -> Result<Option<EffectValue<V>>> {
        let at = self.engine.effect_tables().typed(&table)?;
        let key = K::as_bytes(key.borrow());
        let bytes = self.engine.read_effect(at, key.as_ref())?;
        Ok(bytes.map(EffectValue::new))
    }

    /// Runs `read` in a read transaction of the store's file, for the caller's own tables
    /// (written with [`complete_with_effects`](Store::complete_with_effects) or
    /// [`complete_with`](Store::complete_with)). It sees every acknowledged write to them. Rows
    /// written by effects wait in memory until the next flush of the overlay (every 128 or so
    /// writes); if any are waiting, this call flushes them first (a redb commit without a sync,
    /// behind the batch being written, if any), because redb's `ReadTransaction` cannot see
    /// them. Otherwise it never waits for writers. To read single rows without that cost, use
    /// [`effect_row`](Store::effect_row); BENCHMARKS.md, "Exactly-once payments", gives both
    /// costs.
    ///
    /// ```
    /// use idempotency_store::{Store, redb};
    ///
    /// const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");
    /// let store = Store::builder().open_in_memory()?;
    /// let rows = store.read_with(|txn| -> Result<u64, redb::Error> {
    ///     match txn.open_table(LEDGER) {
    ///         Ok(table) => Ok(redb::ReadableTableMetadata::len(&table)?),
    ///         Err(redb::TableError::TableDoesNotExist(_)) => Ok(0),
    ///         Err(other) => Err(other.into()),
    ///     }
    /// })??;
    /// assert_eq!(rows, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// The outer result: [`Error::Storage`] if the read transaction cannot start. The inner
    /// result: `read`'s own.
    pub fn read_with<T, E>(
        &self,
        read: impl FnOnce(&redb::ReadTransaction) -> std::result::Result<T, E>,
    ) -> Result<std::result::Result<T, E>> {
        let txn = contain("starting a read", || self.engine.begin_read_effects())?;
        Ok(read(&txn))
    }

    /// Like [`complete`](crate::IdempotencyStore::complete), but first runs `effect` in the same redb write
    /// transaction, so the caller's own tables (a ledger, an outbox) and the stored response
    /// commit together or not at all: a crash can never leave a charge without its
    /// idempotency record, or the reverse.
    ///
    /// `effect` receives the write transaction; open your own tables in it (the
    /// [`redb`](https://docs.rs/redb/4) crate is re-exported so the versions match). It runs
    /// only if the lease still holds the key. If it returns `Err`, nothing of it and no
    /// response is written, the lease still holds, and the error comes back as `Ok(Err(e))`.
    ///
    /// `effect` runs while this thread holds the store's writer: a store call from inside it
    /// that writes or needs the writer (an acquiring `claim`, `complete`, `release`,
    /// `complete_with`, `sweep`, `stats`, `verify`, `records`, …) returns
    /// [`Error::Reentrant`] instead of deadlocking. Reads (`lookup`, `read_with`, a claim
    /// answered without a write) work, and see the state before this call.
    ///
    /// The slow path: this call cannot share a group-commit batch (redb cannot roll back one
    /// operation inside a shared transaction), so it pays a durable redb commit of its own,
    /// and other writers wait while `effect` runs. Prefer
    /// [`complete_with_effects`](Store::complete_with_effects), which shares the batch; use
    /// this form for what an effect writer cannot express (range scans, multimap tables, a
    /// table not registered at open).
    ///
    /// ```
    /// use idempotency_store::{IdempotencyStore, Claim, Fingerprint, Key, Response, Store, redb};
    ///
    /// const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("charge-1")?;
    /// let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["4999"]))? else { panic!() };
    /// store.complete_with(&lease, Response::new(201, "charged"), |txn| {
    ///     txn.open_table(LEDGER)?.insert("charge-1", 4999)?;
    ///     Ok::<_, redb::Error>(())
    /// })??;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// The outer result: [`Error::ResponseTooLarge`] or [`Error::LeaseLost`] (nothing ran),
    /// [`Error::Storage`] (the commit failed; outcome unknown). The inner result: `effect`'s
    /// error.
    pub fn complete_with<E, F>(
        &self,
        lease: &Lease,
        response: Response,
        effect: F,
    ) -> Result<std::result::Result<(), E>>
    where
        F: FnOnce(&WriteTransaction) -> std::result::Result<(), E>,
    {
        let started = std::time::Instant::now();
        let result = self.complete_with_unmetered(lease, response, effect);
        self.metered_effect(&result, started);
        result
    }

    fn complete_with_unmetered<E, F>(
        &self,
        lease: &Lease,
        response: Response,
        effect: F,
    ) -> Result<std::result::Result<(), E>>
    where
        F: FnOnce(&WriteTransaction) -> std::result::Result<(), E>,
    {
        self.check_size(response.size())?;
        let complete = Complete::of(lease, response, lease.in_doubt.get());
        let done = self.engine.complete_with(complete, effect);
        lease.in_doubt.after(&done);
        if let Err(err) = done? {
            return Ok(Err(err));
        }
        self.waiters.wake(&lease.key);
        Ok(Ok(()))
    }
}
