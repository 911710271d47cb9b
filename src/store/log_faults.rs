//! Faults in the log handle's own writes (the `O_DSYNC` path of a store on a file, which a
//! custom backend cannot reach): `EIO` before or after the write, or a panic, at every log
//! write of a workload; and a panic after each log write, once the entry is durable but
//! before its batch reaches the overlay (or, with a quota, redb's commit). The store must
//! refuse later writes with `Error::Poisoned`, and once reopened keep every acknowledged
//! completion and serve nothing else as completed.

use crate::api::store::IdempotencyStore;
use std::collections::HashMap;
use std::path::Path;

use crate::api::clock::{ManualClock, Timestamp};
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, RecordState};
use crate::api::response::Response;
use crate::engine::poison::Io;
use crate::engine::wal::LogFault;
use crate::error::{Error, Result};
use crate::store::Store;

const KEYS: usize = 40;

/// What a run injects.
#[derive(Debug, Clone, Copy)]
enum Fault {
    Log(LogFault),
    /// A panic in the batch after this many successful log writes, once its entry is written;
    /// with `quota`, batches write redb's tables directly and the panic cuts their commit off.
    PanicAfterLog {
        log_writes: u64,
        quota: bool,
    },
}

impl Fault {
    fn quota(self) -> bool {
        matches!(self, Fault::PanicAfterLog { quota: true, .. })
    }

    fn arm(self, store: &Store) {
        match self {
            Fault::Log(fault) => store.engine.set_log_fault(Some(fault)),
            Fault::PanicAfterLog { log_writes, .. } => {
                store.engine.set_panic_after_log(Some(log_writes));
            }
        }
    }

    fn fired(self, store: &Store) -> bool {
        match self {
            Fault::Log(_) => store.engine.log_fault().is_none(),
            Fault::PanicAfterLog { .. } => store.engine.panic_after_log().is_none(),
        }
    }
}

fn open(path: &Path, clock: &ManualClock, quota: bool) -> Result<Store> {
    let mut builder = Store::builder();
    builder.log_size(16 << 10).clock(clock.clone());
    if quota {
        builder.max_records(1_000_000);
    }
    builder.open(path)
}

fn fingerprint(name: &str) -> Fingerprint {
    Fingerprint::of([name])
}

fn response(name: &str, token: u64) -> Response {
    Response::new(200, format!("{name}:{token}"))
}

/// Per key: the token of its last acquired lease, and whether its completion was
/// acknowledged.
type Acks = HashMap<String, (u64, bool)>;

fn workload(store: &Store, acks: &mut Acks) -> Result<()> {
    for i in 0..KEYS {
        let name = format!("k{i}");
        let Claim::Acquired(lease) = store.claim(&Key::new(&name)?, fingerprint(&name))? else {
            panic!("{name}: fresh key not acquired");
        };
        acks.insert(name.clone(), (lease.token(), false));
        store.complete(&lease, response(&name, lease.token()))?;
        acks.insert(name, (lease.token(), true));
    }
    Ok(())
}

fn check(store: &Store, acks: &Acks) -> Result<()> {
    for (name, &(token, completed)) in acks {
        let view = store.lookup(&Key::new(name)?)?;
        let replays = matches!(&view, Some(v) if matches!(&v.state,
            RecordState::Completed { response: r, .. } if *r == response(name, token)));
        let is_completed =
            matches!(&view, Some(v) if matches!(v.state, RecordState::Completed { .. }));
        if completed {
            assert!(replays, "{name}: acknowledged completion lost: {view:?}");
        } else {
            assert!(view.is_some(), "{name}: acknowledged claim lost");
            // Only the completion in flight at the fault may have landed, and only as sent.
            assert!(!is_completed || replays, "{name}: {view:?}");
        }
    }
    Ok(())
}

/// How many log-handle writes the workload makes.
fn log_writes(dir: &Path) -> Result<u64> {
    let path = dir.join("count.store");
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let store = open(&path, &clock, false)?;
    store.engine.set_log_fault(Some(LogFault {
        writes_before: u64::MAX,
        during: Io::Write,
        panic: false,
    }));
    workload(&store, &mut Acks::new())?;
    let left = store.engine.log_fault().map(|f| f.writes_before);
    Ok(u64::MAX - left.expect("never fired"))
}

/// How many log writes of the workload succeed (those of the batches, not of the merges).
fn logged_batches(dir: &Path, quota: bool) -> Result<u64> {
    let path = dir.join(format!("count-{quota}.store"));
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let store = open(&path, &clock, quota)?;
    store.engine.set_panic_after_log(Some(u64::MAX));
    workload(&store, &mut Acks::new())?;
    Ok(u64::MAX - store.engine.panic_after_log().expect("never fired"))
}

fn run(dir: &Path, fault: Fault) -> Result<()> {
    let path = dir.join(format!("{fault:?}.store").replace(' ', ""));
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let store = open(&path, &clock, fault.quota())?;
    fault.arm(&store);
    let mut acks = Acks::new();
    let failed = workload(&store, &mut acks);
    assert!(failed.is_err(), "{fault:?}: the fault never fired");
    assert!(fault.fired(&store));
    let refused = store.claim(&Key::new("fresh")?, fingerprint("fresh"));
    assert!(
        matches!(refused, Err(Error::Poisoned { .. })),
        "{fault:?}: first error {failed:?}, then {refused:?}"
    );
    // Reads go on: every acknowledged completion still replays from the poisoned store.
    check(&store, &acks)?;
    drop(store);
    let store = open(&path, &clock, fault.quota())?;
    check(&store, &acks)?;
    assert!(store.verify()?.is_clean());
    let Claim::Acquired(lease) = store.claim(&Key::new("after")?, fingerprint("after"))? else {
        panic!("{fault:?}: no fresh claim after the reopen");
    };
    // The counters the batch cut off had advanced in the log: no token is handed out twice.
    let highest = acks.values().map(|&(token, _)| token).max().unwrap_or(0);
    assert!(
        lease.token() > highest,
        "{fault:?}: token {} reused",
        lease.token()
    );
    store.complete(&lease, response("after", lease.token()))?;
    store.close()
}

fn every_log_write(during: Io, panic: bool) -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let writes = log_writes(dir.path())?;
    assert!(writes >= 2 * KEYS as u64 / 2, "{writes} log writes");
    for writes_before in 0..writes {
        let fault = LogFault {
            writes_before,
            during,
            panic,
        };
        run(dir.path(), Fault::Log(fault))?;
    }
    Ok(())
}

fn panic_after_every_log_write(quota: bool) -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let writes = logged_batches(dir.path(), quota)?;
    assert!(writes >= KEYS as u64, "{writes} log writes");
    for log_writes in 0..writes {
        run(dir.path(), Fault::PanicAfterLog { log_writes, quota })?;
    }
    Ok(())
}

#[test]
fn eio_before_a_log_write_poisons() -> Result<()> {
    every_log_write(Io::Write, false)
}

#[test]
fn eio_after_a_log_write_poisons() -> Result<()> {
    every_log_write(Io::Sync, false)
}

#[test]
fn a_panic_in_a_log_write_poisons() -> Result<()> {
    every_log_write(Io::Write, true)
}

#[test]
fn a_panic_after_a_log_write_poisons() -> Result<()> {
    panic_after_every_log_write(false)
}

#[test]
fn a_panic_in_a_direct_batch_after_its_log_write_poisons() -> Result<()> {
    panic_after_every_log_write(true)
}
