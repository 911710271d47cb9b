//! `PgStore` built and called from inside a tokio runtime, on both flavours: the sync client's
//! own `block_on` would panic there ("Cannot start a runtime from within a runtime"); the
//! store runs such calls on a helper thread instead. Also from `spawn_blocking`, the way an
//! async service should call it. Needs `IDEMPOTENCY_PG_URL` (skipped with a printed reason
//! without it, failed under `CI=true`).
#![cfg(feature = "postgres")]

use std::sync::Arc;

use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, Response, Result, pg::PgStore};

use crate::common::pg::url;

/// Connects, runs every kind of call and drops the store, all on the calling thread.
fn exercise(url: &str, test: &str) -> Result<()> {
    let schema = format!("tokio_{test}_{}", std::process::id());
    let store = PgStore::builder()
        .schema(schema.as_str())
        .pool_size(2)
        .connect(url)?;
    let key = Key::new("k")?;
    let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["r"]))? else {
        panic!("not acquired");
    };
    let ran = store.complete_with(&lease, Response::new(201, "done"), |tx| {
        tx.execute("SELECT 1", &[]).map(drop)
    })?;
    assert!(ran.is_ok(), "{ran:?}");
    assert!(matches!(
        store.claim(&key, Fingerprint::of(["r"]))?,
        Claim::Completed(r) if r.response.body == b"done"
    ));
    let one: i32 = store
        .read_with(|tx| tx.query_one("SELECT 1", &[])?.try_get(0))?
        .map_err(|e| idempotency_store::Error::InvalidConfig {
            reason: e.to_string(),
        })?;
    assert_eq!(one, 1);
    assert_eq!(store.stats()?.completed, 1);
    assert!(store.verify()?.is_clean());
    assert_eq!(store.records()?.count(), 1);
    store.now()?;
    store.sweep(10)?;
    drop(store);
    drop_schema(url.to_owned(), schema);
    Ok(())
}

/// The fixture's own sync client runs on a thread of its own, away from the runtime.
fn drop_schema(url: String, schema: String) {
    std::thread::spawn(move || {
        let mut admin = postgres::Client::connect(
            &url.replace(" prepare_statements=false", ""),
            postgres::NoTls,
        )
        .expect("admin");
        admin
            .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
            .expect("drop schema");
    })
    .join()
    .expect("drop schema");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_multi_thread_runtime_worker() -> Result<()> {
    let Some(url) = url() else { return Ok(()) };
    exercise(&url, "multi")
}

#[tokio::test(flavor = "current_thread")]
async fn on_a_current_thread_runtime() -> Result<()> {
    let Some(url) = url() else { return Ok(()) };
    let schema = format!("tokio_current_{}", std::process::id());
    // Everything on the runtime's only thread, the store's own calls included.
    let store = PgStore::builder()
        .schema(schema.as_str())
        .pool_size(1)
        .connect(&url)?;
    let key = Key::new("k")?;
    let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["r"]))? else {
        panic!("not acquired");
    };
    store.complete(&lease, Response::new(200, "ok"))?;
    assert!(store.lookup(&key)?.is_some());
    assert!(store.verify()?.is_clean());
    // Other tasks keep running between store calls.
    let other = tokio::spawn(async { 7 });
    assert_eq!(other.await.expect("task"), 7);
    drop(store);
    drop_schema(url, schema);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn from_spawned_tasks_and_the_blocking_pool() -> Result<()> {
    let Some(url) = url() else { return Ok(()) };
    let schema = format!("tokio_tasks_{}", std::process::id());
    let store = Arc::new(
        PgStore::builder()
            .schema(schema.as_str())
            .pool_size(4)
            .connect(&url)?,
    );
    let mut tasks = Vec::new();
    for t in 0..8 {
        let store = Arc::clone(&store);
        tasks.push(tokio::spawn(async move {
            for i in 0..10 {
                let key = Key::new(&format!("t{t}-{i}"))?;
                let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["r"]))? else {
                    panic!("not acquired");
                };
                store.complete(&lease, Response::new(200, "ok"))?;
            }
            Ok::<_, idempotency_store::Error>(())
        }));
    }
    let blocking = Arc::clone(&store);
    tasks.push(tokio::task::spawn_blocking(move || {
        let key = Key::new("blocking")?;
        let Claim::Acquired(lease) = blocking.claim(&key, Fingerprint::of(["r"]))? else {
            panic!("not acquired");
        };
        blocking.complete(&lease, Response::new(200, "ok"))
    }));
    for task in tasks {
        task.await.expect("task")?;
    }
    assert_eq!(store.stats()?.completed, 81);
    drop(store);
    drop_schema(url, schema);
    Ok(())
}
