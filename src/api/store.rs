//! The calls every store answers, [`IdempotencyStore`], written once for every [`Backend`]:
//! each call is counted and traced here, around the backend's own; and `execute`, built on
//! them, with every store call whose outcome is unknown retried once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::backend::Backend;
use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::{Call, Metrics};
use crate::api::nonblocking::{AsyncStore, Counted};
use crate::api::outcome::{Claim, ClaimId, ForceRelease, Lease, RecordView, Replay};
use crate::api::records::Records;
use crate::api::report::{Stats, VerifyReport};
use crate::api::response::Response;
use crate::api::settings::Settings;
use crate::api::trace;
use crate::error::{Error, Result};

/// Keeps [`IdempotencyStore`] to the types that are a [`Backend`], so that its calls are
/// counted the same way on every store.
mod sealed {
    pub trait Sealed {}
    impl<B: super::Backend + ?Sized> Sealed for B {}
}

/// The operations of an idempotency store, with the same types, outcomes and metrics on every
/// backend: the embedded redb [`Store`](crate::Store) and, with the `postgres` feature,
/// `PgStore`. Import it to call them (`use idempotency_store::IdempotencyStore;`).
///
/// Code written against this trait switches backends by changing only how the store is
/// opened:
///
/// ```
/// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, Response, Store};
///
/// fn charge(store: &impl IdempotencyStore, key: &Key) -> idempotency_store::Result<u16> {
///     let fp = Fingerprint::of(["POST", "/payments", "4999"]);
///     Ok(match store.execute(key, fp, |_| Ok::<_, ()>(Response::new(201, "charged")))? {
///         Claim::Acquired(Ok(response)) => response.status,
///         Claim::Acquired(Err(())) => 502,
///         Claim::Completed(replay) => replay.response.status,
///         Claim::InProgress { .. } => 409,
///         Claim::Mismatch { .. } => 422,
///     })
/// }
///
/// let store = Store::builder().open_in_memory()?; // or PgStore::builder().connect(url)?
/// let key = Key::new("pay-1")?;
/// assert_eq!(charge(&store, &key)?, 201);
/// assert_eq!(charge(&store, &key)?, 201); // replayed, not charged again
/// # Ok::<(), idempotency_store::Error>(())
/// ```
///
/// The trait is dyn-compatible: a `Box<dyn IdempotencyStore>` or `Arc<dyn IdempotencyStore>`
/// chosen at run time offers every method but the generic
/// [`execute`](IdempotencyStore::execute), which [`execute`](crate::execute) offers for any
/// store, a trait object included. `Arc<S>`, `Box<S>` and `&S` of a store are stores too.
///
/// Every type that implements [`Backend`](crate::backend::Backend) implements this trait, and
/// only those: the counting and the spans around each call are written once, here.
pub trait IdempotencyStore: sealed::Sealed + Send + Sync {
    /// The settings this store shares with every backend, as it was opened with them.
    fn settings(&self) -> &Settings;

