//! Steps: one call each, run against a store and the model side by side, and the checks that
//! compare the two.

use std::time::Duration;

use idempotency_store::{Claim, Error, IdempotencyStore, Lease, ManualClock, Store, StoreBuilder};

use super::{
    Counts, FINGERPRINTS, Failure, LEASE_MS, LeaseLost, Model, Outcome, RETENTION_MS, SEQ_KEYS,
    Shape, T0, Ties, ViewShape, checkpoint_data, fingerprint, key, response, sweep_models, ts,
};

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
