//! `StoreBuilder::open_read_only`: a store opened for inspection reads what a writable open
//! would (the log replayed, after a crash too), refuses every write with `Error::ReadOnly`,
//! and never changes a byte of its file, which it opens read-only.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::redb::{self, TableDefinition};
use idempotency_store::{
    Claim, Error, Fingerprint, Key, Lease, RecordState, Response, Store, StoreBuilder,
};

const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("ledger");

fn key(name: &str) -> Key {
    Key::new(name).expect("key")
}

fn acquire(store: &Store, name: &str) -> Lease {
    match store.claim(&key(name), Fingerprint::of([name])) {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("{name} not acquired: {other:?}"),
    }
}

/// A store file as a crash leaves it: `done` completed, `held` in progress, `gone` released,
/// all of it only in the log (no merge since the store was created), plus a ledger row when
/// `ledger` is set. The store is leaked, never closed; its file (still locked by this
/// process) is copied to `crashed.redb`, which is returned. Also returns the lease on `held`.
fn crashed(dir: &Path, ledger: bool) -> (PathBuf, Lease) {
    let path = dir.join("live.redb");
    let mut builder = Store::builder();
    if ledger {
        builder.effect_table(LEDGER);
    }
    let store = builder.open(&path).expect("create");
    let done = acquire(&store, "done");
    if ledger {
        store
            .complete_with_effects(&done, Response::new(201, "charged"), |fx| {
                fx.insert(LEDGER, "done", 4999)?;
                Ok::<_, Error>(())
            })
            .expect("complete")
            .expect("effect");
    } else {
        store
            .complete(&done, Response::new(201, "charged"))
            .expect("complete");
    }
    let held = acquire(&store, "held");
    let gone = acquire(&store, "gone");
    store.release(&gone).expect("release");
    std::mem::forget(store);
    let copy = dir.join("crashed.redb");
    std::fs::copy(&path, &copy).expect("copy");
    (copy, held)
}

/// The records of `store`: key, state ("completed" or "in-progress").
fn records(store: &Store) -> Vec<(String, &'static str)> {
    let mut all: Vec<_> = store
        .records()
        .expect("records")
        .map(|r| {
            let r = r.expect("undamaged");
            let state = match r.record.state {
                RecordState::InProgress { .. } => "in-progress",
                _ => "completed",
            };
            (r.key.to_string(), state)
        })
        .collect();
    all.sort();
    all
}

