//! `PgStore` in the distributed mode (`PgStoreBuilder::distributed`) on a Citus cluster on this
//! machine: a coordinator and two workers (`.ci/citus-setup`). What the suites run through
//! `IDEMPOTENCY_PG_DISTRIBUTED=1` (conformance, history, HTTP flow) does not show:
//!
//! - every statement of a request's path runs as one task on one shard: the store's sessions
//!   run with `citus.multi_task_query_log_level = error`, under which Citus fails any
//!   statement of more than one task (the sweep, which is multi-shard, fails under it: the
//!   negative control); and a new key's insert is planned as a routed task, not pulled to the
//!   coordinator;
//! - tokens stay unique and increasing per key across both workers and across a shard move
//!   (`citus_move_shard_placement`), and a lease held across the move still completes;
//! - `complete_with`'s effects on a table co-located with the records (distributed by the
//!   same key) commit or roll back with the response;
//! - a quota, the poolers' routines and a connection to a worker are refused at connect;
//! - a worker restarted under load (as after a crash) loses no acknowledged claim or
//!   completion.
//!
//! It restarts a worker, so it runs only where `.ci/run` says so: `IDEMPOTENCY_PG_CITUS_URL`
//! names the coordinator and `IDEMPOTENCY_PG_CITUS_SETUP` the set-up script. Skipped with a
//! printed reason without them (failed under `CI=true`). One test at a time: the restart
//! would fail the others.
#![cfg(feature = "postgres")]

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use idempotency_store::{
    Claim, Error, Fingerprint, IdempotencyStore, Key, Lease, Response,
    pg::{PgStore, PgStoreBuilder},
};

use crate::common::pg::Schema;

/// One test at a time (see the module's documentation).
static SERIAL: Mutex<()> = Mutex::new(());

/// The coordinator's URL and the set-up script, or `None` (with the reason printed).
fn cluster() -> Option<(String, PathBuf)> {
    let url = std::env::var("IDEMPOTENCY_PG_CITUS_URL").ok();
    let setup = std::env::var("IDEMPOTENCY_PG_CITUS_SETUP").ok();
    match (url, setup) {
        (Some(url), Some(setup)) if !url.trim().is_empty() && !setup.trim().is_empty() => {
            Some((url, PathBuf::from(setup)))
        }
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => panic!(
            "CI=true but IDEMPOTENCY_PG_CITUS_URL or IDEMPOTENCY_PG_CITUS_SETUP is not set (see .ci/run)"
        ),
        _ => {
            eprintln!(
                "skipped: IDEMPOTENCY_PG_CITUS_URL (a Citus coordinator) and \
                 IDEMPOTENCY_PG_CITUS_SETUP (.ci/citus-setup) are not set; see .ci/run"
            );
            None
        }
    }
}

fn distributed(schema: &Schema) -> PgStoreBuilder {
    let mut builder = schema.store_builder();
    builder.distributed(true);
    builder
}

/// The URL with a session setting, as the connection string's `options`.
fn with_option(url: &str, setting: &str) -> String {
    format!("{url} options='-c {setting}'")
}

/// Under this setting Citus fails any statement that runs as more than one task.
const SINGLE_TASK_ONLY: &str = "citus.multi_task_query_log_level=error";

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/citus", body])
}

fn admin(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).expect("connect to the coordinator")
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

