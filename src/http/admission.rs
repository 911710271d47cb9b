//! The async layers' admission (the tower layer's and the actix middleware's): a bound on the
//! claims a layer keeps on tokio's blocking pool, and the keys its own requests hold, so that a
//! duplicate waits for the holder's answer on the runtime's timer instead of on a blocking
//! thread, and a shutdown (the layer's drain) can settle every holder.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::AbortHandle;

use crate::api::key::Key;
use crate::api::outcome::Lease;

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
    /// Set by a drain: no new claims.
    draining: AtomicBool,
    /// Notified whenever a holder lets go, for a drain waiting for none to be left.
    let_go: Notify,
}

/// One of this layer's holders of a key.
pub(crate) struct Holder {
    token: u64,
    settled: watch::Sender<()>,
    started: Instant,
    /// A twin of the holder's lease, for a drain that must release it.
    pub(crate) lease: Lease,
    /// The task that runs the holder's handler, for a drain that must stop it.
    pub(crate) task: Option<AbortHandle>,
}

impl Admission {
    pub(crate) fn new(max_blocking: usize, queue_timeout: Duration) -> Self {
        let max_blocking = max_blocking.clamp(1, Semaphore::MAX_PERMITS);
        Admission {
            slots: Arc::new(Semaphore::new(max_blocking)),
            max_blocking,
            queue_timeout,
            held: Mutex::default(),
            draining: AtomicBool::new(false),
            let_go: Notify::new(),
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

    /// Records that this layer's request holds `lease`'s key until the returned guard drops.
    pub(crate) fn hold(self: &Arc<Self>, lease: &Lease) -> Holding {
        let (settled, _) = watch::channel(());
        let holder = Holder {
            token: lease.token(),
            settled,
            started: Instant::now(),
            lease: lease.twin(),
            task: None,
        };
        self.held.lock().insert(lease.key().clone(), holder);
        Holding {
            admission: Arc::clone(self),
            key: lease.key().clone(),
            token: lease.token(),
        }
    }

    /// Records the task that runs the holder of `key` with lease `token`.
    pub(crate) fn running(&self, key: &Key, token: u64, task: AbortHandle) {
        if let Some(holder) = self.held.lock().get_mut(key)
            && holder.token == token
        {
            holder.task = Some(task);
        }
    }

    /// A receiver whose `changed()` ends when this layer's holder of `key` lets it go;
    /// `None` if no request of this layer holds it (another process does, or it is settled).
    pub(crate) fn watch(&self, key: &Key) -> Option<watch::Receiver<()>> {
        self.held.lock().get(key).map(|h| h.settled.subscribe())
    }

    /// How long this layer's holder of `key` has run, if this layer holds it.
    pub(crate) fn held_for(&self, key: &Key) -> Option<Duration> {
        self.held.lock().get(key).map(|h| h.started.elapsed())
    }

    /// Whether a drain has begun: new claims are refused.
    pub(crate) fn draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }

    /// Refuses new claims from now on; the number of holders in flight.
    pub(crate) fn begin_drain(&self) -> usize {
        self.draining.store(true, Ordering::SeqCst);
        self.held.lock().len()
    }

    /// Ends when no holder is left.
    pub(crate) async fn idle(&self) {
        loop {
            // Made before the check, so that a holder letting go in between still wakes it.
            let let_go = self.let_go.notified();
            if self.held.lock().is_empty() {
                return;
            }
            let_go.await;
        }
    }

    /// Takes every holder left, so that a drain can stop and settle them.
    pub(crate) fn take_holders(&self) -> Vec<Holder> {
        let taken: Vec<Holder> = self.held.lock().drain().map(|(_, h)| h).collect();
        self.let_go.notify_waiters();
        taken
    }
}

/// A request's hold on a key; dropping it (after the settling call, or with the holder's
/// task) wakes the key's waiters.
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
        drop(held);
        self.admission.let_go.notify_waiters();
    }
}
