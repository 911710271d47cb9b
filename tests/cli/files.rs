//! Missing, busy, foreign, truncated and damaged files: one clear error line, never a panic,
//! never a file created.

use idempotency_store::Store;
use serde_json::Value;

use super::{cli, expect, fixture, json, p};

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
