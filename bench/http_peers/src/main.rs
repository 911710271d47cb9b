//! Fresh-key POSTs per second through peer idempotency middleware and through ours, in one
//! run on 127.0.0.1, alternating, medians of `--runs` (default 3):
//!
//! - `bare`: the axum app without idempotency (its handler for every request);
//! - `axum-idempotent`: `axum-idempotent` 0.6 as its README sets it up (a `ruts` session in
//!   a `MokaStore`, keys from the `Idempotency-Key` header); each connection opens a session
//!   first, since the layer only caches for requests that carry one;
//! - `idempotent`: `idempotent` 2.x's `IdempotencyLayer` over its `MemoryStore`;
//! - `ours-memory`: `IdempotencyLayer` over `Store::open_in_memory()`;
//! - `ours-file`: `IdempotencyLayer` over a durable `Store` file (default settings: every
//!   claim and completion is synced before the answer).
//!
//! ```text
//! cargo run --release --manifest-path bench/http_peers/Cargo.toml -- \
//!     [--seconds S] [--runs N] [--connections C] [--dir PATH] [--only NAME,...]
//! ```
//!
//! `--only` drives just the named systems (for a profile of one of them); the ratio columns
//! then need `bare` and `axum-idempotent` among them.
//!
//! The server is tokio with 2 workers; the client is one thread driving `--connections`
//! keep-alive HTTP/1.1 connections (default 64) on a runtime of its own, each sending a POST
//! with a new key as soon as the last answer is in (like `wrk -c64`, but with a new key per
//! request). The handler answers 201 with a small JSON body.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::Router;
use axum::routing::{get, post};
use idempotency_store::Store;
use idempotency_store::http::HandleOptions;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

#[path = "../../../examples/support/process_cpu.rs"]
mod process_cpu;
use process_cpu::process_cpu;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const BODY: &str = r#"{"amount": 4999, "currency": "usd", "customerId": "cus_123"}"#;
const ANSWER: &str = r#"{"id":"pay_1","amount":4999,"currency":"usd","customerId":"cus_123"}"#;

const SYSTEMS: [&str; 5] = [
    "bare",
    "axum-idempotent",
    "idempotent",
    "ours-memory",
    "ours-file",
];

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let (mut seconds, mut runs, mut connections) = (3.0_f64, 3_usize, 64_usize);
    let mut dir = std::env::temp_dir();
    let mut only: Option<Vec<String>> = None;
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            println!(
                "usage: http_peers [--seconds S] [--runs N] [--connections C] [--dir PATH] \
                 [--only NAME,...]"
            );
            return Ok(());
        }
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--seconds" => seconds = value.parse()?,
            "--runs" => runs = value.parse()?,
            "--connections" => connections = value.parse()?,
            "--dir" => dir = value.into(),
            "--only" => only = Some(value.split(',').map(str::to_owned).collect()),
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    let window = Duration::from_secs_f64(seconds);
    let tmp = tempfile::tempdir_in(&dir)?;
    let file = Arc::new(Store::open(tmp.path().join("http-peers.redb"))?);
    let memory = Arc::new(Store::builder().open_in_memory()?);
    let server = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let addrs = {
        let _inside = server.enter();
        [
            serve(&server, bare())?,
            serve(&server, axum_idempotent())?,
            serve(&server, idempotent_app()?)?,
            serve(&server, ours(Arc::clone(&memory)))?,
            serve(&server, ours(Arc::clone(&file)))?,
        ]
    };
    for (name, addr) in SYSTEMS.iter().zip(addrs) {
        check_replays(addr, name)?;
    }
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); SYSTEMS.len()];
    let mut cpus: Vec<Vec<f64>> = vec![Vec::new(); SYSTEMS.len()];
    for run in 0..runs {
        for (i, (name, addr)) in SYSTEMS.iter().zip(addrs).enumerate() {
            if only
                .as_ref()
                .is_some_and(|only| !only.iter().any(|o| o == name))
            {
                continue;
            }
            let (rate, cpu) = drive(addr, connections, window, &format!("r{run}-{i}"), name)?;
            println!("run {run} {name:<16} {rate:>9.0} POSTs/s {cpu:>6.1} µs CPU each");
            rates[i].push(rate);
            cpus[i].push(cpu);
        }
    }
    // Ratios are taken within each round (the machine's load moves between rounds), then
    // their median is reported.
    let ratios = |all: &[f64], peer: &[f64]| -> Vec<f64> {
        all.iter()
            .zip(peer)
            .map(|(rate, peer)| rate / peer)
            .collect()
    };
    println!("\nfresh-key POSTs/s, {connections} connections, medians of {runs} rounds:");
    println!(
        "| system | POSTs/s (min-max) | / axum-idempotent (per round) | / bare (per round) | \
         CPU µs per POST |"
    );
    println!("|---|---:|---:|---:|---:|");
    for ((name, all), cpu) in SYSTEMS.iter().zip(&rates).zip(&cpus) {
        if all.is_empty() {
            continue;
        }
        let (lo, hi) = all
            .iter()
            .fold((f64::MAX, 0.0_f64), |(lo, hi), &r| (lo.min(r), hi.max(r)));
        let show = |ratios: Vec<f64>| {
            let each: Vec<String> = ratios.iter().map(|r| format!("{r:.2}")).collect();
            format!("**{:.2}** ({})", median(ratios), each.join(", "))
        };
        println!(
            "| {name} | {:.0} ({lo:.0}-{hi:.0}) | {} | {} | {:.1} |",
            median(all.clone()),
            show(ratios(all, &rates[1])),
            show(ratios(all, &rates[0])),
            median(cpu.clone())
        );
    }
    for (name, store) in [("ours-memory", &memory), ("ours-file", &file)] {
        if let Some(engine) = idempotency_store::IdempotencyStore::metrics(&**store).engine {
            let mean = engine.batched_ops as f64 / engine.batches.max(1) as f64;
            println!("{name}: {mean:.1} write calls per group commit on average");
        }
    }
    server.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

