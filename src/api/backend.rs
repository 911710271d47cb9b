//! What a backend implements: [`Backend`], each store operation once, unmetered. Callers use
//! [`IdempotencyStore`](crate::IdempotencyStore), which every `Backend` is, and which adds what both backends share
//! (counting, spans, the async form's counting, `sweep_all`, `execute`) in one place.

use std::sync::Arc;
use std::time::Duration;

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::{EngineMetrics, Meter};
use crate::api::nonblocking::AsyncStore;
use crate::api::outcome::{Claim, ClaimId, ForceRelease, Lease, RecordView, Replay};
use crate::api::records::Records;
use crate::api::report::{FailoverStatus, Stats, VerifyReport};
use crate::api::response::Response;
use crate::api::settings::Settings;
use crate::error::Result;

/// How many expired records one round of `sweep_all` deletes on PostgreSQL, and one step of
/// the redb store's sweeps (whose `sweep_all` asks for larger rounds,
/// `Backend::sweep_all_round`, deleted in such steps: `engine::sweep`). Expired keys are scattered
/// through the records table, so each deletion dirties a page of its own; a claim waits for
/// at most one round or step, so this bounds a sweep's effect on claim latency.
/// BENCHMARKS.md ("Figures behind the defaults") has the measurements behind 64.
pub(crate) const SWEEP_BATCH: usize = 64;

/// One store operation per method, as a backend does it, before counting: the contract a
/// backend fulfils so that it is an [`IdempotencyStore`](crate::IdempotencyStore) (every `Backend` is one, through one
/// blanket implementation that counts each call in [`meter`](Backend::meter), opens its span
/// and adds `sweep_all`, `execute` and the counted async form).
///
/// Callers never need this trait: import [`IdempotencyStore`](crate::IdempotencyStore). Implement it to wrap one of
/// this crate's stores (a fault injector in a test, a delegating store): forward each method
/// to the inner store's `Backend` method, so that each call is counted once. Every method is
/// required: a backend states its clock, its claim recovery and its waiting itself, nothing
/// falls back silently.
///
/// The semantics of each method are those of the [`IdempotencyStore`](crate::IdempotencyStore) method of the same
/// name.
pub trait Backend: Send + Sync {
    /// Where this store's calls are counted (see [`Meter`]).
    fn meter(&self) -> &Meter;

    /// The settings the store was opened with ([`IdempotencyStore::settings`](crate::IdempotencyStore::settings)).
    fn settings(&self) -> &Settings;

    /// The store's time ([`IdempotencyStore::now`](crate::IdempotencyStore::now)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::now`](crate::IdempotencyStore::now).
    fn now(&self) -> Result<Timestamp>;

    /// Claims `key` ([`IdempotencyStore::claim`](crate::IdempotencyStore::claim)); with `id`, recoverably
    /// ([`IdempotencyStore::claim_with_id`](crate::IdempotencyStore::claim_with_id)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::claim`](crate::IdempotencyStore::claim).
    fn claim(&self, key: &Key, fingerprint: Fingerprint, id: Option<ClaimId>) -> Result<Claim>;

    /// Claims, waiting up to `timeout` for a key in progress to settle
    /// ([`IdempotencyStore::claim_wait`](crate::IdempotencyStore::claim_wait)). Each claim it makes goes through
    /// [`IdempotencyStore::claim`](crate::IdempotencyStore::claim) (so it is counted), and each pause is counted with
    /// [`Meter`]'s waits; a backend that can only poll claims again with a backoff.
    ///
    /// # Errors
    /// As for [`IdempotencyStore::claim`](crate::IdempotencyStore::claim).
    fn claim_wait(&self, key: &Key, fingerprint: Fingerprint, timeout: Duration) -> Result<Claim>;

    /// The replay a claim would answer, if the backend has it in memory
    /// ([`IdempotencyStore::cached_replay`](crate::IdempotencyStore::cached_replay)); `None` for a backend that keeps none.
    fn cached_replay(&self, key: &Key, fingerprint: Fingerprint) -> Option<Replay>;

    /// The backend's own async form of the write calls, if it has one, uncounted
    /// ([`IdempotencyStore::nonblocking`](crate::IdempotencyStore::nonblocking) counts it); `None`: callers use the blocking calls
    /// on a thread that may block.
    fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>>;

    /// Stores the response and ends the lease ([`IdempotencyStore::complete`](crate::IdempotencyStore::complete)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::complete`](crate::IdempotencyStore::complete).
    fn complete(&self, lease: &Lease, response: Response) -> Result<()>;

    /// Deletes the lease's record ([`IdempotencyStore::release`](crate::IdempotencyStore::release)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::release`](crate::IdempotencyStore::release).
    fn release(&self, lease: &Lease) -> Result<()>;

    /// Extends the lease ([`IdempotencyStore::heartbeat`](crate::IdempotencyStore::heartbeat)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::heartbeat`](crate::IdempotencyStore::heartbeat).
    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp>;

    /// Stores a recovery point ([`IdempotencyStore::checkpoint`](crate::IdempotencyStore::checkpoint)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::checkpoint`](crate::IdempotencyStore::checkpoint).
    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()>;

    /// The key's record; an expired one too if `expired` is true
    /// ([`IdempotencyStore::inspect`](crate::IdempotencyStore::inspect)), else not ([`IdempotencyStore::lookup`](crate::IdempotencyStore::lookup)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::lookup`](crate::IdempotencyStore::lookup).
    fn read(&self, key: &Key, expired: bool) -> Result<Option<RecordView>>;

