//! The operator CLI `idempotency-store`, run as a process against store files prepared with the
//! library: output, `--json` output and exit codes of every subcommand, and missing, foreign,
//! damaged and busy files (one clear error line, never a panic). One test binary, a module per
//! group of commands; the fixtures and the runner every module shares are here.

mod commands;
mod effects;
mod errors;
mod files;
mod inspection;
mod keys;
mod library;
mod outbox;
#[cfg(feature = "postgres")]
mod postgres_backend;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use idempotency_store::redb::TableDefinition;
use idempotency_store::{
    Claim, Clock, Fingerprint, IdempotencyStore, Key, ManualClock, Response, Store, SystemClock,
    Timestamp,
};
use serde_json::Value;

const HOUR: u64 = 3_600_000;

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

const BIN: &str = env!("CARGO_BIN_EXE_idempotency-store");

fn cli(args: &[&str]) -> Run {
    let mut command = Command::new(BIN);
    command.args(args);
    run(command, args)
}

/// Runs `command` (the CLI with `args`, perhaps through another program) and checks what every
/// run must hold.
fn run(mut command: Command, args: &[&str]) -> Run {
    let output = command.stdin(Stdio::null()).output().expect("run the CLI");
    let run = Run {
        code: output.status.code().expect("exited, not killed"),
        stdout: String::from_utf8(output.stdout).expect("utf-8 stdout"),
        stderr: String::from_utf8(output.stderr).expect("utf-8 stderr"),
    };
    println!(
        "$ idempotency-store {}\n{}{}[exit {}]\n",
        args.join(" "),
        run.stdout,
        run.stderr,
        run.code
    );
    // Whatever happens: no panic message, no backtrace hint, and an error is one line.
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    assert!(!run.stderr.contains("BACKTRACE"), "{}", run.stderr);
    let errors = run
        .stderr
        .lines()
        .filter(|l| l.starts_with("error") || l.starts_with(r#"{"error""#))
        .count();
    assert!(errors <= 1, "more than one error line: {}", run.stderr);
    run
}

/// Runs and expects `code`; returns the run.
fn expect(code: i32, args: &[&str]) -> Run {
    let run = cli(args);
    assert_eq!(
        run.code, code,
        "exit code of {args:?}; stderr: {}",
        run.stderr
    );
    if code == 2 {
        assert_eq!(
            run.stderr.lines().count(),
            1,
            "one error line: {}",
            run.stderr
        );
        assert!(run.stderr.starts_with("error: "), "{}", run.stderr);
    }
    run
}

fn json(run: &Run) -> Value {
    serde_json::from_str(&run.stdout).unwrap_or_else(|e| panic!("{e}: {}", run.stdout))
}

fn p(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

fn claim<S: IdempotencyStore>(store: &S, key: &Key) -> idempotency_store::Lease {
    match store.claim(key, Fingerprint::of([key.to_string()])) {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("{key:?} not acquired: {other:?}"),
    }
}

/// A closed store file, in times relative to the real clock (the CLI's clock), with
/// - `old-order`: completed two days ago, expired (retention 24 h);
/// - `stuck-order`: claimed 2 h ago with a 1 h lease and a checkpoint: stuck;
/// - `live-order`: claimed now, lease live for an hour;
/// - `order-7` in scope `tenant-a`: completed now with a header and a JSON body.
fn fixture(dir: &Path) -> PathBuf {
    let path = dir.join("store.redb");
    let now = SystemClock.now().as_millis();
    let clock = ManualClock::new(Timestamp::from_millis(now - 48 * HOUR));
    let store = Store::builder()
        .retention(Duration::from_secs(24 * 3600))
        .lease(Duration::from_secs(3600))
        .clock(clock.clone())
        .open(&path)
        .expect("create the store");
    write_fixture(&store, &clock, now);
    path
}

/// Writes [`fixture`]'s records into `store`, whose `clock` stands 48 hours before `now`
/// (the real clock's time in milliseconds).
fn write_fixture<S: IdempotencyStore>(store: &S, clock: &ManualClock, now: u64) {
    let old = claim(store, &Key::new("old-order").expect("key"));
    store
        .complete(&old, Response::new(200, "old"))
        .expect("complete");
    clock.set(Timestamp::from_millis(now - 2 * HOUR));
    let mut stuck = claim(store, &Key::new("stuck-order").expect("key"));
    store
        .checkpoint(&mut stuck, b"step-2".to_vec())
        .expect("checkpoint");
    clock.set(Timestamp::from_millis(now));
    let _live = claim(store, &Key::new("live-order").expect("key"));
    let done = claim(store, &Key::scoped("tenant-a", "order-7").expect("key"));
    let response =
        Response::new(201, r#"{"id":"pay_1"}"#).with_header("content-type", "application/json");
    store.complete(&done, response).expect("complete");
}

/// A store file as a crash leaves it, its changes only in the log (never merged): `done`
/// completed and `held` in progress, in real time. The store is leaked rather than closed,
/// and its file copied to `crashed.redb` (the original stays locked by this process).
fn crashed(dir: &Path) -> PathBuf {
    let path = dir.join("live.redb");
    let store = Store::open(&path).expect("create");
    let done = claim(&store, &Key::new("done").expect("key"));
    store
        .complete(&done, Response::new(200, "done"))
        .expect("complete");
    let _held = claim(&store, &Key::new("held").expect("key"));
    std::mem::forget(store);
    let copy = dir.join("crashed.redb");
    std::fs::copy(&path, &copy).expect("copy");
    copy
}

/// The payment servers' effect table (`examples/payments_service`), which the CLI does not know.
const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("payments_ledger");

/// A store file as a service with an effect table leaves it when it stops uncleanly (the
/// example servers, even on SIGTERM): `paid` completed with a ledger row, `held` in progress
/// with a live lease, all only in the log. Copied to `unclean.redb`, as in `crashed`.
fn crashed_with_effects(dir: &Path) -> PathBuf {
    let path = dir.join("service.redb");
    let store = Store::builder()
        .effect_table(LEDGER)
        .open(&path)
        .expect("create");
    let paid = claim(&store, &Key::new("paid").expect("key"));
    store
        .complete_with_effects(&paid, Response::new(201, "paid"), |effects| {
            effects.insert(LEDGER, "paid", 4999)
        })
        .expect("complete")
        .expect("the ledger row");
    let _held = claim(&store, &Key::new("held").expect("key"));
    std::mem::forget(store);
    let copy = dir.join("unclean.redb");
    std::fs::copy(&path, &copy).expect("copy");
    copy
}

/// A checksum of the file's bytes.
fn checksum(path: &Path) -> blake3::Hash {
    blake3::hash(&std::fs::read(path).expect("read"))
}

fn verify_with_library(path: &Path) -> idempotency_store::admin::VerifyReport {
    Store::open(path).expect("open").verify().expect("verify")
}

/// Runs with `--json` and expects `code` and one JSON error line on stderr of `kind`, with
/// nothing but `error` and `kind` in it; returns the error message.
fn json_error(code: i32, kind: &str, args: &[&str]) -> String {
    let mut all = args.to_vec();
    all.push("--json");
    let run = cli(&all);
    assert_eq!(run.code, code, "{all:?}: {}", run.stderr);
    let lines: Vec<&str> = run.stderr.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {}", run.stderr);
    let value: Value =
        serde_json::from_str(lines[0]).unwrap_or_else(|e| panic!("{e}: {}", lines[0]));
    let object = value.as_object().expect("an object");
    let mut fields: Vec<&str> = object.keys().map(String::as_str).collect();
    fields.sort_unstable();
    assert_eq!(fields, ["error", "kind"], "{}", lines[0]);
    assert_eq!(value["kind"], kind, "{}", lines[0]);
    value["error"].as_str().expect("a message").to_owned()
}
