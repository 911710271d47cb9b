//! The redb store's own [`AsyncStore`] (uncounted: `api::nonblocking::Counted` counts it for
//! every backend): a claim, completion or release queued in the group commit from an async
//! task, whose future the commit wakes. A call that must lead its batch starts
//! a leader on the caller's [`Blocking`] pool instead of leading on the task's thread; that
//! leader goes on leading while async callers keep coming (see `engine::commit`).

use std::sync::Arc;

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::Meter;
use crate::api::nonblocking::{AsyncStore, Blocking, StoreFuture};
use crate::api::outcome::{Claim, ClaimId, Lease};
use crate::api::response::Response;
use crate::engine::commit::{Appoint, Waiting};
use crate::error::Result;
use crate::store::{Claiming, Store, release_write};

/// The store in an `Arc` of its own, which the leaders its calls start hold.
pub(crate) struct Nonblocking(pub(crate) Arc<Store>);

impl Nonblocking {
    /// What a call does when it must lead its batch: the engine leads on a thread of
    /// `blocking`.
    fn appoint(&self, blocking: &Blocking) -> Appoint {
        let (store, blocking) = (Arc::clone(&self.0), Arc::clone(blocking));
        Box::new(move || {
            let leader = Leader(store);
            blocking(Box::new(move || drop(leader)));
        })
    }
}

/// Leads when dropped, run or not: `Blocking` may drop a closure without running it (a
/// runtime shutting down), and an appointed leader that never led would stall every write.
struct Leader(Arc<Store>);

impl Drop for Leader {
    fn drop(&mut self) {
        self.0.engine.lead();
    }
}

impl AsyncStore for Nonblocking {
    fn meter(&self) -> &Meter {
        &self.0.meter
    }

    fn claim_with_id<'a>(
        &'a self,
        key: &Key,
        fingerprint: Fingerprint,
        id: ClaimId,
        blocking: &Blocking,
    ) -> StoreFuture<'a, Claim> {
        let store = &*self.0;
        let waiting = match store.claim_read(key, fingerprint, Some(id), None) {
            Ok(Claiming::Write(write)) => store.engine.write_async(write, self.appoint(blocking)),
            Ok(Claiming::Answer(answer)) => return Box::pin(std::future::ready(Ok(answer))),
            Err(err) => Err(err),
        };
        Box::pin(async move {
            match waiting {
                Ok(waiting) => waiting.await.map(|claim| store.live(claim)),
                Err(err) => Err(err),
            }
        })
    }

    fn complete<'a>(
        &'a self,
        lease: &'a Lease,
        response: Response,
        blocking: &Blocking,
    ) -> StoreFuture<'a, ()> {
        let store = &*self.0;
        let waiting = store
            .complete_write(lease, response)
            .and_then(|write| store.engine.write_async(write, self.appoint(blocking)));
        settling(store, lease, waiting)
    }

    fn release<'a>(&'a self, lease: &'a Lease, blocking: &Blocking) -> StoreFuture<'a, ()> {
        let store = &*self.0;
        let waiting = store
            .engine
            .write_async(release_write(lease), self.appoint(blocking));
        settling(store, lease, waiting)
    }
}

/// The future of a settling call (`complete` or `release`) of `lease`, queued as `waiting`:
/// its result as the blocking call would give it.
fn settling<'a>(
    store: &'a Store,
    lease: &'a Lease,
    waiting: Result<Waiting<()>>,
) -> StoreFuture<'a, ()> {
    Box::pin(async move {
        let done = match waiting {
            Ok(waiting) => waiting.await,
            Err(err) => Err(err),
        };
        store.settled(lease, done)
    })
}
