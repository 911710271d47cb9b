//! The store: opening, the claim/settle calls, lookups and maintenance.

pub(crate) mod admin;
mod backend;
pub(crate) mod builder;
mod effects;
#[cfg(feature = "__test-hooks")]
pub(crate) mod hooks;
#[cfg(test)]
mod log_faults;
#[cfg(test)]
mod log_halves;
pub(crate) mod maintenance;
pub(crate) mod metrics;
pub(crate) mod nonblocking;
mod replay_cache;
pub(crate) mod sweep;
pub(crate) mod wait;

use std::path::PathBuf;

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::{Call, Counters};
use crate::api::outcome::{Claim, ClaimId, Lease, Outcome, RecordView, Replay};
use crate::api::record::{Record, Verdict, verdict};
use crate::api::response::Response;
use crate::api::series;
use crate::api::settings::{Settings, WhenFull};
use crate::engine::handle::Engine;
use crate::engine::ops::{Checkpoint, ClaimKey, Complete, Heartbeat, Release};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::store::builder::StoreBuilder;
use crate::store::metrics::SweeperState;
use crate::store::wait::Waiters;

/// A durable idempotency-key store in one file (a write-ahead log and a redb database).
///
/// `Store` is `Send + Sync`: share one per file (for example in an `Arc`) across all request
/// threads. Reads ([`lookup`](Store::lookup), and claims that only replay or reject) run in
/// read transactions beside the writer. Write calls from many threads share commits (group
/// commit) and each returns only after the commit holding its write is durable.
pub struct Store {
    engine: Engine,
    config: StoreBuilder,
    path: Option<PathBuf>,
    waiters: Waiters,
    pub(crate) metrics: Counters,
    pub(crate) sweeper: SweeperState,
    replays: replay_cache::ReplayCache,
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
    /// As for [`StoreBuilder::open`].
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Store> {
        StoreBuilder::new().open(path)
    }

    /// A builder for a store with custom settings.
    #[must_use]
    pub fn builder() -> StoreBuilder {
        StoreBuilder::new()
    }

    pub(crate) fn new(engine: Engine, config: StoreBuilder, path: Option<PathBuf>) -> Store {
        let show_keys = config.settings.trace_keys;
        let evicts = config.settings.when_full == WhenFull::EvictOldestCompleted;
        let replays = replay_cache::ReplayCache::new(if evicts { 0 } else { config.replay_cache });
        Store {
            replays,
            engine,
            config,
            path,
            waiters: Waiters::default(),
            metrics: Counters::new(&series::REDB, show_keys),
            sweeper: SweeperState::default(),
        }
    }

    /// Closes the store: a last merge of the log into the database, so that the next open
    /// has no log to replay, then the flush thread and the file are closed. Dropping the
    /// store does the same but cannot report a failure; call `close` where a failed final
    /// merge matters (it does not for durability: every acknowledged write is already in the
    /// log, which the next open replays).
    ///
    /// # Errors
    /// [`Error::Poisoned`] if the store was poisoned (nothing is written then; the next open
    /// recovers from the durable state); [`Error::Storage`] or [`Error::Corrupted`] if the
    /// final merge or closing the file failed.
    pub fn close(mut self) -> Result<()> {
        self.engine.close()
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
    /// Answers that write nothing (replay, mismatch, in progress) come from a read transaction,
    /// or for a key replayed before from memory, and never wait for the writer. A claim that acquires returns after its commit is durable.
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
        let started = std::time::Instant::now();
        let _span = crate::api::trace::enter!("claim", "redb");
        let result = self.claim_unmetered(key, fingerprint, None, None);
        self.metrics.claimed(&result, started);
        result
    }

    /// Like [`claim`](Store::claim), and recoverable by the same caller: the record remembers
    /// `id`, and a claim with the same key, fingerprint and `id` that finds the record still in
    /// progress under the lease this id won gets that lease back (same token, deadline,
    /// attempt and checkpoint) instead of [`Claim::InProgress`]. Use it to retry a claim
    /// that failed with [`Error::outcome_unknown`] (see
    /// [`IdempotencyStore::claim_with_id`](crate::IdempotencyStore::claim_with_id)).
    ///
    /// ```
    /// use idempotency_store::{Claim, ClaimId, Fingerprint, Key, Store};
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
    /// As for [`claim`](Store::claim).
    pub fn claim_with_id(&self, key: &Key, fingerprint: Fingerprint, id: ClaimId) -> Result<Claim> {
        let started = std::time::Instant::now();
        let _span = crate::api::trace::enter!("claim", "redb");
        let result = self.claim_unmetered(key, fingerprint, Some(id), None);
        self.metrics.claimed(&result, started);
        result
    }

