//! The tower layer's behaviour, checked over real TCP against both async forms with one test
//! body per case: axum behind `IdempotencyLayer` and actix-web behind `Idempotency`
//! (`tests/adapters/`). Each case runs once per framework, as `tower_layer::CASE` and
//! `actix_middleware::CASE`:
//!
//! - 200 concurrent POSTs with one key: the handler runs once, all get its answer (with the
//!   store's awaited calls, and with a store that has none, through the blocking pool);
//! - 400 fresh keys from 16 clients on a durable file: each handler runs once, and each
//!   retry replays its own answer;
//! - a replay is byte-exact (status, headers, body);
//! - 409 with `Retry-After` while the first attempt runs; 422 for a changed body; 400 for a
//!   missing or malformed key;
//! - a client that gives up at 1 s on a 2.5 s handler: the handler runs once to its end, and
//!   the client's retry gets the stored answer within 0.5 s of the handler finishing;
//! - a store that cannot be reached: 503 with `Retry-After`, the handler never runs;
//! - an answer larger than the store keeps: its client gets it whole with the handler's own
//!   status; every retry, also after the lease would have lapsed, gets the stored 410
//!   "completed, not stored"; the handler ran once;
//! - two routes with their own TTL over one store: each answer replays for its route's time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::adapters::{Adapter, BODY, Handler, memory_store, start};
use crate::client::{Client, Reply};
use crate::common::faulty::Faulty;
use idempotency_store::http::{HandleOptions, problem_type};
use idempotency_store::{Error, IdempotencyStore, ManualClock, Store, Timestamp};

fn problem_type_of(reply: &Reply) -> String {
    reply.json()["type"].as_str().unwrap_or_default().to_owned()
}

/// The headers that differ between an answer and its replay by design.
fn comparable(reply: &Reply) -> Vec<(String, String)> {
    let mut headers: Vec<_> = reply
        .headers
        .iter()
        .map(|(n, v)| (n.to_ascii_lowercase(), v.clone()))
        .filter(|(n, _)| n != "date" && n != "idempotent-replayed")
        .collect();
    headers.sort();
    headers
}

fn two_hundred_duplicates_run_once(adapter: &Adapter) {
    duplicates_run_once(adapter, memory_store());
}

/// The same through the blocking pool: a `Box` hides the store's awaited calls
/// (`IdempotencyStore::nonblocking`), as `PgStore` has none.
fn two_hundred_duplicates_run_once_on_the_blocking_pool(adapter: &Adapter) {
    let boxed = Arc::new(Box::new(memory_store()));
    assert!(
        Arc::clone(&boxed).nonblocking().is_none(),
        "a Box forwards none"
    );
    duplicates_run_once(adapter, boxed);
}

fn duplicates_run_once(adapter: &Adapter, store: impl IdempotencyStore + 'static) {
    let handler = Handler::new(Duration::from_millis(500));
    let options = HandleOptions::new().wait(Duration::from_secs(10));
    let server = start(adapter, store, options, &handler);
    let http = Client::new(server.addr).with_timeout(Duration::from_secs(30));
    let replies: Vec<Reply> = std::thread::scope(|s| {
        let sends: Vec<_> = (0..200)
            .map(|_| s.spawn(|| http.post("/payments", Some("flood"), BODY)))
            .collect();
        sends
            .into_iter()
            .map(|t| t.join().expect("thread").expect("post"))
            .collect()
    });
    assert_eq!(
        handler.runs(),
        1,
        "{}: the handler ran more than once",
        adapter.name
    );
    let fresh = replies.iter().filter(|r| !r.replayed()).count();
    assert_eq!(fresh, 1, "{}: one answer is the run's own", adapter.name);
    for reply in &replies {
        assert_eq!(reply.status, 201, "{}: {reply:?}", adapter.name);
        assert_eq!(reply.body, "charged, run 1", "{}", adapter.name);
    }
}