#[test]
fn every_request_statement_runs_on_one_shard() -> idempotency_store::Result<()> {
    let Some((url, _)) = cluster() else {
        return Ok(());
    };
    let _serial = lock();
    let schema = Schema::named(url.clone(), "citus", "one_shard");
    // Created (and distributed) by a store without the setting: the migration is DDL.
    drop(distributed(&schema).connect(&url)?);
    let store = distributed(&schema)
        .lease(Duration::from_millis(300))
        .connect(&with_option(&url, SINGLE_TASK_ONLY))?;
    for n in 0..20u32 {
        let key = Key::new(&format!("k{n}"))?;
        let Claim::Acquired(mut lease) = store.claim(&key, fp("a"))? else {
            panic!("a fresh key was not acquired");
        };
        assert!(matches!(
            store.claim(&key, fp("a"))?,
            Claim::InProgress { .. }
        ));
        assert!(matches!(
            store.claim(&key, fp("b"))?,
            Claim::Mismatch { .. }
        ));
        store.heartbeat(&mut lease)?;
        store.checkpoint(&mut lease, b"half".to_vec())?;
        assert!(store.lookup(&key)?.is_some());
        if n.is_multiple_of(2) {
            store.complete(&lease, Response::new(201, format!("r{n}")))?;
            let Claim::Completed(record) = store.claim(&key, fp("a"))? else {
                panic!("no replay");
            };
            assert_eq!(record.response, Response::new(201, format!("r{n}")));
        } else {
            store.release(&lease)?;
        }
    }
    // A takeover of a lapsed lease, and a lost lease's fenced write.
    let key = Key::new("lapsed")?;
    let Claim::Acquired(old) = store.claim(&key, fp("a"))? else {
        panic!("not acquired");
    };
    std::thread::sleep(Duration::from_millis(400));
    let Claim::Acquired(new) = store.claim(&key, fp("a"))? else {
        panic!("the lapsed lease was not taken over");
    };
    assert!(new.token() > old.token() && new.attempt() == 2);
    assert!(matches!(
        store.complete(&old, Response::new(200, "late")),
        Err(Error::LeaseLost)
    ));
    store.complete(&new, Response::new(200, "ok"))?;
    // The negative control: the sweep reads every shard, which the setting refuses.
    let swept = store.sweep(10);
    assert!(
        matches!(&swept, Err(Error::Storage { .. })),
        "a multi-shard statement ran under {SINGLE_TASK_ONLY}: {swept:?}"
    );
    Ok(())
}

/// A new key's insert, the claim's first statement, is planned as one task routed to the
/// key's shard: not an `INSERT … SELECT` that Citus pulls to the coordinator, which the
/// single-task setting above lets through. The plan is Citus's `EXPLAIN` of the statement's
/// text as the store's session last sent it (`pg_stat_activity`), with the claim's parameters.
#[test]
fn a_new_keys_insert_is_one_task_routed_to_its_shard() -> idempotency_store::Result<()> {
    let Some((url, _)) = cluster() else {
        return Ok(());
    };
    let _serial = lock();
    let schema = Schema::named(url.clone(), "citus", "routed_insert");
    let store = distributed(&schema).pool_size(1).connect(&url)?;
    assert!(matches!(
        store.claim(&Key::new("fresh")?, fp("a"))?,
        Claim::Acquired(_)
    ));
    let mut admin = admin(&url);
    let row = admin
        .query_one(
            "SELECT query, octet_length(query) < (SELECT setting::int - 1 FROM pg_settings \
                 WHERE name = 'track_activity_query_size') \
             FROM pg_stat_activity WHERE pid <> pg_backend_pid() \
             AND query LIKE '%' || $1::text || '%idempotency_token_seq%'",
            &[&schema.name],
        )
        .expect("the store's session and its last statement");
    let (insert, whole): (String, bool) = (row.get(0), row.get(1));
    assert!(
        whole,
        "pg_stat_activity cut the statement short: the coordinator needs a larger \
         track_activity_query_size (.ci/citus-setup sets it)"
    );
    admin
        .batch_execute(&format!(
            "PREPARE claim_insert (bigint, text, text, bytea, smallint, bigint, bigint, \
             bigint) AS {insert}"
        ))
        .expect("prepare the insert's text");
    let plan: Vec<String> = admin
        .query(
            "EXPLAIN EXECUTE claim_insert (NULL, '', 'probe', '\\x00', 1, 1000, 1000, NULL)",
            &[],
        )
        .expect("explain the insert")
        .iter()
        .map(|row| row.get(0))
        .collect();
    let plan = plan.join("\n");
    assert!(
        plan.contains("Custom Scan (Citus Adaptive)")
            && plan.contains("Task Count: 1")
            && !plan.contains("pull to coordinator"),
        "the insert is not one routed task:\n{insert}\n{plan}"
    );
    Ok(())
}

