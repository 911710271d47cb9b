//! The tower/axum form (feature `tower`): [`IdempotencyLayer`] runs the flow of
//! [`handle`](super::handle) around any tower service of `http` requests, with every store
//! call that can block on tokio's blocking pool.
//!
//! ```
//! use idempotency_store::http::{tower::IdempotencyLayer, HandleOptions};
//! use idempotency_store::Store;
//!
//! # fn app(store: Store) -> axum::Router {
//! axum::Router::new()
//!     .route("/payments", axum::routing::post(|| async { (axum::http::StatusCode::CREATED, "charged") }))
//!     .layer(IdempotencyLayer::new(store, HandleOptions::new()))
//! # }
//! ```
//!
//! # How it differs from `handle`
//!
//! - The body of a covered request is read into memory, at most
//!   [`max_body`](HandleOptions::max_body) bytes (413 beyond; 400 if it cannot be read), and
//!   handed to the inner service as one chunk. Requests that are not covered are not touched.
//! - Every store call that can block (claim, `claim_wait` when [`wait`](HandleOptions::wait)
//!   is set, heartbeat, complete, release, the store's time) runs in
//!   [`tokio::task::spawn_blocking`](https://docs.rs/tokio/1/tokio/task/fn.spawn_blocking.html):
//!   nothing blocks an async worker thread, with the embedded `Store` and with `PgStore`'s
//!   synchronous client alike. The layer needs a tokio runtime.
//!   One call runs on the async thread first:
//!   [`IdempotencyStore::cached_replay`], which
//!   answers a retry of a key the store has replayed before from memory (no I/O, one short
//!   lock; the redb `Store` keeps such replays, `PgStore` none), so that a retry storm costs
//!   no trip to the blocking pool and back, which on a small machine costs more than the
//!   claim itself (BENCHMARKS.md). Everything else about the answer is as for a claim.
//! - The inner service's [`LeaseWatch`] is in the request's extensions; the heartbeat is a
//!   task that sleeps on the runtime's timer and beats on the blocking pool.
//! - The response body is read whole before it is stored. A body that fails to stream, like
//!   one larger than the store's `max_response_bytes`, is replaced by a stored 500
//!   ([`problem_type::NOT_STORED`]) that every retry
//!   replays: the inner service ran, so it must not run again for the key. A warning goes
//!   to `tracing` (feature `tracing`) and the error to [`on_error`](HandleOptions::on_error).
//!
//! # Waiting and overload
//!
//! Nothing a request waits for holds a blocking thread, so a flood of duplicates cannot
//! starve the holder of the key (its heartbeat would queue behind them, its lease lapse
//! while it is alive, and a duplicate run the inner service again):
//!
//! - A duplicate waits for the attempt in flight on the runtime's timer, up to
//!   [`wait`](HandleOptions::wait) (500 ms by default), or what the client asks with
//!   `Prefer: wait=N` (up to [`max_wait`](HandleOptions::max_wait); the answer then carries
//!   `Preference-Applied`). It is woken when this layer's holder of the key settles (it then
//!   takes the replay from memory where the store keeps one), or claims again with a
//!   backoff (10 ms doubling to 250 ms) when another process holds the key; never past the
//!   holder's lease or its own `wait`, then 409 as usual.
//! - Claims go to the blocking pool through [`max_blocking`](IdempotencyLayer::max_blocking)
//!   slots (default [`DEFAULT_MAX_BLOCKING`]). A request waits for a slot without a thread,
//!   up to [`queue_timeout`](IdempotencyLayer::queue_timeout) (default
//!   [`DEFAULT_QUEUE_TIMEOUT`]), and is then answered 503 with `Retry-After: 1` (409 if it
//!   was waiting for an attempt in flight), without touching the key.
//! - A holder's heartbeat, completion and release need no slot: they wait at most behind
//!   the claims in the slots, which are short.
//!
//! # Store errors
//!
//! The claim carries a fresh [`ClaimId`](crate::ClaimId) per request. A claim, completion or
//! release that fails with its outcome unknown ([`Error::outcome_unknown`](crate::Error::outcome_unknown),
//! e.g. `PgStore`'s connection lost mid-statement) is made once more (same claim id, same
//! lease), which settles what the first one did; if that fails too, the client gets 503 with
//! `Retry-After: 1`.
//!
//! # When the client goes away
//!
//! Once a request holds the key, the inner service's future and the settling call
//! (complete, the stored substitute, or release) run on a task of their own; the response
//! future only waits for it. A client that times out, a reset, or hyper closing the
//! connection drops the response future and cancels nothing: the operation runs to its end,
//! its answer is stored, and the client's retry gets it, at once if it comes later, or the
//! moment it exists if the retry is waiting for it (see "Waiting and overload").
//!
//! An inner service that panics or returns an error leaves the key in progress, like a
//! crashed process: no answer to store, and no proof that nothing happened. The heartbeat
//! stops with it, so a retry takes the key over within one lease (10 s by default) as
//! attempt 2, with the last checkpoint, or answers "outcome unknown" under
//! [`Takeover::AnswerUnknown`](super::Takeover::AnswerUnknown).
//!
//! # Shutdown
//!
//! Because a handler can outlive its connection, a server's graceful shutdown (which waits
//! for connections) does not wait for every handler. [`IdempotencyLayer::drain_handle`]
//! gives a [`Drain`]: after the server stops, `drain.finish(deadline).await` refuses new
//! claims, lets the operations in flight finish up to the deadline, then stops those left and
//! releases their keys (or stores "outcome unknown" under `Takeover::AnswerUnknown`), so that
//! no key is left in progress after a clean shutdown.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ::http::{Request, Response, StatusCode};
use bytes::Bytes;
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tokio::sync::oneshot;

