//! The calls of a store that wait for their durable commit without holding a thread:
//! [`AsyncStore`], which a backend offers through
//! [`IdempotencyStore::nonblocking`](crate::IdempotencyStore::nonblocking).
//!
//! Std futures only: the runtime's part (a thread that may block, for the work that does)
//! comes in as a [`Blocking`] function.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, ClaimId, Lease};
use crate::api::response::Response;
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
