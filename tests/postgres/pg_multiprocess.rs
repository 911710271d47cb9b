//! Several service instances on one PostgreSQL database, as separate OS processes: this test
//! binary re-executed with `IDEMPOTENCY_PG_CHILD` set, each child with its own `PgStore` (its
//! own connection pool), on the database's clock.
//!
//! - `racing_processes_acquire_each_key_exactly_once`: four processes connect at once (racing
//!   the schema migration too), then claim the same keys in the same order; across all of them
//!   exactly one claim per key is `Acquired`.
//! - `a_killed_holder_is_taken_over_only_after_its_lease`: a process claims keys and is killed
//!   with SIGKILL in the middle of its work; three other processes then race for the same keys
//!   and take each of the dead process's keys over exactly once, and only once its lease has
//!   lapsed by the database's clock.
//!
//! - `payers_mixing_complete_with_and_complete_charge_each_key_once`: eight processes race for
//!   the same 200 keys; a third of the keys are completed with `complete`, the others with
//!   `complete_with` writing a ledger row in the same transaction (odd processes decline one
//!   kind of key, roll back and release it for another process). The ledger then holds
//!   exactly one row per key completed with `complete_with`, written by the process whose
//!   response is stored, and none for the others.
//!
//! Needs `IDEMPOTENCY_PG_URL` (skipped with a printed reason without it, failed under
//! `CI=true`).
#![cfg(feature = "postgres")]

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use idempotency_store::{
    Claim, Fingerprint, IdempotencyStore, Key, RecordState, Response, Result, pg::PgStore,
};

use crate::common::pg::{Schema, url};

const CHILD_ENV: &str = "IDEMPOTENCY_PG_CHILD";
const SCHEMA_ENV: &str = "IDEMPOTENCY_PG_CHILD_SCHEMA";
const NAME_ENV: &str = "IDEMPOTENCY_PG_CHILD_NAME";
/// Output lines of a child meant for the parent start with this (libtest writes its own lines
/// to the same stdout).
const MARK: &str = "@@ ";

const RACE_PROCESSES: usize = 4;
const RACE_KEYS: usize = 200;

const PAY_PROCESSES: usize = 8;
const PAY_KEYS: usize = 200;

const KILL_KEYS: usize = 40;
/// The victim is killed after this many acquired claims.
const KILL_AFTER: usize = 12;
const SURVIVORS: usize = 3;
const KILL_LEASE_MS: u64 = 3_000;

fn fingerprint(name: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/multi", name])
}

// ---------------------------------------------------------------- fixtures

fn store(url: &str, schema: &str, lease_ms: u64) -> Result<PgStore> {
    PgStore::builder()
        .schema(schema)
        .lease(Duration::from_millis(lease_ms))
        .pool_size(2)
        .connection_timeout(Duration::from_secs(10))
        .connect(url)
}

// ---------------------------------------------------------------- the children

/// Not a test on its own: a parent runs this binary with `CHILD_ENV` set, and this function
/// then becomes one service instance. Without the variable it returns at once.
#[test]
fn pg_child_process() -> Result<()> {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    let url = std::env::var("IDEMPOTENCY_PG_URL").expect("the parent passes the URL");
    let schema = std::env::var(SCHEMA_ENV).expect("the parent passes the schema");
    let name = std::env::var(NAME_ENV).expect("the parent passes a name");
    let lease_ms = if role == "racer" {
        60_000
    } else {
        KILL_LEASE_MS
    };
    let store = store(&url, &schema, lease_ms)?;
    say("ready");
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).expect("stdin");
    match role.as_str() {
        "racer" => racer(&store, &name),
        "victim" => victim(&store),
        "survivor" => survivor(&store, &name),
        "payer" => payer(&store, &schema, &name),
        other => panic!("unknown child role {other:?}"),
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{MARK}{line}").expect("stdout");
    out.flush().expect("stdout");
}

/// Claims every race key once, in order; completes the ones it wins with its own name.
fn racer(store: &PgStore, name: &str) -> Result<()> {
    for i in 0..RACE_KEYS {
        let key_name = format!("race-{i}");
        let key = Key::new(&key_name)?;
        match store.claim(&key, fingerprint(&key_name))? {
            Claim::Acquired(lease) => {
                store.complete(&lease, Response::new(200, name))?;
                say(&format!("A {i} {}", lease.token()));
            }
            Claim::InProgress { .. } => say(&format!("I {i}")),
            Claim::Completed(_) => say(&format!("C {i}")),
            Claim::Mismatch { .. } => say(&format!("M {i}")),
        }
    }
    say("done");
    Ok(())
}

