//! History checks (issue 21): many threads call random operations on a few keys of one store
//! while the clock moves; every call is recorded and the history is checked per key for
//! linearizability against the reference model, token order and at most one live lease (the
//! checker is in `tests/history/`). Both backends: the redb `Store` with a manual clock,
//! and with `--features postgres` `PgStore` with a manual clock and with the server's clock.
//!
//! `cargo test` runs short histories. The long runs (8 and 64 threads, 100,000 calls, 3 seeds,
//! every backend) are ignored tests; CONTRIBUTING.md's "Long runs" section has the command and the
//! variables that size them (`HISTORY_OPS`, `HISTORY_SEEDS`, `HISTORY_THREADS`).
//!
//! PostgreSQL histories read the server from `IDEMPOTENCY_PG_URL`; without it they print why
//! and pass as skipped, except under `CI=true`, where a missing server fails them.

use std::time::Duration;

use idempotency_store::{
    Claim, Clock, IdempotencyStore, Key, ManualClock, RecordState, Result, Store, Timestamp,
};

use crate::reference;
// The checker under the name it had as a test binary of its own.
#[allow(clippy::module_inception)]
#[path = "../history/mod.rs"]
mod history;

use history::{Call, Op, Plan, Ret, Rng, Target, Times, check, record};
use reference::{LeaseLost, Model, ReplayShape, Shape, ViewShape, fingerprint, response};

/// Lease and retention of every recorded run: short, so that leases lapse and records expire
/// all the time (as in the runs that found the PostgreSQL bug).
const TIMES: Times = Times {
    lease_ms: 50,
    retention_ms: 300,
    exact_lapse: true,
};
const KEYS: usize = 8;
const T0: u64 = 1_700_000_000_000;

// ---------------------------------------------------------------------------------------------
// Targets
// ---------------------------------------------------------------------------------------------

/// A store driven by a manual clock that the threads move between calls.
struct Manual<S> {
    store: S,
    clock: ManualClock,
    can_wait: bool,
}

impl<S: IdempotencyStore + WaitingClaim> Target for Manual<S> {
    type Store = S;

    fn store(&self) -> &S {
        &self.store
    }

    fn now(&self) -> u64 {
        self.clock.now().as_millis()
    }

    fn tick(&self, rng: &mut Rng) {
        // About 0.75 ms per call on average: a 50 ms lease spans about 70 calls, a 300 ms
        // retention about 400.
        if rng.below(2) == 0 {
            self.clock.advance(Duration::from_millis(1 + rng.below(2)));
        }
    }

    fn can_wait(&self) -> bool {
        self.can_wait
    }

    fn claim_wait(&self, key: &Key, fp: usize) -> Result<Claim> {
        self.store.claim_wait_for(key, fp)
    }
}

/// `claim_wait` where a backend has it.
trait WaitingClaim {
    fn claim_wait_for(&self, key: &Key, fp: usize) -> Result<Claim>;
}

impl WaitingClaim for Store {
    fn claim_wait_for(&self, key: &Key, fp: usize) -> Result<Claim> {
        self.claim_wait(key, fingerprint(fp), history::WAIT)
    }
}

fn redb(clock: &ManualClock) -> Result<Store> {
    Store::builder()
        .lease(Duration::from_millis(TIMES.lease_ms))
        .retention(Duration::from_millis(TIMES.retention_ms))
        .clock(clock.clone())
        .open_in_memory()
}

