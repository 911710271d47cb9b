//! One API over every backend: the [`IdempotencyStore`] trait.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::Metrics;
use crate::api::nonblocking::AsyncStore;
use crate::api::outcome::{Claim, ClaimId, ForceRelease, Lease, Outcome, RecordView, Replay};
use crate::api::records::Records;
use crate::api::report::{Stats, VerifyReport};
use crate::api::response::Response;
use crate::error::{Error, Result};

/// How many expired records one round of `sweep_all` deletes, on every backend (the CLI's
/// `sweep` uses the same rounds). Each round is one bounded transaction. Expired keys are scattered through the
/// records table, so each deletion dirties a page of its own; a claim queued behind a sweep
/// waits for at most one round (sweeps never share a batch), so this bounds a sweep's effect
/// on claim latency. BENCHMARKS.md ("Figures behind the defaults") has the measurements behind 64.
pub(crate) const SWEEP_BATCH: usize = 64;

/// The operations of an idempotency store, with the same types and the same outcomes on every
/// backend: the embedded redb [`Store`](crate::Store) and, with the `postgres` feature,
/// `PgStore`.
///
/// Code written against this trait switches backends by changing only how the store is
/// opened:
///
/// ```
/// use idempotency_store::{Fingerprint, IdempotencyStore, Key, Outcome, Response, Store};
///
/// fn charge(store: &impl IdempotencyStore, key: &Key) -> idempotency_store::Result<u16> {
///     let fp = Fingerprint::of(["POST", "/payments", "4999"]);
///     Ok(match store.execute(key, fp, |_| Ok::<_, ()>(Response::new(201, "charged")))? {
///         Outcome::Executed(response) => response.status,
///         Outcome::Replayed(replay) => replay.response.status,
///         Outcome::InProgress { .. } => 409,
///         Outcome::Mismatch { .. } => 422,
///         Outcome::Failed(()) => 502,
///         _ => 500, // `Outcome` is non-exhaustive
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
/// The trait is dyn-compatible, and implemented for `Box`, `Arc` and references of any
/// implementation, so a `Box<dyn IdempotencyStore>` or `Arc<dyn IdempotencyStore>` chosen at
/// run time offers every method, [`execute`](IdempotencyStore::execute) included.
///
/// The semantics of each request-path operation are those documented on
/// [`Store`](crate::Store)'s methods of the same name; the operator calls (`records`,
/// `inspect`, `force_release`, `metrics`, `now`) are documented here, as only the trait
/// offers them. The backends differ only in what they store in and in which errors the
/// storage can produce.
pub trait IdempotencyStore: Send + Sync {
    /// Claims `key` for the request with `fingerprint`: the first-writer-wins step. See
    /// [`Store::claim`](crate::Store::claim) for every branch.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if the key or scope is longer than the store's `max_key_len`;
    /// [`Error::Storage`] (or [`Error::Corrupted`]) if the record cannot be read or written.
    /// After a storage error on the write path the claim may have landed; its lease then
    /// lapses normally.
    fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim>;

    /// Like [`claim`](IdempotencyStore::claim), and recoverable: the record remembers `id`,
    /// and a later claim with the same key, fingerprint and `id` that finds the record still in
    /// progress under the lease this id won gets that lease back ([`Claim::Acquired`], same
    /// token, same deadline, same attempt) instead of [`Claim::InProgress`].
    ///
    /// Use it when a claim failed with an error whose outcome is unknown
    /// ([`Error::outcome_unknown`]): the claim may have won the key and only its answer was
    /// lost. Retrying with the same id either gets that lease back or claims afresh; without an
    /// id the key would answer "in progress" to its own winner until the lease lapsed.
    ///
    /// The default ignores `id` and calls [`claim`](IdempotencyStore::claim) (for backends
    /// outside this crate); both of this crate's backends store it.
    ///
    /// # Errors
    /// As for [`claim`](IdempotencyStore::claim).
    fn claim_with_id(&self, key: &Key, fingerprint: Fingerprint, id: ClaimId) -> Result<Claim> {
        let _ = id;
        self.claim(key, fingerprint)
    }

