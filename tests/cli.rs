//! The operator CLI `idempotency-store`, run as a process against store files prepared with the
//! library: output, `--json` output and exit codes of every subcommand, and missing, foreign,
//! damaged and busy files (one clear error line, never a panic).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use idempotency_store::redb::TableDefinition;
use idempotency_store::{
    Claim, Clock, Error, Fingerprint, IdempotencyStore, Key, ManualClock, Response, Store,
    SystemClock, Timestamp,
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

fn claim(store: &Store, key: &Key) -> idempotency_store::Lease {
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
    let old = claim(&store, &Key::new("old-order").expect("key"));
    store
        .complete(&old, Response::new(200, "old"))
        .expect("complete");
    clock.set(Timestamp::from_millis(now - 2 * HOUR));
    let mut stuck = claim(&store, &Key::new("stuck-order").expect("key"));
    store
        .checkpoint(&mut stuck, b"step-2".to_vec())
        .expect("checkpoint");
    clock.set(Timestamp::from_millis(now));
    let _live = claim(&store, &Key::new("live-order").expect("key"));
    let done = claim(&store, &Key::scoped("tenant-a", "order-7").expect("key"));
    let response =
        Response::new(201, r#"{"id":"pay_1"}"#).with_header("content-type", "application/json");
    store.complete(&done, response).expect("complete");
    path
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

#[test]
fn stats_counts_each_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let human = expect(0, &["stats", p(&path)]);
    assert!(human.stdout.starts_with("STATE"), "{}", human.stdout);
    let line = |name: &str| {
        human
            .stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(line("in progress").starts_with("in progress 2 (1 stuck"));
    assert_eq!(line("completed"), "completed 1");
    assert!(line("expired").starts_with("expired 1"));
    assert_eq!(line("total"), "total 4");
    assert!(line("file size:").ends_with(" bytes)"));

    let stats = json(&expect(0, &["stats", p(&path), "--json"]));
    assert_eq!(stats["records"], 4);
    assert_eq!(stats["in_progress"], 2);
    assert_eq!(stats["stuck"], 1);
    assert_eq!(stats["completed"], 1);
    assert_eq!(stats["expired"], 1);
    assert!(stats["file_bytes"].as_u64().is_some_and(|b| b > 0));
}

#[test]
fn get_shows_a_record_in_every_state() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let done = expect(0, &["get", p(&path), "order-7", "--scope", "tenant-a"]);
    for expected in [
        "key          order-7",
        "scope        tenant-a",
        "state        completed",
        "attempt      1",
        "status       201",
        "header       content-type: application/json",
        r#"body         14 bytes: {"id":"pay_1"}"#,
    ] {
        assert!(
            done.stdout.contains(expected),
            "{expected:?} in\n{}",
            done.stdout
        );
    }
    let value = json(&expect(
        0,
        &["--json", "get", p(&path), "order-7", "--scope", "tenant-a"],
    ));
    assert_eq!(value["key"], "order-7");
    assert_eq!(value["scope"], "tenant-a");
    assert_eq!(value["state"], "completed");
    assert_eq!(value["expired"], false);
    assert_eq!(value["fingerprint_version"], 1);
    assert_eq!(value["fingerprint"].as_str().map(str::len), Some(64));
    assert_eq!(value["response"]["status"], 201);
    assert_eq!(value["response"]["body_base64"], "eyJpZCI6InBheV8xIn0=");
    assert_eq!(value["response"]["headers"][0]["name"], "content-type");
    assert_eq!(
        value["response"]["headers"][0]["value_base64"],
        "YXBwbGljYXRpb24vanNvbg=="
    );
    assert!(value["completed_at_ms"].as_u64().is_some());
    assert!(value["lease_until_ms"].is_null());

    let stuck = expect(0, &["get", p(&path), "stuck-order"]);
    assert!(
        stuck.stdout.contains("state        stuck"),
        "{}",
        stuck.stdout
    );
    assert!(stuck.stdout.contains("(lapsed 1h"), "{}", stuck.stdout);
    assert!(
        stuck.stdout.contains("checkpoint   6 bytes: step-2"),
        "{}",
        stuck.stdout
    );
    let stuck = json(&expect(0, &["get", p(&path), "stuck-order", "--json"]));
    assert_eq!(
        (
            &stuck["state"],
            &stuck["stuck"],
            &stuck["checkpoint_base64"]
        ),
        (
            &Value::from("in-progress"),
            &Value::from(true),
            &Value::from("c3RlcC0y")
        )
    );
    assert!(stuck["response"].is_null());

    let live = expect(0, &["get", p(&path), "live-order"]);
    assert!(
        live.stdout.contains("state        in-progress"),
        "{}",
        live.stdout
    );
    assert!(live.stdout.contains("(live for "), "{}", live.stdout);
    let old = expect(0, &["get", p(&path), "old-order"]);
    assert!(
        old.stdout.contains("state        expired"),
        "{}",
        old.stdout
    );

    // The scope is part of the key.
    let missing = expect(1, &["get", p(&path), "order-7"]);
    assert!(
        missing.stderr.contains(r#"no record for key "order-7""#),
        "{}",
        missing.stderr
    );
    let bad = expect(2, &["get", p(&path), "bad\tkey"]);
    assert!(
        bad.stderr.contains("invalid idempotency key"),
        "{}",
        bad.stderr
    );
}

#[test]
fn list_filters_and_limits() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let keys = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["list", p(&path), "--json"];
        all.extend_from_slice(args);
        let value = json(&expect(0, &all));
        value
            .as_array()
            .expect("an array")
            .iter()
            .map(|r| r["key"].as_str().expect("key").to_owned())
            .collect()
    };
    let mut all = keys(&[]);
    all.sort();
    assert_eq!(all, ["live-order", "old-order", "order-7", "stuck-order"]);
    let mut in_progress = keys(&["--state", "in-progress"]);
    in_progress.sort();
    assert_eq!(in_progress, ["live-order", "stuck-order"]);
    assert_eq!(keys(&["--stuck"]), ["stuck-order"]);
    assert_eq!(keys(&["--state", "completed"]), ["order-7"]);
    assert_eq!(keys(&["--state", "expired"]), ["old-order"]);

    let limited = expect(0, &["list", p(&path), "--json", "--limit", "1"]);
    assert_eq!(json(&limited).as_array().map(Vec::len), Some(1));
    assert!(limited.stderr.contains("more match"), "{}", limited.stderr);

    let table = expect(0, &["list", p(&path)]);
    let lines: Vec<&str> = table.stdout.lines().collect();
    assert_eq!(lines.len(), 5, "{}", table.stdout);
    assert!(lines[0].starts_with("KEY") && lines[0].contains("STATE"));
    let row = |key: &str| {
        lines
            .iter()
            .find(|l| l.starts_with(key))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .unwrap_or_else(|| panic!("no row for {key}"))
    };
    assert_eq!(row("order-7")[1..4], ["tenant-a", "completed", "1"]);
    assert_eq!(row("order-7").last(), Some(&"201"));
    assert_eq!(row("stuck-order")[1..3], ["-", "stuck"]);
    assert_eq!(row("old-order")[2], "expired");

    let none = expect(
        0,
        &[
            "list",
            p(&path),
            "--stuck",
            "--state",
            "in-progress",
            "--limit",
            "0",
        ],
    );
    assert_eq!(none.stdout.trim(), "no matching records");
    expect(2, &["list", p(&path), "--stuck", "--state", "completed"]);
    let usage = cli(&["list", p(&path), "--state", "running"]);
    assert_eq!(usage.code, 2);
}

#[test]
fn release_needs_confirmation_and_keeps_the_store_consistent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());

    // No terminal and no --yes: refused, nothing changed.
    let refused = expect(2, &["release", p(&path), "stuck-order"]);
    assert!(
        refused.stderr.contains("not a terminal"),
        "{}",
        refused.stderr
    );
    assert!(refused.stderr.contains("--yes"), "{}", refused.stderr);
    expect(0, &["get", p(&path), "stuck-order"]);

    let completed = expect(
        2,
        &[
            "release",
            p(&path),
            "order-7",
            "--scope",
            "tenant-a",
            "--yes",
        ],
    );
    assert!(
        completed.stderr.contains("completed"),
        "{}",
        completed.stderr
    );
    let expired = expect(2, &["release", p(&path), "old-order", "--yes"]);
    assert!(expired.stderr.contains("no record"), "{}", expired.stderr);
    expect(2, &["release", p(&path), "no-such-order", "--yes"]);

    let released = expect(0, &["release", p(&path), "stuck-order", "--yes"]);
    assert!(
        released
            .stdout
            .starts_with(r#"released key "stuck-order" (attempt 1)"#)
    );
    expect(1, &["get", p(&path), "stuck-order"]);
    let live = json(&expect(
        0,
        &["release", p(&path), "live-order", "-y", "--json"],
    ));
    assert_eq!(live["released"], true);
    assert_eq!(live["lease_was_live"], true);

    // The expiry index and the usage counters were kept: verify is clean, and the key runs
    // afresh.
    let report = verify_with_library(&path);
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!((report.records, report.expiry_entries), (2, 2));
    let store = Store::open(&path).expect("open");
    let lease = claim(&store, &Key::new("stuck-order").expect("key"));
    assert_eq!(lease.attempt(), 1);
    assert_eq!(store.stats().expect("stats").in_progress, 1);
}

