//! The actix-web 4 form (feature `actix`): the [`Idempotency`] middleware runs the flow of
//! [`handle`](super::handle) and of the tower layer around an actix-web app, with the same
//! [`HandleOptions`] and the same answers.
//!
//! ```
//! use actix_web::{App, HttpResponse, web};
//! use idempotency_store::http::{actix::Idempotency, HandleOptions};
//! use idempotency_store::Store;
//!
//! # fn app(store: Store) {
//! let idempotency = Idempotency::new(store, HandleOptions::new());
//! let app = App::new()
//!     .wrap(idempotency)
//!     .route("/payments", web::post().to(|| async { HttpResponse::Created().body("charged") }));
//! # drop(app);
//! # }
//! ```
//!
//! With several workers (`HttpServer::new` calls its factory once per worker), build the
//! middleware once outside the factory and move a clone in: clones share the bound on
//! blocking claims and the table of keys held, so a duplicate that waits is woken by the
//! holder's answer whichever worker runs it (with a middleware per worker, it finds a key
//! held on another worker as if another process held it, and claims again with a backoff).
//!
//! ```no_run
//! # use actix_web::{App, HttpServer, web};
//! # use idempotency_store::http::{actix::Idempotency, HandleOptions};
//! # async fn serve(store: idempotency_store::Store) -> std::io::Result<()> {
//! let idempotency = Idempotency::new(store, HandleOptions::new());
//! HttpServer::new(move || App::new().wrap(idempotency.clone()))
//!     .bind("127.0.0.1:8080")?
//!     .run()
//!     .await
//! # }
//! ```
//!
//! # What it does
//!
//! As the tower layer does (`http::tower`, whose docs say more): the body of a covered
//! request is read into memory, at most [`max_body`](HandleOptions::max_body) bytes (413
//! beyond, 400 if it cannot be read), and handed on as one chunk; a replay the store keeps in
//! memory is answered on the worker; every other store call (claim, heartbeat, complete,
//! release) runs on tokio's blocking pool, never on an actix worker thread, except where the
//! store offers [`AsyncStore`](crate::nonblocking::AsyncStore) (the redb `Store` does): the claim,
//! completion and release are then awaited on the worker, and only the store's group-commit
//! leader runs on the blocking pool, once per run of batches; a duplicate waits
//! for the attempt in flight on the runtime's timer, at most [`wait`](HandleOptions::wait);
//! claims go through [`max_blocking`](Idempotency::max_blocking) slots, and a request that
//! finds none within [`queue_timeout`](Idempotency::queue_timeout) gets 503; storage errors
//! are 503. The answer is teed as the tower layer's is: one of known length that fits in the
//! store is read whole and stored first; any other goes to the client as it is produced while
//! a bounded copy is recorded, stored if the body ends within `max_response_bytes`, else
//! replaced by a stored 410 ([`problem_type::COMPLETED_NOT_STORED`]) that every retry gets; a
//! body that fails mid-stream cuts the client's connection and stores the 500
//! ([`problem_type::NOT_STORED`]). docs/http.md, "Answer shapes", has the table.
//!
//! The handler finds its [`LeaseWatch`] in the request's extensions
//! (`web::ReqData<LeaseWatch>`), and marks an answer that should release the key by
//! inserting [`NotFinal`] into the `HttpResponse`'s extensions. actix has extensions of its
//! own type: a handler that leaves values for a [`complete_with`](HandleOptions::complete_with)
//! hook builds an `http` 1 response and answers [`respond`]`(response)`, which keeps its
//! `http` extensions for the hook. The options' closures see the request's method, target,
//! headers and body; [`RequestView::extensions`] is empty, so a scope function reads the
//! principal from a header.
//!
//! # When the client goes away
//!
//! Once the request's body is read, its claim, the handler, its teed body and the settling
//! call (complete, substitute or release) run on a task of their own on the worker
//! ([`actix_web::rt::spawn`]); the response future only waits for that task. A client that
//! hangs up or times out cancels nothing: the handler runs to its end, its answer is stored,
//! and the client's retry gets the replay (or waits for it, or 409 while it runs). The task
//! ends with the worker, so a graceful shutdown drains the middleware first (below); a server
//! that stops without it before the handler returns leaves the key in progress until its
//! lease lapses, as a crash does.
//!
//! # Shutdown
//!
//! [`Idempotency::drain_handle`] gives the tower layer's [`Drain`], with the same
//! [`DrainReport`]. actix's workers end with the server and take the tasks they run with them,
//! so the drain runs *before* they stop: as the server's shutdown signal, which replaces
//! actix's own handling of SIGTERM and SIGINT. [`Drain::finish`] refuses new claims (503 with
//! `Retry-After: 1`), lets the operations in flight finish up to its deadline, then stops
//! those left and releases their keys (or stores "outcome unknown" under
//! [`Takeover::AnswerUnknown`](super::Takeover::AnswerUnknown)); the server then stops
//! gracefully, its connections answered.
//!
//! ```no_run
//! # use std::time::Duration;
//! # use actix_web::{App, HttpServer};
//! # use idempotency_store::http::{actix::Idempotency, HandleOptions};
//! # async fn serve(store: idempotency_store::Store) -> std::io::Result<()> {
//! let idempotency = Idempotency::new(store, HandleOptions::new());
//! let drain = idempotency.drain_handle();
//! HttpServer::new(move || App::new().wrap(idempotency.clone()))
//!     .shutdown_signal(async move {
//!         let _ = tokio::signal::ctrl_c().await; // or SIGTERM
//!         let report = drain.finish(Duration::from_secs(10)).await;
//!         assert_eq!(report.left_in_progress, 0);
//!     })
//!     .bind("127.0.0.1:8080")?
//!     .run()
//!     .await
//! # }
//! ```
//!
//! An error the inner service returns instead of a response is answered as actix renders it
//! (`ResponseError::error_response`), and that answer is settled like any other.

