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
//!   [`tokio::task::spawn_blocking`]: nothing blocks an async worker thread, with the embedded
//!   `Store` and with `PgStore`'s synchronous client alike. The layer needs a tokio runtime.
//!   One call runs on the async thread first:
//!   [`IdempotencyStore::cached_replay`], which
//!   answers a retry of a key the store has replayed before from memory (no I/O, one short
//!   lock; the redb `Store` keeps such replays, `PgStore` none), so that a retry storm costs
//!   no trip to the blocking pool and back, which on a small machine costs more than the
//!   claim itself (BENCHMARKS.md). Everything else about the answer is as for a claim.
//! - The inner service's [`LeaseWatch`] is in the request's extensions; the heartbeat is a
//!   task that sleeps on the runtime's timer and beats on the blocking pool.
//! - The response body is read whole before it is stored (a body that fails to stream gives
//!   the client a 500 and leaves the key to its lease, like a panicking handler).
//!
//! # When the client goes away
//!
//! If the connection closes while the inner service runs, hyper drops the response future
//! and with it the inner service's future. The layer then does nothing to the key: no
//! completion, no release (a half-done payment must not be run again at once). The heartbeat
//! stops with the future, so the key stays in progress until its lease lapses (at most one
//! lease after the drop); then the client's retry takes it over and the inner service runs
//! again as attempt 2 ([`LeaseWatch::attempt`], with the last checkpoint). An inner service
//! that returns an error is treated the same way.

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

use super::flow::{self, Decided, Screen, Ticket};
use super::heartbeat::{self, LeaseWatch};
use super::options::{BoxError, HandleOptions};
use super::view::RequestView;
use super::{Problem, problem_type};
use crate::api::backend::IdempotencyStore;
use crate::api::outcome::Lease;

/// A [`tower::Layer`] that makes the services it wraps idempotent; see the module docs.
#[derive(Clone)]
pub struct IdempotencyLayer {
    store: Arc<dyn IdempotencyStore>,
    options: Arc<HandleOptions>,
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
        }
    }
}

/// The service [`IdempotencyLayer`] wraps around an inner service.
#[derive(Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    store: Arc<dyn IdempotencyStore>,
    options: Arc<HandleOptions>,
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
        };
        Box::pin(flow.run(inner, request))
    }
}

/// The lease to run with (and the heartbeat period), or the answer.
enum Claimed {
    Run(Ticket, Lease, Option<Duration>),
    Answer(Answer),
}

/// One request's share of the layer.
struct Flow {
    store: Arc<dyn IdempotencyStore>,
    options: Arc<HandleOptions>,
}

impl Flow {
    async fn run<S, ReqBody, ResBody>(
        self,
        mut inner: S,
        request: Request<ReqBody>,
    ) -> Result<Response<ResBody>, S::Error>
    where
        S: tower::Service<Request<ReqBody>, Response = Response<ResBody>>,
        ReqBody: Body + From<Bytes>,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body + From<Bytes>,
        ResBody::Error: Into<BoxError>,
    {
        let options = &self.options;
        if let Screen::Pass = flow::screen(options, request.method(), request.headers()) {
            return inner.call(request).await;
        }
        let (parts, body) = request.into_parts();
        let body = match Limited::new(body, options.max_body).collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(err) => return Ok(into_body(unreadable(options.max_body, &*err))),
        };
        let mut request = Request::from_parts(parts, body);
        let ticket = match flow::ticket(options, &RequestView::of(&request)) {
            Ok(ticket) => ticket,
            Err(answer) => return Ok(into_body(*answer)),
        };
        // A replay the store keeps in memory needs no trip to the blocking pool.
        if let Some(answer) = flow::cached_replay(&*self.store, options, &ticket) {
            return Ok(into_body(answer));
        }
        let (ticket, lease, period) = match self.claim(ticket).await {
            Claimed::Run(ticket, lease, period) => (ticket, lease, period),
            Claimed::Answer(answer) => return Ok(into_body(answer)),
        };
        let watch = LeaseWatch::new(&lease);
        request.extensions_mut().insert(watch.clone());
        // Dropped with this future (or after the handler): the heartbeat task then stops.
        let _beating = period.map(|period| self.beat(lease.twin(), period, watch));
        let started = Instant::now();
        let response = inner.call(request.map(ReqBody::from)).await?;
        let (parts, body) = response.into_parts();
        let body = match body.collect().await {
            Ok(collected) => collected.to_bytes(),
            Err(err) => {
                options.report(&*err.into());
                return Ok(into_body(Problem::internal().to_http()));
            }
        };
        let response = Response::from_parts(parts, body.to_vec());
        let answer = self
            .blocking(move |store, options| {
                flow::settle(store, options, &ticket, &lease, response, started)
            })
            .await;
        Ok(into_body(
            answer.unwrap_or_else(|| Problem::internal().to_http()),
        ))
    }

    /// Claims and decides on the blocking pool.
    async fn claim(&self, ticket: Ticket) -> Claimed {
        let claimed = self
            .blocking(move |store, options| {
                let claim = flow::claim(store, options, &ticket);
                match flow::decide(store, options, &ticket, claim) {
                    Decided::Run(lease) => {
                        let period = flow::heartbeat_period(store, options, &lease);
                        Claimed::Run(ticket, lease, period)
                    }
                    Decided::Answer(answer) => Claimed::Answer(answer),
                }
            })
            .await;
        claimed.unwrap_or_else(|| Claimed::Answer(Problem::internal().to_http()))
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
                    let go_on = heartbeat::beat(&*store, &mut twin, &watch);
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

/// 413 for a body over the limit, 400 for one that could not be read.
fn unreadable(max: usize, err: &(dyn std::error::Error + 'static)) -> Answer {
    if err.downcast_ref::<LengthLimitError>().is_some() {
        return flow::too_large(max);
    }
    Problem::new(
        StatusCode::BAD_REQUEST,
        problem_type::INVALID_BODY,
        "Request body unreadable",
        "The request body could not be read to the end; send it again.",
    )
    .to_http()
}

fn into_body<B: From<Bytes>>(answer: Answer) -> Response<B> {
    answer.map(|body| B::from(Bytes::from(body)))
}
