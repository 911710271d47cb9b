//! `PgStore` while PostgreSQL loses its connections: every backend terminated
//! (`pg_terminate_backend`), then the server restarted, fast and immediate
//! (`pg_ctlcluster … restart -m fast|immediate`), then stopped for 16 s, all under a workload of threads that race in
//! pairs on each key. A failed call is retried the way the docs tell a caller to (a claim with
//! the same claim id, a settling call with the same lease), and the test checks the end to end
//! promise: 0 lost acknowledgements, 0 double acquires, no key left stuck in progress by its
//! own winner, every completion retried after a connection error settled (never a false
//! `LeaseLost`), and the first success within 1 s of the server accepting connections again.
//!
//! It controls the server, so it runs only where the script that started the server says so:
//! `.ci/run` sets `IDEMPOTENCY_PG_CLUSTER` ("15 main": the version and cluster name for
//! `pg_ctlcluster`) beside `IDEMPOTENCY_PG_URL`. Skipped with a printed reason without them
//! (failed under `CI=true`). Its own test binary, so no other test shares the server while it
//! restarts.
#![cfg(feature = "postgres")]

use std::collections::HashMap;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_store::{
    Claim, ClaimId, Error, Fingerprint, IdempotencyStore, Key, Lease, RecordState, Response,
    pg::PgStore,
};

/// Threads; two per key, so every key is raced.
const THREADS: usize = 32;
/// How long a caller keeps retrying one call before the test calls the key stuck.
const GIVE_UP: Duration = Duration::from_secs(40);
/// The promise of issue 30: serving again within a second of the server being ready.
const RECOVERY: Duration = Duration::from_secs(1);
/// A long outage: r2d2's default backoff (doubling to 15 s) has its attempts at 12.4 s and 25.2 s.
const OUTAGE: Duration = Duration::from_secs(16);

struct Env {
    url: String,
    cluster: Vec<String>,
}

fn env() -> Option<Env> {
    let url = std::env::var("IDEMPOTENCY_PG_URL")
        .ok()
        .filter(|u| !u.trim().is_empty());
    let cluster = std::env::var("IDEMPOTENCY_PG_CLUSTER")
        .ok()
        .filter(|c| !c.trim().is_empty());
    match (url, cluster) {
        (Some(url), Some(cluster)) => Some(Env {
            url,
            cluster: cluster.split_whitespace().map(str::to_owned).collect(),
        }),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => panic!(
            "CI=true but IDEMPOTENCY_PG_URL or IDEMPOTENCY_PG_CLUSTER is not set (see .ci/run)"
        ),
        _ => {
            eprintln!(
                "skipped: IDEMPOTENCY_PG_URL and IDEMPOTENCY_PG_CLUSTER are not both set; see .ci/run"
            );
            None
        }
    }
}

/// What the workers saw, for the checks at the end.
#[derive(Default)]
struct Ledger {
    /// Per key: the distinct tokens that were acquired (one acquisition, however often its
    /// claim id got it back).
    acquired: HashMap<String, Vec<u64>>,
    /// Per key: the bodies whose completion was acknowledged (`Ok`).
    acked: HashMap<String, Vec<Vec<u8>>>,
    /// Calls that failed and were retried, by kind.
    retried_claims: usize,
    retried_completes: usize,
    /// Successful calls, with when they returned.
    successes: Vec<Instant>,
}

struct Shared {
    store: PgStore,
    ledger: Mutex<Ledger>,
    stop: AtomicBool,
    failures: Mutex<Vec<String>>,
}

impl Shared {
    fn fail(&self, what: String) {
        self.failures.lock().expect("failures").push(what);
    }

    fn success(&self) {
        self.ledger
            .lock()
            .expect("ledger")
            .successes
            .push(Instant::now());
    }
}

