//! Errors, exit codes and the release prompt: one JSON error line with a kind under `--json`,
//! `--help` and `--version`, and the prompt on a terminal.

use std::path::Path;
use std::process::{Command, Stdio};

use idempotency_store::Store;

use super::{BIN, cli, expect, fixture, json_error, p};

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
