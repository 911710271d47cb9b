//! What a store answers: claim outcomes, leases, replays, record views and operator results.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::api::clock::{Timestamp, millis};
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::response::Response;

/// The answer to a first-writer-wins claim: from [`IdempotencyStore::claim`](crate::IdempotencyStore::claim)
/// (holding a [`Lease`]), from [`IdempotencyStore::execute`](crate::IdempotencyStore::execute)
/// (holding what the operation returned, having run it) and from the client's `Outbox::begin`
/// (holding an `Intent`, feature `client`). Every variant is an expected answer; match all of them.
///
/// | variant | meaning | what an HTTP service does |
/// |---|---|---|
/// | `Acquired` | you run the operation | run it, then `complete` or `release` |
/// | `InProgress` | another attempt holds a live lease | 409 with `Retry-After`, or wait |
/// | `Completed` | it already ran | replay the stored response |
/// | `Mismatch` | the key was used for a different request | 422; never replay, never run |
///
/// `H` is what the winner holds: one type for the four answers, whoever asks.
/// `Claim<Result<Response, E>>` from `execute`: `Acquired(Ok(response))` ran now and stored
/// `response`; `Acquired(Err(e))` ran and failed with `e`, and the key was released so that a
/// retry runs afresh.
///
/// Deliberately not `#[non_exhaustive]`: a new kind of answer would change what callers must
/// do, so their `match` should stop compiling rather than fall into a wildcard arm. (The types
/// it carries can grow: [`Replay`] is `#[non_exhaustive]`.)
#[must_use = "a claim says whether the caller may run the operation"]
#[derive(Debug)]
pub enum Claim<H = Lease> {
    /// The caller holds the key: run the operation, then settle it.
    Acquired(H),
    /// Another attempt holds the key.
    InProgress {
        /// When that attempt's lease lapses (a takeover becomes possible then).
        lease_until: Timestamp,
        /// That attempt's number.
        attempt: u32,
    },
    /// The operation already completed: replay this.
    Completed(Replay),
    /// The key is stored with a different request fingerprint.
    Mismatch {
        /// The fingerprint stored with the key.
        stored: Fingerprint,
    },
}

impl Claim<Lease> {
    /// The answer once the call is about to return at `now`: a lease that has already lapsed
    /// (the write took longer than the lease) is not handed out; the caller hears
    /// [`Claim::InProgress`] with that lease's deadline, exactly as if another caller had won,
    /// and a retry takes the key over. So a returned lease is always live when it arrives.
    pub(crate) fn unless_lapsed(self, now: Timestamp) -> Claim {
        match self {
            Claim::Acquired(lease) if now >= lease.lease_until => Claim::InProgress {
                lease_until: lease.lease_until,
                attempt: lease.attempt,
            },
            other => other,
        }
    }
}

/// Proof that the holder may run the operation for one key, until the lease lapses.
///
/// Settle it with [`IdempotencyStore::complete`](crate::IdempotencyStore::complete) or
/// [`IdempotencyStore::release`](crate::IdempotencyStore::release). Dropping a lease without settling it leaves the
/// record in progress until the lease lapses, after which a retry takes it over (with the last
/// [`checkpoint`](Lease::checkpoint)). There is deliberately no release-on-drop: after a panic
/// in the middle of a payment, running it again blindly is the wrong default.
#[must_use = "a lease left unsettled blocks the key until it lapses"]
#[derive(Debug, PartialEq, Eq)]
pub struct Lease {
    pub(crate) key: Key,
    pub(crate) token: u64,
    pub(crate) attempt: u32,
    pub(crate) lease_until: Timestamp,
    pub(crate) checkpoint: Option<Vec<u8>>,
    /// How long the completed record replays, in milliseconds, if not the store's retention.
    pub(crate) retention_ms: Option<u64>,
    pub(crate) in_doubt: InDoubt,
}

/// Set once a settling call on the lease failed with an outcome-unknown error
/// ([`Error::outcome_unknown`](crate::Error::outcome_unknown)): only then may a later
/// `complete` or `release` of the lease find its own earlier settlement and answer `Ok`.
/// Without the flag a settled lease stays settled: every further use fails with `LeaseLost`.
#[derive(Debug, Default)]
pub(crate) struct InDoubt(AtomicBool);

