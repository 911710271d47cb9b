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
//!   synchronous client alike. The layer needs a tokio runtime. Where the store offers
//!   [`AsyncStore`](crate::nonblocking::AsyncStore) ([`IdempotencyStore::nonblocking`]; the redb `Store`
//!   does), the claim, completion and release are awaited instead: the store decides in memory
//!   on the async thread and queues its write in the group commit, whose leader runs on the
//!   blocking pool (one trip per run of batches, not one per call) and wakes each waiting
//!   request once its write is durable; over a store in memory, which waits for no I/O, the
//!   async thread commits the batch itself. A completion through
//!   [`complete_with`](HandleOptions::complete_with)'s hook, a takeover under
//!   [`Takeover::AnswerUnknown`](super::Takeover::AnswerUnknown), the heartbeat and the rare
//!   second call after a failed completion still go to the blocking pool.
//!   One call runs on the async thread first:
//!   [`IdempotencyStore::cached_replay`], which
//!   answers a retry of a key the store has replayed before from memory (no I/O, one short
//!   lock; the redb `Store` keeps such replays, `PgStore` none), so that a retry storm costs
//!   no trip to the blocking pool and back, which on a small machine costs more than the
//!   claim itself (BENCHMARKS.md, "HTTP: the tower layer against the bare axum app").
//!   Everything else about the answer is as for a claim.
//! - The inner service's [`LeaseWatch`] is in the request's extensions; the heartbeat is a
//!   task that sleeps on the runtime's timer and beats on the blocking pool.
//! - The answer is teed (the service's response body is [`LayerBody`]). An answer whose length
//!   is known and fits in the store's `max_response_bytes` is read whole and stored before
//!   the client gets it, as `handle` does. Any other (a stream, server-sent events, an answer
//!   larger than the store keeps) goes to the client as the inner service produces it, from
//!   its first frame on, while a copy is recorded on the side, at most `max_response_bytes`:
//!   - the body ends within the limit: the copy is stored and every retry replays it byte
//!     for byte;
//!   - past the limit: the copy is dropped and the client's stream goes on; when the body
//!     ends, the key is completed with a stored 410
//!     ([`problem_type::COMPLETED_NOT_STORED`](super::problem_type::COMPLETED_NOT_STORED))
//!     that every retry gets: done, do not repeat it under a new key;
//!   - the body fails mid-stream: the client's connection is cut after the bytes sent (it
//!     cannot take them for a whole answer), and the key is completed with the 500
//!     ([`problem_type::NOT_STORED`](super::problem_type::NOT_STORED)) that a body failing
//!     before its first byte gets as the client's answer too. The inner service ran and may
//!     have done its work, so a release (a second run on the retry) could do it twice
//!     unknowingly. A warning goes to `tracing` (feature `tracing`) and the error to
//!     [`on_error`](HandleOptions::on_error).
//!
//!   The client sees the end of a teed body only once the key is settled (a body of known
//!   length keeps its last byte back until then), so a client that retries at once gets the
//!   replay. The body goes to the client through a channel of a few frames, so memory stays
//!   bounded whatever the answer's size, and a slow client holds the inner body back as it
//!   would without the layer. The settling call's own answer (say a store error's 503)
//!   cannot reach a client that already has the head: it goes to
//!   [`on_error`](HandleOptions::on_error). docs/http.md, "Answer shapes", has the table.
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
//! - Claims go through [`max_blocking`](IdempotencyLayer::max_blocking) slots (default
//!   [`DEFAULT_MAX_BLOCKING`]), whether on the blocking pool or awaited. A request waits for
//!   a slot without a thread, up to [`queue_timeout`](IdempotencyLayer::queue_timeout) (default
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
//! Once a request holds the key, the inner service's future, its teed body and the settling
//! call (complete, the stored substitute, or release) run on a task of their own; the
//! response future and the client's body only wait for it. A client that times out, a
//! reset, or hyper closing the connection (mid-stream too) drops them and cancels nothing:
//! the operation and its body run to their end (the heartbeat keeps the lease), its answer
//! is stored, and the client's retry gets it, at once if it comes later, or the moment it
//! exists if the retry is waiting for it (see "Waiting and overload").
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

use ::http::{Request, Response};
use bytes::{Buf, Bytes};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Limited};
use tokio::sync::oneshot;
use tokio::task::AbortHandle;

