//! The payments service shared by the `payments_server` and `payments` examples and by
//! `tests/payments_e2e.rs`: `POST /payments` charges once per `Idempotency-Key`,
//! `GET /payments/{id}` and `GET /ledger` read the charges, and `GET /metrics` (once given a
//! page with [`Payments::with_metrics_page`]) shows the store's metrics.
//!
//! The idempotency flow is `idempotency_store::http::handle`: this file only validates and
//! charges. A charge is a row in a ledger table in the store's own redb file, written by
//! `Store::complete_with_effects` (the options' completion hook) in the same group-commit batch
//! and log write as the stored answer: after a crash there is never a charge without its
//! answer, or an answer without its charge. The store must be opened with
//! `StoreBuilder::effect_table(LEDGER)`.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use idempotency_store::IdempotencyStore;
use idempotency_store::http::{self as idem, HandleOptions, Problem};
use idempotency_store::redb::{self, ReadableTable};
use idempotency_store::{Key, Lease, Response, Store, metrics::LATENCY_BUCKETS_US};
use metrics_exporter_prometheus::Matcher;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

/// Any error, for setup code.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The ledger, in the store's file: payment number → (idempotency key, amount, currency,
/// customer). The payment number is the charging lease's fencing token, unique for the life of
/// the file, so the answer can name the payment before the row is written.
pub const LEDGER: redb::TableDefinition<u64, (&str, u64, &str, &str)> =
    redb::TableDefinition::new("payments_ledger");

/// The largest request body read (16 KiB): a payment is a few dozen bytes, and every
/// connection may hold a body this size in memory (8 MiB for 512 connections). Stated in
/// `--help` ([`limits_help`]) and the README.
pub const MAX_BODY: usize = 16 * 1024;

/// How the service behaves.
#[derive(Debug, Clone)]
pub struct Options {
    /// 0: a duplicate of a request in flight gets 409 at once. Otherwise it waits (with
    /// `claim_wait`) up to this long for the first attempt, then gets its answer.
    pub wait: Duration,
    /// Simulated card-network latency, spent while holding the key.
    pub charge_delay: Duration,
    /// Threads running the handler: a request holds one from when it is all in until its
    /// answer is ready (including its durable write); a connection holds none.
    pub threads: usize,
}

/// One charge, as the ledger holds it; serialized, the body of `201 Created` and
/// `GET /payments/{id}`.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Charge {
    /// `pay_` and the number.
    pub id: String,
    pub amount: u64,
    pub currency: String,
    pub customer_id: String,
    #[serde(skip)]
    pub number: u64,
    #[serde(skip)]
    pub key: String,
}

impl Charge {
    fn new(number: u64, key: &str, amount: u64, currency: &str, customer_id: &str) -> Charge {
        Charge {
            id: format!("pay_{number}"),
            amount,
            currency: currency.to_owned(),
            customer_id: customer_id.to_owned(),
            number,
            key: key.to_owned(),
        }
    }
}

/// The body of `GET /ledger`.
#[derive(serde::Serialize)]
struct LedgerBody<'a> {
    count: usize,
    charges: Vec<LedgerEntry<'a>>,
}

/// A `GET /ledger` entry: the charge and the idempotency key that made it.
#[derive(serde::Serialize)]
#[serde(rename_all = "camelCase")]
struct LedgerEntry<'a> {
    #[serde(flatten)]
    charge: &'a Charge,
    idempotency_key: &'a str,
}

/// The body of `POST /payments`.
#[derive(serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct NewPayment {
    amount: u64,
    currency: String,
    customer_id: String,
}

impl NewPayment {
    fn parse(body: &[u8]) -> Result<NewPayment, String> {
        let payment: NewPayment = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        if !(1..=99_999_999).contains(&payment.amount) {
            return Err(
                "amount must be between 1 and 99999999 (in the currency's minor unit)".into(),
            );
        }
        if payment.currency.len() != 3 || !payment.currency.bytes().all(|b| b.is_ascii_lowercase())
        {
            return Err("currency must be a three-letter lowercase ISO code, like \"usd\"".into());
        }
        let id_char = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
        if !(1..=64).contains(&payment.customer_id.len())
            || !payment.customer_id.bytes().all(id_char)
        {
            return Err("customerId must be 1 to 64 letters, digits, '_' or '-'".into());
        }
        Ok(payment)
    }
}

