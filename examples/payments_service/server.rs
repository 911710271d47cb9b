//! The payments service shared by the `payments_server` and `payments` examples and by
//! `tests/payments_e2e.rs`: `POST /payments` charges once per `Idempotency-Key`,
//! `GET /payments/{id}` and `GET /ledger` read the charges.
//!
//! A charge is a row in a ledger table in the store's own redb file, written by
//! `Store::complete_with` in the same transaction as the stored answer: after a crash there is
//! never a charge without its answer, or an answer without its charge.

use std::collections::BTreeMap;
use std::io::Read;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use http::{Method, StatusCode};
use idempotency_store::http::{self as idem, Decision, Problem};
use idempotency_store::redb::{self, ReadableTable};
use idempotency_store::{Key, Lease, Response, Store};

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

/// The service: the store, and the charges mirrored in memory for the `GET` routes.
pub struct Payments {
    store: Store,
    options: Options,
    charges: Mutex<BTreeMap<u64, Charge>>,
}

impl Payments {
    /// Serves from `store`, loading the charges already in its ledger.
    pub fn open(store: Store, options: Options) -> Result<Payments, BoxError> {
        let charges = load_ledger(&store)?;
        Ok(Payments {
            store,
            options,
            charges: Mutex::new(charges),
        })
    }

    /// Answers one request.
    pub fn handle(&self, request: &http::Request<Vec<u8>>) -> http::Response<Vec<u8>> {
        let path = request.uri().path();
        let id = path.strip_prefix("/payments/");
        match (request.method(), path, id) {
            (&Method::POST, "/payments", _) => self.create(request),
            (&Method::GET, "/ledger", _) => self.ledger(),
            (&Method::GET, _, Some(id)) => self.show(id),
            (_, "/payments" | "/ledger", _) | (_, _, Some(_)) => problem(
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
                "use POST /payments, GET /payments/{id} or GET /ledger",
            )
            .to_http(),
            _ => problem(StatusCode::NOT_FOUND, "not-found", "Not found", path).to_http(),
        }
    }

