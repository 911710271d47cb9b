//! The seed story in one run: a payment request whose answer is lost, the client's retry, and
//! the same key reused for a different payment.
//!
//! `cargo run --example quickstart`

use std::cell::Cell;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Fingerprint, Key, Response, Store};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("payments.redb");
    let store = Store::open(&path)?;
    let charges = Cell::new(0);

    // The server side of POST /payments: charge once per idempotency key.
    let handle = |key: &str, body: &str| -> Result<String, Box<dyn std::error::Error>> {
        let key = Key::new(key)?;
        let request = Fingerprint::of(["POST", "/payments", body]);
        Ok(match store.claim(&key, request)? {
            Claim::Acquired(lease) => {
                charges.set(charges.get() + 1);
                let id = format!("pay_{}", charges.get());
                let response = Response::new(201, format!(r#"{{"id":"{id}","request":{body}}}"#));
                store.complete(&lease, response.clone())?;
                format!("201 {} (charged)", String::from_utf8_lossy(&response.body))
            }
            Claim::Completed(replay) => format!(
                "{} {} (replayed, Idempotent-Replayed: true)",
                replay.response.status,
                String::from_utf8_lossy(&replay.response.body)
            ),
            Claim::InProgress { .. } => "409 request in progress, retry later".to_owned(),
            Claim::Mismatch { .. } => "422 key reused with a different request".to_owned(),
        })
    };

    let key = "8e03978e-40d5-43e8-bc93-6894a57f9324";
    let body = r#"{"amount":4999,"currency":"usd"}"#;
    println!("store: {}", path.display());
    println!("1. client sends POST /payments with Idempotency-Key {key}");
    println!("   server: {}", handle(key, body)?);
    println!("   ...the answer is lost on the way back (client timeout)");
    println!("2. client retries with the same key and body");
    println!("   server: {}", handle(key, body)?);
    println!("3. client reuses the key for another amount");
    let other = r#"{"amount":1,"currency":"usd"}"#;
    println!("   server: {}", handle(key, other)?);
    println!(
        "charges made: {} (one, whatever the retries)",
        charges.get()
    );
    assert_eq!(charges.get(), 1);
    Ok(())
}