/// A store builder for this service: the ledger is registered for effects, as every open of
/// its file must do (an open redoes logged ledger rows, which needs the table's types).
pub fn store_builder() -> idempotency_store::StoreBuilder {
    let mut builder = Store::builder();
    builder.effect_table(LEDGER);
    builder
}

/// The charges mirrored in memory for the `GET` routes.
type Charges = Arc<Mutex<BTreeMap<u64, Charge>>>;

/// Renders the `GET /metrics` page, in the Prometheus text format.
type MetricsPage = Box<dyn Fn() -> String + Send + Sync>;

/// The Prometheus text format's content type (exposition format 0.0.4).
pub const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4";

/// How often the exporter drains histogram samples when nobody scrapes (its own default).
const PROMETHEUS_UPKEEP: Duration = Duration::from_secs(5);

/// Installs the process's one global Prometheus recorder, so that the store's counts reach
/// `GET /metrics`, and runs its upkeep: without it, the exporter keeps every histogram sample
/// between scrapes, so memory grows with traffic while nobody scrapes.
///
/// The `_seconds` series are Prometheus histograms with the store's own bucket bounds
/// ([`LATENCY_BUCKETS_US`]), not the exporter's default summaries: bucket counts from many
/// instances (every server on one PostgreSQL table) can be summed, quantiles cannot, and
/// counting a sample into buckets costs the exporter less than updating a quantile sketch.
pub fn install_prometheus() -> Result<metrics_exporter_prometheus::PrometheusHandle, BoxError> {
    let handle = metrics_exporter_prometheus::PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &latency_buckets_s())?
        .install_recorder()
        .map_err(|err| format!("cannot install the metrics recorder: {err}"))?;
    let upkeep = handle.clone();
    std::thread::Builder::new()
        .name("prometheus-upkeep".into())
        .spawn(move || {
            loop {
                std::thread::sleep(PROMETHEUS_UPKEEP);
                upkeep.run_upkeep();
            }
        })?;
    Ok(handle)
}

/// [`LATENCY_BUCKETS_US`] in seconds, the unit of the `_seconds` series.
fn latency_buckets_s() -> Vec<f64> {
    LATENCY_BUCKETS_US
        .iter()
        .map(|&us| Duration::from_micros(us).as_secs_f64())
        .collect()
}

/// The service: the store, the idempotency options, and the charges mirrored in memory.
pub struct Payments {
    store: Arc<Store>,
    options: Options,
    idempotency: HandleOptions,
    charges: Charges,
    metrics_page: Option<MetricsPage>,
}

impl Payments {
    /// Serves from `store`, loading the charges already in its ledger.
    pub fn open(store: Store, options: Options) -> Result<Payments, BoxError> {
        let store = Arc::new(store);
        let charges = Arc::new(Mutex::new(load_ledger(&store)?));
        let idempotency = HandleOptions::new()
            .wait(options.wait)
            .max_body(MAX_BODY)
            .complete_with(record_charge(Arc::clone(&store), Arc::clone(&charges)))
            .on_error(|err| eprintln!("payments: {err}"));
        Ok(Payments {
            store,
            options,
            idempotency,
            charges,
            metrics_page: None,
        })
    }

    /// Serves `GET /metrics` with `render`'s text (the Prometheus text format, e.g. a
    /// `metrics-exporter-prometheus` handle's `render`); without it there is no such route.
    pub fn with_metrics_page(
        mut self,
        render: impl Fn() -> String + Send + Sync + 'static,
    ) -> Payments {
        self.metrics_page = Some(Box::new(render));
        self
    }

    /// Answers one request.
    pub fn handle(&self, request: http::Request<Vec<u8>>) -> http::Response<Vec<u8>> {
        let path = request.uri().path();
        let id = path.strip_prefix("/payments/");
        let metrics = path == "/metrics" && self.metrics_page.is_some();
        match (request.method(), path, id) {
            (&Method::POST, "/payments", _) => idem::handle(
                &*self.store,
                request,
                &self.idempotency,
                |lease, request| {
                    std::thread::sleep(self.options.charge_delay);
                    // The key is required, so a POST always runs with a lease.
                    match lease {
                        Some(lease) => self.charge(lease.token(), lease.key(), request.body()),
                        None => Problem::internal().to_http(),
                    }
                },
            ),
            (&Method::GET, "/ledger", _) => self.ledger(),
            (&Method::GET, _, _) if metrics => self.metrics(),
            (&Method::GET, _, Some(id)) => self.show(id),
            (_, "/payments" | "/ledger", _) | (_, _, Some(_)) => not_allowed(path),
            _ if metrics => not_allowed(path),
            _ => problem(StatusCode::NOT_FOUND, "not-found", "Not found", path).to_http(),
        }
    }

