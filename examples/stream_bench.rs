//! Streamed answers through the tower layer and the actix middleware (BENCHMARKS.md, "HTTP:
//! streamed answers through the layer"):
//!
//! ```text
//! cargo run --release --example stream_bench -- [--requests N] [--dir PATH]
//! cargo run --release --example stream_bench -- --memory tower|actix
//! ```
//!
//! By default, the time to the first byte of a streamed answer (a first chunk at once, a
//! second 20 ms later) through each adapter against the same app without it, with fresh
//! keys, over an in-memory store and over a durable store file: `--requests` requests (default
//! 300) to each, strictly alternating, one connection per request; medians and 90th
//! percentiles.
//!
//! With `--memory`, one 200 MiB answer (3,200 chunks of 64 KiB, length unknown) through the
//! adapter over an in-memory store (1 MiB `max_response_bytes`), read to its end by a client
//! in the same process, then its retry (the stored 410); the process's peak RSS (`VmHWM`)
//! before and after. Run it once per process: the peak is the process's.

use std::future::Future;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_store::http::HandleOptions;
use idempotency_store::{IdempotencyStore, Store};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A body of `left` chunks, `gap` apart.
struct Chunks {
    left: usize,
    chunk: Bytes,
    gap: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl Chunks {
    fn new(count: usize, size: usize, gap: Duration) -> Chunks {
        Chunks {
            left: count,
            chunk: Bytes::from(vec![b'z'; size]),
            gap,
            sleep: None,
        }
    }

    fn poll_chunk(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        if self.left == 0 {
            return Poll::Ready(None);
        }
        if let Some(sleep) = &mut self.sleep {
            std::task::ready!(sleep.as_mut().poll(cx));
            self.sleep = None;
        }
        self.left -= 1;
        if !self.gap.is_zero() && self.left > 0 {
            self.sleep = Some(Box::pin(tokio::time::sleep(self.gap)));
        }
        Poll::Ready(Some(self.chunk.clone()))
    }
}

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::io::Result<http_body::Frame<Bytes>>>> {
        self.get_mut()
            .poll_chunk(cx)
            .map(|chunk| chunk.map(|chunk| Ok(http_body::Frame::data(chunk))))
    }
}

impl actix_web::body::MessageBody for Chunks {
    type Error = std::io::Error;

    fn size(&self) -> actix_web::body::BodySize {
        actix_web::body::BodySize::Stream
    }

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<std::io::Result<Bytes>>> {
        self.get_mut().poll_chunk(cx).map(|chunk| chunk.map(Ok))
    }
}

/// What the route answers: `count` chunks of `size` bytes, `gap` apart.
#[derive(Clone, Copy)]
struct Shape {
    count: usize,
    size: usize,
    gap: Duration,
}

/// A server on a thread of its own (stopped with the process).
fn serve(
    framework: &str,
    store: Option<Arc<dyn IdempotencyStore>>,
    shape: Shape,
    runs: Arc<AtomicUsize>,
) -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    if framework == "actix" {
        std::thread::spawn(move || actix(listener, store, shape, runs));
    } else {
        std::thread::spawn(move || tower(listener, store, shape, runs));
    }
    addr
}

fn tower(
    listener: std::net::TcpListener,
    store: Option<Arc<dyn IdempotencyStore>>,
    shape: Shape,
    runs: Arc<AtomicUsize>,
) {
    use idempotency_store::http::tower::IdempotencyLayer;
    listener.set_nonblocking(true).expect("nonblocking");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
        let route = axum::routing::post(move || {
            runs.fetch_add(1, Ordering::Relaxed);
            let body = Chunks::new(shape.count, shape.size, shape.gap);
            async move { axum::body::Body::new(body) }
        });
        let app = axum::Router::new().route("/stream", route);
        let app = match store {
            Some(store) => app.layer(IdempotencyLayer::shared(store, HandleOptions::new())),
            None => app,
        };
        axum::serve(listener, app).await.expect("serve");
    });
}

fn actix(
    listener: std::net::TcpListener,
    store: Option<Arc<dyn IdempotencyStore>>,
    shape: Shape,
    runs: Arc<AtomicUsize>,
) {
    use actix_web::middleware::Condition;
    use actix_web::{App, HttpResponse, HttpServer, web};
    use idempotency_store::http::actix::Idempotency;
    actix_web::rt::System::new().block_on(async move {
        let layered = store.is_some();
        let store =
            store.unwrap_or_else(|| Arc::new(Store::builder().open_in_memory().expect("store")));
        let idempotency = Idempotency::shared(store, HandleOptions::new());
        HttpServer::new(move || {
            let runs = Arc::clone(&runs);
            App::new()
                .wrap(Condition::new(layered, idempotency.clone()))
                .route(
                    "/stream",
                    web::post().to(move || {
                        runs.fetch_add(1, Ordering::Relaxed);
                        let body = Chunks::new(shape.count, shape.size, shape.gap);
                        async move { HttpResponse::Ok().body(body) }
                    }),
                )
        })
        .workers(2)
        .disable_signals()
        .listen(listener)
        .expect("listen")
        .run()
        .await
        .expect("serve");
    });
}