/// Retries `call` while it fails with a storage error (as a caller after a lost connection
/// should), up to [`GIVE_UP`]; counts the retries.
fn retrying<T>(
    shared: &Shared,
    retries: &mut usize,
    mut call: impl FnMut() -> idempotency_store::Result<T>,
) -> Option<idempotency_store::Result<T>> {
    let started = Instant::now();
    loop {
        match call() {
            Err(err @ Error::Storage { .. }) => {
                if started.elapsed() > GIVE_UP {
                    shared.fail(format!("gave up after {GIVE_UP:?}: {err}"));
                    return None;
                }
                *retries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return Some(other),
        }
    }
}

/// One worker: claims key pairs `2n` and `2n + 1`'s shared key, completes what it wins, and
/// waits for the other's answer when it loses.
fn worker(shared: &Shared, me: usize) {
    let fp = Fingerprint::of(["POST", "/payments", "4999"]);
    let mut round = 0usize;
    while !shared.stop.load(Ordering::SeqCst) {
        // Workers 2k and 2k + 1 share each round's key.
        let name = format!("pay-{}-{round}", me / 2);
        round += 1;
        let Ok(key) = Key::new(&name) else { return };
        let id = ClaimId::random();
        let (mut claim_retries, mut complete_retries) = (0, 0);
        let started = Instant::now();
        let lease = loop {
            let Some(claim) = retrying(shared, &mut claim_retries, || {
                shared.store.claim_with_id(&key, fp, id)
            }) else {
                return;
            };
            match claim {
                Ok(Claim::Acquired(lease)) => break Some(lease),
                Ok(Claim::Completed(_)) => break None,
                Ok(Claim::InProgress { .. }) if started.elapsed() < GIVE_UP => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Ok(other) => {
                    shared.fail(format!("{name}: worker {me} stuck on {other:?}"));
                    return;
                }
                Err(err) => {
                    shared.fail(format!("{name}: claim failed: {err}"));
                    return;
                }
            }
        };
        shared.success();
        if let Some(lease) = lease {
            settle(shared, &name, me, &lease, &mut complete_retries);
        }
        let mut ledger = shared.ledger.lock().expect("ledger");
        ledger.retried_claims += claim_retries;
        ledger.retried_completes += complete_retries;
    }
}

fn settle(shared: &Shared, name: &str, me: usize, lease: &Lease, retries: &mut usize) {
    {
        let mut ledger = shared.ledger.lock().expect("ledger");
        let tokens = ledger.acquired.entry(name.to_owned()).or_default();
        if !tokens.contains(&lease.token()) {
            tokens.push(lease.token());
        }
    }
    let body = format!("charged by worker {me}").into_bytes();
    let response = Response::new(201, body.clone());
    match retrying(shared, retries, || {
        shared.store.complete(lease, response.clone())
    }) {
        Some(Ok(())) => {
            shared.success();
            let mut ledger = shared.ledger.lock().expect("ledger");
            ledger.acked.entry(name.to_owned()).or_default().push(body);
        }
        Some(Err(err)) => shared.fail(format!("{name}: complete after {retries} retries: {err}")),
        None => {}
    }
}

fn admin(url: &str) -> postgres::Client {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match postgres::Client::connect(url, postgres::NoTls) {
            Ok(client) => return client,
            Err(err) if Instant::now() < deadline => {
                let _ = err;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(err) => panic!("the server did not come back: {err}"),
        }
    }
}

/// Terminates every other backend of this database.
fn terminate_all(url: &str) -> u64 {
    let mut client = admin(url);
    let row = client
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE datname = current_database() AND pid <> pg_backend_pid() \
             AND usename = current_user",
            &[],
        )
        .expect("terminate backends");
    row.get::<_, i64>(0).try_into().unwrap_or(0)
}

fn pg_ctlcluster(env: &Env, args: &[&str]) {
    let status = Command::new("pg_ctlcluster")
        .args(&env.cluster)
        .args(args)
        .status()
        .expect("run pg_ctlcluster");
    assert!(status.success(), "pg_ctlcluster {args:?}: {status}");
}

/// Restarts the server and returns when it accepts connections again.
fn restart(env: &Env, mode: &str) -> Instant {
    pg_ctlcluster(env, &["restart", "-m", mode]);
    drop(admin(&env.url));
    Instant::now()
}

/// Stops the server for `outage`, long enough for a doubling reconnect backoff to grow past
/// several seconds, and returns when it accepts connections again.
fn outage(env: &Env, outage: Duration) -> Instant {
    pg_ctlcluster(env, &["stop", "-m", "immediate"]);
    std::thread::sleep(outage);
    pg_ctlcluster(env, &["start"]);
    drop(admin(&env.url));
    Instant::now()
}