use super::admission::{Admission, Holding};
pub use super::admission::{DEFAULT_MAX_BLOCKING, DEFAULT_QUEUE_TIMEOUT};
pub use super::drain::{Drain, DrainReport};
use super::flow::{self, Decided, Screen, Ticket};
use super::heartbeat::LeaseWatch;
use super::options::{BoxError, HandleOptions};
use super::prefer;
use super::view::RequestView;
use super::{Problem, problem_type};
use crate::api::backend::IdempotencyStore;
use crate::api::heartbeat;
use crate::api::outcome::{Claim, Lease};

/// A [`tower::Layer`](https://docs.rs/tower/0.5/tower/trait.Layer.html) that makes the services
/// it wraps idempotent; see the module docs.
#[derive(Clone)]
pub struct IdempotencyLayer {
    store: Arc<dyn IdempotencyStore>,
    options: Arc<HandleOptions>,
    admission: Arc<Admission>,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl IdempotencyLayer {
    /// The layer over `store` (a `Store`, a `PgStore`, or an `Arc` of either) with `options`.
    #[must_use]
    pub fn new(store: impl IdempotencyStore + 'static, options: HandleOptions) -> Self {
        IdempotencyLayer::shared(Arc::new(store), options)
    }

    /// The layer over a store shared with the rest of the application.
    #[must_use]
    pub fn shared(store: Arc<dyn IdempotencyStore>, options: HandleOptions) -> Self {
        IdempotencyLayer {
            store,
            options: Arc::new(options),
            admission: Arc::new(Admission::new(DEFAULT_MAX_BLOCKING, DEFAULT_QUEUE_TIMEOUT)),
        }
    }

    /// At most `claims` of this layer's claims on tokio's blocking pool at once (default
    /// [`DEFAULT_MAX_BLOCKING`], at least 1); a request waits for a slot without holding a
    /// thread. Keep it below the runtime's `max_blocking_threads` (tokio's default: 512)
    /// less what the rest of the application runs there, so that a holder's heartbeat and
    /// completion, which need no slot, always find a thread soon.
    #[must_use]
    pub fn max_blocking(mut self, claims: usize) -> Self {
        self.admission = Arc::new(Admission::new(claims, self.admission.queue_timeout));
        self
    }

    /// How long a request waits for a slot ([`max_blocking`](IdempotencyLayer::max_blocking))
    /// before the layer answers that it is overloaded (default [`DEFAULT_QUEUE_TIMEOUT`]): 503
    /// with `Retry-After: 1`, or 409 for a duplicate that was already waiting for the
    /// attempt in flight. The handler does not run and the key is not touched.
    #[must_use]
    pub fn queue_timeout(mut self, timeout: Duration) -> Self {
        let claims = self.admission.max_blocking;
        self.admission = Arc::new(Admission::new(claims, timeout));
        self
    }

    /// The handle that drains this layer at shutdown: see [`Drain`]. Take it after the
    /// other settings (`max_blocking` and `queue_timeout` make a new admission).
    #[must_use]
    pub fn drain_handle(&self) -> Drain {
        Drain {
            store: Arc::clone(&self.store),
            options: Arc::clone(&self.options),
            admission: Arc::clone(&self.admission),
        }
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            store: Arc::clone(&self.store),
            options: Arc::clone(&self.options),
            admission: Arc::clone(&self.admission),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around an inner service.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    store: Arc<dyn IdempotencyStore>,
    options: Arc<HandleOptions>,
    admission: Arc<Admission>,
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

type Answer = Response<Vec<u8>>;

impl<S, ReqBody, ResBody> tower::Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + From<Bytes> + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone that was driven to readiness serves this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let flow = Flow {
            store: Arc::clone(&self.store),
            options: Arc::clone(&self.options),
            admission: Arc::clone(&self.admission),
        };
        Box::pin(flow.run(inner, request))
    }
}

/// The lease to run with (and the heartbeat period), or the answer.
enum Claimed {
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

/// One request's share of the layer.
struct Flow {
    store: Arc<dyn IdempotencyStore>,
    options: Arc<HandleOptions>,
    admission: Arc<Admission>,
}

impl Flow {
    async fn run<S, ReqBody, ResBody>(
        self,
        mut inner: S,
        request: Request<ReqBody>,
    ) -> Result<Response<ResBody>, S::Error>
    where
        S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Body + From<Bytes> + Send + 'static,
        ResBody: Body + From<Bytes> + Send + 'static,
        ResBody::Data: Send,
        ResBody::Error: Into<BoxError>,
        ReqBody::Error: Into<BoxError>,
    {
        let options = Arc::clone(&self.options);
        if let Screen::Pass = flow::screen(&options, request.method(), request.headers()) {
            return inner.call(request).await;
        }
        let headers = request.headers().clone();
        let wait = prefer::wait(&options, &headers);
        let answer = self.covered(inner, request, wait.bound).await?;
        Ok(into_body(flow::finish(
            &options,
            &headers,
            wait.applied,
            answer,
        )))
    }

