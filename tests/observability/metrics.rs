//! `Store::metrics` and `PgStore::metrics`: each outcome driven once, and the exact change it
//! makes to the counters, on both backends (PostgreSQL only with `IDEMPOTENCY_PG_URL` set).

use std::sync::Arc;
use std::time::Duration;

use idempotency_store::{
    Claim, Error, Fingerprint, IdempotencyStore, Key, Lease, ManualClock, Response, Store,
    Timestamp, metrics::Metrics,
};

use crate::common::disk::FailingSyncs;

const LEASE: Duration = Duration::from_secs(60);
const RETENTION: Duration = Duration::from_secs(3600);
const T0: u64 = 1_700_000_000_000;

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", body])
}

fn key(name: &str) -> Key {
    Key::new(name).expect("valid key")
}

fn acquire<S: IdempotencyStore>(store: &S, key: &Key) -> Lease {
    match store.claim(key, fp("a")) {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Drives every outcome the trait can produce and checks each counter's change, on `store`
/// whose lease is `LEASE`, retention `RETENTION`, key limit 16 bytes, response limit 64 bytes.
fn drive<S: IdempotencyStore>(store: &S, clock: &ManualClock, metrics: impl Fn() -> Metrics) {
    let before = metrics();
    assert_eq!(
        before.claims,
        Default::default(),
        "a new store has counted nothing"
    );

    let k1 = key("k1");
    let mut lease = acquire(store, &k1);
    assert!(matches!(
        store.claim(&k1, fp("a")),
        Ok(Claim::InProgress { .. })
    ));
    assert!(matches!(
        store.claim(&k1, fp("b")),
        Ok(Claim::Mismatch { .. })
    ));
    store.heartbeat(&mut lease).expect("heartbeat");
    let big = Response::new(200, vec![b'x'; 100]);
    assert!(matches!(
        store.complete(&lease, big),
        Err(Error::ResponseTooLarge { .. })
    ));
    store
        .complete(&lease, Response::new(201, "ok"))
        .expect("complete");
    assert!(matches!(store.claim(&k1, fp("a")), Ok(Claim::Completed(_))));
    assert!(matches!(
        store.complete(&lease, Response::new(201, "ok")),
        Err(Error::LeaseLost)
    ));
    let long = key("a-key-longer-than-sixteen-bytes");
    assert!(matches!(
        store.claim(&long, fp("a")),
        Err(Error::InvalidKey { .. })
    ));

    let m = metrics();
    assert_eq!(m.claims.acquired, 1);
    assert_eq!(m.claims.in_progress, 1);
    assert_eq!(m.claims.mismatch, 1);
    assert_eq!(m.claims.replayed, 1);
    assert_eq!(m.claims.taken_over, 0);
    assert_eq!(m.heartbeats, 1);
    assert_eq!(m.completes, 1);
    assert_eq!(m.lease_lost, 1);
    assert_eq!(m.errors.lease_lost, 1);
    assert_eq!(m.errors.response_too_large, 1);
    assert_eq!(m.errors.invalid_key, 1);
    assert_eq!(m.errors.storage + m.errors.corrupted + m.errors.other, 0);
    assert_eq!(
        m.claim_latency.count, 5,
        "every claim is timed, errors included"
    );
    assert_eq!(m.complete_latency.count, 3);
    assert_eq!(m.claim_latency.buckets.iter().sum::<u64>(), 5);

    // A lapsed lease: taken over; the old holder's calls are refused as lost.
    let k2 = key("k2");
    let mut old = acquire(store, &k2);
    clock.advance(LEASE + Duration::from_secs(1));
    let new = acquire(store, &k2);
    assert_eq!(new.attempt(), 2);
    assert!(matches!(store.release(&old), Err(Error::LeaseLost)));
    assert!(matches!(store.heartbeat(&mut old), Err(Error::LeaseLost)));
    assert!(matches!(
        store.checkpoint(&mut old, b"step".to_vec()),
        Err(Error::LeaseLost)
    ));
    store.release(&new).expect("release");

    let m2 = metrics();
    assert_eq!(m2.claims.acquired - m.claims.acquired, 1);
    assert_eq!(m2.claims.taken_over, 1);
    assert_eq!(m2.releases, 1);
    assert_eq!(
        m2.heartbeats, 1,
        "a refused heartbeat does not count as one"
    );
    assert_eq!(m2.lease_lost - m.lease_lost, 3);
    assert_eq!(m2.errors.lease_lost - m.errors.lease_lost, 3);

    // Past retention, k1's record is swept.
    clock.advance(RETENTION + Duration::from_secs(1));
    assert_eq!(store.sweep(100).expect("sweep"), 1);
    assert_eq!(metrics().swept, 1);
    assert_eq!(metrics().quota_refusals, 0);
}

fn open_redb(builder: &mut idempotency_store::StoreBuilder) -> (Store, ManualClock) {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = builder
        .lease(LEASE)
        .retention(RETENTION)
        .max_key_len(16)
        .max_response_bytes(64)
        .clock(clock.clone())
        .open_in_memory()
        .expect("open");
    (store, clock)
}

#[test]
fn redb_counts_each_outcome() {
    let (store, clock) = open_redb(&mut Store::builder());
    drive(&store, &clock, || store.metrics());
    let m = store.metrics();
    assert_eq!(m.backend, "redb");
    let engine = m.engine.expect("the redb store reports its engine");
    assert!(engine.batches >= 1 && engine.batched_ops >= engine.batches);
    assert!(engine.max_batch >= 1);
    assert!(engine.log_writes >= 1);
    assert_eq!(engine.file_bytes, None, "an in-memory store has no file");
}

#[test]
fn redb_counts_quota_refusals() {
    let (store, _clock) = open_redb(Store::builder().max_records(1));
    let _lease = acquire(&store, &key("first"));
    assert!(matches!(
        store.claim(&key("second"), fp("a")),
        Err(Error::QuotaExceeded { .. })
    ));
    let m = store.metrics();
    assert_eq!((m.quota_refusals, m.errors.quota_exceeded), (1, 1));
    assert_eq!(m.claims.acquired, 1);
}

#[test]
fn redb_counts_claim_wait_timeouts() {
    let (store, _clock) = open_redb(&mut Store::builder());
    let k = key("busy");
    let _lease = acquire(&store, &k);
    let claim = store.claim_wait(&k, fp("a"), Duration::from_millis(20));
    assert!(matches!(claim, Ok(Claim::InProgress { .. })));
    let m = store.metrics();
    assert_eq!(m.wait_timeouts, 1);
    assert!(m.waits >= 1, "it blocked before giving up: {}", m.waits);
    assert_eq!(m.claims.in_progress, 1 + m.waits);
}

/// `claim_wait` on a key held throughout, then on one completed while it waits: each pause
/// counts as a wait, giving up at the deadline as a timeout, and every claim it made behind
/// them as an in-progress answer. Returns the waits of the 200 ms wait and of the one that
/// ended in a replay, which depend on the backend (the redb store sleeps on a condvar, the
/// trait's default polls with a backoff).
fn drive_waits<S: IdempotencyStore + Sync>(
    store: &S,
    metrics: impl Fn() -> Metrics + Sync,
) -> (u64, u64) {
    let k = key("busy");
    let lease = acquire(store, &k);

    let before = metrics();
    let claim = store.claim_wait(&k, fp("a"), Duration::ZERO);
    assert!(matches!(claim, Ok(Claim::InProgress { .. })), "{claim:?}");
    let m = metrics();
    assert_eq!(m.wait_timeouts - before.wait_timeouts, 1);
    assert_eq!(
        m.waits - before.waits,
        0,
        "no time to wait: it never blocked"
    );
    assert_eq!(m.claims.in_progress - before.claims.in_progress, 1);

    let before = m;
    let claim = store.claim_wait(&k, fp("a"), Duration::from_millis(200));
    assert!(matches!(claim, Ok(Claim::InProgress { .. })), "{claim:?}");
    let m = metrics();
    let timed_out = m.waits - before.waits;
    assert_eq!(m.wait_timeouts - before.wait_timeouts, 1);
    assert_eq!(
        m.claims.in_progress - before.claims.in_progress,
        timed_out + 1,
        "one claim before each wait, and the last one at the deadline"
    );

    let before = m;
    let claim = std::thread::scope(|s| {
        let waiter = s.spawn(|| store.claim_wait(&k, fp("a"), Duration::from_secs(60)));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while metrics().waits == before.waits {
            assert!(
                std::time::Instant::now() < deadline,
                "the waiter never waited"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        store
            .complete(&lease, Response::new(201, "ok"))
            .expect("complete");
        waiter.join().expect("waiter")
    });
    assert!(matches!(claim, Ok(Claim::Completed(_))), "{claim:?}");
    let m = metrics();
    let replayed = m.waits - before.waits;
    assert_eq!(m.wait_timeouts, before.wait_timeouts, "it did not time out");
    assert_eq!(m.claims.replayed - before.claims.replayed, 1);
    assert_eq!(
        m.claims.in_progress - before.claims.in_progress,
        replayed,
        "one in-progress claim before each wait, then the replay"
    );
    (timed_out, replayed)
}

#[test]
fn redb_counts_claim_wait_waits_exactly() {
    let (store, _clock) = open_redb(&mut Store::builder());
    // The condvar wakes a waiter at its deadline or at the settling call, never before.
    assert_eq!(drive_waits(&store, || store.metrics()), (1, 1));
}

#[test]
fn redb_counts_the_overlay_until_it_is_flushed() {
    let (store, _clock) = open_redb(&mut Store::builder());
    let overlay = || {
        let engine = store.metrics().engine.expect("engine");
        (engine.overlay_records, engine.overlay_bytes)
    };
    assert_eq!(overlay(), (0, 0), "a new store has nothing logged");
    // Fewer records than the 1024 that freeze a generation for the flush thread, so all of
    // them stay in the overlay until something flushes it.
    let keys: Vec<Key> = (0..100).map(|i| key(&format!("key-{i:03}"))).collect();
    let mut leases = vec![acquire(&store, &keys[0])];
    let (records, one) = overlay();
    assert_eq!(records, 1);
    assert!(one > 7, "more than the key's 7 bytes: {one}");
    leases.extend(keys[1..].iter().map(|k| acquire(&store, k)));
    let (records, bytes) = overlay();
    assert_eq!(records, 100, "one record per claimed key");
    // Same-length keys, one fingerprint and a manual clock: every claim adds the same bytes.
    assert_eq!(bytes, 100 * one);
    for lease in &leases {
        store
            .complete(lease, Response::new(200, "ok"))
            .expect("complete");
    }
    let (records, completed) = overlay();
    assert_eq!(records, 100, "a record changed again is still one record");
    assert!(
        completed > bytes,
        "the responses were added: {completed} after {bytes}"
    );
    // `stats` walks redb's tables, so it writes the overlay into them first.
    assert_eq!(store.stats().expect("stats").completed, 100);
    assert_eq!(overlay(), (0, 0), "flushed");
}

/// A larger log takes larger overlay generations (1024 records per MiB of log, up to 16):
/// 3000 claims all stay in the overlay of a store with a 4 MiB log (the default), while a 1 MiB
/// log hands generations of 1024 to the flush thread (and its 512 KiB halves fill).
#[test]
fn redb_overlay_generations_grow_with_the_log() {
    let overlay_after_claims = |log_size: u64| {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::builder()
            .log_size(log_size)
            .open(dir.path().join("store.idem"))
            .expect("open");
        for i in 0..3000 {
            let _lease = acquire(&store, &key(&format!("key-{i:04}")));
        }
        store.metrics().engine.expect("engine").overlay_records
    };
    let one_mib = overlay_after_claims(1 << 20);
    assert!(one_mib < 2500, "1 MiB: {one_mib} records in the overlay");
    assert_eq!(overlay_after_claims(4 << 20), 3000, "4 MiB");
}

#[test]
fn redb_shows_the_sweepers_last_error() {
    let disk = FailingSyncs::default();
    let failing = Arc::clone(&disk.sim().faults.0);
    let store = Arc::new(Store::builder().open_with_backend(disk).expect("open"));
    failing.store(true, std::sync::atomic::Ordering::SeqCst);
    let failed = store.claim(&key("k"), fp("a"));
    assert!(matches!(failed, Err(Error::Storage { .. })), "{failed:?}");
    assert_eq!(
        store.metrics().engine.expect("engine").sweeper_last_error,
        None
    );
    // The failed sync poisoned the store: every sweep fails until it is reopened.
    let sweeper = store.start_sweeper(Duration::from_millis(40), 64);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while sweeper.errors() < 2 {
        assert!(std::time::Instant::now() < deadline, "no sweep failed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let engine = store.metrics().engine.expect("engine");
    let shown = sweeper.last_error().map(|err| err.to_string());
    assert!(matches!(sweeper.last_error(), Some(Error::Poisoned { .. })));
    assert_eq!(
        engine.sweeper_last_error, shown,
        "the error the sweeper met"
    );
    assert_eq!(engine.sweeper_last_run, None, "no round finished");
    assert!(sweeper.stop().is_err(), "it was still failing");
}

#[test]
fn redb_reports_merges_file_size_and_the_sweeper() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store.idem");
    let store = Arc::new(
        Store::builder()
            .log_size(64 * 1024)
            .open(&path)
            .expect("open"),
    );
    for i in 0..2000 {
        let lease = acquire(&*store, &key(&format!("key-{i}")));
        store
            .complete(&lease, Response::new(200, "ok"))
            .expect("complete");
    }
    let sweeper = store.start_sweeper(Duration::from_secs(3600), 100);
    // The first round runs at once; wait for it to be reported before stopping the sweeper.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while store
        .metrics()
        .engine
        .and_then(|e| e.sweeper_last_run)
        .is_none()
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    sweeper.stop().expect("sweeper");
    let m = store.metrics();
    let engine = m.engine.expect("engine");
    assert_eq!((m.claims.acquired, m.completes), (2000, 2000));
    assert!(engine.merges >= 1, "a small log merges: {engine:?}");
    assert!(engine.max_merge >= engine.last_merge && engine.max_merge > Duration::ZERO);
    assert_eq!(
        engine.file_bytes,
        Some(std::fs::metadata(&path).expect("meta").len())
    );
    assert!(engine.sweeper_last_run.is_some());
    assert_eq!(engine.sweeper_last_error, None);
}

/// A sweep's pace: the records it deleted, its time, and the calls that shared a batch with
/// its deletions (claims made while it runs, from another thread).
#[test]
fn redb_shows_a_sweeps_pace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = Store::builder()
        .retention(RETENTION)
        .clock(clock.clone())
        .open(dir.path().join("store.idem"))
        .expect("open");
    for i in 0..3000 {
        let lease = acquire(&store, &key(&format!("old-{i}")));
        store
            .complete(&lease, Response::new(200, "ok"))
            .expect("complete");
    }
    clock.advance(RETENTION);
    let before = store.metrics();
    let done = std::sync::atomic::AtomicBool::new(false);
    let claimed = std::thread::scope(|s| {
        let claimer = s.spawn(|| {
            let mut n = 0;
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let _lease = acquire(&store, &key(&format!("new-{n}")));
                n += 1;
            }
            n
        });
        assert_eq!(store.sweep_all().expect("sweep"), 3000);
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        claimer.join().expect("claimer")
    });
    let m = store.metrics();
    let engine = m.engine.expect("engine");
    assert_eq!(m.swept - before.swept, 3000);
    assert!(engine.sweep_time > Duration::ZERO, "{engine:?}");
    assert!(engine.sweep_paced <= engine.sweep_time, "{engine:?}");
    assert!(
        engine.sweep_shared_calls <= claimed,
        "{claimed} claims: {engine:?}"
    );
}

/// A store in memory writes no log (nothing of it outlives the `Store`), and merges each full
/// overlay generation durably instead: redb gives back the pages that unsynced commits free
/// from its last durable state only at a durable commit. With no log to bound them, its
/// generations hold 16,384 records, whatever `log_size` says.
#[test]
fn redb_in_memory_writes_no_log_and_merges_each_generation() {
    const GENERATION: usize = 16_384;
    let store = Store::builder().open_in_memory().expect("open");
    let fill = |keys: std::ops::Range<usize>| {
        for i in keys {
            let lease = acquire(&store, &key(&format!("key-{i}")));
            store
                .complete(&lease, Response::new(200, "ok"))
                .expect("complete");
        }
        store.metrics().engine.expect("engine")
    };
    let engine = fill(0..GENERATION - 1);
    assert_eq!(engine.log_writes, 0, "no log entry in memory: {engine:?}");
    assert_eq!(
        engine.merges,
        0,
        "{} records are less than a generation: {engine:?}",
        GENERATION - 1
    );
    // Three generations: the second one's merge has had a generation's time to finish.
    let engine = fill(GENERATION - 1..3 * GENERATION + 1);
    assert_eq!(engine.log_writes, 0, "no log entry in memory: {engine:?}");
    assert!(
        engine.merges >= 2,
        "{} records fill three generations: {engine:?}",
        3 * GENERATION + 1
    );
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_counts_each_outcome() {
    let Some(url) = crate::common::pg::url() else {
        return;
    };
    let schema = format!("metrics_{}", std::process::id());
    let admin = |sql: &str| crate::common::pg::admin(&url, sql);
    admin(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = idempotency_store::pg::PgStore::builder()
        .schema(schema.as_str())
        .lease(LEASE)
        .retention(RETENTION)
        .max_key_len(16)
        .max_response_bytes(64)
        .pool_size(2)
        .clock(clock.clone())
        .connect(&url)
        .expect("connect");
    drive(&store, &clock, || store.metrics());
    let m = store.metrics();
    assert_eq!((m.backend, m.engine), ("postgres", None));
    drop(store);

    // A quota of one record: the second new key is refused and counted.
    admin(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    let store = idempotency_store::pg::PgStore::builder()
        .schema(schema.as_str())
        .max_records(1)
        .pool_size(1)
        .connect(&url)
        .expect("connect");
    let _lease = acquire(&store, &key("first"));
    assert!(matches!(
        store.claim(&key("second"), fp("a")),
        Err(Error::QuotaExceeded { .. })
    ));
    let m = store.metrics();
    assert_eq!((m.quota_refusals, m.errors.quota_exceeded), (1, 1));
    assert_eq!(m.claims.acquired, 1);
    drop(store);
    admin(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_counts_claim_wait_waits_and_timeouts() {
    let Some(url) = crate::common::pg::url() else {
        return;
    };
    let schema = format!("metrics_wait_{}", std::process::id());
    let admin = |sql: &str| crate::common::pg::admin(&url, sql);
    admin(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    let store = idempotency_store::pg::PgStore::builder()
        .schema(schema.as_str())
        .lease(LEASE)
        .pool_size(2)
        .connect(&url)
        .expect("connect");
    let (timed_out, replayed) = drive_waits(&store, || store.metrics());
    // It re-claims after pauses of 10, 20, 40 and 80 ms and then the rest of the 200 ms, so
    // it paused one to five times.
    assert!((1..=5).contains(&timed_out), "{timed_out}");
    assert!(replayed >= 1, "{replayed}");
    drop(store);
    admin(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
}

/// The README's "Metrics" sample, verbatim.
#[test]
fn readme_sample_holds() -> idempotency_store::Result<()> {
    let store = Store::builder().open_in_memory()?;
    let key = Key::new("order-1")?;
    let fp = Fingerprint::of(["POST", "/orders", "{}"]);
    let Claim::Acquired(lease) = store.claim(&key, fp)? else {
        unreachable!()
    };
    store.complete(&lease, Response::new(201, "created"))?;
    let _replay = store.claim(&key, fp)?;
    let _mismatch = store.claim(&key, Fingerprint::of(["POST", "/orders", "{\"x\":1}"]))?;

    let m = store.metrics();
    assert_eq!(
        (m.claims.acquired, m.claims.replayed, m.claims.mismatch),
        (1, 1, 1)
    );
    assert_eq!(m.completes, 1);
    assert_eq!(m.claim_latency.count, 3);
    let engine = m.engine.expect("the redb store reports its engine");
    assert!(engine.batches >= 2);
    Ok(())
}

/// The failover report: none on redb; on PostgreSQL the check at connect, one on each new
/// pooled connection's first use, one per period on a busy store and one per `stats()`, the
/// same in `metrics()` (no I/O) and `stats()`, and agreeing with a fresh read.
#[test]
fn failover_safety_is_reported_as_checked() {
    let store = Store::builder().open_in_memory().expect("open");
    assert_eq!(store.metrics().failover, None);
    assert_eq!(store.stats().expect("stats").failover, None);

    #[cfg(feature = "postgres")]
    {
        use idempotency_store::pg::PgStore;
        let Some(url) = crate::common::pg::url() else {
            return;
        };
        let checks = |store: &PgStore| store.metrics().failover.expect("reported").checks;
        let store = PgStore::builder()
            .pool_size(1)
            .failover_check_period(Duration::from_secs(3600))
            .connect(&url)
            .expect("connect");
        let at_connect = store.failover_safety_at_connect().clone();
        let status = store.metrics().failover.expect("reported");
        assert_eq!(status.checks, 1, "{status:?}");
        assert_eq!(status.safe, at_connect.is_failover_safe(), "{status:?}");
        assert_eq!(status.detail, at_connect.to_string());
        assert_eq!(status.unsafe_checks, u64::from(!status.safe));
        store.lookup(&key("absent")).expect("lookup");
        assert_eq!(checks(&store), 2, "a new connection's first use checks");
        store.lookup(&key("absent")).expect("lookup");
        assert_eq!(checks(&store), 2, "a used connection, the period not due");
        let stats = store.stats().expect("stats").failover.expect("reported");
        assert_eq!(stats.checks, 3, "stats() checks: {stats:?}");
        assert_eq!(store.metrics().failover, Some(stats.clone()));
        let fresh = store.failover_safety().expect("read now");
        assert_eq!(stats.safe, fresh.is_failover_safe());
        assert_eq!(stats.detail, fresh.to_string());

        let busy = PgStore::builder()
            .pool_size(1)
            .failover_check_period(Duration::from_millis(20))
            .connect(&url)
            .expect("connect");
        busy.lookup(&key("absent")).expect("lookup");
        assert_eq!(checks(&busy), 2);
        std::thread::sleep(Duration::from_millis(40));
        busy.lookup(&key("absent")).expect("lookup");
        assert_eq!(checks(&busy), 3, "the period elapsed: the call checked");
    }
}