/// Fresh keys from many clients at once, on a durable file: the claims and completions share
/// group commits (awaited by the requests, led from the blocking pool), every key's handler
/// runs once, and each retry replays that run's own answer.
fn many_fresh_keys_each_run_once_and_replay_their_own_answer(adapter: &Adapter) {
    const CLIENTS: usize = 16;
    const KEYS: usize = 25;
    let dir = tempfile::tempdir().expect("dir");
    let store = Store::open(dir.path().join("fresh.redb")).expect("store");
    let handler = Handler::new(Duration::ZERO);
    let server = start(adapter, store, HandleOptions::new(), &handler);
    let http = Client::new(server.addr).with_timeout(Duration::from_secs(30));
    let firsts: Vec<Vec<Reply>> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|c| {
                let http = &http;
                s.spawn(move || {
                    (0..KEYS)
                        .map(|k| {
                            let key = format!("fresh-{c}-{k}");
                            http.post("/payments", Some(&key), BODY).expect("post")
                        })
                        .collect()
                })
            })
            .collect();
        clients
            .into_iter()
            .map(|t| t.join().expect("client"))
            .collect()
    });
    assert_eq!(handler.runs(), CLIENTS * KEYS, "{}", adapter.name);
    for (c, replies) in firsts.iter().enumerate() {
        for (k, first) in replies.iter().enumerate() {
            assert_eq!(
                (first.status, first.replayed()),
                (201, false),
                "{}: {first:?}",
                adapter.name
            );
            let key = format!("fresh-{c}-{k}");
            let again = http.post("/payments", Some(&key), BODY).expect("post");
            assert_eq!(
                (again.status, again.replayed()),
                (201, true),
                "{}: {again:?}",
                adapter.name
            );
            assert_eq!(again.body, first.body, "{}: {key}", adapter.name);
        }
    }
    assert_eq!(handler.runs(), CLIENTS * KEYS, "{}", adapter.name);
}

fn replay_is_byte_exact(adapter: &Adapter) {
    let handler = Handler::new(Duration::ZERO);
    let server = start(adapter, memory_store(), HandleOptions::new(), &handler);
    let http = Client::new(server.addr);
    let first = http.post("/payments", Some("order-1"), BODY).expect("post");
    let again = http.post("/payments", Some("order-1"), BODY).expect("post");
    assert_eq!(
        (first.status, first.replayed()),
        (201, false),
        "{}: {first:?}",
        adapter.name
    );
    assert_eq!(
        (again.status, again.replayed()),
        (201, true),
        "{}: {again:?}",
        adapter.name
    );
    assert_eq!(again.body, first.body, "{}", adapter.name);
    assert_eq!(comparable(&again), comparable(&first), "{}", adapter.name);
    assert_eq!(handler.runs(), 1, "{}", adapter.name);
}

fn in_flight_is_409(adapter: &Adapter) {
    let handler = Handler::new(Duration::from_secs(1));
    let server = start(adapter, memory_store(), HandleOptions::new(), &handler);
    let http = Client::new(server.addr);
    let (first, duplicate) = std::thread::scope(|s| {
        let first = s.spawn(|| http.post("/payments", Some("slow"), BODY));
        std::thread::sleep(Duration::from_millis(300));
        let duplicate = http.post("/payments", Some("slow"), BODY).expect("post");
        (first.join().expect("first").expect("post"), duplicate)
    });
    assert_eq!(first.status, 201, "{}: {first:?}", adapter.name);
    assert_eq!(duplicate.status, 409, "{}: {duplicate:?}", adapter.name);
    assert_eq!(problem_type_of(&duplicate), problem_type::IN_PROGRESS);
    assert!(
        duplicate.header("retry-after").is_some(),
        "{}: {duplicate:?}",
        adapter.name
    );
    assert_eq!(handler.runs(), 1, "{}", adapter.name);
}

fn changed_body_is_422(adapter: &Adapter) {
    let handler = Handler::new(Duration::ZERO);
    let server = start(adapter, memory_store(), HandleOptions::new(), &handler);
    let http = Client::new(server.addr);
    let first = http.post("/payments", Some("reused"), BODY).expect("post");
    assert_eq!(first.status, 201, "{}", adapter.name);
    let other = http
        .post(
            "/payments",
            Some("reused"),
            r#"{"amount": 1, "currency": "usd"}"#,
        )
        .expect("post");
    assert_eq!(other.status, 422, "{}: {other:?}", adapter.name);
    assert_eq!(problem_type_of(&other), problem_type::KEY_REUSED);
    assert_eq!(handler.runs(), 1, "{}", adapter.name);
}