#[test]
fn sweep_verify_and_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let ok = expect(0, &["verify", p(&path)]);
    assert_eq!(
        ok.stdout.trim(),
        "ok: 4 records, 4 expiry entries, no problems"
    );
    let report = json(&expect(0, &["verify", p(&path), "--json"]));
    assert_eq!(report["clean"], true);
    assert_eq!(report["problems"].as_array().map(Vec::len), Some(0));

    let export = expect(0, &["export", p(&path), "--jsonl"]);
    let lines: Vec<Value> = export
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 4);
    let done = lines
        .iter()
        .find(|r| r["key"] == "order-7")
        .expect("order-7 exported");
    assert_eq!(done["scope"], "tenant-a");
    assert_eq!(done["response"]["body_base64"], "eyJpZCI6InBheV8xIn0=");
    let old = lines.iter().find(|r| r["key"] == "old-order").expect("old");
    assert_eq!(old["expired"], true);
    assert_eq!(old["response"]["body_base64"], "b2xk");
    for line in &lines {
        for field in [
            "state",
            "attempt",
            "fingerprint",
            "created_at_ms",
            "expires_at_ms",
        ] {
            assert!(!line[field].is_null(), "{field} in {line}");
        }
    }
    // JSON lines is the default: the same output without --jsonl.
    let default = expect(0, &["export", p(&path)]);
    assert_eq!(default.stdout, export.stdout);

    let swept = expect(0, &["sweep", p(&path)]);
    assert_eq!(swept.stdout.trim(), "deleted 1 expired record");
    assert_eq!(json(&expect(0, &["sweep", p(&path), "--json"]))["swept"], 0);
    let ok = expect(0, &["verify", p(&path)]);
    assert!(ok.stdout.starts_with("ok: 3 records"), "{}", ok.stdout);
}

#[test]
fn a_missing_file_is_reported_and_never_created() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("nope.redb");
    for args in [
        vec!["stats"],
        vec!["get", "k"],
        vec!["list"],
        vec!["release", "k", "--yes"],
        vec!["sweep"],
        vec!["verify"],
        vec!["export", "--jsonl"],
    ] {
        let mut all = vec![args[0], p(&path)];
        all.extend_from_slice(&args[1..]);
        let run = expect(2, &all);
        assert!(
            run.stderr.contains("nope.redb: no such file"),
            "{}",
            run.stderr
        );
        assert!(!path.exists(), "{args:?} created the file");
    }
    let run = expect(2, &["stats", p(dir.path())]);
    assert!(run.stderr.contains("is a directory"), "{}", run.stderr);
}

#[test]
fn a_file_open_in_a_service_is_reported_plainly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let _service = Store::open(&path).expect("open");
    for command in ["stats", "verify", "sweep"] {
        let run = expect(2, &[command, p(&path)]);
        assert!(
            run.stderr.contains("already open in another process"),
            "{}",
            run.stderr
        );
    }
}

#[test]
fn foreign_and_truncated_files_give_one_clear_line() {
    let dir = tempfile::tempdir().expect("tempdir");
    let garbage = dir.path().join("garbage.redb");
    std::fs::write(
        &garbage,
        b"these are my notes, not a database\n".repeat(200),
    )
    .expect("write");
    let run = expect(2, &["stats", p(&garbage)]);
    assert!(run.stderr.contains("not an idempotency store") || run.stderr.contains("corrupted"));
    let run = expect(1, &["verify", p(&garbage)]);
    assert!(run.stdout.starts_with("1 problem"), "{}", run.stdout);
    assert!(run.stderr.contains("1 problem found"), "{}", run.stderr);
    let notes = std::fs::read(&garbage).expect("read");
    assert!(
        notes.starts_with(b"these are my notes"),
        "the foreign file was modified"
    );

    let empty = dir.path().join("empty.redb");
    std::fs::write(&empty, b"").expect("write");
    let run = expect(1, &["verify", p(&empty), "--json"]);
    assert_eq!(json(&run)["clean"], false);

    let path = fixture(dir.path());
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("truncate");
    let run = cli(&["verify", p(&path)]);
    assert_ne!(run.code, 0, "a truncated file verified clean");
    let run = cli(&["list", p(&path)]);
    assert_ne!(run.code, 0, "a truncated file listed cleanly");
}

