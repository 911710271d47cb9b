//! Power loss checked at the level of the real system calls, on the default build's own file
//! I/O (`Store::open` on a path: redb's file backend, and the log's second handle opened with
//! `O_DSYNC`, or in the `-portable` workloads without it, each write followed by `fdatasync`),
//! where `tests/durability/power_loss.rs` goes through a custom storage backend.
//!
//! A child process (this test binary, re-run with `CHILD_ENV` set) runs a workload under
//! `strace -f`, which records every `openat` (with its flags: which descriptor has `O_DSYNC`),
//! `pwrite64` (with all its bytes), `fdatasync`/`fsync`, `ftruncate`/`fallocate` of the store
//! file, and the workload's notes: `try …` before each store call and `ack …` after it
//! returned `Ok`, each one `write(2)` to a notes file, so they sit in the same trace between
//! the store's calls. Then, for sampled crash points (a line of the trace), crash images are
//! built: the file as the last barriers left it, plus the writes not yet durable kept, dropped
//! or torn at 512-byte and 4 KiB boundaries (`syscalls::image` has the model). Each image is
//! opened with `Store::open` on a copy and checked against every call acknowledged before the
//! point (`syscalls::check`): recovery must succeed (crashes before the first `Store::open`
//! returned are counted apart, see the ignored test), `verify` must be clean, acknowledged
//! claims, heartbeats, checkpoints and completions must be there (completions with their exact
//! response), releases gone, nothing completed with a response no call was made with, the
//! `complete_with` ledger equal to the completed records, and the store must take new writes.
//! A negative control per workload that logs through `O_DSYNC` (an image from a disk that
//! ignored `O_DSYNC`) must fail the check. Each trace must also show the store file's
//! directory synced after the file was created and before the first open returned.
//!
//! The trace is the thread schedule of one run, so two runs with one seed try different
//! points; a failure prints the trace line, the image and what the store held, and keeps the
//! image and the trace in `$TMPDIR/idempotency-power-loss-failures/`.
//!
//! `cargo test --test durability -- power_loss_syscalls::` runs a short sample;
//! `SYSCALL_CRASH_POINTS` (crash points per workload, default 32), `SYSCALL_CRASH_SCALE`
//! (multiplies the workloads' keys, default 1), `SYSCALL_CRASH_RANDOM_IMAGES` (random images
//! per point beside the five fixed ones, default 4) and `SYSCALL_CRASH_SEED` make the long run
//! (CONTRIBUTING.md, "Long runs"). Needs `strace` (`.ci/run` installs it).

mod child;
mod images;
mod points;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use idempotency_store::{ManualClock, Recovery, Result, Store, StoreBuilder, Timestamp};

#[path = "../../syscalls/mod.rs"]
mod syscalls;

use child::{open_notes, run_key};
use images::check_workload;

const CHILD_ENV: &str = "IDEMPOTENCY_SYSCALL_CHILD";
const START: u64 = 1_000_000_000;
const LEASE: Duration = Duration::from_secs(600);
const RETENTION: Duration = Duration::from_secs(3600);

/// What one workload's threads do with each of their keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mix {
    /// Claim, then complete (most keys), release (every fifth) or leave in progress.
    Complete,
    /// Claim, heartbeat, checkpoint, heartbeat, checkpoint, then complete, release or leave.
    Leases,
    /// Claim, then `complete_with` a ledger row (even keys) or `complete` (odd keys).
    Effects,
}

#[derive(Debug, Clone, Copy)]
struct Workload {
    name: &'static str,
    threads: usize,
    keys: usize,
    log_size: u64,
    durability: Recovery,
    /// A store with a quota: its batches write redb's tables directly and sync the file.
    quota: bool,
    /// Close and reopen the store halfway (crash points then land in a recovery too).
    reopen: bool,
    /// The portable log path (`portable_log_sync`): the log's handle without `O_DSYNC`, each
    /// write followed by `fdatasync`, as on every platform but Linux.
    portable: bool,
    mix: Mix,
}