impl InDoubt {
    pub(crate) fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// Marks the lease after `result`, if it is an outcome-unknown error.
    pub(crate) fn after<T>(&self, result: &crate::error::Result<T>) {
        if result
            .as_ref()
            .is_err_and(crate::error::Error::outcome_unknown)
        {
            self.0.store(true, Ordering::Relaxed);
        }
    }
}

/// Not part of a lease's identity.
impl PartialEq for InDoubt {
    fn eq(&self, _: &InDoubt) -> bool {
        true
    }
}

impl Eq for InDoubt {}

impl Lease {
    pub(crate) fn new(
        key: Key,
        token: u64,
        attempt: u32,
        lease_until: Timestamp,
        checkpoint: Option<Vec<u8>>,
    ) -> Lease {
        Lease {
            key,
            token,
            attempt,
            lease_until,
            checkpoint,
            retention_ms: None,
            in_doubt: InDoubt::default(),
        }
    }

    /// The key this lease holds.
    #[must_use]
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The fencing token: unique for the life of the store (its file, or its PostgreSQL
    /// schema), so a write with an older token can be told apart from the current holder's
    /// (also useful to pass downstream as a fencing token).
    ///
    /// Per key, tokens strictly increase in the order the key was acquired, on every backend:
    /// the redb [`Store`](crate::Store) hands them out from one counter in its single writer,
    /// in commit order; `PgStore` draws a claim's token and time only after the claim has won
    /// the key (claims of one key are serialised, see `PgStore`'s "Statements"). A later holder
    /// of a key therefore always carries a larger token than every earlier one, and its lease
    /// never begins before the previous holder's release.
    #[must_use]
    pub fn token(&self) -> u64 {
        self.token
    }

    /// 1 for a fresh claim, n + 1 when this lease took over attempt n.
    #[must_use]
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// When this lease lapses unless extended with [`IdempotencyStore::heartbeat`](crate::IdempotencyStore::heartbeat).
    #[must_use]
    pub fn lease_until(&self) -> Timestamp {
        self.lease_until
    }

    /// A second handle on the same lease (same key and token, no checkpoint), for a
    /// background heartbeat that runs while the handler holds the first one. Fencing is by
    /// token, so either handle settles the lease, and the other then gets `LeaseLost`.
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn twin(&self) -> Lease {
        Lease {
            retention_ms: self.retention_ms,
            ..Lease::new(
                self.key.clone(),
                self.token,
                self.attempt,
                self.lease_until,
                None,
            )
        }
    }

    /// Keeps the record that completes this lease for `retention` after its completion,
    /// instead of the store's [`retention`](crate::Settings::retention): a TTL per operation
    /// (the HTTP layer's per-route `HandleOptions::ttl` sets it), with one
    /// store, one key space and one sweep for all of them. It applies to the completion
    /// (`complete`, `complete_with` and their async forms); a record in progress, or one
    /// released, expires as the store's setting says. At least 1 ms; on `PgStore` at most the
    /// same cap as the store's own retention.
    pub fn keep_for(&mut self, retention: Duration) -> &mut Self {
        self.retention_ms = Some(millis(retention).max(1));
        self
    }

    /// The retention set with [`keep_for`](Lease::keep_for), if any (else the store's applies).
    #[must_use]
    pub fn retention(&self) -> Option<Duration> {
        self.retention_ms.map(Duration::from_millis)
    }

    /// Marks the lease as if a settling call had failed with its outcome unknown; for the
    /// test suite, which cannot make a storage fail on demand on every backend.
    #[cfg(feature = "__test-hooks")]
    #[doc(hidden)]
    pub fn mark_in_doubt(&self) {
        self.in_doubt
            .after::<()>(&Err(crate::error::Error::storage_for_tests("a test")));
    }

    /// The last recovery point stored for this operation: on a takeover, the previous
    /// attempt's; after [`IdempotencyStore::checkpoint`](crate::IdempotencyStore::checkpoint), this lease's own.
    #[must_use]
    pub fn checkpoint(&self) -> Option<&[u8]> {
        self.checkpoint.as_deref()
    }
}

/// Names one claim attempt of one caller, so that the caller can get its lease back when the
/// claim's answer was lost ([`IdempotencyStore::claim_with_id`](crate::IdempotencyStore::claim_with_id)).
///
/// Generate one per request (not per retry of the store call): [`ClaimId::random`] does. It
/// only has to differ from the ids of other callers of the same key and fingerprint, so 64
/// random bits are plenty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClaimId(pub(crate) u64);

impl ClaimId {
    /// A claim id from the caller's own number (a request id, say). Must differ between the
    /// callers that may claim the same key with the same fingerprint.
    #[must_use]
    pub const fn new(id: u64) -> ClaimId {
        ClaimId(id)
    }