    /// `GET /metrics`: the page, with the store's gauges (overlay, file size) set first.
    fn metrics(&self) -> http::Response<Vec<u8>> {
        let _gauges = self.store.metrics();
        let text = self.metrics_page.as_ref().map(|render| render());
        let mut out = http::Response::new(text.unwrap_or_default().into_bytes());
        out.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static(PROMETHEUS_TEXT),
        );
        out
    }

    /// `POST /payments` while holding the key (`token`, `key`): validate, charge, and leave
    /// the charge in the answer's extensions for [`record_charge`], which stores both in one
    /// transaction.
    pub fn charge(&self, token: u64, key: &Key, body: &[u8]) -> http::Response<Vec<u8>> {
        // A request that fails validation releases the key: the client fixes it and retries
        // with the same key.
        let payment = match NewPayment::parse(body) {
            Ok(payment) => payment,
            Err(detail) => {
                let status = StatusCode::BAD_REQUEST;
                let invalid = problem(status, "invalid-payment", "Invalid payment", &detail);
                return idem::not_final(invalid.to_http());
            }
        };
        let charge = Charge::new(
            token,
            &key.to_string(),
            payment.amount,
            &payment.currency,
            &payment.customer_id,
        );
        let mut answer = json_response(StatusCode::CREATED, &charge);
        let location = format!("/payments/{}", charge.id);
        if let Ok(location) = http::HeaderValue::from_str(&location) {
            answer
                .headers_mut()
                .insert(http::header::LOCATION, location);
        }
        answer.extensions_mut().insert(charge);
        answer
    }

    /// The store, shared with the idempotency flow.
    pub fn store(&self) -> Arc<Store> {
        Arc::clone(&self.store)
    }

    /// The idempotency options (wait, body limit, the ledger's completion hook).
    pub fn idempotency(&self) -> HandleOptions {
        self.idempotency.clone()
    }

    /// How long a charge takes.
    pub fn charge_delay(&self) -> Duration {
        self.options.charge_delay
    }

    /// `GET /payments/{id}`.
    pub fn show(&self, id: &str) -> http::Response<Vec<u8>> {
        let number = id.strip_prefix("pay_").and_then(|n| n.parse::<u64>().ok());
        match number.and_then(|n| self.charges_lock().get(&n).cloned()) {
            Some(charge) => json_response(StatusCode::OK, &charge),
            None => problem(StatusCode::NOT_FOUND, "not-found", "No such payment", id).to_http(),
        }
    }

    /// `GET /ledger`: every charge, in order, with its idempotency key, and the count.
    pub fn ledger(&self) -> http::Response<Vec<u8>> {
        let charges = self.charges_lock();
        let entries: Vec<_> = charges
            .values()
            .map(|charge| LedgerEntry {
                charge,
                idempotency_key: &charge.key,
            })
            .collect();
        let body = LedgerBody {
            count: entries.len(),
            charges: entries,
        };
        json_response(StatusCode::OK, &body)
    }

    fn charges_lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Charge>> {
        self.charges.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The completion hook: the ledger row and the answer commit together, in the batch of every
/// other call, then the charge is mirrored in memory.
fn record_charge(
    store: Arc<Store>,
    charges: Charges,
) -> impl Fn(&Lease, Response, &http::Extensions) -> idempotency_store::Result<Result<(), BoxError>>
+ Send
+ Sync
+ 'static {
    move |lease: &Lease, response: Response, extensions: &http::Extensions| {
        let Some(charge) = extensions.get::<Charge>() else {
            return Ok(Err("the answer carries no charge".into()));
        };
        let (number, row) = (
            charge.number,
            (
                charge.key.clone(),
                charge.amount,
                charge.currency.clone(),
                charge.customer_id.clone(),
            ),
        );
        // The fast path: the row rides in the same group-commit batch as the answer.
        let written = store.complete_with_effects(lease, response, move |fx| {
            let (key, amount, currency, customer) = &row;
            fx.insert(
                LEDGER,
                number,
                (key.as_str(), *amount, currency.as_str(), customer.as_str()),
            )
        })?;
        if written.is_ok() {
            let mut charges = charges.lock().unwrap_or_else(PoisonError::into_inner);
            charges.insert(charge.number, charge.clone());
        }
        Ok(written.map_err(Into::into))
    }
}

