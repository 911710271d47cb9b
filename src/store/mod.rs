//! The store: opening, the claim/settle calls, lookups and maintenance.

pub(crate) mod admin;
pub(crate) mod builder;
pub(crate) mod maintenance;
pub(crate) mod sweep;
pub(crate) mod wait;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use redb::{
    Database, MultimapTableHandle, ReadableDatabase, ReadableTable, TableHandle, WriteTransaction,
};

use crate::api::clock::{Timestamp, millis};
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, Lease, Outcome, RecordState, RecordView};
use crate::engine::commit::Committer;
use crate::engine::flush::{Flusher, Job};
use crate::engine::ops::{
    Counters, Ctx, Decision, Done, Fail, META, META_FORMAT, META_LOG_SEQ, META_NEXT_TOKEN, Op,
    Quota, STORE_FORMAT, Tables, decide,
};
use crate::engine::overlay::{self, Shared};
use crate::engine::record::{Record, Response, State, check_size};
use crate::engine::tables::{self, EXPIRY, RECORDS};
use crate::engine::wal::{self, Change, Log};
use crate::error::{Error, Result, contain};
use crate::store::builder::{Builder, Durability, WhenFull};
use crate::store::wait::Waiters;

/// A durable idempotency-key store in one file (a write-ahead log and a redb database).
///
/// `Store` is `Send + Sync`: share one per file (for example in an `Arc`) across all request
/// threads. Reads ([`lookup`](Store::lookup), and claims that only replay or reject) run in
/// read transactions beside the writer. Write calls from many threads share commits (group
/// commit) and each returns only after the commit holding its write is durable.
pub struct Store {
    /// Always `Some` until the store is dropped; an `Option` so that `Drop` can contain a
    /// panic of redb's own drop on a damaged file.
    db: Option<Arc<Database>>,
    pub(crate) config: Builder,
    path: Option<PathBuf>,
    committer: Committer,
    pub(crate) waiters: Waiters,
    /// The log and the counters; locked by the holder of redb's write transaction for as long
    /// as it holds it.
    pub(crate) writer: parking_lot::Mutex<Writer>,
    /// Changes the log holds but redb's tables do not yet; changed only under the writer lock.
    overlay: Arc<Shared>,
    /// Writes full overlay generations into redb; see `flush`.
    flusher: Flusher,
    /// The highest time the store has used; the store's clock never goes below it.
    high_water: AtomicU64,
}

/// What the holder of redb's write transaction works with besides the tables.
pub(crate) struct Writer {
    log: Log,
    /// The meta table's counters as of the last commit (see `Counters`).
    pub(crate) counters: Counters,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (or creates) the store file at `path` with default settings.
    ///
    /// # Errors
    /// As for [`Builder::open`].
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Store> {
        Builder::new().open(path)
    }

    /// A builder for a store with custom settings.
    #[must_use]
    pub fn builder() -> Builder {
        Builder::new()
    }

