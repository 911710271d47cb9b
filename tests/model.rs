//! Model-based tests: random sequences of store calls, checked step by step against a plain
//! in-memory model of the documented semantics (`Store::claim`, `complete`, `release`,
//! `heartbeat`, `checkpoint`, `lookup`, `sweep`).
//!
//! The model, in milliseconds of the store's time `now`:
//! - a record with `now >= expires_at` is expired and counts as absent everywhere;
//! - a fresh claim makes `created_at = now`, attempt 1, `lease_until = now + lease` and
//!   `expires_at = max(created_at + retention, lease_until)`;
//! - a takeover (same fingerprint, `now >= lease_until`) keeps `created_at` and the checkpoint,
//!   makes attempt + 1 and recomputes `lease_until` and `expires_at` the same way;
//! - `complete` / `release` / `heartbeat` / `checkpoint` need the record unexpired, in progress
//!   and held by the same lease, else `Error::LeaseLost` and nothing changes;
//! - `complete` sets `expires_at = now + retention`; `heartbeat` sets `lease_until = now + lease`
//!   and `expires_at = max(expires_at, lease_until)`;
//! - `sweep(limit)` deletes up to `limit` expired records, oldest `(expires_at, stored key)`
//!   first.
//!
//! Failures are persisted next to this file in `model.proptest-regressions`.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Barrier;
use std::time::Duration;

use idempotency_store::{
    Claim, Error, Fingerprint, Key, Lease, ManualClock, RecordState, RecordView, Replay, Response,
    Store, Timestamp,
};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{FileFailurePersistence, TestCaseError};

const T0: u64 = 1_700_000_000_000;
const LEASE_MS: u64 = 10_000;
const RETENTION_MS: u64 = 100_000;
/// Keys in the sequential test's pool (index 3 is the scoped one).
const SEQ_KEYS: usize = 4;
/// Threads of the concurrent test, and the keys each one owns.
const THREADS: usize = 8;
const KEYS_PER_THREAD: usize = 3;
const FINGERPRINTS: usize = 2;

type TestResult<T = ()> = Result<T, TestCaseError>;

// ---------------------------------------------------------------------------------------------
// Keys, fingerprints, payloads
// ---------------------------------------------------------------------------------------------

/// Key `idx` of the pool: every fourth one is scoped, reusing an unscoped key's name so that
/// scope separation is exercised too.
fn key_parts(idx: usize) -> (Option<String>, String) {
    if idx % 4 == 3 {
        (Some("tenant".to_owned()), format!("k{}", idx - 3))
    } else {
        (None, format!("k{idx}"))
    }
}

fn key(idx: usize) -> Key {
    let built = match key_parts(idx) {
        (Some(scope), name) => Key::scoped(&scope, &name),
        (None, name) => Key::new(&name),
    };
    built.expect("pool keys are valid")
}

