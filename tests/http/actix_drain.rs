//! The actix middleware's drain at shutdown (issue 57): actix-web over real TCP, the drain run
//! as the server's shutdown signal, before its workers stop. The operations in flight when it
//! begins (their clients gone) finish and are stored, or, past the deadline, are stopped and
//! their keys released (or given "outcome unknown"): none is left in progress. A client still
//! connected gets its answer, and a new request meanwhile gets 503.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use actix_web::{App, HttpResponse, HttpServer, web};
use idempotency_store::http::actix::{DrainReport, Idempotency};
use idempotency_store::http::{HandleOptions, Takeover, problem_type};
use idempotency_store::{IdempotencyStore, Key, RecordState, Store};

use crate::drain_support::{durable_store, states, wait_for_runs};

/// What the handler saw: how many runs started and finished.
struct Ledger {
    started: AtomicUsize,
    finished: AtomicUsize,
    /// Opened by a test: every handler still sleeping finishes at once.
    gate: tokio::sync::watch::Sender<bool>,
}

struct Server {
    addr: std::net::SocketAddr,
    ledger: Arc<Ledger>,
    /// Starts the shutdown: the drain with this deadline, then the server's graceful stop.
    stop: Option<tokio::sync::oneshot::Sender<Duration>>,
    report: std::sync::mpsc::Receiver<DrainReport>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// actix-web with two workers, whose `POST /payments` takes `delay` (or until the gate
    /// opens), behind the middleware; the drain is its shutdown signal.
    fn start(store: Arc<dyn IdempotencyStore>, options: HandleOptions, delay: Duration) -> Self {
        let ledger = Arc::new(Ledger {
            started: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            gate: tokio::sync::watch::channel(false).0,
        });
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<Duration>();
        let (reported, report) = std::sync::mpsc::channel();
        let app_ledger = Arc::clone(&ledger);
        let thread = std::thread::spawn(move || {
            actix_web::rt::System::new().block_on(async move {
                let idempotency = Idempotency::shared(store, options);
                let drain = idempotency.drain_handle();
                let server = HttpServer::new(move || {
                    let ledger = Arc::clone(&app_ledger);
                    let create = move || {
                        let ledger = Arc::clone(&ledger);
                        async move {
                            let n = ledger.started.fetch_add(1, Ordering::SeqCst) + 1;
                            let mut gate = ledger.gate.subscribe();
                            tokio::select! {
                                () = tokio::time::sleep(delay) => {}
                                _ = gate.wait_for(|open| *open) => {}
                            }
                            ledger.finished.fetch_add(1, Ordering::SeqCst);
                            HttpResponse::Created().body(format!("charge {n}"))
                        }
                    };
                    App::new()
                        .wrap(idempotency.clone())
                        .route("/payments", web::post().to(create))
                })
                .workers(2)
                .shutdown_signal(async move {
                    if let Ok(deadline) = stopped.await {
                        let _ = reported.send(drain.finish(deadline).await);
                    }
                })
                .listen(listener)
                .expect("listen");
                server.run().await.expect("serve");
            });
        });
        Server {
            addr,
            ledger,
            stop: Some(stop),
            report,
            thread: Some(thread),
        }
    }

    /// Starts the shutdown with the drain's `deadline`, waits for the server to stop and
    /// returns the drain's report.
    fn shut_down(&mut self, deadline: Duration) -> DrainReport {
        self.begin_shutdown(deadline);
        self.stopped()
    }

    fn begin_shutdown(&mut self, deadline: Duration) {
        let stop = self.stop.take().expect("running");
        stop.send(deadline).expect("the server is running");
    }

    /// Waits for the server to stop; the drain's report.
    fn stopped(&mut self) -> DrainReport {
        let thread = self.thread.take().expect("running");
        thread.join().expect("the server's thread");
        self.report
            .recv_timeout(Duration::from_secs(5))
            .expect("the drain's report")
    }
}

/// A request for `key` on a connection of its own.
fn send(addr: std::net::SocketAddr, key: &str) -> std::net::TcpStream {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    let head = format!(
        "POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: \"{key}\"\r\n\
         Content-Length: 2\r\nConnection: close\r\n\r\n{{}}"
    );
    stream.write_all(head.as_bytes()).expect("send");
    stream
}

/// The whole answer on `stream` (the request asked to close the connection after it).
fn read_answer(mut stream: std::net::TcpStream) -> String {
    use std::io::Read;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("answer");
    answer
}

