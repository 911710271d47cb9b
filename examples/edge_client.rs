//! An offline-first edge device (a POS terminal, a kiosk): it queues payments whether or not
//! the network is up, and flushes them to the payments server exactly once when it can,
//! across crashes and reboots of either side.
//!
//! ```sh
//! cargo run --example axum_payments -- --db server.redb --listen 127.0.0.1:8080 &
//! cargo run --example edge_client -- --db device.redb --server http://127.0.0.1:8080 --payments 5
//! ```
//!
//! Each payment is an intent of the outbox (`idempotency_store::client`): its idempotency key
//! is on the device's disk before the first send, every retry (after a timeout, a 503, a
//! reboot) sends the same key, and a payment whose answer arrived is never sent again. At
//! boot the device first resumes what `pending()` lists. `--fresh-key-per-retry` makes the
//! classic mistake instead (a new key on every attempt), to show what it costs.
//!
//! For the crash test (tests/client/edge_client_crash.rs), `EDGE_CLIENT_CRASH_AT=POINT:N` makes the
//! process kill itself with SIGKILL the Nth time it reaches `POINT`: `after-begin` (the key is
//! on disk, nothing sent), `before-request` (the send is recorded, not yet out) or
//! `after-request` (the server answered; the answer is not yet recorded or finished).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use idempotency_store::client::{self, Delivery, Failure, Outbox, RetryPolicy};
use idempotency_store::{Claim, ClaimId, Fingerprint, Response, Store};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An offline-first device that queues payments and flushes each exactly once.
#[derive(Debug, Parser)]
#[command(name = "edge_client", version)]
pub struct Args {
    /// The device's store file: its intents (queued payments and their keys).
    #[arg(long, value_name = "PATH", default_value = "device.redb")]
    pub db: std::path::PathBuf,
    /// The payments server (`axum_payments` or `payments_server`).
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// How many payments to queue: `PREFIX-1` … `PREFIX-N` (already queued ones are kept).
    #[arg(long, value_name = "N", default_value_t = 5)]
    pub payments: u32,
    /// The operation ids' prefix.
    #[arg(long, value_name = "PREFIX", default_value = "sale")]
    pub prefix: String,
    /// How long one request may take before it counts as unanswered.
    #[arg(long = "timeout-ms", value_name = "MS", default_value_t = 2_000)]
    pub timeout_ms: u64,
    /// Give up (exit 1) when payments are still queued after this long.
    #[arg(long = "max-seconds", value_name = "S", default_value_t = 300)]
    pub max_seconds: u64,
    /// The mistake, for comparison: a fresh key on every attempt (double charges follow).
    #[arg(long = "fresh-key-per-retry")]
    pub fresh_key_per_retry: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("edge_client: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Queues the payments and flushes every queued one; returns once none is left.
pub fn run(args: &Args) -> Result<(), BoxError> {
    let outbox = Outbox::new(Arc::new(Store::open(&args.db)?));
    for n in 1..=args.payments {
        let id = format!("{}-{n}", args.prefix);
        if let Claim::Acquired(intent) = outbox.begin(&id, fingerprint(&body(&id)))? {
            println!("queued {id} key={}", intent.key());
        }
    }
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .timeout_global(Some(Duration::from_millis(args.timeout_ms)))
        .http_status_as_error(false)
        .build()
        .into();
    let deadline = Instant::now() + Duration::from_secs(args.max_seconds);
    loop {
        let pending = outbox.pending()?;
        if pending.is_empty() {
            println!("done: nothing queued");
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("{} payments still queued", pending.len()).into());
        }
        for queued in pending {
            if !flush(&outbox, &agent, args, &queued.operation_id)? {
                // The server is unreachable: keep the queue's order, try again later.
                std::thread::sleep(Duration::from_millis(200));
                break;
            }
        }
    }
}

/// Sends one queued payment; `false` if the server could not be reached.
fn flush(outbox: &Outbox, agent: &ureq::Agent, args: &Args, id: &str) -> Result<bool, BoxError> {
    let body = body(id);
    let Claim::Acquired(mut intent) = outbox.begin(id, fingerprint(&body))? else {
        return Ok(true); // finished meanwhile
    };
    crash_point("after-begin");
    let url = format!("{}/payments", args.server);
    // While an earlier attempt of this payment is still running on the server (the device
    // died mid-request and was restarted), ask the server to hold this one until the answer
    // exists (RFC 7240), for a second less than this request's own timeout; without it the
    // server answers 409 after its own short wait, and the answer is fetched a
    // `Retry-After` later.
    let wait = format!("wait={}", (args.timeout_ms / 1000).saturating_sub(1));
    let mut headers = vec![("content-type", "application/json")];
    if args.timeout_ms >= 2000 {
        headers.push(("prefer", &wait));
    }
    let policy = RetryPolicy::new()
        .max_attempts(4)
        .backoff(Duration::from_millis(50), Duration::from_secs(2));
    let mut send = client::ureq::sender(agent, "POST", &url, body.as_bytes(), &headers);
    let delivery = outbox.send(&mut intent, &policy, |key, attempt| {
        crash_point("before-request");
        let answer = if args.fresh_key_per_retry {
            send(&format!("fresh-{:016x}", ClaimId::random().get()), attempt)
        } else {
            send(key, attempt)
        };
        crash_point("after-request");
        answer
    })?;
    match delivery {
        Delivery::Answered(answer) => {
            println!("delivered {id} status={} {}", answer.status, text(&answer));
            Ok(true)
        }
        Delivery::GaveUp {
            last: Err(Failure::Refused(_)),
        } => Ok(false),
        Delivery::GaveUp { .. } => Ok(true),
        Delivery::KeyReused(answer) => Err(format!("{id}: 422 {}", text(&answer)).into()),
        Delivery::NeedsReconciliation => {
            Err(format!("{id}: too old to retry; ask the server what became of it").into())
        }
        other => Err(format!("{id}: {other:?}").into()),
    }
}

/// Kills the process with SIGKILL the Nth time `point` is reached, if `EDGE_CLIENT_CRASH_AT`
/// says `point:N`: a crash with no chance to clean up, as a power cut would be.
fn crash_point(point: &str) {
    static REACHED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let Ok(at) = std::env::var("EDGE_CLIENT_CRASH_AT") else {
        return;
    };
    let Some((name, nth)) = at.split_once(':') else {
        return;
    };
    if name != point || nth.parse::<u32>().is_err() {
        return;
    }
    let reached = REACHED.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
    if nth.parse() == Ok(reached) {
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &std::process::id().to_string()])
            .status();
        std::process::abort(); // only if `kill` could not be run
    }
}

/// The payment's JSON; the operation id doubles as the customer reference, so the server's
/// ledger shows which operation each charge belongs to.
fn body(id: &str) -> String {
    let amount = 100 + id.bytes().map(u64::from).sum::<u64>() % 900;
    format!(r#"{{"amount":{amount},"currency":"usd","customerId":"{id}"}}"#)
}

fn fingerprint(body: &str) -> Fingerprint {
    Fingerprint::of(["POST /payments", body])
}

fn text(answer: &Response) -> String {
    String::from_utf8_lossy(&answer.body).into_owned()
}