fn bad_key_is_400(adapter: &Adapter) {
    let handler = Handler::new(Duration::ZERO);
    let server = start(adapter, memory_store(), HandleOptions::new(), &handler);
    let http = Client::new(server.addr);
    let missing = http.post("/payments", None, BODY).expect("post");
    assert_eq!(missing.status, 400, "{}: {missing:?}", adapter.name);
    assert_eq!(problem_type_of(&missing), problem_type::MISSING_KEY);
    let malformed = http
        .send(
            "POST",
            "/payments",
            &[("Idempotency-Key", "\"unterminated")],
            BODY.as_bytes(),
        )
        .expect("post");
    assert_eq!(malformed.status, 400, "{}: {malformed:?}", adapter.name);
    assert_eq!(problem_type_of(&malformed), problem_type::INVALID_KEY);
    assert_eq!(
        malformed.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(handler.runs(), 0, "{}", adapter.name);
}

/// How a client that gives up on its answer leaves.
#[derive(Clone, Copy, Debug)]
enum HangUp {
    /// Closes the connection (FIN), as a client whose timeout passed does.
    Close,
    /// Resets it (RST), as a killed client, a proxy or a load balancer may.
    Reset,
}

/// Sends a payment with `key`, waits `patience` for the answer (there must be none by then)
/// and hangs up.
fn give_up(addr: std::net::SocketAddr, key: &str, patience: Duration, how: HangUp) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    let request = format!(
        "POST /payments HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Idempotency-Key: \"{key}\"\r\nContent-Length: {}\r\n\r\n{BODY}",
        BODY.len()
    );
    stream.write_all(request.as_bytes()).expect("send");
    stream.set_read_timeout(Some(patience)).expect("timeout");
    let mut byte = [0u8; 1];
    let read = stream.read(&mut byte);
    assert!(
        matches!(&read, Err(err) if err.kind() == std::io::ErrorKind::WouldBlock
            || err.kind() == std::io::ErrorKind::TimedOut),
        "answered within {patience:?}: {read:?}"
    );
    if let HangUp::Reset = how {
        reset_on_close(&stream);
    }
}

/// `SO_LINGER` 0: closing the socket sends RST instead of FIN.
fn reset_on_close(stream: &std::net::TcpStream) {
    use std::os::fd::AsRawFd;
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: a valid socket and a `linger` of the size given.
    let set = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    assert_eq!(set, 0, "SO_LINGER");
}

