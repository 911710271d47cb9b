//! The payments server of `payments_server` on actix-web, with the `Idempotency` middleware:
//! the same routes (`POST /payments`, `GET /payments/{id}`, `GET /ledger`, `GET /metrics`),
//! ledger, JSON and options as `axum_payments`, so one client script drives either.
//!
//! ```sh
//! cargo run --example actix_payments -- --db payments.redb --listen 127.0.0.1:8080
//! curl -i -X POST localhost:8080/payments -H 'Idempotency-Key: "order-1"' \
//!      -d '{"amount": 4999, "currency": "usd", "customerId": "cus_123"}'
//! ```
//!
//! Options (`--help` lists them with their defaults): `--db PATH`, `--listen ADDR` (port 0
//! picks a free one), `--wait-ms MS`, `--lease-ms MS`, `--delay-ms MS` and `--drop-answers N`,
//! as `axum_payments` takes them. It prints `listening on http://ADDR` once it serves. On
//! SIGTERM or Ctrl-C it drains the middleware (new payments get 503; those in flight finish,
//! for up to 10 s, even a payment whose client hung up), prints what the drain settled, then
//! stops the server gracefully.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use actix_web::dev::{Service, ServiceRequest};
use actix_web::{App, HttpRequest, HttpResponse, HttpServer, web};
use clap::Parser;
use idempotency_store::IdempotencyStore;
use idempotency_store::http::LeaseWatch;
use idempotency_store::http::actix::{Idempotency, respond};
use metrics_exporter_prometheus::PrometheusHandle;

#[allow(dead_code)] // the sync server is not used here
#[path = "payments_service/server.rs"]
pub mod server;

#[path = "payments_service/options.rs"]
pub mod options;

use options::ServeOptions;
use server::{BoxError, Payments};

/// The payments server of `payments_server` on actix-web, behind the `Idempotency`
/// middleware: the same routes (`POST /payments`, `GET /payments/{id}`, `GET /ledger`), plus
/// `GET /metrics`.
#[derive(Debug, Parser)]
#[command(name = "actix_payments", version, after_help = options::AFTER_HELP)]
pub struct Args {
    #[command(flatten)]
    pub serve: ServeOptions,
    /// Loses every Nth answer to `POST /payments` after the charge (0: none): the client gets
    /// no answer and must retry with the same key. For tests of clients; never in production.
    #[arg(long = "drop-answers", value_name = "N", default_value_t = 0)]
    pub drop_answers: u64,
}

