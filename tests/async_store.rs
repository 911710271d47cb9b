//! The store's `AsyncStore` calls: many async callers share the group commit with blocking
//! callers, exactly one claim of a key wins, and a `Blocking` that drops its closures unrun
//! (a runtime shutting down) still gets every call answered, and a call whose future is
//! dropped lands all the same.

use std::sync::Arc;
use std::time::Duration;

use idempotency_store::nonblocking::{AsyncStore, Blocking};
use idempotency_store::{Claim, ClaimId, Fingerprint, IdempotencyStore, Key, Response, Store};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

fn pool() -> Blocking {
    let handle = tokio::runtime::Handle::current();
    Arc::new(move |work| drop(handle.spawn_blocking(work)))
}

fn fp() -> Fingerprint {
    Fingerprint::of(["POST", "/payments"])
}

fn nonblocking(store: &Arc<Store>) -> Arc<dyn AsyncStore> {
    Arc::clone(store)
        .nonblocking()
        .expect("the redb store has async calls")
}

#[test]
fn async_and_blocking_callers_share_the_commit_and_each_gets_its_own_answer() {
    let dir = tempfile::tempdir().expect("dir");
    let store = Arc::new(Store::open(dir.path().join("s.redb")).expect("open"));
    let calls = nonblocking(&store);
    let rt = runtime();
    let blocking_side = {
        let store = Arc::clone(&store);
        std::thread::spawn(move || {
            for i in 0..200 {
                let key = Key::new(&format!("sync-{i}")).expect("key");
                let Ok(Claim::Acquired(lease)) = store.claim(&key, fp()) else {
                    panic!("sync claim {i} not acquired");
                };
                store
                    .complete(&lease, Response::new(201, "s"))
                    .expect("complete");
            }
        })
    };
    rt.block_on(async {
        let tasks: Vec<_> = (0..64)
            .map(|t| {
                let calls = Arc::clone(&calls);
                tokio::spawn(async move {
                    let blocking = pool();
                    for i in 0..20 {
                        let key = Key::new(&format!("async-{t}-{i}")).expect("key");
                        let claim = calls
                            .claim_with_id(&key, fp(), ClaimId::random(), &blocking)
                            .await;
                        let Ok(Claim::Acquired(lease)) = claim else {
                            panic!("async claim {t}/{i} not acquired: {claim:?}");
                        };
                        let body = format!("{t}-{i}");
                        calls
                            .complete(&lease, Response::new(201, body), &blocking)
                            .await
                            .expect("complete");
                    }
                })
            })
            .collect();
        for task in tasks {
            tokio::time::timeout(Duration::from_secs(60), task)
                .await
                .expect("no caller waits forever")
                .expect("task");
        }
    });
    blocking_side.join().expect("sync thread");
    for t in 0..64 {
        for i in 0..20 {
            let key = Key::new(&format!("async-{t}-{i}")).expect("key");
            match store.claim(&key, fp()).expect("claim") {
                Claim::Completed(replay) => {
                    assert_eq!(replay.response.body, format!("{t}-{i}").as_bytes());
                }
                other => panic!("{t}/{i}: {other:?}"),
            }
        }
    }
}

#[test]
fn one_async_claim_of_a_key_wins_and_a_release_frees_it() {
    let store = Arc::new(Store::builder().open_in_memory().expect("open"));
    let calls = nonblocking(&store);
    let key = Key::new("race").expect("key");
    let rt = runtime();
    let claims: Vec<Claim> = rt.block_on(async {
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let (calls, key) = (Arc::clone(&calls), key.clone());
                tokio::spawn(async move {
                    calls
                        .claim_with_id(&key, fp(), ClaimId::random(), &pool())
                        .await
                        .expect("claim")
                })
            })
            .collect();
        let mut claims = Vec::new();
        for task in tasks {
            claims.push(task.await.expect("task"));
        }
        claims
    });
    let won: Vec<_> = claims
        .into_iter()
        .filter_map(|c| match c {
            Claim::Acquired(lease) => Some(lease),
            Claim::InProgress { .. } => None,
            other => panic!("unexpected {other:?}"),
        })
        .collect();
    assert_eq!(won.len(), 1, "exactly one claim acquires the key");
    rt.block_on(async { calls.release(&won[0], &pool()).await })
        .expect("release");
    assert!(matches!(store.claim(&key, fp()), Ok(Claim::Acquired(_))));
}

#[test]
fn a_blocking_pool_that_drops_its_work_still_gets_every_call_answered() {
    let store = Arc::new(Store::builder().open_in_memory().expect("open"));
    let calls = nonblocking(&store);
    // Drops every closure unrun, as a runtime shutting down does.
    let dropping: Blocking = Arc::new(drop);
    let rt = runtime();
    rt.block_on(async {
        for i in 0..50 {
            let key = Key::new(&format!("k{i}")).expect("key");
            let claim = calls
                .claim_with_id(&key, fp(), ClaimId::random(), &dropping)
                .await;
            let Ok(Claim::Acquired(lease)) = claim else {
                panic!("claim {i}: {claim:?}");
            };
            calls
                .complete(&lease, Response::new(200, "ok"), &dropping)
                .await
                .expect("complete");
        }
    });
    let key = Key::new("k49").expect("key");
    assert!(matches!(store.claim(&key, fp()), Ok(Claim::Completed(_))));
}

#[test]
fn pointers_forward_what_they_can() {
    let store = Arc::new(Store::builder().open_in_memory().expect("open"));
    let shared: Arc<dyn IdempotencyStore> = Arc::new(Arc::clone(&store));
    assert!(
        shared.nonblocking().is_some(),
        "Arc<Store> in an Arc forwards"
    );
    let boxed: Arc<dyn IdempotencyStore> =
        Arc::new(Box::new(Store::builder().open_in_memory().expect("open")));
    assert!(boxed.nonblocking().is_none(), "Box<Store> has none");
}

#[test]
fn a_dropped_future_does_not_withdraw_its_call() {
    let store = Arc::new(Store::builder().open_in_memory().expect("open"));
    let calls = nonblocking(&store);
    let key = Key::new("dropped").expect("key");
    let rt = runtime();
    rt.block_on(async {
        // Queued when called; the future is only the wait for its commit.
        drop(calls.claim_with_id(&key, fp(), ClaimId::random(), &pool()));
    });
    assert!(
        matches!(store.claim(&key, fp()), Ok(Claim::InProgress { .. })),
        "the dropped claim landed and holds the key"
    );
}
