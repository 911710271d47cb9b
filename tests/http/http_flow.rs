//! `http::handle` (sync) and `http::tower::IdempotencyLayer` (axum) over real HTTP on
//! 127.0.0.1, on `Store` and (with `IDEMPOTENCY_PG_URL` set and the `postgres` feature) on
//! `PgStore`: duplicates run once, the 400/409/413/422 answers, canonical JSON, the
//! heartbeat of a slow handler, a client that hangs up mid-handler, and a restart.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ::http::{Request, Response};
use idempotency_store::http::tower::IdempotencyLayer;
use idempotency_store::http::{FingerprintPolicy, HandleOptions, LeaseWatch, handle, problem_type};
use idempotency_store::{IdempotencyStore, Key, RecordState, Store};

use crate::client::{Client, Reply};
use crate::payments_server::server;

/// The application behind the idempotency flow: a sync function of the request (the tower
/// form runs it on the blocking pool).
type App = Arc<dyn Fn(&Request<Vec<u8>>) -> Response<Vec<u8>> + Send + Sync>;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Form {
    Sync,
    Tower,
}

const FORMS: [Form; 2] = [Form::Sync, Form::Tower];

/// A server of either form; stops (and drops its store handle) when dropped.
struct Running {
    addr: std::net::SocketAddr,
    _sync: Option<server::Running>,
    tower: Option<tokio::runtime::Runtime>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(runtime) = self.tower.take() {
            runtime.shutdown_timeout(Duration::from_secs(5));
        }
    }
}

fn start(
    form: Form,
    store: Arc<dyn IdempotencyStore>,
    options: HandleOptions,
    app: App,
) -> Running {
    match form {
        Form::Sync => {
            let handler: server::Handler = Arc::new(move |request| {
                handle(&*store, request, &options, |_lease, request| app(request))
            });
            let running = server::serve_with("127.0.0.1:0", 40, handler).expect("sync server");
            Running {
                addr: running.addr(),
                _sync: Some(running),
                tower: None,
            }
        }
        Form::Tower => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            std_listener.set_nonblocking(true).expect("nonblocking");
            let addr = std_listener.local_addr().expect("addr");
            let router = axum::Router::new()
                .fallback(axum::routing::any(
                    move |request: axum::extract::Request| {
                        let app = Arc::clone(&app);
                        async move { run_app(app, request).await }
                    },
                ))
                .layer(IdempotencyLayer::shared(store, options));
            runtime.spawn(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener).expect("listener");
                axum::serve(listener, router).await.expect("serve");
            });
            Running {
                addr,
                _sync: None,
                tower: Some(runtime),
            }
        }
    }
}

async fn run_app(app: App, request: axum::extract::Request) -> axum::response::Response {
    use http_body_util::BodyExt;
    let (parts, body) = request.into_parts();
    let body = body.collect().await.expect("body").to_bytes().to_vec();
    let request = Request::from_parts(parts, body);
    let answer = tokio::task::spawn_blocking(move || app(&request))
        .await
        .expect("app");
    answer.map(axum::body::Body::from)
}

// ---------------------------------------------------------------- stores

/// Every backend to test on: `Store` always, `PgStore` when a server is configured.
fn stores(test: &str, lease: Duration) -> Vec<(String, Arc<dyn IdempotencyStore>)> {
    let mut out: Vec<(String, Arc<dyn IdempotencyStore>)> = vec![(
        "Store".into(),
        Arc::new(
            Store::builder()
                .lease(lease)
                .open_in_memory()
                .expect("store"),
        ),
    )];
    #[cfg(feature = "postgres")]
    if let Some(store) = pg::store(test, lease) {
        out.push(("PgStore".into(), Arc::new(store)));
    }
    let _ = test;
    out
}