    /// Like [`claim`](IdempotencyStore::claim), but while the key is in progress, waits up to
    /// `timeout` for it to settle: returns the replay once the holder completes,
    /// [`Claim::Acquired`] once it releases or its lease lapses, [`Claim::InProgress`] if the
    /// time runs out first. See [`Store::claim_wait`](crate::Store::claim_wait), which wakes
    /// on the settling call in its process.
    ///
    /// The default re-claims with a backoff (10 ms doubling up to 250 ms, never past the
    /// deadline), which is what a store shared by several processes can do. It blocks the
    /// calling thread: from async code, call it on the blocking pool.
    ///
    /// # Errors
    /// As for [`claim`](IdempotencyStore::claim).
    fn claim_wait(&self, key: &Key, fingerprint: Fingerprint, timeout: Duration) -> Result<Claim> {
        poll_claim_wait(self, key, fingerprint, timeout, |_| {})
    }

    /// The replay a [`claim`](IdempotencyStore::claim) would answer, if this backend can give
    /// it from memory without blocking (no I/O, no waiting on a writer); `None`: call
    /// `claim`. The tower layer asks this on the async thread before it hands a claim to the
    /// blocking pool. The default keeps nothing (`PgStore`: every answer is a round trip); the
    /// redb [`Store`](crate::Store) keeps recently replayed keys
    /// ([`Store::cached_replay`](crate::Store::cached_replay)).
    fn cached_replay(&self, key: &Key, fingerprint: Fingerprint) -> Option<Replay> {
        let _ = (key, fingerprint);
        None
    }

    /// The calls of this store that await their durable commit without holding a thread
    /// ([`AsyncStore`]), if it has them; the tower layer and the actix middleware use them
    /// where they can. `None` (the default, and `PgStore`'s): call the blocking methods on a
    /// thread that may block. The redb [`Store`](crate::Store) has them. A backend that returns `Some` also answers
    /// [`now`](IdempotencyStore::now) without blocking.
    ///
    /// Forwarded by `Arc<T>`; `&T` and `Box<T>` have none.
    fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>> {
        None
    }

    /// The store's current time, the one its leases and expiry are counted in (for example to
    /// turn a lease's end into a `Retry-After`, or to tell whether a record from
    /// [`inspect`](IdempotencyStore::inspect) has expired). The default is the system clock.
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
    fn now(&self) -> Result<Timestamp> {
        Ok(crate::api::clock::Clock::now(
            &crate::api::clock::SystemClock,
        ))
    }

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
    /// consistency. For operator tools such as a listing or an export; a service has no use
    /// for it.
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

    /// The key's record, expired or not: like [`lookup`](IdempotencyStore::lookup), but an
    /// expired record that no sweep has deleted yet is returned too (compare its `expires_at`
    /// with [`now`](IdempotencyStore::now)). For operator tools.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a key longer than `max_key_len`; [`Error::Corrupted`] if the
    /// record does not decode; [`Error::Storage`].
    fn inspect(&self, key: &Key) -> Result<Option<RecordView>>;

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
    /// Completed records are never deleted (the response keeps replaying), and an expired record
    /// is left to the sweeps. The redb store changes the record, its expiry-index entry and the
    /// usage counters in one durable write transaction, so [`verify`](IdempotencyStore::verify)
    /// stays clean, and wakes the callers waiting in `claim_wait` in its process.
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

    /// Stores the response for the lease's key and ends the lease; fenced by the lease's
    /// token. See [`Store::complete`](crate::Store::complete).
    ///
    /// After an error whose outcome is unknown ([`Error::outcome_unknown`]), call it again
    /// with the same lease and the same response: if the first call landed, the retry finds
    /// this lease's completion with that response and answers `Ok`; it fails with
    /// [`Error::LeaseLost`] only if another attempt settled the key. (Without such an error
    /// before it, a second completion of a settled lease fails with `LeaseLost`.)
    ///
    /// # Errors
    /// [`Error::ResponseTooLarge`] (nothing written, the lease still holds);
    /// [`Error::LeaseLost`] if the key was taken over, released or expired (nothing written);
    /// [`Error::Storage`] if the write failed (if [`Error::outcome_unknown`], retry as above).
    fn complete(&self, lease: &Lease, response: Response) -> Result<()>;