#[test]
fn a_damaged_record_is_listed_as_a_problem_and_skipped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    // Flip a bit in every copy of order-7's body: redb does not check page checksums outside
    // repair, the record's own checksum catches it.
    let mut bytes = std::fs::read(&path).expect("read");
    let marker = b"pay_1";
    let mut flipped = 0;
    for i in 0..bytes.len() - marker.len() {
        if &bytes[i..i + marker.len()] == marker {
            bytes[i] ^= 0x01;
            flipped += 1;
        }
    }
    assert!(flipped > 0, "the body is not in the file");
    std::fs::write(&path, &bytes).expect("write");

    let run = expect(1, &["verify", p(&path)]);
    assert!(run.stdout.contains("order-7"), "{}", run.stdout);
    assert!(run.stdout.contains("checksum"), "{}", run.stdout);
    let report = json(&expect(1, &["verify", p(&path), "--json"]));
    assert_eq!(report["clean"], false);
    assert_eq!(report["records"], 4);

    let list = expect(1, &["list", p(&path)]);
    assert!(list.stderr.contains("warning: skipped"), "{}", list.stderr);
    assert!(
        list.stderr.contains("1 damaged record skipped"),
        "{}",
        list.stderr
    );
    // Under --json, the warning and the error are JSON lines too.
    let list = expect(1, &["list", p(&path), "--json"]);
    assert_eq!(json(&list).as_array().map(Vec::len), Some(3));
    let lines: Vec<Value> = list
        .stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 2, "{}", list.stderr);
    assert!(
        lines[0]["warning"]
            .as_str()
            .is_some_and(|w| w.starts_with("skipped:")),
        "{}",
        list.stderr
    );
    assert_eq!(lines[1]["kind"], "damaged");
    assert!(
        lines[1]["error"]
            .as_str()
            .is_some_and(|e| e.contains("1 damaged record skipped")),
        "{}",
        list.stderr
    );
    let export = expect(1, &["export", p(&path), "--jsonl"]);
    assert_eq!(export.stdout.lines().count(), 3);
    let get = expect(2, &["get", p(&path), "order-7", "--scope", "tenant-a"]);
    assert!(get.stderr.contains("checksum"), "{}", get.stderr);
    expect(2, &["stats", p(&path)]);
    // The other records are still served.
    expect(0, &["get", p(&path), "stuck-order"]);
}

// ----- release and sweep: the application's effect rows, and nothing changed on failure -------

#[test]
fn release_and_sweep_keep_the_applications_effect_rows_for_its_next_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = crashed_with_effects(dir.path());
    // The finding: an open that does not register the table refuses such a file.
    let probe = dir.path().join("probe.redb");
    std::fs::copy(&path, &probe).expect("copy");
    assert!(matches!(
        Store::open(&probe),
        Err(Error::EffectTable { .. })
    ));

    let released = expect(0, &["release", p(&path), "held", "--yes"]);
    assert!(
        released
            .stdout
            .starts_with(r#"released key "held" (attempt 1)"#),
        "{}",
        released.stdout
    );
    let swept = expect(0, &["sweep", p(&path), "--json"]);
    assert_eq!(json(&swept)["swept"], 0);
    expect(1, &["get", p(&path), "held"]);

    // Kept, not dropped: an open without the table still refuses the file...
    let refused = Store::open(&path).map(drop);
    assert!(
        matches!(&refused, Err(Error::EffectTable { table, .. }) if table == "payments_ledger"),
        "{refused:?}"
    );
    // ...and the application's next open has its ledger row, and the release.
    let app = Store::builder()
        .effect_table(LEDGER)
        .open(&path)
        .expect("the application opens its file");
    let paid = app
        .read_with(
            |txn| -> Result<Option<u64>, idempotency_store::redb::Error> {
                Ok(txn.open_table(LEDGER)?.get("paid")?.map(|v| v.value()))
            },
        )
        .expect("read")
        .expect("the ledger");
    assert_eq!(paid, Some(4999));
    assert!(
        app.lookup(&Key::new("held").expect("key"))
            .expect("lookup")
            .is_none()
    );
    assert!(app.verify().expect("verify").is_clean());
    app.close().expect("close");
    // Applied, so nothing waits any more: any open works again.
    Store::open(&path).expect("open").close().expect("close");
}

#[test]
fn a_failing_release_or_sweep_leaves_the_file_byte_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = crashed_with_effects(dir.path());
    let before = checksum(&path);
    let refusals: [(&[&str], &str); 5] = [
        (&["release", p(&path), "paid", "--yes"], "refused"),
        (&["release", p(&path), "nothing-here", "--yes"], "no-record"),
        (&["release", p(&path), "held"], "refused"),
        (&["release", p(&path), "bad\tkey", "--yes"], "invalid-key"),
        (&["sweep", p(&path), "--limit", "1"], "usage"),
    ];
    for (args, kind) in refusals {
        json_error(2, kind, args);
        assert_eq!(checksum(&path), before, "{args:?} changed the file");
    }
    // The look passes, the writable open fails: a reader holds the file.
    {
        let _reader = Store::builder().open_read_only(&path).expect("read-only");
        expect(0, &["stats", p(&path)]);
        json_error(2, "already-open", &["sweep", p(&path)]);
        json_error(2, "already-open", &["release", p(&path), "held", "--yes"]);
    }
    assert_eq!(
        checksum(&path),
        before,
        "a refused writable open changed the file"
    );
    // A damaged file does not get as far as a writable open.
    let truncated = dir.path().join("truncated.redb");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("truncate");
    let damaged = checksum(&truncated);
    for args in [
        vec!["sweep", p(&truncated)],
        vec!["release", p(&truncated), "held", "--yes"],
    ] {
        assert_eq!(cli(&args).code, 2, "{args:?}");
        assert_eq!(checksum(&truncated), damaged, "{args:?} changed the file");
    }
    // The test could fail: a release that succeeds does change the file.
    expect(0, &["release", p(&path), "held", "--yes"]);
    assert_ne!(checksum(&path), before);
}

// ----- the library operations behind `list`, `get` and `release` ------------------------------

#[test]
fn force_release_deletes_only_in_progress_records_and_keeps_the_store_consistent() {
    use idempotency_store::{Error, admin::ForceRelease};
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let store = Store::builder()
        .lease(Duration::from_secs(10))
        .retention(Duration::from_secs(100))
        .clock(clock.clone())
        .open_in_memory()
        .expect("store");
    let key = |k: &str| Key::new(k).expect("key");
    let stuck = Key::scoped("t", "stuck").expect("key");
    let _old = claim(&store, &key("old"));
    clock.advance(Duration::from_secs(200));
    let stuck_lease = claim(&store, &stuck);
    let live_lease = claim(&store, &key("live"));
    let done = claim(&store, &key("done"));
    store
        .complete(&done, Response::new(201, "ok"))
        .expect("complete");
    clock.advance(Duration::from_secs(20));

    let release = |k: &Key| store.force_release(k).expect("force_release");
    assert_eq!(release(&key("done")), ForceRelease::Completed);
    assert_eq!(release(&key("old")), ForceRelease::NotFound, "expired");
    assert_eq!(release(&key("none")), ForceRelease::NotFound);
    assert!(matches!(
        release(&stuck),
        ForceRelease::Released { attempt: 1, .. }
    ));
    assert!(matches!(
        release(&key("live")),
        ForceRelease::Released { attempt: 1, .. }
    ));
    let report = store.verify().expect("verify");
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.records, 2, "done and the expired old remain");

    // The old holders are fenced off; the keys run afresh.
    assert!(matches!(store.release(&stuck_lease), Err(Error::LeaseLost)));
    assert!(matches!(
        store.complete(&live_lease, Response::new(200, "late")),
        Err(Error::LeaseLost)
    ));
    assert_eq!(claim(&store, &stuck).attempt(), 1);
    assert!(store.verify().expect("verify").is_clean());
    assert_eq!(store.sweep_all().expect("sweep"), 1);
    assert!(store.verify().expect("verify").is_clean());
}