    /// Sets up the tables of a new store, or checks an existing one's, and replays the log
    /// entries written after the last checkpoint; the commit that ends it is a checkpoint.
    pub(crate) fn init(
        db: Database,
        opened: crate::store::builder::Opened,
        config: Builder,
        path: Option<PathBuf>,
    ) -> Result<Store> {
        let mut txn = db.begin_write()?;
        txn.set_quick_repair(config.durability == Durability::QuickRepair);
        let mut writer = {
            let names: Vec<String> = txn
                .list_tables()?
                .map(|t| t.name().to_owned())
                .chain(txn.list_multimap_tables()?.map(|t| t.name().to_owned()))
                .collect();
            if !names.iter().any(|n| n == META.name()) && !names.is_empty() {
                return Err(Error::NotAStore {
                    reason: format!(
                        "the file holds the tables {names:?} but no idempotency-store metadata"
                    ),
                });
            }
            let mut meta = txn.open_table(META)?;
            let stored = |m: &redb::Table<&str, u64>, k| -> Result<Option<u64>> {
                Ok(m.get(k)?.map(|v| v.value()))
            };
            match stored(&meta, META_FORMAT)? {
                None => {
                    meta.insert(META_FORMAT, STORE_FORMAT)?;
                    meta.insert(META_NEXT_TOKEN, 1)?;
                }
                Some(STORE_FORMAT) => {}
                Some(v) => {
                    return Err(Error::NotAStore {
                        reason: format!(
                            "store format version {v} is not supported (this build reads \
                             version {STORE_FORMAT})"
                        ),
                    });
                }
            }
            // After the format check: another format's tables may have other key types.
            txn.open_table(RECORDS)?;
            txn.open_table(EXPIRY)?;
            let applied = stored(&meta, META_LOG_SEQ)?.unwrap_or(0);
            drop(meta);
            let (log, entries) = wal::recover(opened, applied)?;
            wal::redo(&txn, entries)?;
            let mut meta = txn.open_table(META)?;
            meta.insert(META_LOG_SEQ, log.last_seq())?;
            Writer {
                log,
                counters: Counters::load(&meta)?,
            }
        };
        txn.commit()?;
        writer.log.checkpointed();
        let high_water = writer.counters.clock;
        let db = Arc::new(db);
        let overlay = Arc::new(Shared::default());
        let flusher = Flusher::start(Arc::clone(&db), Arc::clone(&overlay))?;
        Ok(Store {
            db: Some(db),
            flusher,
            committer: Committer::new(config.max_batch),
            config,
            path,
            waiters: Waiters::default(),
            writer: parking_lot::Mutex::new(writer),
            overlay,
            high_water: AtomicU64::new(high_water),
        })
    }

    /// The store's current time: the clock's time, but never earlier than any time the store
    /// has already used (also across restarts). A clock stepping back therefore makes time
    /// stand still until the clock catches up; leases never lapse early and a lease is never
    /// handed out twice.
    ///
    /// Reads and writes take this time at different moments: a write batch takes it when the
    /// batch starts and becomes visible after its log write, while a read
    /// ([`lookup`](Store::lookup), a claim's answer that writes nothing) takes it when it runs.
    /// So a read may carry a time later than that of a write it cannot see yet: the write's
    /// time is up to one batch's duration older than the moment it becomes visible. Each call
    /// is still consistent with one moment between its start and its return.
    #[must_use]
    pub fn now(&self) -> Timestamp {
        let wall = self.config.clock.now().as_millis();
        let before = self.high_water.fetch_max(wall, Ordering::SeqCst);
        Timestamp::from_millis(before.max(wall))
    }

    /// Claims `key` for the request with `fingerprint`: the first-writer-wins step.
    ///
    /// At the store's time `now`:
    /// - no record, or an expired one: the caller acquires a fresh lease (attempt 1);
    /// - a record with another fingerprint, in any state: [`Claim::Mismatch`];
    /// - in progress under a live lease: [`Claim::InProgress`];
    /// - in progress with a lapsed lease: the caller takes over (attempt + 1, new token, the
    ///   last checkpoint); the old holder's token is dead;
    /// - completed: [`Claim::Completed`] with the stored response.
    ///
    /// Answers that write nothing (replay, mismatch, in progress) come from a read transaction
    /// and never wait for the writer. A claim that acquires returns after its commit is durable.
    ///
    /// Ordering: per key, leases are granted in the order of their [tokens](Lease::token), each
    /// beginning no earlier than the previous holder's release. A lease is never handed out
    /// already lapsed: if the write took so long that the lease lapsed before the call
    /// returns, the answer is [`Claim::InProgress`] with that deadline (already past), as if
    /// another caller had won, and a retry takes the key over.
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, Key, Response, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("order-42")?;
    /// let fp = Fingerprint::of(["POST", "/orders", "{}"]);
    /// let Claim::Acquired(lease) = store.claim(&key, fp)? else { unreachable!() };
    /// store.complete(&lease, Response::new(201, "created"))?;
    /// assert!(matches!(store.claim(&key, fp)?, Claim::Completed(r) if r.response.body == b"created"));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if the key is longer than this store's `max_key_len`;
    /// [`Error::Storage`] or [`Error::Corrupted`] if the record cannot be read or written. A
    /// storage error on the write path leaves the outcome unknown: the claim may have landed
    /// (its lease then lapses normally).
    pub fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim> {
        self.check_key(key)?;
        if let Decision::Answer(answer) = decide(self.read(key)?, fingerprint, self.now()) {
            return Ok(answer);
        }
        match self.write(Op::Claim {
            key: key.clone(),
            fingerprint,
        })? {
            // The batch stamped the lease when it started; a batch that outlasted the lease
            // must not hand it out.
            Done::Claim(claim) => Ok(claim.unless_lapsed(self.now())),
            _ => Err(misrouted()),
        }
    }