/// The first success after `ready`, as a delay.
fn recovery(shared: &Shared, ready: Instant) -> Option<Duration> {
    let deadline = ready + Duration::from_secs(10);
    while Instant::now() < deadline {
        let ledger = shared.ledger.lock().expect("ledger");
        if let Some(first) = ledger.successes.iter().filter(|t| **t >= ready).min() {
            return Some(first.duration_since(ready));
        }
        drop(ledger);
        std::thread::sleep(Duration::from_millis(5));
    }
    None
}

#[test]
fn lost_connections_and_restarts_lose_nothing_and_recover_fast() {
    let Some(env) = env() else { return };
    let schema = format!("faults_{}", std::process::id());
    // Leases outlast the 16 s outage: an attempt cut off from its server for longer than its
    // lease loses the key by design (fenced: `LeaseLost`), which is not what this test is
    // about. The default lease (10 s) is shorter than the outage.
    let store = PgStore::builder()
        .schema(schema.as_str())
        .pool_size(10)
        .lease(OUTAGE * 4)
        .connect(&env.url)
        .expect("connect");
    let shared = Arc::new(Shared {
        store,
        ledger: Mutex::default(),
        stop: AtomicBool::new(false),
        failures: Mutex::default(),
    });
    let workers: Vec<_> = (0..THREADS)
        .map(|me| {
            let shared = Arc::clone(&shared);
            std::thread::spawn(move || worker(&shared, me))
        })
        .collect();
    let pause = || std::thread::sleep(Duration::from_millis(1500));
    let mut recoveries = Vec::new();
    pause();
    let terminated = terminate_all(&env.url);
    recoveries.push(("terminate", recovery(&shared, Instant::now())));
    for mode in ["fast", "immediate", "immediate"] {
        pause();
        let ready = restart(&env, mode);
        recoveries.push((mode, recovery(&shared, ready)));
    }
    pause();
    let ready = outage(&env, OUTAGE);
    recoveries.push(("outage", recovery(&shared, ready)));
    pause();
    shared.stop.store(true, Ordering::SeqCst);
    for worker in workers {
        worker.join().expect("worker panicked");
    }

    let ledger = shared.ledger.lock().expect("ledger");
    let failures = shared.failures.lock().expect("failures");
    eprintln!(
        "pg_faults: {terminated} backends terminated; {} keys; {} claims and {} completions \
         retried after errors; recovery after each fault: {recoveries:?}",
        ledger.acquired.len(),
        ledger.retried_claims,
        ledger.retried_completes
    );
    assert!(
        failures.is_empty(),
        "{} failures: {failures:#?}",
        failures.len()
    );
    assert!(
        ledger.retried_claims + ledger.retried_completes > 0,
        "no fault was met"
    );
    // 0 double acquires: one acquisition per key, and one acknowledged completion.
    for (key, tokens) in &ledger.acquired {
        assert_eq!(tokens.len(), 1, "{key} acquired by tokens {tokens:?}");
    }
    for (key, acked) in &ledger.acked {
        assert_eq!(acked.len(), 1, "{key} completed {} times", acked.len());
    }
    // 0 lost acknowledgements: every acknowledged body is what the key replays.
    for (name, acked) in &ledger.acked {
        let key = Key::new(name).expect("key");
        let view = shared
            .store
            .lookup(&key)
            .expect("lookup")
            .expect("record kept");
        match view.state {
            RecordState::Completed { response, .. } => {
                assert_eq!(response.body, acked[0], "{name}")
            }
            other => panic!("{name}: acknowledged but {other:?}"),
        }
    }
    for (fault, delay) in &recoveries {
        let delay = delay.unwrap_or_else(|| panic!("no success within 10 s after {fault}"));
        assert!(
            delay <= RECOVERY,
            "first success {delay:?} after the server was ready ({fault})"
        );
    }
    drop(ledger);
    drop(failures);
    let mut client = admin(&env.url);
    client
        .batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE"))
        .expect("drop schema");
}