mod convert;
mod shutdown;

use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use ::http::StatusCode;
use actix_web::body::{BodySize, BoxBody, MessageBody};
use actix_web::dev::{Payload, Service, ServiceRequest, ServiceResponse, Transform};
use actix_web::{HttpMessage, HttpResponse, ResponseError, web};
use tokio::sync::oneshot;

use super::admission::{Admission, Holding};
pub use super::admission::{DEFAULT_MAX_BLOCKING, DEFAULT_QUEUE_TIMEOUT};
pub use super::drain::{Drain, DrainReport};
use super::flow::{self, Screen, Ticket};
use super::heartbeat::LeaseWatch;
use super::options::HandleOptions;
#[cfg(doc)]
use super::options::NotFinal;
use super::prefer;
use super::runner::{Claimed, Runner};
use super::tee;
use super::view::RequestView;
use super::{Problem, problem_type};
use crate::api::outcome::Lease;
use crate::api::store::IdempotencyStore;

/// The actix-web middleware (a [`Transform`]) that makes the services it wraps idempotent;
/// see the module docs. Cheap to clone; clones share their admission.
#[derive(Clone)]
pub struct Idempotency {
    runner: Runner,
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency")
            .field("options", &self.runner.options)
            .finish_non_exhaustive()
    }
}

impl Idempotency {
    /// The middleware over `store` (a `Store`, a `PgStore`, or an `Arc` of either) with
    /// `options`.
    #[must_use]
    pub fn new(store: impl IdempotencyStore + 'static, options: HandleOptions) -> Self {
        Idempotency::shared(Arc::new(store), options)
    }

    /// The middleware over a store shared with the rest of the application.
    #[must_use]
    pub fn shared(store: Arc<dyn IdempotencyStore>, options: HandleOptions) -> Self {
        Idempotency {
            runner: Runner::new(store, options),
        }
    }