    /// Deletes up to `limit` expired records ([`IdempotencyStore::sweep`](crate::IdempotencyStore::sweep)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::sweep`](crate::IdempotencyStore::sweep).
    fn sweep(&self, limit: usize) -> Result<Swept>;

    /// How many records one round of `sweep_all` asks [`sweep`](Backend::sweep) for. No
    /// default: a store behind a pointer or a wrapper must forward its backend's.
    fn sweep_all_round(&self) -> usize;

    /// Checks the stored records' invariants ([`IdempotencyStore::verify`](crate::IdempotencyStore::verify)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::verify`](crate::IdempotencyStore::verify).
    fn verify(&self) -> Result<VerifyReport>;

    /// Counts records by state ([`IdempotencyStore::stats`](crate::IdempotencyStore::stats)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::stats`](crate::IdempotencyStore::stats).
    fn stats(&self) -> Result<Stats>;

    /// Walks every record ([`IdempotencyStore::records`](crate::IdempotencyStore::records)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::records`](crate::IdempotencyStore::records).
    fn records(&self) -> Result<Records<'_>>;

    /// Deletes an in-progress record without its lease ([`IdempotencyStore::force_release`](crate::IdempotencyStore::force_release)).
    ///
    /// # Errors
    /// As for [`IdempotencyStore::force_release`](crate::IdempotencyStore::force_release).
    fn force_release(&self, key: &Key) -> Result<ForceRelease>;

    /// The backend's own engine figures for [`IdempotencyStore::metrics`](crate::IdempotencyStore::metrics), if it has any.
    fn engine_metrics(&self) -> Option<EngineMetrics>;

    /// The last failover-safety check, for [`IdempotencyStore::metrics`](crate::IdempotencyStore::metrics):
    /// `None` (the default) for a backend that has no failover.
    fn failover_status(&self) -> Option<FailoverStatus> {
        None
    }
}

/// What one [`Backend::sweep`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Swept {
    /// Expired records deleted.
    pub deleted: usize,
    /// Whether expired records may remain: `sweep_all` goes on while this is true.
    pub more: bool,
}

/// A [`Backend::claim_wait`] for a backend that cannot be woken by a settling call: makes
/// `claim` (a counted claim) again with a backoff (10 ms doubling up to 250 ms, never past the
/// deadline) while the key is in progress, counting each pause and a timeout in `meter`. It
/// blocks the calling thread.
#[cfg(feature = "postgres")]
pub(crate) fn poll_claim_wait(
    claim: impl Fn() -> Result<Claim>,
    timeout: Duration,
    meter: &Meter,
) -> Result<Claim> {
    use std::time::Instant;
    let deadline = Instant::now().checked_add(timeout);
    let mut pauses =
        crate::api::backoff::doubling(Duration::from_millis(10), Duration::from_millis(250));
    loop {
        let claim = claim()?;
        if !matches!(claim, Claim::InProgress { .. }) {
            return Ok(claim);
        }
        let now = Instant::now();
        let left = deadline.map(|deadline| deadline.saturating_duration_since(now));
        if left.is_some_and(|left| left.is_zero()) {
            meter.waited(true);
            return Ok(claim);
        }
        meter.waited(false);
        let pause = pauses.next().unwrap_or(Duration::from_millis(250));
        std::thread::sleep(left.map_or(pause, |left| pause.min(left)));
    }
}

/// A store behind a pointer is the same backend: each method forwards to the store (so each
/// call is counted once, in its meter); `nonblocking` as `$nonblocking` says, which needs the
/// store in an `Arc` of its own.
macro_rules! forward {
    ($($ptr:ty => |$this:ident| $nonblocking:expr),*) => {$(
        impl<T: Backend + ?Sized> Backend for $ptr {
            fn meter(&self) -> &Meter { (**self).meter() }
            fn settings(&self) -> &Settings { (**self).settings() }
            fn now(&self) -> Result<Timestamp> { (**self).now() }
            fn claim(&self, key: &Key, fp: Fingerprint, id: Option<ClaimId>) -> Result<Claim> {
                (**self).claim(key, fp, id)
            }
            fn claim_wait(&self, key: &Key, fp: Fingerprint, timeout: Duration) -> Result<Claim> {
                (**self).claim_wait(key, fp, timeout)
            }
            fn cached_replay(&self, key: &Key, fp: Fingerprint) -> Option<Replay> {
                (**self).cached_replay(key, fp)
            }
            fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>> {
                let $this = self;
                $nonblocking
            }
            fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
                (**self).complete(lease, response)
            }
            fn release(&self, lease: &Lease) -> Result<()> { (**self).release(lease) }
            fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> { (**self).heartbeat(lease) }
            fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
                (**self).checkpoint(lease, data)
            }
            fn read(&self, key: &Key, expired: bool) -> Result<Option<RecordView>> {
                (**self).read(key, expired)
            }
            fn sweep(&self, limit: usize) -> Result<Swept> { (**self).sweep(limit) }
            fn sweep_all_round(&self) -> usize { (**self).sweep_all_round() }
            fn verify(&self) -> Result<VerifyReport> { (**self).verify() }
            fn stats(&self) -> Result<Stats> { (**self).stats() }
            fn records(&self) -> Result<Records<'_>> { (**self).records() }
            fn force_release(&self, key: &Key) -> Result<ForceRelease> { (**self).force_release(key) }
            fn engine_metrics(&self) -> Option<EngineMetrics> { (**self).engine_metrics() }
            fn failover_status(&self) -> Option<FailoverStatus> { (**self).failover_status() }
        }
    )*};
}

forward!(
    &T => |_this| None,
    Box<T> => |_this| None,
    Arc<T> => |this| Backend::nonblocking(Arc::clone(&*this))
);
