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
//! Options: `--db PATH` (default `payments.redb`), `--listen ADDR` (default `127.0.0.1:8080`;
//! port 0 picks a free one), `--wait-ms N` (0, the default: a duplicate of a request in flight
//! gets 409 at once; otherwise it waits up to N ms), `--lease-ms N` (default 60000),
//! `--delay-ms N` (simulated card-network latency; default 0). It prints
//! `listening on http://ADDR` once it serves. `GET /metrics` answers the store's metrics in the
//! Prometheus text format (README, "Metrics").

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, Path, Request, State};
use axum::response::Response;
use axum::routing::{any, get, post};
use idempotency_store::Store;
use idempotency_store::http::LeaseWatch;
use idempotency_store::http::tower::IdempotencyLayer;

#[allow(dead_code)] // the tiny_http-free sync server is not used here
#[path = "payments_service/server.rs"]
pub mod server;

use server::{BoxError, Options, Payments};

fn main() -> ExitCode {
    match run(std::env::args().skip(1)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("axum_payments: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Parses the options, opens the store and serves until the process ends.
pub fn run(mut args: impl Iterator<Item = String>) -> Result<(), BoxError> {
    let (mut db, mut listen) = ("payments.redb".to_owned(), "127.0.0.1:8080".to_owned());
    let mut lease = None;
    let mut options = Options {
        wait: Duration::ZERO,
        charge_delay: Duration::ZERO,
        threads: 1,
    };
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        let millis = |v: String| v.parse().map(Duration::from_millis);
        match flag.as_str() {
            "--db" => db = value()?,
            "--listen" => listen = value()?,
            "--wait-ms" => options.wait = millis(value()?)?,
            "--lease-ms" => lease = Some(millis(value()?)?),
            "--delay-ms" => options.charge_delay = millis(value()?)?,
            other => return Err(format!("unknown option {other} (see the source's docs)").into()),
        }
    }
    let mut builder = server::store_builder();
    if let Some(lease) = lease {
        builder.lease(lease);
    }
    // Opened before the runtime starts: opening reads and may repair the file (blocking).
    let payments = Arc::new(Payments::open(builder.open(&db)?, options)?);
    tokio::runtime::Runtime::new()?.block_on(async {
        let listener = tokio::net::TcpListener::bind(&listen).await?;
        println!("listening on http://{}", listener.local_addr()?);
        std::io::stdout().flush()?;
        let metrics = metrics_route(payments.store())?;
        axum::serve(listener, app(payments).merge(metrics)).await?;
        Ok(())
    })
}

/// `GET /metrics`: the store's metrics (README, "Metrics") in the Prometheus text format.
fn metrics_route(store: Arc<Store>) -> Result<Router, BoxError> {
    let prometheus = metrics_exporter_prometheus::PrometheusBuilder::new().install_recorder()?;
    let render = move || {
        let _gauges = store.metrics(); // sets the overlay and file-size gauges
        let text = prometheus.render();
        async move { text }
    };
    Ok(Router::new().route("/metrics", get(render)))
}

/// The routes; `POST /payments` behind the idempotency layer.
pub fn app(payments: Arc<Payments>) -> Router {
    let layer = IdempotencyLayer::shared(payments.store(), payments.idempotency());
    Router::new()
        .route("/payments", post(create).layer(layer).fallback(other))
        .route("/payments/{id}", get(show).fallback(other))
        .route("/ledger", get(ledger).fallback(other))
        .fallback(any(other))
        .with_state(payments)
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
