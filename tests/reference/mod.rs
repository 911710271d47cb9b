//! The reference model of the store and the step machinery that checks a store against it,
//! shared by the model-based proptests (`tests/store/model.rs`), the `store_ops` fuzz target
//! (`fuzz/fuzz_targets/store_ops.rs`) and its corpus replay (`tests/durability/fuzz_corpus.rs`).
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
//! Every check returns `Err(Failure)` instead of panicking, so that proptest can shrink; the
//! fuzz entry point [`run_ops`] turns a failure into a panic, which libFuzzer reports.
//!
//! The step machinery works on any [`IdempotencyStore`] backend ([`run_steps`]), so the
//! conformance suite (`tests/store/conformance/`) runs the same sequences against PostgreSQL.

// Each including crate uses a different part of this module.
#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use idempotency_store::{
    Claim, Error, Fingerprint, IdempotencyStore, Key, Lease, ManualClock, RecordState, RecordView,
    Replay, Response, Store, StoreBuilder, Timestamp,
};

pub const T0: u64 = 1_700_000_000_000;
pub const LEASE_MS: u64 = 10_000;
pub const RETENTION_MS: u64 = 100_000;
/// Keys in the sequential runs' pool (index 3 is the scoped one).
pub const SEQ_KEYS: usize = 4;
pub const FINGERPRINTS: usize = 2;
/// The longest step sequence [`decode_steps`] builds.
pub const MAX_STEPS: usize = 64;

// ---------------------------------------------------------------------------------------------
// Failures
// ---------------------------------------------------------------------------------------------

/// A disagreement between the store and the model, or an unexpected error.
#[derive(Debug)]
pub struct Failure(pub String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for Failure {
    fn from(err: E) -> Self {
        Failure(format!("unexpected error: {err:?}"))
    }
}

pub type Outcome<T = ()> = Result<T, Failure>;

/// Fails unless the condition holds; the rest is a `format!` message.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::reference::Failure(format!(
                "{} (failed: {})",
                format!($($msg)+),
                stringify!($cond)
            )));
        }
    };
}

/// Fails unless `got == want`; the optional rest is a `format!` message.
macro_rules! ensure_eq {
    ($got:expr, $want:expr $(,)?) => {
        ensure_eq!($got, $want, "{}", stringify!($got))
    };
    ($got:expr, $want:expr, $($msg:tt)+) => {{
        let (got, want) = (&$got, &$want);
        if got != want {
            return Err($crate::reference::Failure(format!(
                "{}: the store gave\n  {got:?}\nthe model expects\n  {want:?}",
                format!($($msg)+)
            )));
        }
    }};
}

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

pub fn key(idx: usize) -> Key {
    let built = match key_parts(idx) {
        (Some(scope), name) => Key::scoped(&scope, &name),
        (None, name) => Key::new(&name),
    };
    built.expect("pool keys are valid")
}

/// How a backend orders expired records of one millisecond in a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ties {
    /// By stored key (PostgreSQL).
    Key,
    /// By the key hash the redb store files records under (the first 8 bytes of the stored
    /// key's BLAKE3 digest, big-endian), then by stored key.
    KeyHash,
}

impl Ties {
    fn order(self, idx: usize) -> Vec<u8> {
        let stored = stored_key(idx);
        match self {
            Ties::Key => stored,
            Ties::KeyHash => [&blake3::hash(&stored).as_bytes()[..8], &stored[..]].concat(),
        }
    }
}

