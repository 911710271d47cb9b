//! Files of format 3 (records filed under their key's hash) open as format 5 (records in claim
//! order, a key index): the open moves every record in its own transaction, with the log's
//! entries redone on top, and a kill at any moment of the move leaves a file that opens whole.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use idempotency_store::{
    Claim, Fingerprint, IdempotencyStore, Key, RecordState, Response, Result, Store,
};

use crate::raw;
use raw::{add_misfiled_format_3_record, downgrade_to_format_3, format_version};

fn fp(i: usize) -> Fingerprint {
    Fingerprint::of([format!("req-{i}")])
}

fn response(i: usize) -> Response {
    Response::new(201, format!("body {i}"))
}

fn key(i: usize) -> Key {
    Key::new(&format!("key-{i}")).expect("key")
}

/// Completes keys `from..to` in `store`, and leaves key `to` claimed.
fn write(store: &Store, from: usize, to: usize) -> Result<()> {
    for i in from..to {
        let Claim::Acquired(lease) = store.claim(&key(i), fp(i))? else {
            panic!("key-{i} is fresh");
        };
        store.complete(&lease, response(i))?;
    }
    assert!(matches!(store.claim(&key(to), fp(to))?, Claim::Acquired(_)));
    Ok(())
}

/// Checks that `store` replays keys `0..n`, holds key `n` in progress, and `records` records
/// in all, and that `verify` finds nothing wrong.
fn check(store: &Store, n: usize, records: usize) -> Result<()> {
    for i in 0..n {
        match store.claim(&key(i), fp(i))? {
            Claim::Completed(record) => assert_eq!(record.response, response(i), "key-{i}"),
            other => panic!("key-{i}: {other:?}"),
        }
    }
    let held = store.inspect(&key(n))?.expect("the claimed key");
    assert!(
        matches!(held.state, RecordState::InProgress { .. }),
        "{held:?}"
    );
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.records, records as u64);
    Ok(())
}

/// A closed format-3 file holding keys `0..n` completed and key `n` claimed.
fn format_3_file(dir: &Path, n: usize) -> Result<PathBuf> {
    let path = dir.join("format3.redb");
    write(&Store::open(&path)?, 0, n)?;
    downgrade_to_format_3(&path);
    assert_eq!(format_version(&path), 3);
    Ok(path)
}

#[test]
fn a_format_3_file_opens_with_every_record_and_is_format_5_after() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = format_3_file(dir.path(), 300)?;
    {
        let store = Store::open(&path)?;
        check(&store, 300, 301)?;
        // New keys go after the moved ones.
        assert!(matches!(
            store.claim(&key(1000), fp(1000))?,
            Claim::Acquired(_)
        ));
    }
    assert_eq!(format_version(&path), 5);
    let store = Store::open(&path)?;
    check(&store, 300, 302)?;
    let last = store.records()?.last().expect("a record")?;
    assert_eq!(last.key, key(1000), "the newest key is filed last");
    Ok(())
}

#[test]
fn a_format_3_record_under_a_wrong_hash_is_left_out_with_its_counts() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = format_3_file(dir.path(), 20)?;
    add_misfiled_format_3_record(&path);
    let store = Store::open(&path)?;
    // `verify` would report a usage counter that still counted the record.
    check(&store, 20, 21)?;
    Ok(())
}

#[test]
fn a_read_only_open_of_a_format_3_file_reads_it_and_leaves_it_as_it_was() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = format_3_file(dir.path(), 50)?;
    let before = std::fs::read(&path).expect("read");
    {
        let store = Store::builder().open_read_only(&path)?;
        for i in 0..50 {
            let found = store.inspect(&key(i))?.expect("a record");
            assert!(
                matches!(found.state, RecordState::Completed { .. }),
                "{found:?}"
            );
        }
        assert!(store.verify()?.is_clean());
    }
    assert!(
        std::fs::read(&path).expect("read") == before,
        "the file was modified"
    );
    Ok(())
}

