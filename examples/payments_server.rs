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
//! Options: `--db PATH` (default `payments.redb`), `--listen ADDR` (default `127.0.0.1:8080`;
//! port 0 picks a free one), `--wait-ms N` (0, the default: a duplicate of a request in flight
//! gets 409 at once; otherwise it waits up to N ms for the first attempt's answer),
//! `--lease-ms N` (how long a crashed attempt blocks its key; default 60000), `--delay-ms N`
//! (simulated card-network latency; default 0), `--threads N` (default 8).
//!
//! It prints `listening on http://ADDR` once it serves. Kill it with `kill -9` at any moment
//! and start it again on the same file: every retry gets the first answer, and the ledger
//! holds one charge per key.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

// Public so that tests/payments_e2e.rs, which runs this file as its child server, reaches it.
#[path = "payments_service/server.rs"]
pub mod server;

use server::{BoxError, Options, Payments};

fn main() -> ExitCode {
    match run(std::env::args().skip(1)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("payments_server: {err}");
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
        threads: 8,
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
            "--threads" => options.threads = value()?.parse()?,
            other => return Err(format!("unknown option {other} (see the source's docs)").into()),
        }
    }
    let mut builder = server::store_builder();
    if let Some(lease) = lease {
        builder.lease(lease);
    }
    let store = builder.open(&db)?;
    let running = server::start(Payments::open(store, options)?, &listen)?;
    println!("listening on http://{}", running.addr());
    std::io::stdout().flush()?;
    running.wait();
    Ok(())
}