/// Runs `check` against every backend at once, each on a thread of its own: these tests
/// mostly wait (slow handlers, leases running out), and the backends need not wait in turn.
fn on_each_store(
    stores: Vec<(String, Arc<dyn IdempotencyStore>)>,
    check: impl Fn(String, Arc<dyn IdempotencyStore>) + Sync,
) {
    std::thread::scope(|s| {
        for (name, store) in stores {
            let check = &check;
            s.spawn(move || check(name, store));
        }
    });
}

#[cfg(feature = "postgres")]
mod pg {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use idempotency_store::pg::PgStore;

    /// A `PgStore` on a fresh schema of its own, or `None` without `IDEMPOTENCY_PG_URL`.
    pub fn store(test: &str, lease: Duration) -> Option<PgStore> {
        let url = crate::common::pg::url()?;
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let schema = format!(
            "http_{test}_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let mut admin = postgres::Client::connect(
            &url.replace(" prepare_statements=false", ""),
            postgres::NoTls,
        )
        .expect("admin");
        admin
            .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .expect("drop schema");
        let store = crate::common::pg::builder()
            .schema(schema.as_str())
            .lease(lease)
            .pool_size(8)
            .connect(&url)
            .expect("PgStore");
        Some(store)
    }
}

// ---------------------------------------------------------------- helpers