    /// Deletes the lease's record so that a retry runs afresh; fenced like
    /// [`complete`](IdempotencyStore::complete). Retried with the same lease after an error
    /// whose outcome is unknown, it answers `Ok` if the record is gone (the first call
    /// landed, or the record expired and was swept: the key is free either way).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease no longer holds the key; [`Error::Storage`].
    fn release(&self, lease: &Lease) -> Result<()>;

    /// Extends the lease to the configured duration from now and returns the new deadline
    /// (also recorded in `lease`).
    ///
    /// # Errors
    /// [`Error::LeaseLost`] if the lease no longer holds the key (stop the work);
    /// [`Error::Storage`].
    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp>;

    /// Stores a recovery point that an attempt taking the key over receives through
    /// [`Lease::checkpoint`].
    ///
    /// # Errors
    /// [`Error::ResponseTooLarge`] if `data` exceeds `max_response_bytes`;
    /// [`Error::LeaseLost`]; [`Error::Storage`].
    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()>;

    /// The key's record, or `None` if there is none or it has expired.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] for a key longer than `max_key_len`; [`Error::Corrupted`] if the
    /// record does not decode; [`Error::Storage`].
    fn lookup(&self, key: &Key) -> Result<Option<RecordView>>;

    /// Deletes up to `limit` expired records, oldest expiry first, and returns how many it
    /// deleted. Records that expire in the same millisecond go in an order of the backend's
    /// (by key hash in [`Store`](crate::Store), by key in `PgStore`); as an expired record is
    /// treated as absent by every call, the order shows only in record counts between sweeps.
    ///
    /// # Errors
    /// [`Error::Storage`] if the deletion fails (nothing is deleted then; `PgStore` may delete
    /// in several statements, for more than 64 records or after skipping a key
    /// being claimed, and keeps what the earlier ones deleted).
    fn sweep(&self, limit: usize) -> Result<usize>;

    /// Deletes every expired record in bounded rounds of [`sweep`](IdempotencyStore::sweep)
    /// and returns the total deleted.
    ///
    /// # Errors
    /// As for [`sweep`](IdempotencyStore::sweep); records deleted by earlier rounds stay
    /// deleted.
    fn sweep_all(&self) -> Result<u64> {
        let mut total = 0;
        loop {
            let n = self.sweep(SWEEP_BATCH)?;
            total += n as u64;
            if n < SWEEP_BATCH {
                return Ok(total);
            }
        }
    }

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

    /// Claims `key` and, if acquired, runs `operation`: on `Ok` its response is stored, on
    /// `Err` the key is released so that a retry runs afresh. Every other claim outcome is
    /// returned without running anything. See [`Store::execute`](crate::Store::execute).
    ///
    /// Exactly once, also when the store stumbles: the claim carries a fresh [`ClaimId`] and
    /// a claim, completion or release that fails with its outcome unknown is retried once
    /// (same claim id, same lease), so a lost answer does not block the key or lose the
    /// completion. A response larger than `max_response_bytes` is replaced by
    /// [`Response::not_stored`] (a 500 problem that every retry replays; the operation is not
    /// run again), which [`Outcome::Executed`] then carries.
    ///
    /// # Errors
    /// Those of [`claim`](IdempotencyStore::claim) and
    /// [`complete`](IdempotencyStore::complete). If `operation` fails and releasing the key
    /// then fails with a storage error, that error is returned (the key then stays in progress
    /// until its lease lapses).
    fn execute<E, F>(&self, key: &Key, fingerprint: Fingerprint, operation: F) -> Result<Outcome<E>>
    where
        Self: Sized,
        F: FnOnce(&mut Lease) -> Result<Response, E>,
    {
        run(self, key, fingerprint, operation)
    }
}

/// The one implementation of `execute`. The claim carries a fresh claim id and every store
/// call whose outcome is unknown is retried once (the same claim id, the same lease), so a
/// lost answer neither blocks the key nor runs the operation twice.
fn run<S, E, F>(store: &S, key: &Key, fingerprint: Fingerprint, operation: F) -> Result<Outcome<E>>
where
    S: IdempotencyStore,
    F: FnOnce(&mut Lease) -> Result<Response, E>,
{
    let id = ClaimId::random();
    let mut lease = match once_more(|| store.claim_with_id(key, fingerprint, id))? {
        Claim::Acquired(lease) => lease,
        Claim::Completed(replay) => return Ok(Outcome::Replayed(replay)),
        Claim::InProgress {
            lease_until,
            attempt,
        } => {
            return Ok(Outcome::InProgress {
                lease_until,
                attempt,
            });
        }
        Claim::Mismatch { stored } => return Ok(Outcome::Mismatch { stored }),
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
        Ok(response) => store_answer(store, &lease, response).map(Outcome::Executed),
        Err(err) => match once_more(|| store.release(&lease)) {
            Ok(()) | Err(Error::LeaseLost) => Ok(Outcome::Failed(err)),
            Err(other) => Err(other),
        },
    }
}