    /// A covered request's answer: from the claim, or from the run of the inner service on
    /// a task of its own.
    async fn covered<S, ReqBody, ResBody>(
        self,
        inner: S,
        request: Request<ReqBody>,
        wait: Duration,
    ) -> Result<Answer, S::Error>
    where
        S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        S::Future: Send + 'static,
        S::Error: Send + 'static,
        ReqBody: Body + From<Bytes> + Send + 'static,
        ResBody: Body + From<Bytes> + Send + 'static,
        ResBody::Data: Send,
        ResBody::Error: Into<BoxError>,
        ReqBody::Error: Into<BoxError>,
    {
        let options = Arc::clone(&self.options);
        let options = &*options;
        let (parts, body) = request.into_parts();
        let body = match Limited::new(body, options.max_body).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(err) => return Ok(unreadable(options, &*err)),
        };
        let request = Request::from_parts(parts, body);
        let ticket = match flow::ticket(options, &RequestView::of(&request)) {
            Ok(ticket) => ticket,
            Err(answer) => return Ok(*answer),
        };
        // A replay the store keeps in memory needs no trip to the blocking pool.
        if let Some(answer) = flow::cached_replay(&*self.store, options, &ticket) {
            return Ok(answer);
        }
        let (ticket, lease, period) = match self.claim(ticket, wait).await {
            Claimed::Run(ticket, lease, period) => (ticket, lease, period),
            Claimed::Answer(answer) => return Ok(answer),
        };
        // Until the holder lets go (after the settling call, or when a drain stops it),
        // duplicates wait for it on the timer.
        let holding = self.admission.hold(&lease);
        let (key, token) = (lease.key().clone(), lease.token());
        let admission = Arc::clone(&self.admission);
        // The run and the settle go on whatever becomes of this future: a client that hangs
        // up cancels nothing, and its retry gets the stored answer.
        let run = tokio::spawn(self.hold(inner, request, ticket, lease, period, holding));
        admission.running(&key, token, run.abort_handle());
        match run.await {
            Ok(answer) => answer,
            // The inner service panicked, or a drain stopped it and settled the key.
            Err(err) => {
                if err.is_panic() {
                    options.report(&err);
                }
                Ok(options.answer(&Problem::internal()))
            }
        }
    }