/// Reads the ledger table at startup (it does not exist before the first charge).
fn load_ledger(store: &Store) -> Result<BTreeMap<u64, Charge>, BoxError> {
    Ok(store.read_with(|txn| match txn.open_table(LEDGER) {
        Ok(table) => read_ledger(&table),
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(BTreeMap::new()),
        Err(other) => Err(other.into()),
    })??)
}

fn read_ledger(
    table: &impl ReadableTable<u64, (&'static str, u64, &'static str, &'static str)>,
) -> Result<BTreeMap<u64, Charge>, redb::Error> {
    let mut charges = BTreeMap::new();
    for row in table.iter()? {
        let (number, value) = row?;
        let (key, amount, currency, customer_id) = value.value();
        let number = number.value();
        let charge = Charge::new(number, key, amount, currency, customer_id);
        charges.insert(number, charge);
    }
    Ok(charges)
}

fn to_json(value: &impl serde::Serialize) -> Vec<u8> {
    serde_json::to_vec(value).unwrap_or_default()
}

fn json_response(status: StatusCode, body: &impl serde::Serialize) -> http::Response<Vec<u8>> {
    let mut out = http::Response::new(to_json(body));
    *out.status_mut() = status;
    out.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    out
}

/// 405 for `path`, a route of this service.
fn not_allowed(path: &str) -> http::Response<Vec<u8>> {
    let mut answer = problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        "Method not allowed",
        "use POST /payments, GET /payments/{id} or GET /ledger",
    )
    .to_http();
    // RFC 9110 §15.5.6: a 405 names the methods the resource supports.
    let allow = if path == "/payments" { "POST" } else { "GET" };
    answer
        .headers_mut()
        .insert(http::header::ALLOW, http::HeaderValue::from_static(allow));
    answer
}

/// A problem of this service (the idempotency ones come from `idempotency_store::http`).
fn problem(status: StatusCode, kind: &str, title: &str, detail: &str) -> Problem {
    let uri = format!("https://payments.example/problems/{kind}");
    Problem::new(status, uri, title, detail)
}

// ---------------------------------------------------------------- serving over hyper
//
// hyper reads and writes HTTP/1.1 (framing, keep-alive, pipelining, HEAD, `Expect`), so this
// file has no HTTP parser of its own. Connections are tasks on a one-thread tokio runtime: a
// slow or silent client costs a socket and a small task, never a thread. The handler is
// synchronous and runs on the runtime's blocking pool (`threads` of them), and only once its
// whole request is in.

/// The largest request head (request line and header fields) read; a larger one gets 431.
const MAX_HEAD: usize = 16 * 1024;

/// How long a stopping server lets its connections finish the request each is on.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The pause after a failed accept (out of file descriptors, say), so that the accept loop
/// does not spin while the cause lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The front end's limits. A client holds a connection slot for at most `head` + `body` while
/// its request arrives and `write` while an answer waits for it to read, so slow or silent
/// clients cannot keep the slots, and never a handler thread.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a request head may take, from the connection's opening or its previous
    /// answer: a client trickling its head, and an idle kept-alive connection, are closed
    /// then.
    pub head: Duration,
    /// How long a body may take once its head is in; a late one gets 408 and the connection
    /// is closed.
    pub body: Duration,
    /// How long an answer may wait for the client to take any of its bytes; then the
    /// connection is closed.
    pub write: Duration,
    /// Connections served at once; more wait in the listen backlog until one closes.
    pub connections: usize,
}

impl Default for Limits {
    /// `payments_server`'s limits, stated in its `--help` ([`limits_help`]) and the README.
    fn default() -> Limits {
        Limits {
            head: Duration::from_secs(5),
            body: Duration::from_secs(10),
            write: Duration::from_secs(10),
            connections: 512,
        }
    }
}

