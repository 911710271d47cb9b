//! The actix middleware's drain at shutdown: the tower layer's [`Drain`], run before the
//! workers stop, because the tasks it settles live on them.

use std::sync::Arc;

use super::Idempotency;
use crate::http::drain::Drain;

impl Idempotency {
    /// The handle that drains this middleware at shutdown (see [`Drain`] and the module's
    /// "Shutdown"): run [`Drain::finish`] as the server's shutdown signal, so that it settles
    /// the operations in flight while the workers that run them are still alive. Take it
    /// after the other settings (`max_blocking` and `queue_timeout` make a new admission);
    /// clones of this middleware share it.
    #[must_use]
    pub fn drain_handle(&self) -> Drain {
        Drain {
            store: Arc::clone(&self.runner.store),
            options: Arc::clone(&self.runner.options),
            admission: Arc::clone(&self.runner.admission),
        }
    }
}