/// The child of the tests below: opens the store at `IDEMPOTENCY_UPGRADE` and, with
/// `IDEMPOTENCY_UPGRADE_WRITE=from,to`, writes keys as `write` does, then exits without
/// closing the store, so that the log keeps entries no merge covers.
#[test]
fn child_process_for_the_upgrade_tests() -> Result<()> {
    let Some(path) = std::env::var_os("IDEMPOTENCY_UPGRADE") else {
        return Ok(());
    };
    println!("opening");
    let store = Store::open(PathBuf::from(path))?;
    println!("opened");
    if let Some(range) = std::env::var_os("IDEMPOTENCY_UPGRADE_WRITE") {
        let range = range.to_string_lossy().into_owned();
        let (from, to) = range.split_once(',').expect("from,to");
        write(&store, from.parse().expect("from"), to.parse().expect("to"))?;
        println!("written");
    }
    std::process::exit(0);
}

fn child(path: &Path, write: Option<(usize, usize)>) -> std::process::Child {
    let mut command = Command::new(std::env::current_exe().expect("exe"));
    command
        .args([
            "--exact",
            "format_upgrade::child_process_for_the_upgrade_tests",
            "--nocapture",
        ])
        .env("IDEMPOTENCY_UPGRADE", path)
        .stdout(Stdio::piped());
    if let Some((from, to)) = write {
        command.env("IDEMPOTENCY_UPGRADE_WRITE", format!("{from},{to}"));
    }
    command.spawn().expect("spawn")
}

#[test]
fn the_log_of_a_format_3_file_is_redone_after_the_move() -> Result<()> {
    if std::env::var_os("IDEMPOTENCY_UPGRADE").is_some() {
        return Ok(());
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let path = format_3_file(dir.path(), 100)?;
    // A format-5 build writes keys 101..200 into the log and exits without a merge; the file
    // is then laid out as format 3 again, log and all, as a format-3 build would have left it.
    let status = child(&path, Some((101, 200))).wait().expect("wait");
    assert!(status.success());
    downgrade_to_format_3(&path);
    let store = Store::open(&path)?;
    for i in (0..100).chain(101..200) {
        assert!(
            matches!(store.claim(&key(i), fp(i))?, Claim::Completed(r) if r.response == response(i)),
            "key-{i}"
        );
    }
    assert!(store.verify()?.is_clean());
    Ok(())
}

#[test]
fn a_move_killed_at_any_moment_leaves_a_file_that_opens_whole() -> Result<()> {
    if std::env::var_os("IDEMPOTENCY_UPGRADE").is_some() {
        return Ok(());
    }
    const N: usize = 20_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let original = format_3_file(dir.path(), N)?;
    let copy = dir.path().join("copy.redb");
    // How long a whole open takes, so that the kills below spread over it.
    std::fs::copy(&original, &copy).expect("copy");
    let start = Instant::now();
    let mut whole = child(&copy, None);
    assert!(whole.wait().expect("wait").success());
    let took = start.elapsed();
    assert_eq!(format_version(&copy), 5);
    // Kills from the open's start to a little past its end, the last ones after the move.
    let mut during = 0;
    for step in 0..8u32 {
        std::fs::copy(&original, &copy).expect("copy");
        let mut killed = child(&copy, None);
        let mut out = BufReader::new(killed.stdout.take().expect("stdout"));
        let mut line = String::new();
        while !line.contains("opening") {
            line.clear();
            assert!(out.read_line(&mut line).expect("read") > 0, "child died");
        }
        std::thread::sleep(took.mul_f64(f64::from(step) / 6.0));
        killed.kill().expect("SIGKILL");
        killed.wait().expect("wait");
        let mut rest = String::new();
        while out.read_line(&mut rest).expect("read") > 0 {}
        let version = format_version(&copy);
        if !rest.contains("opened") {
            during += 1;
        }
        assert!(
            version == 3 || version == 5,
            "format {version} after a kill"
        );
        let store = Store::open(&copy)?;
        check(&store, N, N + 1)?;
        drop(store);
        assert_eq!(format_version(&copy), 5);
    }
    assert!(
        during >= 2,
        "only {during} kills landed before the open ended"
    );
    Ok(())
}