    /// Runs the inner service with the lease, heartbeating, and stores or releases its
    /// answer.
    async fn hold<S, ReqBody, ResBody>(
        self,
        mut inner: S,
        request: Request<Bytes>,
        ticket: Ticket,
        lease: Lease,
        period: Option<Duration>,
        _holding: Holding,
    ) -> Result<Answer, S::Error>
    where
        S: tower::Service<Request<ReqBody>, Response = Response<ResBody>>,
        ReqBody: From<Bytes>,
        ResBody: Body,
        ResBody::Error: Into<BoxError>,
    {
        let watch = LeaseWatch::new(&lease);
        let mut request = request.map(ReqBody::from);
        request.extensions_mut().insert(watch.clone());
        // Dropped after the handler (or with this task): the heartbeat task then stops.
        let _beating = period.map(|period| self.beat(lease.twin(), period, watch));
        let started = Instant::now();
        let response = inner.call(request).await?;
        let (parts, body) = response.into_parts();
        let collected = body.collect().await.map(|c| c.to_bytes()).map_err(|err| {
            let err: BoxError = err.into();
            self.options.report(&*err);
        });
        let answer = match collected {
            Ok(body) => {
                let response = Response::from_parts(parts, body.to_vec());
                self.blocking(move |store, options| {
                    flow::settle(store, options, &ticket, &lease, response, started)
                })
                .await
            }
            // The handler ran: its answer is lost, so a substitute keeps it from running again.
            Err(()) => {
                self.blocking(move |store, options| {
                    let why = "its response body failed while it was read";
                    flow::substitute(store, options, &lease, why, &::http::Extensions::new())
                })
                .await
            }
        };
        Ok(answer.unwrap_or_else(|| self.options.answer(&Problem::internal())))
    }

    /// Claims, waiting for an attempt in flight up to `wait`: on the timer, woken when this
    /// layer's holder of the key settles, or re-claiming with a backoff when another process
    /// holds it. Each claim needs a slot; none holds one while it waits.
    async fn claim(&self, mut ticket: Ticket, wait: Duration) -> Claimed {
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
    fn beat(&self, mut twin: Lease, period: Duration, watch: LeaseWatch) -> oneshot::Sender<()> {
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
    async fn blocking<T: Send + 'static>(
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
fn overloaded(options: &HandleOptions, waiting: bool) -> Answer {
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
fn shutting_down() -> Problem {
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
fn unreadable(options: &HandleOptions, err: &(dyn std::error::Error + 'static)) -> Answer {
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

fn into_body<B: From<Bytes>>(answer: Answer) -> Response<B> {
    answer.map(|body| B::from(Bytes::from(body)))
}
