//! Crash consistency with real processes: a child runs a mixed workload (claims, completions,
//! releases, takeovers, a background sweeper; 8 threads so group-commit batches are in flight)
//! and logs each acknowledged result *after* the store call returned Ok. Half the completions
//! (even tokens) write a ledger row through an effect in the same batch. The parent kills it
//! with SIGKILL at a random moment, reopens the file and checks every acknowledged result
//! against the store.
//!
//! `cargo test` runs 12 kills per test, with `IDEMPOTENCY_TEST_SCALE=full` (as CI runs it) 50;
//! `CRASH_ITERATIONS=1000 cargo test --release --test durability -- crash::` is the long run.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Key, ManualClock, RecordState, Result, Store, Timestamp};

use crate::acks;
use crate::common::{Rng, scaled};
use acks::{Acks, Event, LEDGER, check_ledger, complete, fingerprint};

const CHILD_ENV: &str = "IDEMPOTENCY_CRASH_CHILD_DIR";
const RETENTION: Duration = Duration::from_secs(10);
const LEASE: Duration = Duration::from_secs(5);
const THREADS: usize = 8;

/// "1" for a run on the portable log path (`StoreBuilder::portable_log_sync`).
const PORTABLE_ENV: &str = "IDEMPOTENCY_CRASH_PORTABLE";

fn builder(clock: &ManualClock) -> idempotency_store::StoreBuilder {
    let mut builder = Store::builder();
    builder
        .portable_log_sync(std::env::var(PORTABLE_ENV).is_ok_and(|v| v == "1"))
        .retention(RETENTION)
        .lease(LEASE)
        .max_batch(32)
        // A small log (halves of 32 KiB): the children switch log halves and checkpoint in
        // the background many times between kills, so kills land in those too.
        .log_size(64 << 10)
        .effect_table(LEDGER)
        .clock(clock.clone());
    builder
}

// ---------------------------------------------------------------- the child process

/// Not a test on its own: the parent runs this binary with `CHILD_ENV` set, and this function
/// then becomes the crashing workload. Without the variable it returns at once.
#[test]
fn crash_child_process() -> Result<()> {
    let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return Ok(());
    };
    let iteration = std::env::var("IDEMPOTENCY_CRASH_ITERATION").unwrap_or_default();
    let clock = ManualClock::new(Timestamp::EPOCH);
    let store = Arc::new(builder(&clock).open(dir.join("store.redb"))?);
    // Start where the file's time stands, so the child's ticks move the store's time.
    clock.set(store.now()?);
    let _sweeper = store.start_sweeper(Duration::from_millis(5), 64);
    println!("ready");
    std::io::stdout().flush().ok();
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (store, clock) = (Arc::clone(&store), clock.clone());
            let log = dir.join(format!("log-{iteration}-{t}.txt"));
            let prefix = format!("i{iteration}-w{t}");
            std::thread::spawn(move || child_worker(&store, &clock, &log, &prefix))
        })
        .collect();
    for worker in workers {
        worker.join().expect("worker panicked")?;
    }
    Ok(())
}

struct Log(File);

impl Log {
    fn line(&mut self, line: String) {
        // Written after the store call returned Ok, and synced, so a logged result was
        // acknowledged before the kill.
        self.0
            .write_all(format!("{line}\n").as_bytes())
            .expect("log write");
        self.0.sync_data().expect("log sync");
    }
}

fn child_worker(store: &Store, clock: &ManualClock, log: &Path, prefix: &str) -> Result<()> {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log");
    let mut log = Log(file);
    let mut abandoned: Vec<String> = Vec::new();
    for i in 0u64.. {
        clock.advance(Duration::from_millis(1));
        // Every fifth round retries an abandoned key, which a lapsed lease lets us take over.
        let name = match (i % 5, abandoned.is_empty()) {
            (0, false) => abandoned.remove(0),
            _ => format!("{prefix}-{i}"),
        };
        let key = Key::new(&name)?;
        let before = store.now()?.as_millis();
        let lease = match store.claim(&key, fingerprint(&name))? {
            Claim::Acquired(lease) => lease,
            Claim::InProgress { .. } => {
                abandoned.push(name);
                continue;
            }
            Claim::Completed(_) | Claim::Mismatch { .. } => continue,
        };
        let token = lease.token();
        log.line(format!("A {name} {token} {before}"));
        match i % 10 {
            0..=5 => {
                let before = store.now()?.as_millis();
                complete(store, &lease, &name)?;
                log.line(format!("C {name} {token} {before}"));
            }
            6 | 7 => {
                log.line(format!("r {name} {token} 0"));
                store.release(&lease)?;
                log.line(format!("R {name} {token} 0"));
            }
            _ => abandoned.push(name),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- the parent

fn read_logs(dir: &Path) -> Acks {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("log-"))
        })
        .collect();
    files.sort();
    let mut acks = Acks::default();
    for path in files {
        let text = std::fs::read_to_string(&path).expect("read log");
        // A line without its newline was cut by the kill: it was never acknowledged.
        let complete = text.rfind('\n').map_or("", |end| &text[..end]);
        for line in complete.lines() {
            let parts: Vec<&str> = line.split(' ').collect();
            let [kind, name, token, clock] = parts[..] else {
                panic!("bad log line {line:?} in {}", path.display());
            };
            let event = Event {
                kind: kind.chars().next().expect("kind"),
                token: token.parse().expect("token"),
                clock: clock.parse().expect("clock"),
            };
            acks.record(name, event);
        }
    }
    acks
}