/// Records and checks one history; panics with the violations if there are any.
fn run<T: Target>(label: &str, target: &T, times: Times, threads: usize, ops: usize, seed: u64) {
    let plan = Plan {
        threads,
        keys: KEYS,
        ops,
        seed,
    };
    let started = std::time::Instant::now();
    let history = record(target, &plan);
    let recorded = started.elapsed();
    let report = check(&history, times);
    let acquired = history
        .iter()
        .filter(|op| matches!(op.ret, Ret::Claim { token: Some(_), .. }))
        .count();
    println!(
        "history {label}: threads={threads} seed={seed} operations={} keys={} acquired={acquired} \
         search_states={} violations={} (recorded in {recorded:.1?}, checked in {:.1?})",
        report.ops,
        report.keys,
        report.states,
        report.violations.len(),
        started.elapsed() - recorded,
    );
    // HISTORY_DUMP=path writes a failing history there, one call a line in invocation order.
    if !report.violations.is_empty()
        && let Ok(path) = std::env::var("HISTORY_DUMP")
    {
        let mut sorted = history.clone();
        sorted.sort_by_key(|op| op.inv);
        let lines: Vec<String> = sorted.iter().map(|op| format!("{op:?}")).collect();
        std::fs::write(&path, lines.join("\n")).expect("write the history");
        eprintln!("history written to {path}");
    }
    assert!(
        report.violations.is_empty(),
        "{label}, threads {threads}, seed {seed}: {} violations; the first:\n{}",
        report.violations.len(),
        report.violations[..report.violations.len().min(3)].join("\n")
    );
}

fn run_redb(threads: usize, ops: usize, seed: u64) {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = redb(&clock).expect("open the store");
    let target = Manual {
        store,
        clock,
        can_wait: true,
    };
    run("redb", &target, TIMES, threads, ops, seed);
}

