//! The handler runs once per key end to end, through the tower layer and the sync `handle`,
//! where the store alone cannot promise it:
//!
//! - hundreds of duplicates waiting (`wait`) on one key, on a runtime with 4 blocking threads,
//!   while the holder runs for many heartbeat periods: the waiters must not starve the
//!   holder's heartbeat (its lease would lapse and a waiter would run the handler again);
//! - an answer larger than the store keeps: the tower layer streams it to its client and
//!   stores a 410 "completed, not stored" that retries get (the sync `handle`, which gives
//!   the client only what it stored, a 500 substitute); one whose body fails: a 500
//!   substitute is stored and replayed; the handler is not run again after the lease;
//! - overload: a claim that finds no slot in time is answered 503 without touching the key.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::common::faulty::Faulty;
use ::http::{Request, StatusCode};
use axum::body::Body;
use http_body_util::BodyExt;
use idempotency_store::backend::Backend;
use idempotency_store::http::tower::IdempotencyLayer;
use idempotency_store::http::{HandleOptions, handle, problem_type};
use idempotency_store::{
    Error, IdempotencyStore, Key, Lease, ManualClock, Result, Store, Timestamp,
};
use tower::ServiceExt;

const WAITERS: usize = 300;

fn request(key: &str) -> Request<Body> {
    Request::post("/payments")
        .header("idempotency-key", format!("\"{key}\""))
        .body(Body::from(r#"{"amount":4999}"#))
        .expect("request")
}

async fn answer(router: axum::Router, request: Request<Body>) -> (StatusCode, Vec<u8>, bool) {
    let response = router.oneshot(request).await.expect("infallible");
    let status = response.status();
    let replayed = response.headers().contains_key("idempotent-replayed");
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, body.to_vec(), replayed)
}

fn runtime(blocking_threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(blocking_threads)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A payments route whose handler counts its runs and takes `runs_for` (on the timer).
fn payments(layer: IdempotencyLayer, runs: &Arc<AtomicUsize>, runs_for: Duration) -> axum::Router {
    let runs = Arc::clone(runs);
    let handler = move || {
        let runs = Arc::clone(&runs);
        async move {
            let run = runs.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(runs_for).await;
            (StatusCode::CREATED, format!("charged, run {run}"))
        }
    };
    axum::Router::new()
        .route("/payments", axum::routing::post(handler))
        .layer(layer)
}

/// 300 duplicates wait up to 5 s for a holder that runs 2 s on a 600 ms lease (a heartbeat
/// every 200 ms), on a runtime with 4 blocking threads: before the fix, the waiters sat in
/// `claim_wait` on all 4 threads, the heartbeat queued behind them, the lease lapsed and a
/// waiter ran the handler a second time.
#[test]
fn waiters_do_not_starve_the_holder() {
    let store = Store::builder()
        .lease(Duration::from_millis(600))
        .open_in_memory()
        .expect("store");
    let options = HandleOptions::new().wait(Duration::from_secs(5));
    let runs = Arc::new(AtomicUsize::new(0));
    let router = payments(
        IdempotencyLayer::new(store, options),
        &runs,
        Duration::from_secs(2),
    );
    let answers = runtime(4).block_on(async move {
        let holder = tokio::spawn(answer(router.clone(), request("flood")));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let waiters: Vec<_> = (0..WAITERS)
            .map(|_| tokio::spawn(answer(router.clone(), request("flood"))))
            .collect();
        let mut answers = vec![holder.await.expect("holder")];
        for waiter in waiters {
            answers.push(waiter.await.expect("waiter"));
        }
        answers
    });
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the handler ran more than once"
    );
    let (status, body, replayed) = &answers[0];
    assert_eq!(
        (*status, body.as_slice(), *replayed),
        (StatusCode::CREATED, &b"charged, run 1"[..], false)
    );
    for (status, body, replayed) in &answers[1..] {
        assert_eq!(
            *status,
            StatusCode::CREATED,
            "{}",
            String::from_utf8_lossy(body)
        );
        assert_eq!(body.as_slice(), b"charged, run 1");
        assert!(replayed);
    }
}

/// With one slot, a queue timeout of 50 ms and a claim that is slow (a store whose every
/// call sleeps), a burst of fresh keys gets 503 with `Retry-After` for those that found no
/// slot, and none of their keys is touched.
#[test]
fn overload_is_answered_503_and_leaves_the_key_alone() {
    let store = Arc::new(Store::builder().open_in_memory().expect("store"));
    let slow = Arc::new(slow(Arc::clone(&store)));
    let runs = Arc::new(AtomicUsize::new(0));
    let layer = IdempotencyLayer::shared(slow, HandleOptions::new())
        .max_blocking(1)
        .queue_timeout(Duration::from_millis(50));
    let router = payments(layer, &runs, Duration::ZERO);
    let answers = runtime(4).block_on(async move {
        let calls: Vec<_> = (0..8)
            .map(|i| tokio::spawn(answer(router.clone(), request(&format!("burst-{i}")))))
            .collect();
        let mut out = Vec::new();
        for call in calls {
            out.push(call.await.expect("call"));
        }
        out
    });
    let served = answers
        .iter()
        .filter(|(s, ..)| *s == StatusCode::CREATED)
        .count();
    let refused: Vec<_> = answers
        .iter()
        .filter(|(s, ..)| *s == StatusCode::SERVICE_UNAVAILABLE)
        .collect();
    assert_eq!(served + refused.len(), 8, "{answers:?}");
    assert!(
        !refused.is_empty() && served >= 1,
        "served {served}, refused {}",
        refused.len()
    );
    for (_, body, _) in &refused {
        assert!(String::from_utf8_lossy(body).contains(problem_type::UNAVAILABLE));
    }
    assert_eq!(runs.load(Ordering::SeqCst), served);
    let untouched = (0..8)
        .filter(|i| {
            let key = Key::new(&format!("burst-{i}")).expect("key");
            store.lookup(&key).expect("lookup").is_none()
        })
        .count();
    assert_eq!(untouched, refused.len());
}

/// A store whose claims take 200 ms: the layer's one slot is busy that long.
fn slow(store: Arc<Store>) -> Faulty<Arc<Store>> {
    Faulty::new(store).claims(|inner, key, fingerprint, id| {
        std::thread::sleep(Duration::from_millis(200));
        Backend::claim(inner, key, fingerprint, id)
    })
}

const LIMIT: usize = 1024;
const LEASE: Duration = Duration::from_secs(5);

fn small_store(clock: &ManualClock) -> Store {
    Store::builder()
        .clock(clock.clone())
        .lease(LEASE)
        .max_response_bytes(LIMIT)
        .open_in_memory()
        .expect("store")
}

fn assert_substitute(status: StatusCode, body: &[u8]) {
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let text = String::from_utf8_lossy(body);
    assert!(text.contains(problem_type::NOT_STORED), "{text}");
}

/// An answer larger than `max_response_bytes`: the client gets it whole with the handler's
/// own status, every retry (also after the lease would have lapsed) gets the stored 410
/// "completed, not stored", the handler ran once.
#[test]
fn an_oversize_answer_is_replaced_and_never_rerun_by_the_layer() {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async { (StatusCode::CREATED, vec![b'x'; LIMIT + 1]) }
    };
    let router = axum::Router::new()
        .route("/payments", axum::routing::post(handler))
        .layer(IdempotencyLayer::new(
            small_store(&clock),
            HandleOptions::new(),
        ));
    runtime(4).block_on(async move {
        let (status, body, replayed) = answer(router.clone(), request("big")).await;
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(body, vec![b'x'; LIMIT + 1]);
        assert!(!replayed);
        let mut stored = None;
        for _ in 0..3 {
            clock.advance(LEASE * 2);
            let (status, again, replayed) = answer(router.clone(), request("big")).await;
            assert_eq!(status, StatusCode::GONE);
            let text = String::from_utf8_lossy(&again);
            assert!(text.contains(problem_type::COMPLETED_NOT_STORED), "{text}");
            assert_eq!(&again, stored.get_or_insert_with(|| again.clone()));
            assert!(replayed);
        }
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A response body that fails while the layer reads it: the substitute is stored in its
/// place, the handler ran once.
#[test]
fn a_failing_answer_body_is_replaced_and_never_rerun() {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let handler = move || {
        counted.fetch_add(1, Ordering::SeqCst);
        async { (StatusCode::CREATED, Body::new(Failing)) }
    };
    let router = axum::Router::new()
        .route("/payments", axum::routing::post(handler))
        .layer(IdempotencyLayer::new(
            small_store(&clock),
            HandleOptions::new(),
        ));
    runtime(4).block_on(async move {
        let (status, body, _) = answer(router.clone(), request("broken")).await;
        assert_substitute(status, &body);
        clock.advance(LEASE * 2);
        let (status, again, replayed) = answer(router.clone(), request("broken")).await;
        assert_substitute(status, &again);
        assert!(replayed);
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A response body whose first frame is an error.
struct Failing;

impl http_body::Body for Failing {
    type Data = bytes::Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
        std::task::Poll::Ready(Some(Err(std::io::Error::other("the upstream hung up"))))
    }
}

/// The sync `handle`: the same substitute, replayed, one run.
#[test]
fn an_oversize_answer_is_replaced_and_never_rerun_by_handle() {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let store = small_store(&clock);
    let options = HandleOptions::new();
    let runs = AtomicUsize::new(0);
    let big = |_: Option<&mut Lease>, _: &Request<Vec<u8>>| {
        runs.fetch_add(1, Ordering::SeqCst);
        ::http::Response::builder()
            .status(201)
            .body(vec![b'x'; LIMIT + 1])
            .expect("response")
    };
    let sync_request = || {
        Request::post("/payments")
            .header("idempotency-key", "\"big\"")
            .body(b"{}".to_vec())
            .expect("request")
    };
    let first = handle(&store, sync_request(), &options, big);
    assert_substitute(first.status(), first.body());
    for _ in 0..3 {
        clock.advance(LEASE * 2);
        let again = handle(&store, sync_request(), &options, big);
        assert_substitute(again.status(), again.body());
        assert_eq!(again.body(), first.body());
        assert_eq!(again.headers()["idempotent-replayed"], "true");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A store whose first claim with a claim id and first completion land and then fail as a
/// lost connection would (`outcome_unknown`): the layer makes each call once more with the
/// same claim id and the same lease, which settles what the first one did.
fn loses_answers(inner: Store) -> Faulty<Store> {
    let (lose_claim, lose_complete) = (AtomicBool::new(true), AtomicBool::new(true));
    Faulty::new(inner)
        .claims(move |inner, key, fingerprint, id| {
            let landed = Backend::claim(inner, key, fingerprint, id);
            if id.is_some() {
                return lost(&lose_claim, landed);
            }
            landed
        })
        .completes(move |inner, lease, response| {
            let done = lost(&lose_complete, Backend::complete(inner, lease, response));
            if done.is_err() {
                // What the backend does when it sees the error itself.
                lease.mark_in_doubt();
            }
            done
        })
}

/// `landed`, or the first time (while `flag` is set) a lost answer after it landed.
fn lost<T>(flag: &AtomicBool, landed: Result<T>) -> Result<T> {
    if flag.swap(false, Ordering::SeqCst) {
        landed?;
        return Err(Error::storage_for_tests("the connection was lost"));
    }
    landed
}

/// A lost answer to the claim and to the completion: the client still gets the handler's
/// 201 from one run (not a 409 for its own key, nor a 500), and its retry the replay.
#[test]
fn lost_answers_are_settled_by_the_layer() {
    let store = loses_answers(Store::builder().open_in_memory().expect("store"));
    let runs = Arc::new(AtomicUsize::new(0));
    let router = payments(
        IdempotencyLayer::new(store, HandleOptions::new()),
        &runs,
        Duration::ZERO,
    );
    runtime(4).block_on(async move {
        let (status, body, replayed) = answer(router.clone(), request("lost")).await;
        assert_eq!(
            (status, body.as_slice(), replayed),
            (StatusCode::CREATED, &b"charged, run 1"[..], false)
        );
        let (status, body, replayed) = answer(router.clone(), request("lost")).await;
        assert_eq!(
            (status, body.as_slice(), replayed),
            (StatusCode::CREATED, &b"charged, run 1"[..], true)
        );
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