    /// Like [`claim_with_id`](Store::claim_with_id), and a fresh record starts with `seed` as
    /// its recovery point, in the claim's own commit: as if [`checkpoint`](Store::checkpoint)
    /// had been called at once, without a second durable write. A recovered or taken-over
    /// lease carries the record's own checkpoint instead (`seed` is then unused). The
    /// outbound-key client (feature `client`) stores a new intent's key this way.
    ///
    /// ```
    /// use idempotency_store::{Claim, ClaimId, Fingerprint, Key, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let (key, fp, id) = (Key::new("job-1")?, Fingerprint::of(["job"]), ClaimId::new(7));
    /// let Claim::Acquired(lease) = store.claim_seeded(&key, fp, id, b"plan A".to_vec())? else { unreachable!() };
    /// assert_eq!(lease.checkpoint(), Some(&b"plan A"[..]));
    /// let Claim::Acquired(again) = store.claim_seeded(&key, fp, id, b"plan B".to_vec())? else { unreachable!() };
    /// assert_eq!(again.checkpoint(), Some(&b"plan A"[..])); // the record's, not the new seed
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// As for [`claim`](Store::claim); [`Error::ResponseTooLarge`] if `seed` is larger than
    /// `max_response_bytes` (nothing written).
    pub fn claim_seeded(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        id: ClaimId,
        seed: Vec<u8>,
    ) -> Result<Claim> {
        self.check_size(seed.len())?;
        let started = std::time::Instant::now();
        let _span = crate::api::trace::enter!("claim", "redb");
        let result = self.claim_unmetered(key, fingerprint, Some(id), Some(seed));
        self.metrics.claimed(&result, started);
        result
    }