    /// Stores the response for the lease's key, durably, and ends the lease. From then on
    /// claims with the same fingerprint replay it until `retention` has passed.
    ///
    /// Fenced: succeeds only while the record is in progress under this lease's token (a
    /// lapsed lease that nobody took over still completes). The lease is borrowed, not
    /// consumed, so that a response rejected as too large can be replaced by a smaller one; once
    /// the lease is settled, every further use of it fails with [`Error::LeaseLost`].
    ///
    /// To make a failure final (the client must see it again), complete with the error
    /// response; to let a retry run afresh, [`release`](Store::release) instead.
    ///
    /// # Errors
    /// [`Error::ResponseTooLarge`] (nothing written, the lease still holds);
    /// [`Error::LeaseLost`] if the key was taken over, released or expired (nothing written);
    /// [`Error::Storage`] if the commit failed (outcome unknown: look the key up).
    pub fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
        self.check_size(response.size())?;
        self.settle(Op::Complete {
            key: lease.key.clone(),
            token: lease.token,
            response,
        })
    }

    /// Deletes the lease's record so that a retry runs the operation afresh. Use it when the
    /// operation failed before any side effect. Fenced like [`complete`](Store::complete).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease no longer holds the key; [`Error::Storage`] if the
    /// commit failed.
    pub fn release(&self, lease: &Lease) -> Result<()> {
        self.settle(Op::Release {
            key: lease.key.clone(),
            token: lease.token,
        })
    }

    /// Extends the lease to `lease` (the configured duration) from now, and returns the new
    /// deadline (also recorded in `lease`). Call it from long operations well before the lease
    /// lapses.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease no longer holds the key (stop the work: another
    /// attempt owns it); [`Error::Storage`] if the commit failed.
    pub fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
        let done = self.write(Op::Heartbeat {
            key: lease.key.clone(),
            token: lease.token,
        })?;
        match done {
            Done::Heartbeat(until) => {
                lease.lease_until = until;
                Ok(until)
            }
            _ => Err(misrouted()),
        }
    }

    /// Stores a recovery point in the record. If this attempt dies, the attempt that takes the
    /// key over receives it through [`Lease::checkpoint`] and can resume instead of redoing
    /// finished steps.
    ///
    /// # Errors
    /// [`Error::ResponseTooLarge`] if `data` exceeds `max_response_bytes`;
    /// [`Error::LeaseLost`]; [`Error::Storage`].
    pub fn checkpoint(&self, lease: &mut Lease, data: impl Into<Vec<u8>>) -> Result<()> {
        let data = data.into();
        self.check_size(data.len())?;
        self.settle(Op::Checkpoint {
            key: lease.key.clone(),
            token: lease.token,
            data: data.clone(),
        })?;
        lease.checkpoint = Some(data);
        Ok(())
    }

    /// Claims `key` and, if acquired, runs `operation`: on `Ok` its response is stored, on
    /// `Err` the key is released so that a retry runs afresh. Every other claim outcome is
    /// returned without running anything.
    ///
    /// ```
    /// use idempotency_store::{Fingerprint, Key, Outcome, Response, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("sms-7")?;
    /// let fp = Fingerprint::of(["send", "+15550100", "hello"]);
    /// let send = |_: &mut _| Ok::<_, std::io::Error>(Response::new(200, "sent"));
    /// assert!(matches!(store.execute(&key, fp, send)?, Outcome::Executed(_)));
    /// assert!(matches!(store.execute(&key, fp, send)?, Outcome::Replayed(_)));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// Those of [`claim`](Store::claim) and [`complete`](Store::complete). If `operation` fails
    /// and releasing the key then fails with a storage error, that error is returned (the key
    /// then stays in progress until its lease lapses).
    pub fn execute<E, F>(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        operation: F,
    ) -> Result<Outcome<E>>
    where
        F: FnOnce(&mut Lease) -> Result<Response, E>,
    {
        crate::api::backend::IdempotencyStore::execute(self, key, fingerprint, operation)
    }

    /// The key's record, or `None` if there is none or it has expired. Runs in a read
    /// transaction and never waits for writers.
    ///
    /// The view is the last visible write judged at the store's time when the read runs; a
    /// write batch still being made durable is not visible yet, although its time (taken when
    /// the batch started) may be earlier than this read's (see [`now`](Store::now)).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a key longer than `max_key_len`; [`Error::Corrupted`] if the
    /// record does not decode; [`Error::Storage`].
    pub fn lookup(&self, key: &Key) -> Result<Option<RecordView>> {
        self.check_key(key)?;
        let now = self.now();
        Ok(self.read(key)?.filter(|r| !r.is_expired(now)).map(view))
    }

    /// The settings this store was opened with.
    #[must_use]
    pub fn settings(&self) -> &Builder {
        &self.config
    }

    /// The file behind the store, if it has one.
    #[must_use]
    pub fn path(&self) -> Option<&std::path::Path> {
        self.path.as_deref()
    }

    pub(crate) fn db(&self) -> Result<&Database> {
        self.db.as_deref().ok_or_else(|| {
            Error::storage(
                "using the store",
                std::io::Error::other("the store is closed"),
            )
        })
    }

    fn check_key(&self, key: &Key) -> Result<()> {
        key.check_len(self.config.max_key_len)
    }

    fn check_size(&self, size: usize) -> Result<()> {
        check_size(size, self.config.max_response_bytes)
    }

    pub(crate) fn read(&self, key: &Key) -> Result<Option<Record>> {
        contain("reading a record", || {
            let stored = key.as_stored();
            let known = self.overlay.with_record(stored, |bytes| {
                bytes.map(|b| Record::decode(stored, b)).transpose()
            });
            if let Some(record) = known {
                return record;
            }
            let txn = self.db()?.begin_read()?;
            let table = txn.open_table(RECORDS)?;
            let bytes = table.get(tables::record_key(key.as_stored()).as_slice())?;
            bytes
                .map(|b| Record::decode(key.as_stored(), b.value()))
                .transpose()
        })
    }

    fn settle(&self, op: Op) -> Result<()> {
        self.write(op).map(drop)
    }

    pub(crate) fn write(&self, op: Op) -> Result<Done> {
        self.committer.submit(op, |ops| self.run_batch(ops))
    }

    /// Runs one batch and fans its outcome out: per-operation results if it committed, the
    /// batch's error for every caller if it did not.
    fn run_batch(&self, ops: Vec<Op>) -> Vec<Result<Done>> {
        let settled: Vec<Option<Key>> = ops.iter().map(|op| op.settles().cloned()).collect();
        match contain("writing a batch", || self.write_batch(ops)) {
            Ok(results) => {
                for (key, result) in settled.iter().zip(&results) {
                    if let (Some(key), Ok(_)) = (key, result) {
                        self.waiters.wake(key);
                    }
                }
                results
            }
            Err(err) => settled.iter().map(|_| Err(err.clone())).collect(),
        }
    }

    fn write_batch(&self, ops: Vec<Op>) -> Result<Vec<Result<Done>>> {
        let mut writer = self.writer.lock();
        if self.layered(&ops) {
            return self.write_layered(&mut writer, ops);
        }
        self.flush_overlay(&mut writer)?;
        let txn = self.db()?.begin_write()?;
        let mut tables = Tables::direct(&txn)?;
        let (results, counters) = self.with_tables(&mut tables, writer.counters, |t, ctx| {
            apply_all(t, ctx, ops)
        })?;
        let changes = std::mem::take(&mut tables.changes);
        drop(tables);
        self.commit(txn, &mut writer, &changes, counters)?;
        Ok(results)
    }

    /// Whether a batch can run on the overlay: it must not scan the tables, which a sweep
    /// does, and so may a claim in a store with quotas (to make room).
    fn layered(&self, ops: &[Op]) -> bool {
        self.config.max_records.is_none()
            && self.config.max_bytes.is_none()
            && !ops.iter().any(Op::runs_alone)
    }

    /// Runs a batch on the overlay: once its log entry is synced its changes join the overlay,
    /// with no redb commit. If the log's half is full, the log moves to the other half; if it
    /// cannot, the batch checkpoints instead.
    fn write_layered(&self, writer: &mut Writer, ops: Vec<Op>) -> Result<Vec<Result<Done>>> {
        self.collect_flush(writer, false);
        let db = self.db()?;
        let snapshot = db.begin_read()?;
        let mut tables = Tables::layered(&snapshot, &self.overlay)?;
        let (results, counters) = self.with_tables(&mut tables, writer.counters, |t, ctx| {
            apply_all(t, ctx, ops)
        })?;
        let changes = std::mem::take(&mut tables.changes);
        let batch = tables.into_batch().unwrap_or_default();
        if changes.is_empty()
            || writer.log.append(&changes, false)?
            || (self.switch_log(writer) && writer.log.append(&changes, false)?)
        {
            self.overlay.absorb(&batch);
            writer.counters = counters;
            self.hand_over(writer)?;
            return Ok(results);
        }
        self.flush_overlay(writer)?;
        let txn = db.begin_write()?;
        let (records, index) = batch.changes();
        overlay::write(
            &txn,
            &records.collect::<Vec<_>>(),
            &index.collect::<Vec<_>>(),
        )?;
        self.commit_durably(txn, writer, counters)?;
        Ok(results)
    }

    /// Gives a full active overlay generation to the flush thread, if it is free. If it is
    /// not, the generation grows; at `OVERLAY_LIMIT` records the batch writes it itself, so a
    /// flush thread that falls behind bounds the overlay instead of the overlay growing.
    fn hand_over(&self, writer: &mut Writer) -> Result<()> {
        if self.overlay.len() < OVERLAY_RECORDS {
            return Ok(());
        }
        self.collect_flush(writer, false);
        if self.flusher.idle() && self.overlay.frozen_is_empty() {
            self.overlay.freeze();
            self.flusher.request(Job::Flush);
        } else if self.overlay.len() >= OVERLAY_LIMIT {
            self.flush_overlay(writer)?;
        }
        Ok(())
    }

    /// When the log's half is full: hands everything logged so far to the flush thread as a
    /// checkpoint, and moves the log to its other half (see `Log::switch`). False if it cannot:
    /// the other half's checkpoint or a write failed.
    fn switch_log(&self, writer: &mut Writer) -> bool {
        self.collect_flush(writer, true);
        if !self.overlay.frozen_is_empty() {
            return false;
        }
        let Some(seq) = writer.log.switch() else {
            return false;
        };
        self.overlay.freeze();
        self.flusher.request(Job::Checkpoint {
            seq,
            counters: writer.counters,
            quick_repair: self.config.durability == Durability::QuickRepair,
        });
        true
    }

    /// Takes the flush thread's report, waiting for it with `wait`: a written generation
    /// leaves the overlay, and a checkpoint frees the log's other half; a generation that
    /// failed stays, and the next batch checkpoints, which writes it (`flush_overlay`).
    fn collect_flush(&self, writer: &mut Writer, wait: bool) {
        match self.flusher.collect(wait) {
            Some((job, Ok(()))) => {
                self.overlay.clear(false);
                if matches!(job, Job::Checkpoint { .. }) {
                    writer.log.freed();
                }
            }
            Some((_, Err(_))) => writer.log.commit_failed(),
            None => {}
        }
    }

    /// Writes the whole overlay into redb in one commit without a sync (the log holds its
    /// changes) and empties it: before any transaction that writes redb's tables directly,
    /// before a walk of the tables, and when the flush thread falls behind.
    pub(crate) fn flush_overlay(&self, writer: &mut Writer) -> Result<()> {
        self.collect_flush(writer, true);
        if self.overlay.is_empty() {
            return Ok(());
        }
        let txn = self.db()?.begin_write()?;
        self.overlay
            .with_changes(true, |records, index| overlay::write(&txn, records, index))?;
        self.commit_unsynced(txn, writer)?;
        self.overlay.clear(true);
        Ok(())
    }

    /// Makes a batch durable: through the log and a commit without a sync, or, if the log
    /// cannot take the batch (full, or a write failed), as a checkpoint. The batch's
    /// `counters` become the store's once it is durable. The overlay must be empty.
    fn commit(
        &self,
        txn: WriteTransaction,
        writer: &mut Writer,
        changes: &[Change],
        counters: Counters,
    ) -> Result<()> {
        if !changes.is_empty() && !writer.log.append(changes, true)? {
            return self.commit_durably(txn, writer, counters);
        }
        self.commit_unsynced(txn, writer)?;
        writer.counters = counters;
        Ok(())
    }

    /// Commits `txn` without a sync: the log holds its changes already.
    fn commit_unsynced(&self, mut txn: WriteTransaction, writer: &mut Writer) -> Result<()> {
        txn.set_durability(redb::Durability::None)
            .map_err(|err| Error::storage("committing a batch", err))?;
        txn.commit().map_err(|err| {
            writer.log.commit_failed();
            Error::from(err)
        })
    }

    /// Commits `txn` durably with `counters` in the meta table, recording that it covers every
    /// log entry so far, and starts the log again. The overlay must be empty.
    fn commit_durably(
        &self,
        mut txn: WriteTransaction,
        writer: &mut Writer,
        counters: Counters,
    ) -> Result<()> {
        counters.checkpoint(
            &mut txn,
            writer.log.last_seq(),
            self.config.durability == Durability::QuickRepair,
        )?;
        match txn.commit() {
            Ok(()) => {
                writer.log.checkpointed();
                writer.counters = counters;
                Ok(())
            }
            Err(err) => {
                writer.log.commit_failed();
                Err(err.into())
            }
        }
    }

    /// Runs `body` on `tables` from `counters`, and returns its result and the counters after
    /// it; the changed counters join the tables' changes, last.
    fn with_tables<T>(
        &self,
        tables: &mut Tables<'_>,
        counters: Counters,
        body: impl FnOnce(&mut Tables<'_>, &mut Ctx) -> Result<T>,
    ) -> Result<(T, Counters)> {
        tables.usage = counters.usage;
        let mut ctx = Ctx {
            now: self.now(),
            lease_ms: millis(self.config.lease),
            retention_ms: millis(self.config.retention),
            next_token: counters.next_token,
            quota: Quota {
                max_records: self.config.max_records,
                max_bytes: self.config.max_bytes,
                evict_completed: self.config.when_full == WhenFull::EvictOldestCompleted,
            },
        };
        let out = body(tables, &mut ctx)?;
        let after = Counters {
            next_token: ctx.next_token,
            clock: counters.clock.max(ctx.now.as_millis()),
            usage: tables.usage,
        };
        tables.changes.extend(after.changes_since(&counters));
        Ok((out, after))
    }

    /// Runs `read` in a read transaction of the store's file, for the caller's own tables
    /// (written with [`complete_with`](Store::complete_with)). Like every read here, it sees the
    /// last durable commit and never waits for writers.
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
        let txn = contain("starting a read", || Ok(self.db()?.begin_read()?))?;
        Ok(read(&txn))
    }

    /// Like [`complete`](Store::complete), but first runs `effect` in the same redb write
    /// transaction, so the caller's own tables (a ledger, an outbox) and the stored response
    /// commit together or not at all: a crash can never leave a charge without its
    /// idempotency record, or the reverse.
    ///
    /// `effect` receives the write transaction; open your own tables in it (the
    /// [`redb`] crate is re-exported so the versions match). It runs only if the lease still
    /// holds the key. If it returns `Err`, nothing of it and no response is written, the lease
    /// still holds, and the error comes back as `Ok(Err(e))`.
    ///
    /// Cost: this call cannot share a group-commit batch (redb cannot roll back one
    /// operation inside a shared transaction), so it pays a commit of its own, and other
    /// writers wait while `effect` runs: keep it short.
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, Key, Response, Store, redb};
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
        self.check_size(response.size())?;
        let mut writer = self.writer.lock();
        let txn = contain("completing with an effect", || {
            self.flush_overlay(&mut writer)?;
            let txn = self.db()?.begin_write()?;
            self.with_tables(
                &mut Tables::direct(&txn)?,
                writer.counters,
                |tables, ctx| {
                    tables
                        .held(&lease.key, lease.token, ctx.now)
                        .map_err(Fail::into_error)
                },
            )?;
            Ok(txn)
        })?;
        if let Err(err) = effect(&txn) {
            return Ok(Err(err));
        }
        contain("completing with an effect", || {
            let op = Op::Complete {
                key: lease.key.clone(),
                token: lease.token,
                response,
            };
            let mut tables = Tables::direct(&txn)?;
            let (_, counters) = self.with_tables(&mut tables, writer.counters, |tables, ctx| {
                tables.apply(ctx, op).map_err(Fail::into_error)
            })?;
            drop(tables);
            // The effect's writes are not in the log, so this commit must be durable itself.
            self.commit_durably(txn, &mut writer, counters)
        })?;
        self.waiters.wake(&lease.key);
        Ok(Ok(()))
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // A last checkpoint, so that the next open has no log to replay.
        let _ = contain("closing the store", || {
            let mut writer = self.writer.lock();
            self.flush_overlay(&mut writer)?;
            let txn = self.db()?.begin_write()?;
            let counters = writer.counters;
            self.commit_durably(txn, &mut writer, counters)
        });
        // The thread holds the database too: it must be gone before the database is dropped.
        self.flusher.stop();
        if let Some(db) = self.db.take() {
            // redb's drop saves the allocator state and can panic on a damaged file; the error
            // is already reported by the call that met the damage.
            let _ = contain("closing the store", || {
                drop(db);
                Ok(())
            });
        }
    }
}

