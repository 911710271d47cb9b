//! Streamed answers through both async forms (issue 57), over real TCP: axum behind
//! `IdempotencyLayer` and actix-web behind `Idempotency`, each case once per framework as
//! `tower_layer::CASE` and `actix_middleware::CASE`:
//!
//! - server-sent events (5 events, 400 ms apart) reach the client live: its first event within
//!   100 ms of the bare app's (measured in the same test), and the retry replays the stream
//!   byte for byte;
//! - a 3 MiB answer (over the store's 1 MiB) reaches its client whole with the handler's own
//!   status; the retry gets the stored 410 "completed, not stored", and the handler ran once;
//! - a client that hangs up after the first event, and retries 3 s later, gets the whole
//!   stream replayed, from one run;
//! - a stream that fails after two events: the client gets those two and a cut connection;
//!   the retry gets the stored 500 "response not stored", from one run;
//! - a duplicate while the stream runs: 409 after its `wait`, the handler not run again.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use idempotency_store::http::{HandleOptions, problem_type};
use idempotency_store::{IdempotencyStore, Store};
use tokio::sync::mpsc;

use crate::adapters::{self, Server};

const EVENTS: usize = 5;
const GAP: Duration = Duration::from_millis(400);
const BIG: usize = 3 << 20;

/// The handler runs, per route.
#[derive(Debug, Default)]
struct Runs {
    events: AtomicUsize,
    failing: AtomicUsize,
    big: AtomicUsize,
}

/// A stream of `EVENTS` server-sent events `GAP` apart, produced on a task of its own; with
/// `fails_at`, that event is an error instead.
fn events(run: usize, fails_at: Option<usize>) -> Events {
    let (sender, events) = mpsc::channel(1);
    tokio::spawn(async move {
        for n in 1..=EVENTS {
            tokio::time::sleep(GAP).await;
            let event = if fails_at == Some(n) {
                Err(io::Error::other("the upstream failed"))
            } else {
                Ok(Bytes::from(format!("data: run {run} event {n}\n\n")))
            };
            let failed = event.is_err();
            if sender.send(event).await.is_err() || failed {
                return;
            }
        }
    });
    Events(events)
}

/// The events as a body of either framework.
struct Events(mpsc::Receiver<io::Result<Bytes>>);

impl http_body::Body for Events {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<io::Result<http_body::Frame<Bytes>>>> {
        self.0
            .poll_recv(cx)
            .map(|event| event.map(|event| event.map(http_body::Frame::data)))
    }
}

impl actix_web::body::MessageBody for Events {
    type Error = io::Error;

    fn size(&self) -> actix_web::body::BodySize {
        actix_web::body::BodySize::Stream
    }

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<io::Result<Bytes>>> {
        self.0.poll_recv(cx)
    }
}

fn count(runs: &AtomicUsize) -> usize {
    runs.fetch_add(1, Ordering::SeqCst) + 1
}

/// Which framework, with the idempotency middleware or bare.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framework {
    Tower,
    Actix,
}

fn start(
    framework: Framework,
    store: Option<Arc<dyn IdempotencyStore>>,
    runs: &Arc<Runs>,
) -> Server {
    match framework {
        Framework::Tower => tower_server(store, Arc::clone(runs)),
        Framework::Actix => actix_server(store, Arc::clone(runs)),
    }
}

fn tower_server(store: Option<Arc<dyn IdempotencyStore>>, runs: Arc<Runs>) -> Server {
    use axum::http::{StatusCode, header};
    use idempotency_store::http::tower::IdempotencyLayer;

    adapters::tower::serve(move || {
        let sse = || [(header::CONTENT_TYPE, "text/event-stream")];
        let (on_events, on_failing, on_big) =
            (Arc::clone(&runs), Arc::clone(&runs), Arc::clone(&runs));
        let app = axum::Router::new()
            .route(
                "/events",
                axum::routing::post(move || {
                    let run = count(&on_events.events);
                    async move { (sse(), axum::body::Body::new(events(run, None))) }
                }),
            )
            .route(
                "/failing",
                axum::routing::post(move || {
                    let run = count(&on_failing.failing);
                    async move { (sse(), axum::body::Body::new(events(run, Some(3)))) }
                }),
            )
            .route(
                "/big",
                axum::routing::post(move || {
                    count(&on_big.big);
                    async { (StatusCode::CREATED, vec![b'y'; BIG]) }
                }),
            );
        match store {
            Some(store) => app.layer(IdempotencyLayer::shared(store, HandleOptions::new())),
            None => app,
        }
    })
}

