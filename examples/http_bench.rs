//! HTTP benchmark of the tower layer and the actix middleware on 127.0.0.1: replays/s and
//! fresh-key POSTs/s through `IdempotencyLayer` against the same axum app without it, and
//! through `http::actix::Idempotency` against the same actix-web app without it, at 1 and 64
//! concurrent clients (keep-alive connections), plus the store's own durable claim+complete
//! pairs/s at 64 threads from the same run; medians of `--runs` (default 3), the four servers
//! measured in turn within each run.
//!
//! ```text
//! cargo run --release --example http_bench -- [--seconds S] [--runs N] [--dir PATH] [--in-memory]
//! ```
//!
//! Servers (tokio with 2 worker threads; actix-web with 2 workers) and clients share the
//! machine. The store is a file `Store` with default settings (durable: every acknowledged
//! claim and completion is synced), or with `--in-memory` one from
//! `Store::builder().open_in_memory()` (the same code, no disk). Each line also gives the CPU
//! time the layer or middleware adds per request: the process's CPU per request through it
//! less that of the bare app in the same run.
//! A replay is a POST whose key completed earlier; a fresh-key POST claims, runs the handler
//! and completes. The bare app runs its handler for every request.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use actix_web::{App, HttpResponse, HttpServer, web};
use idempotency_store::IdempotencyStore;
use idempotency_store::http::HandleOptions;
use idempotency_store::http::actix::Idempotency;
use idempotency_store::http::tower::IdempotencyLayer;
use idempotency_store::{Claim, Fingerprint, Key, Response, Store};

#[path = "support/process_cpu.rs"]
mod process_cpu;
use process_cpu::process_cpu;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