/// The stored byte form documented on `Key` (`[scope length][scope][key]`).
fn stored_key(idx: usize) -> Vec<u8> {
    let (scope, name) = key_parts(idx);
    let scope = scope.unwrap_or_default();
    let mut out = vec![u8::try_from(scope.len()).expect("short scope")];
    out.extend_from_slice(scope.as_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

pub fn fingerprint(fp: usize) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", &format!("body-{fp}")])
}

pub fn response(body: u8) -> Response {
    Response::new(200 + u16::from(body % 4), vec![body; usize::from(body % 7)])
        .with_header("x-body", vec![body])
}

pub fn checkpoint_data(data: u8) -> Vec<u8> {
    vec![data; 1 + usize::from(data % 5)]
}

pub fn ts(millis: u64) -> Timestamp {
    Timestamp::from_millis(millis)
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
pub struct MRec {
    fp: usize,
    created_at: u64,
    expires_at: u64,
    attempt: u32,
    state: MState,
}

#[derive(Debug, Clone)]
pub enum MState {
    /// `holder` names the test's lease (its index in the caller's lease list), standing in for
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
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
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
    Completed(ReplayShape),
    Mismatch(Fingerprint),
}

/// Every field of a [`Replay`] (which is `#[non_exhaustive]`, so the model cannot build one).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayShape {
    pub response: Response,
    pub created_at: Timestamp,
    pub completed_at: Timestamp,
    pub expires_at: Timestamp,
    pub attempt: u32,
}

impl From<Replay> for ReplayShape {
    fn from(r: Replay) -> Self {
        ReplayShape {
            response: r.response,
            created_at: r.created_at,
            completed_at: r.completed_at,
            expires_at: r.expires_at,
            attempt: r.attempt,
        }
    }
}

/// Every field of a [`RecordView`] (`#[non_exhaustive]`, so the model cannot build one).
#[derive(Debug, Clone, PartialEq)]
pub struct ViewShape {
    pub fingerprint: Fingerprint,
    pub created_at: Timestamp,
    pub expires_at: Timestamp,
    pub attempt: u32,
    pub state: RecordState,
}

impl From<RecordView> for ViewShape {
    fn from(v: RecordView) -> Self {
        ViewShape {
            fingerprint: v.fingerprint,
            created_at: v.created_at,
            expires_at: v.expires_at,
            attempt: v.attempt,
            state: v.state,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Counts {
    in_progress: u64,
    stuck: u64,
    completed: u64,
    expired: u64,
    records: u64,
}

/// The model of one store (or of the keys one caller owns). Lease and retention are the
/// sequential runs' ([`LEASE_MS`], [`RETENTION_MS`]) unless set with [`Model::with_times`].
#[derive(Debug, Clone)]
pub struct Model {
    records: HashMap<usize, MRec>,
    lease_ms: u64,
    retention_ms: u64,
}

impl Default for Model {
    fn default() -> Self {
        Model::with_times(LEASE_MS, RETENTION_MS)
    }
}

impl Model {
    /// An empty model with this lease and retention.
    pub fn with_times(lease_ms: u64, retention_ms: u64) -> Model {
        Model {
            records: HashMap::new(),
            lease_ms,
            retention_ms,
        }
    }

    fn live(&self, k: usize, now: u64) -> Option<&MRec> {
        self.records.get(&k).filter(|r| now < r.expires_at)
    }

    pub fn claim(&mut self, k: usize, fp: usize, now: u64, holder: usize) -> Shape {
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
                    return Shape::Completed(ReplayShape {
                        response,
                        created_at: ts(r.created_at),
                        completed_at: ts(completed_at),
                        expires_at: ts(r.expires_at),
                        attempt: r.attempt,
                    });
                }
            },
        };
        let lease_until = now + self.lease_ms;
        self.records.insert(
            k,
            MRec {
                fp,
                created_at,
                expires_at: (created_at + self.retention_ms).max(lease_until),
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

    pub fn complete(
        &mut self,
        k: usize,
        holder: usize,
        now: u64,
        response: Response,
    ) -> Result<(), LeaseLost> {
        let retention_ms = self.retention_ms;
        let r = self.held(k, holder, now)?;
        r.expires_at = now + retention_ms;
        r.state = MState::Completed {
            completed_at: now,
            response,
        };
        Ok(())
    }

    pub fn release(&mut self, k: usize, holder: usize, now: u64) -> Result<(), LeaseLost> {
        self.held(k, holder, now)?;
        self.records.remove(&k);
        Ok(())
    }

    pub fn heartbeat(&mut self, k: usize, holder: usize, now: u64) -> Result<u64, LeaseLost> {
        let until = now + self.lease_ms;
        let r = self.held(k, holder, now)?;
        if let MState::InProgress { lease_until, .. } = &mut r.state {
            *lease_until = until;
        }
        r.expires_at = r.expires_at.max(until);
        Ok(until)
    }

    pub fn checkpoint(
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

    pub fn view(&self, k: usize, now: u64) -> Option<ViewShape> {
        let r = self.live(k, now)?;
        Some(ViewShape {
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

    /// The times at which key `k`'s answers change by themselves (its lease deadline and its
    /// expiry), for a checker choosing an operation's time.
    pub fn deadlines(&self, k: usize) -> Vec<u64> {
        match self.records.get(&k) {
            Some(MRec {
                expires_at,
                state: MState::InProgress { lease_until, .. },
                ..
            }) => vec![*lease_until, *expires_at],
            Some(r) => vec![r.expires_at],
            None => Vec::new(),
        }
    }

    /// The expired records as `(expires_at, tie order, key index)`, a sweep's order.
    fn expired(&self, now: u64, ties: Ties) -> Vec<(u64, Vec<u8>, usize)> {
        self.records
            .iter()
            .filter(|(_, r)| now >= r.expires_at)
            .map(|(&k, r)| (r.expires_at, ties.order(k), k))
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

/// Sweeps the models as `sweep(limit)` sweeps a backend that orders ties by `ties`: the
/// `limit` oldest expired records across all of them. Returns how many went.
pub fn sweep_models(
    models: &mut [&mut Model],
    owner: impl Fn(usize) -> usize,
    now: u64,
    limit: usize,
    ties: Ties,
) -> usize {
    let mut expired: Vec<_> = models.iter().flat_map(|m| m.expired(now, ties)).collect();
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

/// One call. `key` indexes the caller's keys; `lease` picks one of the leases the caller has
/// acquired so far (settled or taken over ones included), modulo their number.
#[derive(Debug, Clone)]
pub enum Step {
    Claim {
        key: usize,
        fp: usize,
    },
    Complete {
        lease: usize,
        body: u8,
    },
    Release {
        lease: usize,
    },
    Heartbeat {
        lease: usize,
    },
    Checkpoint {
        lease: usize,
        data: u8,
    },
    Lookup {
        key: usize,
    },
    Advance {
        ms: u64,
    },
    Sweep {
        limit: usize,
    },
    Reopen,
    /// The whole store checked against the model ([`check_backend`]): counts and `verify()`,
    /// which first write what the overlay holds into redb's tables.
    Verify,
}

/// When [`run_steps`] checks the whole store against the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checks {
    /// After every step: a failure names its step, but the check writes the overlay into
    /// redb's tables each time, so no overlay generation ever spans two steps.
    EveryStep,
    /// At `Step::Verify` steps and after the last step only, so that generations span many
    /// steps (a record's expiry entry moved, moved back and moved again before redb hears of
    /// any of it). Every key is still looked up after every step.
    AtVerify,
}

/// A lease the test holds, and its key's index.
struct Held {
    lease: Lease,
    key: usize,
}

/// One caller's view: its model, its leases and the last fencing token it saw.
#[derive(Default)]
pub struct Caller {
    pub model: Model,
    leases: Vec<Held>,
    last_token: u64,
}

/// `Err(LeaseLost)` is an expected answer; any other error fails the case.
fn fenced<T>(result: Result<T, Error>) -> Outcome<Result<T, LeaseLost>> {
    match result {
        Ok(v) => Ok(Ok(v)),
        Err(Error::LeaseLost) => Ok(Err(LeaseLost)),
        Err(other) => Err(Failure(format!("unexpected error: {other:?}"))),
    }
}

pub fn shape(claim: Claim) -> (Shape, Option<Lease>) {
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
        Claim::Completed(replay) => (Shape::Completed(replay.into()), None),
        Claim::Mismatch { stored } => (Shape::Mismatch(stored), None),
    }
}

fn pick(leases: &mut [Held], index: usize) -> Option<(usize, &mut Held)> {
    if leases.is_empty() {
        return None;
    }
    let i = index % leases.len();
    Some((i, &mut leases[i]))
}

impl Caller {
    /// Runs one key step on `store` and on the model and compares the answers. `keys` maps the
    /// step's local key index to the pool index.
    pub fn apply<S: IdempotencyStore + ?Sized>(
        &mut self,
        store: &S,
        now: u64,
        keys: &[usize],
        step: &Step,
    ) -> Outcome {
        match *step {
            Step::Claim { key: local, fp } => {
                let k = keys[local % keys.len()];
                let fp = fp % FINGERPRINTS;
                let expected = self.model.claim(k, fp, now, self.leases.len());
                let (got, lease) = shape(store.claim(&key(k), fingerprint(fp))?);
                ensure_eq!(got, expected, "claim of key {k} with fp {fp}");
                if let Some(lease) = lease {
                    ensure!(
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
                let k = keys[local % keys.len()];
                ensure_eq!(
                    store.lookup(&key(k))?.map(ViewShape::from),
                    self.model.view(k, now),
                    "lookup {k}"
                );
            }
            Step::Complete { lease, body } => {
                let Some((i, held)) = pick(&mut self.leases, lease) else {
                    return Ok(());
                };
                let expected = self.model.complete(held.key, i, now, response(body));
                let got = fenced(store.complete(&held.lease, response(body)))?;
                ensure_eq!(got, expected, "complete with lease {i}");
            }
            Step::Release { lease } => {
                let Some((i, held)) = pick(&mut self.leases, lease) else {
                    return Ok(());
                };
                let expected = self.model.release(held.key, i, now);
                let got = fenced(store.release(&held.lease))?;
                ensure_eq!(got, expected, "release with lease {i}");
            }
            Step::Heartbeat { lease } => {
                let Some((i, held)) = pick(&mut self.leases, lease) else {
                    return Ok(());
                };
                let before = held.lease.lease_until();
                let expected = self.model.heartbeat(held.key, i, now).map(ts);
                let got = fenced(store.heartbeat(&mut held.lease))?;
                ensure_eq!(got, expected, "heartbeat with lease {i}");
                let after = held.lease.lease_until();
                ensure_eq!(after, got.unwrap_or(before), "the lease's own deadline");
            }
            Step::Checkpoint { lease, data } => {
                let Some((i, held)) = pick(&mut self.leases, lease) else {
                    return Ok(());
                };
                let data = checkpoint_data(data);
                let before = held.lease.checkpoint().map(<[u8]>::to_vec);
                let expected = self.model.checkpoint(held.key, i, now, data.clone());
                let got = fenced(store.checkpoint(&mut held.lease, data.clone()))?;
                ensure_eq!(got, expected, "checkpoint with lease {i}");
                let after = held.lease.checkpoint().map(<[u8]>::to_vec);
                let want = if got.is_ok() { Some(data) } else { before };
                ensure_eq!(after, want, "the lease's own checkpoint");
            }
            Step::Advance { .. } | Step::Sweep { .. } | Step::Reopen | Step::Verify => {
                return Err(Failure(format!("{step:?} is not a key step")));
            }
        }
        Ok(())
    }

    /// Every key this caller owns looks up as the model says.
    pub fn check_keys<S: IdempotencyStore + ?Sized>(
        &self,
        store: &S,
        now: u64,
        keys: &[usize],
    ) -> Outcome {
        for &k in keys {
            ensure_eq!(
                store.lookup(&key(k))?.map(ViewShape::from),
                self.model.view(k, now),
                "key {k}"
            );
        }
        Ok(())
    }
}

/// The whole store agrees with the models: counts by state, physical records, a clean
/// `verify()`, and the store's time.
pub fn check_store(store: &Store, now: u64, models: &[&Model]) -> Outcome {
    check_backend(store, now, models)?;
    ensure_eq!(store.now()?, ts(now), "store time");
    Ok(())
}

/// [`check_store`] for any backend, without the time check (`now` is not part of the
/// [`IdempotencyStore`] trait).
pub fn check_backend<S: IdempotencyStore + ?Sized>(
    store: &S,
    now: u64,
    models: &[&Model],
) -> Outcome {
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
    ensure_eq!(got, want, "stats / record count");
    ensure_eq!(
        report.expiry_entries,
        report.records,
        "one expiry entry per record"
    );
    ensure!(
        report.is_clean(),
        "verify found problems: {:?}",
        report.problems
    );
    Ok(())
}

/// The settings of every model run: lease, retention, the manual clock and `max_batch`.
pub fn builder(clock: &ManualClock, max_batch: usize) -> StoreBuilder {
    let mut builder = Store::builder();
    builder
        .lease(Duration::from_millis(LEASE_MS))
        .retention(Duration::from_millis(RETENTION_MS))
        .max_batch(max_batch)
        .clock(clock.clone());
    builder
}

/// One caller on keys `0..SEQ_KEYS`, every step compared and the whole store checked after
/// each. `open` opens the store with the given settings, at the start and at each `Reopen`,
/// on the same storage each time.
pub fn run_sequential(
    steps: &[Step],
    checks: Checks,
    open: &dyn Fn(&StoreBuilder) -> Result<Store, Error>,
) -> Outcome {
    let clock = ManualClock::new(ts(T0));
    let settings = builder(&clock, 128);
    run_steps(
        steps,
        Ties::KeyHash,
        checks,
        &clock,
        &|| open(&settings),
        &|store, now| {
            ensure_eq!(store.now()?, ts(now), "store time");
            Ok(())
        },
    )
}

/// [`run_sequential`] on any backend. `open` opens the store on the same storage each time (at
/// the start and at each `Reopen`), with lease [`LEASE_MS`], retention [`RETENTION_MS`] and
/// `clock` (standing at [`T0`]) as its time source; the storage must start empty; `ties` is how
/// it orders a sweep's ties; `checks`, when the whole store is checked. `check` runs after
/// the model checks of every step.
pub fn run_steps<S: IdempotencyStore>(
    steps: &[Step],
    ties: Ties,
    checks: Checks,
    clock: &ManualClock,
    open: &dyn Fn() -> Result<S, Error>,
    check: &dyn Fn(&S, u64) -> Outcome,
) -> Outcome {
    let mut store = open()?;
    let keys: Vec<usize> = (0..SEQ_KEYS).collect();
    let mut caller = Caller::default();
    let mut now = T0;
    for (n, step) in steps.iter().enumerate() {
        let at = |f: Failure| Failure(format!("step {n} ({step:?}): {f}"));
        match *step {
            Step::Advance { ms } => {
                clock.advance(Duration::from_millis(ms));
                now += ms;
            }
            Step::Sweep { limit } => {
                let expected = sweep_models(&mut [&mut caller.model], |_| 0, now, limit, ties);
                let got = store.sweep(limit).map_err(Failure::from).map_err(at)?;
                if got != expected {
                    return Err(at(Failure(format!(
                        "sweep({limit}) removed {got}, the model expects {expected}"
                    ))));
                }
            }
            Step::Reopen => {
                drop(store);
                store = open().map_err(Failure::from).map_err(at)?;
            }
            Step::Verify => check_backend(&store, now, &[&caller.model]).map_err(at)?,
            _ => caller.apply(&store, now, &keys, step).map_err(at)?,
        }
        caller.check_keys(&store, now, &keys).map_err(at)?;
        if checks == Checks::EveryStep {
            check_backend(&store, now, &[&caller.model]).map_err(at)?;
        }
        check(&store, now).map_err(at)?;
    }
    check_backend(&store, now, &[&caller.model])
        .map_err(|f| Failure(format!("after the last step: {}", f.0)))
}

// ---------------------------------------------------------------------------------------------
// In-memory storage that survives a reopen
// ---------------------------------------------------------------------------------------------

/// A redb `StorageBackend` over a shared byte vector: clones share the bytes, so a store
/// dropped and reopened on a clone sees everything the first one wrote. `sync_data` is free.
#[derive(Debug, Clone, Default)]
pub struct MemDisk(Arc<Mutex<Vec<u8>>>);

impl MemDisk {
    fn bytes(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn span(offset: u64, len: usize) -> std::io::Result<std::ops::Range<usize>> {
    let start = usize::try_from(offset).map_err(std::io::Error::other)?;
    let end = start
        .checked_add(len)
        .ok_or_else(|| std::io::Error::other("offset overflow"))?;
    Ok(start..end)
}

impl redb::StorageBackend for MemDisk {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.bytes().len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let bytes = self.bytes();
        let data = bytes
            .get(span(offset, out.len())?)
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        out.copy_from_slice(data);
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        self.bytes().resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let range = span(offset, data.len())?;
        let mut bytes = self.bytes();
        if bytes.len() < range.end {
            bytes.resize(range.end, 0);
        }
        bytes[range].copy_from_slice(data);
        Ok(())
    }
}

/// [`run_sequential`] on a fresh [`MemDisk`].
pub fn run_in_memory(steps: &[Step]) -> Outcome {
    let disk = MemDisk::default();
    run_sequential(steps, Checks::EveryStep, &|settings| {
        settings.open_with_backend(disk.clone())
    })
}

// ---------------------------------------------------------------------------------------------
// Steps from fuzz bytes
// ---------------------------------------------------------------------------------------------

/// Reads fuzz bytes; past the end every field reads as zero.
struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn tag(&mut self) -> Option<u8> {
        let (&first, rest) = self.data.split_first()?;
        self.data = rest;
        Some(first)
    }

    fn byte(&mut self) -> u8 {
        self.tag().unwrap_or(0)
    }

    /// An `n`-byte little-endian number.
    fn uint(&mut self, n: usize) -> u64 {
        (0..n).fold(0, |acc, i| acc | u64::from(self.byte()) << (8 * i))
    }
}

/// A clock move, around the lease (10 s) and retention (100 s) boundaries as often as not.
fn advance_ms(bytes: &mut Bytes<'_>) -> u64 {
    match bytes.byte() % 8 {
        0 => 1 + bytes.uint(2) % 3_000,
        1 => LEASE_MS - 1,
        2 => LEASE_MS,
        3 => LEASE_MS - 1_000 + bytes.uint(2) % 2_001,
        4 => RETENTION_MS,
        5 => RETENTION_MS - 2_000 + bytes.uint(2) % 4_001,
        6 => 1 + bytes.uint(3) % (2 * RETENTION_MS),
        _ => 1,
    }
}

/// Steps from fuzz bytes: a tag byte picks the kind (its low four bits, weighted roughly as
/// the proptest strategy is), the following bytes its fields. At most [`MAX_STEPS`] steps.
pub fn decode_steps(data: &[u8]) -> Vec<Step> {
    let mut bytes = Bytes { data };
    let mut steps = Vec::new();
    while steps.len() < MAX_STEPS {
        let Some(tag) = bytes.tag() else { break };
        let step = match tag % 16 {
            0..=4 => {
                let b = usize::from(bytes.byte());
                Step::Claim {
                    key: b % SEQ_KEYS,
                    fp: (b / SEQ_KEYS) % FINGERPRINTS,
                }
            }
            5 | 6 => Step::Complete {
                lease: usize::from(bytes.byte()),
                body: bytes.byte(),
            },
            7 => Step::Release {
                lease: usize::from(bytes.byte()),
            },
            8 => Step::Heartbeat {
                lease: usize::from(bytes.byte()),
            },
            9 => Step::Checkpoint {
                lease: usize::from(bytes.byte()),
                data: bytes.byte(),
            },
            10 => Step::Lookup {
                key: usize::from(bytes.byte()) % SEQ_KEYS,
            },
            11..=13 => Step::Advance {
                ms: advance_ms(&mut bytes),
            },
            14 => Step::Sweep {
                limit: 1 + usize::from(bytes.byte() % 3),
            },
            _ => Step::Reopen,
        };
        steps.push(step);
    }
    steps
}

/// The `store_ops` fuzz target's body: decodes the bytes into steps and runs them on an
/// in-memory store that reopens, panicking on any disagreement with the model.
pub fn run_ops(data: &[u8]) {
    let steps = decode_steps(data);
    let contained = idempotency_store::contained_panics();
    if let Err(failure) = run_in_memory(&steps) {
        panic!("store and model disagree: {failure}\nsteps: {steps:#?}");
    }
    // The memory disk never damages a page, so a panic the store turned into an error was a
    // bug of ours (or redb's), not damage.
    assert_eq!(
        idempotency_store::contained_panics(),
        contained,
        "a panic was contained\nsteps: {steps:#?}"
    );
}
