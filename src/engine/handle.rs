//! The engine behind a redb `Store`: one file's database, write-ahead log, overlay, flush
//! thread and group commit, behind a small typed interface (open, read, write a call, sweep,
//! complete with an effect, take a consistent snapshot).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use redb::{Database, ReadTransaction, ReadableDatabase, WriteTransaction};

use crate::api::clock::Timestamp;
use crate::api::key::Key;
use crate::api::metrics::EngineMetrics;
use crate::api::record::Record;
use crate::engine::apply;
use crate::engine::batch::{Access, Ctx, Direct, Fail, Quota, Tables};
use crate::engine::commit::{Appoint, Batch, Committer, Job, Pending, Slot, SweepCall, Waiting};
use crate::engine::config::Config;
use crate::engine::contain::{contain, contain_then};
use crate::engine::effects::{EffectScope, Registry, not_in_effect};
use crate::engine::flush::{Flusher, Task};
use crate::engine::format::check_tables;
use crate::engine::generation::{Generation, OVERLAY_LIMIT, Unlogged};
use crate::engine::meta::{Counters, KEPT_FORMAT, META, META_FORMAT, META_LOG_SEQ, STORE_FORMAT};
use crate::engine::ops::{Complete, Write};
use crate::engine::overlay::{self, Overlay, Shared};
use crate::engine::poison::Poison;
use crate::engine::redo;
use crate::engine::scan::Pace;
use crate::engine::snapshot::Snapshots;
use crate::engine::stats::EngineStats;
use crate::engine::tables::RecordsRead;
use crate::engine::wal::{self, Change, Log, LogFile};
use crate::error::{Error, Result};

pub(crate) struct Engine {
    /// Always `Some` until the engine is dropped; an `Option` so that `Drop` can contain a
    /// panic of redb's own drop on a damaged file.
    db: Option<Arc<Database>>,
    config: Config,
    pub(super) committer: Committer,
    /// The log and the counters; locked by the holder of redb's write transaction for as long
    /// as it holds it.
    writer: Mutex<Writer>,
    /// Changes the log holds but redb's tables do not yet; changed only under the writer lock.
    pub(super) overlay: Arc<Shared>,
    /// The read snapshot of redb under the overlay that reads share (see `snapshot`).
    pub(super) snapshots: Arc<Snapshots>,
    /// Writes full overlay generations into redb; see `flush`.
    pub(super) flusher: Flusher,
    /// When a generation is full (see `hand_over`).
    generation: Generation,
    /// The highest time the engine has used; its clock never goes below it.
    high_water: AtomicU64,
    /// Set by a failure that may have lost data; every write checks it (see `poison`).
    pub(super) poison: Arc<Poison>,
    /// Batches, log writes and merges, for `Store::metrics`.
    pub(crate) stats: Arc<EngineStats>,
    /// Where the next sweep step starts and how large it may be; held for a whole sweep
    /// (see `sweep`).
    pub(super) sweep_pace: Mutex<Pace>,
}

/// What the holder of redb's write transaction works with besides the tables.
struct Writer {
    log: Log,
    /// The meta table's counters as of the last commit (see `Counters`).
    counters: Counters,
    /// Expired records deleted without a log entry since the last merge was handed over.
    unlogged: Unlogged,
    /// An empty overlay for the next layered batch's changes, kept with its capacity (see
    /// `Overlay::clear`): a fresh one for each batch cost about ten allocations and their
    /// frees, which contend for glibc's arena locks across the runtime's threads.
    batch: Overlay,
    /// Tests only: the batch after this many more successful log writes panics once its
    /// entry is written, before its changes reach the overlay or redb.
    #[cfg(test)]
    panic_after_log: Option<u64>,
}

impl Writer {
    /// A batch's log entry is durable: the point at which an injected panic fires (tests).
    #[cfg(test)]
    #[allow(clippy::panic)]
    fn logged(&mut self) {
        match self.panic_after_log.as_mut() {
            Some(0) => {
                self.panic_after_log = None;
                panic!("injected panic after the log write");
            }
            Some(left) => *left -= 1,
            None => {}
        }
    }

    #[cfg(not(test))]
    fn logged(&mut self) {}
}