    /// The store's current time, the one its leases and expiry are counted in (for example to
    /// turn a lease's end into a `Retry-After`, or to tell whether a record from
    /// [`inspect`](IdempotencyStore::inspect) has expired).
    ///
    /// The redb [`Store`](crate::Store) answers from memory and never fails: the clock's time,
    /// but never earlier than any time the store has already used (also across restarts), so
    /// a clock stepping back makes time stand still until it catches up and a lease is never
    /// handed out twice. The times of write calls are logged with them, and every merge and
    /// the close persist the highest time used by any call, reads included; after a crash, a
    /// time seen only by reads since the last merge may be forgotten, so with the clock behind
    /// it at reopen, a record such a read saw expire can be seen live again until the clock
    /// passes its expiry. A read may carry a time later than that of a write it cannot see yet
    /// (a write batch takes its time when it starts); each call is still consistent with one
    /// moment between its start and its return.
    ///
    /// `PgStore` (feature `postgres`) asks the database server (one round trip), or its
    /// injected clock (never going backwards within the store).
    ///
    /// # Errors
    /// [`Error::Storage`] if the backend has to ask a server for its time and cannot.
    fn now(&self) -> Result<Timestamp>;

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
    /// On the redb store, answers that write nothing (replay, mismatch, in progress) come from
    /// a read transaction, or for a key replayed before from memory, and never wait for the
    /// writer. A claim that acquires returns after its commit is durable.
    ///
    /// Ordering: per key, leases are granted in the order of their [tokens](Lease::token), each
    /// beginning no earlier than the previous holder's release. A lease is never handed out
    /// already lapsed: if the write took so long that the lease lapsed before the call
    /// returns, the answer is [`Claim::InProgress`] with that deadline (already past), as if
    /// another caller had won, and a retry takes the key over.
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, Response, Store};
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
    /// [`Error::InvalidKey`] if the key or scope is longer than the store's `max_key_len`;
    /// [`Error::QuotaExceeded`] if a quota refuses a new record; [`Error::Storage`] (or
    /// [`Error::Corrupted`]) if the record cannot be read or written. After a storage error
    /// on the write path the claim may have landed; its lease then lapses normally (or use
    /// [`claim_with_id`](IdempotencyStore::claim_with_id) to get it back).
    fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim>;

    /// Like [`claim`](IdempotencyStore::claim), and recoverable: the record remembers `id`,
    /// and a later claim with the same key, fingerprint and `id` that finds the record still in
    /// progress under the lease this id won gets that lease back ([`Claim::Acquired`], same
    /// token, same deadline, same attempt, same checkpoint) instead of [`Claim::InProgress`].
    ///
    /// Use it when a claim failed with an error whose outcome is unknown
    /// ([`Error::outcome_unknown`]): the claim may have won the key and only its answer was
    /// lost. Retrying with the same id either gets that lease back or claims afresh; without an
    /// id the key would answer "in progress" to its own winner until the lease lapsed.
    ///
    /// ```
    /// use idempotency_store::{Claim, ClaimId, Fingerprint, IdempotencyStore, Key, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let (key, fp, id) = (Key::new("order-9")?, Fingerprint::of(["POST /orders"]), ClaimId::random());
    /// let Claim::Acquired(won) = store.claim_with_id(&key, fp, id)? else { unreachable!() };
    /// // Say that answer was lost: the same id gets the same lease back ...
    /// let Claim::Acquired(again) = store.claim_with_id(&key, fp, id)? else { unreachable!() };
    /// assert_eq!(again.token(), won.token());
    /// // ... and any other caller hears that the key is in progress.
    /// assert!(matches!(store.claim_with_id(&key, fp, ClaimId::random())?, Claim::InProgress { .. }));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// As for [`claim`](IdempotencyStore::claim).
    fn claim_with_id(&self, key: &Key, fingerprint: Fingerprint, id: ClaimId) -> Result<Claim>;

    /// Like [`claim`](IdempotencyStore::claim), but while the key is in progress, waits up to
    /// `timeout` for it to settle: returns the replay once the holder completes,
    /// [`Claim::Acquired`] once it releases or its lease lapses, [`Claim::InProgress`] if the
    /// time runs out first. Any `timeout` works: one too long to add to the current instant
    /// (`Duration::MAX`) waits without a time limit.
    ///
    /// The redb [`Store`](crate::Store) is woken by the settling call in its process (a
    /// condvar per key, not polling; a lease lapse is noticed when its deadline passes in real
    /// time). `PgStore`, shared by several processes, claims again with a backoff (10 ms
    /// doubling up to 250 ms, never past the deadline). It blocks the calling thread: from
    /// async code, call it on the blocking pool.
    ///
    /// # Errors
    /// As for [`claim`](IdempotencyStore::claim).
    fn claim_wait(&self, key: &Key, fingerprint: Fingerprint, timeout: Duration) -> Result<Claim>;

    /// The replay a [`claim`](IdempotencyStore::claim) would answer, if this store can give it
    /// from memory without blocking (no I/O, no waiting on a writer); `None`: call `claim`.
    /// The layers ask this on the async thread before they hand a claim to the blocking pool.
    /// An answer counts as a claim that replayed in [`metrics`](IdempotencyStore::metrics).
    ///
    /// The redb [`Store`](crate::Store) keeps the keys that claims have replayed, up to
    /// [`StoreBuilder::replay_cache`](crate::StoreBuilder::replay_cache) bytes (none when it
    /// evicts completed records to make room); `PgStore` keeps none (every answer is a round
    /// trip).
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, Response, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("order-7")?;
    /// let fp = Fingerprint::of(["POST", "/orders", "{}"]);
    /// assert!(store.cached_replay(&key, fp).is_none());
    /// let Claim::Acquired(lease) = store.claim(&key, fp)? else { unreachable!() };
    /// store.complete(&lease, Response::new(201, "created"))?;
    /// assert!(matches!(store.claim(&key, fp)?, Claim::Completed(_))); // kept from here on
    /// assert_eq!(store.cached_replay(&key, fp).map(|r| r.response.body), Some(b"created".to_vec()));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    fn cached_replay(&self, key: &Key, fingerprint: Fingerprint) -> Option<Replay>;

    /// The write calls of this store as futures that await their durable commit without
    /// holding a thread ([`AsyncStore`]), counted like the blocking calls, if the store has
    /// them; the layers use them where they can. `None` (`PgStore`): call the blocking methods
    /// on a thread that may block. The redb [`Store`](crate::Store) has them, and a store
    /// that has them also answers [`now`](IdempotencyStore::now) without blocking.
    fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>>;

    /// Stores the response for the lease's key, durably, and ends the lease. From then on
    /// claims with the same fingerprint replay it until `retention` has passed.
    ///
    /// Fenced: succeeds only while the record is in progress under this lease's token (a
    /// lapsed lease that nobody took over still completes). The lease is borrowed, not
    /// consumed, so that a response rejected as too large can be replaced by a smaller one;
    /// once the lease is settled, every further use of it fails with [`Error::LeaseLost`].
    /// To make a failure final (the client must see it again), complete with the error
    /// response; to let a retry run afresh, [`release`](IdempotencyStore::release) instead.
    ///
    /// After an error whose outcome is unknown ([`Error::outcome_unknown`]), call it again
    /// with the same lease and the same response: if the first call landed, the retry finds
    /// this lease's completion with that response and answers `Ok`; it fails with
    /// [`Error::LeaseLost`] only if another attempt settled the key.
    ///
    /// # Errors
    /// [`Error::ResponseTooLarge`] (nothing written, the lease still holds);
    /// [`Error::LeaseLost`] if the key was taken over, released or expired (nothing written);
    /// [`Error::Storage`] if the write failed (if [`Error::outcome_unknown`], retry as above).
    fn complete(&self, lease: &Lease, response: Response) -> Result<()>;

    /// Deletes the lease's record so that a retry runs the operation afresh (the operation
    /// failed before any side effect); fenced like [`complete`](IdempotencyStore::complete).
    /// Retried with the same lease after an error whose outcome is unknown, it answers `Ok`
    /// if the record is gone (the first call landed, or the record expired and was swept: the
    /// key is free either way).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease no longer holds the key; [`Error::Storage`].
    fn release(&self, lease: &Lease) -> Result<()>;

    /// Extends the lease to the configured duration from now and returns the new deadline
    /// (also recorded in `lease`). Call it from long operations well before the lease lapses.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease no longer holds the key (stop the work: another
    /// attempt owns it); [`Error::Storage`].
    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp>;

    /// Stores a recovery point in the record. If this attempt dies, the attempt that takes the
    /// key over receives it through [`Lease::checkpoint`] and can resume instead of redoing
    /// finished steps.
    ///
    /// # Errors
    /// [`Error::ResponseTooLarge`] if `data` exceeds `max_response_bytes`;
    /// [`Error::LeaseLost`]; [`Error::Storage`].
    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()>;

    /// The key's record, or `None` if there is none or it has expired. On the redb store it
    /// runs in a read transaction and never waits for writers; the view is the last visible
    /// write judged at the store's time when the read runs.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a key longer than `max_key_len`; [`Error::Corrupted`] if the
    /// record does not decode; [`Error::Storage`].
    fn lookup(&self, key: &Key) -> Result<Option<RecordView>>;

    /// The key's record, expired or not: like [`lookup`](IdempotencyStore::lookup), but an
    /// expired record that no sweep has deleted yet is returned too (compare its `expires_at`
    /// with [`now`](IdempotencyStore::now)). For operator tools.
    ///
    /// # Errors
    /// As for [`lookup`](IdempotencyStore::lookup).
    fn inspect(&self, key: &Key) -> Result<Option<RecordView>>;

    /// Deletes up to `limit` expired records, oldest expiry first, and returns how many it
    /// deleted. Records that expire in the same millisecond go in an order of the backend's
    /// (by key hash in [`Store`](crate::Store), by key in `PgStore`); as an expired record is
    /// treated as absent by every call, the order shows only in record counts between sweeps.
    /// The deletions need not be durable when this returns: a crash may bring some back,
    /// still expired (they never replay), for the next sweep.
    ///
    /// # Errors
    /// [`Error::Storage`] if the deletion fails. Both backends may delete in several steps
    /// and keep what the earlier ones deleted: `PgStore` in statements of 64 records (more
    /// after skipping a key being claimed), [`Store`](crate::Store) in steps of 64 that ride
    /// other calls' batches (up to 1024 when no claims are being made).
    fn sweep(&self, limit: usize) -> Result<usize>;

    /// Deletes every expired record in bounded rounds of [`sweep`](IdempotencyStore::sweep)
    /// and returns the total deleted. On PostgreSQL a round is 64 records, so other writers
    /// get the writer between rounds; the redb store's rounds ride other calls' batches in
    /// steps of 64 (`docs/operations.md`, "Sweeps").
    ///
    /// # Errors
    /// As for [`sweep`](IdempotencyStore::sweep); records deleted by earlier rounds stay
    /// deleted.
    fn sweep_all(&self) -> Result<u64>;

    /// Checks the stored records' invariants; problems are reported, not returned as errors.
    ///
    /// # Errors
    /// [`Error::Storage`] if the records cannot be read.
    fn verify(&self) -> Result<VerifyReport>;

    /// Counts records by state.
    ///
    /// # Errors
    /// [`Error::Storage`] or [`Error::Corrupted`] if the records cannot be read.
    fn stats(&self) -> Result<Stats>;

    /// What this store has done since it was opened: claims by outcome, settling calls,
    /// errors by kind, latencies, under the same names on every backend (the redb
    /// [`Store`](crate::Store) adds its engine's batches, log writes and merges in
    /// [`Metrics::engine`]). Counts this process's calls only. Cheap: it reads counters and
    /// walks no table; for counts of records by state use
    /// [`stats`](IdempotencyStore::stats).
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, Response, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("order-1")?;
    /// let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["a"]))? else { panic!() };
    /// store.complete(&lease, Response::new(201, "created"))?;
    /// let _ = store.claim(&key, Fingerprint::of(["a"]))?;
    /// let metrics = store.metrics();
    /// assert_eq!((metrics.claims.acquired, metrics.claims.replayed, metrics.completes), (1, 1, 1));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    fn metrics(&self) -> Metrics;

    /// Walks every record, expired ones included; see [`Records`] for each backend's order and
    /// consistency. For operator tools such as a listing or an export.
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let Claim::Acquired(_lease) = store.claim(&Key::new("k")?, Fingerprint::of(["r"]))? else {
    ///     unreachable!()
    /// };
    /// let keys = store.records()?.map(|r| r.map(|r| r.key.to_string())).collect::<Result<Vec<_>, _>>()?;
    /// assert_eq!(keys, ["k"]);
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Storage`] or [`Error::Corrupted`] if the walk cannot start (the redb store's
    /// records table cannot be opened). Errors met during the walk are items of the iterator.
    fn records(&self) -> Result<Records<'_>>;

    /// Deletes the key's **in-progress**, unexpired record without holding its lease, so that
    /// the next claim runs the operation afresh. For an operator un-sticking a key, never for a
    /// service's normal flow (use [`release`](IdempotencyStore::release) with the lease there).
    ///
    /// **Danger: this bypasses fencing.** If the attempt holding the key is still alive (or its
    /// side effect already happened downstream), a retry after this call runs the operation a
    /// second time: the payment is charged twice. Check downstream first. The old holder's
    /// later `complete`, `release`, `heartbeat` or `checkpoint` then fails with
    /// [`Error::LeaseLost`] (its token no longer matches any record), but its side effect is not
    /// undone.
    ///
    /// Completed records are never deleted (the response keeps replaying), and an expired
    /// record is left to the sweeps. The redb store changes the record, its expiry-index entry
    /// and the usage counters in one durable write transaction, so
    /// [`verify`](IdempotencyStore::verify) stays clean, and wakes the callers waiting in
    /// `claim_wait` in its process.
    ///
    /// ```
    /// use idempotency_store::{Claim, Error, Fingerprint, admin::ForceRelease, IdempotencyStore, Key, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("stuck")?;
    /// let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["r"]))? else { unreachable!() };
    /// assert!(matches!(store.force_release(&key)?, ForceRelease::Released { attempt: 1, .. }));
    /// assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
    /// assert!(store.verify()?.is_clean());
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a key longer than `max_key_len`; [`Error::Corrupted`] if the
    /// record does not decode (nothing is changed); [`Error::Storage`] if the write fails (its
    /// outcome is then unknown: inspect the key).
    fn force_release(&self, key: &Key) -> Result<ForceRelease>;

    /// Claims `key` and, if acquired, runs `operation`: on `Ok` its response is stored, on
    /// `Err` the key is released so that a retry runs afresh. Every other claim outcome is
    /// returned without running anything.
    ///
    /// Exactly once, also when the store stumbles: the claim carries a fresh [`ClaimId`] and
    /// a claim, completion or release that fails with its outcome unknown is retried once
    /// (same claim id, same lease), so a lost answer does not block the key or lose the
    /// completion. A live operation keeps its key however long it runs (a heartbeat extends
    /// its lease). A response larger than `max_response_bytes` is replaced by
    /// [`Response::not_stored`] (a 500 problem that every retry replays; the operation is not
    /// run again), which [`Claim::Acquired`] then carries.
    ///
    /// The answer is a [`Claim`] whose winner holds what the operation returned:
    /// `Acquired(Ok(response))` (ran now; `response` stored), `Acquired(Err(e))` (ran and
    /// failed; the key released), or the claim's other answers, with nothing run.
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, Response, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("sms-7")?;
    /// let fp = Fingerprint::of(["send", "+15550100", "hello"]);
    /// let send = |_: &mut _| Ok::<_, std::io::Error>(Response::new(200, "sent"));
    /// assert!(matches!(store.execute(&key, fp, send)?, Claim::Acquired(Ok(_))));
    /// assert!(matches!(store.execute(&key, fp, send)?, Claim::Completed(_)));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// Those of [`claim`](IdempotencyStore::claim) and
    /// [`complete`](IdempotencyStore::complete). If `operation` fails and releasing the key
    /// then fails with a storage error, that error is returned (the key then stays in progress
    /// until its lease lapses).
    fn execute<E, F>(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        operation: F,
    ) -> Result<Claim<std::result::Result<Response, E>>>
    where
        Self: Sized,
        F: FnOnce(&mut Lease) -> Result<Response, E>,
    {
        execute(self, key, fingerprint, operation)
    }
}