/// Issue 39's case: the client gives up after 1 s on a 2.5 s handler, then retries with the
/// same key every 100 ms, each attempt again with a 1 s timeout.
fn retry_after_hang_up(adapter: &Adapter, how: HangUp) {
    let handler = Handler::new(Duration::from_millis(2500));
    let server = start(adapter, memory_store(), HandleOptions::new(), &handler);
    give_up(server.addr, "impatient", Duration::from_secs(1), how);
    let http = Client::new(server.addr).with_timeout(Duration::from_secs(1));
    let deadline = Instant::now() + Duration::from_secs(8);
    let answer = loop {
        match http.post("/payments", Some("impatient"), BODY) {
            Ok(reply) if reply.status != 409 => break Some((reply, Instant::now())),
            _ if Instant::now() > deadline => break None,
            _ => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let name = adapter.name;
    assert_eq!(
        (handler.runs(), handler.finished()),
        (1, 1),
        "{name} ({how:?}): (runs started, runs finished)"
    );
    let (reply, at) =
        answer.unwrap_or_else(|| panic!("{name} ({how:?}): the retries got no answer within 8 s"));
    assert_eq!(
        (reply.status, reply.replayed()),
        (201, true),
        "{name}: {reply:?}"
    );
    assert_eq!(reply.body, "charged, run 1");
    let late = at.saturating_duration_since(handler.finished_at().expect("finished"));
    assert!(
        late < Duration::from_millis(500),
        "{name} ({how:?}): the retry got the answer {late:?} after the handler finished"
    );
}

fn a_client_that_times_out_gets_the_one_answer_on_retry(adapter: &Adapter) {
    retry_after_hang_up(adapter, HangUp::Close);
}

fn a_client_whose_connection_resets_gets_the_one_answer_on_retry(adapter: &Adapter) {
    retry_after_hang_up(adapter, HangUp::Reset);
}

/// A store that cannot be reached: every claim fails.
fn unreachable() -> Faulty<Store> {
    Faulty::new(memory_store())
        .claims(|_, _, _, _| Err(Error::storage_for_tests("the database is down")))
}

fn storage_error_is_503(adapter: &Adapter) {
    let handler = Handler::new(Duration::ZERO);
    let server = start(adapter, unreachable(), HandleOptions::new(), &handler);
    let http = Client::new(server.addr);
    let reply = http.post("/payments", Some("down"), BODY).expect("post");
    assert_eq!(reply.status, 503, "{}: {reply:?}", adapter.name);
    assert_eq!(problem_type_of(&reply), problem_type::UNAVAILABLE);
    assert_eq!(reply.header("retry-after"), Some("1"), "{}", adapter.name);
    assert_eq!(handler.runs(), 0, "{}", adapter.name);
}

const LIMIT: usize = 1024;
const LEASE: Duration = Duration::from_secs(5);

fn oversize_answer_reaches_its_client_and_is_never_rerun(adapter: &Adapter) {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let store = Store::builder()
        .clock(clock.clone())
        .lease(LEASE)
        .max_response_bytes(LIMIT)
        .open_in_memory()
        .expect("store");
    let handler = Handler::sized(LIMIT + 1);
    let server = start(adapter, store, HandleOptions::new(), &handler);
    let http = Client::new(server.addr);
    let first = http.post("/payments", Some("big"), BODY).expect("post");
    assert_eq!(first.status, 201, "{}: {first:?}", adapter.name);
    assert_eq!(first.body, "x".repeat(LIMIT + 1), "{}", adapter.name);
    assert!(!first.replayed(), "{}", adapter.name);
    let mut stored = None;
    for _ in 0..3 {
        clock.advance(LEASE * 2);
        let again = http.post("/payments", Some("big"), BODY).expect("post");
        assert_eq!(
            (again.status, again.replayed()),
            (410, true),
            "{}: {again:?}",
            adapter.name
        );
        assert_eq!(problem_type_of(&again), problem_type::COMPLETED_NOT_STORED);
        let stored = stored.get_or_insert_with(|| again.body.clone());
        assert_eq!(&again.body, stored, "{}", adapter.name);
    }
    assert_eq!(handler.runs(), 1, "{}", adapter.name);
}

/// Two routes (two layers) over one store, one with a TTL of an hour and one with the store's
/// day: each answer replays for its own route's time, measured from its completion, and the
/// key space stays one (the same key on the other route with another body is a 422).
fn per_route_ttl_on_one_store(adapter: &Adapter) {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let store: Arc<dyn IdempotencyStore> = Arc::new(
        Store::builder()
            .clock(clock.clone())
            .open_in_memory()
            .expect("store"),
    );
    let hour = Duration::from_secs(3600);
    let handler = Handler::new(Duration::ZERO);
    let hourly = (adapter.start)(
        Arc::clone(&store),
        HandleOptions::new().ttl(hour),
        Arc::clone(&handler),
    );
    let daily = (adapter.start)(
        Arc::clone(&store),
        HandleOptions::new(),
        Arc::clone(&handler),
    );
    let (hourly, daily) = (Client::new(hourly.addr), Client::new(daily.addr));
    assert_eq!(
        hourly
            .post("/payments", Some("h"), BODY)
            .expect("post")
            .status,
        201
    );
    assert_eq!(
        daily
            .post("/payments", Some("d"), BODY)
            .expect("post")
            .status,
        201
    );
    let expires = |key: &str| {
        let key = idempotency_store::Key::new(key).expect("key");
        let view = store.lookup(&key).expect("lookup").expect("stored");
        view.expires_at.as_millis() - store.now().expect("now").as_millis()
    };
    assert_eq!(expires("h"), 3_600_000, "{}", adapter.name);
    assert_eq!(expires("d"), 86_400_000, "{}", adapter.name);
    let other = daily
        .post(
            "/payments",
            Some("h"),
            r#"{"amount": 1, "currency": "usd"}"#,
        )
        .expect("post");
    assert_eq!(other.status, 422, "{}: {other:?}", adapter.name);
    clock.advance(hour - Duration::from_millis(1));
    let again = hourly.post("/payments", Some("h"), BODY).expect("post");
    assert_eq!(
        (again.status, again.replayed()),
        (201, true),
        "{}",
        adapter.name
    );
    clock.advance(Duration::from_millis(1));
    let later = hourly.post("/payments", Some("h"), BODY).expect("post");
    assert_eq!(
        (later.status, later.replayed()),
        (201, false),
        "{}",
        adapter.name
    );
    let kept = daily.post("/payments", Some("d"), BODY).expect("post");
    assert_eq!(
        (kept.status, kept.replayed()),
        (201, true),
        "{}",
        adapter.name
    );
    assert_eq!(handler.runs(), 3, "{}", adapter.name);
}

for_each_adapter!(
    two_hundred_duplicates_run_once,
    two_hundred_duplicates_run_once_on_the_blocking_pool,
    many_fresh_keys_each_run_once_and_replay_their_own_answer,
    replay_is_byte_exact,
    in_flight_is_409,
    changed_body_is_422,
    bad_key_is_400,
    a_client_that_times_out_gets_the_one_answer_on_retry,
    a_client_whose_connection_resets_gets_the_one_answer_on_retry,
    storage_error_is_503,
    oversize_answer_reaches_its_client_and_is_never_rerun,
    per_route_ttl_on_one_store,
);