/// How full the log's half is when a batch may switch halves early, provided the flush thread
/// is idle. A switch at a full half has to wait for the thread's write in progress to free the
/// frozen generation, with the group-commit leader and every caller queued behind it. Switching
/// at 7/8 with the thread idle took most of those waits away, for a few more merges
/// (BENCHMARKS.md, "Figures behind the defaults").
const SWITCH_EARLY: (u64, u64) = (7, 8);

impl Engine {
    /// Sets up the tables of a new store in `db`, or checks an existing one's, and replays the
    /// log entries written after the last merge; the commit that ends it is a merge.
    pub(crate) fn init(db: Database, log_file: LogFile, config: Config) -> Result<Engine> {
        let poison = Arc::clone(&log_file.poison);
        let generation = if config.in_memory {
            Generation::in_memory()
        } else {
            Generation::for_log(log_file.region.log_len)
        };
        let mut txn = db.begin_write()?;
        txn.set_quick_repair(config.quick_repair);
        let mut writer = {
            let applied = check_tables(&txn)?;
            let (log, entries) = wal::recover(log_file, applied)?;
            crate::api::trace::recovered(entries.len());
            let kept = redo::redo(&txn, entries, &config.effects, config.unregistered)?;
            let mut meta = txn.open_table(META)?;
            meta.insert(META_LOG_SEQ, log.last_seq())?;
            meta.insert(META_FORMAT, if kept { KEPT_FORMAT } else { STORE_FORMAT })?;
            Writer {
                log,
                counters: Counters::load(&meta)?,
                unlogged: Unlogged {
                    count: 0,
                    bound: generation.unlogged,
                },
                batch: Overlay::default(),
                #[cfg(test)]
                panic_after_log: None,
            }
        };
        txn.commit()?;
        writer.log.merged();
        let high_water = writer.counters.clock;
        let db = Arc::new(db);
        let overlay = Arc::new(Shared::new(Arc::clone(&config.effects)));
        let stats = Arc::new(EngineStats::default());
        let snapshots = Arc::new(Snapshots::default());
        let flusher = Flusher::start(
            Arc::clone(&db),
            Arc::clone(&overlay),
            Arc::clone(&snapshots),
            Arc::clone(&poison),
            Arc::clone(&stats),
        )?;
        Ok(Engine {
            db: Some(db),
            flusher,
            generation,
            committer: Committer::new(config.max_batch),
            config,
            writer: Mutex::new(writer),
            overlay,
            snapshots,
            high_water: AtomicU64::new(high_water),
            poison,
            stats,
            sweep_pace: Mutex::default(),
        })
    }

    /// The engine's counters and the overlay's size now.
    pub(crate) fn metrics(&self) -> EngineMetrics {
        let (overlay_records, overlay_bytes) = self.overlay.size();
        EngineMetrics {
            overlay_records,
            overlay_bytes,
            sweep_shared_calls: self.committer.carried(),
            ..self.stats.snapshot()
        }
    }

    /// The clock's time, but never earlier than any time the engine has already used (also
    /// across restarts).
    pub(crate) fn now(&self) -> Timestamp {
        let wall = self.config.clock.now().as_millis();
        // A load first: the mark moves at most once a millisecond, and a read-modify-write on
        // every call would make all cores take the line in turn.
        let seen = self.high_water.load(Ordering::SeqCst);
        if wall <= seen {
            return Timestamp::from_millis(seen);
        }
        let before = self.high_water.fetch_max(wall, Ordering::SeqCst);
        Timestamp::from_millis(before.max(wall))
    }

    pub(super) fn db(&self) -> Result<&Database> {
        self.db.as_deref().ok_or_else(|| {
            Error::storage(
                "using the store",
                std::io::Error::other("the store is closed"),
            )
        })
    }

    /// A read transaction on the last durable commit; it never waits for writers.
    pub(crate) fn begin_read(&self) -> Result<ReadTransaction> {
        Ok(self.db()?.begin_read()?)
    }

    /// A read transaction whose tables hold every acknowledged write, and the counters that
    /// match them exactly: the overlay is flushed first, under the writer lock.
    pub(crate) fn snapshot(&self) -> Result<(ReadTransaction, Counters)> {
        not_in_effect()?;
        let mut writer = self.writer.lock();
        self.flush_overlay(&mut writer)?;
        Ok((self.db()?.begin_read()?, writer.counters))
    }

