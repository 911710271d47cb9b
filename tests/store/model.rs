//! Model-based tests: random sequences of store calls, checked step by step against a plain
//! in-memory model of the documented semantics (`Store::claim`, `complete`, `release`,
//! `heartbeat`, `checkpoint`, `lookup`, `sweep`). The model and the step runner live in
//! `tests/reference/`, shared with the `store_ops` fuzz target; here are the proptest
//! strategies, a sequential run on a real store file (with reopen) and a concurrent one.
//!
//! Failures are persisted next to this file in `model.proptest-regressions`.

use std::sync::Barrier;
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::ManualClock;
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, TestCaseError};

use crate::reference;
use reference::{
    Caller, Checks, FINGERPRINTS, Failure, LEASE_MS, Model, Outcome, RETENTION_MS, SEQ_KEYS, Step,
    T0, Ties, builder, check_store, run_sequential, sweep_models, ts,
};

/// Threads of the concurrent test, and the keys each one owns.
const THREADS: usize = 8;
const KEYS_PER_THREAD: usize = 3;

impl From<Failure> for TestCaseError {
    fn from(failure: Failure) -> Self {
        TestCaseError::fail(failure.0)
    }
}

// ---------------------------------------------------------------------------------------------
// Strategies
// ---------------------------------------------------------------------------------------------

/// Steps on keys `0..nkeys` (indices local to the caller) and on leases the caller holds.
fn key_step(nkeys: usize) -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..nkeys, 0..FINGERPRINTS).prop_map(|(key, fp)| Step::Claim { key, fp }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(lease, body)| Step::Complete { lease, body }),
        1 => any::<usize>().prop_map(|lease| Step::Release { lease }),
        2 => any::<usize>().prop_map(|lease| Step::Heartbeat { lease }),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(lease, data)| Step::Checkpoint { lease, data }),
        1 => (0..nkeys).prop_map(|key| Step::Lookup { key }),
    ]
}

/// Clock moves around the lease (10 s) and retention (100 s) boundaries.
fn advance_ms() -> impl Strategy<Value = u64> {
    prop_oneof![
        1..=3_000u64,
        Just(LEASE_MS - 1),
        Just(LEASE_MS),
        LEASE_MS - 1_000..=LEASE_MS + 1_000,
        Just(RETENTION_MS),
        RETENTION_MS - 2_000..=RETENTION_MS + 2_000,
        1..=2 * RETENTION_MS,
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        15 => key_step(SEQ_KEYS),
        4 => advance_ms().prop_map(|ms| Step::Advance { ms }),
        2 => (1..=3usize).prop_map(|limit| Step::Sweep { limit }),
        1 => Just(Step::Reopen),
    ]
}

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Sequential: one caller, every step compared
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config(128))]

    /// One caller, a file-backed store, random steps including reopen.
    #[test]
    fn store_matches_the_model(steps in prop::collection::vec(step(), 1..48)) {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("model.redb");
        run_sequential(&steps, Checks::EveryStep, &|settings| settings.open(&path))?;
    }
}

/// Steps for [`Checks::AtVerify`] runs: the clock moves by a millisecond as often as by more,
/// so that a key released and claimed again in one millisecond and completed in the next
/// (its expiry entry moved away, back and away again) is common.
fn step_between_checks() -> impl Strategy<Value = Step> {
    prop_oneof![
        15 => key_step(SEQ_KEYS),
        2 => Just(Step::Advance { ms: 1 }),
        2 => advance_ms().prop_map(|ms| Step::Advance { ms }),
        1 => (1..=3usize).prop_map(|limit| Step::Sweep { limit }),
        1 => Just(Step::Reopen),
        1 => Just(Step::Verify),
    ]
}

proptest! {
    #![proptest_config(config(128))]

    /// One caller, a file-backed store, the whole store checked only now and then, so that
    /// overlay generations span many steps before redb's tables are written and verified.
    #[test]
    fn store_matches_the_model_across_overlay_generations(
        steps in prop::collection::vec(step_between_checks(), 1..64)
    ) {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("model.redb");
        run_sequential(&steps, Checks::AtVerify, &|settings| settings.open(&path))?;
    }
}

// ---------------------------------------------------------------------------------------------
// Concurrent: 8 callers on disjoint keys through the group commit
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Round {
    /// Clock advance before the round (0: none).
    advance: u64,
    /// `sweep(limit)` by the main thread before the round (0: none).
    sweep: usize,
    /// Each thread's steps this round.
    steps: Vec<Vec<Step>>,
}

fn round() -> impl Strategy<Value = Round> {
    (
        prop_oneof![1 => Just(0u64), 3 => advance_ms()],
        prop_oneof![2 => Just(0usize), 1 => 1..=3usize],
        prop::collection::vec(
            prop::collection::vec(key_step(KEYS_PER_THREAD), 1..6),
            THREADS,
        ),
    )
        .prop_map(|(advance, sweep, steps)| Round {
            advance,
            sweep,
            steps,
        })
}

fn thread_keys(t: usize) -> Vec<usize> {
    (t * KEYS_PER_THREAD..(t + 1) * KEYS_PER_THREAD).collect()
}

fn run_concurrent(rounds: &[Round]) -> Outcome {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("model.redb");
    let clock = ManualClock::new(ts(T0));
    let store = builder(&clock, 16).open(&path)?;
    let mut callers: Vec<Caller> = (0..THREADS).map(|_| Caller::default()).collect();
    let mut now = T0;
    for (r, round) in rounds.iter().enumerate() {
        // Between rounds only the main thread touches the store and the clock.
        if round.advance > 0 {
            clock.advance(Duration::from_millis(round.advance));
            now += round.advance;
        }
        if round.sweep > 0 {
            let mut models: Vec<&mut Model> = callers.iter_mut().map(|c| &mut c.model).collect();
            let owner = |k: usize| k / KEYS_PER_THREAD;
            let expected = sweep_models(&mut models, owner, now, round.sweep, Ties::KeyHash);
            ensure_eq!(store.sweep(round.sweep)?, expected, "sweep in round {r}");
        }
        let start = Barrier::new(THREADS);
        let results: Vec<Outcome> = std::thread::scope(|s| {
            let handles: Vec<_> = callers
                .iter_mut()
                .zip(&round.steps)
                .enumerate()
                .map(|(t, (caller, steps))| {
                    let (store, start) = (&store, &start);
                    s.spawn(move || -> Outcome {
                        let keys = thread_keys(t);
                        start.wait();
                        for step in steps {
                            caller.apply(store, now, &keys, step).map_err(|e| {
                                Failure(format!("thread {t}, round {r}, {step:?}: {e}"))
                            })?;
                        }
                        caller.check_keys(store, now, &keys)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Failure("thread panicked".into())))
                })
                .collect()
        });
        for result in results {
            result?;
        }
        let models: Vec<&Model> = callers.iter().map(|c| &c.model).collect();
        check_store(&store, now, &models)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(32))]

    /// Eight threads, each on its own keys, through the group commit (`max_batch` 16); the
    /// clock moves and sweeps run only between rounds.
    #[test]
    fn concurrent_callers_match_per_key_models(rounds in prop::collection::vec(round(), 1..10)) {
        run_concurrent(&rounds)?;
    }
}