/// Sends `count` requests, waits until every handler runs, then hangs up on all of them.
fn start_in_flight(server: &Server, prefix: &str, count: usize) {
    let streams: Vec<_> = (0..count)
        .map(|i| send(server.addr, &format!("{prefix}-{i}")))
        .collect();
    wait_for_runs(&server.ledger.started, count);
    drop(streams);
}

/// A server over a store on a file in `dir` whose handlers take 60 s (or until the gate opens).
fn on_a_file(dir: &tempfile::TempDir) -> (Arc<Store>, Server) {
    let store = durable_store(dir, Duration::from_secs(10));
    let server = Server::start(
        Arc::clone(&store) as Arc<dyn IdempotencyStore>,
        HandleOptions::new(),
        Duration::from_secs(60),
    );
    (store, server)
}

#[test]
fn a_drain_lets_fifty_operations_in_flight_finish_and_answers_the_client_still_waiting() {
    let dir = tempfile::tempdir().expect("dir");
    let (store, mut server) = on_a_file(&dir);
    start_in_flight(&server, "drain", 50);
    // One more whose client waits for the answer through the shutdown.
    let waiting = send(server.addr, "waiting");
    wait_for_runs(&server.ledger.started, 51);
    server.begin_shutdown(Duration::from_secs(20));
    // A new payment while the drain runs is refused, its key untouched.
    std::thread::sleep(Duration::from_millis(100));
    let refused = read_answer(send(server.addr, "late"));
    // The handlers finish 300 ms into the drain, well before its deadline.
    std::thread::sleep(Duration::from_millis(200));
    server.ledger.gate.send_replace(true);
    let answer = read_answer(waiting);
    let report = server.stopped();
    println!("{report:?}");
    assert_eq!((report.in_flight, report.finished), (51, 51), "{report:?}");
    assert_eq!((report.stopped, report.left_in_progress), (0, 0));
    assert_eq!(states(&store, "drain", 50), (50, 0, 0));
    assert_eq!(server.ledger.finished.load(Ordering::SeqCst), 51);
    assert!(answer.starts_with("HTTP/1.1 201"), "{answer}");
    assert!(answer.contains("charge "), "{answer}");
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(refused.contains(problem_type::UNAVAILABLE), "{refused}");
    assert!(
        refused.to_ascii_lowercase().contains("retry-after: 1\r\n"),
        "{refused}"
    );
    let late = Key::new("late").expect("key");
    assert!(store.lookup(&late).expect("lookup").is_none());
}

#[test]
fn a_drain_past_its_deadline_stops_the_operations_and_releases_their_keys() {
    let dir = tempfile::tempdir().expect("dir");
    let (store, mut server) = on_a_file(&dir);
    start_in_flight(&server, "cut", 50);
    let started = Instant::now();
    let report = server.shut_down(Duration::from_millis(300));
    let took = started.elapsed();
    println!("{report:?} in {took:?}");
    assert_eq!((report.in_flight, report.stopped), (50, 50), "{report:?}");
    assert_eq!((report.finished, report.left_in_progress), (0, 0));
    // Released: the retry runs afresh, at another instance or after the restart.
    assert_eq!(states(&store, "cut", 50), (0, 0, 50));
    assert_eq!(server.ledger.finished.load(Ordering::SeqCst), 0);
    // Not the handlers' 60 s, nor actix's 30 s shutdown timeout.
    assert!(took < Duration::from_secs(15), "{took:?}");
}

#[test]
fn a_drain_with_answer_unknown_stores_the_unknown_outcome() {
    let store = Arc::new(Store::builder().open_in_memory().expect("store"));
    let options = HandleOptions::new().takeover(Takeover::AnswerUnknown);
    let mut server = Server::start(
        Arc::clone(&store) as Arc<dyn IdempotencyStore>,
        options,
        Duration::from_secs(60),
    );
    start_in_flight(&server, "unknown", 5);
    let report = server.shut_down(Duration::from_millis(200));
    assert_eq!(
        (report.stopped, report.left_in_progress),
        (5, 0),
        "{report:?}"
    );
    assert_eq!(states(&store, "unknown", 5), (5, 0, 0));
    let key = Key::new("unknown-0").expect("key");
    let Some(RecordState::Completed { response, .. }) =
        store.lookup(&key).expect("lookup").map(|r| r.state)
    else {
        panic!("not completed");
    };
    assert_eq!(response.status, 500);
    assert!(String::from_utf8_lossy(&response.body).contains(problem_type::OUTCOME_UNKNOWN));
}