/// The body cap and [`Limits::default`] in words, for `payments_server --help`.
pub fn limits_help() -> String {
    let limits = Limits::default();
    format!(
        "Limits: a request body may have at most {} KiB (a larger one gets 413). A request \
         head must arrive within {} s of its connection's opening or previous answer (an idle \
         connection is closed then), and its body within {} s after its head (else 408). A \
         client that takes no bytes of an answer for {} s is disconnected. At most {} \
         connections are served at once; more wait to be accepted.",
        MAX_BODY / 1024,
        limits.head.as_secs(),
        limits.body.as_secs(),
        limits.write.as_secs(),
        limits.connections,
    )
}

/// A running server; dropping it stops it.
pub struct Running {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    server: Option<JoinHandle<()>>,
}

/// Listens on `listen` (`127.0.0.1:0` picks a free port) and serves with `options.threads`
/// handler threads and the default [`Limits`].
pub fn start(payments: Payments, listen: &str) -> Result<Running, BoxError> {
    let threads = payments.options.threads;
    let payments = Arc::new(payments);
    serve_with(
        listen,
        threads,
        Arc::new(move |request| payments.handle(request)),
    )
}

/// A request handler for [`serve_with`].
pub type Handler = Arc<dyn Fn(http::Request<Vec<u8>>) -> http::Response<Vec<u8>> + Send + Sync>;

/// Serves `handler` on `listen` with `threads` handler threads and the default [`Limits`]
/// (also used by tests/http_flow.rs).
pub fn serve_with(listen: &str, threads: usize, handler: Handler) -> Result<Running, BoxError> {
    serve_with_limits(listen, threads, handler, Limits::default())
}

/// Serves `handler` on `listen` with `threads` handler threads and `limits`.
///
/// A connection stays open after an answer unless the request asked for `Connection: close`,
/// was HTTP/1.0, was malformed or refused (400, 408, 413, 431: the rest of it is not read),
/// or the server is stopping.
pub fn serve_with_limits(
    listen: &str,
    threads: usize,
    handler: Handler,
    limits: Limits,
) -> Result<Running, BoxError> {
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|err| format!("cannot listen on {listen}: {err}"))?;
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(threads.max(1))
        .thread_name("payments-handler")
        .build()?;
    let listener = {
        let _context = runtime.enter();
        tokio::net::TcpListener::from_std(listener)?
    };
    let (stop, stopping) = watch::channel(false);
    let server = std::thread::Builder::new()
        .name("payments-http".into())
        .spawn(move || {
            runtime.block_on(accept(listener, handler, limits, stopping));
            // Dropping the runtime waits for the handlers still running: once `Running` has
            // stopped, nothing holds the store, and its file can be opened again.
            drop(runtime);
        })?;
    Ok(Running {
        addr,
        stop,
        server: Some(server),
    })
}