fn main() -> ExitCode {
    // `--help`: usage on stdout, exit 0; a bad option or value: clap's message naming it, exit 2.
    let args = Args::parse();
    match serve(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("actix_payments: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Parses `args` (the options, without the program name) and serves until the process ends.
pub fn run(args: impl Iterator<Item = String>) -> Result<(), BoxError> {
    serve(&Args::try_parse_from(
        std::iter::once("actix_payments".to_owned()).chain(args),
    )?)
}

/// Opens the store and serves until the process ends.
pub fn serve(args: &Args) -> Result<(), BoxError> {
    let listen = &args.serve.listen;
    // Opened before the server starts: opening reads and may repair the file (blocking).
    let payments = Arc::new(Payments::open(
        args.serve.open_store()?,
        args.serve.service(1),
    )?);
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|err| format!("cannot listen on {listen}: {err}"))?;
    let prometheus = server::install_prometheus()?;
    // One middleware for every worker: they share its bound on blocking claims, and a
    // duplicate is woken by the holder's answer whichever worker runs either.
    let idempotency = Idempotency::shared(payments.store(), payments.idempotency());
    let dropper = Arc::new(Dropper::new(args.drop_answers));
    let drain = idempotency.drain_handle();
    actix_web::rt::System::new().block_on(async move {
        let (drained, report) = tokio::sync::oneshot::channel();
        let server = HttpServer::new(move || {
            let dropper = Arc::clone(&dropper);
            App::new()
                .configure(routes(Arc::clone(&payments), idempotency.clone()))
                .configure(metrics_route(payments.store(), prometheus.clone()))
                .default_service(web::to(other))
                .wrap_fn(move |request, service| {
                    let drops = dropper.drops(&request);
                    let answered = service.call(request);
                    async move {
                        let answer = answered.await?;
                        if drops {
                            actix_web::rt::time::sleep(Duration::from_secs(30)).await;
                        }
                        Ok(answer)
                    }
                })
        })
        // In place of actix's own SIGTERM handling: the payments in flight run on the workers'
        // tasks, which end with the workers, so they are settled before the server stops.
        .shutdown_signal(async move {
            shutdown_signal().await;
            let _ = drained.send(drain.finish(DRAIN_DEADLINE).await);
        })
        .listen(listener)?;
        for addr in server.addrs() {
            println!("listening on http://{addr}");
        }
        std::io::stdout().flush()?;
        server.run().await?;
        if let Ok(report) = report.await {
            println!(
                "drained: {} in flight, {} finished, {} stopped and released, {} left in progress",
                report.in_flight, report.finished, report.stopped, report.left_in_progress
            );
        }
        Ok(())
    })
}

/// How long a shutdown lets the payments in flight finish before it stops them and releases
/// their keys.
const DRAIN_DEADLINE: Duration = Duration::from_secs(10);

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
    seen: AtomicU64,
}

impl Dropper {
    fn new(every: u64) -> Self {
        Dropper {
            every,
            seen: AtomicU64::new(0),
        }
    }

    /// Whether to lose the answer to `request`: every Nth payment runs (the middleware charges
    /// and stores the answer), then its answer is held far longer than any client waits.
    fn drops(&self, request: &ServiceRequest) -> bool {
        let payment =
            request.method() == actix_web::http::Method::POST && request.path() == "/payments";
        if !payment || self.every == 0 {
            return false;
        }
        let seen = self.seen.fetch_add(1, Ordering::Relaxed);
        (seen + 1).is_multiple_of(self.every)
    }
}

/// The routes; `POST /payments` behind the idempotency middleware, other methods answered
/// 405 as the sync server answers them.
pub fn routes(
    payments: Arc<Payments>,
    idempotency: Idempotency,
) -> impl FnOnce(&mut web::ServiceConfig) {
    move |config| {
        config
            .app_data(web::Data::from(payments))
            .service(
                web::resource("/payments")
                    .route(web::post().to(create).wrap(idempotency))
                    .default_service(web::to(other)),
            )
            .service(
                web::resource("/payments/{id}")
                    .route(web::get().to(show))
                    .default_service(web::to(other)),
            )
            .service(
                web::resource("/ledger")
                    .route(web::get().to(ledger))
                    .default_service(web::to(other)),
            );
    }
}

/// `POST /payments`, run by the middleware once per key; the charge runs on the blocking
/// pool (it writes the ledger), after the simulated card-network delay.
async fn create(
    payments: web::Data<Payments>,
    watch: web::ReqData<LeaseWatch>,
    body: web::Bytes,
) -> HttpResponse {
    actix_web::rt::time::sleep(payments.charge_delay()).await;
    let payments = payments.into_inner();
    let watch = watch.into_inner();
    let charged = web::block(move || payments.charge(watch.token(), watch.key(), &body)).await;
    // `respond` keeps the charge in the answer's extensions for the ledger's completion hook.
    respond(charged.unwrap_or_else(|_| idempotency_store::http::Problem::internal().to_http()))
}

async fn show(payments: web::Data<Payments>, id: web::Path<String>) -> HttpResponse {
    respond(payments.show(&id))
}

async fn ledger(payments: web::Data<Payments>) -> HttpResponse {
    respond(payments.ledger())
}

/// 404 and 405 as the sync server answers them.
async fn other(payments: web::Data<Payments>, request: HttpRequest) -> HttpResponse {
    let method = http::Method::from_bytes(request.method().as_str().as_bytes());
    let uri = request.uri().to_string().parse::<http::Uri>();
    let (Ok(method), Ok(uri)) = (method, uri) else {
        return HttpResponse::BadRequest().finish();
    };
    let mut sync = http::Request::new(Vec::new());
    *sync.method_mut() = method;
    *sync.uri_mut() = uri;
    respond(payments.handle(sync))
}

/// `GET /metrics`: the store's metrics (docs/operations.md, "Metrics") in the Prometheus text
/// format; other methods 405.
fn metrics_route(
    store: Arc<idempotency_store::Store>,
    prometheus: PrometheusHandle,
) -> impl FnOnce(&mut web::ServiceConfig) {
    let render = move || {
        let _gauges = store.metrics(); // sets the overlay and file-size gauges
        let text = prometheus.render();
        async move {
            HttpResponse::Ok()
                .content_type(server::PROMETHEUS_TEXT)
                .body(text)
        }
    };
    move |config| {
        config.service(
            web::resource("/metrics")
                .route(web::get().to(render))
                .default_service(web::to(|| async {
                    HttpResponse::MethodNotAllowed()
                        .insert_header(("allow", "GET"))
                        .finish()
                })),
        );
    }
}