use super::admission::{Admission, Holding};
pub use super::admission::{DEFAULT_MAX_BLOCKING, DEFAULT_QUEUE_TIMEOUT};
pub use super::drain::{Drain, DrainReport};
use super::flow::{self, Screen, Ticket};
use super::heartbeat::LeaseWatch;
use super::options::{BoxError, HandleOptions};
use super::prefer;
use super::runner::{Claimed, Runner, unreadable};
use super::tee;
use super::view::RequestView;
use super::{IDEMPOTENCY_KEY, Problem};
use crate::api::outcome::Lease;
use crate::api::store::IdempotencyStore;

/// A [`tower::Layer`](https://docs.rs/tower/0.5/tower/trait.Layer.html) that makes the services
/// it wraps idempotent; see the module docs.
#[derive(Clone)]
pub struct IdempotencyLayer {
    runner: Runner,
}

impl std::fmt::Debug for IdempotencyLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("options", &self.runner.options)
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
            runner: Runner::new(store, options),
        }
    }

    /// At most `claims` of this layer's claims in flight at once, on tokio's blocking pool or
    /// awaited (default [`DEFAULT_MAX_BLOCKING`], at least 1); a request waits for a slot
    /// without holding a thread. Keep it below the runtime's `max_blocking_threads` (tokio's default: 512)
    /// less what the rest of the application runs there, so that a holder's heartbeat and
    /// completion, which need no slot, always find a thread soon.
    #[must_use]
    pub fn max_blocking(mut self, claims: usize) -> Self {
        let timeout = self.runner.admission.queue_timeout;
        self.runner.admission = Arc::new(Admission::new(claims, timeout));
        self
    }

    /// How long a request waits for a slot ([`max_blocking`](IdempotencyLayer::max_blocking))
    /// before the layer answers that it is overloaded (default [`DEFAULT_QUEUE_TIMEOUT`]): 503
    /// with `Retry-After: 1`, or 409 for a duplicate that was already waiting for the
    /// attempt in flight. The handler does not run and the key is not touched.
    #[must_use]
    pub fn queue_timeout(mut self, timeout: Duration) -> Self {
        let claims = self.runner.admission.max_blocking;
        self.runner.admission = Arc::new(Admission::new(claims, timeout));
        self
    }

    /// The handle that drains this layer at shutdown: see [`Drain`]. Take it after the
    /// other settings (`max_blocking` and `queue_timeout` make a new admission).
    #[must_use]
    pub fn drain_handle(&self) -> Drain {
        Drain {
            store: Arc::clone(&self.runner.store),
            options: Arc::clone(&self.runner.options),
            admission: Arc::clone(&self.runner.admission),
        }
    }
}

impl<S> tower::Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            runner: self.runner.clone(),
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around an inner service.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    runner: Runner,
}

impl<S> std::fmt::Debug for IdempotencyService<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("options", &self.runner.options)
            .finish_non_exhaustive()
    }
}

type Answer = Response<Vec<u8>>;

/// What the task that holds the key sends the response future: the answer, or the inner
/// service's error.
type Reply<B, E> = oneshot::Sender<Result<Response<LayerBody<B>>, E>>;

impl<S, ReqBody, ResBody> tower::Service<Request<ReqBody>> for IdempotencyService<S>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ReqBody::Data: Send,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<LayerBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The clone that was driven to readiness serves this request.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(serve(self.runner.clone(), inner, request))
    }
}

async fn serve<S, ReqBody, ResBody>(
    runner: Runner,
    mut inner: S,
    request: Request<ReqBody>,
) -> Result<Response<LayerBody<ResBody>>, S::Error>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
    ReqBody::Error: Into<BoxError>,
{
    let options = Arc::clone(&runner.options);
    if let Screen::Pass = flow::screen(&options, request.method(), request.headers()) {
        let response = inner.call(request).await?;
        return Ok(response.map(LayerBody::inner));
    }
    // Of the request's headers, the answer needs only the key (echoed), not a copy of all.
    let key = request.headers().get(IDEMPOTENCY_KEY).cloned();
    let wait = prefer::wait(&options, request.headers());
    let answer = covered(runner, inner, request, wait.bound).await?;
    Ok(flow::finish(&options, key.as_ref(), wait.applied, answer))
}

