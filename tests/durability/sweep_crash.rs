//! A SIGKILL during a sweep of 10^5 expired records, with claims still being made: after the
//! reopen no unexpired record is missing (neither the ones that were there before the sweep
//! nor the ones acknowledged during it) and no expired record replays. The same child set-up
//! as `crash` (a real process, killed at a random moment), on a copy of one prefilled file:
//! 2 kills under `cargo test`, 8 with `IDEMPOTENCY_TEST_SCALE=full` (as CI runs it).

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::thread;
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{
    Claim, Fingerprint, Key, ManualClock, RecordState, Response, Result, Store, Timestamp,
};

use crate::common::{Rng, scaled};

const CHILD_ENV: &str = "IDEMPOTENCY_SWEEP_CRASH_DIR";
const RETENTION: Duration = Duration::from_secs(3600);
const T0: u64 = 1_700_000_000_000;
const EXPIRED: usize = 100_000;
const LIVE: usize = 2_000;
const WRITERS: usize = 4;

/// When the child sweeps: every `old-` record has expired (they expire over one second, 20 ms
/// per 2,000 records), no `live-` one has.
fn sweep_time() -> Timestamp {
    Timestamp::from_millis(T0 + 1_000 + RETENTION.as_millis() as u64 + 1)
}

fn fp(name: &str) -> Fingerprint {
    Fingerprint::of(["POST", name])
}

fn open(path: &Path, clock: &ManualClock) -> Result<Store> {
    Store::builder()
        .retention(RETENTION)
        .clock(clock.clone())
        .open(path)
}

// ---------------------------------------------------------------- the child process

/// Not a test on its own: with `CHILD_ENV` set it is the child that sweeps while it claims
/// new keys, logging each acknowledged completion, until it is killed.
#[test]
fn sweep_crash_child_process() -> Result<()> {
    let Some(dir) = std::env::var_os(CHILD_ENV).map(PathBuf::from) else {
        return Ok(());
    };
    let clock = ManualClock::new(sweep_time());
    let store = Arc::new(open(&dir.join("store.redb"), &clock)?);
    println!("ready");
    std::io::stdout().flush().ok();
    let writers: Vec<_> = (0..WRITERS)
        .map(|t| {
            let store = Arc::clone(&store);
            let log = dir.join(format!("acked-{t}.txt"));
            thread::spawn(move || write_new(&store, &log, t))
        })
        .collect();
    store.sweep_all()?;
    println!("swept");
    std::io::stdout().flush().ok();
    for writer in writers {
        writer.join().expect("writer panicked")?;
    }
    Ok(())
}

/// Claims and completes new keys for ever, logging (and syncing) each acknowledged one.
fn write_new(store: &Store, log: &Path, t: usize) -> Result<()> {
    let mut log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .expect("log");
    for i in 0u64.. {
        let name = format!("new-{t}-{i}");
        let Claim::Acquired(lease) = store.claim(&Key::new(&name)?, fp(&name))? else {
            panic!("a fresh key was not acquired");
        };
        store.complete(&lease, Response::new(200, name.as_str()))?;
        log.write_all(format!("{name}\n").as_bytes())
            .expect("log write");
        log.sync_data().expect("log sync");
    }
    Ok(())
}

// ---------------------------------------------------------------- the parent

/// The file every iteration starts from: `EXPIRED` records that have expired at
/// [`sweep_time`], and `LIVE` that have not.
fn template(dir: &Path) -> Result<PathBuf> {
    let path = dir.join("template.redb");
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = open(&path, &clock)?;
    let fill = |names: Vec<String>| -> Result<()> {
        thread::scope(|s| {
            let workers: Vec<_> = names
                .chunks(names.len().div_ceil(64))
                .map(|chunk| {
                    let store = &store;
                    s.spawn(move || -> Result<()> {
                        for name in chunk {
                            let key = Key::new(name)?;
                            let Claim::Acquired(lease) = store.claim(&key, fp(name))? else {
                                panic!("a fresh key was not acquired");
                            };
                            store.complete(&lease, Response::new(200, name.as_str()))?;
                        }
                        Ok(())
                    })
                })
                .collect();
            workers
                .into_iter()
                .try_for_each(|w| w.join().expect("prefill thread"))
        })
    };
    for block in 0..50 {
        fill(
            (0..EXPIRED / 50)
                .map(|i| format!("old-{}", block * (EXPIRED / 50) + i))
                .collect(),
        )?;
        clock.advance(Duration::from_millis(20));
    }
    clock.set(Timestamp::from_millis(
        T0 + RETENTION.as_millis() as u64 / 2,
    ));
    fill((0..LIVE).map(|i| format!("live-{i}")).collect())?;
    store.close()?;
    Ok(path)
}