#[test]
fn records_and_inspect_include_expired_records() {
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let store = Store::builder()
        .retention(Duration::from_secs(100))
        .clock(clock.clone())
        .open_in_memory()
        .expect("store");
    let a = Key::new("a").expect("key");
    let lease = claim(&store, &a);
    store
        .complete(&lease, Response::new(200, "a"))
        .expect("complete");
    let _b = claim(&store, &Key::scoped("s", "b").expect("key"));
    clock.advance(Duration::from_secs(1_000));
    let all: Vec<_> = store
        .records()
        .expect("records")
        .collect::<Result<_, _>>()
        .expect("no damage");
    let keys: Vec<String> = all.iter().map(|r| r.key.to_string()).collect();
    assert_eq!(keys, ["a", "s/b"]);
    assert!(
        all.iter()
            .all(|r| r.record.expires_at <= store.now().expect("now"))
    );
    assert!(store.lookup(&a).expect("lookup").is_none());
    assert!(store.inspect(&a).expect("inspect").is_some());
}

/// Every subcommand on a PostgreSQL table: the same fixture written with `PgStore` into a
/// fresh schema, the CLI given a `postgresql://` URL and `--schema`. Needs
/// `IDEMPOTENCY_PG_URL` (skipped with a printed reason without it, failed under `CI=true`).
#[cfg(feature = "postgres")]
mod postgres_backend {
    use std::time::Duration;

    use idempotency_store::{
        Claim, Clock, Fingerprint, IdempotencyStore, Key, ManualClock, Response, SystemClock,
        Timestamp, pg::PgStore,
    };

    use super::{HOUR, cli, expect, json};

    /// A fresh schema holding the fixture of `super::fixture`, dropped afterwards.
    struct Db {
        url: String,
        plain: String,
        schema: String,
    }

    impl Db {
        /// A schema name of this test's own, with no schema of that name.
        fn empty(test: &str) -> Option<Db> {
            let plain = match std::env::var("IDEMPOTENCY_PG_URL") {
                Ok(url) if !url.trim().is_empty() => url,
                _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
                    panic!("CI=true but IDEMPOTENCY_PG_URL is not set (see .ci/run)")
                }
                _ => {
                    eprintln!("skipped: IDEMPOTENCY_PG_URL is not set; see .ci/run");
                    return None;
                }
            };
            let db = Db {
                url: as_url(&plain),
                plain,
                schema: format!("cli_{test}_{}", std::process::id()),
            };
            db.admin(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", db.schema));
            Some(db)
        }

        fn fixture(test: &str) -> Option<Db> {
            let db = Db::empty(test)?;
            let now = SystemClock.now().as_millis();
            let clock = ManualClock::new(Timestamp::from_millis(now - 48 * HOUR));
            let store = PgStore::builder()
                .schema(db.schema.as_str())
                .retention(Duration::from_secs(24 * 3600))
                .lease(Duration::from_secs(3600))
                .clock(clock.clone())
                .pool_size(1)
                .connect(&db.plain)
                .expect("connect");
            let old = claim(&store, &Key::new("old-order").expect("key"));
            store
                .complete(&old, Response::new(200, "old"))
                .expect("complete");
            clock.set(Timestamp::from_millis(now - 2 * HOUR));
            let mut stuck = claim(&store, &Key::new("stuck-order").expect("key"));
            store
                .checkpoint(&mut stuck, b"step-2".to_vec())
                .expect("checkpoint");
            clock.set(Timestamp::from_millis(now));
            let _live = claim(&store, &Key::new("live-order").expect("key"));
            let done = claim(&store, &Key::scoped("tenant-a", "order-7").expect("key"));
            let response = Response::new(201, r#"{"id":"pay_1"}"#)
                .with_header("content-type", "application/json");
            store.complete(&done, response).expect("complete");
            Some(db)
        }

        /// `args` with the URL in place of `{}` and `--schema` added.
        fn run(&self, code: i32, args: &[&str]) -> super::Run {
            let mut all: Vec<&str> = args
                .iter()
                .map(|a| if *a == "{}" { self.url.as_str() } else { a })
                .collect();
            all.extend(["--schema", self.schema.as_str()]);
            expect(code, &all)
        }

        fn store(&self) -> PgStore {
            PgStore::builder()
                .schema(self.schema.as_str())
                .pool_size(1)
                .connect(&self.plain)
                .expect("connect")
        }

        fn admin(&self, sql: &str) {
            let mut client =
                postgres::Client::connect(&self.plain, postgres::NoTls).expect("admin connection");
            client.batch_execute(sql).expect("admin statement");
        }

        /// The one `bigint` that `sql` answers.
        fn number(&self, sql: &str) -> i64 {
            let mut client =
                postgres::Client::connect(&self.plain, postgres::NoTls).expect("admin connection");
            client
                .query_one(sql, &[])
                .and_then(|row| row.try_get(0))
                .expect("a number")
        }

        fn schema_exists(&self) -> bool {
            let sql = format!(
                "SELECT count(*) FROM pg_namespace WHERE nspname = '{}'",
                self.schema
            );
            self.number(&sql) > 0
        }

        /// The highest migration the schema records.
        fn migration(&self) -> i64 {
            self.number(&format!(
                "SELECT max(version)::bigint FROM \"{}\".idempotency_schema_migrations",
                self.schema
            ))
        }
    }

    impl Drop for Db {
        fn drop(&mut self) {
            self.admin(&format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema
            ));
        }
    }

    /// `IDEMPOTENCY_PG_URL` (a URL or `key=value` pairs) as `key=value` pairs, as the README
    /// writes it.
    fn as_pairs(text: &str) -> String {
        let config: postgres::Config = text.parse().expect("IDEMPOTENCY_PG_URL parses");
        let host = match config.get_hosts().first() {
            Some(postgres::config::Host::Tcp(host)) => host.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let quote = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"));
        let mut pairs = format!(
            "host={host} port={} user={} dbname={}",
            config.get_ports().first().copied().unwrap_or(5432),
            quote(config.get_user().unwrap_or("postgres")),
            quote(config.get_dbname().unwrap_or("postgres")),
        );
        if let Some(password) = config.get_password() {
            pairs += &format!(" password={}", quote(&String::from_utf8_lossy(password)));
        }
        pairs
    }

    /// `IDEMPOTENCY_PG_URL` (`key=value` pairs or a URL) as a `postgresql://` URL.
    fn as_url(text: &str) -> String {
        if text.starts_with("postgres") {
            return text.to_owned();
        }
        let config: postgres::Config = text.parse().expect("IDEMPOTENCY_PG_URL parses");
        let host = match config.get_hosts().first() {
            Some(postgres::config::Host::Tcp(host)) => host.clone(),
            _ => "127.0.0.1".to_owned(),
        };
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let encode = |s: &str| -> String {
            s.bytes()
                .map(|b| match b {
                    b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                        char::from(b).to_string()
                    }
                    _ => format!("%{b:02X}"),
                })
                .collect()
        };
        let user = encode(config.get_user().unwrap_or("postgres"));
        let password = config
            .get_password()
            .map(|p| format!(":{}", encode(&String::from_utf8_lossy(p))))
            .unwrap_or_default();
        let db = encode(config.get_dbname().unwrap_or("postgres"));
        format!("postgresql://{user}{password}@{host}:{port}/{db}")
    }

    fn claim(store: &PgStore, key: &Key) -> idempotency_store::Lease {
        match store.claim(key, Fingerprint::of([key.to_string()])) {
            Ok(Claim::Acquired(lease)) => lease,
            other => panic!("{key:?} not acquired: {other:?}"),
        }
    }