    /// A read transaction whose effect tables hold every acknowledged effect row: if the
    /// overlay holds any, it is flushed first (a caller's reads go through redb's own API, which
    /// cannot see the overlay). Otherwise, like `begin_read`, it never waits for writers.
    pub(crate) fn begin_read_effects(&self) -> Result<ReadTransaction> {
        if self.overlay.has_effects() {
            not_in_effect()?;
            let mut writer = self.writer.lock();
            self.flush_overlay(&mut writer)?;
        }
        self.begin_read()
    }

    /// The key's record, expired or not.
    pub(crate) fn read(&self, key: &Key) -> Result<Option<Record>> {
        Ok(self.read_found(key)?.0)
    }

    /// Like [`read`](Self::read), and if the key is in neither the overlay nor redb, the
    /// counter of the snapshot that showed it absent (see `ops::ClaimKey::absent_at`).
    pub(crate) fn read_found(&self, key: &Key) -> Result<(Option<Record>, Option<u64>)> {
        contain("reading a record", || {
            let stored = key.as_stored();
            let snapshot = self.snapshots.get(self.db()?)?;
            let known = self.overlay.with_record(stored, |bytes| {
                bytes.map(|b| Record::decode(stored, b)).transpose()
            });
            if let Some(record) = known {
                return Ok((record?, None));
            }
            let decode = |b: &[u8]| Record::decode(stored, b);
            let found = snapshot.records.with(stored, decode)?;
            if self.snapshots.current(&snapshot) {
                let absent_at = found.is_none().then(|| Snapshots::epoch(&snapshot));
                return Ok((found.transpose()?, absent_at));
            }
            // redb changed under the overlay meanwhile: a snapshot begun after the overlay's
            // answer holds whatever the overlay no longer does.
            let txn = self.db()?.begin_read()?;
            let found = RecordsRead::open(&txn)?.with(stored, decode)?;
            Ok((found.transpose()?, None))
        })
    }

    /// The value bytes of `key` in the effect table at position `table`, as acknowledged: the
    /// overlay first, then redb (as [`read`](Self::read) does for records). Never flushes.
    pub(crate) fn read_effect(&self, table: usize, key: &[u8]) -> Result<Option<Vec<u8>>> {
        contain("reading an effect row", || {
            let at = overlay::effect_key(table, key);
            let known = self
                .overlay
                .with_effect(&at, |bytes| bytes.map(<[u8]>::to_vec));
            if let Some(known) = known {
                return Ok(known);
            }
            let txn = self.db()?.begin_read()?;
            self.config.effects.table(table)?.get_at(&txn, key)
        })
    }

    /// The effect tables this store was opened with.
    pub(crate) fn effect_tables(&self) -> &Registry {
        &self.config.effects
    }

    /// Runs `write` in a group-commit batch and returns its result once the batch is durable.
    pub(crate) fn write<W: Write>(&self, write: W) -> Result<W::Output> {
        self.writable()?;
        not_in_effect()?;
        self.poison.check()?;
        let slot = Arc::new(Slot::default());
        let job = Job::write(write, Arc::clone(&slot));
        self.committer
            .submit(job, &slot, |batch| self.run_batch(batch))
    }

    /// Like [`write`](Self::write), for a caller that must not block: `write` is queued at
    /// once and the returned future is woken with its result once the batch is durable. If
    /// the call must lead its batch, `appoint` is called to have [`lead`](Self::lead) run on a
    /// thread that may block (see `commit::Appoint`); in memory, where a batch does no I/O,
    /// the caller leads on its own thread instead.
    pub(crate) fn write_async<W: Write>(
        &self,
        write: W,
        appoint: Appoint,
    ) -> Result<Waiting<W::Output>> {
        self.writable()?;
        not_in_effect()?;
        self.poison.check()?;
        let slot = Arc::new(Slot::default());
        let job = Job::write_async(write, Arc::clone(&slot), appoint);
        if self.config.in_memory && !self.flush_behind() {
            let run = |batch: &mut Batch| self.run_batch(batch);
            return Ok(self.committer.enqueue_inline(job, slot, &run));
        }
        Ok(self.committer.enqueue(job, slot))
    }