#[test]
fn tokens_increase_per_key_across_workers_and_a_shard_move() -> idempotency_store::Result<()> {
    let Some((url, _)) = cluster() else {
        return Ok(());
    };
    let _serial = lock();
    let schema = Schema::named(url.clone(), "citus", "tokens");
    let store = Arc::new(distributed(&schema).pool_size(8).connect(&url)?);
    // 8 threads over 16 keys (on both workers): claim, then release or complete, in turns.
    let seen: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let (store, seen) = (store.clone(), seen.clone());
            std::thread::spawn(move || -> idempotency_store::Result<()> {
                for i in 0..60 {
                    let name = format!("key-{}", (t * 7 + i) % 16);
                    let key = Key::new(&name)?;
                    if let Claim::Acquired(lease) = store.claim(&key, fp("same"))? {
                        seen.lock().unwrap().push((name, lease.token()));
                        store.release(&lease)?;
                    }
                }
                Ok(())
            })
        })
        .collect();
    for thread in threads {
        thread.join().expect("thread")?;
    }
    let seen = seen.lock().unwrap().clone();
    assert!(seen.len() >= 16, "too few acquisitions: {}", seen.len());
    let unique: HashSet<u64> = seen.iter().map(|(_, t)| *t).collect();
    assert_eq!(unique.len(), seen.len(), "a token was handed out twice");
    // A lease was recorded before its release, and the key's next claim won after it: per
    // key, the record's order is the order of acquisition, whose tokens must increase.
    let mut last: HashMap<&str, u64> = HashMap::new();
    for (name, token) in &seen {
        if let Some(before) = last.insert(name, *token) {
            assert!(*token > before, "{name}: token {token} after {before}");
        }
    }
    let mut client = admin(&crate::common::pg::raw_url(&url));
    let nodes: i64 = client
        .query_one(
            "SELECT count(DISTINCT nodeport) FROM citus_shards WHERE table_name = $1::text::regclass",
            &[&format!("\"{}\".idempotency_keys", schema.name)],
        )
        .expect("shards")
        .get(0);
    assert_eq!(nodes, 2, "the records table is not on both workers");

    // A lease held across a shard move still completes, and the key's next token is higher.
    let key = Key::new("moving")?;
    let Claim::Acquired(held) = store.claim(&key, fp("m"))? else {
        panic!("not acquired");
    };
    let table = format!("\"{}\".idempotency_keys", schema.name);
    let row = client
        .query_one(
            "SELECT s.shardid, s.nodeport, (SELECT nodeport FROM pg_dist_node WHERE noderole = \
             'primary' AND groupid > 0 AND nodeport <> s.nodeport LIMIT 1) \
             FROM citus_shards AS s WHERE s.table_name = $1::text::regclass \
             AND s.shardid = get_shard_id_for_distribution_column($1::text::regclass, 'moving')",
            &[&table],
        )
        .expect("the key's shard");
    let (shard, from, to): (i64, i32, i32) = (row.get(0), row.get(1), row.get(2));
    client
        .execute(
            "SELECT citus_move_shard_placement($1::bigint, '127.0.0.1', $2::int, '127.0.0.1', \
             $3::int, shard_transfer_mode := 'block_writes')",
            &[&shard, &from, &to],
        )
        .expect("move the shard");
    let now_on: i32 = client
        .query_one(
            "SELECT nodeport FROM citus_shards WHERE shardid = $1::bigint",
            &[&shard],
        )
        .expect("placement")
        .get(0);
    assert_eq!(now_on, to, "the shard did not move");
    store.complete(&held, Response::new(201, "moved"))?;
    let Claim::Completed(record) = store.claim(&key, fp("m"))? else {
        panic!("no replay after the move");
    };
    assert_eq!(record.response, Response::new(201, "moved"));
    let other = Key::scoped("after", "moving")?;
    let Claim::Acquired(after) = store.claim(&other, fp("m"))? else {
        panic!("not acquired after the move");
    };
    let highest_before = seen.iter().map(|(_, t)| *t).chain([held.token()]).max();
    assert!(
        Some(after.token()) > highest_before,
        "a token went down after the move"
    );
    // The multi-shard reads: verify's cursor (its token check against the coordinator's
    // sequence included), the walk over every record, and stats.
    let report = store.verify()?;
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(
        report.records, 2,
        "the two records of \"moving\" (the rest were released)"
    );
    assert_eq!(store.records()?.count(), 2);
    let stats = store.stats()?;
    assert_eq!((stats.in_progress, stats.completed), (1, 1), "{stats:?}");
    Ok(())
}