    #[test]
    fn stats_counts_each_state() {
        let Some(db) = Db::fixture("stats") else {
            return;
        };
        let human = db.run(0, &["stats", "{}"]);
        let line = |name: &str| {
            human
                .stdout
                .lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no {name} line"))
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert!(line("in progress").starts_with("in progress 2 (1 stuck"));
        assert_eq!(line("completed"), "completed 1");
        assert!(line("expired").starts_with("expired 1"));
        assert_eq!(line("total"), "total 4");
        // A table, not a file: the names say so.
        assert!(line("table size:").ends_with(" bytes)"));
        // And whether a failover can lose what it acknowledged (issue 40).
        assert!(line("replication:").contains("failover-safe"));
        assert!(!human.stdout.contains("file"), "{}", human.stdout);
        let stats = json(&db.run(0, &["stats", "{}", "--json"]));
        assert_eq!(
            (&stats["records"], &stats["stuck"], &stats["expired"]),
            (&4.into(), &1.into(), &1.into())
        );
        assert!(stats["table_bytes"].as_u64().is_some_and(|b| b > 0));
        assert!(stats.get("file_bytes").is_none(), "{stats}");
        assert!(stats["failover_safe"].is_boolean(), "{stats}");
        assert!(
            stats["replication"]
                .as_str()
                .is_some_and(|r| r.contains("failover-safe")),
            "{stats}"
        );
    }

    #[test]
    fn get_shows_records_and_exits_1_without_one() {
        let Some(db) = Db::fixture("get") else { return };
        let done = db.run(0, &["get", "{}", "order-7", "--scope", "tenant-a"]);
        for expected in [
            "key          order-7",
            "scope        tenant-a",
            "state        completed",
            "status       201",
            "header       content-type: application/json",
            r#"body         14 bytes: {"id":"pay_1"}"#,
        ] {
            assert!(
                done.stdout.contains(expected),
                "{expected}: {}",
                done.stdout
            );
        }
        let stuck = json(&db.run(0, &["get", "{}", "stuck-order", "--json"]));
        assert_eq!(stuck["stuck"], true);
        assert_eq!(stuck["checkpoint_base64"], "c3RlcC0y");
        let old = json(&db.run(0, &["get", "{}", "old-order", "--json"]));
        assert_eq!(old["expired"], true);
        let missing = db.run(1, &["get", "{}", "no-such-order"]);
        assert!(missing.stderr.contains("no record"), "{}", missing.stderr);
    }

    #[test]
    fn list_filters_and_limits() {
        let Some(db) = Db::fixture("list") else {
            return;
        };
        let keys = |args: &[&str]| -> Vec<String> {
            let mut all = vec!["list", "{}", "--json"];
            all.extend_from_slice(args);
            json(&db.run(0, &all))
                .as_array()
                .expect("an array")
                .iter()
                .map(|r| r["key"].as_str().expect("key").to_owned())
                .collect()
        };
        // Oldest first (issue 41): created 48 h ago, 2 h ago, then two at the same time,
        // which keep the table's order (unscoped keys before scope "tenant-a").
        assert_eq!(
            keys(&[]),
            ["old-order", "stuck-order", "live-order", "order-7"]
        );
        assert_eq!(
            keys(&["--state", "in-progress"]),
            ["stuck-order", "live-order"]
        );
        assert_eq!(keys(&["--stuck"]), ["stuck-order"]);
        assert_eq!(keys(&["--state", "completed"]), ["order-7"]);
        assert_eq!(keys(&["--state", "expired"]), ["old-order"]);
        let limited = db.run(0, &["list", "{}", "--json", "--limit", "1"]);
        assert_eq!(json(&limited).as_array().map(Vec::len), Some(1));
        assert!(limited.stderr.contains("more match"), "{}", limited.stderr);
        let table = db.run(0, &["list", "{}"]);
        assert_eq!(table.stdout.lines().count(), 5, "{}", table.stdout);
    }

    #[test]
    fn release_needs_confirmation_and_deletes_only_in_progress_records() {
        let Some(db) = Db::fixture("release") else {
            return;
        };
        let refused = db.run(2, &["release", "{}", "stuck-order"]);
        assert!(
            refused.stderr.contains("not a terminal"),
            "{}",
            refused.stderr
        );
        let completed = db.run(
            2,
            &["release", "{}", "order-7", "--scope", "tenant-a", "--yes"],
        );
        assert!(
            completed.stderr.contains("completed"),
            "{}",
            completed.stderr
        );
        let expired = db.run(2, &["release", "{}", "old-order", "--yes"]);
        assert!(expired.stderr.contains("no record"), "{}", expired.stderr);
        let released = db.run(0, &["release", "{}", "stuck-order", "--yes"]);
        assert!(
            released
                .stdout
                .starts_with(r#"released key "stuck-order" (attempt 1)"#),
            "{}",
            released.stdout
        );
        db.run(1, &["get", "{}", "stuck-order"]);
        let live = json(&db.run(0, &["release", "{}", "live-order", "-y", "--json"]));
        assert_eq!(live["released"], true);
        assert_eq!(live["lease_was_live"], true);
        let store = db.store();
        assert_eq!(
            claim(&store, &Key::new("stuck-order").expect("key")).attempt(),
            1
        );
        assert!(store.verify().expect("verify").is_clean());
    }

    #[test]
    fn sweep_verify_and_export() {
        let Some(db) = Db::fixture("sweep") else {
            return;
        };
        let ok = db.run(0, &["verify", "{}"]);
        assert_eq!(
            ok.stdout.trim(),
            "ok: 4 records, 4 expiry entries, no problems"
        );
        let export = db.run(0, &["export", "{}", "--jsonl"]);
        let lines: Vec<serde_json::Value> = export
            .stdout
            .lines()
            .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
            .collect();
        assert_eq!(lines.len(), 4);
        let done = lines
            .iter()
            .find(|r| r["key"] == "order-7")
            .expect("order-7 exported");
        assert_eq!(done["scope"], "tenant-a");
        assert_eq!(done["response"]["body_base64"], "eyJpZCI6InBheV8xIn0=");
        let swept = db.run(0, &["sweep", "{}"]);
        assert_eq!(swept.stdout.trim(), "deleted 1 expired record");
        assert_eq!(json(&db.run(0, &["sweep", "{}", "--json"]))["swept"], 0);
        assert!(
            db.run(0, &["verify", "{}"])
                .stdout
                .starts_with("ok: 3 records")
        );

        // A damaged row: verify lists it and exits 1.
        db.admin(&format!(
            "UPDATE \"{}\".idempotency_keys SET fingerprint = '\\x0102' WHERE key = 'live-order'",
            db.schema
        ));
        let bad = db.run(1, &["verify", "{}"]);
        assert!(
            bad.stdout.contains("fingerprint of 2 bytes"),
            "{}",
            bad.stdout
        );
        assert!(bad.stderr.contains("1 problem found"), "{}", bad.stderr);
    }

    /// Every command, on a schema given by `Db::run`.
    const COMMANDS: [&[&str]; 7] = [
        &["stats", "{}"],
        &["get", "{}", "k"],
        &["list", "{}"],
        &["verify", "{}"],
        &["export", "{}"],
        &["sweep", "{}"],
        &["release", "{}", "k", "--yes"],
    ];

    #[test]
    fn no_command_creates_a_missing_schema() {
        let Some(db) = Db::empty("missing") else {
            return;
        };
        for args in COMMANDS {
            let run = db.run(2, args);
            for expected in ["does not exist", "never creates or migrates a schema"] {
                assert!(run.stderr.contains(expected), "{args:?}: {}", run.stderr);
            }
            assert!(!db.schema_exists(), "{args:?} created the schema");
        }
        let message = super::json_error(
            2,
            "not-a-store",
            &["stats", db.plain.as_str(), "--schema", db.schema.as_str()],
        );
        assert!(message.contains(&db.schema), "{message}");
    }

    #[test]
    fn no_command_migrates_a_schema_at_another_migration() {
        let Some(db) = Db::fixture("older") else {
            return;
        };
        let current = db.migration();
        // As a build one migration older left it (the last migration's column stays: the
        // CLI must refuse before it reads anything).
        db.admin(&format!(
            "DELETE FROM \"{}\".idempotency_schema_migrations WHERE version = {current}",
            db.schema
        ));
        for args in COMMANDS {
            let run = db.run(2, args);
            let older = format!("is at migration {}", current - 1);
            assert!(run.stderr.contains(&older), "{args:?}: {}", run.stderr);
            assert_eq!(db.migration(), current - 1, "{args:?} migrated the schema");
        }
        // As a newer build leaves it.
        db.admin(&format!(
            "INSERT INTO \"{}\".idempotency_schema_migrations (version, description) \
             VALUES ({current}, 'back'), ({}, 'from the future')",
            db.schema,
            current + 1
        ));
        let run = db.run(2, &["verify", "{}"]);
        let newer = format!("is at migration {}", current + 1);
        assert!(run.stderr.contains(&newer), "{}", run.stderr);
        assert_eq!(db.migration(), current + 1);
    }

    #[test]
    fn a_key_value_connection_string_is_a_database() {
        let Some(db) = Db::fixture("pairs") else {
            return;
        };
        let pairs = as_pairs(&db.plain);
        let stats = expect(0, &["stats", &pairs, "--schema", &db.schema, "--json"]);
        assert_eq!(json(&stats)["records"], 4);
        let listed = expect(0, &["list", &pairs, "--schema", &db.schema, "--json"]);
        assert_eq!(json(&listed).as_array().map(Vec::len), Some(4));
    }

    #[test]
    fn an_unreachable_server_is_one_line_without_the_password() {
        if Db::fixture("unreachable").is_none() {
            return;
        }
        let run = cli(&[
            "stats",
            "postgresql://idem:s3cret@127.0.0.1:1/idem?sslmode=disable",
        ]);
        assert_eq!(run.code, 2, "{}", run.stderr);
        assert!(
            run.stderr
                .starts_with("error: postgresql://idem@127.0.0.1:1/idem:"),
            "{}",
            run.stderr
        );
        assert!(!run.stderr.contains("s3cret"), "{}", run.stderr);
        // key=value pairs: the password pair is left out, quoted or not.
        for password in ["s3cret", r"'s3cret \' x'"] {
            let pairs = format!("host=127.0.0.1 port=1 user=idem password={password} dbname=idem");
            let run = cli(&["stats", &pairs]);
            assert_eq!(run.code, 2, "{}", run.stderr);
            assert!(
                run.stderr
                    .starts_with("error: host=127.0.0.1 port=1 user=idem dbname=idem:"),
                "{}",
                run.stderr
            );
            assert!(!run.stderr.contains("s3cret"), "{}", run.stderr);
        }
    }
}

// ----- read-only inspection -------------------------------------------------------------------

/// Every inspection command, in both output forms: (arguments after the path, exit code).
const INSPECTIONS: [(&[&str], i32); 10] = [
    (&["stats"], 0),
    (&["stats", "--json"], 0),
    (&["list"], 0),
    (&["list", "--json"], 0),
    (&["get", "done"], 0),
    (&["get", "done", "--json"], 0),
    (&["verify"], 0),
    (&["verify", "--json"], 0),
    (&["export"], 0),
    (&["export", "--jsonl"], 0),
];

fn inspection<'a>(path: &'a str, args: &[&'a str]) -> Vec<&'a str> {
    let mut all = vec![args[0], path];
    all.extend_from_slice(&args[1..]);
    all
}

#[test]
fn inspection_commands_leave_the_file_byte_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let closed = fixture(dir.path());
    // The fixture's `order-7` stands in for `done` there.
    let done_key = |path: &Path| if path == closed { "order-7" } else { "done" };
    for path in [closed.clone(), crashed(dir.path())] {
        let before = std::fs::read(&path).expect("read");
        for (args, code) in INSPECTIONS {
            let mut args = inspection(p(&path), args);
            if args[0] == "get" {
                args[2] = done_key(&path);
                if path == closed {
                    args.extend(["--scope", "tenant-a"]);
                }
            }
            expect(code, &args);
            let after = std::fs::read(&path).expect("read");
            assert_eq!(after.len(), before.len(), "{args:?} changed the size");
            assert!(after == before, "{args:?} changed the file's bytes");
        }
        // Two runs on the same closed file report the same size: the file's own.
        let size = |run: &Run| json(run)["file_bytes"].as_u64().expect("file_bytes");
        let first = size(&expect(0, &["stats", p(&path), "--json"]));
        let second = size(&expect(0, &["stats", p(&path), "--json"]));
        assert_eq!((first, second), (before.len() as u64, before.len() as u64));
    }
    // The crashed file's log was replayed in memory: its records are seen.
    let crashed = dir.path().join("crashed.redb");
    let listed = json(&expect(0, &["list", p(&crashed), "--json"]));
    let mut keys: Vec<&str> = listed
        .as_array()
        .expect("array")
        .iter()
        .filter_map(|r| r["key"].as_str())
        .collect();
    keys.sort_unstable();
    assert_eq!(keys, ["done", "held"]);
}

/// The inspection commands on a file that permission bits make read-only, in a read-only
/// directory. Root ignores permission bits, so as root the commands run as `nobody` (through
/// `runuser`); where that is impossible the test says so and stops (the library test
/// `read_only::every_handle_on_the_file_is_read_only` checks the O_RDONLY handle anyway).
#[cfg(unix)]
#[test]
fn inspection_works_on_a_read_only_copy() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let original = crashed(dir.path());
    let shelf = dir.path().join("evidence");
    std::fs::create_dir(&shelf).expect("mkdir");
    let path = shelf.join("copy.redb");
    std::fs::copy(&original, &path).expect("copy");
    let before = std::fs::read(&path).expect("read");
    let mode = |path: &Path, mode| {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    };
    mode(&path, 0o444);
    mode(&shelf, 0o555);
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| {
        use std::os::unix::fs::MetadataExt;
        m.uid() == 0
    });
    let as_user = |args: &[&str]| -> Run {
        if root {
            let mut command = Command::new("runuser");
            command.args(["-u", "nobody", "--", BIN]).args(args);
            run(command, args)
        } else {
            cli(args)
        }
    };
    if root {
        // `nobody` must reach the directory and the binary.
        mode(dir.path(), 0o755);
        let probe = Command::new("runuser")
            .args(["-u", "nobody", "--", BIN, "--version"])
            .output();
        if !probe.is_ok_and(|o| o.status.success()) {
            eprintln!("skipped: running as root and cannot run the CLI as `nobody` (runuser)");
            return;
        }
    }
    for (args, code) in INSPECTIONS {
        let args = inspection(p(&path), args);
        let run = as_user(&args);
        assert_eq!(run.code, code, "{args:?}: {}", run.stderr);
    }
    // The copy really is read-only to this user: a command that writes cannot open it.
    let sweep = as_user(&["sweep", p(&path)]);
    assert_eq!(sweep.code, 2, "{}", sweep.stderr);
    assert!(
        sweep.stderr.contains("Permission denied"),
        "{}",
        sweep.stderr
    );
    mode(&shelf, 0o755);
    assert!(std::fs::read(&path).expect("read") == before);
}

