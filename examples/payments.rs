//! The seed story over real HTTP: a payments server (the one `payments_server` runs) on a free
//! loopback port, and a client that loses an answer, retries, races duplicates, reuses a key,
//! survives a server restart and forgets the key.
//!
//! `cargo run --example payments`

use std::time::{Duration, Instant};

#[allow(dead_code)] // shared with payments_server and the e2e test; this story uses a part
#[path = "payments_service/server.rs"]
mod server;

#[allow(dead_code)]
#[path = "payments_service/client.rs"]
mod client;

use client::{Client, Reply};
use server::{BoxError, Options, Payments};

const KEY: &str = "8e03978e-40d5-43e8-bc93-6894a57f9324";
const BODY: &str = r#"{"amount": 4999, "currency": "usd", "customerId": "cus_123"}"#;

fn main() -> Result<(), BoxError> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("payments.redb");
    let options = Options {
        // A duplicate of a request in flight waits for its answer instead of getting a 409.
        wait: Duration::from_secs(5),
        // The card network takes a while: long enough for a client to give up.
        charge_delay: Duration::from_millis(300),
        threads: 8,
    };
    let running = server::start(
        Payments::open(server::store_builder().open(&path)?, options.clone())?,
        "127.0.0.1:0",
    )?;
    let http = Client::new(running.addr());
    println!(
        "payments server on http://{} (store {})",
        running.addr(),
        path.display()
    );
    println!(
        "charging a card takes {} ms",
        options.charge_delay.as_millis()
    );

    println!("\n1. The answer is lost, the client retries with the same key");
    println!("   > POST /payments  Idempotency-Key: \"{KEY}\"\n     {BODY}");
    let impatient = http.with_timeout(Duration::from_millis(100));
    match impatient.post("/payments", Some(KEY), BODY) {
        Err(_) => {
            println!("   x no answer within 100 ms: the client times out, the answer is lost")
        }
        Ok(reply) => return Err(format!("expected a timeout, got {}", reply.status).into()),
    }
    println!("   > the same request again, same key");
    let started = Instant::now();
    let first = http.post("/payments", Some(KEY), BODY)?;
    show(&first);
    println!(
        "     (the server waited {} ms for the first attempt, then replayed its answer)",
        started.elapsed().as_millis()
    );
    assert!(first.status == 201 && first.replayed());
    println!("   ledger: {} charge", ledger_count(&http)?);

    println!("\n2. Eight concurrent duplicates of a new key");
    let key2 = "c1a7e5b2-0f4d-4a39-9d8e-2b6f3c8a1e77";
    let body2 = r#"{"amount": 1250, "currency": "eur", "customerId": "cus_456"}"#;
    let replies = std::thread::scope(|s| {
        let sends: Vec<_> = (0..8)
            .map(|_| s.spawn(|| http.post("/payments", Some(key2), body2)))
            .collect();
        sends
            .into_iter()
            .map(|t| {
                t.join()
                    .map_err(|_| "client thread panicked")?
                    .map_err(BoxError::from)
            })
            .collect::<Result<Vec<Reply>, BoxError>>()
    })?;
    let charged = replies
        .iter()
        .filter(|r| r.status == 201 && !r.replayed())
        .count();
    let replayed = replies
        .iter()
        .filter(|r| r.status == 201 && r.replayed())
        .count();
    let same = replies.iter().all(|r| r.body == replies[0].body);
    println!("   < {charged} x 201 charged, {replayed} x 201 replayed (Idempotent-Replayed: true)");
    println!("     every answer the same: {same}  {}", replies[0].body);
    assert!(charged == 1 && replayed == 7 && same);
    println!("   ledger: {} charges", ledger_count(&http)?);

    println!("\n3. The first key reused for another amount");
    let other = BODY.replace("4999", "5000");
    println!("   > POST /payments  Idempotency-Key: \"{KEY}\"\n     {other}");
    let reused = http.post("/payments", Some(KEY), &other)?;
    show(&reused);
    assert_eq!(reused.status, 422);

    println!("\n4. The server restarts: workers stopped, store closed, the file reopened");
    drop(running);
    let running = server::start(
        Payments::open(server::store_builder().open(&path)?, options)?,
        "127.0.0.1:0",
    )?;
    let http = Client::new(running.addr());
    println!("   payments server on http://{}", running.addr());
    println!("   > the first request once more");
    let after = http.post("/payments", Some(KEY), BODY)?;
    show(&after);
    println!(
        "     same body as before the restart: {}",
        after.body == first.body
    );
    assert!(after.status == 201 && after.replayed() && after.body == first.body);

    println!("\n5. A request without Idempotency-Key");
    let missing = http.post("/payments", None, BODY)?;
    show(&missing);
    assert_eq!(missing.status, 400);

    let count = ledger_count(&http)?;
    println!("\nledger: {count} charges (GET /ledger), one per key, whatever the retries");
    assert_eq!(count, 2);
    Ok(())
}

/// Prints an answer: status, the replay header if set, and the body.
fn show(reply: &Reply) {
    let replayed = if reply.replayed() {
        "  Idempotent-Replayed: true"
    } else {
        ""
    };
    let retry = reply
        .header("retry-after")
        .map(|s| format!("  Retry-After: {s}"))
        .unwrap_or_default();
    let reason = http::StatusCode::from_u16(reply.status)
        .ok()
        .and_then(|s| s.canonical_reason())
        .unwrap_or_default();
    println!(
        "   < {} {reason}{replayed}{retry}\n     {}",
        reply.status, reply.body
    );
}

fn ledger_count(http: &Client) -> Result<u64, BoxError> {
    let ledger = http.get("/ledger")?.json();
    ledger["count"]
        .as_u64()
        .ok_or_else(|| "GET /ledger has no count".into())
}