    /// Whether the active overlay generation has grown to twice its size while the flush
    /// thread was busy. A batch that finds it at [`OVERLAY_LIMIT`] waits for the thread and
    /// writes the overlay itself (`hand_over`): in memory, up to 65,536 records, hundreds of
    /// milliseconds that must not fall on an async runtime's thread. So past two generations
    /// async callers go to a leader on the blocking pool. An inline leader leads at most
    /// `INLINE_BATCHES` batches: with the default `max_batch` (128 calls) and batches of at
    /// most 4 MiB of responses, too little to take the overlay from under two generations to
    /// four.
    fn flush_behind(&self) -> bool {
        let size = (self.overlay.len(), self.overlay.bytes());
        self.generation.reached(2, size)
    }

    /// Leads the batches of appointed async callers (see `write_async`). Blocks for as long
    /// as it leads.
    pub(crate) fn lead(&self) {
        self.committer.lead_async(&|batch| self.run_batch(batch));
    }

    /// `Err(Error::ReadOnly)` for a store opened read-only.
    pub(crate) fn writable(&self) -> Result<()> {
        if self.config.read_only {
            return Err(Error::ReadOnly);
        }
        Ok(())
    }

    /// Runs one batch; `Ok` once it is durable.
    pub(super) fn run_batch(&self, batch: &mut Batch) -> Result<()> {
        let _span = crate::api::trace::enter!("batch", "redb");
        self.stats.batch(match batch {
            Batch::Writes(writes) => writes.len(),
            Batch::Sweep(_) => 1,
        });
        contain_then(
            "writing a batch",
            || {
                let mut writer = self.writer.lock();
                // Queued before the store was poisoned, perhaps, but must not run after.
                self.poison.check()?;
                match (batch, self.config.quota) {
                    (Batch::Writes(writes), None) => self.write_layered(&mut writer, writes),
                    (Batch::Writes(writes), Some(quota)) => {
                        self.write_direct(&mut writer, Some(quota), |tables, ctx| {
                            writes
                                .iter_mut()
                                .try_for_each(|w| w.apply_direct(tables, ctx))
                        })
                    }
                    (Batch::Sweep(sweep), quota) => {
                        self.write_direct(&mut writer, quota, |t, ctx| {
                            SweepCall::apply(sweep, t, ctx.now)
                        })
                    }
                }
            },
            |err| self.poison_after(err),
        )
    }

    /// Poisons the store after a panic cut its write path off halfway.
    fn poison_after(&self, err: &Error) {
        self.poison.set(Arc::new(err.clone()));
    }

