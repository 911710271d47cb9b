//! Auto-heartbeat: the lease of a running handler is extended in the background, and a lost
//! lease is made visible to the handler through its [`LeaseWatch`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::api::key::Key;
use crate::api::outcome::Lease;

/// What the handler of a covered request knows about its lease. [`handle`](super::handle)
/// and the tower layer put it into the request's extensions
/// (`request.extensions().get::<LeaseWatch>()`), the actix middleware into actix's
/// (`web::ReqData<LeaseWatch>`); cheap to clone.
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    key: Key,
    token: u64,
    attempt: u32,
    checkpoint: Option<Arc<[u8]>>,
    lost: Arc<AtomicBool>,
}

impl LeaseWatch {
    pub(crate) fn new(lease: &Lease) -> Self {
        LeaseWatch {
            key: lease.key().clone(),
            token: lease.token(),
            attempt: lease.attempt(),
            checkpoint: lease.checkpoint().map(Arc::from),
            lost: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The key the request holds.
    #[must_use]
    pub fn key(&self) -> &Key {
        &self.key
    }

    /// The lease's fencing token (see [`Lease::token`]).
    #[must_use]
    pub fn token(&self) -> u64 {
        self.token
    }

    /// 1 for a fresh key, n + 1 when this run took over attempt n.
    #[must_use]
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// The checkpoint the attempt before this one left (see [`Lease::checkpoint`]).
    #[must_use]
    pub fn checkpoint(&self) -> Option<&[u8]> {
        self.checkpoint.as_deref()
    }

    /// `true` once a heartbeat found the lease taken over: another attempt owns the key,
    /// this run's answer will not be stored (the client gets 409). Check it before side
    /// effects in a long handler, and stop.
    #[must_use]
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    pub(crate) fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
    }
}