/// An in-progress record of the dead child is taken over only once its lease lapses.
fn check_takeover(store: &Store, clock: &ManualClock, acks: &Acks, log: &mut Log) -> Result<bool> {
    let now = store.now()?;
    for name in acks.keys.keys() {
        let key = Key::new(name)?;
        let Some(view) = store.lookup(&key)? else {
            continue;
        };
        let RecordState::InProgress { lease_until, .. } = view.state else {
            continue;
        };
        if lease_until <= now {
            continue;
        }
        clock.set(Timestamp::from_millis(lease_until.as_millis() - 1));
        assert!(
            matches!(
                store.claim(&key, fingerprint(name))?,
                Claim::InProgress { .. }
            ),
            "{name}: taken over before its lease lapsed"
        );
        clock.set(lease_until);
        let Claim::Acquired(lease) = store.claim(&key, fingerprint(name))? else {
            panic!("{name}: not taken over after its lease lapsed");
        };
        assert_eq!(lease.attempt(), view.attempt + 1);
        let before = store.now()?.as_millis();
        log.line(format!("A {name} {} {before}", lease.token()));
        complete(store, &lease, name)?;
        log.line(format!("C {name} {} {before}", lease.token()));
        return Ok(true);
    }
    Ok(false)
}

/// The log written with `O_DSYNC` (the default on Linux).
#[test]
fn sigkill_never_loses_an_acknowledged_result() -> Result<()> {
    sigkill_loop(false)
}

/// The log written with a write and `sync_data`, as on every platform but Linux.
#[test]
fn sigkill_never_loses_an_acknowledged_result_portable_log() -> Result<()> {
    sigkill_loop(true)
}

fn sigkill_loop(portable: bool) -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return Ok(());
    }
    let iterations: usize = std::env::var("CRASH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| scaled(12, 50));
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("test binary");
    let mut rng = Rng::from_clock();
    println!("crash test: seed {}, {iterations} kills", rng.0);
    let (mut kills, mut checks, mut takeovers, mut acknowledged) = (0, 0, 0, 0);
    let mut ledger_rows = 0;
    let started = Instant::now();
    for iteration in 0..iterations {
        let mut child = Command::new(&exe)
            .args([
                "--exact",
                "crash::crash_child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, dir.path())
            .env(PORTABLE_ENV, if portable { "1" } else { "" })
            .env("IDEMPOTENCY_CRASH_ITERATION", iteration.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child");
        let mut ready = String::new();
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        while !ready.contains("ready") {
            ready.clear();
            assert!(
                out.read_line(&mut ready).expect("child stdout") > 0,
                "child died before ready"
            );
        }
        std::thread::sleep(Duration::from_millis(20 + rng.next() % 300));
        child.kill().expect("SIGKILL");
        let status = child.wait().expect("wait");
        assert!(!status.success(), "the child ended by itself: {status}");
        kills += 1;

        // Reopen: the clock at 0 means the store's time is the file's high-water mark.
        let clock = ManualClock::new(Timestamp::EPOCH);
        let store = builder(&clock).open(dir.path().join("store.redb"))?;
        let report = store.verify()?;
        assert!(report.is_clean(), "verify after kill {kills}: {report:?}");
        let acks = read_logs(dir.path());
        acknowledged = acks.keys.len();
        let now = store.now()?;
        clock.set(now);
        checks += acks.check(&store, now.as_millis(), RETENTION)?;
        ledger_rows = check_ledger(&store, now.as_millis(), RETENTION)?;

        // The store accepts new claims.
        let fresh = Key::new(&format!("parent-{iteration}"))?;
        let Claim::Acquired(lease) = store.claim(&fresh, fingerprint("parent"))? else {
            panic!("the reopened store refused a fresh claim");
        };
        store.release(&lease)?;
        let parent_log = dir.path().join(format!("log-parent-{iteration}.txt"));
        let mut log = Log(File::create(parent_log).expect("parent log"));
        takeovers += usize::from(check_takeover(&store, &clock, &acks, &mut log)?);
        assert!(store.verify()?.is_clean());
    }
    println!(
        "crash test: {kills} SIGKILLs, {checks} key checks ({acknowledged} keys acknowledged in all), \
         {ledger_rows} ledger rows matched to their responses after the last kill, \
         {takeovers} takeovers after lease checked, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert_eq!(kills, iterations);
    assert!(ledger_rows > 0, "no completion wrote a ledger row");
    assert!(
        takeovers > 0,
        "no in-progress record was left to check the takeover rule"
    );
    Ok(())
}
