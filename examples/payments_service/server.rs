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
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use http::{Method, StatusCode};
use idempotency_store::http::{self as idem, HandleOptions, Problem};
use idempotency_store::redb::{self, ReadableTable};
use idempotency_store::{Key, LATENCY_BUCKETS_US, Lease, Response, Store};
use metrics_exporter_prometheus::Matcher;

/// Any error, for setup code.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The ledger, in the store's file: payment number → (idempotency key, amount, currency,
/// customer). The payment number is the charging lease's fencing token, unique for the life of
/// the file, so the answer can name the payment before the row is written.
pub const LEDGER: redb::TableDefinition<u64, (&str, u64, &str, &str)> =
    redb::TableDefinition::new("payments_ledger");

/// The largest request body read.
const MAX_BODY: u64 = 16 * 1024;

/// How the service behaves.
#[derive(Debug, Clone)]
pub struct Options {
    /// 0: a duplicate of a request in flight gets 409 at once. Otherwise it waits (with
    /// `claim_wait`) up to this long for the first attempt, then gets its answer.
    pub wait: Duration,
    /// Simulated card-network latency, spent while holding the key.
    pub charge_delay: Duration,
    /// Worker threads serving requests.
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
            .max_body(MAX_BODY as usize)
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
                return idem::release(invalid.to_http());
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

// ---------------------------------------------------------------- serving over std::net

/// How long a request may take to arrive once its first byte has.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a kept-alive connection may sit idle between requests.
const IDLE_LIMIT: Duration = Duration::from_secs(5);

/// How often an idle worker looks up from its connection: to stop, or to let a waiting
/// connection in when no other worker is free to accept it.
const IDLE_POLL: Duration = Duration::from_millis(20);

/// A running server: worker threads accepting on one listener, each serving one connection at a
/// time, kept alive between requests (HTTP/1.1 persistent connections).
pub struct Running {
    addr: SocketAddr,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

/// What the workers share: whether to stop, and how many of them wait in `accept`.
#[derive(Default)]
struct Shared {
    stopping: AtomicBool,
    accepting: AtomicUsize,
}

/// Listens on `listen` (`127.0.0.1:0` picks a free port) and serves with `options.threads`
/// workers.
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

/// Serves `handler` on `listen` with `threads` workers (also used by tests/http_flow.rs).
///
/// A connection stays open after a response unless the request asked for `Connection: close`,
/// was HTTP/1.0 or malformed, or the server is stopping. Between requests a worker gives its
/// connection up (closes it) after [`IDLE_LIMIT`], or after [`IDLE_POLL`] when no other worker
/// is waiting to accept, so idle clients cannot keep new connections out.
pub fn serve_with(listen: &str, threads: usize, handler: Handler) -> Result<Running, BoxError> {
    let listener = Arc::new(
        TcpListener::bind(listen).map_err(|err| format!("cannot listen on {listen}: {err}"))?,
    );
    let addr = listener.local_addr()?;
    let shared = Arc::new(Shared::default());
    let workers = (0..threads.max(1))
        .map(|_| {
            let (listener, handler, shared) = (
                Arc::clone(&listener),
                Arc::clone(&handler),
                Arc::clone(&shared),
            );
            std::thread::spawn(move || {
                loop {
                    shared.accepting.fetch_add(1, Ordering::SeqCst);
                    let accepted = listener.accept();
                    shared.accepting.fetch_sub(1, Ordering::SeqCst);
                    if shared.stopping.load(Ordering::SeqCst) {
                        return;
                    }
                    match accepted {
                        Ok((stream, _)) => serve(&*handler, &stream, &shared),
                        Err(err) => eprintln!("payments: accepting a connection failed: {err}"),
                    }
                }
            })
        })
        .collect();
    Ok(Running {
        addr,
        shared,
        workers,
    })
}

impl Running {
    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

impl Drop for Running {
    /// Stops the workers after their current request (idle connections are closed) and closes
    /// the store (once the last worker has dropped it), so the file can be opened again.
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        for _ in &self.workers {
            // Wakes one worker blocked in accept.
            let _ = TcpStream::connect(self.addr);
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

/// Answers the requests of one connection until it is closed or should be.
fn serve(
    handler: &dyn Fn(http::Request<Vec<u8>>) -> http::Response<Vec<u8>>,
    stream: &TcpStream,
    shared: &Shared,
) {
    let mut reader = BufReader::new(stream);
    let mut first = true;
    while first || next_request_arrives(stream, &mut reader, shared) {
        first = false;
        let _ = stream.set_read_timeout(Some(REQUEST_TIMEOUT));
        let (answer, keep) = match read_request(&mut reader) {
            Ok(request) => {
                let keep = keeps_alive(&request);
                (handler(request), keep)
            }
            Err(problem) => (problem.to_http(), false),
        };
        let keep = keep && !shared.stopping.load(Ordering::SeqCst);
        // The client may be gone (a lost answer): its retry gets the stored answer.
        if write_response(stream, answer, keep).is_err() || !keep {
            return;
        }
    }
}

/// Whether an HTTP/1.1 request lets the connection persist (RFC 9112 section 9.3).
fn keeps_alive(request: &http::Request<Vec<u8>>) -> bool {
    let close = request
        .headers()
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .any(|token| token.trim().eq_ignore_ascii_case("close"));
    request.version() == http::Version::HTTP_11 && !close
}

/// Waits for the first byte of the next request on a kept-alive connection; `false` when the
/// client closed it or the worker should give it up (see [`serve_with`]).
fn next_request_arrives(stream: &TcpStream, reader: &mut impl BufRead, shared: &Shared) -> bool {
    let _ = stream.set_read_timeout(Some(IDLE_POLL));
    let idle_since = std::time::Instant::now();
    loop {
        match reader.fill_buf() {
            Ok(buffered) => return !buffered.is_empty(),
            Err(err) if err.kind() == std::io::ErrorKind::Interrupted => {}
            Err(err)
                if matches!(
                    err.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                let crowded = shared.accepting.load(Ordering::SeqCst) == 0;
                if crowded
                    || shared.stopping.load(Ordering::SeqCst)
                    || idle_since.elapsed() >= IDLE_LIMIT
                {
                    return false;
                }
            }
            Err(_) => return false,
        }
    }
}

fn write_response(
    mut stream: &TcpStream,
    answer: http::Response<Vec<u8>>,
    keep: bool,
) -> std::io::Result<()> {
    let (parts, body) = answer.into_parts();
    let reason = parts.status.canonical_reason().unwrap_or("");
    let mut head = format!("HTTP/1.1 {} {reason}\r\n", parts.status.as_u16()).into_bytes();
    for (name, value) in &parts.headers {
        head.extend_from_slice(name.as_str().as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(value.as_bytes());
        head.extend_from_slice(b"\r\n");
    }
    let connection = if keep { "" } else { "connection: close\r\n" };
    let tail = format!("content-length: {}\r\n{connection}\r\n", body.len());
    head.extend_from_slice(tail.as_bytes());
    head.extend_from_slice(&body);
    stream.write_all(&head)
}

/// Reads one request (request line, headers, `Content-Length` body) into `http` types, or the
/// problem to answer. Header values are bytes: a key with non-ASCII or control characters
/// reaches the key parser or gets its 400 here, never a closed connection.
fn read_request(reader: &mut impl BufRead) -> Result<http::Request<Vec<u8>>, Problem> {
    let bad = |what: &str| problem(StatusCode::BAD_REQUEST, "bad-request", "Bad request", what);
    let line = read_line(reader).ok_or_else(|| bad("the request line could not be read"))?;
    let line = String::from_utf8_lossy(&line).into_owned();
    let mut words = line.split(' ');
    let (Some(method), Some(target)) = (words.next(), words.next()) else {
        return Err(bad("malformed request line"));
    };
    // Anything but HTTP/1.1 is answered as HTTP/1.0 would be: the connection then closes.
    let version = match words.next() {
        Some("HTTP/1.1") => http::Version::HTTP_11,
        _ => http::Version::HTTP_10,
    };
    let mut builder = http::Request::builder()
        .method(method)
        .uri(target)
        .version(version);
    let mut length = 0u64;
    let mut fields = 0;
    loop {
        let line = read_line(reader).ok_or_else(|| bad("the headers could not be read"))?;
        if line.is_empty() {
            break;
        }
        fields += 1;
        if fields > 100 {
            return Err(bad("too many header fields"));
        }
        let colon = line.iter().position(|&b| b == b':');
        let Some(colon) = colon else {
            return Err(bad("a header line has no ':'"));
        };
        let name = String::from_utf8_lossy(&line[..colon])
            .trim()
            .to_ascii_lowercase();
        let value = line[colon + 1..].trim_ascii();
        let Ok(header_value) = http::HeaderValue::from_bytes(value) else {
            return Err(match name.as_str() {
                "idempotency-key" => Problem::invalid_key("the value has a control character"),
                _ => bad(&format!("header {name} has a control character")),
            });
        };
        if name == "content-length" {
            let text = std::str::from_utf8(value).unwrap_or("");
            length = text.parse().map_err(|_| bad("malformed Content-Length"))?;
        }
        builder = builder.header(name.as_str(), header_value);
    }
    if length > MAX_BODY {
        let detail = format!("the body is larger than {MAX_BODY} bytes");
        let status = StatusCode::PAYLOAD_TOO_LARGE;
        return Err(problem(status, "too-large", "Body too large", &detail));
    }
    let mut body = vec![0; length as usize];
    reader
        .read_exact(&mut body)
        .map_err(|_| bad("the body could not be read"))?;
    builder.body(body).map_err(|e| bad(&e.to_string()))
}

/// One CRLF-terminated line without its end, at most 16 KiB; `None` if it cannot be read.
fn read_line(reader: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut line = Vec::new();
    let read = reader.take(16 * 1024).read_until(b'\n', &mut line).ok()?;
    if read == 0 || line.last() != Some(&b'\n') {
        return None;
    }
    line.pop();
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Some(line)
}
