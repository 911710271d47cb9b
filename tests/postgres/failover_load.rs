//! The load and the check shared by the failover tests (`pg_failover`, a hand-made failover;
//! `pg_patroni`, Patroni's): 32 threads claiming fresh keys and completing three in four, each
//! acknowledged claim and completion recorded; then, on the server serving after the fault,
//! every acknowledged claim must still be held (or completed) and every acknowledged
//! completion must replay its body, and no re-claim may acquire one of those keys (that would
//! run its operation twice).
#![cfg(feature = "postgres")]

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use idempotency_store::{
    Claim, Error, Fingerprint, IdempotencyStore, Key, RecordState, Response, pg::PgStore,
};

pub const THREADS: usize = 32;

/// The set-up script that the environment variable `var` names (`setup`, run as root); `None`,
/// with the reason printed, when it is unset (a failure under `CI=true`).
pub fn script(var: &str, setup: &str) -> Option<PathBuf> {
    match std::env::var(var) {
        Ok(path) if !path.trim().is_empty() => Some(PathBuf::from(path)),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but {var} is not set (see .ci/run)")
        }
        _ => {
            eprintln!("skipped: {var} (the path of {setup}, run as root) is not set; see .ci/run");
            None
        }
    }
}

/// Runs the set-up script with `args`; its standard output.
pub fn run(script: &PathBuf, args: &[&str]) -> String {
    let out = Command::new(script)
        .args(args)
        .output()
        .expect("run the set-up script");
    assert!(
        out.status.success(),
        "{} {args:?}: {}\n{}",
        script.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn builder() -> idempotency_store::pg::PgStoreBuilder {
    let mut builder = PgStore::builder();
    builder
        .pool_size(u32::try_from(THREADS).unwrap())
        .connection_timeout(Duration::from_secs(5))
        // Long enough that no lease lapses during the run: a re-claim that acquires a key is
        // then a lost record, never a takeover.
        .lease(Duration::from_secs(600));
    builder
}

pub fn fingerprint(key: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/failover", key])
}

/// What the workers saw.
#[derive(Default)]
pub struct Ledger {
    /// Keys whose claim was acknowledged (`Acquired`).
    pub claimed: Vec<String>,
    /// Keys whose completion was acknowledged (`Ok`); the body is the key.
    pub completed: Vec<String>,
    /// When each acknowledged write (claim or completion) returned.
    pub writes: Vec<Instant>,
    /// Calls that failed (during the failover).
    pub errors: usize,
    /// Failed calls whose outcome is unknown.
    pub unknown: usize,
}

/// Fresh keys: claim, then (three keys in four) complete. `prefix` keeps runs apart.
fn worker(store: &PgStore, prefix: &str, stop: &AtomicBool, ledger: &Mutex<Ledger>) {
    let mut i = 0u64;
    while !stop.load(Ordering::Relaxed) {
        i += 1;
        let name = format!("{prefix}-{i}");
        let key = Key::new(&name).unwrap();
        let lease = match store.claim(&key, fingerprint(&name)) {
            Ok(Claim::Acquired(lease)) => lease,
            Ok(other) => panic!("{name}: a fresh key answered {other:?}"),
            Err(err) => {
                failed(ledger, &err);
                continue;
            }
        };
        {
            let mut l = ledger.lock().unwrap();
            l.claimed.push(name.clone());
            l.writes.push(Instant::now());
        }
        if i.is_multiple_of(4) {
            continue; // held, never completed
        }
        match store.complete(&lease, Response::new(201, name.clone())) {
            Ok(()) => {
                let mut l = ledger.lock().unwrap();
                l.completed.push(name);
                l.writes.push(Instant::now());
            }
            Err(err) => failed(ledger, &err),
        }
    }
}

fn failed(ledger: &Mutex<Ledger>, err: &Error) {
    let mut l = ledger.lock().unwrap();
    l.errors += 1;
    l.unknown += usize::from(err.outcome_unknown());
    drop(l);
    // A failing call is quick while no server accepts writes: do not spin.
    std::thread::sleep(Duration::from_millis(5));
}

/// The figures of one failover.
#[derive(Default)]
pub struct Figures {
    pub claims_acked: usize,
    pub completions_acked: usize,
    pub errors: usize,
    pub outcome_unknown: usize,
    pub lost_claims: usize,
    pub lost_completions: usize,
    pub double_runs: usize,
    /// From the fault (the promotion, the kill, the switchover's start) to the first
    /// acknowledged write after it.
    pub first_write_after_fault: Option<Duration>,
    /// The longest stretch without an acknowledged write: the failover's.
    pub write_unavailable: Duration,
}

impl std::fmt::Debug for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ms =
            |d: Option<Duration>| d.map_or("never".to_owned(), |d| format!("{} ms", d.as_millis()));
        write!(
            f,
            "{} claims and {} completions acknowledged, {} calls failed ({} outcome unknown); \
             lost: {} claims, {} completions; double runs: {}; first write {} after the \
             fault; writes unavailable {}",
            self.claims_acked,
            self.completions_acked,
            self.errors,
            self.outcome_unknown,
            self.lost_claims,
            self.lost_completions,
            self.double_runs,
            ms(self.first_write_after_fault),
            ms((self.write_unavailable != Duration::MAX).then_some(self.write_unavailable)),
        )
    }
}