    /// At most `claims` of this middleware's claims in flight at once, on tokio's blocking pool
    /// or awaited (default [`DEFAULT_MAX_BLOCKING`], at least 1); a request waits for a slot
    /// without holding a thread. Keep it below the runtime's `max_blocking_threads` (tokio's default: 512) less
    /// what the rest of the application runs there, as for the tower layer.
    #[must_use]
    pub fn max_blocking(mut self, claims: usize) -> Self {
        let timeout = self.runner.admission.queue_timeout;
        self.runner.admission = Arc::new(Admission::new(claims, timeout));
        self
    }

    /// How long a request waits for a slot ([`max_blocking`](Idempotency::max_blocking))
    /// before it is answered 503 with `Retry-After: 1` (default [`DEFAULT_QUEUE_TIMEOUT`]),
    /// or 409 for a duplicate that was already waiting for the attempt in flight. The
    /// handler does not run and the key is not touched.
    #[must_use]
    pub fn queue_timeout(mut self, timeout: Duration) -> Self {
        let claims = self.runner.admission.max_blocking;
        self.runner.admission = Arc::new(Admission::new(claims, timeout));
        self
    }
}

impl<S, B> Transform<S, ServiceRequest> for Idempotency
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<BoxBody>;
    type Error = actix_web::Error;
    type Transform = IdempotencyMiddleware<S>;
    type InitError = ();
    type Future = Ready<Result<Self::Transform, Self::InitError>>;

    fn new_transform(&self, service: S) -> Self::Future {
        ready(Ok(IdempotencyMiddleware {
            service: Rc::new(service),
            runner: self.runner.clone(),
        }))
    }
}

/// The service [`Idempotency`] wraps around an inner service.
pub struct IdempotencyMiddleware<S> {
    service: Rc<S>,
    runner: Runner,
}

impl<S> std::fmt::Debug for IdempotencyMiddleware<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyMiddleware")
            .field("options", &self.runner.options)
            .finish_non_exhaustive()
    }
}

type Served = Result<ServiceResponse<BoxBody>, actix_web::Error>;

impl<S, B> Service<ServiceRequest> for IdempotencyMiddleware<S>
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    type Response = ServiceResponse<BoxBody>;
    type Error = actix_web::Error;
    type Future = Pin<Box<dyn Future<Output = Served>>>;

    actix_web::dev::forward_ready!(service);

    fn call(&self, request: ServiceRequest) -> Self::Future {
        Box::pin(serve(
            Rc::clone(&self.service),
            self.runner.clone(),
            request,
        ))
    }
}

/// What every answer to a covered request carries (`flow::finish`): the key echoed, and
/// the `Preference-Applied` of its wait.
struct Finish {
    key: Option<::http::HeaderValue>,
    applied: Option<::http::HeaderValue>,
}

impl Finish {
    fn apply<T>(
        &self,
        options: &HandleOptions,
        answer: ::http::Response<T>,
    ) -> ::http::Response<T> {
        flow::finish(options, self.key.as_ref(), self.applied.clone(), answer)
    }
}

type Answer = ::http::Response<Vec<u8>>;