const WORKLOADS: [Workload; 8] = [
    // Group commit: 8 threads queue behind one leader's log write.
    Workload {
        name: "group",
        threads: 8,
        keys: 10,
        log_size: 64 << 10,
        durability: Recovery::FullRepair,
        quota: false,
        reopen: false,
        portable: false,
        mix: Mix::Complete,
    },
    // The smallest log (two 8 KiB halves) with bodies up to 1.4 KiB: it switches halves and
    // checkpoints every few batches, and the store is closed and reopened halfway.
    Workload {
        name: "wrap",
        threads: 2,
        keys: 40,
        log_size: 16 << 10,
        durability: Recovery::FullRepair,
        quota: false,
        reopen: true,
        portable: false,
        mix: Mix::Complete,
    },
    Workload {
        name: "wrap-quick-repair",
        threads: 2,
        keys: 30,
        log_size: 16 << 10,
        durability: Recovery::QuickRepair,
        quota: false,
        reopen: true,
        portable: false,
        mix: Mix::Complete,
    },
    Workload {
        name: "leases",
        threads: 4,
        keys: 8,
        log_size: 32 << 10,
        durability: Recovery::FullRepair,
        quota: false,
        reopen: false,
        portable: false,
        mix: Mix::Leases,
    },
    Workload {
        name: "effects",
        threads: 4,
        keys: 10,
        log_size: 32 << 10,
        durability: Recovery::FullRepair,
        quota: false,
        reopen: false,
        portable: false,
        mix: Mix::Effects,
    },
    Workload {
        name: "quota",
        threads: 4,
        keys: 10,
        log_size: 32 << 10,
        durability: Recovery::FullRepair,
        quota: true,
        reopen: false,
        portable: false,
        mix: Mix::Complete,
    },
    // The portable log path: group commit, then the smallest log across a reopen.
    Workload {
        name: "group-portable",
        threads: 8,
        keys: 10,
        log_size: 64 << 10,
        durability: Recovery::FullRepair,
        quota: false,
        reopen: false,
        portable: true,
        mix: Mix::Complete,
    },
    Workload {
        name: "wrap-portable",
        threads: 2,
        keys: 40,
        log_size: 16 << 10,
        durability: Recovery::FullRepair,
        quota: false,
        reopen: true,
        portable: true,
        mix: Mix::Complete,
    },
];

fn builder(workload: &Workload, clock: &ManualClock) -> StoreBuilder {
    let mut builder = Store::builder();
    builder
        .retention(RETENTION)
        .lease(LEASE)
        .max_batch(32)
        .log_size(workload.log_size)
        .recovery(workload.durability)
        .portable_log_sync(workload.portable)
        .clock(clock.clone());
    if workload.quota {
        builder.max_records(1_000_000);
    }
    builder
}

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Not a test on its own: the parent runs this binary under strace with `CHILD_ENV` set to
/// `<workload name>:<dir>`, and this function then runs the workload. Without the variable it
/// returns at once.
#[test]
fn syscall_child_process() -> Result<()> {
    let Some(spec) = std::env::var_os(CHILD_ENV) else {
        return Ok(());
    };
    let spec = spec.to_string_lossy().into_owned();
    let (name, dir) = spec.split_once(':').expect("workload:dir");
    let workload = WORKLOADS
        .iter()
        .find(|w| w.name == name)
        .expect("known workload");
    let dir = PathBuf::from(dir);
    let keys = workload.keys * env_number("SYSCALL_CRASH_SCALE", 1) as usize;
    let clock = ManualClock::new(Timestamp::from_millis(START));
    let phases: &[(usize, usize)] = if workload.reopen {
        &[(0, keys / 2), (keys / 2, keys)]
    } else {
        &[(0, keys)]
    };
    for &(from, to) in phases {
        let mut notes = open_notes(&dir);
        notes.note("try", 'O', "-", 0, 0);
        let store = builder(workload, &clock).open(dir.join("store.redb"))?;
        notes.note("ack", 'O', "-", 0, 0);
        std::thread::scope(|s| {
            for t in 0..workload.threads {
                let (store, clock, dir) = (&store, &clock, &dir);
                s.spawn(move || {
                    let mut notes = open_notes(dir);
                    for i in from..to {
                        let name = format!("{}-t{t}-{i}", workload.name);
                        run_key(store, clock, &mut notes, workload.mix, &name, i)
                            .expect("store call");
                    }
                });
            }
        });
        notes.note("try", 'X', "-", 0, 0);
        drop(store);
        notes.note("ack", 'X', "-", 0, 0);
    }
    Ok(())
}