    /// The replay a [`claim`](Store::claim) of `key` with `fingerprint` would answer, if it
    /// can be given from memory: the key's completed response, kept since an earlier claim
    /// replayed it. Never blocks on I/O or on the writer (one short lock), so the tower layer
    /// calls it on the async thread and hands only the other claims to the blocking pool.
    /// `None`: not kept (never replayed yet, evicted, another fingerprint, or expired), so
    /// call `claim`. An answer counts as a claim that replayed, in [`metrics`](crate::IdempotencyStore::metrics)
    /// as everywhere.
    ///
    /// Memory: up to [`StoreBuilder::replay_cache`] bytes (default 4 MiB), filled by claims
    /// that replay (which answer from it too); a store that evicts completed records to make
    /// room ([`WhenFull::EvictOldestCompleted`](crate::WhenFull::EvictOldestCompleted)) keeps
    /// none.
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, Key, Response, Store};
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
    #[must_use]
    pub fn cached_replay(&self, key: &Key, fingerprint: Fingerprint) -> Option<Replay> {
        let started = std::time::Instant::now();
        let replay = self.replays.get(key, fingerprint, self.engine.now())?;
        let claim = Ok(Claim::Completed(replay));
        self.metrics.claimed(&claim, started);
        match claim {
            Ok(Claim::Completed(replay)) => Some(replay),
            _ => None,
        }
    }

    fn claim_unmetered(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        id: Option<ClaimId>,
        seed: Option<Vec<u8>>,
    ) -> Result<Claim> {
        match self.claim_read(key, fingerprint, id, seed)? {
            Claiming::Answer(answer) => Ok(answer),
            Claiming::Write(write) => self.engine.write(write).map(|c| self.live(c)),
        }
    }

    /// A claim's answer from the record, where it needs no write, or the write that decides it.
    fn claim_read(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        id: Option<ClaimId>,
        seed: Option<Vec<u8>>,
    ) -> Result<Claiming> {
        self.check_key(key)?;
        let now = self.engine.now();
        // A completed record does not change until it expires: no read transaction, page
        // cache or decode for a key replayed before (see `replay_cache`).
        if let Some(replay) = self.replays.get(key, fingerprint, now) {
            return Ok(Claiming::Answer(Claim::Completed(replay)));
        }
        let (record, absent_at) = self.engine.read_found(key)?;
        if let Verdict::Answer(answer) = verdict(key, record, fingerprint, id, now) {
            if let Claim::Completed(replay) = &answer {
                self.replays.insert(key, fingerprint, replay);
            }
            return Ok(Claiming::Answer(answer));
        }
        Ok(Claiming::Write(ClaimKey {
            key: key.clone(),
            fingerprint,
            id,
            seed,
            absent_at,
        }))
    }

    /// A claim's written answer: the batch stamped the lease when it started, and a batch that
    /// outlasted the lease must not hand it out.
    fn live(&self, claim: Claim) -> Claim {
        claim.unless_lapsed(self.engine.now())
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
        let started = std::time::Instant::now();
        let _span = crate::api::trace::enter!("complete", "redb");
        let result = self.complete_unmetered(lease, response);
        self.metrics.settled(Call::Complete, &result, started);
        result
    }

    fn complete_unmetered(&self, lease: &Lease, response: Response) -> Result<()> {
        let done = self
            .complete_write(lease, response)
            .and_then(|write| self.engine.write(write));
        self.settled(lease, done)
    }

    /// The write of `complete`.
    fn complete_write(&self, lease: &Lease, response: Response) -> Result<Complete> {
        self.check_size(response.size())?;
        Ok(Complete {
            key: lease.key.clone(),
            token: lease.token,
            response,
            retry: lease.in_doubt.get(),
        })
    }

    /// After a settling call (`complete`, `release`): a lease whose call failed with its
    /// outcome unknown is in doubt, and a settled key's waiters wake.
    fn settled(&self, lease: &Lease, done: Result<()>) -> Result<()> {
        lease.in_doubt.after(&done);
        done?;
        self.waiters.wake(&lease.key);
        Ok(())
    }

    /// Deletes the lease's record so that a retry runs the operation afresh. Use it when the
    /// operation failed before any side effect. Fenced like [`complete`](Store::complete).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease no longer holds the key; [`Error::Storage`] if the
    /// commit failed.
    pub fn release(&self, lease: &Lease) -> Result<()> {
        let started = std::time::Instant::now();
        let _span = crate::api::trace::enter!("release", "redb");
        let result = self.release_unmetered(lease);
        self.metrics.settled(Call::Release, &result, started);
        result
    }

    fn release_unmetered(&self, lease: &Lease) -> Result<()> {
        let done = self.engine.write(release_write(lease));
        self.settled(lease, done)
    }

    /// Extends the lease to `lease` (the configured duration) from now, and returns the new
    /// deadline (also recorded in `lease`). Call it from long operations well before the lease
    /// lapses.
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease no longer holds the key (stop the work: another
    /// attempt owns it); [`Error::Storage`] if the commit failed.
    pub fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
        let started = std::time::Instant::now();
        let result = self.heartbeat_unmetered(lease);
        self.metrics.settled(Call::Heartbeat, &result, started);
        result
    }

    fn heartbeat_unmetered(&self, lease: &mut Lease) -> Result<Timestamp> {
        let until = self.engine.write(Heartbeat {
            key: lease.key.clone(),
            token: lease.token,
        })?;
        lease.lease_until = until;
        Ok(until)
    }

    /// Stores a recovery point in the record. If this attempt dies, the attempt that takes the
    /// key over receives it through [`Lease::checkpoint`] and can resume instead of redoing
    /// finished steps.
    ///
    /// # Errors
    /// [`Error::ResponseTooLarge`] if `data` exceeds `max_response_bytes`;
    /// [`Error::LeaseLost`]; [`Error::Storage`].
    pub fn checkpoint(&self, lease: &mut Lease, data: impl Into<Vec<u8>>) -> Result<()> {
        let started = std::time::Instant::now();
        let result = self.checkpoint_unmetered(lease, data.into());
        self.metrics.settled(Call::Checkpoint, &result, started);
        result
    }

    fn checkpoint_unmetered(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
        self.check_size(data.len())?;
        self.engine.write(Checkpoint {
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
    /// the batch started) may be earlier than this read's (see [`now`](crate::IdempotencyStore::now)).
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a key longer than `max_key_len`; [`Error::Corrupted`] if the
    /// record does not decode; [`Error::Storage`].
    pub fn lookup(&self, key: &Key) -> Result<Option<RecordView>> {
        self.check_key(key)?;
        let now = self.engine.now();
        Ok(self
            .read(key)?
            .filter(|r| !r.is_expired(now))
            .map(Record::into_view))
    }

    /// The settings this store shares with every backend, as it was opened with them.
    #[must_use]
    pub fn settings(&self) -> &Settings {
        &self.config.settings
    }

    /// The file behind the store, if it has one.
    #[must_use]
    pub fn path(&self) -> Option<&std::path::Path> {
        self.path.as_deref()
    }

    fn check_key(&self, key: &Key) -> Result<()> {
        self.config.settings.check_key(key)
    }

    fn check_size(&self, size: usize) -> Result<()> {
        self.config.settings.check_size(size)
    }

    /// The key's record, expired or not.
    fn read(&self, key: &Key) -> Result<Option<Record>> {
        self.engine.read(key)
    }
}

/// A claim's answer without a write, or its write.
enum Claiming {
    Answer(Claim),
    Write(ClaimKey),
}

/// The write of `release`.
fn release_write(lease: &Lease) -> Release {
    Release {
        key: lease.key.clone(),
        token: lease.token,
        retry: lease.in_doubt.get(),
    }
}