async fn handler(_body: axum::body::Bytes) -> impl axum::response::IntoResponse {
    (
        axum::http::StatusCode::CREATED,
        [("content-type", "application/json")],
        ANSWER,
    )
}

fn bare() -> Router {
    Router::new().route("/payments", post(handler))
}

fn ours(store: Arc<Store>) -> Router {
    bare().layer(idempotency_store::http::tower::IdempotencyLayer::new(
        store,
        HandleOptions::new(),
    ))
}

/// `axum-idempotent` as its README sets it up, plus `GET /session`, which starts the session
/// the layer needs before it caches anything.
fn axum_idempotent() -> Router {
    use axum_idempotent::{IdempotentLayer, IdempotentOptions};
    use ruts::store::moka::MokaStore;
    use ruts::{CookieOptions, Session, SessionLayer};

    let store = Arc::new(MokaStore::builder().build());
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(60 * 5);
    let start = |session: Session<MokaStore>| async move {
        let ttl = ruts::store::Ttl::new(3600)
            .map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?;
        session
            .set("user", &1_u32, ttl, None)
            .await
            .map_err(|_| axum::http::StatusCode::INTERNAL_SERVER_ERROR)?;
        Ok::<_, axum::http::StatusCode>("session")
    };
    Router::new()
        .route("/payments", post(handler))
        .layer(IdempotentLayer::<MokaStore>::new(options))
        .route("/session", get(start))
        .layer(SessionLayer::new(store).with_cookie_options(CookieOptions::build().name("session")))
        .layer(tower_cookies::CookieManagerLayer::new())
}

/// `idempotent`'s layer over its in-memory store, as its README sets it up.
fn idempotent_app() -> Result<Router, BoxError> {
    let store = idempotent::memory::MemoryStore::builder().try_build()?;
    Ok(bare().layer(idempotent::middleware::IdempotencyLayer::new(store)))
}

fn serve(runtime: &tokio::runtime::Runtime, app: Router) -> Result<SocketAddr, BoxError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    runtime.spawn(async move {
        if let Ok(listener) = tokio::net::TcpListener::from_std(listener) {
            let _ = axum::serve(listener, app).await;
        }
    });
    Ok(addr)
}