fn actix_server(store: Option<Arc<dyn IdempotencyStore>>, runs: Arc<Runs>) -> Server {
    use actix_web::middleware::Condition;
    use actix_web::{App, HttpResponse, HttpServer, web};
    use idempotency_store::http::actix::Idempotency;

    adapters::actix::serve(move |listener| {
        let layered = store.is_some();
        let store =
            store.unwrap_or_else(|| Arc::new(Store::builder().open_in_memory().expect("store")));
        let idempotency = Idempotency::shared(store, HandleOptions::new());
        HttpServer::new(move || {
            let (on_events, on_failing, on_big) =
                (Arc::clone(&runs), Arc::clone(&runs), Arc::clone(&runs));
            App::new()
                .wrap(Condition::new(layered, idempotency.clone()))
                .route(
                    "/events",
                    web::post().to(move || {
                        let run = count(&on_events.events);
                        async move {
                            HttpResponse::Ok()
                                .content_type("text/event-stream")
                                .body(events(run, None))
                        }
                    }),
                )
                .route(
                    "/failing",
                    web::post().to(move || {
                        let run = count(&on_failing.failing);
                        async move {
                            HttpResponse::Ok()
                                .content_type("text/event-stream")
                                .body(events(run, Some(3)))
                        }
                    }),
                )
                .route(
                    "/big",
                    web::post().to(move || {
                        count(&on_big.big);
                        async { HttpResponse::Created().body(vec![b'y'; BIG]) }
                    }),
                )
        })
        .workers(2)
        .disable_signals()
        .listen(listener)
        .expect("listen")
        .run()
    })
}

/// An answer as the client read it.
#[derive(Debug)]
struct Got {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// From the request sent to the first `data:` of the body.
    first_event: Option<Duration>,
    /// Whether the body arrived to its end (a last chunk, or its `Content-Length`).
    whole: bool,
}

impl Got {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn problem_type(&self) -> String {
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap_or_default();
        json["type"].as_str().unwrap_or_default().to_owned()
    }
}

/// `POST path` with `key`, read as it arrives; with `hang_up`, the connection is dropped
/// once the first event is in.
fn post(addr: SocketAddr, path: &str, key: Option<&str>, hang_up: bool) -> Got {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let key = key.map_or_else(String::new, |key| format!("Idempotency-Key: \"{key}\"\r\n"));
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n{key}Content-Length: 2\r\n\r\n{{}}"
    );
    let sent = Instant::now();
    stream.write_all(request.as_bytes()).expect("send");
    let mut raw = Vec::new();
    let mut buffer = vec![0; 64 << 10];
    let mut first_event = None;
    let mut head_end = None;
    loop {
        let read = match stream.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        raw.extend_from_slice(&buffer[..read]);
        if head_end.is_none() {
            head_end = find(&raw, b"\r\n\r\n").map(|at| at + 4);
        }
        if let Some(at) = head_end
            && first_event.is_none()
            && find(&raw[at..], b"data:").is_some()
        {
            first_event = Some(sent.elapsed());
            if hang_up {
                break;
            }
        }
    }
    let at = head_end.expect("an answer's head");
    let head = String::from_utf8_lossy(&raw[..at]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|status| status.parse().ok())
        .expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut got = Got {
        status,
        headers,
        body: Vec::new(),
        first_event,
        whole: false,
    };
    let rest = &raw[at..];
    if got.header("transfer-encoding") == Some("chunked") {
        (got.body, got.whole) = dechunk(rest);
    } else if let Some(length) = got
        .header("content-length")
        .and_then(|v| v.parse::<usize>().ok())
    {
        got.whole = rest.len() == length;
        got.body = rest.to_vec();
    } else {
        got.body = rest.to_vec();
    }
    got
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// A chunked body's bytes, and whether its last chunk came.
fn dechunk(mut rest: &[u8]) -> (Vec<u8>, bool) {
    let mut body = Vec::new();
    loop {
        let Some(line) = find(rest, b"\r\n") else {
            return (body, false);
        };
        let size = std::str::from_utf8(&rest[..line])
            .ok()
            .and_then(|size| usize::from_str_radix(size.split(';').next()?.trim(), 16).ok());
        let Some(size) = size else {
            return (body, false);
        };
        rest = &rest[line + 2..];
        if size == 0 {
            return (body, true);
        }
        if rest.len() < size + 2 {
            body.extend_from_slice(&rest[..size.min(rest.len())]);
            return (body, false);
        }
        body.extend_from_slice(&rest[..size]);
        rest = &rest[size + 2..];
    }
}

