//! Feature `metrics`: the store's counts reach a recorder installed for the `metrics` facade,
//! under the documented names and labels.
#![cfg(feature = "metrics")]

use std::collections::BTreeMap;
use std::time::Duration;

use idempotency_store::{Claim, Error, Fingerprint, Key, ManualClock, Response, Store, Timestamp};
use metrics_util::debugging::{DebugValue, DebuggingRecorder};

/// `name{label=value,...}` → the counter's value, or a histogram's number of samples.
fn recorded(recorder: &DebuggingRecorder) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for (key, _, _, value) in recorder.snapshotter().snapshot().into_vec() {
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
        let _ = store.metrics();
    });
    let got = recorded(&recorder);
    let expect = [
        ("idempotency_claims_total{backend=redb,outcome=acquired}", 1),
        (
            "idempotency_claims_total{backend=redb,outcome=in_progress}",
            1,
        ),
        ("idempotency_claims_total{backend=redb,outcome=mismatch}", 1),
        ("idempotency_claims_total{backend=redb,outcome=replayed}", 2),
        ("idempotency_completes_total{backend=redb}", 1),
        ("idempotency_lease_lost_total{backend=redb}", 1),
        ("idempotency_errors_total{backend=redb,kind=lease_lost}", 1),
        ("idempotency_claim_seconds{backend=redb}", 5),
        ("idempotency_complete_seconds{backend=redb}", 1),
        ("idempotency_overlay_records{backend=redb}", 1),
    ];
    for (name, value) in expect {
        assert_eq!(got.get(name), Some(&value), "{name} in {got:#?}");
    }
    assert!(
        got["idempotency_batches_total{backend=redb}"] >= 1,
        "{got:#?}"
    );
    assert_eq!(
        got.get("idempotency_releases_total{backend=redb}"),
        None,
        "no release succeeded"
    );
}
