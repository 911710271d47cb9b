//! The answer outlives the connection: through the tower layer (axum over real TCP), a client
//! that times out and retries gets the one result; a shutdown settles what is in flight; a
//! live operation is never taken over; and the layer speaks real clients' conventions.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use idempotency_store::http::tower::{Drain, DrainReport, IdempotencyLayer};
use idempotency_store::http::{FingerprintPolicy, HandleOptions, Problem, Takeover, problem_type};
use idempotency_store::{Claim, IdempotencyStore, Key, RecordState, Store};
use parking_lot::Mutex;

use crate::drain_support::{durable_store, states, wait_for_runs};

/// What the handler saw: how many runs started and finished, and when the last one finished.
struct Ledger {
    started: AtomicUsize,
    finished: AtomicUsize,
    finished_at: Mutex<Option<Instant>>,
    attempts: Mutex<Vec<u32>>,
    /// Opened by a test: every handler still sleeping finishes at once.
    gate: tokio::sync::watch::Sender<bool>,
}

impl Default for Ledger {
    fn default() -> Self {
        Ledger {
            started: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            finished_at: Mutex::new(None),
            attempts: Mutex::new(Vec::new()),
            gate: tokio::sync::watch::channel(false).0,
        }
    }
}

struct Server {
    addr: std::net::SocketAddr,
    ledger: Arc<Ledger>,
    drain: Drain,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<()>>,
    runtime: tokio::runtime::Runtime,
}

impl Server {
    /// An axum app whose `POST /payments` takes `delay`, behind the layer.
    fn start(store: Arc<dyn IdempotencyStore>, options: HandleOptions, delay: Duration) -> Self {
        let ledger = Arc::new(Ledger::default());
        let layer = IdempotencyLayer::shared(store, options);
        let drain = layer.drain_handle();
        let app_ledger = Arc::clone(&ledger);
        let app = axum::Router::new()
            .route(
                "/payments",
                axum::routing::post(move |request: axum::extract::Request| {
                    let ledger = Arc::clone(&app_ledger);
                    async move {
                        let attempt = request
                            .extensions()
                            .get::<idempotency_store::http::LeaseWatch>()
                            .map_or(0, |watch| watch.attempt());
                        ledger.attempts.lock().push(attempt);
                        let n = ledger.started.fetch_add(1, Ordering::SeqCst) + 1;
                        let mut gate = ledger.gate.subscribe();
                        tokio::select! {
                            () = tokio::time::sleep(delay) => {}
                            _ = gate.wait_for(|open| *open) => {}
                        }
                        ledger.finished.fetch_add(1, Ordering::SeqCst);
                        *ledger.finished_at.lock() = Some(Instant::now());
                        (axum::http::StatusCode::CREATED, format!("charge {n}"))
                    }
                }),
            )
            .layer(layer);
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let served = runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await
                .expect("serve");
        });
        Server {
            addr,
            ledger,
            drain,
            stop: Some(stop),
            served: Some(served),
            runtime,
        }
    }

    /// Stops taking connections, waits for the server, then drains the layer.
    fn shut_down(&mut self, deadline: Duration) -> DrainReport {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let served = self.served.take().expect("running");
        let drain = self.drain.clone();
        self.runtime.block_on(async move {
            served.await.expect("server task");
            drain.finish(deadline).await
        })
    }
}

struct Reply {
    status: u16,
    headers: ::http::HeaderMap,
    body: String,
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into()
}

fn post(
    agent: &ureq::Agent,
    addr: std::net::SocketAddr,
    key: &str,
    extra: &[(&str, &str)],
    body: &str,
) -> Result<Reply, ureq::Error> {
    let mut request = ::http::Request::post(format!("http://{addr}/payments"))
        .header("idempotency-key", format!("\"{key}\""));
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let mut answer = agent.run(request.body(body.as_bytes()).expect("request"))?;
    Ok(Reply {
        status: answer.status().as_u16(),
        headers: answer.headers().clone(),
        body: answer.body_mut().read_to_string()?,
    })
}