    /// Runs `body` in a write transaction on redb's tables (after flushing the overlay into
    /// them) and makes it durable.
    fn write_direct(
        &self,
        writer: &mut Writer,
        quota: Option<Quota>,
        body: impl FnOnce(&mut Tables<Direct<'_>>, &mut Ctx) -> Result<()>,
    ) -> Result<()> {
        self.flush_overlay(writer)?;
        let txn = self.db()?.begin_write()?;
        let mut tables = Tables::direct(&txn, &self.config.effects, quota)?;
        let counters = self.with_tables(&mut tables, writer.counters, body)?;
        let changes = std::mem::take(&mut tables.changes);
        writer.unlogged.add(tables.expired_unlogged);
        drop(tables);
        self.commit(txn, writer, &changes, counters)
    }

    /// Runs a batch on the overlay: once its log entry is synced its changes join the overlay,
    /// with no redb commit. If the log's half is full, the log moves to the other half; if it
    /// cannot, the batch merges instead.
    fn write_layered(&self, writer: &mut Writer, writes: &mut [Box<dyn Pending>]) -> Result<()> {
        self.collect_flush(writer, false);
        let db = self.db()?;
        // Under the writer lock nothing changes redb's part (see `snapshot`).
        let snapshot = self.snapshots.get(db)?;
        let scratch = std::mem::take(&mut writer.batch);
        let mut tables = Tables::layered(&snapshot, &self.overlay, scratch);
        // A store in memory keeps no log: nothing of it outlives the `Store`, so an entry
        // (the changes collected, encoded, checksummed and copied into memory; BENCHMARKS.md,
        // "Figures behind the defaults", has their share of an in-memory POST) would protect
        // nothing, and without it the log never fills and never forces a merge (see
        // `generation_task`).
        if self.config.in_memory {
            tables = tables.unlogged();
        }
        let counters = self.with_tables(&mut tables, writer.counters, |tables, ctx| {
            writes
                .iter_mut()
                .try_for_each(|w| w.apply_layered(tables, ctx))
        })?;
        let changes = std::mem::take(&mut tables.changes);
        let unlogged = tables.expired_unlogged;
        let mut batch = tables.into_batch();
        if !changes.is_empty() || unlogged > 0 {
            self.switch_early(writer);
        }
        if changes.is_empty()
            || writer.log.append(&changes, false)?
            || (self.switch_log(writer) && writer.log.append(&changes, false)?)
        {
            // Counted only when an entry was written: never in memory (see above).
            if !changes.is_empty() {
                self.stats.log_write();
            }
            writer.logged();
            self.overlay.absorb(&batch);
            batch.clear();
            writer.batch = batch;
            writer.counters = counters;
            writer.unlogged.add(unlogged);
            return self.hand_over(writer);
        }
        self.flush_overlay(writer)?;
        let txn = db.begin_write()?;
        apply::write(&txn, &mut batch.changes(), &self.config.effects)?;
        self.commit_durably(txn, writer, counters)
    }

    /// Gives a full active overlay generation to the flush thread, if it is free. If it is
    /// not, the generation grows; at four generations the batch writes it itself, so a flush
    /// thread that falls behind bounds the overlay instead of the overlay growing.
    fn hand_over(&self, writer: &mut Writer) -> Result<()> {
        let size = (self.overlay.len(), self.overlay.bytes());
        if !self.generation.reached(1, size) {
            return Ok(());
        }
        self.collect_flush(writer, false);
        if self.flusher.idle() && self.overlay.frozen_is_empty() {
            self.overlay.freeze();
            self.flusher.request(self.generation_task(writer));
        } else if self.generation.reached(OVERLAY_LIMIT, size) {
            self.flush_overlay(writer)?;
        }
        Ok(())
    }

    /// What the flush thread does with a full generation: a commit without a sync, which the
    /// log covers. In memory there is no log to fill and force merges, and redb gives back the
    /// pages that unsynced commits free from its last durable state only at a durable commit,
    /// so there every generation is a merge (whose sync costs nothing there): a store that
    /// never merged would keep the pages of every record it ever rewrote.
    fn generation_task(&self, writer: &Writer) -> Task {
        if !self.config.in_memory {
            return Task::Flush;
        }
        Task::Merge {
            seq: writer.log.last_seq(),
            counters: self.with_high_water(writer.counters),
            quick_repair: self.config.quick_repair,
        }
    }

    /// Switches the log's halves before the half is full (see [`SWITCH_EARLY`]), if the flush
    /// thread is idle: at a full half the switch must wait for whatever the thread is writing.
    /// Also when sweeps have deleted enough records without a log entry since the last merge
    /// (see `Generation::unlogged`), which fill no half.
    fn switch_early(&self, writer: &mut Writer) {
        let due = writer.log.filled(SWITCH_EARLY) || writer.unlogged.due();
        if due && self.flusher.idle() && self.overlay.frozen_is_empty() {
            self.switch_log(writer);
        }
    }

    /// When the log's half is full: hands everything logged so far to the flush thread as a
    /// merge, and moves the log to its other half (see `Log::switch`). False if it cannot:
    /// the other half's merge or a write failed.
    fn switch_log(&self, writer: &mut Writer) -> bool {
        self.collect_flush(writer, true);
        if !self.overlay.frozen_is_empty() {
            return false;
        }
        let Some(seq) = writer.log.switch() else {
            return false;
        };
        self.overlay.freeze();
        self.flusher.request(Task::Merge {
            seq,
            counters: self.with_high_water(writer.counters),
            quick_repair: self.config.quick_repair,
        });
        writer.unlogged.merged();
        true
    }

    /// Takes the flush thread's report, waiting for it with `wait`: a written generation
    /// leaves the overlay, and a merge frees the log's other half; a generation that failed
    /// stays, and the next batch merges, which writes it (`flush_overlay`).
    fn collect_flush(&self, writer: &mut Writer, wait: bool) {
        match self.flusher.collect(wait) {
            Some((task, Ok(()))) => {
                self.snapshots.change(|| self.overlay.clear(false));
                if matches!(task, Task::Merge { .. }) {
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
    fn flush_overlay(&self, writer: &mut Writer) -> Result<()> {
        self.poison.check()?;
        self.collect_flush(writer, true);
        if self.overlay.is_empty() {
            return Ok(());
        }
        let txn = self.db()?.begin_write()?;
        self.overlay.with_changes(true, |changes| {
            apply::write(&txn, changes, &self.config.effects)
        })?;
        self.commit_unsynced(txn, writer)?;
        self.snapshots.change(|| self.overlay.clear(true));
        Ok(())
    }

    /// Makes a batch durable: through the log and a commit without a sync, or, if the log
    /// cannot take the batch (full, or a write failed) or sweeps' deletions without a log
    /// entry are due a merge (see `Generation::unlogged`), as a merge. The batch's `counters`
    /// become the engine's once it is durable. The overlay must be empty.
    fn commit(
        &self,
        txn: WriteTransaction,
        writer: &mut Writer,
        changes: &[Change],
        counters: Counters,
    ) -> Result<()> {
        if writer.unlogged.due() || (!changes.is_empty() && !writer.log.append(changes, true)?) {
            return self.commit_durably(txn, writer, counters);
        }
        if !changes.is_empty() {
            self.stats.log_write();
            writer.logged();
        }
        self.commit_unsynced(txn, writer)?;
        writer.counters = counters;
        Ok(())
    }

    /// Commits `txn` without a sync: the log holds its changes already.
    fn commit_unsynced(&self, mut txn: WriteTransaction, writer: &mut Writer) -> Result<()> {
        txn.set_durability(redb::Durability::None)
            .map_err(|err| Error::storage("committing a batch", err))?;
        self.snapshots.change(|| txn.commit()).map_err(|err| {
            writer.log.commit_failed();
            Error::from(err)
        })
    }

    /// `counters` with the clock's high-water mark raised to every time the engine has used,
    /// reads included, for a merge: a lookup that saw a record expire must not see it live
    /// again after a reopen with a clock slightly behind.
    fn with_high_water(&self, counters: Counters) -> Counters {
        Counters {
            clock: counters.clock.max(self.high_water.load(Ordering::SeqCst)),
            ..counters
        }
    }

    /// Commits `txn` durably as a merge: with `counters` in the meta table, recording that it
    /// covers every log entry so far, and starts the log again. The overlay must be empty.
    fn commit_durably(
        &self,
        mut txn: WriteTransaction,
        writer: &mut Writer,
        counters: Counters,
    ) -> Result<()> {
        let counters = self.with_high_water(counters);
        let started = std::time::Instant::now();
        counters.merge(&mut txn, writer.log.last_seq(), self.config.quick_repair)?;
        match self.snapshots.change(|| txn.commit()) {
            Ok(()) => {
                self.stats.merged(started);
                writer.log.merged();
                writer.counters = counters;
                writer.unlogged.merged();
                Ok(())
            }
            Err(err) => {
                writer.log.commit_failed();
                Err(err.into())
            }
        }
    }

    /// Runs `body` on `tables` from `counters`, and returns the counters after it; the changed
    /// counters join the tables' changes, last.
    fn with_tables<A: Access>(
        &self,
        tables: &mut Tables<A>,
        counters: Counters,
        body: impl FnOnce(&mut Tables<A>, &mut Ctx) -> Result<()>,
    ) -> Result<Counters> {
        tables.usage = counters.usage;
        let mut ctx = Ctx {
            now: self.now(),
            lease_ms: self.config.lease_ms,
            retention_ms: self.config.retention_ms,
            next_token: counters.next_token,
        };
        body(tables, &mut ctx)?;
        let after = Counters {
            next_token: ctx.next_token,
            clock: counters.clock.max(ctx.now.as_millis()),
            usage: tables.usage,
        };
        if tables.logged {
            tables.changes.extend(
                after
                    .changed_since(&counters)
                    .map(|(counter, value)| Change::Counter { counter, value }),
            );
        }
        Ok(after)
    }

    /// Runs `complete` and `effect` in one write transaction of their own, committed durably:
    /// `effect` runs only if the lease still holds, and if it fails nothing is written and its
    /// error comes back inside `Ok`.
    pub(crate) fn complete_with<E>(
        &self,
        complete: Complete,
        effect: impl FnOnce(&WriteTransaction) -> std::result::Result<(), E>,
    ) -> Result<std::result::Result<(), E>> {
        self.writable()?;
        not_in_effect()?;
        let mut writer = self.writer.lock();
        let txn = contain_then(
            "completing with an effect",
            || {
                self.flush_overlay(&mut writer)?;
                let txn = self.db()?.begin_write()?;
                let tables = Tables::direct(&txn, &self.config.effects, None)?;
                let held = complete
                    .held_or_settled(&tables, self.now())
                    .map_err(fail_error)?;
                drop(tables);
                Ok(held.map(|_| txn))
            },
            |err| self.poison_after(err),
        )?;
        // A retry that found its own completion: the effect committed with it already.
        let Some(txn) = txn else {
            return Ok(Ok(()));
        };
        let effect = {
            let _inside = EffectScope::enter();
            effect(&txn)
        };
        if let Err(err) = effect {
            return Ok(Err(err));
        }
        contain_then(
            "completing with an effect",
            || {
                let mut tables = Tables::direct(&txn, &self.config.effects, None)?;
                let counters = self.with_tables(&mut tables, writer.counters, |tables, ctx| {
                    complete.apply(tables, ctx).map_err(fail_error)
                })?;
                drop(tables);
                // The effect's writes are not in the log, so this commit must be durable.
                self.commit_durably(txn, &mut writer, counters)
            },
            |err| self.poison_after(err),
        )?;
        Ok(Ok(()))
    }
}

impl Engine {
    /// A last merge, so that the next open has no log to replay, then the flush thread and
    /// the file are closed. Runs once, from `close` or from `Drop`: after it, the database
    /// is gone.
    pub(crate) fn close(&mut self) -> Result<()> {
        if self.db.is_none() {
            return Ok(());
        }
        // A read-only store wrote nothing but its open's replay, into memory: nothing to merge.
        let merge = if self.config.read_only {
            Ok(())
        } else {
            self.final_merge()
        };
        // The thread holds the database too: it must be gone before the database is closed,
        // and so must the shared read snapshot.
        self.flusher.stop();
        self.snapshots.change(|| ());
        let closed = match self.db.take() {
            // redb's close saves the allocator state and can panic on a damaged file.
            Some(db) => contain("closing the store", || match Arc::try_unwrap(db) {
                Ok(db) => Ok(db.close()?),
                Err(_) => Ok(()),
            }),
            None => Ok(()),
        };
        merge.and(closed)
    }

    /// The close's merge, so that the next open has no log to replay.
    fn final_merge(&mut self) -> Result<()> {
        contain_then(
            "closing the store",
            || {
                let mut writer = self.writer.lock();
                self.flush_overlay(&mut writer)?;
                let txn = self.db()?.begin_write()?;
                let counters = writer.counters;
                self.commit_durably(txn, &mut writer, counters)
            },
            |err| self.poison_after(err),
        )
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Best effort: `Store::close` is the way to see the error (the last merge only spares
        // the next open a replay).
        let _ = self.close();
    }
}

/// A failure of the one call of a transaction of its own: whatever its kind, it is the call's.
fn fail_error(fail: Fail) -> Error {
    match fail {
        Fail::Op(err) | Fail::Batch(err) => err,
    }
}

#[cfg(test)]
impl Engine {
    /// Arms (or disarms) a failure of the log handle's writes; see `wal::LogFault`.
    pub(crate) fn set_log_fault(&self, fault: Option<wal::LogFault>) {
        self.writer.lock().log.fault = fault;
    }

    /// The armed log fault, if it has not fired.
    pub(crate) fn log_fault(&self) -> Option<wal::LogFault> {
        self.writer.lock().log.fault
    }

    /// Arms (or disarms) a panic in the batch after `log_writes` more successful log
    /// writes, once its entry is written (see `Writer::logged`).
    pub(crate) fn set_panic_after_log(&self, log_writes: Option<u64>) {
        self.writer.lock().panic_after_log = log_writes;
    }

    /// Sets how many deletions without a log entry make a merge due (see `Unlogged`).
    pub(crate) fn set_unlogged_bound(&self, bound: usize) {
        self.writer.lock().unlogged.bound = bound;
    }

    /// The successful log writes left before the armed panic, if it has not fired.
    pub(crate) fn panic_after_log(&self) -> Option<u64> {
        self.writer.lock().panic_after_log
    }

    /// Where the log writes: the start of its half, the next entry's position and the end
    /// of the half, from the start of the log region.
    pub(crate) fn log_at(&self) -> (u64, u64, u64) {
        self.writer.lock().log.at()
    }
}
