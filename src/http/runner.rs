//! The async forms' store calls, shared by the tower layer and the actix middleware: each on
//! tokio's blocking pool, claims through the [`Admission`]'s slots, a duplicate's wait for
//! the attempt in flight on the runtime's timer, and the heartbeat task. Nothing here holds
//! an async worker thread.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ::http::StatusCode;
#[cfg(feature = "tower")]
use http_body_util::LengthLimitError;
use tokio::sync::oneshot;

use super::admission::Admission;
use super::flow::{self, Decided, Ticket};
use super::heartbeat::LeaseWatch;
use super::options::HandleOptions;
use super::{Problem, problem_type};
use crate::api::backend::IdempotencyStore;
use crate::api::heartbeat;
use crate::api::outcome::{Claim, Lease};

type Answer = ::http::Response<Vec<u8>>;

/// The lease to run with (and the heartbeat period), or the answer.
pub(crate) enum Claimed {
    Run(Ticket, Lease, Option<Duration>),
    Answer(Answer),
}

/// One claim's result: [`Claimed`], or the key is in flight and the request may wait up to
/// this long (the holder's lease, bounded by the request's own deadline) before it claims
/// again.
enum Step {
    Done(Claimed),
    Wait(Ticket, Duration),
}

/// A layer's (or middleware's) store, options and admission; cheap to clone (one per request).
#[derive(Clone)]
pub(crate) struct Runner {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) options: Arc<HandleOptions>,
    pub(crate) admission: Arc<Admission>,
}

impl Runner {
    /// Claims, waiting for an attempt in flight up to `wait`: on the timer, woken when this
    /// layer's holder of the key settles, or re-claiming with a backoff when another process
    /// holds it. Each claim needs a slot; none holds one while it waits.
    pub(crate) async fn claim(&self, mut ticket: Ticket, wait: Duration) -> Claimed {
        let deadline = Instant::now() + wait;
        let mut pause = FIRST_PAUSE;
        let mut waiting = false;
        loop {
            if waiting
                && let Some(answer) = flow::cached_replay(&*self.store, &self.options, &ticket)
            {
                return Claimed::Answer(answer);
            }
            if self.admission.draining() {
                return Claimed::Answer(self.options.answer(&shutting_down()));
            }
            let Some(slot) = self.admission.slot().await else {
                return Claimed::Answer(overloaded(&self.options, waiting));
            };
            let admission = Arc::clone(&self.admission);
            let step = self
                .blocking(move |store, options| {
                    claim_step(store, options, &admission, ticket, deadline)
                })
                .await;
            drop(slot);
            let (back, left) = match step {
                Some(Step::Done(claimed)) => return claimed,
                Some(Step::Wait(back, left)) => (back, left),
                None => return Claimed::Answer(self.options.answer(&Problem::internal())),
            };
            ticket = back;
            waiting = true;
            match self.admission.watch(&ticket.key) {
                // Woken when the holder lets go, or when its lease may have lapsed.
                Some(mut settled) => {
                    let _ = tokio::time::timeout(left, settled.changed()).await;
                }
                None => {
                    tokio::time::sleep(pause.min(left)).await;
                    pause = (pause * 2).min(LAST_PAUSE);
                }
            }
        }
    }

    /// Starts the heartbeat task; it runs until the returned sender is dropped or the lease is
    /// lost.
    pub(crate) fn beat(
        &self,
        mut twin: Lease,
        period: Duration,
        watch: LeaseWatch,
    ) -> oneshot::Sender<()> {
        let (stop, mut stopped) = oneshot::channel();
        let store = Arc::clone(&self.store);
        tokio::spawn(async move {
            loop {
                if tokio::time::timeout(period, &mut stopped).await.is_ok() {
                    return;
                }
                let (store, watch) = (Arc::clone(&store), watch.clone());
                let beat = tokio::task::spawn_blocking(move || {
                    let go_on = heartbeat::beat(&*store, &mut twin, &|| watch.mark_lost());
                    (twin, go_on)
                });
                match beat.await {
                    Ok((back, true)) => twin = back,
                    _ => return,
                }
            }
        });
        stop
    }

    /// Runs `work` on the blocking pool; `None` if it panicked or the runtime is shutting
    /// down.
    pub(crate) async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&dyn IdempotencyStore, &HandleOptions) -> T + Send + 'static,
    ) -> Option<T> {
        let (store, options) = (Arc::clone(&self.store), Arc::clone(&self.options));
        let done = tokio::task::spawn_blocking(move || work(&*store, &options)).await;
        match done {
            Ok(value) => Some(value),
            Err(err) => {
                self.options.report(&err);
                None
            }
        }
    }
}

/// The first pause before a waiter claims again a key that another process holds; it
/// doubles up to [`LAST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(10);
const LAST_PAUSE: Duration = Duration::from_millis(250);

/// One claim on the blocking pool: the decision, or how long to wait before claiming again.
fn claim_step(
    store: &dyn IdempotencyStore,
    options: &HandleOptions,
    admission: &Admission,
    ticket: Ticket,
    deadline: Instant,
) -> Step {
    let claim = flow::claim_now(store, &ticket);
    if let Ok(Claim::InProgress { lease_until, .. }) = &claim {
        let left = deadline.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            let lease_left = lease_until.saturating_duration_since(flow::now(store));
            return Step::Wait(ticket, left.min(lease_left.max(FIRST_PAUSE)));
        }
    }
    let held_for = admission.held_for(&ticket.key);
    Step::Done(
        match flow::decide(store, options, &ticket, claim, held_for) {
            Decided::Run(lease) => {
                let period = flow::heartbeat_period(store, options, &lease);
                Claimed::Run(ticket, lease, period)
            }
            Decided::Answer(answer) => Claimed::Answer(answer),
        },
    )
}

/// The answer when no slot came free in time: 409 for a duplicate that was waiting for the
/// attempt in flight (it is still in flight), else 503.
pub(crate) fn overloaded(options: &HandleOptions, waiting: bool) -> Answer {
    if waiting {
        return options.answer(
            &Problem::new(
                StatusCode::CONFLICT,
                problem_type::IN_PROGRESS,
                "Request in progress",
                "A request with this Idempotency-Key is still being processed. Retry after the \
                 time in Retry-After to get its answer.",
            )
            .with_retry_after(1),
        );
    }
    options.answer(&Problem::overloaded())
}

/// 503 while a [`Drain`] runs: the key is not touched, and the retry reaches another
/// instance or this one after its restart.
pub(crate) fn shutting_down() -> Problem {
    Problem::new(
        StatusCode::SERVICE_UNAVAILABLE,
        problem_type::UNAVAILABLE,
        "Server shutting down",
        "This server is shutting down and takes no new requests. Retry with the same \
         Idempotency-Key.",
    )
    .with_retry_after(1)
}

/// 413 for a body over the limit, 400 for one that could not be read.
#[cfg(feature = "tower")]
pub(crate) fn unreadable(
    options: &HandleOptions,
    err: &(dyn std::error::Error + 'static),
) -> Answer {
    if err.downcast_ref::<LengthLimitError>().is_some() {
        return flow::too_large(options, options.max_body);
    }
    options.answer(&Problem::new(
        StatusCode::BAD_REQUEST,
        problem_type::INVALID_BODY,
        "Request body unreadable",
        "The request body could not be read to the end; send it again.",
    ))
}
