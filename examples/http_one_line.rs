//! The README's one-line forms, compiled: the tower/axum layer and the sync `handle`.
//!
//! `cargo run --example http_one_line` serves the layer form on a free port, sends one
//! request and its retry through each form, and prints the answers.

use std::time::Duration;

use idempotency_store::Store;
use idempotency_store::http::{HandleOptions, handle, tower::IdempotencyLayer};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

async fn create_payment(body: String) -> (axum::http::StatusCode, String) {
    (axum::http::StatusCode::CREATED, format!("charged {body}"))
}

fn charge(body: &[u8]) -> http::Response<Vec<u8>> {
    let mut answer = http::Response::new([b"charged ", body].concat());
    *answer.status_mut() = http::StatusCode::CREATED;
    answer
}

// ---- README: the layer
async fn layer_form(listener: tokio::net::TcpListener) -> Result<(), BoxError> {
    let store = Store::builder().open_in_memory()?; // or Store::open("idempotency.redb")?
    let app = axum::Router::new()
        .route("/payments", axum::routing::post(create_payment))
        .layer(IdempotencyLayer::new(
            store,
            HandleOptions::new().wait(Duration::from_secs(5)),
        ));
    axum::serve(listener, app).await?;
    Ok(())
}

// ---- README: the sync handle
fn sync_form(store: &Store, request: http::Request<Vec<u8>>) -> http::Response<Vec<u8>> {
    let options = HandleOptions::new(); // covers POST and PATCH; 409 at once; every answer final
    handle(store, request, &options, |lease, request| match lease {
        // POST or PATCH with its key claimed: runs once per key, retries get the stored answer.
        Some(_lease) => charge(request.body()),
        // GET, PUT, DELETE, …: not covered, so no key, no store, and it runs every time.
        None => http::Response::new(b"[]".to_vec()),
    })
}

fn request() -> Result<http::Request<Vec<u8>>, http::Error> {
    http::Request::post("/payments")
        .header("Idempotency-Key", "\"order-1\"")
        .body(b"4999".to_vec())
}

fn main() -> Result<(), BoxError> {
    let store = Store::builder().open_in_memory()?;
    for attempt in ["first", "retry"] {
        let answer = sync_form(&store, request()?);
        let replayed = answer.headers().contains_key("idempotent-replayed");
        println!("sync {attempt}: {} replayed={replayed}", answer.status());
    }
    tokio::runtime::Runtime::new()?.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(layer_form(listener));
        for attempt in ["first", "retry"] {
            let reply = tokio::task::spawn_blocking(move || post(addr)).await??;
            println!("layer {attempt}: {reply}");
        }
        Ok(())
    })
}

/// One POST over a plain socket; the status line and the replay header.
fn post(addr: std::net::SocketAddr) -> Result<String, BoxError> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.write_all(
        b"POST /payments HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
          Idempotency-Key: \"order-1\"\r\nContent-Length: 4\r\n\r\n4999",
    )?;
    let mut reply = String::new();
    stream.read_to_string(&mut reply)?;
    let status = reply.lines().next().unwrap_or_default().to_owned();
    let replayed = reply
        .to_ascii_lowercase()
        .contains("idempotent-replayed: true");
    Ok(format!("{status} replayed={replayed}"))
}