/// The workers, running.
pub struct Load {
    pub store: Arc<PgStore>,
    stop: Arc<AtomicBool>,
    ledger: Arc<Mutex<Ledger>>,
    workers: Vec<JoinHandle<()>>,
}

impl Load {
    /// `THREADS` workers on `store`, their keys named `{run}-t{thread}-{i}`.
    pub fn start(store: PgStore, run: &str) -> Load {
        let store = Arc::new(store);
        let stop = Arc::new(AtomicBool::new(false));
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let workers = (0..THREADS)
            .map(|thread| {
                let (store, stop, ledger) = (store.clone(), stop.clone(), ledger.clone());
                let prefix = format!("{run}-t{thread}");
                std::thread::spawn(move || worker(&store, &prefix, &stop, &ledger))
            })
            .collect();
        Load {
            store,
            stop,
            ledger,
            workers,
        }
    }

    /// Waits up to `limit` for an acknowledged write after `fault`; returns when it was.
    pub fn await_write_after(&self, fault: Instant, limit: Duration) -> Option<Instant> {
        let deadline = fault + limit;
        loop {
            let after = self
                .ledger
                .lock()
                .unwrap()
                .writes
                .iter()
                .copied()
                .filter(|t| *t > fault)
                .min();
            if after.is_some() {
                return after;
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops the workers; the ledger and its figures (the check's still zero).
    pub fn finish(self, fault: Instant) -> (Ledger, Figures) {
        self.stop.store(true, Ordering::Relaxed);
        for worker in self.workers {
            worker.join().expect("worker");
        }
        drop(self.store);
        let ledger = Arc::try_unwrap(self.ledger)
            .ok()
            .unwrap()
            .into_inner()
            .unwrap();
        let mut writes = ledger.writes.clone();
        writes.sort_unstable();
        let figures = Figures {
            claims_acked: ledger.claimed.len(),
            completions_acked: ledger.completed.len(),
            errors: ledger.errors,
            outcome_unknown: ledger.unknown,
            first_write_after_fault: writes.iter().find(|t| **t > fault).map(|t| *t - fault),
            write_unavailable: writes
                .windows(2)
                .map(|w| w[1] - w[0])
                .max()
                .unwrap_or(Duration::MAX),
            ..Figures::default()
        };
        (ledger, figures)
    }
}

/// Every acknowledged claim still held or completed, every acknowledged completion replaying
/// its body, and no re-claim acquiring any of those keys; on the server `url` reaches now.
pub fn check(url: &str, ledger: &Ledger, figures: &mut Figures) {
    let store = Arc::new(
        builder()
            .connect(url)
            .expect("connect to the server serving after the fault"),
    );
    let completed: Arc<HashSet<String>> = Arc::new(ledger.completed.iter().cloned().collect());
    let keys = Arc::new(ledger.claimed.clone());
    let counts = Arc::new(Mutex::new((0usize, 0usize, 0usize)));
    let checkers: Vec<_> = (0..THREADS)
        .map(|thread| {
            let (store, completed, keys, counts) = (
                store.clone(),
                completed.clone(),
                keys.clone(),
                counts.clone(),
            );
            std::thread::spawn(move || {
                let (mut lost_claims, mut lost_completions, mut double_runs) = (0, 0, 0);
                for name in keys.iter().skip(thread).step_by(THREADS) {
                    let key = Key::new(name).unwrap();
                    let view = store.lookup(&key).expect("lookup");
                    let done = completed.contains(name);
                    match view.map(|v| v.state) {
                        None => {
                            if done {
                                lost_completions += 1;
                            } else {
                                lost_claims += 1;
                            }
                        }
                        Some(RecordState::Completed { .. }) => {}
                        Some(RecordState::InProgress { .. }) if !done => {}
                        Some(_) => lost_completions += 1,
                    }
                    match store.claim(&key, fingerprint(name)).expect("re-claim") {
                        Claim::Acquired(_) => double_runs += 1,
                        Claim::Completed(replay) if done => {
                            if replay.response.body != name.as_bytes() {
                                lost_completions += 1;
                            }
                        }
                        Claim::Completed(_) | Claim::InProgress { .. } => {}
                        other => panic!("{name}: re-claim answered {other:?}"),
                    }
                }
                let mut c = counts.lock().unwrap();
                c.0 += lost_claims;
                c.1 += lost_completions;
                c.2 += double_runs;
            })
        })
        .collect();
    for checker in checkers {
        checker.join().expect("checker");
    }
    let (lost_claims, lost_completions, double_runs) = *counts.lock().unwrap();
    figures.lost_claims = lost_claims;
    figures.lost_completions = lost_completions;
    figures.double_runs = double_runs;
}