/// Fresh-key POSTs per second from `connections` keep-alive connections over `window`, after
/// a 300 ms warm-up, and the process's CPU time per POST in µs meanwhile (the client's
/// included); every answer must be 201.
fn drive(
    addr: SocketAddr,
    connections: usize,
    window: Duration,
    tag: &str,
    system: &str,
) -> Result<(f64, f64), BoxError> {
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let done = Arc::new(AtomicU64::new(0));
    let counting = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let session = system == "axum-idempotent";
    client.block_on(async {
        let tasks: Vec<_> = (0..connections)
            .map(|c| {
                let (done, counting, stop) =
                    (Arc::clone(&done), Arc::clone(&counting), Arc::clone(&stop));
                let prefix = format!("{tag}-c{c}");
                tokio::spawn(async move {
                    let mut conn = Conn::open(addr).await?;
                    if session {
                        conn.start_session().await?;
                    }
                    for i in 0u64.. {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let status = conn.post(&format!("{prefix}-{i}")).await?;
                        if status != 201 {
                            return Err(format!("status {status}").into());
                        }
                        if counting.load(Ordering::Relaxed) {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok::<(), BoxError>(())
                })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(300)).await;
        counting.store(true, Ordering::SeqCst);
        let (started, cpu_before) = (Instant::now(), process_cpu());
        tokio::time::sleep(window).await;
        counting.store(false, Ordering::SeqCst);
        let requests = done.load(Ordering::SeqCst) as f64;
        let rate = requests / started.elapsed().as_secs_f64();
        let cpu =
            (process_cpu().saturating_sub(cpu_before)).as_secs_f64() * 1e6 / requests.max(1.0);
        stop.store(true, Ordering::SeqCst);
        for task in tasks {
            task.await??;
        }
        Ok((rate, cpu))
    })
}

/// Checks that `system` does its job: the same key twice on one connection, the second
/// answer a replay (each peer marks it with a header whose name ends in `replayed`), and none
/// for the bare app.
fn check_replays(addr: SocketAddr, system: &str) -> Result<(), BoxError> {
    let client = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    client.block_on(async {
        let mut conn = Conn::open(addr).await?;
        if system == "axum-idempotent" {
            conn.start_session().await?;
        }
        conn.post("check-1").await?;
        let first = conn.replayed;
        conn.post("check-1").await?;
        let second = conn.replayed;
        let expected = system != "bare";
        if first || second != expected {
            return Err(format!("{system}: replayed {first} then {second}").into());
        }
        Ok(())
    })
}

/// The median; NaN for none (a ratio to a system that `--only` left out).
fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One keep-alive HTTP/1.1 connection.
struct Conn {
    stream: BufReader<TcpStream>,
    cookie: String,
    line: String,
    /// Whether the last answer was marked as a replay.
    replayed: bool,
}

impl Conn {
    async fn open(addr: SocketAddr) -> Result<Conn, BoxError> {
        let stream = TcpStream::connect(addr).await?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            stream: BufReader::new(stream),
            cookie: String::new(),
            line: String::new(),
            replayed: false,
        })
    }

    /// `GET /session`, keeping the session cookie for every later request.
    async fn start_session(&mut self) -> Result<(), BoxError> {
        let request = "GET /session HTTP/1.1\r\nHost: bench\r\n\r\n";
        self.stream.get_mut().write_all(request.as_bytes()).await?;
        let status = self.answer().await?;
        if status != 200 || self.cookie.is_empty() {
            return Err(format!("no session: status {status}").into());
        }
        Ok(())
    }

    /// `POST /payments` with `key`; the status.
    async fn post(&mut self, key: &str) -> Result<u16, BoxError> {
        let request = format!(
            "POST /payments HTTP/1.1\r\nHost: bench\r\nIdempotency-Key: \"{key}\"\r\n{}\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{BODY}",
            self.cookie,
            BODY.len()
        );
        self.stream.get_mut().write_all(request.as_bytes()).await?;
        self.answer().await
    }

    /// Reads one answer; its status. A `Set-Cookie` becomes the `Cookie` of later requests.
    async fn answer(&mut self) -> Result<u16, BoxError> {
        self.line.clear();
        self.stream.read_line(&mut self.line).await?;
        let status = self
            .line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut length = 0;
        self.replayed = false;
        loop {
            self.line.clear();
            if self.stream.read_line(&mut self.line).await? == 0 {
                return Err("connection closed".into());
            }
            let header = self.line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                } else if name.to_ascii_lowercase().ends_with("replayed") {
                    self.replayed = value.trim() != "false";
                } else if name.eq_ignore_ascii_case("set-cookie") {
                    let pair = value.trim().split(';').next().unwrap_or_default();
                    self.cookie = format!("Cookie: {pair}\r\n");
                }
            }
        }
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).await?;
        Ok(status)
    }
}
