//! The answers the layers make themselves (issue 57), on both adapters over real TCP (axum
//! behind `IdempotencyLayer`, actix-web behind `Idempotency`, `tests/adapters/`): every
//! problem carries its type's short `code` and `Cache-Control: no-store`, fresh or replayed
//! from the store; the handler's own answer, and its replay, carry only the handler's headers.

use std::time::Duration;

use crate::adapters::{Adapter, BODY, Handler, memory_store, start};
use crate::client::{Client, Reply};
use crate::common::faulty::Faulty;
use idempotency_store::http::{HandleOptions, Takeover, problem_code, problem_type};
use idempotency_store::{Claim, Error, IdempotencyStore, Key, ManualClock, Store, Timestamp};

/// `reply` is the layer's problem `status` with `code` (and the matching `type`), and says
/// `Cache-Control: no-store`.
fn assert_own_problem(adapter: &Adapter, reply: &Reply, status: u16, code: &str) {
    let name = adapter.name;
    assert_eq!(reply.status, status, "{name}: {reply:?}");
    assert_eq!(
        reply.header("content-type"),
        Some("application/problem+json"),
        "{name}: {reply:?}"
    );
    let body = reply.json();
    assert_eq!(body["code"], code, "{name}: {reply:?}");
    let fragment = body["type"].as_str().and_then(|t| t.rsplit_once('#'));
    assert_eq!(fragment.map(|(_, f)| f), Some(code), "{name}: {reply:?}");
    assert_eq!(
        reply.header("cache-control"),
        Some("no-store"),
        "{name}: {reply:?}"
    );
}