/// Completes the lease with `response`, or, if the store cannot keep a response that large,
/// with [`Response::not_stored`]: the operation ran, so a retry must replay, not run it again.
/// Returns what was stored.
fn store_answer<S: IdempotencyStore>(
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

/// The default [`IdempotencyStore::claim_wait`]: re-claims with a backoff, and tells `waited`
/// of each pause (`false`) and of giving up at the deadline (`true`), so that a backend can
/// count them as the redb store counts its waits.
pub(crate) fn poll_claim_wait<S: IdempotencyStore + ?Sized>(
    store: &S,
    key: &Key,
    fingerprint: Fingerprint,
    timeout: Duration,
    waited: impl Fn(bool),
) -> Result<Claim> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_millis(10);
    loop {
        let claim = store.claim(key, fingerprint)?;
        if !matches!(claim, Claim::InProgress { .. }) {
            return Ok(claim);
        }
        let now = Instant::now();
        if now >= deadline {
            waited(true);
            return Ok(claim);
        }
        waited(false);
        std::thread::sleep(pause.min(deadline - now));
        pause = (pause * 2).min(Duration::from_millis(250));
    }
}

/// Forwards every method, `execute` included, to the store behind a pointer; `nonblocking`
/// as `$nonblocking` says, which needs the store in an `Arc` of its own.
macro_rules! forward {
    ($($ptr:ty => |$this:ident| $nonblocking:expr),*) => {$(
        impl<T: IdempotencyStore + ?Sized> IdempotencyStore for $ptr {
            fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>> {
                let $this = self;
                $nonblocking
            }

            fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim> {
                (**self).claim(key, fingerprint)
            }

            fn claim_with_id(
                &self,
                key: &Key,
                fingerprint: Fingerprint,
                id: ClaimId,
            ) -> Result<Claim> {
                (**self).claim_with_id(key, fingerprint, id)
            }

            fn claim_wait(
                &self,
                key: &Key,
                fingerprint: Fingerprint,
                timeout: Duration,
            ) -> Result<Claim> {
                (**self).claim_wait(key, fingerprint, timeout)
            }

            fn cached_replay(&self, key: &Key, fingerprint: Fingerprint) -> Option<Replay> {
                (**self).cached_replay(key, fingerprint)
            }

            fn now(&self) -> Result<Timestamp> {
                (**self).now()
            }

            fn metrics(&self) -> Metrics {
                (**self).metrics()
            }

            fn records(&self) -> Result<Records<'_>> {
                (**self).records()
            }

            fn inspect(&self, key: &Key) -> Result<Option<RecordView>> {
                (**self).inspect(key)
            }

            fn force_release(&self, key: &Key) -> Result<ForceRelease> {
                (**self).force_release(key)
            }

            fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
                (**self).complete(lease, response)
            }

            fn release(&self, lease: &Lease) -> Result<()> {
                (**self).release(lease)
            }

            fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
                (**self).heartbeat(lease)
            }

            fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
                (**self).checkpoint(lease, data)
            }

            fn lookup(&self, key: &Key) -> Result<Option<RecordView>> {
                (**self).lookup(key)
            }

            fn sweep(&self, limit: usize) -> Result<usize> {
                (**self).sweep(limit)
            }

            fn sweep_all(&self) -> Result<u64> {
                (**self).sweep_all()
            }

            fn verify(&self) -> Result<VerifyReport> {
                (**self).verify()
            }

            fn stats(&self) -> Result<Stats> {
                (**self).stats()
            }
        }
    )*};
}

forward!(
    &T => |_this| None,
    Box<T> => |_this| None,
    Arc<T> => |this| Arc::clone(&*this).nonblocking()
);
