//! Feature `metrics`: the store's counts reach a recorder installed for the `metrics` facade,
//! under the documented names and labels.
#![cfg(feature = "metrics")]

use std::collections::BTreeMap;
use std::time::Duration;

use idempotency_store::{
    Claim, Error, Fingerprint, IdempotencyStore, Key, ManualClock, Response, Store, Timestamp,
};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// `name{label=value,...}` → the counter's value, or a histogram's number of samples.
fn recorded(recorder: &DebuggingRecorder) -> BTreeMap<String, u64> {
    snapshot(&recorder.snapshotter())
}

/// [`recorded`], through a snapshotter (histograms are drained by each snapshot).
fn snapshot(snapshotter: &Snapshotter) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let value = match value {
            DebugValue::Counter(n) => n,
            DebugValue::Histogram(samples) => samples.len() as u64,
            DebugValue::Gauge(level) => level.into_inner() as u64,
        };
        out.insert(name, value);
    }
    out
}

/// One of each outcome: acquired, in progress (also through a `claim_wait` with no time to
/// wait), mismatch, a completion, two replays, and a release refused as lost.
fn drive(store: &impl IdempotencyStore) {
    let fp = Fingerprint::of(["a"]);
    let key = Key::new("k").expect("key");
    let Ok(Claim::Acquired(lease)) = store.claim(&key, fp) else {
        panic!("expected Acquired")
    };
    assert!(matches!(
        store.claim(&key, fp),
        Ok(Claim::InProgress { .. })
    ));
    assert!(matches!(
        store.claim_wait(&key, fp, Duration::ZERO),
        Ok(Claim::InProgress { .. })
    ));
    assert!(matches!(
        store.claim(&key, Fingerprint::of(["b"])),
        Ok(Claim::Mismatch { .. })
    ));
    store
        .complete(&lease, Response::new(200, "ok"))
        .expect("complete");
    for _ in 0..2 {
        assert!(matches!(store.claim(&key, fp), Ok(Claim::Completed(_))));
    }
    assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
}

/// The series `drive` leaves on `backend`, the same on both.
fn expected(backend: &str) -> Vec<(String, u64)> {
    [
        ("idempotency_claims_total{backend=B,outcome=acquired}", 1),
        ("idempotency_claims_total{backend=B,outcome=in_progress}", 2),
        ("idempotency_claims_total{backend=B,outcome=mismatch}", 1),
        ("idempotency_claims_total{backend=B,outcome=replayed}", 2),
        ("idempotency_claim_wait_timeouts_total{backend=B}", 1),
        ("idempotency_completes_total{backend=B}", 1),
        ("idempotency_lease_lost_total{backend=B}", 1),
        ("idempotency_errors_total{backend=B,kind=lease_lost}", 1),
        ("idempotency_claim_seconds{backend=B}", 6),
        ("idempotency_complete_seconds{backend=B}", 1),
    ]
    .into_iter()
    .map(|(name, value)| {
        (
            name.replace("backend=B", &format!("backend={backend}")),
            value,
        )
    })
    .collect()
}

/// Checks `got` against `expected(backend)` and what no call of `drive` records.
fn check_common(got: &BTreeMap<String, u64>, backend: &str) {
    for (name, value) in expected(backend) {
        assert_eq!(got.get(&name), Some(&value), "{name} in {got:#?}");
    }
    for absent in [
        "idempotency_releases_total",
        "idempotency_claim_waits_total",
    ] {
        let name = format!("{absent}{{backend={backend}}}");
        assert_eq!(got.get(&name), None, "nothing counted it: {got:#?}");
    }
}

#[test]
fn counts_reach_the_recorder_with_names_and_labels() {
    let recorder = DebuggingRecorder::new();
    metrics::with_local_recorder(&recorder, || {
        let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
        let store = Store::builder()
            .lease(Duration::from_secs(60))
            .clock(clock.clone())
            .open_in_memory()
            .expect("open");
        drive(&store);
        let _ = store.metrics();
    });
    let got = recorded(&recorder);
    check_common(&got, "redb");
    assert_eq!(
        got.get("idempotency_overlay_records{backend=redb}"),
        Some(&1),
        "{got:#?}"
    );
    assert!(
        got["idempotency_batches_total{backend=redb}"] >= 1,
        "{got:#?}"
    );
}