// ----- errors, exit codes and the release prompt -----------------------------------------------

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

#[test]
fn errors_under_json_are_one_json_line_with_a_kind() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let missing = dir.path().join("nope.redb");
    assert!(json_error(2, "no-file", &["stats", p(&missing)]).ends_with("nope.redb: no such file"));
    assert!(json_error(2, "not-a-file", &["stats", p(dir.path())]).contains("is a directory"));
    let usage = json_error(2, "usage", &["list", p(&path), "--state", "running"]);
    assert!(usage.contains("running"), "{usage}");
    json_error(
        2,
        "usage",
        &["list", p(&path), "--stuck", "--state", "completed"],
    );
    json_error(2, "usage", &["frobnicate"]);
    assert!(json_error(1, "no-record", &["get", p(&path), "order-7"]).contains("no record"));
    json_error(2, "invalid-key", &["get", p(&path), "bad\tkey"]);
    assert!(json_error(2, "refused", &["release", p(&path), "stuck-order"]).contains("--yes"));
    json_error(
        2,
        "no-record",
        &["release", p(&path), "nothing-here", "--yes"],
    );
    let garbage = dir.path().join("garbage.redb");
    std::fs::write(&garbage, b"not a store\n".repeat(500)).expect("write");
    json_error(2, "not-a-store", &["stats", p(&garbage)]);
    {
        let _service = Store::open(&path).expect("open");
        let busy = json_error(2, "already-open", &["stats", p(&path)]);
        assert!(busy.contains("already open"), "{busy}");
    }
    // Without --json the same error is the plain line.
    let plain = expect(2, &["stats", p(&missing)]);
    assert!(plain.stderr.starts_with("error: "), "{}", plain.stderr);
}