fn store() -> Arc<dyn IdempotencyStore> {
    Arc::new(Store::builder().open_in_memory().expect("store"))
}

/// A server of `framework` behind its idempotency middleware over a store in memory, and its
/// handlers' runs.
fn serve(framework: Framework) -> (Arc<Runs>, Server) {
    let runs = Arc::new(Runs::default());
    let server = start(framework, Some(store()), &runs);
    (runs, server)
}

/// `POST path` with `key` again, read to its end: a replay with `status`.
fn replay(framework: Framework, addr: SocketAddr, path: &str, key: &str, status: u16) -> Got {
    let retry = post(addr, path, Some(key), false);
    assert_eq!(
        (retry.status, retry.replayed()),
        (status, true),
        "{framework:?}: {retry:?}"
    );
    retry
}

fn all_events(run: usize) -> Vec<u8> {
    (1..=EVENTS)
        .map(|n| format!("data: run {run} event {n}\n\n"))
        .collect::<String>()
        .into_bytes()
}

fn server_sent_events_arrive_live_and_replay_byte_for_byte(framework: Framework) {
    let bare_runs = Arc::new(Runs::default());
    let bare = start(framework, None, &bare_runs);
    let bare_first = post(bare.addr, "/events", None, false);
    drop(bare);
    let (runs, server) = serve(framework);
    let first = post(server.addr, "/events", Some("sse"), false);
    let (bare_at, at) = (
        bare_first.first_event.expect("the bare app's first event"),
        first.first_event.expect("the first event"),
    );
    assert!(
        at <= bare_at + Duration::from_millis(100),
        "{framework:?}: first event after {at:?} through the layer, {bare_at:?} bare"
    );
    assert_eq!(first.status, 200, "{framework:?}: {first:?}");
    assert!(first.whole, "{framework:?}: {first:?}");
    assert_eq!(first.body, all_events(1), "{framework:?}");
    assert_eq!(first.header("content-type"), Some("text/event-stream"));
    let retry = replay(framework, server.addr, "/events", "sse", 200);
    assert!(retry.whole, "{framework:?}");
    assert_eq!(
        retry.body, first.body,
        "{framework:?}: the replay is byte for byte"
    );
    assert_eq!(retry.header("content-type"), Some("text/event-stream"));
    assert_eq!(runs.events.load(Ordering::SeqCst), 1, "{framework:?}");
}

fn a_large_answer_reaches_its_client_whole_and_the_retry_is_told_it_was_done(framework: Framework) {
    let (runs, server) = serve(framework);
    let first = post(server.addr, "/big", Some("big"), false);
    assert_eq!(first.status, 201, "{framework:?}: the handler's own status");
    assert!(first.whole, "{framework:?}");
    assert_eq!(first.body.len(), BIG, "{framework:?}");
    assert!(first.body.iter().all(|&b| b == b'y'), "{framework:?}");
    assert!(!first.replayed(), "{framework:?}");
    let mut retries = Vec::new();
    for _ in 0..2 {
        let retry = replay(framework, server.addr, "/big", "big", 410);
        assert_eq!(retry.problem_type(), problem_type::COMPLETED_NOT_STORED);
        let detail = String::from_utf8_lossy(&retry.body).into_owned();
        assert!(detail.contains("answered 201"), "{framework:?}: {detail}");
        retries.push(retry.body);
    }
    assert_eq!(
        retries[0], retries[1],
        "{framework:?}: the same stored answer"
    );
    assert_eq!(runs.big.load(Ordering::SeqCst), 1, "{framework:?}");
}