/// 400 (missing and malformed key), 413, 409 and 422 from one server; the handler's 201 and
/// its replay without `Cache-Control`.
fn the_layers_refusals_carry_their_code_and_no_store(adapter: &Adapter) {
    let handler = Handler::new(Duration::from_secs(1));
    let options = HandleOptions::new().wait(Duration::ZERO).max_body(64);
    let server = start(adapter, memory_store(), options, &handler);
    let http = Client::new(server.addr);

    let missing = http.post("/payments", None, BODY).expect("post");
    assert_own_problem(adapter, &missing, 400, problem_code::MISSING_KEY);
    let malformed = http
        .send(
            "POST",
            "/payments",
            &[("Idempotency-Key", "\"unterminated")],
            BODY.as_bytes(),
        )
        .expect("post");
    assert_own_problem(adapter, &malformed, 400, problem_code::INVALID_KEY);
    let large = http
        .post("/payments", Some("large"), &"x".repeat(65))
        .expect("post");
    assert_own_problem(adapter, &large, 413, problem_code::TOO_LARGE);

    let (first, busy) = std::thread::scope(|s| {
        let first = s.spawn(|| http.post("/payments", Some("slow"), BODY));
        while handler.runs() == 0 {
            std::thread::sleep(Duration::from_millis(10));
        }
        let busy = http.post("/payments", Some("slow"), BODY).expect("post");
        (first.join().expect("first").expect("post"), busy)
    });
    assert_own_problem(adapter, &busy, 409, problem_code::IN_PROGRESS);
    assert!(busy.header("retry-after").is_some(), "{busy:?}");
    let reused = http
        .post("/payments", Some("slow"), r#"{"amount": 1}"#)
        .expect("post");
    assert_own_problem(adapter, &reused, 422, problem_code::KEY_REUSED);

    // The handler's own answer, and its replay, are as the handler made them.
    let replay = http.post("/payments", Some("slow"), BODY).expect("post");
    for reply in [&first, &replay] {
        assert_eq!(reply.status, 201, "{}: {reply:?}", adapter.name);
        assert_eq!(reply.header("cache-control"), None, "{}", adapter.name);
        assert!(reply.json().get("code").is_none(), "{}", adapter.name);
    }
    assert!(replay.replayed(), "{}: {replay:?}", adapter.name);
    assert_eq!(handler.runs(), 1, "{}", adapter.name);
}

/// 503 for a store that cannot be reached, and for a full one.
fn store_errors_carry_their_code_and_no_store(adapter: &Adapter) {
    let handler = Handler::new(Duration::ZERO);
    let down = Faulty::new(memory_store())
        .claims(|_, _, _, _| Err(Error::storage_for_tests("the database is down")));
    let server = start(adapter, down, HandleOptions::new(), &handler);
    let reply = Client::new(server.addr)
        .post("/payments", Some("down"), BODY)
        .expect("post");
    assert_own_problem(adapter, &reply, 503, problem_code::UNAVAILABLE);
    drop(server);

    let full = Store::builder()
        .max_records(1)
        .open_in_memory()
        .expect("store");
    let server = start(adapter, full, HandleOptions::new(), &handler);
    let http = Client::new(server.addr);
    let first = http.post("/payments", Some("first"), BODY).expect("post");
    assert_eq!(first.status, 201, "{}: {first:?}", adapter.name);
    let refused = http.post("/payments", Some("second"), BODY).expect("post");
    assert_own_problem(adapter, &refused, 503, problem_code::STORE_FULL);
    assert_eq!(handler.runs(), 1, "{}", adapter.name);
}

/// A completion hook that fails: the key is released and the client gets 500.
fn a_failed_completion_is_500_internal_with_no_store(adapter: &Adapter) {
    let handler = Handler::new(Duration::ZERO);
    let options =
        HandleOptions::new().complete_with(|_, _, _| Ok(Err("the ledger refused the row".into())));
    let server = start(adapter, memory_store(), options, &handler);
    let reply = Client::new(server.addr)
        .post("/payments", Some("hooked"), BODY)
        .expect("post");
    assert_own_problem(adapter, &reply, 500, problem_code::INTERNAL);
}

/// A takeover under `Takeover::AnswerUnknown`: the stored "outcome unknown" says no-store and
/// carries its code, first and on every replay.
fn a_stored_outcome_unknown_replays_its_code_and_no_store(adapter: &Adapter) {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let store = Store::builder()
        .clock(clock.clone())
        .lease(Duration::from_secs(5))
        .open_in_memory()
        .expect("store");
    // An attempt that crashed: claimed, never settled, its lease lapsed.
    let request = ::http::Request::post("/payments")
        .body(BODY.as_bytes().to_vec())
        .expect("request");
    let fingerprint = idempotency_store::http::fingerprint(&request);
    let key = Key::new("crashed").expect("key");
    let Claim::Acquired(lease) = store.claim(&key, fingerprint).expect("claim") else {
        panic!("not acquired");
    };
    drop(lease);
    clock.advance(Duration::from_secs(10));
    let handler = Handler::new(Duration::ZERO);
    let options = HandleOptions::new().takeover(Takeover::AnswerUnknown);
    let server = start(adapter, store, options, &handler);
    let http = Client::new(server.addr);
    let first = http.post("/payments", Some("crashed"), BODY).expect("post");
    assert_own_problem(adapter, &first, 500, problem_code::OUTCOME_UNKNOWN);
    assert_eq!(first.json()["type"], problem_type::OUTCOME_UNKNOWN);
    let again = http.post("/payments", Some("crashed"), BODY).expect("post");
    assert!(again.replayed(), "{}: {again:?}", adapter.name);
    assert_own_problem(adapter, &again, 500, problem_code::OUTCOME_UNKNOWN);
    assert_eq!(handler.runs(), 0, "{}", adapter.name);
}

/// A body cut short (the client shuts its side down mid-body): 400 `invalid-body`.
fn a_body_cut_short_is_400_invalid_body_with_no_store(adapter: &Adapter) {
    use std::io::{Read, Write};
    let handler = Handler::new(Duration::ZERO);
    let server = start(adapter, memory_store(), HandleOptions::new(), &handler);
    let mut stream = std::net::TcpStream::connect(server.addr).expect("connect");
    let head = "POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: \"cut\"\r\n\
                Content-Length: 100\r\n\r\n{\"amount\":";
    stream.write_all(head.as_bytes()).expect("send");
    stream
        .shutdown(std::net::Shutdown::Write)
        .expect("shutdown");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let lower = head.to_ascii_lowercase();
    assert!(
        lower.starts_with("http/1.1 400"),
        "{}: {answer:?}",
        adapter.name
    );
    assert!(
        lower.contains("\r\ncache-control: no-store"),
        "{}: {answer:?}",
        adapter.name
    );
    assert!(
        body.contains(&format!("\"code\":\"{}\"", problem_code::INVALID_BODY)),
        "{}: {answer:?}",
        adapter.name
    );
    assert_eq!(handler.runs(), 0, "{}", adapter.name);
}

for_each_adapter!(
    the_layers_refusals_carry_their_code_and_no_store,
    store_errors_carry_their_code_and_no_store,
    a_failed_completion_is_500_internal_with_no_store,
    a_stored_outcome_unknown_replays_its_code_and_no_store,
    a_body_cut_short_is_400_invalid_body_with_no_store,
);