fn json_body(amount: u64) -> String {
    format!(r#"{{"amount": {amount}, "currency": "usd"}}"#)
}

fn problem_type_of(reply: &Reply) -> String {
    reply.json()["type"].as_str().unwrap_or_default().to_owned()
}

/// An app that counts runs per key and answers 201 with the key, attempt and a run number.
fn counting_app(runs: Arc<Mutex<HashMap<String, usize>>>, delay: Duration) -> App {
    static RUN: AtomicUsize = AtomicUsize::new(0);
    Arc::new(move |request| {
        let watch = request
            .extensions()
            .get::<LeaseWatch>()
            .expect("a covered request carries its LeaseWatch")
            .clone();
        *runs
            .lock()
            .expect("lock")
            .entry(watch.key().key().to_owned())
            .or_default() += 1;
        std::thread::sleep(delay);
        let body = format!(
            r#"{{"key":"{}","attempt":{},"run":{},"lost":{}}}"#,
            watch.key().key(),
            watch.attempt(),
            RUN.fetch_add(1, Ordering::SeqCst),
            watch.is_lost()
        );
        Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .body(body.into_bytes())
            .expect("response")
    })
}

// ---------------------------------------------------------------- the tests

#[test]
fn sixteen_concurrent_duplicates_of_fifty_keys_run_once_each() {
    on_each_store(stores("dups", Duration::from_secs(30)), |name, store| {
        for form in FORMS {
            let runs = Arc::new(Mutex::new(HashMap::new()));
            let options = HandleOptions::new().wait(Duration::from_secs(20));
            let app = counting_app(Arc::clone(&runs), Duration::from_millis(20));
            let server = start(form, Arc::clone(&store), options, app);
            let http = Client::new(server.addr).with_timeout(Duration::from_secs(30));
            let prefix = format!("{name}-{form:?}");
            let replies: Vec<Vec<(usize, Reply)>> = std::thread::scope(|s| {
                let clients: Vec<_> = (0..16)
                    .map(|_| {
                        let prefix = &prefix;
                        s.spawn(move || {
                            (0..50)
                                .map(|k| {
                                    let key = format!("{prefix}-{k}");
                                    let reply = http
                                        .post("/pay", Some(&key), &json_body(100))
                                        .expect("answer");
                                    (k, reply)
                                })
                                .collect()
                        })
                    })
                    .collect();
                clients
                    .into_iter()
                    .map(|c| c.join().expect("client"))
                    .collect()
            });
            let mut by_key: HashMap<usize, Vec<Reply>> = HashMap::new();
            for (k, reply) in replies.into_iter().flatten() {
                by_key.entry(k).or_default().push(reply);
            }
            assert_eq!(by_key.len(), 50);
            for (k, replies) in &by_key {
                assert_eq!(replies.len(), 16);
                assert!(
                    replies.iter().all(|r| r.status == 201),
                    "{name} {form:?} {k}: {replies:?}"
                );
                assert!(
                    replies.iter().all(|r| r.body == replies[0].body),
                    "{k}: identical answers"
                );
                let fresh = replies.iter().filter(|r| !r.replayed()).count();
                assert_eq!(
                    fresh, 1,
                    "{name} {form:?} key {k}: one fresh answer, 15 replays"
                );
            }
            let runs = runs.lock().expect("lock");
            assert_eq!(runs.len(), 50);
            assert!(runs.values().all(|&n| n == 1), "{name} {form:?}: {runs:?}");
        }
    });
}

#[test]
fn bad_keys_400_body_too_large_413_reuse_422_and_in_flight_409() {
    let lease = Duration::from_secs(10);
    on_each_store(stores("answers", lease), |name, store| {
        for form in FORMS {
            let runs = Arc::new(Mutex::new(HashMap::new()));
            let options = HandleOptions::new().max_body(64);
            let app = counting_app(Arc::clone(&runs), Duration::from_millis(1500));
            let server = start(form, Arc::clone(&store), options, app);
            let http = Client::new(server.addr);
            let ctx = format!("{name} {form:?}");

            let missing = http.post("/pay", None, &json_body(1)).expect("post");
            assert_eq!(missing.status, 400, "{ctx}");
            assert_eq!(
                missing.header("content-type"),
                Some("application/problem+json")
            );
            assert_eq!(problem_type_of(&missing), problem_type::MISSING_KEY);
            for bad in ["\"unterminated", "café", "\"caf\u{e9}\""] {
                let reply = http
                    .send("POST", "/pay", &[("Idempotency-Key", bad)], b"{}")
                    .expect("an answer, not a closed connection");
                assert_eq!(reply.status, 400, "{ctx} {bad:?}");
                assert_eq!(
                    problem_type_of(&reply),
                    problem_type::INVALID_KEY,
                    "{ctx} {bad:?}"
                );
            }
            // A control character: both forms serve HTTP with hyper, which refuses the header
            // line itself (RFC 9110 section 5.5) with a bare 400 before any handler runs.
            let control = http
                .send("POST", "/pay", &[("Idempotency-Key", "a\u{1}b")], b"{}")
                .expect("an answer");
            assert_eq!(control.status, 400, "{ctx}");
            assert_eq!(control.body, "", "{ctx}: {control:?}");

            let big = "x".repeat(100);
            let too_large = http
                .post("/pay", Some(&format!("{ctx}-big")), &big)
                .expect("post");
            assert_eq!(too_large.status, 413, "{ctx}");
            assert_eq!(problem_type_of(&too_large), problem_type::TOO_LARGE);

            // In flight: a duplicate gets 409 with a Retry-After below the lease.
            let key = format!("{ctx}-slow");
            let (first, busy) = std::thread::scope(|s| {
                let first = s.spawn(|| http.post("/pay", Some(&key), &json_body(5)));
                std::thread::sleep(Duration::from_millis(500));
                let busy = http.post("/pay", Some(&key), &json_body(5));
                (first.join().expect("first"), busy)
            });
            let (first, busy) = (first.expect("first"), busy.expect("busy"));
            assert_eq!(first.status, 201, "{ctx}");
            assert_eq!(busy.status, 409, "{ctx}");
            assert_eq!(problem_type_of(&busy), problem_type::IN_PROGRESS);
            let retry_after: u64 = busy
                .header("retry-after")
                .and_then(|v| v.parse().ok())
                .expect("Retry-After");
            assert!(
                (1..lease.as_secs()).contains(&retry_after),
                "{ctx}: {retry_after}"
            );

            // The same key with another body: 422, and the first still replays.
            let reused = http.post("/pay", Some(&key), &json_body(6)).expect("post");
            assert_eq!(reused.status, 422, "{ctx}");
            assert_eq!(problem_type_of(&reused), problem_type::KEY_REUSED);
            let again = http.post("/pay", Some(&key), &json_body(5)).expect("post");
            assert!(again.replayed() && again.body == first.body, "{ctx}");
            assert_eq!(
                runs.lock().expect("lock").len(),
                1,
                "{ctx}: only the slow key ran"
            );
        }
    });
}

#[test]
fn canonical_json_replays_reformatted_bodies_and_rejects_a_changed_amount() {
    on_each_store(
        stores("canonical", Duration::from_secs(30)),
        |name, store| {
            for form in FORMS {
                let runs = Arc::new(Mutex::new(HashMap::new()));
                let policy = FingerprintPolicy::raw().canonical_json();
                let options = HandleOptions::new().fingerprint(policy);
                let app = counting_app(Arc::clone(&runs), Duration::ZERO);
                let server = start(form, Arc::clone(&store), options, app);
                let http = Client::new(server.addr);
                let key = format!("{name}-{form:?}-canon");
                let first = http
                    .post(
                        "/pay",
                        Some(&key),
                        r#"{"amount":4999,"currency":"usd","meta":{"a":1,"b":[1,2]}}"#,
                    )
                    .expect("post");
                assert_eq!((first.status, first.replayed()), (201, false));
                let reformatted = "{ \"meta\" : {\"b\": [1, 2], \"a\": 1},\n  \"currency\": \"usd\",\t\"amount\": 4999 }";
                let replay = http.post("/pay", Some(&key), reformatted).expect("post");
                assert!(
                    replay.replayed() && replay.body == first.body,
                    "{name} {form:?}: {replay:?}"
                );
                let changed = r#"{"amount":5000,"currency":"usd","meta":{"a":1,"b":[1,2]}}"#;
                let reused = http.post("/pay", Some(&key), changed).expect("post");
                assert_eq!(reused.status, 422, "{name} {form:?}");
                assert_eq!(runs.lock().expect("lock")[&key], 1);
            }
        },
    );
}

#[test]
fn a_handler_running_three_leases_is_heartbeaten_and_never_taken_over() {
    let lease = Duration::from_millis(600);
    on_each_store(stores("heartbeat", lease), |name, store| {
        for form in FORMS {
            let runs = Arc::new(Mutex::new(HashMap::new()));
            let app = counting_app(Arc::clone(&runs), lease * 3);
            let server = start(form, Arc::clone(&store), HandleOptions::new(), app);
            let http = Client::new(server.addr);
            let key = format!("{name}-{form:?}-slow");
            let first = std::thread::scope(|s| {
                let first = s.spawn(|| http.post("/pay", Some(&key), &json_body(7)));
                // Duplicates all through the run, well past the first lease: none takes over.
                let started = Instant::now();
                while started.elapsed() < lease * 5 / 2 {
                    std::thread::sleep(lease / 4);
                    let dup = http.post("/pay", Some(&key), &json_body(7)).expect("dup");
                    assert!(
                        dup.status == 409 || dup.replayed(),
                        "{name} {form:?}: {dup:?}"
                    );
                }
                first.join().expect("first").expect("answer")
            });
            assert_eq!(
                (first.status, first.replayed()),
                (201, false),
                "{name} {form:?}"
            );
            assert_eq!(first.json()["attempt"], 1);
            assert_eq!(first.json()["lost"], false);
            assert_eq!(
                runs.lock().expect("lock")[&key],
                1,
                "{name} {form:?}: one run"
            );
            let replay = http.post("/pay", Some(&key), &json_body(7)).expect("post");
            assert!(replay.replayed() && replay.body == first.body);
        }
    });
}

/// Sends a request and hangs up before the answer, once `started` says the handler runs.
fn post_and_hang_up(addr: std::net::SocketAddr, key: &str, body: &str, started: impl Fn() -> bool) {
    use std::io::Write;
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    let head = format!(
        "POST /pay HTTP/1.1\r\nHost: x\r\nIdempotency-Key: \"{key}\"\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(head.as_bytes()).expect("send");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !started() {
        assert!(Instant::now() < deadline, "the handler never started");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(100));
    drop(stream);
}

#[test]
fn a_client_hanging_up_mid_handler_cancels_nothing() {
    let lease = Duration::from_millis(800);
    on_each_store(stores("hangup", lease), |name, store| {
        // Tower: the handler runs on a task of its own, so the hang-up cancels nothing: it
        // finishes (heartbeating past its 800 ms lease), its answer is stored, and the
        // retry replays attempt 1. It never runs twice.
        let finished = Arc::new(AtomicUsize::new(0));
        let runs = Arc::new(AtomicUsize::new(0));
        let app_finished = Arc::clone(&finished);
        let app_runs = Arc::clone(&runs);
        let router = axum::Router::new()
            .fallback(axum::routing::any(
                move |request: axum::extract::Request| {
                    let (finished, runs) = (Arc::clone(&app_finished), Arc::clone(&app_runs));
                    async move {
                        let watch = request
                            .extensions()
                            .get::<LeaseWatch>()
                            .cloned()
                            .expect("watch");
                        runs.fetch_add(1, Ordering::SeqCst);
                        if watch.attempt() == 1 {
                            tokio::time::sleep(Duration::from_secs(3)).await;
                        }
                        finished.fetch_add(1, Ordering::SeqCst);
                        (
                            axum::http::StatusCode::CREATED,
                            format!("attempt {}", watch.attempt()),
                        )
                    }
                },
            ))
            .layer(IdempotencyLayer::shared(
                Arc::clone(&store),
                HandleOptions::new(),
            ));
        let runtime = tokio::runtime::Runtime::new().expect("runtime");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        runtime.spawn(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            axum::serve(listener, router).await.expect("serve");
        });
        let key = format!("{name}-tower-hangup");
        post_and_hang_up(addr, &key, &json_body(9), || {
            runs.load(Ordering::SeqCst) == 1
        });
        std::thread::sleep(Duration::from_millis(200));
        let record = store
            .lookup(&Key::new(&key).expect("key"))
            .expect("lookup")
            .expect("record");
        assert!(
            matches!(record.state, RecordState::InProgress { .. }),
            "{name}: {record:?}"
        );
        let http = Client::new(addr);
        let deadline = Instant::now() + Duration::from_secs(10);
        let retry = loop {
            let reply = http.post("/pay", Some(&key), &json_body(9)).expect("retry");
            if reply.status != 409 {
                break reply;
            }
            assert!(Instant::now() < deadline, "{name}: still 409");
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(
            (retry.status, retry.body.as_str()),
            (201, "attempt 1"),
            "{name}"
        );
        assert!(retry.replayed(), "{name}: {retry:?}");
        assert_eq!(runs.load(Ordering::SeqCst), 1, "{name}");
        assert_eq!(finished.load(Ordering::SeqCst), 1, "{name}");
        runtime.shutdown_timeout(Duration::from_secs(5));

        // Sync: the handler cannot notice; it finishes and its answer is stored, so the
        // retry gets the replay of attempt 1.
        let runs = Arc::new(Mutex::new(HashMap::new()));
        let app = counting_app(Arc::clone(&runs), Duration::from_millis(600));
        let server = start(Form::Sync, Arc::clone(&store), HandleOptions::new(), app);
        let key = format!("{name}-sync-hangup");
        post_and_hang_up(server.addr, &key, &json_body(9), || {
            runs.lock().expect("lock").contains_key(&key)
        });
        std::thread::sleep(Duration::from_millis(1000));
        let retry = Client::new(server.addr)
            .post("/pay", Some(&key), &json_body(9))
            .expect("retry");
        assert!(retry.status == 201 && retry.replayed(), "{name}: {retry:?}");
        assert_eq!(retry.json()["attempt"], 1);
        assert_eq!(runs.lock().expect("lock")[&key], 1);
    });
}

#[test]
fn a_restarted_server_replays_every_acknowledged_answer() {
    let dir = tempfile::tempdir().expect("dir");
    for form in FORMS {
        let path = dir.path().join(format!("{form:?}.redb"));
        let runs = Arc::new(Mutex::new(HashMap::new()));
        let mut acknowledged = Vec::new();
        {
            let store: Arc<dyn IdempotencyStore> = Arc::new(Store::open(&path).expect("open"));
            let app = counting_app(Arc::clone(&runs), Duration::ZERO);
            let server = start(form, store, HandleOptions::new(), app);
            let http = Client::new(server.addr);
            for i in 0..30 {
                let key = format!("{form:?}-restart-{i}");
                let reply = http.post("/pay", Some(&key), &json_body(i));
                let reply = reply.unwrap_or_else(|e| panic!("{form:?} {key}: {e}"));
                assert_eq!(reply.status, 201);
                acknowledged.push((key, i, reply.body));
            }
        }
        let store: Arc<dyn IdempotencyStore> = Arc::new(Store::open(&path).expect("reopen"));
        let app = counting_app(Arc::clone(&runs), Duration::ZERO);
        let server = start(form, store, HandleOptions::new(), app);
        let http = Client::new(server.addr);
        for (key, i, body) in &acknowledged {
            let reply = http.post("/pay", Some(key), &json_body(*i)).expect("post");
            assert!(
                reply.replayed() && &reply.body == body,
                "{form:?} {key}: {reply:?}"
            );
        }
        assert!(runs.lock().expect("lock").values().all(|&n| n == 1));
    }
}

// ---------------------------------------------------------------- the flow without a server

fn post(key: &str, body: &str) -> Request<Vec<u8>> {
    Request::post("/pay")
        .header("Idempotency-Key", key)
        .body(body.as_bytes().to_vec())
        .expect("request")
}

fn answer(status: u16, body: &str) -> Response<Vec<u8>> {
    Response::builder()
        .status(status)
        .body(body.as_bytes().to_vec())
        .expect("response")
}

#[test]
fn a_panicking_handler_leaves_the_key_to_its_lease() {
    let store = Store::builder()
        .lease(Duration::from_millis(300))
        .open_in_memory()
        .expect("store");
    // No waiting: the duplicate within the lease must see 409, not wait for the takeover.
    let options = HandleOptions::new().wait(Duration::ZERO);
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        handle(
            &store,
            post("p", "{}"),
            &options,
            |_, _| -> Response<Vec<u8>> { panic!("the card network exploded") },
        )
    }));
    assert!(panicked.is_err());
    let record = store.lookup(&Key::new("p").expect("key")).expect("lookup");
    let record = record.expect("still there");
    assert!(matches!(record.state, RecordState::InProgress { .. }));
    // Within the lease: 409; after it: the retry takes over as attempt 2.
    let busy = handle(&store, post("p", "{}"), &options, |_, _| answer(201, "no"));
    assert_eq!(busy.status(), 409);
    std::thread::sleep(Duration::from_millis(400));
    let retry = handle(&store, post("p", "{}"), &options, |lease, _| {
        let attempt = lease.map(|l| l.attempt()).unwrap_or_default();
        answer(201, &format!("attempt {attempt}"))
    });
    assert_eq!(
        (retry.status(), retry.body().as_slice()),
        (::http::StatusCode::CREATED, &b"attempt 2"[..])
    );
}