#[test]
fn help_and_version_exit_0() {
    for args in [
        vec!["--help"],
        vec!["--version"],
        vec!["help"],
        vec!["stats", "--help"],
        vec!["release", "--help"],
        vec!["export", "--help"],
    ] {
        let run = expect(0, &args);
        assert!(!run.stdout.is_empty(), "{args:?} printed nothing");
        assert!(run.stderr.is_empty(), "{args:?}: {}", run.stderr);
    }
    // An installed binary has no docs/cli.md: --help carries the PATH forms, the promises,
    // the exit codes and every error kind.
    let help = expect(0, &["--help"]).stdout;
    for promise in [
        "postgresql://",
        "key=value",
        "--schema",
        "read-only",
        "byte for byte",
        "effect tables",
        "creates or migrates a schema",
        "Exit codes:",
        "  0  done",
        "  1  done, but",
        "  2  could not do it",
        "\"kind\"",
    ] {
        assert!(help.contains(promise), "{promise:?} in --help:\n{help}");
    }
    let (_, kinds) = help.split_once("one of:").expect("the kinds in --help");
    let kinds: Vec<&str> = kinds
        .split('.')
        .next()
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .collect();
    assert_eq!(
        kinds,
        [
            "usage",
            "invalid-key",
            "no-file",
            "not-a-file",
            "already-open",
            "not-a-store",
            "corrupted",
            "storage",
            "refused",
            "no-record",
            "problems",
            "damaged",
            "output",
            "internal",
        ]
    );
    let short = expect(0, &["-h"]).stdout;
    assert!(short.contains("--help says more"), "{short}");
    // No subcommand is a usage error.
    assert_eq!(cli(&[]).code, 2);
}

/// The prompt needs a terminal: the CLI runs under `script`, which gives it a pseudo-terminal
/// fed with `answer`. Returns the exit code and everything the terminal showed.
fn release_on_a_terminal(path: &Path, key: &str, answer: &str) -> Option<(i32, String)> {
    let command = format!("'{BIN}' release '{}' '{key}'", p(path));
    let child = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let Ok(mut child) = child else {
        eprintln!("skipped: `script` (util-linux) is not installed");
        return None;
    };
    use std::io::Write as _;
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(answer.as_bytes())
        .expect("answer");
    let output = child.wait_with_output().expect("script");
    let shown = String::from_utf8_lossy(&output.stdout).into_owned();
    println!(
        "$ release {key} <<< {answer:?}\n{shown}[exit {:?}]",
        output.status.code()
    );
    Some((output.status.code().expect("exited"), shown))
}

#[cfg(unix)]
#[test]
fn answering_no_at_the_release_prompt_releases_nothing_and_exits_0() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let Some((code, shown)) = release_on_a_terminal(&path, "stuck-order", "n\n") else {
        return;
    };
    assert!(
        shown.contains("Release key \"stuck-order\"? [y/N]"),
        "{shown}"
    );
    assert!(shown.contains("nothing released"), "{shown}");
    assert_eq!(code, 0, "{shown}");
    expect(0, &["get", p(&path), "stuck-order"]);
    let (code, shown) = release_on_a_terminal(&path, "stuck-order", "y\n").expect("script");
    assert_eq!(code, 0, "{shown}");
    assert!(shown.contains("released key \"stuck-order\""), "{shown}");
    expect(1, &["get", p(&path), "stuck-order"]);
}

// ----- list's long keys, get's quoted keys ----------------------------------------------------

#[test]
fn list_cuts_long_keys_unless_full() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("long.redb");
    let long = "k".repeat(200) + "-tail";
    {
        let store = Store::open(&path).expect("create");
        let _long = claim(&store, &Key::new(&long).expect("long key"));
        let _short = claim(&store, &Key::new("short").expect("key"));
        store.close().expect("close");
    }
    let table = expect(0, &["list", p(&path)]);
    let row = table
        .stdout
        .lines()
        .find(|l| l.starts_with('k'))
        .expect("the long key's row");
    let cell = row.split_whitespace().next().expect("key cell");
    assert_eq!(cell.chars().count(), 64, "{cell}");
    assert!(cell.ends_with('…') && !cell.contains("tail"), "{cell}");
    assert!(table.stdout.lines().any(|l| l.starts_with("short ")));
    assert!(table.stderr.contains("--full"), "{}", table.stderr);

    let full = expect(0, &["list", p(&path), "--full"]);
    assert!(
        full.stdout
            .lines()
            .any(|l| l.starts_with(&format!("{long} "))),
        "{}",
        full.stdout
    );
    assert!(full.stderr.is_empty(), "{}", full.stderr);
    let listed = json(&expect(0, &["list", p(&path), "--json"]));
    assert!(
        listed
            .as_array()
            .expect("array")
            .iter()
            .any(|r| r["key"] == long.as_str())
    );
}

#[test]
fn a_quoted_key_gets_a_hint_about_the_quotes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let run = expect(1, &["get", p(&path), "\"order-7\"", "--scope", "tenant-a"]);
    for expected in [
        "the quotes are part of the key",
        "there is a record without them",
        "get PATH order-7 --scope tenant-a",
    ] {
        assert!(
            run.stderr.contains(expected),
            "{expected:?} in {}",
            run.stderr
        );
    }
    let run = expect(1, &["get", p(&path), "'no-such'"]);
    assert!(run.stderr.contains("try without them"), "{}", run.stderr);
    let run = expect(1, &["get", p(&path), "no-such"]);
    assert!(!run.stderr.contains("quotes"), "{}", run.stderr);
}