impl Running {
    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

impl Drop for Running {
    /// Stops accepting, closes idle connections at once, lets each busy one finish its
    /// request (for up to [`STOP_GRACE`]), and returns once the last handler has returned, so
    /// that the store they share is closed.
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

/// Resolves once the server is stopping (or its [`Running`] is gone).
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// Accepts connections, at most `limits.connections` at a time, until the server stops; then
/// lets them finish.
async fn accept(
    listener: tokio::net::TcpListener,
    handler: Handler,
    limits: Limits,
    stopping: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.connections.max(1)));
    let mut connections = JoinSet::new();
    loop {
        let next = async {
            // The slot is taken before the accept: past the limit, clients wait in the
            // backlog instead of being accepted and starved.
            let slot = Arc::clone(&slots).acquire_owned().await;
            (slot, listener.accept().await)
        };
        let (slot, accepted) = tokio::select! {
            () = stopped(stopping.clone()) => break,
            next = next => next,
        };
        match (slot, accepted) {
            (Ok(slot), Ok((stream, _))) => {
                let (handler, stopping) = (Arc::clone(&handler), stopping.clone());
                connections.spawn(async move {
                    serve(stream, handler, limits, stopping).await;
                    drop(slot);
                });
            }
            (_, Err(err)) => {
                eprintln!("payments: accepting a connection failed: {err}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
            // The semaphore is never closed.
            (Err(_), Ok(_)) => {}
        }
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    let finished = async { while connections.join_next().await.is_some() {} };
    // Past the grace, the connections left are dropped with the set (their handlers, on the
    // blocking pool, still run to the end).
    let _ = tokio::time::timeout(STOP_GRACE, finished).await;
}

/// Serves one connection until the client or hyper closes it, or the server stops.
async fn serve(
    stream: tokio::net::TcpStream,
    handler: Handler,
    limits: Limits,
    stopping: watch::Receiver<bool>,
) {
    // A pipelining client must not wait for Nagle's algorithm to release its second answer.
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(WriteDeadline::new(stream, limits.write));
    let service = hyper::service::service_fn(move |request| {
        answer(request, Arc::clone(&handler), limits.body)
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.head)
        .max_header_size(MAX_HEAD);
    let connection = http.serve_connection(io, service);
    tokio::pin!(connection);
    // A connection's errors (a timeout, a reset, a malformed request hyper has answered) are
    // the client's: logging them would let any client fill the log.
    tokio::select! {
        _ = connection.as_mut() => return,
        () = stopped(stopping) => connection.as_mut().graceful_shutdown(),
    }
    // Closes at once if idle, else after the answer to the request in progress.
    let _ = connection.await;
}

/// Reads the whole body (within `body_limit`), then runs the handler on the blocking pool.
async fn answer(
    request: http::Request<Incoming>,
    handler: Handler,
    body_limit: Duration,
) -> Result<http::Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let version = parts.version;
    let mut answer = match read_body(body, body_limit).await {
        Ok(body) => {
            let request = http::Request::from_parts(parts, body);
            tokio::task::spawn_blocking(move || handler(request))
                .await
                .unwrap_or_else(|panicked| {
                    eprintln!("payments: a handler panicked: {panicked}");
                    Problem::internal().to_http()
                })
        }
        // The rest of the body is not read, so the connection cannot carry another request.
        Err(refused) => closing(refused.to_http()),
    };
    if version == http::Version::HTTP_10 {
        // HTTP/1.0 connections are not kept alive: an HTTP/1.0 answer saying so has hyper
        // close the connection after it, even if the client asked for keep-alive.
        *answer.version_mut() = http::Version::HTTP_10;
        answer = closing(answer);
    }
    Ok(answer.map(|body| Full::new(Bytes::from(body))))
}

/// The body, at most [`MAX_BODY`] bytes and within `limit`, or the problem to answer.
async fn read_body(body: Incoming, limit: Duration) -> Result<Vec<u8>, Problem> {
    let too_large = || {
        let detail = format!("the body is larger than {MAX_BODY} bytes");
        let status = StatusCode::PAYLOAD_TOO_LARGE;
        problem(status, "too-large", "Body too large", &detail)
    };
    // A declared length over the cap is refused before a byte of the body is read.
    if body.size_hint().lower() > MAX_BODY as u64 {
        return Err(too_large());
    }
    match tokio::time::timeout(limit, Limited::new(body, MAX_BODY).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes().to_vec()),
        Ok(Err(err)) if err.is::<LengthLimitError>() => Err(too_large()),
        // A malformed chunk, or the client went away.
        Ok(Err(err)) => Err(problem(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "Bad request",
            &format!("the body could not be read: {err}"),
        )),
        Err(_) => Err(problem(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            "Request timeout",
            &format!("the body did not arrive within {} s", limit.as_secs()),
        )),
    }
}

/// `answer` with `Connection: close`, which hyper honours by closing after it.
fn closing(mut answer: http::Response<Vec<u8>>) -> http::Response<Vec<u8>> {
    answer.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    answer
}

/// A connection's socket whose writes fail once they have made no progress for `limit`, so
/// that a client that does not read its answers cannot keep its connection slot.
struct WriteDeadline {
    stream: tokio::net::TcpStream,
    limit: Duration,
    /// Set while a write waits for the client; any progress clears it.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    fn new(stream: tokio::net::TcpStream, limit: Duration) -> WriteDeadline {
        WriteDeadline {
            stream,
            limit,
            stalled: None,
        }
    }

    /// `polled` (a write, flush or shutdown), or a timeout once it has been pending for
    /// `limit`.
    fn check<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took no bytes of its answer",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.check(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.check(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_flush(cx);
        this.check(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_shutdown(cx);
        this.check(cx, polled)
    }
}
