//! A payments HTTP server over one store file: `POST /payments` charges once per
//! `Idempotency-Key`, whatever the retries, crashes and restarts.
//!
//! ```sh
//! cargo run --example payments_server -- --db payments.redb --listen 127.0.0.1:8080
//! curl -i -X POST localhost:8080/payments -H 'Idempotency-Key: "order-1"' \
//!      -d '{"amount": 4999, "currency": "usd", "customerId": "cus_123"}'
//! curl localhost:8080/ledger
//! ```
//!
//! Options (`--help` lists them with their defaults): `--db PATH`, `--listen ADDR` (port 0
//! picks a free one), `--wait-ms MS` (how long a duplicate of a request in flight waits for the
//! first answer; 0 answers 409 at once), `--lease-ms MS` (how long a crashed attempt blocks
//! its key), `--delay-ms MS` (simulated card-network latency), `--threads N`.
//!
//! It prints `listening on http://ADDR` once it serves. Kill it with `kill -9` at any moment
//! and start it again on the same file: every retry gets the first answer, and the ledger
//! holds one charge per key. `GET /metrics` answers the store's metrics in the Prometheus text
//! format (docs/operations.md, "Metrics").

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;

// Public so that tests/payments_e2e.rs, which runs this file as its child server, reaches it.
#[path = "payments_service/server.rs"]
pub mod server;

#[path = "payments_service/options.rs"]
pub mod options;

use options::ServeOptions;
use server::{BoxError, Payments};

/// A payments HTTP server over one store file: `POST /payments` charges once per
/// Idempotency-Key, whatever the retries, crashes and restarts; `GET /payments/{id}` and
/// `GET /ledger` read the charges; `GET /metrics` shows the store's metrics.
#[derive(Debug, Parser)]
#[command(
    name = "payments_server",
    version,
    after_help = format!("{}\n\n{}", server::limits_help(), options::AFTER_HELP)
)]
pub struct Args {
    #[command(flatten)]
    pub serve: ServeOptions,
    /// Threads running requests. A request holds one, once it has fully arrived, until its
    /// answer is ready, blocking while its write becomes durable; group commit shares one log
    /// write among the requests waiting together, so about as many threads as concurrent
    /// clients is fastest. Connections (HTTP/1.1, kept alive) hold no thread.
    #[arg(long, value_name = "N", default_value_t = 64)]
    pub threads: usize,
}

fn main() -> ExitCode {
    // `--help`: usage on stdout, exit 0; a bad option or value: clap's message naming it, exit 2.
    let args = Args::parse();
    match serve(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("payments_server: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Parses `args` (the options, without the program name) and serves until the process ends.
pub fn run(args: impl Iterator<Item = String>) -> Result<(), BoxError> {
    serve(&Args::try_parse_from(
        std::iter::once("payments_server".to_owned()).chain(args),
    )?)
}

/// Opens the store and serves until the process ends.
pub fn serve(args: &Args) -> Result<(), BoxError> {
    let store = args.serve.open_store()?;
    let prometheus = server::install_prometheus()?;
    let payments = Payments::open(store, args.serve.service(args.threads))?
        .with_metrics_page(move || prometheus.render());
    let running = server::start(payments, &args.serve.listen)?;
    println!("listening on http://{}", running.addr());
    std::io::stdout().flush()?;
    running.wait();
    Ok(())
}