/// Each call counted in the backend's meter, with its span, around the backend's own.
impl<B: Backend + ?Sized> IdempotencyStore for B {
    fn settings(&self) -> &Settings {
        Backend::settings(self)
    }

    fn now(&self) -> Result<Timestamp> {
        Backend::now(self)
    }

    fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim> {
        counted_claim(self, || Backend::claim(self, key, fingerprint, None))
    }

    fn claim_with_id(&self, key: &Key, fingerprint: Fingerprint, id: ClaimId) -> Result<Claim> {
        counted_claim(self, || Backend::claim(self, key, fingerprint, Some(id)))
    }

    fn claim_wait(&self, key: &Key, fingerprint: Fingerprint, timeout: Duration) -> Result<Claim> {
        Backend::claim_wait(self, key, fingerprint, timeout)
    }

    fn cached_replay(&self, key: &Key, fingerprint: Fingerprint) -> Option<Replay> {
        let started = Instant::now();
        let replay = Backend::cached_replay(self, key, fingerprint)?;
        let claim = Ok(Claim::Completed(replay));
        self.meter().claimed(&claim, started);
        match claim {
            Ok(Claim::Completed(replay)) => Some(replay),
            _ => None,
        }
    }

    fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>> {
        let calls = Backend::nonblocking(self)?;
        Some(Arc::new(Counted(calls)))
    }

    fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
        let started = Instant::now();
        let _span = trace::enter!("complete", self.meter().backend());
        let result = Backend::complete(self, lease, response);
        self.meter().settled(Call::Complete, &result, started);
        result
    }

    fn release(&self, lease: &Lease) -> Result<()> {
        let started = Instant::now();
        let _span = trace::enter!("release", self.meter().backend());
        let result = Backend::release(self, lease);
        self.meter().settled(Call::Release, &result, started);
        result
    }

    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
        let started = Instant::now();
        let result = Backend::heartbeat(self, lease);
        self.meter().settled(Call::Heartbeat, &result, started);
        result
    }

    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
        let started = Instant::now();
        let result = Backend::checkpoint(self, lease, data);
        self.meter().settled(Call::Checkpoint, &result, started);
        result
    }

    fn lookup(&self, key: &Key) -> Result<Option<RecordView>> {
        Backend::read(self, key, false)
    }

    fn inspect(&self, key: &Key) -> Result<Option<RecordView>> {
        Backend::read(self, key, true)
    }

    fn sweep(&self, limit: usize) -> Result<usize> {
        counted_sweep(self, limit).map(|swept| swept.deleted)
    }

    fn sweep_all(&self) -> Result<u64> {
        let mut total = 0;
        loop {
            let swept = counted_sweep(self, self.sweep_all_round())?;
            total += swept.deleted as u64;
            if !swept.more {
                return Ok(total);
            }
        }
    }

    fn verify(&self) -> Result<VerifyReport> {
        Backend::verify(self)
    }

    fn stats(&self) -> Result<Stats> {
        Backend::stats(self)
    }

    fn metrics(&self) -> Metrics {
        Metrics {
            engine: self.engine_metrics(),
            failover: self.failover_status(),
            ..self.meter().snapshot()
        }
    }

    fn records(&self) -> Result<Records<'_>> {
        Backend::records(self)
    }

    fn force_release(&self, key: &Key) -> Result<ForceRelease> {
        Backend::force_release(self, key)
    }
}