/// A store file a point-of-sale device's `Outbox` wrote, in real time and with a lease of
/// 300 ms that has lapsed by the time the CLI looks (what `stats` once counted as stuck). In
/// order of creation: `pos-6` answered 201 and finished; `pos-5` begun, not sent; `pos-4`
/// sent once with no answer; then a server-side record `srv-1`, in progress. Returns the path
/// and the keys `pos-4` and `pos-5` carry.
fn outbox_fixture(dir: &Path) -> (PathBuf, String, String) {
    use idempotency_store::Claim;
    use idempotency_store::client::{Outbox, Sent};

    let path = dir.join("device.redb");
    let store = Store::builder()
        .lease(Duration::from_millis(300))
        .open(&path)
        .expect("create the store");
    let store = std::sync::Arc::new(store);
    let outbox = Outbox::new(std::sync::Arc::clone(&store));
    let fp = Fingerprint::of(["POST /payments", r#"{"amount":4999}"#]);
    let open = |id: &str| match outbox.begin(id, fp).expect("begin") {
        Claim::Acquired(intent) => intent,
        other => panic!("{id} not open: {other:?}"),
    };
    let mut done = open("pos-6");
    outbox.start(&mut done).expect("start");
    outbox
        .record(&mut done, Sent::Answered(201))
        .expect("record");
    outbox
        .finish(&done, Response::new(201, r#"{"id":"pay_6"}"#))
        .expect("finish");
    std::thread::sleep(Duration::from_millis(3));
    let queued = open("pos-5");
    std::thread::sleep(Duration::from_millis(3));
    let mut sent = open("pos-4");
    outbox.start(&mut sent).expect("start");
    outbox.record(&mut sent, Sent::NoAnswer).expect("record");
    std::thread::sleep(Duration::from_millis(3));
    let _server = claim(&store, &Key::new("srv-1").expect("key"));
    let keys = (sent.key().to_owned(), queued.key().to_owned());
    drop((outbox, sent, queued, done));
    std::sync::Arc::into_inner(store)
        .expect("the only handle")
        .close()
        .expect("close");
    std::thread::sleep(Duration::from_millis(400));
    (path, keys.0, keys.1)
}

#[test]
fn release_of_an_outbox_intent_is_refused_without_the_flag_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _, _) = outbox_fixture(dir.path());
    let before = std::fs::read(&path).expect("read");
    let scope = idempotency_store::client::SCOPE;
    for (id, extra) in [
        ("pos-4", &["--yes"][..]),
        ("pos-4", &[][..]), // refused before any prompt
        ("pos-5", &["--yes"][..]),
    ] {
        let mut args = vec!["release", p(&path), id, "--scope", scope];
        args.extend(extra);
        let refused = expect(2, &args);
        assert!(
            refused.stderr.contains("--allow-new-key-may-charge-twice")
                && refused.stderr.contains("outbound intent"),
            "{}",
            refused.stderr
        );
        let message = json_error(2, "refused", &args);
        assert!(message.contains("charge"), "{message}");
        assert_eq!(std::fs::read(&path).expect("read"), before, "{args:?}");
    }
    // The server-side record beside them is still released as before.
    let released = expect(0, &["release", p(&path), "srv-1", "--yes"]);
    assert!(released.stdout.contains("released key \"srv-1\""));
    // Named, the risk is taken.
    let taken = expect(
        0,
        &[
            "release",
            p(&path),
            "pos-4",
            "--scope",
            scope,
            "--yes",
            "--allow-new-key-may-charge-twice",
        ],
    );
    assert!(taken.stdout.contains("released key"), "{}", taken.stdout);
}

#[test]
fn outbox_intents_are_listed_with_the_key_sent_and_never_as_stuck() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, sent_key, queued_key) = outbox_fixture(dir.path());
    let before = checksum(&path);

    // stats: the intents are not stuck, and nothing advises releasing them.
    let stats = expect(0, &["stats", p(&path)]);
    assert!(stats.stdout.contains("outbound"), "{}", stats.stdout);
    assert!(
        stats.stdout.contains("1 stuck"),
        "srv-1 only: {}",
        stats.stdout
    );
    let counts = json(&expect(0, &["stats", p(&path), "--json"]));
    assert_eq!(counts["outbound_intents"], 2);
    assert_eq!(counts["in_progress"], 1);
    assert_eq!(counts["stuck"], 1);

    // list: oldest first, the intents' states and the keys they sent.
    let rows = json(&expect(0, &["list", p(&path), "--json"]));
    let rows = rows.as_array().expect("array");
    let keys: Vec<&str> = rows.iter().filter_map(|r| r["key"].as_str()).collect();
    assert_eq!(keys, ["pos-6", "pos-5", "pos-4", "srv-1"]);
    let intent = |i: usize| &rows[i]["intent"];
    assert_eq!(intent(0)["state"], "finished");
    assert_eq!(intent(1)["state"], "queued");
    assert_eq!(intent(1)["key_sent"], queued_key.as_str());
    assert_eq!(intent(2)["state"], "sent");
    assert_eq!(intent(2)["key_sent"], sent_key.as_str());
    assert_eq!(intent(2)["sends"], 1);
    assert_eq!(rows[2]["stuck"], false);
    assert!(rows[3].get("intent").is_none());
    assert_eq!(rows[3]["stuck"], true);
    let table = expect(0, &["list", p(&path)]);
    assert!(table.stdout.contains("KEY SENT"), "{}", table.stdout);
    assert!(table.stdout.contains(&sent_key), "{}", table.stdout);
    let stuck_rows: Vec<&str> = table
        .stdout
        .lines()
        .filter(|l| l.contains(" stuck "))
        .collect();
    assert_eq!(stuck_rows.len(), 1, "{}", table.stdout);
    assert!(stuck_rows[0].starts_with("srv-1"), "{}", table.stdout);
    let stuck = json(&expect(0, &["list", p(&path), "--stuck", "--json"]));
    assert_eq!(stuck.as_array().map(Vec::len), Some(1));

    // get: by operation id without the scope, and by the key that was sent.
    let by_id = expect(0, &["get", p(&path), "pos-4"]);
    assert!(by_id.stdout.contains(&sent_key), "{}", by_id.stdout);
    assert!(by_id.stdout.contains("never release"), "{}", by_id.stdout);
    assert!(
        by_id.stderr.contains("--scope idempotency-client"),
        "{}",
        by_id.stderr
    );
    let by_key = json(&expect(0, &["get", p(&path), &sent_key, "--json"]));
    assert_eq!(by_key["key"], "pos-4");
    assert_eq!(by_key["scope"], "idempotency-client");
    assert_eq!(by_key["intent"]["key_sent"], sent_key.as_str());
    let finished = expect(0, &["get", p(&path), "pos-6"]);
    assert!(finished.stdout.contains("finished"), "{}", finished.stdout);
    assert_eq!(checksum(&path), before, "looking changed the file");

    // A key that is only in another scope: the message names the scope to try.
    let other = fixture(dir.path());
    let missing = expect(1, &["get", p(&other), "order-7"]);
    assert!(
        missing.stderr.contains("try --scope tenant-a"),
        "{}",
        missing.stderr
    );
}
