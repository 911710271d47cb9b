//! The payments server of `payments_server` on axum, with `IdempotencyLayer`: the same routes
//! (`POST /payments`, `GET /payments/{id}`, `GET /ledger`), ledger, JSON and options, so one
//! client script drives either.
//!
//! ```sh
//! cargo run --example axum_payments -- --db payments.redb --listen 127.0.0.1:8080
//! curl -i -X POST localhost:8080/payments -H 'Idempotency-Key: "order-1"' \
//!      -d '{"amount": 4999, "currency": "usd", "customerId": "cus_123"}'
//! ```
//!
//! Options (`--help` lists them with their defaults): `--db PATH`, `--listen ADDR` (port 0
//! picks a free one), `--wait-ms MS` (how long a duplicate of a request in flight waits; 0
//! answers 409 at once), `--lease-ms MS`, `--delay-ms MS` (simulated card-network latency), as
//! `payments_server` takes them. It prints `listening on http://ADDR` once it serves. `GET /metrics` answers the store's metrics in the
//! Prometheus text format (docs/operations.md, "Metrics"). On SIGTERM or Ctrl-C it stops
//! taking connections, lets the payments in flight finish (for up to 10 s; a payment whose
//! client hung up still runs to its end), and prints what the drain settled.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Path, Request, State};
use axum::response::Response;
use axum::routing::{any, get, post};
use clap::Parser;
use idempotency_store::IdempotencyStore;
use idempotency_store::Store;
use idempotency_store::http::LeaseWatch;
use idempotency_store::http::tower::{Drain, IdempotencyLayer};

#[allow(dead_code)] // the tiny_http-free sync server is not used here
#[path = "payments_service/server.rs"]
pub mod server;

#[path = "payments_service/options.rs"]
pub mod options;

use options::ServeOptions;
use server::{BoxError, Payments};

/// The payments server of `payments_server` on axum, behind `IdempotencyLayer`: the same
/// routes (`POST /payments`, `GET /payments/{id}`, `GET /ledger`), plus `GET /metrics`.
#[derive(Debug, Parser)]
#[command(name = "axum_payments", version, after_help = options::AFTER_HELP)]
pub struct Args {
    #[command(flatten)]
    pub serve: ServeOptions,
    /// Loses every Nth answer to `POST /payments` after the charge (0: none): the client gets
    /// no answer and must retry with the same key. For tests of clients
    /// (tests/client/edge_client_crash.rs); never in production.
    #[arg(long = "drop-answers", value_name = "N", default_value_t = 0)]
    pub drop_answers: u64,
}

fn main() -> ExitCode {
    // `--help`: usage on stdout, exit 0; a bad option or value: clap's message naming it, exit 2.
    let args = Args::parse();
    match serve(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("axum_payments: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Parses `args` (the options, without the program name) and serves until the process ends.
pub fn run(args: impl Iterator<Item = String>) -> Result<(), BoxError> {
    serve(&Args::try_parse_from(
        std::iter::once("axum_payments".to_owned()).chain(args),
    )?)
}

/// Opens the store and serves until the process ends.
pub fn serve(args: &Args) -> Result<(), BoxError> {
    let listen = &args.serve.listen;
    // Opened before the runtime starts: opening reads and may repair the file (blocking).
    let payments = Arc::new(Payments::open(
        args.serve.open_store()?,
        args.serve.service(1),
    )?);
    tokio::runtime::Runtime::new()?.block_on(async {
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .map_err(|err| format!("cannot listen on {listen}: {err}"))?;
        println!("listening on http://{}", listener.local_addr()?);
        std::io::stdout().flush()?;
        let metrics = metrics_route(payments.store())?;
        let (app, drain) = app(payments);
        let app = app.merge(metrics);
        let app = match args.drop_answers {
            0 => app,
            every => app.layer(axum::middleware::from_fn_with_state(
                Arc::new(Dropper::new(every)),
                drop_answer,
            )),
        };
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown_signal())
            .await?;
        // The server waits for open connections only: payments whose client hung up run on
        // the layer's tasks. Let them finish and settle their keys before the process ends.
        let report = drain.finish(DRAIN_DEADLINE).await;
        println!(
            "drained: {} in flight, {} finished, {} stopped and released, {} left in progress",
            report.in_flight, report.finished, report.stopped, report.left_in_progress
        );
        Ok(())
    })
}

/// How long a shutdown lets the payments in flight finish before it stops them and releases
/// their keys.
const DRAIN_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        // No signal handling: serve until killed.
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Counts `POST /payments` for `--drop-answers`.
struct Dropper {
    every: u64,
    seen: std::sync::atomic::AtomicU64,
}

impl Dropper {
    fn new(every: u64) -> Self {
        Dropper {
            every,
            seen: std::sync::atomic::AtomicU64::new(0),
        }
    }
}

/// Lets every Nth payment run (the layer charges and stores the answer), then holds the
/// answer far longer than any client waits: the answer is lost after the charge.
async fn drop_answer(
    State(dropper): State<Arc<Dropper>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let payment = request.method() == http::Method::POST && request.uri().path() == "/payments";
    let response = next.run(request).await;
    let seen = dropper
        .seen
        .fetch_add(u64::from(payment), std::sync::atomic::Ordering::Relaxed);
    if payment && (seen + 1) % dropper.every == 0 {
        tokio::time::sleep(std::time::Duration::from_secs(30)).await;
    }
    response
}

/// `GET /metrics`: the store's metrics (docs/operations.md, "Metrics") in the Prometheus text format.
fn metrics_route(store: Arc<Store>) -> Result<Router, BoxError> {
    let prometheus = server::install_prometheus()?;
    let render = move || {
        let _gauges = store.metrics(); // sets the overlay and file-size gauges
        let text = prometheus.render();
        let content_type = [(http::header::CONTENT_TYPE, server::PROMETHEUS_TEXT)];
        async move { (content_type, text) }
    };
    Ok(Router::new().route("/metrics", get(render)))
}

/// The routes; `POST /payments` behind the idempotency layer.
pub fn app(payments: Arc<Payments>) -> (Router, Drain) {
    let layer = IdempotencyLayer::shared(payments.store(), payments.idempotency());
    let drain = layer.drain_handle();
    let router = Router::new()
        .route("/payments", post(create).layer(layer).fallback(other))
        .route("/payments/{id}", get(show).fallback(other))
        .route("/ledger", get(ledger).fallback(other))
        .fallback(any(other))
        .with_state(payments);
    (router, drain)
}

/// `POST /payments`, run by the layer once per key; the charge runs on the blocking pool
/// (it sleeps for the simulated card network).
async fn create(
    State(payments): State<Arc<Payments>>,
    Extension(watch): Extension<LeaseWatch>,
    body: Bytes,
) -> Response {
    let delay = payments.charge_delay();
    tokio::time::sleep(delay).await;
    let charged =
        tokio::task::spawn_blocking(move || payments.charge(watch.token(), watch.key(), &body))
            .await;
    let answer = charged.unwrap_or_else(|_| idempotency_store::http::Problem::internal().to_http());
    answer.map(Into::into)
}

async fn show(State(payments): State<Arc<Payments>>, Path(id): Path<String>) -> Response {
    payments.show(&id).map(Into::into)
}

async fn ledger(State(payments): State<Arc<Payments>>) -> Response {
    payments.ledger().map(Into::into)
}

/// 404 and 405 as the sync server answers them.
async fn other(State(payments): State<Arc<Payments>>, request: Request) -> Response {
    let (parts, _) = request.into_parts();
    let request = http::Request::from_parts(parts, Vec::new());
    payments.handle(request).map(Into::into)
}
