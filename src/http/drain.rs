//! A graceful shutdown of the async layers (the tower layer, the actix middleware): every
//! operation in flight finishes within a deadline, or is stopped and its key settled, so that
//! no key is left in progress.

use std::sync::Arc;
use std::time::Duration;

use super::admission::{Admission, Holder};
use super::flow;
use super::options::HandleOptions;
use crate::api::store::IdempotencyStore;
use crate::error::Error;

/// The handle that drains a layer at shutdown: from `IdempotencyLayer::drain_handle` (the
/// tower layer) or `Idempotency::drain_handle` (the actix middleware).
///
/// The layers run each handler on a task of their own, so that a client that hangs up cancels
/// nothing; such a task outlives its connection, and so a server's graceful shutdown (which
/// waits for connections) does not wait for it. Behind the tower layer, await
/// [`Drain::finish`] after the server has stopped, before the runtime ends:
///
/// ```no_run
/// # use std::time::Duration;
/// # use idempotency_store::{Store, http::{HandleOptions, tower::IdempotencyLayer}};
/// # async fn serve(store: Store, listener: tokio::net::TcpListener) -> std::io::Result<()> {
/// let layer = IdempotencyLayer::new(store, HandleOptions::new());
/// let drain = layer.drain_handle();
/// let app = axum::Router::new()
///     .route("/payments", axum::routing::post(|| async { "charged" }))
///     .layer(layer);
/// axum::serve(listener, app)
///     .with_graceful_shutdown(async { /* e.g. SIGTERM */ })
///     .await?;
/// let report = drain.finish(Duration::from_secs(10)).await;
/// assert_eq!(report.left_in_progress, 0);
/// # Ok(())
/// # }
/// ```
///
/// actix-web runs those tasks on its workers, which end with the server: there the drain
/// runs *before* the server stops, as its shutdown signal (see the `actix` module's
/// "Shutdown").
#[derive(Clone)]
pub struct Drain {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) options: Arc<HandleOptions>,
    pub(crate) admission: Arc<Admission>,
}

impl std::fmt::Debug for Drain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Drain").finish_non_exhaustive()
    }
}

/// What [`Drain::finish`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct DrainReport {
    /// Operations in flight when the drain began.
    pub in_flight: usize,
    /// Those that finished (and settled their keys) by themselves within the deadline.
    pub finished: usize,
    /// Those stopped at the deadline whose keys were then settled: released (the retry runs
    /// afresh), or under [`Takeover::AnswerUnknown`](super::Takeover::AnswerUnknown) given
    /// the stored "outcome unknown" answer.
    pub stopped: usize,
    /// Keys that could not be settled (a store error); they stay in progress until their
    /// lease lapses. Zero after a clean shutdown.
    pub left_in_progress: usize,
}

impl Drain {
    /// Refuses new claims (503 with `Retry-After: 1`; the client's retry reaches the next
    /// instance), waits up to `deadline` for the operations in flight to finish and settle,
    /// then stops those left and settles their keys. Behind the tower layer, call it once the
    /// server no longer takes requests; behind the actix middleware, before its workers stop.
    pub async fn finish(&self, deadline: Duration) -> DrainReport {
        let in_flight = self.admission.begin_drain();
        let _ = tokio::time::timeout(deadline, self.admission.idle()).await;
        let mut report = DrainReport {
            in_flight,
            ..DrainReport::default()
        };
        for holder in self.admission.take_holders() {
            if let Some(task) = &holder.task {
                task.abort();
            }
            if self.settle(holder).await {
                report.stopped += 1;
            } else {
                report.left_in_progress += 1;
            }
        }
        report.finished = in_flight.saturating_sub(report.stopped + report.left_in_progress);
        report
    }

    /// Releases a stopped holder's key, or stores "outcome unknown" for it; `true` once the
    /// key is settled (by this, or by the holder just before it was stopped).
    async fn settle(&self, holder: Holder) -> bool {
        let (store, options) = (Arc::clone(&self.store), Arc::clone(&self.options));
        let settled = tokio::task::spawn_blocking(move || {
            let lease = holder.lease;
            match flow::abandon(&*store, &options, &lease) {
                Ok(()) | Err(Error::LeaseLost) => true,
                Err(err) => {
                    options.report(&err);
                    false
                }
            }
        });
        settled.await.unwrap_or(false)
    }
}
