//! The calls of a store that wait for their durable commit without holding a thread:
//! [`AsyncStore`], which a backend offers through
//! [`IdempotencyStore::nonblocking`](crate::IdempotencyStore::nonblocking).
//!
//! Std futures only: the runtime's part (a thread that may block, for the work that does)
//! comes in as a [`Blocking`] function.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Instant;

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::{Call, Meter};
use crate::api::outcome::{Claim, ClaimId, Lease};
use crate::api::response::Response;
use crate::api::trace;
use crate::error::Result;

/// A store call's result on its way.
pub type StoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + Send + 'a>>;

/// Runs a closure that may block on a thread where blocking is allowed, without waiting for
/// it: under tokio, `Handle::spawn_blocking`. It must not block itself. The closure may be
/// dropped without being run (a runtime shutting down): dropping it does its work, on the
/// dropping thread.
pub type Blocking = Arc<dyn Fn(Box<dyn FnOnce() + Send>) + Send + Sync>;

/// The write calls of an [`IdempotencyStore`](crate::IdempotencyStore) for async code: the
/// same semantics, errors and metrics as the calls of the same name, but the caller awaits
/// the durable commit instead of blocking a thread for it. What the store decides in memory
/// (a replay, a key in progress, a mismatch, the call's place in a group commit) happens in
/// the call itself; the future only waits for the commit. A future dropped before it is
/// ready does not withdraw the call: it lands all the same (a claim's lease then lapses).
///
/// A backend offers it when it can do this better than a blocking call on a thread pool;
/// the redb [`Store`](crate::Store) does (its group commit wakes each waiting future; a store
/// [in memory](crate::StoreBuilder::open_in_memory) commits a caller's batch on the caller's
/// own thread, since it waits for no I/O), and it also answers
/// [`now`](crate::IdempotencyStore::now) from memory. The tower layer and the
/// actix middleware use it where the store offers it.
///
/// The redb store's leader, on a `Blocking` thread, holds the store (an `Arc`) until just
/// after it has woken its last caller: code that takes the store back out of its `Arc` to
/// [`close`](crate::Store::close) it may find that leader's share still there for a moment
/// (dropping the store closes it too, without reporting a failed final merge).
pub trait AsyncStore: Send + Sync {
    /// Where the store these calls belong to counts its calls.
    fn meter(&self) -> &Meter;

    /// [`IdempotencyStore::claim_with_id`](crate::IdempotencyStore::claim_with_id), awaited.
    /// A commit that needs a leader gets one through `blocking`.
    ///
    /// # Errors
    /// As for `claim_with_id`.
    fn claim_with_id<'a>(
        &'a self,
        key: &Key,
        fingerprint: Fingerprint,
        id: ClaimId,
        blocking: &Blocking,
    ) -> StoreFuture<'a, Claim>;

    /// [`IdempotencyStore::complete`](crate::IdempotencyStore::complete), awaited.
    ///
    /// # Errors
    /// As for `complete`.
    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: Response,
        blocking: &Blocking,
    ) -> StoreFuture<'a, ()>;

    /// [`IdempotencyStore::release`](crate::IdempotencyStore::release), awaited.
    ///
    /// # Errors
    /// As for `release`.
    fn release<'a>(&'a self, lease: &'a Lease, blocking: &Blocking) -> StoreFuture<'a, ()>;
}

/// A backend's own async calls ([`Backend::nonblocking`](crate::backend::Backend::nonblocking)),
/// counted in its meter like the blocking calls: what
/// [`IdempotencyStore::nonblocking`](crate::IdempotencyStore::nonblocking) hands out, for every
/// backend that has such calls.
pub(crate) struct Counted(pub(crate) Arc<dyn AsyncStore>);

impl Counted {
    /// `done`, a settling call's future, counted as `call` once it is ready.
    fn settling<'a>(
        &'a self,
        call: Call,
        started: Instant,
        done: StoreFuture<'a, ()>,
    ) -> StoreFuture<'a, ()> {
        Box::pin(async move {
            let result = done.await;
            self.meter().settled(call, &result, started);
            result
        })
    }
}

impl AsyncStore for Counted {
    fn meter(&self) -> &Meter {
        self.0.meter()
    }

    fn claim_with_id<'a>(
        &'a self,
        key: &Key,
        fingerprint: Fingerprint,
        id: ClaimId,
        blocking: &Blocking,
    ) -> StoreFuture<'a, Claim> {
        let started = Instant::now();
        let claim = {
            let _span = trace::enter!("claim", self.meter().backend());
            self.0.claim_with_id(key, fingerprint, id, blocking)
        };
        Box::pin(async move {
            let result = claim.await;
            self.meter().claimed(&result, started);
            result
        })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: Response,
        blocking: &Blocking,
    ) -> StoreFuture<'a, ()> {
        let started = Instant::now();
        let done = {
            let _span = trace::enter!("complete", self.meter().backend());
            self.0.complete(lease, response, blocking)
        };
        self.settling(Call::Complete, started, done)
    }

    fn release<'a>(&'a self, lease: &'a Lease, blocking: &Blocking) -> StoreFuture<'a, ()> {
        let started = Instant::now();
        let done = {
            let _span = trace::enter!("release", self.meter().backend());
            self.0.release(lease, blocking)
        };
        self.settling(Call::Release, started, done)
    }
}