fn a_client_that_hangs_up_mid_stream_gets_the_whole_stream_on_retry(framework: Framework) {
    let (runs, server) = serve(framework);
    let first = post(server.addr, "/events", Some("gone"), true);
    assert_eq!(first.status, 200, "{framework:?}");
    assert!(
        !first.whole,
        "{framework:?}: it hung up after the first event"
    );
    std::thread::sleep(Duration::from_secs(3));
    let retry = replay(framework, server.addr, "/events", "gone", 200);
    assert!(retry.whole, "{framework:?}");
    assert_eq!(
        retry.body,
        all_events(1),
        "{framework:?}: the whole stream, replayed"
    );
    assert_eq!(runs.events.load(Ordering::SeqCst), 1, "{framework:?}");
}

fn a_stream_that_fails_mid_way_is_cut_and_never_rerun(framework: Framework) {
    let (runs, server) = serve(framework);
    let first = post(server.addr, "/failing", Some("broken"), false);
    assert_eq!(first.status, 200, "{framework:?}: {first:?}");
    let two: Vec<u8> = all_events(1)
        .split_inclusive(|&b| b == b'\n')
        .take(4)
        .flatten()
        .copied()
        .collect();
    assert_eq!(
        first.body, two,
        "{framework:?}: the two events before the failure"
    );
    assert!(
        !first.whole,
        "{framework:?}: the connection is cut, not ended"
    );
    for _ in 0..2 {
        let retry = replay(framework, server.addr, "/failing", "broken", 500);
        assert_eq!(
            retry.problem_type(),
            problem_type::NOT_STORED,
            "{framework:?}"
        );
    }
    assert_eq!(runs.failing.load(Ordering::SeqCst), 1, "{framework:?}");
}

fn a_duplicate_while_the_stream_runs_gets_409_and_runs_nothing(framework: Framework) {
    let (runs, server) = serve(framework);
    let addr = server.addr;
    let first = std::thread::spawn(move || post(addr, "/events", Some("busy"), false));
    std::thread::sleep(GAP + GAP / 2);
    let duplicate = post(addr, "/events", Some("busy"), false);
    assert_eq!(duplicate.status, 409, "{framework:?}: {duplicate:?}");
    assert_eq!(duplicate.problem_type(), problem_type::IN_PROGRESS);
    assert!(duplicate.header("retry-after").is_some(), "{framework:?}");
    let first = first.join().expect("the first client");
    assert!(first.whole, "{framework:?}: the first stream went on");
    assert_eq!(first.body, all_events(1), "{framework:?}");
    assert_eq!(runs.events.load(Ordering::SeqCst), 1, "{framework:?}");
}

/// Each case as a test of its own per framework.
macro_rules! for_each_framework {
    ($($case:ident),* $(,)?) => {
        mod tower_layer {
            $(#[test] fn $case() { super::$case(super::Framework::Tower) })*
        }
        mod actix_middleware {
            $(#[test] fn $case() { super::$case(super::Framework::Actix) })*
        }
    };
}

for_each_framework!(
    server_sent_events_arrive_live_and_replay_byte_for_byte,
    a_large_answer_reaches_its_client_whole_and_the_retry_is_told_it_was_done,
    a_client_that_hangs_up_mid_stream_gets_the_whole_stream_on_retry,
    a_stream_that_fails_mid_way_is_cut_and_never_rerun,
    a_duplicate_while_the_stream_runs_gets_409_and_runs_nothing,
);