#[test]
fn reads_work_writes_are_refused_and_the_file_is_unchanged_after_a_crash() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, mut held) = crashed(dir.path(), false);
    let before = std::fs::read(&path).expect("read");

    let store = Arc::new(Store::builder().open_read_only(&path).expect("open"));
    // The log was replayed: everything acknowledged before the crash is there.
    assert_eq!(
        records(&store),
        [
            ("done".to_owned(), "completed"),
            ("held".to_owned(), "in-progress")
        ]
    );
    let done = store.lookup(&key("done")).expect("lookup").expect("done");
    assert!(
        matches!(done.state, RecordState::Completed { ref response, .. } if response.body == b"charged")
    );
    assert!(store.inspect(&key("held")).expect("inspect").is_some());
    let stats = store.stats().expect("stats");
    assert_eq!((stats.completed, stats.in_progress), (1, 1));
    assert_eq!(stats.file_bytes, Some(before.len() as u64));
    let report = store.verify().expect("verify");
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.records, 2);
    // A claim that only replays or reports needs no write.
    assert!(matches!(
        store.claim(&key("done"), Fingerprint::of(["done"])),
        Ok(Claim::Completed(_))
    ));
    assert!(matches!(
        store.claim(&key("held"), Fingerprint::of(["held"])),
        Ok(Claim::InProgress { .. })
    ));

    // Every write is refused.
    let refused = |what: &str, result: Result<(), Error>| {
        assert!(matches!(result, Err(Error::ReadOnly)), "{what}: {result:?}");
    };
    refused(
        "claim",
        store.claim(&key("new"), Fingerprint::of(["new"])).map(drop),
    );
    refused(
        "complete",
        store.complete(&held, Response::new(200, "late")),
    );
    refused("checkpoint", store.checkpoint(&mut held, b"step".to_vec()));
    refused("heartbeat", store.heartbeat(&mut held).map(drop));
    refused("release", store.release(&held));
    refused("sweep", store.sweep(10).map(drop));
    refused("sweep_all", store.sweep_all().map(drop));
    refused("force_release", store.force_release(&key("held")).map(drop));
    refused(
        "complete_with",
        store
            .complete_with(&held, Response::new(200, "x"), |_| Ok::<_, Error>(()))
            .map(drop),
    );
    refused(
        "complete_with_effects",
        store
            .complete_with_effects(&held, Response::new(200, "x"), |_| Ok::<_, Error>(()))
            .map(drop),
    );
    let sweeper = store.start_sweeper(Duration::from_millis(1), 10);
    assert!(matches!(sweeper.last_error(), Some(Error::ReadOnly)));
    assert!(matches!(sweeper.stop(), Err(Error::ReadOnly)));
    let message = Error::ReadOnly.to_string();
    assert!(message.contains("read-only") && message.contains("StoreBuilder::open"));
    let store = Arc::into_inner(store).expect("one owner");
    store.close().expect("close");

    let after = std::fs::read(&path).expect("read");
    assert_eq!(after.len(), before.len(), "size changed");
    assert!(after == before, "the read-only open changed the file");

    // The file still recovers as it would have: a writable open sees the same records.
    let writable = Store::open(&path).expect("open");
    assert_eq!(
        records(&writable),
        [
            ("done".to_owned(), "completed"),
            ("held".to_owned(), "in-progress")
        ]
    );
}

/// The open's handle on the file is read-only: any write through it would fail (`EBADF`), so
/// "never writes a byte" holds even for the process's root user, whom permission bits do not
/// stop. Linux: the access mode of every descriptor open on the file, from /proc.
#[cfg(target_os = "linux")]
#[test]
fn every_handle_on_the_file_is_read_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = crashed(dir.path(), false);
    let path = path.canonicalize().expect("canonical");
    let store = Store::builder().open_read_only(&path).expect("open");
    let mut modes = Vec::new();
    for fd in std::fs::read_dir("/proc/self/fd").expect("fds") {
        let fd = fd.expect("fd").path();
        if std::fs::read_link(&fd).ok().as_deref() != Some(path.as_path()) {
            continue;
        }
        let name = fd.file_name().expect("name").to_string_lossy().into_owned();
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{name}")).expect("fdinfo");
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|f| u32::from_str_radix(f.trim(), 8).expect("octal flags"))
            .expect("flags line");
        modes.push(flags & 0o3); // O_ACCMODE
    }
    assert_eq!(modes, [0], "the store's handles on the file: O_RDONLY = 0");
    drop(store);
}

/// A file that permission bits make read-only works too, and is not changed.
#[test]
fn a_read_only_file_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = crashed(dir.path(), false);
    let before = std::fs::read(&path).expect("read");
    let mut perms = std::fs::metadata(&path).expect("meta").permissions();
    perms.set_readonly(true);
    std::fs::set_permissions(&path, perms).expect("chmod 444");
    let store = Store::builder().open_read_only(&path).expect("open");
    assert_eq!(records(&store).len(), 2);
    store.close().expect("close");
    assert!(std::fs::read(&path).expect("read") == before);
}

