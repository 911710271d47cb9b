//! The async forms' admission (the tower layer's and the actix middleware's): a bound on the
//! claims each keeps on tokio's blocking pool, and the keys its own requests hold, so that a
//! duplicate waits for the holder's answer on the runtime's timer instead of on a blocking
//! thread.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use crate::api::key::Key;

/// The default `max_blocking` of the tower layer and of the actix middleware.
pub const DEFAULT_MAX_BLOCKING: usize = 64;

/// The default `queue_timeout` of the tower layer and of the actix middleware.
pub const DEFAULT_QUEUE_TIMEOUT: Duration = Duration::from_secs(2);

/// Shared by every clone of one layer's services.
pub(crate) struct Admission {
    slots: Arc<Semaphore>,
    pub(crate) max_blocking: usize,
    pub(crate) queue_timeout: Duration,
    /// The keys this layer's requests hold, each with the sender its waiters watch; the
    /// sender is dropped when the holder has settled (or given up) the key.
    held: Mutex<HashMap<Key, Holder>>,
}

struct Holder {
    token: u64,
    settled: watch::Sender<()>,
}

impl Admission {
    pub(crate) fn new(max_blocking: usize, queue_timeout: Duration) -> Self {
        let max_blocking = max_blocking.clamp(1, Semaphore::MAX_PERMITS);
        Admission {
            slots: Arc::new(Semaphore::new(max_blocking)),
            max_blocking,
            queue_timeout,
            held: Mutex::default(),
        }
    }

    /// A slot for one claim on the blocking pool, waited for (without a thread) up to the
    /// queue timeout; `None`: the layer is overloaded.
    pub(crate) async fn slot(&self) -> Option<OwnedSemaphorePermit> {
        let acquire = Arc::clone(&self.slots).acquire_owned();
        match tokio::time::timeout(self.queue_timeout, acquire).await {
            Ok(Ok(permit)) => Some(permit),
            // The semaphore is never closed; a timeout is overload.
            _ => None,
        }
    }

    /// Records that this layer's request holds `key` with the lease `token` until the
    /// returned guard drops.
    pub(crate) fn hold(self: &Arc<Self>, key: &Key, token: u64) -> Holding {
        let (settled, _) = watch::channel(());
        self.held
            .lock()
            .insert(key.clone(), Holder { token, settled });
        Holding {
            admission: Arc::clone(self),
            key: key.clone(),
            token,
        }
    }

    /// A receiver whose `changed()` ends when this layer's holder of `key` lets it go;
    /// `None` if no request of this layer holds it (another process does, or it is settled).
    pub(crate) fn watch(&self, key: &Key) -> Option<watch::Receiver<()>> {
        self.held.lock().get(key).map(|h| h.settled.subscribe())
    }
}

/// A request's hold on a key; dropping it (after the settling call, or with the request's
/// future) wakes the key's waiters.
pub(crate) struct Holding {
    admission: Arc<Admission>,
    key: Key,
    token: u64,
}

impl Drop for Holding {
    fn drop(&mut self) {
        let mut held = self.admission.held.lock();
        // A later holder of the same key (a takeover) keeps its own entry.
        if held.get(&self.key).is_some_and(|h| h.token == self.token) {
            held.remove(&self.key);
        }
    }
}
