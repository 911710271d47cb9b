//! The store's `AsyncStore` calls: many async callers share the group commit with blocking
//! callers, exactly one claim of a key wins, and a `Blocking` that drops its closures unrun
//! (a runtime shutting down) still gets every call answered, and a call whose future is
//! dropped lands all the same. Each over a store file (async callers' batches led on the
//! blocking pool) and in memory (async callers lead their batches on their own threads).

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

/// A store file and an in-memory store, named; the directory lives as long as the list.
fn stores() -> (tempfile::TempDir, Vec<(&'static str, Arc<Store>)>) {
    let dir = tempfile::tempdir().expect("dir");
    let file = Store::open(dir.path().join("s.redb")).expect("open");
    let memory = Store::builder().open_in_memory().expect("open");
    (
        dir,
        vec![("file", Arc::new(file)), ("memory", Arc::new(memory))],
    )
}

fn nonblocking(store: &Arc<Store>) -> Arc<dyn AsyncStore> {
    Arc::clone(store)
        .nonblocking()
        .expect("the redb store has async calls")
}

#[test]
fn async_and_blocking_callers_share_the_commit_and_each_gets_its_own_answer() {
    let (_dir, stores) = stores();
    for (_, store) in stores {
        async_and_blocking_callers_share(&store);
    }
}

fn async_and_blocking_callers_share(store: &Arc<Store>) {
    let calls = nonblocking(store);
    let rt = runtime();
    let blocking_side = {
        let store = Arc::clone(store);
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
    let (_dir, stores) = stores();
    for (_, store) in stores {
        one_async_claim_wins(&store);
    }
}

fn one_async_claim_wins(store: &Arc<Store>) {
    let calls = nonblocking(store);
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
    let (_dir, stores) = stores();
    for (_, store) in stores {
        dropped_work_is_answered(&store);
    }
}

fn dropped_work_is_answered(store: &Arc<Store>) {
    let calls = nonblocking(store);
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

/// Async callers on both of a runtime's workers and blocking callers on threads of their own
/// race for the same keys: in memory the async callers lead batches on the workers, the
/// blocking ones on their threads, and the lead passes between them. Each key has exactly
/// one winner, whichever side it is on.
#[test]
fn async_and_blocking_callers_racing_for_keys_get_one_winner_each() {
    const KEYS: usize = 300;
    let (_dir, stores) = stores();
    for (name, store) in stores {
        let calls = nonblocking(&store);
        let rt = runtime();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || {
                    (0..KEYS)
                        .filter(|i| {
                            let key = Key::new(&format!("k{i}")).expect("key");
                            matches!(store.claim(&key, fp()), Ok(Claim::Acquired(_)))
                        })
                        .count()
                })
            })
            .collect();
        let async_wins: usize = rt.block_on(async {
            let tasks: Vec<_> = (0..16)
                .map(|_| {
                    let calls = Arc::clone(&calls);
                    tokio::spawn(async move {
                        let blocking = pool();
                        let mut won = 0;
                        for i in 0..KEYS {
                            let key = Key::new(&format!("k{i}")).expect("key");
                            let claim = calls
                                .claim_with_id(&key, fp(), ClaimId::random(), &blocking)
                                .await;
                            match claim {
                                Ok(Claim::Acquired(_)) => won += 1,
                                Ok(Claim::InProgress { .. }) => {}
                                other => panic!("{name}: claim of k{i}: {other:?}"),
                            }
                        }
                        won
                    })
                })
                .collect();
            let mut won = 0;
            for task in tasks {
                won += tokio::time::timeout(Duration::from_secs(60), task)
                    .await
                    .expect("no caller waits forever")
                    .expect("task");
            }
            won
        });
        let sync_wins: usize = threads.into_iter().map(|t| t.join().expect("thread")).sum();
        assert_eq!(async_wins + sync_wins, KEYS, "{name}: one winner per key");
    }
}