#[test]
fn release_marker_and_finality_rule_let_the_retry_run() {
    use idempotency_store::http::{Finality, not_final};
    let store = Store::builder().open_in_memory().expect("store");
    let runs = AtomicUsize::new(0);
    let run = |status: u16, marked: bool| {
        runs.fetch_add(1, Ordering::SeqCst);
        let response = answer(status, "x");
        if marked {
            not_final(response)
        } else {
            response
        }
    };
    // Default: every answer is final, a 500 included.
    let options = HandleOptions::new();
    for _ in 0..2 {
        let out = handle(&store, post("final-500", "{}"), &options, |_, _| {
            run(500, false)
        });
        assert_eq!(out.status(), 500);
    }
    assert_eq!(runs.swap(0, Ordering::SeqCst), 1);
    // The typed marker releases whatever the rule.
    for _ in 0..2 {
        let out = handle(&store, post("marked", "{}"), &options, |_, _| {
            run(400, true)
        });
        assert_eq!(out.status(), 400);
        assert!(out.headers().get("idempotent-replayed").is_none());
    }
    assert_eq!(runs.swap(0, Ordering::SeqCst), 2);
    // ReleaseServerErrors: 5xx releases, 4xx is final.
    let options = HandleOptions::new().finality(Finality::ReleaseServerErrors);
    for _ in 0..2 {
        let _ = handle(&store, post("5xx", "{}"), &options, |_, _| run(503, false));
        let _ = handle(&store, post("4xx", "{}"), &options, |_, _| run(402, false));
    }
    assert_eq!(runs.swap(0, Ordering::SeqCst), 3);
    // Methods not covered, and keyless requests when the key is optional, pass through.
    let get = Request::get("/pay").body(Vec::new()).expect("request");
    let out = handle(&store, get, &options, |lease, _| {
        answer(if lease.is_none() { 200 } else { 500 }, "")
    });
    assert_eq!(out.status(), 200);
    let optional = HandleOptions::new().key_required(false);
    let keyless = Request::post("/pay").body(Vec::new()).expect("request");
    let out = handle(&store, keyless, &optional, |lease, _| {
        answer(if lease.is_none() { 200 } else { 500 }, "")
    });
    assert_eq!(out.status(), 200);
}