    /// A fresh random claim id: 64 bits from the operating system's generator.
    #[must_use]
    pub fn random() -> ClaimId {
        ClaimId(crate::api::random::u64())
    }

    /// The number.
    #[must_use]
    pub const fn get(self) -> u64 {
        self.0
    }
}

/// A completed operation's stored response, with its times.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Replay {
    /// The response, byte for byte as completed.
    pub response: Response,
    /// When the key was first claimed.
    pub created_at: Timestamp,
    /// When the response was stored.
    pub completed_at: Timestamp,
    /// When the record stops replaying.
    pub expires_at: Timestamp,
    /// The attempt that completed it.
    pub attempt: u32,
}

/// A record as [`IdempotencyStore::lookup`](crate::IdempotencyStore::lookup) sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordView {
    /// The request fingerprint stored with the key.
    pub fingerprint: Fingerprint,
    /// When the key was first claimed.
    pub created_at: Timestamp,
    /// When the record stops counting.
    pub expires_at: Timestamp,
    /// The current (or completing) attempt number.
    pub attempt: u32,
    /// In progress or completed, with the state's details.
    pub state: RecordState,
}

impl RecordView {
    /// Whether the record is stuck at `now`: unexpired and in progress under a lapsed lease, so
    /// it waits for a retry to take it over (or for an operator's `force_release`). The one rule
    /// behind [`Stats::stuck`](crate::admin::Stats::stuck) for both backends and the CLI's `--stuck`.
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, ManualClock, Store, Timestamp};
    ///
    /// let clock = ManualClock::new(Timestamp::EPOCH);
    /// let store = Store::builder().clock(clock.clone()).open_in_memory()?;
    /// let key = Key::new("k")?;
    /// let Claim::Acquired(_lease) = store.claim(&key, Fingerprint::of(["r"]))? else { panic!() };
    /// clock.advance(store.settings().lease());
    /// let now = store.now()?;
    /// assert!(store.lookup(&key)?.is_some_and(|view| view.is_stuck(now)));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    #[must_use]
    pub fn is_stuck(&self, now: Timestamp) -> bool {
        match self.state {
            RecordState::InProgress { lease_until, .. } => {
                now < self.expires_at && now >= lease_until
            }
            RecordState::Completed { .. } => false,
        }
    }
}

/// The state part of a [`RecordView`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// An attempt holds (or held) the key.
    InProgress {
        /// When the current lease lapses.
        lease_until: Timestamp,
        /// The last stored recovery point.
        checkpoint: Option<Vec<u8>>,
    },
    /// The response is stored.
    Completed {
        /// When it was stored.
        completed_at: Timestamp,
        /// The stored response.
        response: Response,
    },
}

/// What [`IdempotencyStore::force_release`](crate::IdempotencyStore::force_release) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForceRelease {
    /// The in-progress record was deleted: the next claim of the key runs the operation afresh
    /// (attempt 1).
    Released {
        /// The attempt that held the key.
        attempt: u32,
        /// When its lease lapses (or lapsed). If this is later than the time of the release,
        /// the holder may well still be running.
        lease_until: Timestamp,
    },
    /// The record is completed; nothing was changed (its response keeps replaying).
    Completed,
    /// There is no record for the key, or it has expired (a sweep deletes it); nothing was
    /// changed.
    NotFound,
}