    /// `POST /payments`: validate, claim the key, then charge once or answer from the store.
    fn create(&self, request: &http::Request<Vec<u8>>) -> http::Response<Vec<u8>> {
        // A request that fails validation is not stored: the client fixes it and retries with
        // the same key.
        let key = match idem::key_from_headers(request.headers(), None) {
            Ok(key) => key,
            Err(err) => return err.problem().to_http(),
        };
        let payment = match NewPayment::parse(request.body()) {
            Ok(payment) => payment,
            Err(detail) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "invalid-payment",
                    "Invalid payment",
                    &detail,
                )
                .to_http();
            }
        };
        let fingerprint = idem::fingerprint(request);
        let claim = if self.options.wait.is_zero() {
            self.store.claim(&key, fingerprint)
        } else {
            self.store.claim_wait(&key, fingerprint, self.options.wait)
        };
        let claim = match claim {
            Ok(claim) => claim,
            Err(err) => return store_failed(&err),
        };
        match idem::decide(claim, self.store.now()) {
            Ok(Decision::Run(lease)) => self.charge(&key, &lease, payment),
            Ok(Decision::Respond(answer)) => answer, // a replay, 409 or 422
            // `Decision` is non-exhaustive: an answer a later version adds is not run blindly.
            Ok(_) => Problem::internal().to_http(),
            Err(err) => {
                eprintln!("payments: cannot replay {key}: {err}");
                Problem::internal().to_http()
            }
        }
    }

    /// Charges while holding the key: the ledger row and the answer commit together.
    fn charge(&self, key: &Key, lease: &Lease, payment: NewPayment) -> http::Response<Vec<u8>> {
        std::thread::sleep(self.options.charge_delay);
        let charge = Charge::new(
            lease.token(),
            &key.to_string(),
            payment.amount,
            &payment.currency,
            &payment.customer_id,
        );
        let response = Response::new(201, to_json(&charge))
            .with_header("content-type", "application/json")
            .with_header("location", format!("/payments/{}", charge.id));
        // Converted before it is stored, so that its replays cannot fail to convert.
        let Ok(answer) = idem::to_http(response.clone()) else {
            return Problem::internal().to_http();
        };
        let row = (
            charge.key.as_str(),
            charge.amount,
            charge.currency.as_str(),
            charge.customer_id.as_str(),
        );
        let written = self.store.complete_with(lease, response, |txn| {
            txn.open_table(LEDGER)?.insert(charge.number, row)?;
            Ok::<_, redb::Error>(())
        });
        match written {
            Ok(Ok(())) => {
                self.charges_lock().insert(charge.number, charge);
                answer
            }
            Ok(Err(err)) => {
                // Nothing was written; let a retry run afresh.
                eprintln!("payments: ledger write for {key} failed: {err}");
                if let Err(err) = self.store.release(lease) {
                    eprintln!("payments: releasing {key} failed: {err}");
                }
                Problem::internal().to_http()
            }
            Err(err) => store_failed(&err),
        }
    }

    /// `GET /payments/{id}`.
    fn show(&self, id: &str) -> http::Response<Vec<u8>> {
        let number = id.strip_prefix("pay_").and_then(|n| n.parse::<u64>().ok());
        match number.and_then(|n| self.charges_lock().get(&n).cloned()) {
            Some(charge) => json_response(StatusCode::OK, &charge),
            None => problem(StatusCode::NOT_FOUND, "not-found", "No such payment", id).to_http(),
        }
    }

    /// `GET /ledger`: every charge, in order, with its idempotency key, and the count.
    fn ledger(&self) -> http::Response<Vec<u8>> {
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

/// A problem of this service (the idempotency ones come from `idempotency_store::http`).
fn problem(status: StatusCode, kind: &str, title: &str, detail: &str) -> Problem {
    let uri = format!("https://payments.example/problems/{kind}");
    Problem::new(status, uri, title, detail)
}

fn store_failed(err: &idempotency_store::Error) -> http::Response<Vec<u8>> {
    eprintln!("payments: store error: {err}");
    Problem::from_error(err).to_http()
}

// ---------------------------------------------------------------- serving over tiny_http

/// A running server: worker threads sharing one `tiny_http::Server`.
pub struct Running {
    server: Arc<tiny_http::Server>,
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

/// Listens on `listen` (`127.0.0.1:0` picks a free port) and serves with `options.threads`
/// workers.
pub fn start(payments: Payments, listen: &str) -> Result<Running, BoxError> {
    let server = Arc::new(tiny_http::Server::http(listen)?);
    let addr = server.server_addr().to_ip().ok_or("not an IP address")?;
    let stopping = Arc::new(AtomicBool::new(false));
    let threads = payments.options.threads.max(1);
    let payments = Arc::new(payments);
    let workers = (0..threads)
        .map(|_| {
            let (server, payments, stopping) = (
                Arc::clone(&server),
                Arc::clone(&payments),
                Arc::clone(&stopping),
            );
            std::thread::spawn(move || {
                loop {
                    match server.recv() {
                        Ok(request) => serve(&payments, request),
                        Err(_) if stopping.load(Ordering::SeqCst) => return,
                        Err(err) => eprintln!("payments: accepting a connection failed: {err}"),
                    }
                }
            })
        })
        .collect();
    Ok(Running {
        server,
        addr,
        stopping,
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
    /// Stops the workers after their current request and closes the store (once the last
    /// worker has dropped it), so the file can be opened again.
    fn drop(&mut self) {
        self.stopping.store(true, Ordering::SeqCst);
        for _ in &self.workers {
            self.server.unblock();
        }
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

fn serve(payments: &Payments, mut request: tiny_http::Request) {
    let answer = match to_http_request(&mut request) {
        Ok(http_request) => payments.handle(&http_request),
        Err(problem) => problem.to_http(),
    };
    let (parts, body) = answer.into_parts();
    let mut response = tiny_http::Response::from_data(body)
        .with_status_code(parts.status.as_u16())
        .with_chunked_threshold(usize::MAX);
    for (name, value) in &parts.headers {
        if let Ok(header) = tiny_http::Header::from_bytes(name.as_str(), value.as_bytes()) {
            response.add_header(header);
        }
    }
    // The client may be gone (a lost answer): its retry gets the stored answer.
    let _ = request.respond(response);
}

/// The request as `http` types, with its body; or the problem if it is unreadable.
fn to_http_request(request: &mut tiny_http::Request) -> Result<http::Request<Vec<u8>>, Problem> {
    let bad = |what: &str| problem(StatusCode::BAD_REQUEST, "bad-request", "Bad request", what);
    let mut builder = http::Request::builder()
        .method(request.method().as_str())
        .uri(request.url());
    for header in request.headers() {
        builder = builder.header(header.field.as_str().as_str(), header.value.as_str());
    }
    let mut body = Vec::new();
    if request
        .as_reader()
        .take(MAX_BODY + 1)
        .read_to_end(&mut body)
        .is_err()
    {
        return Err(bad("the body could not be read"));
    }
    if body.len() as u64 > MAX_BODY {
        let detail = format!("the body is larger than {MAX_BODY} bytes");
        let status = StatusCode::PAYLOAD_TOO_LARGE;
        return Err(problem(status, "too-large", "Body too large", &detail));
    }
    builder.body(body).map_err(|e| bad(&e.to_string()))
}