/// One request: screened, its body read and its ticket made here; a cached replay answered
/// here; everything from the claim on on a task of its own.
async fn serve<S, B>(service: Rc<S>, runner: Runner, mut request: ServiceRequest) -> Served
where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error> + 'static,
    B: MessageBody + 'static,
{
    let options = Arc::clone(&runner.options);
    let options = &*options;
    let method = convert::method(request.method());
    let headers = convert::headers(request.headers());
    if let Screen::Pass = flow::screen(options, &method, &headers) {
        return service
            .call(request)
            .await
            .map(ServiceResponse::map_into_boxed_body);
    }
    let wait = prefer::wait(options, &headers);
    let finish = Finish {
        key: headers.get(super::IDEMPOTENCY_KEY).cloned(),
        applied: wait.applied,
    };
    let payload = request.extract::<web::Payload>().await?;
    let body = match payload.to_bytes_limited(options.max_body).await {
        Ok(Ok(body)) => body,
        Ok(Err(_)) => return Ok(answer(request, &finish, options, unreadable(options))),
        Err(_) => {
            let too_large = flow::too_large(options, options.max_body);
            return Ok(answer(request, &finish, options, too_large));
        }
    };
    let mut view = ::http::Request::new(body);
    *view.method_mut() = method;
    *view.uri_mut() = convert::uri(request.uri());
    *view.headers_mut() = headers;
    let ticket = match flow::ticket(options, &RequestView::of(&view)) {
        Ok(ticket) => ticket,
        Err(refused) => return Ok(answer(request, &finish, options, *refused)),
    };
    if let Some(replay) = flow::cached_replay(&*runner.store, options, &ticket) {
        return Ok(answer(request, &finish, options, replay));
    }
    request.set_payload(Payload::from(view.into_body()));
    let (lease, ticket, period) = match runner.claim(ticket, wait.bound).await {
        Claimed::Run(ticket, lease, period) => (lease, ticket, period),
        Claimed::Answer(claimed) => return Ok(answer(request, &finish, options, claimed)),
    };
    // Until the holder lets go (after the settling call, or when a drain stops it),
    // duplicates wait for it on the timer.
    let holding = runner.admission.hold(&lease);
    let (key, token) = (lease.key().clone(), lease.token());
    let admission = Arc::clone(&runner.admission);
    let (done, answered) = oneshot::channel();
    // A local task of the worker: it outlives this future when the client hangs up.
    let task = actix_web::rt::spawn(async move {
        let held = Held {
            lease,
            period,
            _holding: holding,
        };
        run(&*service, &runner, request, ticket, held, &finish, done).await;
    });
    admission.running(&key, token, task.abort_handle());
    match answered.await {
        Ok(served) => served,
        // The handler panicked, or a drain stopped it and settled the key.
        Err(_) => Err(Answered(options.answer(&Problem::internal())).into()),
    }
}

/// The lease a request holds, its heartbeat period, and its hold in the admission.
struct Held {
    lease: Lease,
    period: Option<Duration>,
    _holding: Holding,
}

