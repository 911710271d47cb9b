//! The async forms' store calls, shared by the tower layer and the actix middleware: claims
//! through the [`Admission`]'s slots, a duplicate's wait for the attempt in flight on the
//! runtime's timer, and the heartbeat task. Nothing here holds an async worker thread.
//!
//! Where the store offers [`AsyncStore`] (the redb `Store` does), the claim and the settling
//! call are awaited: the store decides in memory on the async thread (a replay, a key in
//! progress, a mismatch, a fresh claim's place in the group commit), and the commit wakes the
//! request once its write is durable. Tokio's blocking pool then only runs the group commit's
//! leader, once per run of batches rather than twice per request (BENCHMARKS.md, "Figures
//! behind the defaults", has what those hand-overs cost). Every other call, and every call of a store without
//! `AsyncStore` (`PgStore`), runs on the blocking pool.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ::http::StatusCode;
#[cfg(feature = "tower")]
use http_body_util::LengthLimitError;
use tokio::sync::oneshot;

use super::admission::{Admission, DEFAULT_MAX_BLOCKING, DEFAULT_QUEUE_TIMEOUT};
use super::flow::{self, Decided, Settling, Ticket};
use super::heartbeat::LeaseWatch;
use super::options::HandleOptions;
use super::{Problem, problem_type};
use crate::api::backoff;
use crate::api::heartbeat;
use crate::api::nonblocking::{AsyncStore, Blocking};
use crate::api::outcome::{Claim, Lease};
use crate::api::store::IdempotencyStore;

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
    /// The store's calls that await their commit without a thread, if it has them (asked
    /// once here, not per request).
    nonblocking: Option<Arc<dyn AsyncStore>>,
    pub(crate) options: Arc<HandleOptions>,
    pub(crate) admission: Arc<Admission>,
}

impl Runner {
    /// The runner over `store` with `options` and the default admission.
    pub(crate) fn new(store: Arc<dyn IdempotencyStore>, options: HandleOptions) -> Runner {
        Runner {
            nonblocking: Arc::clone(&store).nonblocking(),
            store,
            options: Arc::new(options),
            admission: Arc::new(Admission::new(DEFAULT_MAX_BLOCKING, DEFAULT_QUEUE_TIMEOUT)),
        }
    }

    /// Claims, waiting for an attempt in flight up to `wait`: on the timer, woken when this
    /// layer's holder of the key settles, or re-claiming with a backoff when another process
    /// holds it. Each claim needs a slot; none holds one while it waits.
    pub(crate) async fn claim(&self, mut ticket: Ticket, wait: Duration) -> Claimed {
        let deadline = Instant::now() + wait;
        let mut pauses = backoff::doubling(FIRST_PAUSE, LAST_PAUSE);
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
            let step = self.claim_step(ticket, deadline).await;
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
                    let pause = pauses.next().unwrap_or(LAST_PAUSE);
                    tokio::time::sleep(pause.min(left)).await;
                }
            }
        }
    }

    /// One claim, and what its result means: awaited where the store offers [`AsyncStore`],
    /// the decision then made here (on the blocking pool only where it writes: a takeover's
    /// stored "outcome unknown"); else both on the blocking pool.
    async fn claim_step(&self, ticket: Ticket, deadline: Instant) -> Option<Step> {
        let admission = Arc::clone(&self.admission);
        let Some(nonblocking) = &self.nonblocking else {
            return self
                .blocking(move |store, options| {
                    let claim = flow::claim_now(store, &ticket);
                    conclude(store, options, &admission, ticket, claim, deadline)
                })
                .await;
        };
        let claim = flow::claim_now_async(&**nonblocking, &ticket, &blocking_pool()).await;
        if flow::decide_writes(&self.options, &claim) {
            return self
                .blocking(move |store, options| {
                    conclude(store, options, &admission, ticket, claim, deadline)
                })
                .await;
        }
        // A store with `AsyncStore` tells its time without blocking, so the rest of the
        // decision (a 409's `Retry-After`, the heartbeat period) is made here.
        let (store, options) = (&*self.store, &*self.options);
        Some(conclude(
            store, options, &admission, ticket, claim, deadline,
        ))
    }

    /// Stores or releases what the handler returned and gives the client's answer (as
    /// `flow::settle` does): awaited where the store offers [`AsyncStore`]; on the blocking
    /// pool for a store without it, a completion through the options' hook (the
    /// application's sync code), and the rare second call after a failed completion. `None`
    /// if the blocking pool failed it (see [`blocking`](Runner::blocking)).
    pub(crate) async fn settle(
        &self,
        ticket: &Ticket,
        lease: Lease,
        response: Answer,
        started: Instant,
    ) -> Option<Answer> {
        let settling = Settling::new(&self.options, ticket, response, started);
        let blocking = blocking_pool();
        let call = |store| settling.call_async(store, &self.options, &lease, &blocking);
        // One statement, so that the call's borrows of `settling` end with it.
        let settled = match self.nonblocking.as_deref().and_then(call) {
            Some(call) => Some(call.await),
            None => None,
        };
        let Some(settled) = settled else {
            return self
                .blocking(move |store, options| settling.finish(store, options, &lease))
                .await;
        };
        match settling.answer(&self.options, settled) {
            Ok(answer) => Some(answer),
            Err(follow_up) => {
                self.blocking(move |store, options| follow_up.run(store, options, &lease))
                    .await
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
                    let go_on = heartbeat::beat(&|twin| store.heartbeat(twin), &mut twin, &|| {
                        watch.mark_lost()
                    });
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

/// The runtime's blocking pool as a [`Blocking`], for the group-commit leaders that the
/// store's async calls start. It holds the runtime's handle rather than looking it up when
/// called: the thread that appoints a leader may be outside the runtime (a sync caller of the
/// same store that led the batch before).
fn blocking_pool() -> Blocking {
    let runtime = tokio::runtime::Handle::current();
    Arc::new(move |work| drop(runtime.spawn_blocking(work)))
}

/// What one claim's result means: the decision, or how long to wait before claiming again.
/// Blocks where [`flow::decide`] does, and for the store's time.
fn conclude(
    store: &dyn IdempotencyStore,
    options: &HandleOptions,
    admission: &Admission,
    ticket: Ticket,
    claim: crate::error::Result<Claim>,
    deadline: Instant,
) -> Step {
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