/// A covered request's answer: from the claim, or from the run of the inner service on
/// a task of its own.
async fn covered<S, ReqBody, ResBody>(
    runner: Runner,
    inner: S,
    request: Request<ReqBody>,
    wait: Duration,
) -> Result<Response<LayerBody<ResBody>>, S::Error>
where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ReqBody: Body + From<Bytes> + Send + 'static,
    ResBody: Body + Send + 'static,
    ResBody::Data: Send,
    ResBody::Error: Into<BoxError>,
    ReqBody::Error: Into<BoxError>,
{
    let options = Arc::clone(&runner.options);
    let options = &*options;
    let (parts, body) = request.into_parts();
    let body = match Limited::new(body, options.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) => return Ok(whole(unreadable(options, &*err))),
    };
    let request = Request::from_parts(parts, body);
    let ticket = match flow::ticket(options, &RequestView::of(&request)) {
        Ok(ticket) => ticket,
        Err(answer) => return Ok(whole(*answer)),
    };
    // A replay the store keeps in memory needs no trip to the blocking pool.
    if let Some(answer) = flow::cached_replay(&*runner.store, options, &ticket) {
        return Ok(whole(answer));
    }
    // The claim, the run and the settle go on whatever becomes of this future: a client that
    // hangs up cancels nothing (not even a claim that was about to acquire the key), and its
    // retry gets the stored answer. The task replies as soon as the client can have the
    // answer's head, and goes on driving a streamed body to its end.
    let (task, this_task) = oneshot::channel();
    let (reply, replied) = oneshot::channel();
    let run = tokio::spawn(claim_and_hold(
        runner, inner, request, ticket, wait, this_task, reply,
    ));
    let _ = task.send(run.abort_handle());
    match replied.await {
        Ok(answer) => answer,
        // The inner service panicked, or a drain stopped it and settled the key.
        Err(_) => {
            if let Err(err) = run.await
                && err.is_panic()
            {
                options.report(&err);
            }
            Ok(whole(options.answer(&Problem::internal())))
        }
    }
}

/// Claims; with the key, runs the inner service on this task (`this_task`, for a drain that
/// must stop it).
async fn claim_and_hold<S, ReqBody, ResBody>(
    runner: Runner,
    inner: S,
    request: Request<Bytes>,
    ticket: Ticket,
    wait: Duration,
    this_task: oneshot::Receiver<AbortHandle>,
    reply: Reply<ResBody, S::Error>,
) where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: From<Bytes>,
    ResBody: Body + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (ticket, lease, period) = match runner.claim(ticket, wait).await {
        Claimed::Run(ticket, lease, period) => (ticket, lease, period),
        Claimed::Answer(answer) => {
            let _ = reply.send(Ok(whole(answer)));
            return;
        }
    };
    // Until the holder lets go (after the settling call, or when a drain stops it),
    // duplicates wait for it on the timer.
    let holding = runner.admission.hold(&lease);
    if let Ok(task) = this_task.await {
        runner.admission.running(lease.key(), lease.token(), task);
    }
    let held = Held {
        ticket,
        lease,
        period,
        _holding: holding,
    };
    hold(runner, inner, request, held, reply).await;
}

/// The key a request holds: its ticket and lease, the heartbeat period, and its hold in the
/// admission.
struct Held {
    ticket: Ticket,
    lease: Lease,
    period: Option<Duration>,
    _holding: Holding,
}

/// Runs the inner service with the lease, heartbeating, and stores or releases its
/// answer: an answer of known length that fits in the store is read whole and settled
/// before the client gets it; any other is teed (see the module docs).
async fn hold<S, ReqBody, ResBody>(
    runner: Runner,
    mut inner: S,
    request: Request<Bytes>,
    held: Held,
    reply: Reply<ResBody, S::Error>,
) where
    S: tower::Service<Request<ReqBody>, Response = Response<ResBody>>,
    ReqBody: From<Bytes>,
    ResBody: Body + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Held {
        ticket,
        lease,
        period,
        _holding,
    } = held;
    let watch = LeaseWatch::new(&lease);
    let mut request = request.map(ReqBody::from);
    request.extensions_mut().insert(watch.clone());
    // Dropped after the handler's body and the settling call (or with this task): the
    // heartbeat task then stops.
    let _beating = period.map(|period| runner.beat(lease.twin(), period, watch));
    let started = Instant::now();
    let response = match inner.call(request).await {
        Ok(response) => response,
        Err(err) => {
            let _ = reply.send(Err(err));
            return;
        }
    };
    let (parts, body) = response.into_parts();
    let limit = runner.store.settings().max_response_bytes();
    let exact = body.size_hint().exact();
    let collected = if tee::Recording::new(limit, &parts.headers).fits(exact) {
        body.collect().await.map(|c| c.to_bytes()).map_err(|err| {
            let err: BoxError = err.into();
            runner.options.report(&*err);
        })
    } else {
        match tee::start(Frames(Box::pin(body)), &runner.options).await {
            tee::Start::Teed(teeing) => {
                let (inlet, outlet) = tee::channel(exact);
                let head = Response::from_parts(parts.clone(), LayerBody::teed(outlet));
                // A client that is gone already still gets its answer stored.
                let _ = reply.send(Ok(head));
                tee::run(&runner, &ticket, lease, parts, teeing, inlet, started).await;
                return;
            }
            tee::Start::Empty => Ok(Bytes::new()),
            tee::Start::Failed => Err(()),
        }
    };
    let answer = match collected {
        Ok(body) => {
            let response = Response::from_parts(parts, Vec::from(body));
            runner.settle(&ticket, lease, response, started).await
        }
        // The handler ran: its answer is lost, so a substitute keeps it from running again.
        Err(()) => {
            runner
                .blocking(move |store, options| {
                    let why = "its response body failed while it was read";
                    flow::substitute(store, options, &lease, why, &::http::Extensions::new())
                })
                .await
        }
    };
    let answer = answer.unwrap_or_else(|| runner.options.answer(&Problem::internal()));
    let _ = reply.send(Ok(whole(answer)));
}