/// Retries `key` as a client with `timeout` would, until an answer other than 409 or a
/// timeout, or `give_up`; the answer and when it came.
fn retry_until_answered(
    server: &Server,
    key: &str,
    timeout: Duration,
    give_up: Duration,
) -> (Reply, Instant, usize) {
    let agent = agent(timeout);
    let deadline = Instant::now() + give_up;
    let mut tries = 0;
    loop {
        tries += 1;
        match post(&agent, server.addr, key, &[], "{\"amount\":4999}") {
            Ok(reply) if reply.status != 409 => return (reply, Instant::now(), tries),
            Ok(_) | Err(_) => {}
        }
        assert!(
            Instant::now() < deadline,
            "{key}: no answer after {tries} tries"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_client_that_times_out_gets_the_one_answer_on_its_retry() {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable_store(&dir, Duration::from_secs(10));
    let server = Server::start(store, HandleOptions::new(), Duration::from_millis(2500));
    let (reply, answered_at, tries) = retry_until_answered(
        &server,
        "timeout-1",
        Duration::from_secs(1),
        Duration::from_secs(10),
    );
    assert_eq!(reply.status, 201, "{}", reply.body);
    assert_eq!(reply.body, "charge 1");
    assert_eq!(reply.headers["idempotent-replayed"], "true");
    assert_eq!(server.ledger.started.load(Ordering::SeqCst), 1, "ran twice");
    let finished_at = server.ledger.finished_at.lock().expect("the run finished");
    let late = answered_at.saturating_duration_since(finished_at);
    println!("answered {late:?} after the handler finished, after {tries} tries");
    assert!(
        late <= Duration::from_millis(500),
        "answered {late:?} after the run"
    );
}

#[test]
fn a_live_operation_longer_than_its_lease_runs_once_for_a_client_that_gives_up() {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable_store(&dir, Duration::from_secs(3));
    let server = Server::start(store, HandleOptions::new(), Duration::from_secs(5));
    let (reply, _, tries) = retry_until_answered(
        &server,
        "long-1",
        Duration::from_secs(1),
        Duration::from_secs(12),
    );
    assert_eq!((reply.status, reply.body.as_str()), (201, "charge 1"));
    assert_eq!(
        server.ledger.started.load(Ordering::SeqCst),
        1,
        "taken over while alive"
    );
    println!("one run of 5 s on a 3 s lease; the client tried {tries} times");
}

/// Sends `count` requests, waits until every handler runs, then hangs up on all of them.
fn start_in_flight(server: &Server, prefix: &str, count: usize) {
    use std::io::Write;
    let streams: Vec<std::net::TcpStream> = (0..count)
        .map(|i| {
            let mut stream = std::net::TcpStream::connect(server.addr).expect("connect");
            let head = format!(
                "POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: \"{prefix}-{i}\"\r\n\
                 Content-Length: 2\r\n\r\n{{}}"
            );
            stream.write_all(head.as_bytes()).expect("send");
            stream
        })
        .collect();
    wait_for_runs(&server.ledger.started, count);
    drop(streams);
}

#[test]
fn a_graceful_shutdown_settles_all_fifty_operations_in_flight() {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable_store(&dir, Duration::from_secs(10));
    // They finish within the deadline (their gate opens 300 ms into the drain): each is
    // completed.
    let mut server = Server::start(
        Arc::clone(&store) as Arc<dyn IdempotencyStore>,
        HandleOptions::new(),
        Duration::from_secs(60),
    );
    start_in_flight(&server, "drain", 50);
    let ledger = Arc::clone(&server.ledger);
    let opener = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        ledger.gate.send_replace(true);
    });
    let report = server.shut_down(Duration::from_secs(20));
    opener.join().expect("opener");
    println!("{report:?}");
    assert_eq!((report.in_flight, report.finished), (50, 50), "{report:?}");
    assert_eq!(report.left_in_progress, 0);
    assert_eq!(states(&store, "drain", 50), (50, 0, 0));
    assert_eq!(server.ledger.finished.load(Ordering::SeqCst), 50);

    // They outlast the deadline: each is stopped and its key released (the retry runs afresh).
    let mut server = Server::start(
        Arc::clone(&store) as Arc<dyn IdempotencyStore>,
        HandleOptions::new(),
        Duration::from_secs(60),
    );
    start_in_flight(&server, "cut", 50);
    let report = server.shut_down(Duration::from_millis(300));
    println!("{report:?}");
    assert_eq!((report.in_flight, report.stopped), (50, 50), "{report:?}");
    assert_eq!(report.left_in_progress, 0);
    assert_eq!(states(&store, "cut", 50), (0, 0, 50));
    assert_eq!(server.ledger.finished.load(Ordering::SeqCst), 0);
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
    assert_eq!((report.stopped, report.left_in_progress), (5, 0));
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

#[test]
fn a_takeover_reruns_by_default_and_answers_outcome_unknown_when_asked() {
    for takeover in [Takeover::Rerun, Takeover::AnswerUnknown] {
        let store = Arc::new(
            Store::builder()
                .lease(Duration::from_millis(300))
                .open_in_memory()
                .expect("store"),
        );
        // An attempt that crashed: claimed, never settled, its lease left to lapse.
        let key = Key::new("crashed").expect("key");
        let body = "{\"amount\":4999}";
        let request = ::http::Request::post("/payments")
            .body(body.as_bytes().to_vec())
            .expect("request");
        let fingerprint = idempotency_store::http::fingerprint(&request);
        let Claim::Acquired(lease) = store.claim(&key, fingerprint).expect("claim") else {
            panic!("not acquired");
        };
        drop(lease);
        std::thread::sleep(Duration::from_millis(400));
        let options = HandleOptions::new().takeover(takeover);
        let server = Server::start(
            Arc::clone(&store) as Arc<dyn IdempotencyStore>,
            options,
            Duration::ZERO,
        );
        let agent = agent(Duration::from_secs(5));
        let first = post(&agent, server.addr, "crashed", &[], body).expect("post");
        let again = post(&agent, server.addr, "crashed", &[], body).expect("post");
        match takeover {
            Takeover::Rerun => {
                assert_eq!((first.status, first.body.as_str()), (201, "charge 1"));
                assert_eq!(*server.ledger.attempts.lock(), vec![2]);
            }
            _ => {
                assert_eq!(first.status, 500);
                assert!(
                    first.body.contains(problem_type::OUTCOME_UNKNOWN),
                    "{}",
                    first.body
                );
                assert_eq!(server.ledger.started.load(Ordering::SeqCst), 0, "it ran");
            }
        }
        assert_eq!((again.status, &again.body), (first.status, &first.body));
        assert_eq!(again.headers["idempotent-replayed"], "true");
    }
}

#[test]
fn answers_echo_the_key_apply_prefer_wait_and_hint_the_time_left() {
    let store = Arc::new(Store::builder().open_in_memory().expect("store"));
    let options = HandleOptions::new().expected_duration(Duration::from_secs(4));
    let server = Server::start(store, options, Duration::from_secs(3));
    let addr = server.addr;
    let holder =
        std::thread::spawn(move || post(&agent(Duration::from_secs(10)), addr, "echo", &[], "{}"));
    while server.ledger.started.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(1100));
    let asked = Instant::now();
    let busy = post(
        &agent(Duration::from_secs(5)),
        addr,
        "echo",
        &[("prefer", "wait=0")],
        "{}",
    )
    .expect("duplicate");
    assert!(
        asked.elapsed() < Duration::from_millis(400),
        "waited {:?}",
        asked.elapsed()
    );
    assert_eq!(busy.status, 409);
    assert_eq!(busy.headers["preference-applied"], "wait=0");
    assert_eq!(busy.headers["idempotency-key"], "\"echo\"");
    // 4 s expected, about 1.1 s run: about 2.9 s left, rounded up.
    assert_eq!(busy.headers["retry-after"], "3");
    let first = holder.join().expect("holder").expect("first");
    assert_eq!(first.status, 201);
    assert_eq!(first.headers["idempotency-key"], "\"echo\"");
}

#[test]
fn a_waiting_duplicate_gets_the_answer_the_moment_it_exists() {
    let store = Arc::new(Store::builder().open_in_memory().expect("store"));
    let server = Server::start(store, HandleOptions::new(), Duration::from_millis(1500));
    let addr = server.addr;
    let holder =
        std::thread::spawn(move || post(&agent(Duration::from_secs(10)), addr, "w", &[], "{}"));
    while server.ledger.started.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let waiter = post(
        &agent(Duration::from_secs(10)),
        addr,
        "w",
        &[("prefer", "wait=5")],
        "{}",
    )
    .expect("waiter");
    let finished_at = server.ledger.finished_at.lock().expect("finished");
    let late = Instant::now().saturating_duration_since(finished_at);
    assert_eq!((waiter.status, waiter.body.as_str()), (201, "charge 1"));
    assert_eq!(waiter.headers["preference-applied"], "wait=5");
    assert!(late < Duration::from_millis(300), "{late:?}");
    assert_eq!(holder.join().expect("holder").expect("first").status, 201);
}

#[test]
fn form_bodies_replay_in_any_order_and_a_changed_value_is_422() {
    let store = Arc::new(Store::builder().open_in_memory().expect("store"));
    let options = HandleOptions::new().fingerprint(FingerprintPolicy::raw().unordered_form());
    let server = Server::start(store, options, Duration::ZERO);
    let agent = agent(Duration::from_secs(5));
    let form = [("content-type", "application/x-www-form-urlencoded")];
    let first = post(
        &agent,
        server.addr,
        "f",
        &form,
        "amount=2000&currency=usd&description=a+b",
    )
    .expect("first");
    let reordered = post(
        &agent,
        server.addr,
        "f",
        &form,
        "description=a%20b&currency=usd&amount=2000",
    )
    .expect("reordered");
    let changed = post(
        &agent,
        server.addr,
        "f",
        &form,
        "amount=2001&currency=usd&description=a+b",
    )
    .expect("changed");
    assert_eq!((first.status, reordered.status), (201, 201));
    assert_eq!(reordered.body, first.body);
    assert_eq!(reordered.headers["idempotent-replayed"], "true");
    assert_eq!(changed.status, 422);
    assert_eq!(server.ledger.started.load(Ordering::SeqCst), 1);
}

#[test]
fn the_application_renders_the_layers_own_errors() {
    let store = Arc::new(Store::builder().open_in_memory().expect("store"));
    let options = HandleOptions::new()
        .wait(Duration::ZERO)
        .render_problem(|problem: &Problem| {
            let body = format!(
                r#"{{"error":{{"code":{},"message":"{}"}}}}"#,
                problem.status.as_u16(),
                problem.title
            );
            ::http::Response::builder()
                .status(problem.status)
                .header("content-type", "application/json")
                .body(body.into_bytes())
                .expect("answer")
        });
    let server = Server::start(store, options, Duration::from_secs(1));
    let addr = server.addr;
    let holder =
        std::thread::spawn(move || post(&agent(Duration::from_secs(5)), addr, "r", &[], "{}"));
    while server.ledger.started.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let agent = agent(Duration::from_secs(5));
    let busy = post(&agent, addr, "r", &[], "{}").expect("busy");
    assert_eq!(busy.status, 409);
    assert_eq!(busy.headers["content-type"], "application/json");
    assert!(
        busy.body.starts_with(r#"{"error":{"code":409"#),
        "{}",
        busy.body
    );
    assert!(busy.headers.contains_key("retry-after"));
    let bad = post(&agent, addr, "", &[], "{}").expect("bad key");
    assert_eq!(bad.status, 400);
    assert!(
        bad.body.starts_with(r#"{"error":{"code":400"#),
        "{}",
        bad.body
    );
    assert_eq!(holder.join().expect("holder").expect("first").status, 201);
}