#[test]
fn effects_on_a_colocated_table_commit_with_the_response() -> idempotency_store::Result<()> {
    let Some((url, _)) = cluster() else {
        return Ok(());
    };
    let _serial = lock();
    let schema = Schema::named(url.clone(), "citus", "effects");
    let store = distributed(&schema).connect(&url)?;
    let ledger = format!("\"{}\".ledger", schema.name);
    let mut client = admin(&crate::common::pg::raw_url(&url));
    client
        .batch_execute(&format!(
            "CREATE TABLE {ledger} (key text NOT NULL, amount bigint NOT NULL); \
             SELECT create_distributed_table('{ledger}', 'key', \
                 colocate_with := '\"{}\".idempotency_keys');",
            schema.name
        ))
        .expect("the ledger");
    let count = |client: &mut postgres::Client, key: &str| -> i64 {
        client
            .query_one(
                &format!("SELECT count(*) FROM {ledger} WHERE key = $1::text"),
                &[&key],
            )
            .expect("count")
            .get(0)
    };
    // Committed together.
    let key = Key::new("charge-1")?;
    let Claim::Acquired(lease) = store.claim(&key, fp("1"))? else {
        panic!("not acquired");
    };
    let sql = format!("INSERT INTO {ledger} (key, amount) VALUES ($1::text, $2::bigint)");
    store
        .complete_with(&lease, Response::new(201, "charged"), |tx| {
            tx.execute(&sql, &[&"charge-1", &4999i64]).map(drop)
        })?
        .expect("the effect");
    assert_eq!(count(&mut client, "charge-1"), 1);
    assert!(matches!(store.claim(&key, fp("1"))?, Claim::Completed(_)));
    // Rolled back together: the effect's error leaves neither row nor response.
    let key = Key::new("charge-2")?;
    let Claim::Acquired(lease) = store.claim(&key, fp("2"))? else {
        panic!("not acquired");
    };
    let failed = store.complete_with(&lease, Response::new(201, "charged"), |tx| {
        tx.execute(&sql, &[&"charge-2", &1i64])?;
        Err::<(), _>(tx.execute("SELECT 1/0", &[]).unwrap_err())
    })?;
    assert!(failed.is_err());
    assert_eq!(count(&mut client, "charge-2"), 0);
    assert!(matches!(
        store.claim(&key, fp("2"))?,
        Claim::InProgress { .. }
    ));
    // The lease still holds: it completes.
    store.complete(&lease, Response::new(201, "later"))?;
    Ok(())
}

#[test]
fn what_the_mode_cannot_do_is_refused_at_connect() {
    let Some((url, _)) = cluster() else {
        return;
    };
    let _serial = lock();
    let schema = Schema::named(url.clone(), "citus", "refused");
    let refused = |result: idempotency_store::Result<PgStore>, needle: &str| match result {
        Err(Error::InvalidConfig { reason }) => {
            assert!(reason.contains(needle), "{needle}: {reason}");
        }
        other => panic!("{needle}: not refused: {other:?}"),
    };
    refused(
        distributed(&schema).max_records(10).connect(&url),
        "max_records",
    );
    refused(
        distributed(&schema).prepare_statements(false).connect(&url),
        "prepare_statements(false)",
    );
    // A worker: the port of one from the coordinator's node table.
    let mut client = admin(&crate::common::pg::raw_url(&url));
    let port: i32 = client
        .query_one(
            "SELECT nodeport FROM pg_dist_node WHERE groupid > 0 ORDER BY nodeport LIMIT 1",
            &[],
        )
        .expect("a worker")
        .get(0);
    let worker = url
        .split_whitespace()
        .map(|kv| {
            if kv.starts_with("port=") {
                format!("port={port}")
            } else {
                kv.to_owned()
            }
        })
        .collect::<Vec<_>>()
        .join(" ");
    refused(distributed(&schema).connect(&worker), "coordinator");
    // And a server without Citus: the one of IDEMPOTENCY_PG_URL, when it is not the
    // coordinator (the main test run).
    if let Some(plain) = crate::common::pg::url().filter(|u| *u != url) {
        let schema = Schema::named(plain.clone(), "citus", "plain");
        refused(distributed(&schema).connect(&plain), "citus extension");
    }
}

/// What the load saw.
#[derive(Default)]
struct Ledger {
    claimed: Vec<String>,
    completed: Vec<String>,
    /// Claims that failed with nothing applied: the key must still be free.
    refused: Vec<String>,
    /// Completions that failed with their outcome unknown, and their leases: the retry the
    /// contract prescribes must answer `Ok`.
    in_doubt: Vec<(String, Lease)>,
    errors: usize,
}