#[derive(Debug, Default)]
struct Figures {
    workloads: usize,
    trace_lines: usize,
    file_calls: usize,
    points: usize,
    images: usize,
    duplicates: usize,
    pending_writes: usize,
    torn: usize,
    keys_checked: usize,
    /// Images of a crash before the first `Store::open` returned: opened, or refused as not a
    /// store (issue 16, item 6: a creation cut short; see the ignored test below).
    creation_opened: usize,
    creation_refused: Vec<String>,
    /// Negative controls: images that drop `O_DSYNC` log writes, which the check must fail.
    controls_caught: usize,
    failures: Vec<String>,
}

/// Which crash points of a trace to try.
#[derive(Debug, Clone, Copy)]
enum Points {
    /// This many, sampled (with the last line of the trace always among them).
    Sample(usize),
    /// Every point before the first `Store::open` returned.
    Creation,
}

fn run_all(points: Points) -> Figures {
    let seed = env_number("SYSCALL_CRASH_SEED", 0x5eed_cafe_f00d_d00d);
    let started = Instant::now();
    let mut figures = Figures::default();
    for workload in &WORKLOADS {
        check_workload(workload, points, seed, &mut figures);
    }
    println!(
        "syscall power loss (seed {seed:#x}): {} workloads, {} trace lines, {} store file calls, \
         {} crash points ({} writes pending at them), {} crash images ({} duplicates \
         skipped; {} torn writes in them), {} key checks; during creation: {} images opened, {} \
         refused; {} of {} negative controls caught; {} failures; {:.1} s",
        figures.workloads,
        figures.trace_lines,
        figures.file_calls,
        figures.points,
        figures.pending_writes,
        figures.images,
        figures.duplicates,
        figures.torn,
        figures.keys_checked,
        figures.creation_opened,
        figures.creation_refused.len(),
        figures.controls_caught,
        WORKLOADS.iter().filter(|w| !w.quota && !w.portable).count(),
        figures.failures.len(),
        started.elapsed().as_secs_f64()
    );
    figures
}

#[test]
fn real_io_power_loss_keeps_every_acknowledged_call() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let points = env_number("SYSCALL_CRASH_POINTS", 32) as usize;
    let figures = run_all(Points::Sample(points));
    assert!(
        figures.failures.is_empty(),
        "{} of {} crash images failed:\n{}",
        figures.failures.len(),
        figures.images,
        figures.failures.join("\n")
    );
}

/// Issue 16, item 6: a power cut while `Store::open` creates the file must leave a file that
/// opens, or one refused with a message that says it is a creation cut short (the message for
/// a file left empty, "… if it is a new file, delete it and the store will create it", does).
/// Before the fix such files were refused forever as "not an idempotency-store file (magic
/// number mismatch)" or "Not a redb database: magic number mismatch".
#[test]
fn real_io_power_loss_during_creation_leaves_an_openable_file() {
    if std::env::var_os(CHILD_ENV).is_some() {
        return;
    }
    let figures = run_all(Points::Creation);
    assert!(
        figures.failures.is_empty(),
        "{}",
        figures.failures.join("\n")
    );
    let misleading: Vec<&String> = figures
        .creation_refused
        .iter()
        .filter(|refusal| !refusal.contains("creat"))
        .collect();
    assert!(
        misleading.is_empty(),
        "{} of {} crash images taken while the file was created were refused without saying \
         so:\n{}",
        misleading.len(),
        figures.creation_refused.len(),
        misleading
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}