const BODY: &str = r#"{"amount": 4999, "currency": "usd", "customerId": "cus_123"}"#;
const ANSWER: &str = r#"{"id":"pay_1","amount":4999,"currency":"usd","customerId":"cus_123"}"#;

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let (mut seconds, mut runs, mut dir) = (3.0_f64, 3_usize, std::env::temp_dir());
    let mut in_memory = false;
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            println!("usage: http_bench [--seconds S] [--runs N] [--dir PATH] [--in-memory]");
            return Ok(());
        }
        if flag == "--in-memory" {
            in_memory = true;
            continue;
        }
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--seconds" => seconds = value.parse()?,
            "--runs" => runs = value.parse()?,
            "--dir" => dir = value.into(),
            other => return Err(format!("unknown option {other}").into()),
        }
    }
    let window = Duration::from_secs_f64(seconds);
    let tmp = tempfile::tempdir_in(&dir)?;
    let store = Arc::new(if in_memory {
        Store::builder().open_in_memory()?
    } else {
        Store::open(tmp.path().join("http-bench.redb"))?
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    // (framework, the bare app, the app behind the framework's idempotency middleware)
    let servers = [
        (
            "tower",
            serve(&runtime, app(None))?,
            serve(&runtime, app(Some(Arc::clone(&store))))?,
        ),
        (
            "actix",
            serve_actix(None)?,
            serve_actix(Some(Arc::clone(&store)))?,
        ),
    ];

    let mut rows = Vec::new();
    for clients in [1, 64] {
        for (workload, fresh) in [("replay", false), ("fresh", true)] {
            let mut rates = vec![(Vec::new(), Vec::new(), Vec::new()); servers.len()];
            for run in 0..runs {
                for ((name, bare, covered), (bare_rates, covered_rates, extra_cpu)) in
                    servers.iter().zip(&mut rates)
                {
                    let tag = format!("{name}-{workload}-{clients}-{run}");
                    let (rate, cpu) = drive(*bare, clients, window, fresh, &format!("b{tag}"))?;
                    bare_rates.push(rate);
                    let (rate, covered_cpu) =
                        drive(*covered, clients, window, fresh, &format!("l{tag}"))?;
                    covered_rates.push(rate);
                    extra_cpu.push(covered_cpu - cpu);
                }
            }
            for ((name, _, _), (bare_rates, covered_rates, extra_cpu)) in servers.iter().zip(rates)
            {
                let (b, l) = (median(bare_rates), median(covered_rates));
                println!(
                    "{name:<5} {workload:<7} {clients:>2} clients: bare {b:>9.0}/s  idempotent {l:>9.0}/s  ratio {:.2}  added CPU {:.1} µs/request",
                    l / b,
                    median(extra_cpu)
                );
                rows.push((*name, workload, clients, l));
            }
        }
    }
    let pairs = median(
        (0..runs)
            .map(|run| pairs_per_sec(&store, 64, window, run))
            .collect(),
    );
    println!("store pairs 64 threads: {pairs:.0}/s");
    for (name, workload, clients, l) in &rows {
        if *workload == "fresh" && *clients == 64 {
            println!(
                "{name} fresh 64 idempotent / store pairs 64: {:.2}",
                l / pairs
            );
        }
    }
    runtime.shutdown_timeout(Duration::from_secs(5));
    Ok(())
}

/// The same app with or without the layer: `POST /payments` answers 201 with a JSON body.
fn app(store: Option<Arc<Store>>) -> axum::Router {
    let router = axum::Router::new().route(
        "/payments",
        axum::routing::post(|_body: axum::body::Bytes| async {
            (
                axum::http::StatusCode::CREATED,
                [("content-type", "application/json")],
                ANSWER,
            )
        }),
    );
    match store {
        Some(store) => router.layer(IdempotencyLayer::new(store, HandleOptions::new())),
        None => router,
    }
}

fn serve(runtime: &tokio::runtime::Runtime, app: axum::Router) -> Result<SocketAddr, BoxError> {
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

/// The same app on actix-web (2 workers), with or without the middleware, served from a
/// thread of its own until the process ends.
fn serve_actix(store: Option<Arc<Store>>) -> Result<SocketAddr, BoxError> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let idempotency = store.map(|store| Idempotency::shared(store, HandleOptions::new()));
    let route = |config: &mut web::ServiceConfig| {
        config.route(
            "/payments",
            web::post().to(|_body: web::Bytes| async {
                HttpResponse::Created()
                    .content_type("application/json")
                    .body(ANSWER)
            }),
        );
    };
    let server = move || -> std::io::Result<()> {
        actix_web::rt::System::new().block_on(async move {
            match idempotency {
                Some(idempotency) => {
                    let app = move || App::new().wrap(idempotency.clone()).configure(route);
                    let server = HttpServer::new(app).workers(2).disable_signals();
                    server.listen(listener)?.run().await
                }
                None => {
                    let app = move || App::new().configure(route);
                    let server = HttpServer::new(app).workers(2).disable_signals();
                    server.listen(listener)?.run().await
                }
            }
        })
    };
    std::thread::spawn(move || {
        if let Err(err) = server() {
            eprintln!("http_bench: the actix server stopped: {err}");
        }
    });
    Ok(addr)
}

/// Requests per second from `clients` keep-alive connections over `window`, and the process's
/// CPU time per request in µs (clients and server: the same clients' share cancels out when
/// two apps are compared). Replays: each client repeats one key (completed during the
/// warm-up). Fresh: a new key per request.
fn drive(
    addr: SocketAddr,
    clients: usize,
    window: Duration,
    fresh: bool,
    tag: &str,
) -> Result<(f64, f64), BoxError> {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let counting = Arc::new(AtomicBool::new(false));
    let ready = Arc::new(Barrier::new(clients + 1));
    let threads: Vec<_> = (0..clients)
        .map(|c| {
            let (done, stop, counting, ready) = (
                Arc::clone(&done),
                Arc::clone(&stop),
                Arc::clone(&counting),
                Arc::clone(&ready),
            );
            let tag = tag.to_owned();
            std::thread::spawn(move || -> Result<(), String> {
                let mut conn = Conn::open(addr).map_err(|e| e.to_string())?;
                let replay_key = format!("{tag}-c{c}");
                conn.post(&replay_key).map_err(|e| e.to_string())?; // warm-up, and the replay's key
                ready.wait();
                for i in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        return Ok(());
                    }
                    let key = if fresh {
                        format!("{tag}-c{c}-{i}")
                    } else {
                        replay_key.clone()
                    };
                    let status = conn.post(&key).map_err(|e| e.to_string())?;
                    if status != 201 {
                        return Err(format!("status {status}"));
                    }
                    if counting.load(Ordering::Relaxed) {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Ok(())
            })
        })
        .collect();
    ready.wait();
    std::thread::sleep(Duration::from_millis(200)); // warm-up
    let cpu_before = process_cpu();
    counting.store(true, Ordering::SeqCst);
    let started = Instant::now();
    std::thread::sleep(window);
    counting.store(false, Ordering::SeqCst);
    let requests = done.load(Ordering::SeqCst) as f64;
    let rate = requests / started.elapsed().as_secs_f64();
    let cpu = process_cpu().saturating_sub(cpu_before).as_secs_f64() * 1e6 / requests.max(1.0);
    stop.store(true, Ordering::SeqCst);
    for thread in threads {
        thread.join().map_err(|_| "client panicked")??;
    }
    Ok((rate, cpu))
}

/// The store's own durable claim+complete pairs per second from `threads` threads.
fn pairs_per_sec(store: &Store, threads: usize, window: Duration, run: usize) -> f64 {
    let done = AtomicU64::new(0);
    let stop = AtomicBool::new(false);
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (done, stop) = (&done, &stop);
            s.spawn(move || {
                for i in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let Ok(key) = Key::new(&format!("pairs-{run}-{t}-{i}")) else {
                        return;
                    };
                    let fp = Fingerprint::of(["POST", "/payments", BODY]);
                    if let Ok(Claim::Acquired(lease)) = store.claim(&key, fp) {
                        let response = Response::new(201, r#"{"id":"pay_1","amount":4999}"#);
                        if store.complete(&lease, response).is_ok() {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            });
        }
        std::thread::sleep(window);
        stop.store(true, Ordering::SeqCst);
    });
    done.load(Ordering::SeqCst) as f64 / started.elapsed().as_secs_f64()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// One keep-alive HTTP/1.1 connection.
struct Conn {
    reader: BufReader<TcpStream>,
}

impl Conn {
    fn open(addr: SocketAddr) -> std::io::Result<Conn> {
        let stream = TcpStream::connect(addr)?;
        stream.set_nodelay(true)?;
        Ok(Conn {
            reader: BufReader::new(stream),
        })
    }

    /// `POST /payments` with `key`; the status.
    fn post(&mut self, key: &str) -> std::io::Result<u16> {
        let request = format!(
            "POST /payments HTTP/1.1\r\nHost: bench\r\nIdempotency-Key: \"{key}\"\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{BODY}",
            BODY.len()
        );
        self.reader.get_mut().write_all(request.as_bytes())?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status = line
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let mut length = 0;
        loop {
            line.clear();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body)?;
        Ok(status)
    }
}