#[test]
fn a_writer_and_a_reader_exclude_each_other_and_readers_share() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("store.redb");
    let writer = Store::open(&path).expect("create");
    assert!(matches!(
        Store::builder().open_read_only(&path),
        Err(Error::AlreadyOpen)
    ));
    writer.close().expect("close");
    let first = Store::builder()
        .open_read_only(&path)
        .expect("first reader");
    let second = Store::builder()
        .open_read_only(&path)
        .expect("second reader");
    assert!(matches!(Store::open(&path), Err(Error::AlreadyOpen)));
    drop((first, second));
    Store::open(&path).expect("the writer again");
}

#[test]
fn unregistered_effect_tables_are_skipped_only_read_only() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = crashed(dir.path(), true);
    // Without the ledger: a writable open refuses (it could not redo the row; redb's repair
    // has written the file by then, so the bytes are taken after it)...
    assert!(matches!(
        Store::open(&path),
        Err(Error::EffectTable { ref table, .. }) if table == "ledger"
    ));
    let before = std::fs::read(&path).expect("read");
    // ...a read-only one leaves the row out and shows the store's own records.
    let store = Store::builder().open_read_only(&path).expect("open");
    assert_eq!(records(&store).len(), 2);
    drop(store);
    // With the ledger registered, its row is replayed too.
    let store = StoreBuilder::new()
        .effect_table(LEDGER)
        .open_read_only(&path)
        .expect("open");
    let charged = store
        .read_with(|txn| -> Result<Option<u64>, redb::Error> {
            Ok(txn.open_table(LEDGER)?.get("done")?.map(|v| v.value()))
        })
        .expect("read")
        .expect("ledger");
    assert_eq!(charged, Some(4999));
    drop(store);
    assert!(std::fs::read(&path).expect("read") == before);
}

#[test]
fn missing_empty_and_foreign_files_are_refused_and_never_created() {
    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("nope.redb");
    let err = Store::builder()
        .open_read_only(&missing)
        .expect_err("missing");
    assert!(matches!(err, Error::NotAStore { .. }), "{err}");
    assert!(err.to_string().contains("never creates"), "{err}");
    assert!(!missing.exists());

    let empty = dir.path().join("empty.redb");
    std::fs::write(&empty, b"").expect("write");
    let err = Store::builder().open_read_only(&empty).expect_err("empty");
    assert!(err.to_string().contains("is empty"), "{err}");
    assert_eq!(std::fs::metadata(&empty).expect("meta").len(), 0);

    let notes = dir.path().join("notes.redb");
    std::fs::write(&notes, b"my notes\n".repeat(1000)).expect("write");
    let err = Store::builder()
        .open_read_only(&notes)
        .expect_err("foreign");
    assert!(matches!(err, Error::NotAStore { .. }), "{err}");
    assert!(std::fs::read(&notes).expect("read") == b"my notes\n".repeat(1000));
}

/// Damage anywhere in the file: a read-only open and every read answer or fail with an error,
/// never panic, and still never write.
#[test]
fn a_damaged_file_gives_errors_not_panics_and_stays_unchanged() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _) = crashed(dir.path(), false);
    let pristine = std::fs::read(&path).expect("read");
    let damaged = dir.path().join("damaged.redb");
    // Offsets in the header, the log and redb's part, spread over the whole file.
    let step = pristine.len() / 97;
    for (n, at) in (0..pristine.len()).step_by(step.max(1)).enumerate() {
        let mut bytes = pristine.clone();
        if n % 5 == 4 {
            bytes.truncate(at);
        } else {
            for b in &mut bytes[at..(at + 64).min(pristine.len())] {
                *b ^= 0x5a;
            }
        }
        std::fs::write(&damaged, &bytes).expect("write");
        if let Ok(store) = Store::builder().open_read_only(&damaged) {
            let _ = store.stats();
            let _ = store.verify();
            if let Ok(walk) = store.records() {
                walk.for_each(drop);
            }
            let _ = store.lookup(&key("done"));
            let _ = store.close();
        }
        assert!(
            std::fs::read(&damaged).expect("read") == bytes,
            "damage at {at} (case {n}): the file changed"
        );
    }
}