/// Claims the kill keys one after the other and "works" on each without ever settling, until
/// the parent kills it.
fn victim(store: &PgStore) -> Result<()> {
    for i in 0..KILL_KEYS {
        let key_name = format!("kill-{i}");
        let key = Key::new(&key_name)?;
        if let Claim::Acquired(lease) = store.claim(&key, fingerprint(&key_name))? {
            say(&format!(
                "A {i} {} {} {}",
                lease.token(),
                lease.attempt(),
                lease.lease_until().as_millis()
            ));
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    // Still holding everything: the parent kills it before this.
    std::thread::sleep(Duration::from_secs(60));
    Ok(())
}

/// Retries every kill key until each is completed (by anyone), reporting every answer.
fn survivor(store: &PgStore, name: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut open: BTreeSet<usize> = (0..KILL_KEYS).collect();
    while !open.is_empty() && Instant::now() < deadline {
        for i in open.clone() {
            let key_name = format!("kill-{i}");
            let key = Key::new(&key_name)?;
            match store.claim(&key, fingerprint(&key_name))? {
                Claim::Acquired(lease) => {
                    say(&format!(
                        "A {i} {} {} {}",
                        lease.token(),
                        lease.attempt(),
                        lease.lease_until().as_millis()
                    ));
                    store.complete(&lease, Response::new(200, name))?;
                    open.remove(&i);
                }
                Claim::InProgress {
                    lease_until,
                    attempt,
                } => say(&format!("I {i} {attempt} {}", lease_until.as_millis())),
                Claim::Completed(_) => {
                    open.remove(&i);
                }
                Claim::Mismatch { .. } => panic!("kill-{i}: mismatch"),
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    say(if open.is_empty() { "done" } else { "timeout" });
    Ok(())
}

/// Pays every `pay-*` key until each is completed (by anyone): keys `i % 3 == 0` with
/// `complete`, the others with `complete_with` and a ledger row; odd processes decline keys
/// `i % 3 == 2` (the row is rolled back, the key released). Reports `P i` (plain), `W i`
/// (with the ledger row) and `F i` (declined).
fn payer(store: &PgStore, schema: &str, name: &str) -> Result<()> {
    let insert = format!("INSERT INTO \"{schema}\".ledger (key, payer) VALUES ($1, $2)");
    let p: usize = name[1..].parse().expect("payer number");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut open: BTreeSet<usize> = (0..PAY_KEYS).collect();
    while !open.is_empty() && Instant::now() < deadline {
        // Each process starts elsewhere in the key space, so the races spread out.
        let order: Vec<usize> = (0..PAY_KEYS)
            .map(|n| (n + p * PAY_KEYS / PAY_PROCESSES) % PAY_KEYS)
            .filter(|i| open.contains(i))
            .collect();
        for i in order {
            let key_name = format!("pay-{i}");
            let key = Key::new(&key_name)?;
            match store.claim(&key, fingerprint(&key_name))? {
                Claim::Acquired(lease) if i % 3 == 0 => {
                    store.complete(&lease, Response::new(200, name))?;
                    say(&format!("P {i}"));
                    open.remove(&i);
                }
                Claim::Acquired(lease) => {
                    let decline = i % 3 == 2 && p % 2 == 1;
                    let outcome = store.complete_with(&lease, Response::new(201, name), |tx| {
                        tx.execute(insert.as_str(), &[&key_name, &name])
                            .map_err(|e| e.to_string())?;
                        if decline {
                            Err("declined".to_owned())
                        } else {
                            Ok(())
                        }
                    })?;
                    if outcome.is_ok() {
                        say(&format!("W {i}"));
                        open.remove(&i);
                    } else {
                        store.release(&lease)?;
                        say(&format!("F {i}"));
                    }
                }
                Claim::InProgress { .. } => {}
                Claim::Completed(_) => {
                    open.remove(&i);
                }
                Claim::Mismatch { .. } => panic!("pay-{i}: mismatch"),
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    say(if open.is_empty() { "done" } else { "timeout" });
    Ok(())
}

// ---------------------------------------------------------------- the parent

/// A running child and the lines it has marked for the parent.
struct Instance {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Instance {
    fn spawn(role: &str, name: &str, url: &str, schema: &str) -> Instance {
        let exe = std::env::current_exe().expect("test binary");
        let mut child = Command::new(exe)
            .args([
                "--exact",
                "pg_multiprocess::pg_child_process",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, role)
            .env(SCHEMA_ENV, schema)
            .env(NAME_ENV, name)
            .env("IDEMPOTENCY_PG_URL", url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn child");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if let Some(at) = line.find(MARK)
                    && tx.send(line[at + MARK.len()..].to_owned()).is_err()
                {
                    break;
                }
            }
        });
        Instance {
            child,
            stdin,
            lines,
        }
    }

    fn next_line(&self) -> Option<String> {
        self.lines.recv_timeout(Duration::from_secs(60)).ok()
    }

    fn wait_ready(&self) {
        assert_eq!(
            self.next_line().as_deref(),
            Some("ready"),
            "child not ready"
        );
    }

    fn go(&mut self) {
        let mut stdin = self.stdin.take().expect("stdin");
        stdin.write_all(b"go\n").expect("go");
    }

    /// Every remaining line, after the child exited successfully. Reads until the reader
    /// thread hits end of file: the child's exit does not mean its last lines were forwarded.
    fn finish(mut self) -> Vec<String> {
        let status = self.child.wait().expect("wait");
        assert!(status.success(), "child failed: {status}");
        self.lines.iter().collect()
    }
}

/// One scenario at a time: each starts up to eight processes on two cores, and the SIGKILL
/// scenario's survivors must get going within its 3 s lease.
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static SCENARIO: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SCENARIO
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn fields(line: &str) -> Vec<u64> {
    line.split(' ')
        .skip(1)
        .map(|f| f.parse().expect("numeric field"))
        .collect()
}

#[test]
fn racing_processes_acquire_each_key_exactly_once() -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return Ok(());
    }
    let Some(url) = url() else { return Ok(()) };
    let _scenario = one_at_a_time();
    let schema = Schema::named(url.clone(), "multi", "race");
    // All processes connect at once, so they race the migration as well.
    let mut racers: Vec<Instance> = (0..RACE_PROCESSES)
        .map(|p| Instance::spawn("racer", &format!("p{p}"), &url, &schema.name))
        .collect();
    for racer in &racers {
        racer.wait_ready();
    }
    for racer in &mut racers {
        racer.go();
    }
    let mut acquired: BTreeMap<usize, Vec<(usize, u64)>> = BTreeMap::new();
    let (mut in_progress, mut replayed) = (0, 0);
    for (p, racer) in racers.into_iter().enumerate() {
        let lines = racer.finish();
        assert_eq!(lines.last().map(String::as_str), Some("done"), "racer {p}");
        for line in &lines[..lines.len() - 1] {
            let f = fields(line);
            let i = usize::try_from(f[0]).expect("key index");
            match &line[..1] {
                "A" => acquired.entry(i).or_default().push((p, f[1])),
                "I" => in_progress += 1,
                "C" => replayed += 1,
                _ => panic!("racer {p}: {line}"),
            }
        }
    }
    let total: usize = acquired.values().map(Vec::len).sum();
    println!(
        "multi-process race: {RACE_PROCESSES} processes x {RACE_KEYS} keys: {total} Acquired \
         ({} keys won, max {} per key), {in_progress} InProgress, {replayed} replays",
        acquired.len(),
        acquired.values().map(Vec::len).max().unwrap_or(0)
    );
    assert_eq!(acquired.len(), RACE_KEYS, "a key nobody acquired");
    for (i, winners) in &acquired {
        assert_eq!(winners.len(), 1, "race-{i} acquired by {winners:?}");
    }
    assert_eq!(
        in_progress + replayed,
        (RACE_PROCESSES - 1) * RACE_KEYS,
        "every losing claim saw the winner"
    );

    // The database agrees: each key completed once, by its winner.
    let check = store(&url, &schema.name, 60_000)?;
    for (i, winners) in &acquired {
        let view = check
            .lookup(&Key::new(&format!("race-{i}"))?)?
            .expect("record");
        let RecordState::Completed { response, .. } = view.state else {
            panic!("race-{i} not completed");
        };
        assert_eq!(response.body, format!("p{}", winners[0].0).into_bytes());
        assert_eq!(view.attempt, 1);
    }
    let stats = check.stats()?;
    assert_eq!((stats.completed, stats.in_progress), (RACE_KEYS as u64, 0));
    let report = check.verify()?;
    assert!(report.is_clean(), "{report:?}");
    Ok(())
}

#[test]
fn a_killed_holder_is_taken_over_only_after_its_lease() -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return Ok(());
    }
    let Some(url) = url() else { return Ok(()) };
    let _scenario = one_at_a_time();
    let schema = Schema::named(url.clone(), "multi", "kill");
    let check = store(&url, &schema.name, KILL_LEASE_MS)?;

    // The victim claims keys one after another and is killed mid-work.
    let mut victim = Instance::spawn("victim", "victim", &url, &schema.name);
    victim.wait_ready();
    victim.go();
    let mut held: BTreeMap<usize, u64> = BTreeMap::new(); // key -> the victim's lease end
    while held.len() < KILL_AFTER {
        let line = victim.next_line().expect("victim output");
        let f = fields(&line);
        assert!(line.starts_with("A "), "victim: {line}");
        assert_eq!(f[2], 1, "victim's attempt");
        held.insert(usize::try_from(f[0]).expect("key"), f[3]);
    }
    victim.child.kill().expect("SIGKILL");
    let status = victim.child.wait().expect("wait");
    assert!(!status.success(), "the victim ended by itself: {status}");
    let killed_at = check.now()?.as_millis();
    // Acquisitions the victim reported between our reads and the kill (read to end of file:
    // the reader thread may not have forwarded them yet).
    for line in victim.lines.iter() {
        let f = fields(&line);
        held.insert(usize::try_from(f[0]).expect("key"), f[3]);
    }
    assert!(
        held.values().all(|&until| until > killed_at),
        "a lease lapsed before the kill: the test would prove nothing"
    );

    // Three other instances race for every key until all are completed.
    let mut survivors: Vec<Instance> = (0..SURVIVORS)
        .map(|s| Instance::spawn("survivor", &format!("s{s}"), &url, &schema.name))
        .collect();
    for survivor in &survivors {
        survivor.wait_ready();
    }
    for survivor in &mut survivors {
        survivor.go();
    }
    // key -> (survivor, attempt, takeover time by the database's clock)
    let mut acquired: BTreeMap<usize, Vec<(usize, u64, u64)>> = BTreeMap::new();
    let mut waited: BTreeMap<usize, usize> = BTreeMap::new();
    for (s, survivor) in survivors.into_iter().enumerate() {
        let lines = survivor.finish();
        assert_eq!(
            lines.last().map(String::as_str),
            Some("done"),
            "survivor {s}"
        );
        for line in &lines[..lines.len() - 1] {
            let f = fields(line);
            let i = usize::try_from(f[0]).expect("key");
            match &line[..1] {
                // A i token attempt lease_until: taken at lease_until - lease.
                "A" => acquired
                    .entry(i)
                    .or_default()
                    .push((s, f[2], f[3] - KILL_LEASE_MS)),
                // I i attempt lease_until: the victim's lease while it lasts (attempt 1), or
                // the lease of the survivor that took the key over (attempt 2).
                "I" => {
                    if f[1] == 1 {
                        if let Some(&until) = held.get(&i) {
                            assert_eq!(f[2], until, "kill-{i}: {line}");
                        }
                        *waited.entry(i).or_default() += 1;
                    }
                }
                _ => panic!("survivor {s}: {line}"),
            }
        }
    }

    let mut takeovers = 0;
    let mut earliest_margin = u64::MAX;
    let mut in_flight = Vec::new();
    for i in 0..KILL_KEYS {
        let winners = acquired.get(&i).cloned().unwrap_or_default();
        assert_eq!(winners.len(), 1, "kill-{i}: acquired by {winners:?}");
        let (_, attempt, taken_at) = winners[0];
        match held.get(&i) {
            Some(&until) => {
                assert_eq!(
                    attempt, 2,
                    "kill-{i}: the victim's claim was not taken over"
                );
                assert!(
                    taken_at >= until,
                    "kill-{i}: taken over at {taken_at}, before the lease ended at {until}"
                );
                assert!(
                    waited.get(&i).copied().unwrap_or(0) > 0,
                    "kill-{i}: nobody saw it in progress"
                );
                takeovers += 1;
                earliest_margin = earliest_margin.min(taken_at - until);
            }
            // A claim the victim made but was killed before reporting.
            None if attempt == 2 => in_flight.push(i),
            None => assert_eq!(attempt, 1, "kill-{i}"),
        }
    }
    assert!(in_flight.len() <= 1, "unreported claims: {in_flight:?}");
    let fresh = KILL_KEYS - takeovers - in_flight.len();
    let waits: usize = waited.values().sum();
    println!(
        "multi-process SIGKILL: the victim held {} keys (lease {KILL_LEASE_MS} ms) when killed; \
         {SURVIVORS} survivor processes took each over exactly once ({takeovers} takeovers at \
         attempt 2, the earliest {earliest_margin} ms after its lease ended, after {waits} \
         InProgress answers), {} unreported in-flight claim(s) taken over, {fresh} fresh keys \
         acquired once each",
        held.len(),
        in_flight.len()
    );
    let stats = check.stats()?;
    assert_eq!((stats.completed, stats.in_progress), (KILL_KEYS as u64, 0));
    assert!(check.verify()?.is_clean());
    Ok(())
}

#[test]
fn payers_mixing_complete_with_and_complete_charge_each_key_once() -> Result<()> {
    if std::env::var_os(CHILD_ENV).is_some() {
        return Ok(());
    }
    let Some(url) = url() else { return Ok(()) };
    let _scenario = one_at_a_time();
    let schema = Schema::named(url.clone(), "multi", "pay");
    let mut admin = postgres::Client::connect(
        &url.replace(" prepare_statements=false", ""),
        postgres::NoTls,
    )
    .expect("admin");
    admin
        .batch_execute(&format!(
            "CREATE SCHEMA \"{0}\"; CREATE TABLE \"{0}\".ledger (key text NOT NULL, payer text NOT NULL)",
            schema.name
        ))
        .expect("ledger table");
    let mut payers: Vec<Instance> = (0..PAY_PROCESSES)
        .map(|p| Instance::spawn("payer", &format!("p{p}"), &url, &schema.name))
        .collect();
    for payer in &payers {
        payer.wait_ready();
    }
    for payer in &mut payers {
        payer.go();
    }
    // key -> the processes that completed it, with or without a ledger row
    let mut with_row: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let mut plain: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    let mut declined = 0;
    for (p, payer) in payers.into_iter().enumerate() {
        let lines = payer.finish();
        assert_eq!(lines.last().map(String::as_str), Some("done"), "payer {p}");
        for line in &lines[..lines.len() - 1] {
            let i = usize::try_from(fields(line)[0]).expect("key index");
            match &line[..1] {
                "W" => with_row.entry(i).or_default().push(format!("p{p}")),
                "P" => plain.entry(i).or_default().push(format!("p{p}")),
                "F" => declined += 1,
                _ => panic!("payer {p}: {line}"),
            }
        }
    }
    let rows = admin
        .query(
            &format!("SELECT key, payer FROM \"{}\".ledger", schema.name),
            &[],
        )
        .expect("ledger");
    let mut ledger: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for row in &rows {
        ledger.entry(row.get(0)).or_default().push(row.get(1));
    }
    println!(
        "multi-process complete_with: {PAY_PROCESSES} processes x {PAY_KEYS} keys: {} \
         completed with a ledger row, {} with complete, {declined} declined and rolled back; \
         {} ledger rows",
        with_row.len(),
        plain.len(),
        rows.len()
    );
    assert!(
        declined > 0,
        "no effect was declined: the rollback path was not exercised"
    );
    let charges: usize = with_row.values().map(Vec::len).sum();
    assert_eq!(rows.len(), charges, "ledger rows != charges reported");
    let check = store(&url, &schema.name, 60_000)?;
    for i in 0..PAY_KEYS {
        let key = format!("pay-{i}");
        let view = check.lookup(&Key::new(&key)?)?.expect("record");
        let RecordState::Completed { response, .. } = view.state else {
            panic!("{key} not completed");
        };
        let completer = String::from_utf8(response.body).expect("utf-8");
        if i % 3 == 0 {
            assert_eq!(plain.get(&i), Some(&vec![completer]), "{key}");
            assert_eq!(with_row.get(&i), None, "{key}");
            assert_eq!(
                ledger.get(&key),
                None,
                "{key}: a ledger row without complete_with"
            );
        } else {
            assert_eq!(plain.get(&i), None, "{key}");
            assert_eq!(with_row.get(&i), Some(&vec![completer.clone()]), "{key}");
            assert_eq!(
                ledger.get(&key),
                Some(&vec![completer]),
                "{key}: exactly one ledger row, by the process whose response is stored"
            );
        }
    }
    assert!(check.verify()?.is_clean());
    Ok(())
}
