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
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use http::{Method, StatusCode};
use idempotency_store::IdempotencyStore;
use idempotency_store::http::{self as idem, HandleOptions, Problem};
use idempotency_store::redb::{self, ReadableTable};
use idempotency_store::{Key, Lease, Response, Store, metrics::LATENCY_BUCKETS_US};
use metrics_exporter_prometheus::Matcher;

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

// Serving over hyper, in a file of its own.
#[path = "serve.rs"]
mod serve;

#[allow(unused_imports)] // every example and test that includes this file uses a part
pub use serve::{Handler, Limits, Running, limits_help, serve_with, serve_with_limits, start};