#[test]
fn redb_histories_are_linearizable() {
    run_redb(8, 4_000, 1);
    run_redb(64, 2_000, 2);
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL
// ---------------------------------------------------------------------------------------------

#[cfg(feature = "postgres")]
mod pg {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    use idempotency_store::pg::PgStore;
    use idempotency_store::{Claim, IdempotencyStore, Key, ManualClock, Result, Timestamp};

    use super::history::{Rng, Target};
    use super::{Manual, T0, TIMES, WaitingClaim};

    impl WaitingClaim for PgStore {
        fn claim_wait_for(&self, _: &Key, _: usize) -> Result<Claim> {
            unreachable!("PgStore has no claim_wait")
        }
    }

    pub use crate::common::pg::{Schema, url};

    impl Schema {
        pub fn connect(&self, threads: usize, clock: Option<&ManualClock>) -> PgStore {
            let mut builder = crate::common::pg::builder();
            builder
                .schema(self.name.as_str())
                .lease(Duration::from_millis(TIMES.lease_ms))
                .retention(Duration::from_millis(TIMES.retention_ms))
                .pool_size(u32::try_from(threads.min(32)).unwrap_or(32));
            if let Some(clock) = clock {
                builder.clock(clock.clone());
            }
            builder.connect(&self.url).expect("connect to PostgreSQL")
        }
    }

    /// `PgStore` on the server's clock; the recorder reads this machine's clock, which must
    /// be the server's (a local server).
    pub struct ServerClock {
        pub store: PgStore,
    }

    pub fn wall_ms() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }

    impl Target for ServerClock {
        type Store = PgStore;

        fn store(&self) -> &PgStore {
            &self.store
        }

        fn now(&self) -> u64 {
            wall_ms()
        }

        fn tick(&self, _: &mut Rng) {}

        fn can_wait(&self) -> bool {
            false
        }

        fn claim_wait(&self, _: &Key, _: usize) -> Result<Claim> {
            unreachable!("PgStore has no claim_wait")
        }
    }

    /// Records and checks one history on a fresh schema, with a manual clock.
    pub fn run_manual(url: &str, threads: usize, ops: usize, seed: u64) {
        let schema = Schema::named(url.to_owned(), "hist", "history");
        let clock = ManualClock::new(Timestamp::from_millis(T0));
        let target = Manual {
            store: schema.connect(threads, Some(&clock)),
            clock,
            can_wait: false,
        };
        super::run("postgres/manual-clock", &target, TIMES, threads, ops, seed);
    }

    /// Records and checks one history on a fresh schema, with the server's clock. Skipped
    /// (with the reason printed) if the server's clock is not this machine's.
    pub fn run_server(url: &str, threads: usize, ops: usize, seed: u64) {
        let schema = Schema::named(url.to_owned(), "hist", "history");
        let target = ServerClock {
            store: schema.connect(threads, None),
        };
        let before = wall_ms();
        let server = target
            .store
            .now()
            .expect("read the server's clock")
            .as_millis();
        let after = wall_ms();
        if !(before..=after).contains(&server) {
            eprintln!(
                "skipped: the server's clock ({server}) is not this machine's ([{before}, \
                 {after}]); the server-clock history needs a local server"
            );
            return;
        }
        let times = super::Times {
            exact_lapse: false,
            ..TIMES
        };
        super::run("postgres/server-clock", &target, times, threads, ops, seed);
    }
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_histories_are_linearizable() {
    let Some(url) = pg::url() else { return };
    pg::run_manual(&url, 8, 2_000, 1);
    pg::run_server(&url, 8, 2_000, 2);
}

// ---------------------------------------------------------------------------------------------
// Long runs
// ---------------------------------------------------------------------------------------------

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn env_threads() -> Vec<usize> {
    std::env::var("HISTORY_THREADS")
        .ok()
        .map(|v| v.split(',').filter_map(|t| t.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![8, 64])
}

/// The long runs of the redb store: every thread count of `HISTORY_THREADS` (8,64) with
/// `HISTORY_SEEDS` (3) seeds of `HISTORY_OPS` (100000) calls each.
#[test]
#[ignore = "long: run with --release -- --ignored (see CONTRIBUTING.md, Long runs)"]
fn long_redb_histories() {
    let ops = env_usize("HISTORY_OPS", 100_000);
    for threads in env_threads() {
        for seed in 1..=env_usize("HISTORY_SEEDS", 3) as u64 {
            run_redb(threads, ops, seed);
        }
    }
}

/// The long runs of `PgStore`, with a manual clock and with the server's, sized as
/// [`long_redb_histories`].
#[cfg(feature = "postgres")]
#[test]
#[ignore = "long: run with --release -- --ignored (see CONTRIBUTING.md, Long runs)"]
fn long_postgres_histories() {
    let Some(url) = pg::url() else { return };
    let ops = env_usize("HISTORY_OPS", 100_000);
    for threads in env_threads() {
        for seed in 1..=env_usize("HISTORY_SEEDS", 3) as u64 {
            pg::run_manual(&url, threads, ops, seed);
            pg::run_server(&url, threads, ops, seed);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The checker catches broken histories
// ---------------------------------------------------------------------------------------------

/// A sequential history of key 0 (lease 50 ms, retention 300 ms), each answer the model's:
///
/// | # | time | call | answer |
/// |---|---|---|---|
/// | 0 | 1000 | claim (fp 0) | Acquired, token 1, until 1050 |
/// | 1 | 1001 | lookup | in progress |
/// | 2 | 1002 | complete token 1 (body 7) | Ok |
/// | 3 | 1003 | claim (fp 0) | Completed (body 7), expires 1302 |
/// | 4 | 1004 | lookup | completed |
/// | 5 | 1400 | claim (fp 0) | Acquired, token 2 (the record expired) |
/// | 6 | 1401 | release token 2 | Ok |
/// | 7 | 1402 | claim (fp 1) | Acquired, token 3 |
/// | 8 | 1460 | claim (fp 1) | Acquired, token 4 (takeover, attempt 2) |
fn sequential() -> Vec<Op> {
    let mut model = Model::with_times(TIMES.lease_ms, TIMES.retention_ms);
    let claim = |model: &mut Model, now: u64, fp: usize, token: u64| {
        let shape = model.claim(0, fp, now, token as usize);
        let token = matches!(shape, Shape::Acquired { .. }).then_some(token);
        (Call::Claim { fp, wait: false }, Ret::Claim { shape, token })
    };
    let mut calls = Vec::new();
    calls.push((1000, claim(&mut model, 1000, 0, 1)));
    calls.push((1001, (Call::Lookup, Ret::View(model.view(0, 1001)))));
    let done = model.complete(0, 1, 1002, response(7));
    calls.push((
        1002,
        (Call::Complete { token: 1, body: 7 }, Ret::Fenced(done)),
    ));
    calls.push((1003, claim(&mut model, 1003, 0, 99)));
    calls.push((1004, (Call::Lookup, Ret::View(model.view(0, 1004)))));
    calls.push((1400, claim(&mut model, 1400, 0, 2)));
    let done = model.release(0, 2, 1401);
    calls.push((1401, (Call::Release { token: 2 }, Ret::Fenced(done))));
    calls.push((1402, claim(&mut model, 1402, 1, 3)));
    calls.push((1460, claim(&mut model, 1460, 1, 4)));
    calls
        .into_iter()
        .enumerate()
        .map(|(i, (at, (call, ret)))| Op {
            thread: i % 2,
            key: 0,
            call,
            ret,
            inv: 2 * i as u64,
            resp: 2 * i as u64 + 1,
            before: at,
            after: at,
        })
        .collect()
}

/// The violations the checker finds in `history`.
fn violations(history: &[Op]) -> Vec<String> {
    check(history, TIMES).violations
}

fn assert_caught(what: &str, history: &[Op]) {
    let found = violations(history);
    assert!(
        !found.is_empty(),
        "{what}: the checker passed a broken history"
    );
    println!("{what}: {}", found[0]);
}

fn acquired_token(op: &mut Op) -> &mut u64 {
    match &mut op.ret {
        Ret::Claim {
            token: Some(token), ..
        } => token,
        other => panic!("not an acquisition: {other:?}"),
    }
}

#[test]
fn the_unbroken_history_passes() {
    let history = sequential();
    assert!(matches!(
        &history[3].ret,
        Ret::Claim {
            shape: Shape::Completed(_),
            ..
        }
    ));
    assert!(matches!(
        &history[8].ret,
        Ret::Claim {
            shape: Shape::Acquired { attempt: 2, .. },
            ..
        }
    ));
    assert_eq!(violations(&history), Vec::<String>::new());
    // Concurrent calls may be ordered either way: overlap the lookup with the completion.
    let mut overlapping = history.clone();
    overlapping[2].inv = 2;
    overlapping[1].resp = 5;
    assert_eq!(violations(&overlapping), Vec::<String>::new());
}

#[test]
fn a_token_that_went_down_is_caught() {
    let mut history = sequential();
    *acquired_token(&mut history[7]) = 1;
    assert_caught("token went down", &history);
}

#[test]
fn two_live_leases_are_caught() {
    // A second claimer also "acquires" while token 1's lease is live.
    let mut history = sequential();
    let mut second = history[0].clone();
    *acquired_token(&mut second) = 5;
    second.thread = 9;
    history.insert(1, second);
    assert_caught("two live leases", &history);
}

#[test]
fn a_replay_of_a_wrong_body_is_caught() {
    let mut history = sequential();
    let Ret::Claim {
        shape: Shape::Completed(ReplayShape { response, .. }),
        ..
    } = &mut history[3].ret
    else {
        panic!("not a replay");
    };
    response.body = b"another body".to_vec();
    assert_caught("replay of a wrong body", &history);
}

#[test]
fn a_stale_read_after_a_completed_write_is_caught() {
    // The lookup began after the completion returned, yet sees the record in progress.
    let mut history = sequential();
    history[4].ret = history[1].ret.clone();
    assert!(matches!(
        history[4].ret,
        Ret::View(Some(ViewShape {
            state: RecordState::InProgress { .. },
            ..
        }))
    ));
    assert_caught("stale read after a completed write", &history);
}

#[test]
fn an_acquisition_while_another_lease_is_live_is_caught() {
    // Token 3's claim returned before token 2's release began.
    let mut history = sequential();
    (history[7].inv, history[7].resp) = (12, 13);
    (history[6].inv, history[6].resp) = (14, 15);
    history[7].before = 1401;
    history[7].after = 1401;
    history[6].before = 1402;
    history[6].after = 1402;
    let Ret::Claim {
        shape: Shape::Acquired { lease_until, .. },
        ..
    } = &mut history[7].ret
    else {
        panic!("not an acquisition");
    };
    *lease_until = Timestamp::from_millis(1401 + TIMES.lease_ms);
    assert_caught("acquired while another lease is live", &history);
}

#[test]
fn an_expired_record_replayed_is_caught() {
    // The replay's call ran after the record expired (completed at 1002, retention 300).
    let mut history = sequential();
    history[3].before = 1302;
    history[3].after = 1302;
    assert_caught("expired record replayed", &history);
}

#[test]
fn a_backdated_lease_is_caught() {
    // Token 2's lease claims to start at 1390, before its call began at 1400.
    let mut history = sequential();
    let Ret::Claim {
        shape: Shape::Acquired { lease_until, .. },
        ..
    } = &mut history[5].ret
    else {
        panic!("not an acquisition");
    };
    *lease_until = Timestamp::from_millis(1390 + TIMES.lease_ms);
    assert_caught("backdated lease", &history);
}

#[test]
fn a_fenced_write_after_a_takeover_is_caught() {
    // Token 3 completes after token 4 took the key over.
    let mut history = sequential();
    let mut late = history[2].clone();
    late.call = Call::Complete { token: 3, body: 1 };
    late.ret = Ret::Fenced(Ok(()));
    late.inv = 100;
    late.resp = 101;
    late.before = 1461;
    late.after = 1461;
    history.push(late.clone());
    assert_caught("fenced write after a takeover", &history);
    // The same call answered LeaseLost is fine.
    let last = history.len() - 1;
    history[last].ret = Ret::Fenced(Err(LeaseLost));
    assert_eq!(violations(&history), Vec::<String>::new());
}

#[test]
fn the_search_explores_concurrent_orders() {
    // Two claims of a fresh key overlap: either may have won, but only one.
    let mut model = Model::with_times(TIMES.lease_ms, TIMES.retention_ms);
    let won = model.claim(0, 0, 1000, 1);
    let lost = model.claim(0, 0, 1000, 2);
    let op = |inv, resp, shape: &Shape, token| Op {
        thread: inv as usize,
        key: 0,
        call: Call::Claim { fp: 0, wait: false },
        ret: Ret::Claim {
            shape: shape.clone(),
            token,
        },
        inv,
        resp,
        before: 1000,
        after: 1000,
    };
    // The loser was invoked first and returned last.
    let history = vec![op(0, 3, &lost, None), op(1, 2, &won, Some(1))];
    assert_eq!(violations(&history), Vec::<String>::new());
    let both = vec![op(0, 3, &won, Some(2)), op(1, 2, &won, Some(1))];
    assert_caught("two concurrent winners", &both);
}

#[test]
fn a_completion_late_in_a_long_call_is_found() {
    // Found on Citus under load: a completion's call spans 1010..=1200 (its lease lapsed at
    // 1050, its record expires at 1300); no read reveals when it ran. A claim at 1450..=1460
    // still finds the completed record (so it ran after 1150), and one at 1480 finds it
    // expired (so it ran at 1180 at the latest): only a time in 1151..=1180 fits.
    let mut model = Model::with_times(TIMES.lease_ms, TIMES.retention_ms);
    let op = |inv: u64, (before, after), call, ret| Op {
        thread: inv as usize,
        key: 0,
        call,
        ret,
        inv,
        resp: inv + 1,
        before,
        after,
    };
    let claim = |model: &mut Model, now, fp, token: u64| {
        let shape = model.claim(0, fp, now, token as usize);
        let token = matches!(shape, Shape::Acquired { .. }).then_some(token);
        (Call::Claim { fp, wait: false }, Ret::Claim { shape, token })
    };
    let (call, ret) = claim(&mut model, 1000, 0, 1);
    let first = op(0, (1000, 1000), call, ret);
    let done = model.complete(0, 1, 1170, response(7));
    let complete = op(
        2,
        (1010, 1200),
        Call::Complete { token: 1, body: 7 },
        Ret::Fenced(done),
    );
    let (call, ret) = claim(&mut model, 1455, 1, 99);
    assert!(matches!(
        ret,
        Ret::Claim {
            shape: Shape::Mismatch(_),
            ..
        }
    ));
    let live = op(4, (1450, 1460), call, ret);
    let (call, ret) = claim(&mut model, 1480, 1, 2);
    assert!(matches!(
        ret,
        Ret::Claim {
            shape: Shape::Acquired { attempt: 1, .. },
            ..
        }
    ));
    let expired = op(6, (1470, 1490), call, ret);
    assert_eq!(
        violations(&[first.clone(), complete.clone(), live.clone(), expired]),
        Vec::<String>::new()
    );
    // Without the claim that saw it expired, the latest time of the call fits too.
    assert_eq!(violations(&[first, complete, live]), Vec::<String>::new());
}