fn acked(dir: &Path) -> Vec<String> {
    let mut names = Vec::new();
    for t in 0..WRITERS {
        let Ok(file) = File::open(dir.join(format!("acked-{t}.txt"))) else {
            continue;
        };
        // A line cut by the kill was not acknowledged; every whole one was.
        let lines = BufReader::new(file).lines().map_while(std::io::Result::ok);
        names.extend(lines.filter(|l| !l.is_empty()));
    }
    names
}

/// The reopened store holds every unexpired record, and no expired one answers a claim with
/// its response.
fn check(path: &Path, dir: &Path, rng: &mut Rng) -> Result<usize> {
    let clock = ManualClock::new(sweep_time());
    let store = open(path, &clock)?;
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    let live = (0..LIVE).map(|i| format!("live-{i}"));
    let acked = acked(dir);
    let mut checked = 0;
    for name in live.chain(acked.iter().cloned()) {
        let view = store.lookup(&Key::new(&name)?)?;
        let Some(RecordState::Completed { response, .. }) = view.map(|v| v.state) else {
            panic!("{name} was lost");
        };
        assert_eq!(response.body, name.as_bytes());
        checked += 1;
    }
    // 200 distinct expired keys from a random start (a key claimed twice would rightly
    // answer the second time that it is in progress).
    let start = rng.next() % EXPIRED as u64;
    for k in 0..200 {
        let name = format!("old-{}", (start + k * 499) % EXPIRED as u64);
        match store.claim(&Key::new(&name)?, fp(&name))? {
            Claim::Acquired(_) => {}
            other => panic!("the expired {name} answered {other:?}"),
        }
    }
    store.sweep_all()?;
    let stats = store.stats()?;
    assert_eq!(stats.expired, 0);
    assert!(stats.completed >= (LIVE + acked.len()) as u64);
    Ok(checked)
}

/// One iteration: a child on a fresh copy of the template, SIGKILLed at a random moment, then
/// checked. Whether the sweep had ended before the kill, and how many records were checked.
fn kill_and_check(
    root: &Path,
    template: &Path,
    iteration: usize,
    rng: &mut Rng,
) -> Result<(bool, usize)> {
    let dir = root.join(format!("run-{iteration}"));
    std::fs::create_dir(&dir).expect("run dir");
    let path = dir.join("store.redb");
    std::fs::copy(template, &path).expect("copy the template");
    let exe = std::env::current_exe().expect("test binary");
    let mut child = Command::new(&exe)
        .args([
            "--exact",
            "sweep_crash::sweep_crash_child_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn child");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut line = String::new();
    while !line.contains("ready") {
        line.clear();
        assert!(out.read_line(&mut line).expect("stdout") > 0, "child died");
    }
    // Most kills land while the sweep runs, the odd one after it finished.
    thread::sleep(Duration::from_millis(50 + rng.next() % 2_000));
    child.kill().expect("SIGKILL");
    let status = child.wait().expect("wait");
    assert!(!status.success(), "the child ended by itself: {status}");
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).ok();
    let checked = check(&path, &dir, rng)?;
    std::fs::remove_dir_all(&dir).ok();
    Ok((rest.contains("swept"), checked))
}

#[test]
fn sigkill_during_a_sweep_loses_no_unexpired_record_and_replays_no_expired_one() -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return Ok(());
    }
    let root = tempfile::tempdir().expect("tempdir");
    let template = template(root.path())?;
    let iterations = scaled(2, 8);
    let seed = Rng::from_clock().0;
    println!("sweep crash test: seed {seed}, {iterations} kills");
    // Two at a time: each iteration is one child and one single-threaded check, and this
    // test often runs last in its binary with the other core idle.
    let runs: Vec<(bool, usize)> = thread::scope(|s| {
        let workers: Vec<_> = (0..2)
            .map(|w| {
                let (root, template) = (root.path(), template.as_path());
                s.spawn(move || -> Result<Vec<(bool, usize)>> {
                    let mut rng =
                        Rng(seed ^ (w as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
                    (w..iterations)
                        .step_by(2)
                        .map(|iteration| kill_and_check(root, template, iteration, &mut rng))
                        .collect()
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| w.join().expect("kill worker"))
            .collect::<Result<Vec<_>>>()
            .map(|runs| runs.into_iter().flatten().collect())
    })?;
    let swept_before_kill = runs.iter().filter(|(swept, _)| *swept).count();
    let checked: usize = runs.iter().map(|(_, checked)| checked).sum();
    println!(
        "sweep crash test: {iterations} SIGKILLs ({swept_before_kill} after the sweep ended), \
         {checked} unexpired records checked"
    );
    assert!(
        swept_before_kill < iterations,
        "no kill landed during a sweep"
    );
    Ok(())
}