/// The handler under the lease, heartbeating, then its answer stored (or the key released)
/// and sent through `done`: an answer of known length that fits in the store is read whole
/// and settled first; any other is teed, its head sent at once and its body as it comes
/// (the tower layer's docs say more).
async fn run<S, B>(
    service: &S,
    runner: &Runner,
    request: ServiceRequest,
    ticket: Ticket,
    held: Held,
    finish: &Finish,
    done: oneshot::Sender<Served>,
) where
    S: Service<ServiceRequest, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody + 'static,
{
    let Held {
        lease,
        period,
        _holding,
    } = held;
    let watch = LeaseWatch::new(&lease);
    request.extensions_mut().insert(watch.clone());
    // Dropped after the handler's body and the settling call: the heartbeat task then stops.
    let _beating = period.map(|period| runner.beat(lease.twin(), period, watch));
    let started = Instant::now();
    let (request, response) = match service.call(request).await {
        Ok(served) => {
            let (request, response) = served.into_parts();
            (Some(request), response.map_into_boxed_body())
        }
        Err(err) => (None, err.error_response()),
    };
    let (mut head, body) = response.into_parts();
    let exact = match body.size() {
        BodySize::None => Some(0),
        BodySize::Sized(len) => Some(len),
        BodySize::Stream => None,
    };
    let limit = runner.store.settings().max_response_bytes();
    let fits = tee::Recording::new(limit, &convert::headers(head.headers())).fits(exact);
    // An inner service's error is answered whole: actix renders it from a whole answer.
    let collected = match &request {
        Some(request) if !fits => match tee::start(Frames(body), &runner.options).await {
            tee::Start::Teed(teeing) => {
                let (parts, ()) = convert::answer(&mut head, ()).into_parts();
                let (inlet, outlet) = tee::channel(exact);
                let mut client = ::http::Response::new(());
                *client.status_mut() = parts.status;
                *client.headers_mut() = parts.headers.clone();
                let client = finish.apply(&runner.options, client);
                let client = convert::response_with(client.map(|()| BoxBody::new(Teed(outlet))));
                // A client that is gone already still gets its answer stored.
                let _ = done.send(Ok(ServiceResponse::new(request.clone(), client)));
                tee::run(runner, &ticket, lease, parts, teeing, inlet, started).await;
                return;
            }
            tee::Start::Empty => Ok(Vec::new()),
            tee::Start::Failed => Err(()),
        },
        _ => actix_web::body::to_bytes(body)
            .await
            .map(Vec::from)
            .map_err(|err| runner.options.report(&*err)),
    };
    let settled = match collected {
        Ok(body) => {
            let response = convert::answer(&mut head, body);
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
    let options = &*runner.options;
    let settled = settled.unwrap_or_else(|| options.answer(&Problem::internal()));
    let settled = finish.apply(options, settled);
    let _ = done.send(match request {
        Some(request) => Ok(ServiceResponse::new(request, convert::response(settled))),
        None => Err(Answered(settled).into()),
    });
}

/// The handler's body as the tee reads it.
struct Frames(BoxBody);

impl tee::Source for Frames {
    type Error = BodyError;

    fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<tee::Piece, BodyError>>> {
        let chunk = std::task::ready!(Pin::new(&mut self.0).poll_next(cx));
        Poll::Ready(chunk.map(|chunk| chunk.map(tee::Piece::Data).map_err(BodyError)))
    }
}

/// The handler's body failed.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct BodyError(Box<dyn std::error::Error>);

/// The client's end of a teed answer: the handler's body as it comes, cut (an error, so
/// that actix closes the connection) if it fails before its end.
struct Teed(tee::Outlet);

impl MessageBody for Teed {
    type Error = tee::Cut;

    fn size(&self) -> BodySize {
        self.0.exact().map_or(BodySize::Stream, BodySize::Sized)
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<actix_web::web::Bytes, tee::Cut>>> {
        let outlet = &mut self.get_mut().0;
        loop {
            return Poll::Ready(match std::task::ready!(outlet.poll_piece(cx)) {
                Some(Ok(tee::Piece::Data(data))) => Some(Ok(data)),
                // actix sends no trailers.
                Some(Ok(tee::Piece::Trailers(_) | tee::Piece::End)) => continue,
                Some(Err(cut)) => Some(Err(cut)),
                None => None,
            });
        }
    }
}

/// An `http` 1 response as actix's, with its `http` extensions kept for the middleware: a
/// [`NotFinal`] among them releases the key, and a
/// [`complete_with`](HandleOptions::complete_with) hook finds the rest, as it does behind the
/// tower layer. A handler behind [`Idempotency`] answers with it where it needs either.
#[must_use]
pub fn respond<B: MessageBody + 'static>(response: ::http::Response<B>) -> HttpResponse {
    convert::response_with(response.map(BoxBody::new))
}

/// `answer` to `request`, finished, as actix's response.
fn answer(
    request: ServiceRequest,
    finish: &Finish,
    options: &HandleOptions,
    answer: Answer,
) -> ServiceResponse {
    request.into_response(convert::response(finish.apply(options, answer)))
}

/// 400 for a body that could not be read to the end.
fn unreadable(options: &HandleOptions) -> Answer {
    options.answer(&Problem::new(
        StatusCode::BAD_REQUEST,
        problem_type::INVALID_BODY,
        "Request body unreadable",
        "The request body could not be read to the end; send it again.",
    ))
}

/// The flow's answer as an actix error, where no request is left to answer with (the inner
/// service returned an error, or the handler panicked): actix renders it as this answer.
#[derive(Debug)]
struct Answered(::http::Response<Vec<u8>>);

impl std::fmt::Display for Answered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the idempotency middleware answered {}", self.0.status())
    }
}

impl ResponseError for Answered {
    fn status_code(&self) -> actix_web::http::StatusCode {
        actix_web::http::StatusCode::from_u16(self.0.status().as_u16())
            .unwrap_or(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR)
    }

    fn error_response(&self) -> HttpResponse<BoxBody> {
        convert::response(self.0.clone())
    }
}
