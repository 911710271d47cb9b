//! Read-only inspection: the inspection commands leave the file byte-identical and work on a
//! read-only copy.

use std::path::Path;
use std::process::Command;

use super::{BIN, Run, cli, crashed, expect, fixture, json, p, run};

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