/// The inner service's body as the tee reads it.
struct Frames<B>(Pin<Box<B>>);

impl<B> tee::Source for Frames<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Error = BoxedError;

    fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<tee::Piece, BoxedError>>> {
        let frame = std::task::ready!(self.0.as_mut().poll_frame(cx));
        Poll::Ready(frame.map(|frame| match frame {
            Ok(frame) => Ok(match frame.into_data() {
                Ok(mut data) => tee::Piece::Data(data.copy_to_bytes(data.remaining())),
                Err(frame) => tee::Piece::Trailers(frame.into_trailers().unwrap_or_default()),
            }),
            Err(err) => Err(BoxedError(err.into())),
        }))
    }
}

/// A body's error as a `std` error (a `BoxError` is not one).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct BoxedError(BoxError);

/// The body of the layer's answers: the inner service's own for a request the layer does
/// not cover; an answer of the layer's (a replay, a problem) or one read whole; or the inner
/// service's answer teed, as it is produced, with the copy stored on the side. A teed body
/// that is cut before its end (the inner service's body failed, or a drain stopped it) ends
/// with an error, so that the server cuts the connection rather than end the answer as if
/// it were whole.
pub struct LayerBody<B> {
    kind: Kind<B>,
}

enum Kind<B> {
    Inner(Pin<Box<B>>),
    Whole(Option<Bytes>),
    Teed(tee::Outlet),
}

impl<B> std::fmt::Debug for LayerBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.kind {
            Kind::Inner(_) => "inner",
            Kind::Whole(_) => "whole",
            Kind::Teed(_) => "teed",
        };
        f.debug_struct("LayerBody")
            .field("kind", &kind)
            .finish_non_exhaustive()
    }
}

impl<B> LayerBody<B> {
    fn inner(body: B) -> Self {
        LayerBody {
            kind: Kind::Inner(Box::pin(body)),
        }
    }

    fn teed(outlet: tee::Outlet) -> Self {
        LayerBody {
            kind: Kind::Teed(outlet),
        }
    }
}

impl<B> Body for LayerBody<B>
where
    B: Body,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match &mut self.get_mut().kind {
            Kind::Inner(body) => body.as_mut().poll_frame(cx).map(|frame| {
                frame.map(|frame| match frame {
                    Ok(frame) => {
                        Ok(frame.map_data(|mut data| data.copy_to_bytes(data.remaining())))
                    }
                    Err(err) => Err(err.into()),
                })
            }),
            Kind::Whole(body) => Poll::Ready(body.take().map(|body| Ok(Frame::data(body)))),
            Kind::Teed(outlet) => outlet.poll_piece(cx).map(|piece| {
                piece.map(|piece| match piece {
                    Ok(tee::Piece::Data(data)) => Ok(Frame::data(data)),
                    Ok(tee::Piece::Trailers(trailers)) => Ok(Frame::trailers(trailers)),
                    Ok(tee::Piece::End) => Ok(Frame::data(Bytes::new())),
                    Err(cut) => Err(cut.into()),
                })
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Inner(body) => body.is_end_stream(),
            Kind::Whole(body) => body.is_none(),
            Kind::Teed(outlet) => outlet.is_done(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Inner(body) => body.size_hint(),
            Kind::Whole(body) => SizeHint::with_exact(body.as_ref().map_or(0, |b| b.len() as u64)),
            Kind::Teed(outlet) => outlet
                .exact()
                .map_or_else(SizeHint::default, SizeHint::with_exact),
        }
    }
}

/// One of the layer's own answers (or one read whole) as the layer's body.
fn whole<B>(answer: Answer) -> Response<LayerBody<B>> {
    answer.map(|body| LayerBody {
        kind: Kind::Whole((!body.is_empty()).then(|| Bytes::from(body))),
    })
}