/// One load thread's calls on fresh keys `t{t}-{i}` until `stop`: every fourth claim held,
/// the others completed with their name as the body.
fn load(t: usize, store: &PgStore, stop: &AtomicBool, ledger: &Mutex<Ledger>) {
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let name = format!("t{t}-{i}");
        let key = Key::new(&name).expect("key");
        let lease = match store.claim(&key, fp(&name)) {
            Ok(Claim::Acquired(lease)) => lease,
            Ok(other) => panic!("{name}: a fresh key answered {other:?}"),
            Err(err) => {
                let mut ledger = ledger.lock().unwrap();
                ledger.errors += 1;
                if !err.outcome_unknown() {
                    ledger.refused.push(name);
                }
                drop(ledger);
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
        };
        ledger.lock().unwrap().claimed.push(name.clone());
        if i.is_multiple_of(4) {
            continue; // held, never completed
        }
        match store.complete(&lease, Response::new(201, name.clone())) {
            Ok(()) => ledger.lock().unwrap().completed.push(name),
            Err(err) => {
                let mut ledger = ledger.lock().unwrap();
                ledger.errors += 1;
                if err.outcome_unknown() {
                    ledger.in_doubt.push((name, lease));
                }
                drop(ledger);
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
}

#[test]
fn a_worker_restart_under_load_loses_no_acknowledged_write() -> idempotency_store::Result<()> {
    let Some((url, setup)) = cluster() else {
        return Ok(());
    };
    let _serial = lock();
    const THREADS: usize = 16;
    let schema = Schema::named(url.clone(), "citus", "restart");
    let store = Arc::new(
        distributed(&schema)
            .pool_size(THREADS as u32)
            .connection_timeout(Duration::from_secs(5))
            // No lease lapses during the run: a re-claim that acquires is a lost record.
            .lease(Duration::from_secs(600))
            .connect(&url)?,
    );
    let stop = Arc::new(AtomicBool::new(false));
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (store, stop, ledger) = (store.clone(), stop.clone(), ledger.clone());
            std::thread::spawn(move || load(t, &store, &stop, &ledger))
        })
        .collect();
    std::thread::sleep(Duration::from_secs(2));
    let before = ledger.lock().unwrap().claimed.len();
    let out = Command::new(&setup)
        .args(["restart-worker", "1"])
        .output()
        .expect("run the set-up script");
    assert!(
        out.status.success(),
        "restart-worker: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    for thread in threads {
        thread.join().expect("a load thread panicked");
    }
    let mut ledger = ledger.lock().unwrap();
    let after = ledger.claimed.len();
    assert!(
        before > 0 && after > before,
        "no load around the restart: {before}, {after}"
    );
    assert!(
        ledger.errors > 0,
        "the restart failed no call: was the worker restarted?"
    );
    // A completion whose outcome was unknown, retried as the contract says (same lease, same
    // response), answers Ok whether or not the first call landed; from then on it replays.
    let in_doubt = std::mem::take(&mut ledger.in_doubt);
    for (name, lease) in &in_doubt {
        store.complete(lease, Response::new(201, name.clone()))?;
        ledger.completed.push(name.clone());
    }
    // A claim refused with nothing applied left its key free.
    for name in &ledger.refused {
        let claim = store.claim(&Key::new(name)?, fp(name))?;
        assert!(
            matches!(claim, Claim::Acquired(_)),
            "{name}: its claim failed with nothing applied, yet the key answers {claim:?}"
        );
    }
    // Every acknowledged completion replays; every acknowledged claim is still held (a
    // completion that failed with nothing applied left it in progress).
    let completed: HashSet<&String> = ledger.completed.iter().collect();
    let mut lost: HashMap<&str, Vec<String>> = HashMap::new();
    for name in &ledger.claimed {
        let key = Key::new(name)?;
        match store.claim(&key, fp(name))? {
            Claim::Completed(record) if completed.contains(name) => {
                assert_eq!(record.response, Response::new(201, name.clone()));
            }
            Claim::InProgress { .. } if !completed.contains(name) => {}
            other => lost
                .entry(if completed.contains(name) {
                    "completion"
                } else {
                    "claim"
                })
                .or_default()
                .push(format!("{name}: {other:?}")),
        }
    }
    eprintln!(
        "worker restart: {} claims and {} completions acknowledged, {} calls failed ({} \
         completions in doubt, {} claims refused with nothing applied), lost: {:?}",
        ledger.claimed.len(),
        ledger.completed.len(),
        ledger.errors,
        in_doubt.len(),
        ledger.refused.len(),
        lost
    );
    assert!(lost.is_empty(), "acknowledged writes lost: {lost:?}");
    Ok(())
}