/// A claim by `claim`, counted by its outcome and time in `backend`'s meter.
pub(crate) fn counted_claim<B: Backend + ?Sized>(
    backend: &B,
    claim: impl FnOnce() -> Result<Claim>,
) -> Result<Claim> {
    let started = Instant::now();
    let _span = trace::enter!("claim", backend.meter().backend());
    let result = claim();
    backend.meter().claimed(&result, started);
    result
}

/// One sweep round, counted.
pub(crate) fn counted_sweep<B: Backend + ?Sized>(
    backend: &B,
    limit: usize,
) -> Result<crate::api::backend::Swept> {
    let _span = trace::enter!("sweep", backend.meter().backend());
    let result = Backend::sweep(backend, limit);
    match &result {
        Ok(swept) => backend
            .meter()
            .swept(u64::try_from(swept.deleted).unwrap_or(u64::MAX)),
        Err(err) => backend.meter().failed(err),
    }
    result
}

/// [`IdempotencyStore::execute`] for any store, a trait object (`&dyn IdempotencyStore`)
/// included: the one implementation of `execute`. The claim carries a fresh claim id and
/// every store call whose outcome is unknown is retried once (the same claim id, the same
/// lease), so a lost answer neither blocks the key nor runs the operation twice.
///
/// ```
/// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, Response, Store};
///
/// let store: Box<dyn IdempotencyStore> = Box::new(Store::builder().open_in_memory()?);
/// let key = Key::new("sms-8")?;
/// let send = |_: &mut _| Ok::<_, ()>(Response::new(200, "sent"));
/// let outcome = idempotency_store::execute(&*store, &key, Fingerprint::of(["hi"]), send)?;
/// assert!(matches!(outcome, Claim::Acquired(Ok(_))));
/// # Ok::<(), idempotency_store::Error>(())
/// ```
///
/// # Errors
/// As for [`IdempotencyStore::execute`].
pub fn execute<S, E, F>(
    store: &S,
    key: &Key,
    fingerprint: Fingerprint,
    operation: F,
) -> Result<Claim<std::result::Result<Response, E>>>
where
    S: IdempotencyStore + ?Sized,
    F: FnOnce(&mut Lease) -> Result<Response, E>,
{
    let id = ClaimId::random();
    let mut lease = match once_more(|| store.claim_with_id(key, fingerprint, id))? {
        Claim::Acquired(lease) => lease,
        Claim::Completed(replay) => return Ok(Claim::Completed(replay)),
        Claim::InProgress {
            lease_until,
            attempt,
        } => {
            return Ok(Claim::InProgress {
                lease_until,
                attempt,
            });
        }
        Claim::Mismatch { stored } => return Ok(Claim::Mismatch { stored }),
    };
    // A live operation keeps its key, however long it runs: only a dead one's lease lapses.
    let now = store.now().unwrap_or_else(|_| {
        use crate::api::clock::Clock;
        crate::api::clock::SystemClock.now()
    });
    let period = crate::api::heartbeat::period(&lease, now);
    let twin = lease.twin();
    let extend = |twin: &mut Lease| store.heartbeat(twin);
    let done =
        crate::api::heartbeat::run_beating(&extend, twin, period, &|| {}, || operation(&mut lease));
    match done {
        Ok(response) => store_answer(store, &lease, response).map(|r| Claim::Acquired(Ok(r))),
        Err(err) => match once_more(|| store.release(&lease)) {
            Ok(()) | Err(Error::LeaseLost) => Ok(Claim::Acquired(Err(err))),
            Err(other) => Err(other),
        },
    }
}

/// Completes the lease with `response`, or, if the store cannot keep a response that large,
/// with [`Response::not_stored`]: the operation ran, so a retry must replay, not run it again.
/// Returns what was stored.
fn store_answer<S: IdempotencyStore + ?Sized>(
    store: &S,
    lease: &Lease,
    response: Response,
) -> Result<Response> {
    match once_more(|| store.complete(lease, response.clone())) {
        Ok(()) => Ok(response),
        Err(err @ Error::ResponseTooLarge { size, limit }) => {
            crate::api::trace::answer_not_stored(&err);
            let substitute = Response::not_stored(size, limit);
            once_more(|| store.complete(lease, substitute.clone()))?;
            Ok(substitute)
        }
        Err(err) => Err(err),
    }
}

/// Runs `call`, and once more if it failed with its outcome unknown: the retry of a claim
/// with the same claim id, or of a settling call with the same lease, settles what the first
/// one did.
pub(crate) fn once_more<T>(mut call: impl FnMut() -> Result<T>) -> Result<T> {
    match call() {
        Err(err) if err.outcome_unknown() => call(),
        other => other,
    }
}