/// The same calls on `PgStore` give the same series under `backend=postgres`, and none of the
/// redb engine's (PostgreSQL only with `IDEMPOTENCY_PG_URL` set).
#[cfg(feature = "postgres")]
#[test]
fn postgres_counts_reach_the_recorder_with_backend_postgres() {
    let Ok(url) = std::env::var("IDEMPOTENCY_PG_URL") else {
        eprintln!("skipped: IDEMPOTENCY_PG_URL is not set; see .ci/run");
        return;
    };
    let schema = format!("metrics_facade_{}", std::process::id());
    let admin = |sql: &str| {
        let mut client = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
        client.batch_execute(sql).expect("admin sql");
    };
    admin(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    let recorder = DebuggingRecorder::new();
    metrics::with_local_recorder(&recorder, || {
        let store = idempotency_store::pg::PgStore::builder()
            .schema(schema.as_str())
            .lease(Duration::from_secs(60))
            .pool_size(1)
            .connect(&url)
            .expect("connect");
        drive(&store);
        let _ = store.metrics();
    });
    admin(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
    let got = recorded(&recorder);
    check_common(&got, "postgres");
    let stray: Vec<_> = got
        .keys()
        .filter(|name| !name.contains("backend=postgres"))
        .collect();
    assert!(
        stray.is_empty(),
        "every series is labelled postgres: {stray:?}"
    );
    for redb_only in ["batches_total", "log_writes_total", "overlay_records"] {
        let name = format!("idempotency_{redb_only}{{backend=postgres}}");
        assert_eq!(got.get(&name), None, "{got:#?}");
    }
}

/// `name` → the change from `before` to `after` (`recorded` drains histograms, so theirs is
/// `after`'s count); unchanged series are left out.
fn delta(before: &BTreeMap<String, u64>, after: &BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    after
        .iter()
        .map(|(name, &value)| {
            let was = if name.contains("_seconds") {
                0
            } else {
                before.get(name).copied().unwrap_or(0)
            };
            (name.clone(), value - was)
        })
        .filter(|&(_, value)| value > 0)
        .collect()
}

/// The store caches its series' handles in the global recorder: a global recorder installed
/// after the store opened still gets every count, and local recorders (one after another, at
/// the same address) still get theirs and keep them from the global one.
#[test]
fn a_global_recorder_installed_after_open_gets_every_count_and_local_ones_still_win() {
    // `drive` needs a fresh key each time: one store per drive, all opened before the install.
    let mut stores = (0..7)
        .map(|_| {
            Store::builder()
                .lease(Duration::from_secs(60))
                .clock(ManualClock::new(Timestamp::from_millis(1_700_000_000_000)))
                .open_in_memory()
                .expect("open")
        })
        .collect::<Vec<_>>()
        .into_iter();
    let mut next = move || stores.next().expect("a store per drive");
    drive(&next());
    let global = DebuggingRecorder::new();
    let snapshotter = global.snapshotter();
    let global_recorded = || snapshot(&snapshotter);
    global
        .install()
        .expect("the only global recorder of this test binary");
    for round in 0..3 {
        let before = global_recorded();
        drive(&next());
        check_common(&delta(&before, &global_recorded()), "redb");

        let before = global_recorded();
        let local = DebuggingRecorder::new();
        let store = next();
        metrics::with_local_recorder(&local, || drive(&store));
        check_common(&recorded(&local), "redb");
        let leaked = delta(&before, &global_recorded());
        for (name, _) in expected("redb") {
            assert_eq!(
                leaked.get(&name),
                None,
                "round {round}: {name} reached the global"
            );
        }
    }
}