#[test]
fn a_previous_policy_keeps_old_records_replaying_and_a_version_change_is_named() {
    let store = Store::builder().open_in_memory().expect("store");
    let raw = HandleOptions::new();
    let first = handle(&store, post("k", r#"{"a":1}"#), &raw, |_, _| {
        answer(201, "one")
    });
    assert_eq!(first.status(), 201);
    let canonical = FingerprintPolicy::raw().canonical_json();
    // Switched without the previous policy: 422 whose detail says the server changed.
    let switched = HandleOptions::new().fingerprint(canonical.clone());
    let out = handle(&store, post("k", r#"{"a":1}"#), &switched, |_, _| {
        answer(201, "two")
    });
    assert_eq!(out.status(), 422);
    assert!(String::from_utf8_lossy(out.body()).contains("changed how it compares"));
    // With it: the old record replays.
    let migrating = switched.previous_fingerprint(FingerprintPolicy::raw());
    let out = handle(&store, post("k", r#"{"a":1}"#), &migrating, |_, _| {
        answer(201, "two")
    });
    assert_eq!(
        (out.status(), out.body().as_slice()),
        (::http::StatusCode::CREATED, &b"one"[..])
    );
    assert_eq!(out.headers()["idempotent-replayed"], "true");
}

#[test]
fn a_lease_lost_during_the_run_is_surfaced_and_answered_409() {
    use idempotency_store::{Claim, Fingerprint, ManualClock, Timestamp};
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let store = Store::builder()
        .lease(Duration::from_millis(600))
        .clock(clock.clone())
        .open_in_memory()
        .expect("store");
    let out = handle(
        &store,
        post("lost", "{}"),
        &HandleOptions::new(),
        |_, request| {
            // Stall past the lease (as the store's clock sees it); another attempt takes over.
            clock.advance(Duration::from_secs(1));
            let same = Fingerprint::of(["POST", "/pay", "{}"]);
            let other = store.claim(&Key::new("lost").expect("key"), same);
            assert!(matches!(other, Ok(Claim::Acquired(ref l)) if l.attempt() == 2));
            let watch = request.extensions().get::<LeaseWatch>().expect("watch");
            let deadline = Instant::now() + Duration::from_secs(5);
            while !watch.is_lost() {
                assert!(
                    Instant::now() < deadline,
                    "the heartbeat never reported the loss"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
            answer(201, "too late")
        },
    );
    assert_eq!(out.status(), 409);
}