pub(crate) fn view(record: Record) -> RecordView {
    let state = match record.state {
        State::InProgress {
            lease_until,
            checkpoint,
            ..
        } => RecordState::InProgress {
            lease_until: Timestamp::from_millis(lease_until),
            checkpoint,
        },
        State::Completed {
            completed_at,
            response,
        } => RecordState::Completed {
            completed_at: Timestamp::from_millis(completed_at),
            response,
        },
    };
    RecordView {
        fingerprint: record.fingerprint,
        created_at: Timestamp::from_millis(record.created_at),
        expires_at: Timestamp::from_millis(record.expires_at),
        attempt: record.attempt,
        state,
    }
}

/// How many records the overlay's active generation collects before it is handed to the
/// flush thread (see `flush`). Each redb commit costs page copies, checksums and new roots, and
/// a claim and its completion that meet in one generation reach redb once. 64 threads made as
/// many pairs per second at 128 as at 256 (23,425 and 23,214 against 21,085 and 22,657), and
/// the larger commits cost resident memory: peak RSS with 10^6 records 59.4 MiB at 128, 67.1
/// at 256.
const OVERLAY_RECORDS: usize = 128;

/// The active generation's size at which a batch writes the overlay itself, because the flush
/// thread is still busy with the last one.
const OVERLAY_LIMIT: usize = 4 * OVERLAY_RECORDS;

/// Applies a batch's operations in order: an operation's own failure is its result, a storage
/// failure fails the batch.
fn apply_all(tables: &mut Tables<'_>, ctx: &mut Ctx, ops: Vec<Op>) -> Result<Vec<Result<Done>>> {
    let mut results = Vec::with_capacity(ops.len());
    for op in ops {
        match tables.apply(ctx, op) {
            Ok(done) => results.push(Ok(done)),
            Err(Fail::Op(err)) => results.push(Err(err)),
            Err(Fail::Batch(err)) => return Err(err),
        }
    }
    Ok(results)
}

/// A batch answered an operation with another operation's kind of result: a bug in this crate.
pub(crate) fn misrouted() -> Error {
    Error::storage(
        "dispatching a write",
        std::io::Error::other("internal error: result of the wrong kind; please report it"),
    )
}
