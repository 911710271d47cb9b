//! Each subcommand on a store file: `stats`, `get`, `list`, `release`, `sweep`, `verify` and
//! `export`, in text and `--json` output, with their exit codes.

use idempotency_store::{IdempotencyStore, Key, Store};
use serde_json::Value;

use super::{claim, cli, expect, fixture, json, p, verify_with_library};

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