/// One POST: the status, the time to the first byte of the body, and the body's length
/// (its chunked framing included, for a streamed answer).
fn post(addr: SocketAddr, key: &str) -> (u16, Duration, usize) {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream.set_nodelay(true).expect("nodelay");
    let request = format!(
        "POST /stream HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nIdempotency-Key: \"{key}\"\r\nContent-Length: 2\r\n\r\n{{}}"
    );
    let sent = Instant::now();
    stream.write_all(request.as_bytes()).expect("send");
    let mut buffer = vec![0; 256 << 10];
    let mut head = Vec::new();
    let mut first = None;
    let mut body = 0;
    loop {
        let read = stream.read(&mut buffer).unwrap_or(0);
        if read == 0 {
            break;
        }
        if first.is_none() {
            head.extend_from_slice(&buffer[..read]);
            if let Some(at) = head.windows(4).position(|w| w == b"\r\n\r\n")
                && head.len() > at + 4
            {
                first = Some(sent.elapsed());
                body += head.len() - at - 4;
            }
        } else {
            body += read;
        }
    }
    let status = std::str::from_utf8(&head[..head.len().min(12)])
        .ok()
        .and_then(|line| line.get(9..12)?.parse().ok())
        .unwrap_or(0);
    (status, first.unwrap_or_default(), body)
}

fn peak_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find(|line| line.starts_with("VmHWM"))
        .map_or_else(|| "VmHWM: unknown".to_owned(), str::to_owned)
}

fn memory(framework: &str) {
    const CHUNKS: usize = 3200;
    const CHUNK: usize = 64 << 10;
    let runs = Arc::new(AtomicUsize::new(0));
    let store: Arc<dyn IdempotencyStore> =
        Arc::new(Store::builder().open_in_memory().expect("store"));
    let shape = Shape {
        count: CHUNKS,
        size: CHUNK,
        gap: Duration::ZERO,
    };
    let addr = serve(framework, Some(store), shape, Arc::clone(&runs));
    std::thread::sleep(Duration::from_millis(300));
    println!("{framework}: before the stream, {}", peak_rss());
    let started = Instant::now();
    let (status, _, body) = post(addr, "big-stream");
    let took = started.elapsed();
    let (retry, _, _) = post(addr, "big-stream");
    println!(
        "{framework}: {status}, {:.1} MiB read (chunked framing included) in {took:.2?}; retry {retry}; handler runs {}",
        body as f64 / f64::from(1 << 20),
        runs.load(Ordering::Relaxed)
    );
    println!("{framework}: after the stream, {}", peak_rss());
}

fn quantile(sorted: &[Duration], q: f64) -> Duration {
    let at = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[at.min(sorted.len() - 1)]
}

fn ttfb(requests: usize, dir: &std::path::Path) {
    let shape = Shape {
        count: 2,
        size: 64,
        gap: Duration::from_millis(20),
    };
    for (kind, file) in [("in-memory store", false), ("store file", true)] {
        for framework in ["tower", "actix"] {
            let store: Arc<dyn IdempotencyStore> = if file {
                let path = dir.join(format!(
                    "stream-bench-{framework}-{}.redb",
                    std::process::id()
                ));
                let _ = std::fs::remove_file(&path);
                Arc::new(Store::open(&path).expect("store file"))
            } else {
                Arc::new(Store::builder().open_in_memory().expect("store"))
            };
            let runs = Arc::new(AtomicUsize::new(0));
            let bare = serve(framework, None, shape, Arc::clone(&runs));
            let layered = serve(framework, Some(store), shape, Arc::clone(&runs));
            std::thread::sleep(Duration::from_millis(300));
            let (mut through_bare, mut through_layer) = (Vec::new(), Vec::new());
            for i in 0..requests + 20 {
                let (status_bare, at_bare, _) = post(bare, &format!("warm-{i}"));
                let (status, at, _) = post(layered, &format!("fresh-{i}"));
                assert_eq!((status_bare, status), (200, 200), "both answer 200");
                if i >= 20 {
                    through_bare.push(at_bare);
                    through_layer.push(at);
                }
            }
            through_bare.sort();
            through_layer.sort();
            let (bare_median, median) =
                (quantile(&through_bare, 0.5), quantile(&through_layer, 0.5));
            println!(
                "{framework}, {kind}: time to first byte, median {median:.2?} through the adapter, {bare_median:.2?} bare \
                 (+{:.2?}); p90 {:.2?} / {:.2?}; {requests} requests each",
                median.saturating_sub(bare_median),
                quantile(&through_layer, 0.9),
                quantile(&through_bare, 0.9),
            );
        }
    }
}

fn main() -> Result<(), BoxError> {
    let mut args = std::env::args().skip(1);
    let (mut requests, mut dir) = (300_usize, std::env::temp_dir());
    while let Some(flag) = args.next() {
        if flag == "-h" || flag == "--help" {
            println!("usage: stream_bench [--requests N] [--dir PATH] | --memory tower|actix");
            return Ok(());
        }
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--memory" => {
                memory(&value);
                return Ok(());
            }
            "--requests" => requests = value.parse()?,
            "--dir" => dir = value.into(),
            other => return Err(format!("unknown flag {other}").into()),
        }
    }
    ttfb(requests, &dir);
    Ok(())
}