/// The stored byte form documented on `Key` (`[scope length][scope][key]`), which orders ties
/// in the expiry index.
fn stored_key(idx: usize) -> Vec<u8> {
    let (scope, name) = key_parts(idx);
    let scope = scope.unwrap_or_default();
    let mut out = vec![u8::try_from(scope.len()).expect("short scope")];
    out.extend_from_slice(scope.as_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

fn fingerprint(fp: usize) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", &format!("body-{fp}")])
}

fn response(body: u8) -> Response {
    Response::new(200 + u16::from(body % 4), vec![body; usize::from(body % 7)])
        .with_header("x-body", vec![body])
}

fn checkpoint_data(data: u8) -> Vec<u8> {
    vec![data; 1 + usize::from(data % 5)]
}

fn ts(millis: u64) -> Timestamp {
    Timestamp::from_millis(millis)
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct MRec {
    fp: usize,
    created_at: u64,
    expires_at: u64,
    attempt: u32,
    state: MState,
}

#[derive(Debug, Clone)]
enum MState {
    /// `holder` names the test's lease (its index in the test's lease list), standing in for
    /// the fencing token.
    InProgress {
        holder: usize,
        lease_until: u64,
        checkpoint: Option<Vec<u8>>,
    },
    Completed {
        completed_at: u64,
        response: Response,
    },
}

/// A claim outcome without the fencing token.
#[derive(Debug, PartialEq)]
enum Shape {
    Acquired {
        key: Key,
        attempt: u32,
        lease_until: Timestamp,
        checkpoint: Option<Vec<u8>>,
    },
    InProgress {
        lease_until: Timestamp,
        attempt: u32,
    },
    Completed(Replay),
    Mismatch(Fingerprint),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LeaseLost;

#[derive(Debug, Default, PartialEq, Eq)]
struct Counts {
    in_progress: u64,
    stuck: u64,
    completed: u64,
    expired: u64,
    records: u64,
}

#[derive(Debug, Default)]
struct Model {
    records: HashMap<usize, MRec>,
}

impl Model {
    fn live(&self, k: usize, now: u64) -> Option<&MRec> {
        self.records.get(&k).filter(|r| now < r.expires_at)
    }

    fn claim(&mut self, k: usize, fp: usize, now: u64, holder: usize) -> Shape {
        let (created_at, attempt, checkpoint) = match self.live(k, now).cloned() {
            None => (now, 1, None),
            Some(r) if r.fp != fp => return Shape::Mismatch(fingerprint(r.fp)),
            Some(r) => match r.state {
                MState::InProgress { lease_until, .. } if now < lease_until => {
                    return Shape::InProgress {
                        lease_until: ts(lease_until),
                        attempt: r.attempt,
                    };
                }
                MState::InProgress { checkpoint, .. } => (r.created_at, r.attempt + 1, checkpoint),
                MState::Completed {
                    completed_at,
                    response,
                } => {
                    return Shape::Completed(Replay {
                        response,
                        created_at: ts(r.created_at),
                        completed_at: ts(completed_at),
                        expires_at: ts(r.expires_at),
                        attempt: r.attempt,
                    });
                }
            },
        };
        let lease_until = now + LEASE_MS;
        self.records.insert(
            k,
            MRec {
                fp,
                created_at,
                expires_at: (created_at + RETENTION_MS).max(lease_until),
                attempt,
                state: MState::InProgress {
                    holder,
                    lease_until,
                    checkpoint: checkpoint.clone(),
                },
            },
        );
        Shape::Acquired {
            key: key(k),
            attempt,
            lease_until: ts(lease_until),
            checkpoint,
        }
    }

    fn held(&mut self, k: usize, holder: usize, now: u64) -> Result<&mut MRec, LeaseLost> {
        match self.records.get_mut(&k) {
            Some(r)
                if now < r.expires_at
                    && matches!(r.state, MState::InProgress { holder: h, .. } if h == holder) =>
            {
                Ok(r)
            }
            _ => Err(LeaseLost),
        }
    }

    fn complete(
        &mut self,
        k: usize,
        holder: usize,
        now: u64,
        response: Response,
    ) -> Result<(), LeaseLost> {
        let r = self.held(k, holder, now)?;
        r.expires_at = now + RETENTION_MS;
        r.state = MState::Completed {
            completed_at: now,
            response,
        };
        Ok(())
    }

    fn release(&mut self, k: usize, holder: usize, now: u64) -> Result<(), LeaseLost> {
        self.held(k, holder, now)?;
        self.records.remove(&k);
        Ok(())
    }

    fn heartbeat(&mut self, k: usize, holder: usize, now: u64) -> Result<u64, LeaseLost> {
        let r = self.held(k, holder, now)?;
        let until = now + LEASE_MS;
        if let MState::InProgress { lease_until, .. } = &mut r.state {
            *lease_until = until;
        }
        r.expires_at = r.expires_at.max(until);
        Ok(until)
    }

    fn checkpoint(
        &mut self,
        k: usize,
        holder: usize,
        now: u64,
        data: Vec<u8>,
    ) -> Result<(), LeaseLost> {
        let r = self.held(k, holder, now)?;
        if let MState::InProgress { checkpoint, .. } = &mut r.state {
            *checkpoint = Some(data);
        }
        Ok(())
    }

    fn view(&self, k: usize, now: u64) -> Option<RecordView> {
        let r = self.live(k, now)?;
        Some(RecordView {
            fingerprint: fingerprint(r.fp),
            created_at: ts(r.created_at),
            expires_at: ts(r.expires_at),
            attempt: r.attempt,
            state: match &r.state {
                MState::InProgress {
                    lease_until,
                    checkpoint,
                    ..
                } => RecordState::InProgress {
                    lease_until: ts(*lease_until),
                    checkpoint: checkpoint.clone(),
                },
                MState::Completed {
                    completed_at,
                    response,
                } => RecordState::Completed {
                    completed_at: ts(*completed_at),
                    response: response.clone(),
                },
            },
        })
    }

    /// The expired records as `(expires_at, stored key, key index)`, the expiry index's order.
    fn expired(&self, now: u64) -> Vec<(u64, Vec<u8>, usize)> {
        self.records
            .iter()
            .filter(|(_, r)| now >= r.expires_at)
            .map(|(&k, r)| (r.expires_at, stored_key(k), k))
            .collect()
    }

    fn counts(&self, now: u64) -> Counts {
        let mut c = Counts::default();
        for r in self.records.values() {
            c.records += 1;
            if now >= r.expires_at {
                c.expired += 1;
                continue;
            }
            match r.state {
                MState::InProgress { lease_until, .. } => {
                    c.in_progress += 1;
                    c.stuck += u64::from(now >= lease_until);
                }
                MState::Completed { .. } => c.completed += 1,
            }
        }
        c
    }
}

/// Sweeps the models as `Store::sweep(limit)` sweeps the store: the `limit` oldest expired
/// records across all of them. Returns how many went.
fn sweep_models(
    models: &mut [&mut Model],
    owner: impl Fn(usize) -> usize,
    now: u64,
    limit: usize,
) -> usize {
    let mut expired: Vec<_> = models.iter().flat_map(|m| m.expired(now)).collect();
    expired.sort();
    expired.truncate(limit);
    for (_, _, k) in &expired {
        models[owner(*k)].records.remove(k);
    }
    expired.len()
}

// ---------------------------------------------------------------------------------------------
// Steps
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum Step {
    Claim { key: usize, fp: usize },
    Complete { lease: Index, body: u8 },
    Release { lease: Index },
    Heartbeat { lease: Index },
    Checkpoint { lease: Index, data: u8 },
    Lookup { key: usize },
    Advance { ms: u64 },
    Sweep { limit: usize },
    Reopen,
}

/// Steps on keys `0..nkeys` (indices local to the caller) and on leases the caller holds.
fn key_step(nkeys: usize) -> impl Strategy<Value = Step> {
    prop_oneof![
        6 => (0..nkeys, 0..FINGERPRINTS).prop_map(|(key, fp)| Step::Claim { key, fp }),
        3 => (any::<Index>(), any::<u8>()).prop_map(|(lease, body)| Step::Complete { lease, body }),
        1 => any::<Index>().prop_map(|lease| Step::Release { lease }),
        2 => any::<Index>().prop_map(|lease| Step::Heartbeat { lease }),
        2 => (any::<Index>(), any::<u8>()).prop_map(|(lease, data)| Step::Checkpoint { lease, data }),
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

/// A lease the test holds (settled or taken over ones included), and its key's index.
struct Held {
    lease: Lease,
    key: usize,
}

/// One caller's view: its model, its leases and the last fencing token it saw.
#[derive(Default)]
struct Caller {
    model: Model,
    leases: Vec<Held>,
    last_token: u64,
}

fn fail(msg: String) -> TestCaseError {
    TestCaseError::fail(msg)
}

/// `Err(LeaseLost)` is an expected answer; any other error fails the case.
fn fenced<T>(result: Result<T, Error>) -> TestResult<Result<T, LeaseLost>> {
    match result {
        Ok(v) => Ok(Ok(v)),
        Err(Error::LeaseLost) => Ok(Err(LeaseLost)),
        Err(other) => Err(fail(format!("unexpected error: {other:?}"))),
    }
}

fn shape(claim: Claim) -> (Shape, Option<Lease>) {
    match claim {
        Claim::Acquired(lease) => (
            Shape::Acquired {
                key: lease.key().clone(),
                attempt: lease.attempt(),
                lease_until: lease.lease_until(),
                checkpoint: lease.checkpoint().map(<[u8]>::to_vec),
            },
            Some(lease),
        ),
        Claim::InProgress {
            lease_until,
            attempt,
        } => (
            Shape::InProgress {
                lease_until,
                attempt,
            },
            None,
        ),
        Claim::Completed(replay) => (Shape::Completed(replay), None),
        Claim::Mismatch { stored } => (Shape::Mismatch(stored), None),
    }
}

impl Caller {
    /// Runs one key step on `store` and on the model and compares the answers. `keys` maps the
    /// step's local key index to the pool index.
    fn apply(&mut self, store: &Store, now: u64, keys: &[usize], step: &Step) -> TestResult {
        match *step {
            Step::Claim { key: local, fp } => {
                let k = keys[local];
                let expected = self.model.claim(k, fp, now, self.leases.len());
                let (got, lease) = shape(store.claim(&key(k), fingerprint(fp))?);
                prop_assert_eq!(&got, &expected, "claim of key {} with fp {}", k, fp);
                if let Some(lease) = lease {
                    prop_assert!(
                        lease.token() > self.last_token,
                        "token {} not above the previous {}",
                        lease.token(),
                        self.last_token
                    );
                    self.last_token = lease.token();
                    self.leases.push(Held { lease, key: k });
                }
            }
            Step::Lookup { key: local } => {
                let k = keys[local];
                prop_assert_eq!(
                    store.lookup(&key(k))?,
                    self.model.view(k, now),
                    "lookup {}",
                    k
                );
            }
            Step::Complete { lease, body } => {
                let Some((i, held)) = pick(&mut self.leases, lease) else {
                    return Ok(());
                };
                let expected = self.model.complete(held.key, i, now, response(body));
                let got = fenced(store.complete(&held.lease, response(body)))?;
                prop_assert_eq!(got, expected, "complete with lease {}", i);
            }
            Step::Release { lease } => {
                let Some((i, held)) = pick(&mut self.leases, lease) else {
                    return Ok(());
                };
                let expected = self.model.release(held.key, i, now);
                let got = fenced(store.release(&held.lease))?;
                prop_assert_eq!(got, expected, "release with lease {}", i);
            }
            Step::Heartbeat { lease } => {
                let Some((i, held)) = pick(&mut self.leases, lease) else {
                    return Ok(());
                };
                let before = held.lease.lease_until();
                let expected = self.model.heartbeat(held.key, i, now).map(ts);
                let got = fenced(store.heartbeat(&mut held.lease))?;
                prop_assert_eq!(got, expected, "heartbeat with lease {}", i);
                let after = held.lease.lease_until();
                prop_assert_eq!(after, got.unwrap_or(before), "the lease's own deadline");
            }
            Step::Checkpoint { lease, data } => {
                let Some((i, held)) = pick(&mut self.leases, lease) else {
                    return Ok(());
                };
                let data = checkpoint_data(data);
                let before = held.lease.checkpoint().map(<[u8]>::to_vec);
                let expected = self.model.checkpoint(held.key, i, now, data.clone());
                let got = fenced(store.checkpoint(&mut held.lease, data.clone()))?;
                prop_assert_eq!(got, expected, "checkpoint with lease {}", i);
                let after = held.lease.checkpoint().map(<[u8]>::to_vec);
                prop_assert_eq!(after, if got.is_ok() { Some(data) } else { before });
            }
            Step::Advance { .. } | Step::Sweep { .. } | Step::Reopen => {
                return Err(fail(format!("{step:?} is not a key step")));
            }
        }
        Ok(())
    }

    /// Every key this caller owns looks up as the model says.
    fn check_keys(&self, store: &Store, now: u64, keys: &[usize]) -> TestResult {
        for &k in keys {
            prop_assert_eq!(store.lookup(&key(k))?, self.model.view(k, now), "key {}", k);
        }
        Ok(())
    }
}

fn pick(leases: &mut [Held], index: Index) -> Option<(usize, &mut Held)> {
    if leases.is_empty() {
        return None;
    }
    let i = index.index(leases.len());
    Some((i, &mut leases[i]))
}

/// The whole store agrees with the models: counts by state, physical records, and a clean
/// `verify()`.
fn check_store(store: &Store, now: u64, models: &[&Model]) -> TestResult {
    let mut want = Counts::default();
    for m in models {
        let c = m.counts(now);
        want.in_progress += c.in_progress;
        want.stuck += c.stuck;
        want.completed += c.completed;
        want.expired += c.expired;
        want.records += c.records;
    }
    let stats = store.stats()?;
    let report = store.verify()?;
    let got = Counts {
        in_progress: stats.in_progress,
        stuck: stats.stuck,
        completed: stats.completed,
        expired: stats.expired,
        records: report.records,
    };
    prop_assert_eq!(got, want, "stats / record count");
    prop_assert_eq!(
        report.expiry_entries,
        report.records,
        "one expiry entry per record"
    );
    prop_assert!(
        report.is_clean(),
        "verify found problems: {:?}",
        report.problems
    );
    prop_assert_eq!(store.now(), ts(now), "store time");
    Ok(())
}

fn open(path: &Path, clock: &ManualClock, max_batch: usize) -> Result<Store, Error> {
    Store::builder()
        .lease(Duration::from_millis(LEASE_MS))
        .retention(Duration::from_millis(RETENTION_MS))
        .max_batch(max_batch)
        .clock(clock.clone())
        .open(path)
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

fn run_sequential(steps: &[Step]) -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("model.redb");
    let clock = ManualClock::new(ts(T0));
    let mut store = open(&path, &clock, 128)?;
    let keys: Vec<usize> = (0..SEQ_KEYS).collect();
    let mut caller = Caller::default();
    let mut now = T0;
    for (n, step) in steps.iter().enumerate() {
        match *step {
            Step::Advance { ms } => {
                clock.advance(Duration::from_millis(ms));
                now += ms;
            }
            Step::Sweep { limit } => {
                let expected = sweep_models(&mut [&mut caller.model], |_| 0, now, limit);
                prop_assert_eq!(
                    store.sweep(limit)?,
                    expected,
                    "sweep({}) at step {}",
                    limit,
                    n
                );
            }
            Step::Reopen => {
                drop(store);
                store = open(&path, &clock, 128)?;
            }
            _ => caller.apply(&store, now, &keys, step)?,
        }
        caller.check_keys(&store, now, &keys)?;
        check_store(&store, now, &[&caller.model])?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(128))]

    /// One caller, a file-backed store, random steps including reopen.
    #[test]
    fn store_matches_the_model(steps in prop::collection::vec(step(), 1..48)) {
        run_sequential(&steps)?;
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

fn run_concurrent(rounds: &[Round]) -> TestResult {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("model.redb");
    let clock = ManualClock::new(ts(T0));
    let store = open(&path, &clock, 16)?;
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
            let expected = sweep_models(&mut models, owner, now, round.sweep);
            prop_assert_eq!(store.sweep(round.sweep)?, expected, "sweep in round {}", r);
        }
        let start = Barrier::new(THREADS);
        let results: Vec<TestResult> = std::thread::scope(|s| {
            let handles: Vec<_> = callers
                .iter_mut()
                .zip(&round.steps)
                .enumerate()
                .map(|(t, (caller, steps))| {
                    let (store, start) = (&store, &start);
                    s.spawn(move || -> TestResult {
                        let keys = thread_keys(t);
                        start.wait();
                        for step in steps {
                            caller.apply(store, now, &keys, step).map_err(|e| {
                                fail(format!("thread {t}, round {r}, {step:?}: {e}"))
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
                        .unwrap_or_else(|_| Err(fail("thread panicked".into())))
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
