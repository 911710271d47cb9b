//! Model-based: the shared reference model's step sequences on both backends.

use std::time::Duration;

use idempotency_store::{IdempotencyStore, ManualClock, Result, Store};
use proptest::prelude::*;

use super::Settings;
#[cfg(feature = "postgres")]
use super::pg;
use crate::common::scaled;
use crate::reference;

/// A model run's store: lease and retention of the reference model, and its clock.
fn model_settings() -> Settings {
    Settings {
        lease: Duration::from_millis(reference::LEASE_MS),
        retention: Duration::from_millis(reference::RETENTION_MS),
        ..Settings::default()
    }
}

/// Opens a store on one case's storage (again at each `Reopen`), with the given clock.
type Opener<S> = Box<dyn Fn(&ManualClock) -> Result<S>>;

/// Runs step sequences decoded from random bytes (the fuzz target's decoder) against a fresh
/// store of the backend per case, every answer compared with the reference model. A `Reopen`
/// step drops the store and opens another on the same storage (redb: the same in-memory disk;
/// PostgreSQL: a new `PgStore` on the same schema).
fn matches_the_reference_model<S: IdempotencyStore>(
    cases: u32,
    ties: reference::Ties,
    fresh: &dyn Fn() -> Result<Opener<S>>,
) {
    let config = ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let case = |bytes: &[u8]| {
        let steps = reference::decode_steps(bytes);
        let clock = ManualClock::new(reference::ts(reference::T0));
        let open = fresh().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let checks = reference::Checks::EveryStep;
        reference::run_steps(&steps, ties, checks, &clock, &|| open(&clock), &|_, _| {
            Ok(())
        })
        .map_err(|f| TestCaseError::fail(format!("{f}\nsteps: {steps:?}")))
    };
    for (i, bytes) in MODEL_REGRESSIONS.iter().enumerate() {
        if let Err(err) = case(bytes) {
            panic!("regression case {i}: the backend disagrees with the reference model: {err}");
        }
    }
    let mut runner = proptest::test_runner::TestRunner::new(config);
    if let Err(err) = runner.run(&prop::collection::vec(any::<u8>(), 1..160), |bytes| {
        case(&bytes)
    }) {
        panic!("the backend disagrees with the reference model: {err}");
    }
}

/// Inputs that once failed, run first on every backend.
const MODEL_REGRESSIONS: &[&[u8]] = &[
    // PostgreSQL's sweep(1) deleted 2 records: `ctid IN (SELECT … LIMIT n FOR UPDATE SKIP
    // LOCKED)` can be rescanned, and a rescan skips the rows the statement already deleted.
    &[
        204, 19, 141, 175, 95, 142, 129, 66, 163, 173, 213, 170, 216, 231, 86, 68, 146, 55, 117,
        92, 235, 130, 30, 89, 174, 81, 41, 167, 64, 44, 160, 125, 50, 120, 153, 180, 203, 124, 92,
        178, 220, 168, 67, 29, 149, 98, 154, 18, 78, 9, 17, 56, 103, 225, 137, 169, 50, 39, 39,
        242, 138, 34, 2, 173, 19, 122, 222, 105, 71, 16, 8, 204, 4, 212, 118, 76, 157, 226, 215,
        112, 105, 22, 207, 106, 103, 2, 128, 37, 162, 227, 119, 154, 191, 66, 174, 44, 12, 20, 184,
        30, 15, 240, 82, 243, 143, 140,
    ],
];

#[test]
fn redb_backend_matches_the_reference_model() {
    matches_the_reference_model::<Store>(64, reference::Ties::KeyHash, &|| {
        // Storage that survives a reopen, fresh for each case.
        let disk = reference::MemDisk::default();
        Ok(Box::new(move |clock: &ManualClock| {
            let settings = model_settings();
            let mut builder = Store::builder();
            builder
                .lease(settings.lease)
                .retention(settings.retention)
                .clock(clock.clone());
            builder.open_with_backend(disk.clone())
        }))
    });
}

/// 6 cases under `cargo test`, 24 with `IDEMPOTENCY_TEST_SCALE=full` (as CI runs it);
/// `CONFORMANCE_MODEL_CASES` sets any other number.
#[cfg(feature = "postgres")]
#[test]
fn postgres_backend_matches_the_reference_model() {
    use std::sync::Arc;
    let Some(url) = pg::url() else { return };
    // One schema for the whole run, emptied before each case; dropped at the end.
    let db = Arc::new(pg::Db::named(url, "model"));
    let cases = std::env::var("CONFORMANCE_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| scaled(6, 24) as u32);
    matches_the_reference_model::<idempotency_store::pg::PgStore>(
        cases,
        reference::Ties::Key,
        &|| {
            db.truncate()?;
            let db = Arc::clone(&db);
            Ok(Box::new(move |clock: &ManualClock| {
                db.connect(&model_settings(), clock)
            }))
        },
    );
}
