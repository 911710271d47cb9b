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
//! `cargo test --test power_loss_syscalls` runs a short sample; `SYSCALL_CRASH_POINTS` (crash
//! points per workload, default 32), `SYSCALL_CRASH_SCALE` (multiplies the workloads' keys,
//! default 1), `SYSCALL_CRASH_RANDOM_IMAGES` (random images per point beside the five fixed
//! ones, default 4) and `SYSCALL_CRASH_SEED` make the long run (CONTRIBUTING.md, "Long runs"). Needs `strace`
//! (`.ci/run` installs it).

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use idempotency_store::IdempotencyStore;
use idempotency_store::{
    Claim, Key, ManualClock, Recovery, Result, Store, StoreBuilder, Timestamp,
};

#[path = "../syscalls/mod.rs"]
mod syscalls;
use syscalls::check::{self, LEDGER, Model, checkpoint_data, fingerprint, response_for};
use syscalls::image::{self, Fate, History, PAGE, SECTOR};
use syscalls::trace;

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

// ---------------------------------------------------------------- the traced child

/// The notes file: one `write(2)` per line, so a line is one call in the trace.
struct Notes(std::fs::File);

impl Notes {
    fn note(&mut self, kind: &str, op: char, key: &str, token: u64, value: u64) {
        let line = format!("{kind} {op} {key} {token} {value}\n");
        self.0.write_all(line.as_bytes()).expect("note");
    }
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

fn open_notes(dir: &Path) -> Notes {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("notes.txt"))
        .expect("notes file");
    Notes(file)
}

fn run_key(
    store: &Store,
    clock: &ManualClock,
    notes: &mut Notes,
    mix: Mix,
    name: &str,
    i: usize,
) -> Result<()> {
    clock.advance(Duration::from_millis(1));
    notes.note("try", 'A', name, 0, 0);
    let Claim::Acquired(mut lease) = store.claim(&Key::new(name)?, fingerprint(name))? else {
        panic!("{name}: a fresh key was not acquired");
    };
    let token = lease.token();
    notes.note("ack", 'A', name, token, lease.lease_until().as_millis());
    if mix == Mix::Leases {
        for n in 1..=2 {
            clock.advance(Duration::from_millis(3));
            notes.note("try", 'H', name, token, 0);
            let until = store.heartbeat(&mut lease)?;
            notes.note("ack", 'H', name, token, until.as_millis());
            notes.note("try", 'P', name, token, n);
            store.checkpoint(&mut lease, checkpoint_data(name, n))?;
            notes.note("ack", 'P', name, token, n);
        }
    }
    let settle = match mix {
        Mix::Complete => [0, 0, 0, 1, 2][i % 5],
        Mix::Leases => i % 3,
        Mix::Effects => 3 + i % 2,
    };
    match settle {
        0 | 4 => {
            notes.note("try", 'C', name, token, 0);
            store.complete(&lease, response_for(name, token))?;
            notes.note("ack", 'C', name, token, 0);
        }
        1 => {
            notes.note("try", 'R', name, token, 0);
            store.release(&lease)?;
            notes.note("ack", 'R', name, token, 0);
        }
        3 => {
            notes.note("try", 'W', name, token, 0);
            store
                .complete_with(&lease, response_for(name, token), |txn| {
                    txn.open_table(LEDGER)?.insert(name, token)?;
                    Ok::<(), idempotency_store::redb::Error>(())
                })?
                .expect("the ledger effect");
            notes.note("ack", 'W', name, token, 0);
        }
        // Left in progress: the lease outlives the run.
        _ => {}
    }
    Ok(())
}

// ---------------------------------------------------------------- the parent

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
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

/// Runs `workload` under strace in `dir` and returns the trace, parsed.
fn record(workload: &Workload, dir: &Path) -> trace::Trace {
    let exe = std::env::current_exe().expect("test binary");
    let log = dir.join("trace.txt");
    let status = Command::new("strace")
        .args(["-f", "-qq", "-y", "-xx", "-s", "67108864", "-o"])
        .arg(&log)
        .args([
            "-e",
            "trace=openat,open,creat,close,write,pwrite64,writev,pwritev,pwritev2,fdatasync,\
             fsync,sync_file_range,ftruncate,fallocate,dup,dup2,dup3,mmap,rename,renameat,\
             renameat2",
        ])
        .arg(&exe)
        .args([
            "--exact",
            "power_loss_syscalls::syscall_child_process",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, format!("{}:{}", workload.name, dir.display()))
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .status()
        .expect(
            "running strace: this test needs strace (`apt-get install strace`; .ci/run \
             installs it)",
        );
    assert!(
        status.success(),
        "{}: the traced workload failed: {status}",
        workload.name
    );
    let text = std::fs::read_to_string(&log).expect("trace");
    let store = dir.join("store.redb");
    let notes = dir.join("notes.txt");
    trace::parse(
        &text,
        store.to_str().expect("path"),
        notes.to_str().expect("path"),
    )
    .unwrap_or_else(|err| panic!("{}: reading the trace: {err}", workload.name))
}

/// The fates of the pending writes for image `variant` at one crash point.
fn fates(
    history: &History,
    pending: &[usize],
    variant: usize,
    rng: &mut Rng,
) -> Vec<(usize, Fate)> {
    let last = pending.len().saturating_sub(1);
    pending
        .iter()
        .enumerate()
        .map(|(n, &index)| {
            let (offset, len) = match &history.op(index).change {
                trace::Change::Data { offset, data } => (*offset, data.len() as u64),
                trace::Change::Resize { .. } => (0, 0),
            };
            let tear = |unit: u64, rng: &mut Rng| {
                let cuts = image::tears(offset, len, unit);
                match cuts.len() as u64 {
                    0 => Fate::Dropped,
                    k => Fate::Prefix(cuts[rng.below(k) as usize]),
                }
            };
            let fate = match variant {
                0 => Fate::Kept,
                1 => Fate::Dropped,
                // In-order write-back cut short: the oldest half landed.
                2 => {
                    if n < pending.len() / 2 {
                        Fate::Kept
                    } else {
                        Fate::Dropped
                    }
                }
                // Everything landed but the last write, torn at a sector or a page.
                3 if n == last => tear(SECTOR, rng),
                4 if n == last => tear(PAGE, rng),
                3 | 4 => Fate::Kept,
                // Random: odd variants keep or drop, even ones tear as well.
                v if v % 2 == 1 => {
                    if rng.next().is_multiple_of(2) {
                        Fate::Kept
                    } else {
                        Fate::Dropped
                    }
                }
                _ => match rng.below(5) {
                    0 => Fate::Kept,
                    1 => Fate::Dropped,
                    2 => tear(PAGE, rng),
                    3 => tear(SECTOR, rng),
                    _ => Fate::Sectors(rng.next()),
                },
            };
            // A resize lands or not; it cannot tear.
            let fate = match fate {
                Fate::Prefix(_) | Fate::Sectors(_) if len == 0 => Fate::Kept,
                fate => fate,
            };
            (index, fate)
        })
        .collect()
}

/// Which crash points of a trace to try.
#[derive(Debug, Clone, Copy)]
enum Points {
    /// This many, sampled (with the last line of the trace always among them).
    Sample(usize),
    /// Every point before the first `Store::open` returned.
    Creation,
}

/// The crash points to try, in increasing order, and how many there were to choose from: just
/// before and just after each call on the store file, and the end of the trace.
fn crash_points(
    history: &History,
    trace: &trace::Trace,
    calls: &[(usize, check::Call)],
    wanted: Points,
    rng: &mut Rng,
) -> (usize, Vec<usize>) {
    let mut candidates: Vec<usize> = history
        .points(&trace.barriers)
        .into_iter()
        .flat_map(|p| [p - 1, p])
        .chain([trace.lines])
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    candidates.sort_unstable();
    let mut points: Vec<usize> = match wanted {
        Points::Sample(n) if candidates.len() <= n => candidates.clone(),
        Points::Sample(n) => {
            let mut chosen: HashSet<usize> = HashSet::from([trace.lines]);
            while chosen.len() < n {
                chosen.insert(candidates[rng.below(candidates.len() as u64) as usize]);
            }
            chosen.into_iter().collect()
        }
        Points::Creation => {
            let opened = calls
                .iter()
                .find(|(_, call)| call.acked && call.op == 'O')
                .map_or(trace.lines, |(line, _)| *line);
            candidates
                .iter()
                .copied()
                .filter(|&p| p <= opened)
                .collect()
        }
    };
    points.sort_unstable();
    (candidates.len(), points)
}

fn check_workload(workload: &Workload, wanted: Points, seed: u64, figures: &mut Figures) {
    let dir = tempfile::tempdir().expect("tempdir");
    let dir_path = dir.path().canonicalize().expect("canonical tempdir");
    let trace = record(workload, &dir_path);
    let calls = check::calls(&trace.notes).expect("notes");
    let acks = calls.iter().filter(|(_, c)| c.acked).count();
    let mut history = History::new(trace.ops.clone(), &trace.barriers);
    let name_hash = blake3::hash(workload.name.as_bytes());
    let mut rng =
        Rng((seed ^ u64::from_le_bytes(name_hash.as_bytes()[..8].try_into().expect("8"))) | 1);
    let (candidates, points) = crash_points(&history, &trace, &calls, wanted, &mut rng);

    let crash_path = dir_path.join("crash.redb");
    let (mut images, mut duplicates) = (0, 0);
    for &point in &points {
        let model = Model::new(&calls, point);
        let (built, same) = check_point(
            workload,
            &mut history,
            point,
            &model,
            &crash_path,
            &mut rng,
            figures,
        );
        images += built;
        duplicates += same;
    }
    if trace.ops.iter().any(|op| op.dsync) {
        negative_control(workload, &trace, &calls, &crash_path, figures);
    }
    println!(
        "{}: {} trace lines, {} store file calls [{}], {} notes ({acks} acks); {} crash points \
         of {}, {images} images ({duplicates} duplicates skipped)",
        workload.name,
        trace.lines,
        trace.counts.values().sum::<usize>(),
        trace.summary(),
        calls.len(),
        points.len(),
        candidates,
    );
    check_directory_synced(workload, &trace);
    if workload.portable {
        assert_eq!(
            trace.dsync_opens, 0,
            "{}: an O_DSYNC descriptor on the portable path",
            workload.name
        );
    } else {
        assert!(
            trace.dsync_opens > 0,
            "{}: no O_DSYNC descriptor",
            workload.name
        );
    }
    figures.workloads += 1;
    figures.trace_lines += trace.lines;
    figures.file_calls += trace.counts.values().sum::<usize>();
    figures.points += points.len();
    figures.images += images;
    figures.duplicates += duplicates;
}

/// Creating the store must make the file's name durable before the open returns: an `fsync`
/// of its directory after the `open` that created the file and before the first `ack O` note.
/// Otherwise a power cut may lose the directory entry, and the next open would create an empty
/// store (the crash images keep the file whatever happens to the directory, so they cannot
/// show this).
fn check_directory_synced(workload: &Workload, trace: &trace::Trace) {
    let created = trace
        .created
        .unwrap_or_else(|| panic!("{}: no open created the store file", workload.name));
    let opened = trace
        .notes
        .iter()
        .find(|note| note.text.starts_with("ack O "))
        .map(|note| note.start)
        .unwrap_or_else(|| panic!("{}: the store never opened", workload.name));
    assert!(
        trace
            .dir_syncs
            .iter()
            .any(|&line| created < line && line < opened),
        "{}: no sync of the directory between the file's creation (trace line {created}) and \
         the open's return (line {opened}); directory syncs at {:?}",
        workload.name,
        trace.dir_syncs
    );
}

/// Builds the images of one crash point, checks each distinct one and tallies the outcomes;
/// returns the images checked and the duplicates skipped.
fn check_point(
    workload: &Workload,
    history: &mut History,
    point: usize,
    model: &Model,
    crash_path: &Path,
    rng: &mut Rng,
    figures: &mut Figures,
) -> (usize, usize) {
    let images_per_point = 5 + env_number("SYSCALL_CRASH_RANDOM_IMAGES", 4) as usize;
    let pending = history.pending(point);
    figures.pending_writes += pending.len();
    let mut seen = HashSet::new();
    let (mut images, mut duplicates) = (0, 0);
    for variant in 0..images_per_point {
        let fates = fates(history, &pending, variant, rng);
        let image = history.image(point, |index| {
            fates
                .iter()
                .find(|(i, _)| *i == index)
                .map_or(Fate::Kept, |(_, f)| *f)
        });
        if !seen.insert(blake3::hash(&image)) {
            duplicates += 1;
            continue;
        }
        images += 1;
        figures.torn += fates
            .iter()
            .filter(|(_, f)| matches!(f, Fate::Prefix(_) | Fate::Sectors(_)))
            .count();
        let at = format!(
            "{} at trace line {point} (image {variant}, {} pending writes)",
            workload.name,
            pending.len()
        );
        match check_image(workload, crash_path, &image, model) {
            Ok(keys) if model.opened => figures.keys_checked += keys,
            Ok(_) => figures.creation_opened += 1,
            Err(Failure::Refused(err)) if !model.opened => {
                figures.creation_refused.push(format!("{at}: {err}"));
            }
            Err(Failure::Refused(err) | Failure::Check(err)) => {
                let kept = keep_evidence(
                    crash_path,
                    &format!("{}-{point}-{variant}", workload.name),
                    &image,
                );
                figures.failures.push(format!("{at}: {err} ({kept})"));
            }
        }
    }
    (images, duplicates)
}

/// Copies a failing image and its trace out of the temporary directory; says where.
fn keep_evidence(crash_path: &Path, name: &str, image: &[u8]) -> String {
    let dir = std::env::temp_dir().join("idempotency-power-loss-failures");
    let trace = crash_path.with_file_name("trace.txt");
    let kept = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(dir.join(format!("{name}.redb")), image))
        .and_then(|()| std::fs::copy(&trace, dir.join(format!("{name}.trace.txt"))));
    match kept {
        Ok(_) => format!("image and trace kept in {}", dir.display()),
        Err(err) => format!("could not keep the image: {err}"),
    }
}

/// The check proves something only if it fails where a write that the store relies on is
/// lost: an image whose disk ignored `O_DSYNC` (log writes durable only at the next
/// `fdatasync`), cut just after the acknowledgement of a call whose log write no barrier has
/// covered yet, must fail.
fn negative_control(
    workload: &Workload,
    trace: &trace::Trace,
    calls: &[(usize, check::Call)],
    path: &Path,
    figures: &mut Figures,
) {
    let forgetful: Vec<trace::FileOp> = trace
        .ops
        .iter()
        .cloned()
        .map(|op| trace::FileOp { dsync: false, ..op })
        .collect();
    let mut history = History::new(forgetful, &trace.barriers);
    let covered =
        |from: usize, to: usize| trace.barriers.iter().any(|b| b.start > from && b.end < to);
    let point = trace
        .ops
        .iter()
        .rev()
        .filter(|op| op.dsync)
        .find_map(|op| {
            let ack = calls
                .iter()
                .find(|(line, call)| *line > op.end && call.acked && !"OXW".contains(call.op))?;
            (!covered(op.end, ack.0)).then_some(ack.0 + 1)
        })
        .unwrap_or_else(|| panic!("{}: no log write to drop", workload.name));
    let image = history.image(point, |_| Fate::Dropped);
    let model = Model::new(calls, point);
    match check_image(workload, path, &image, &model) {
        Err(Failure::Check(_)) => figures.controls_caught += 1,
        other => panic!(
            "{}: an image without the log writes since the last sync passed the check \
             ({other:?}): the check has no teeth",
            workload.name
        ),
    }
}

/// Why an image failed: `Refused` when the store did not open at all.
#[derive(Debug)]
enum Failure {
    Refused(String),
    Check(String),
}

/// Opens `image` as a store and checks it against `model`; returns the keys checked.
fn check_image(
    workload: &Workload,
    path: &Path,
    image: &[u8],
    model: &Model,
) -> std::result::Result<usize, Failure> {
    let checked = open_image(workload, path, image)
        .map_err(Failure::Refused)
        .and_then(|store| check_store(&store, model).map_err(Failure::Check));
    std::fs::remove_file(path).map_err(|e| Failure::Check(e.to_string()))?;
    checked
}

fn open_image(
    workload: &Workload,
    path: &Path,
    image: &[u8],
) -> std::result::Result<Store, String> {
    std::fs::write(path, image).map_err(|e| e.to_string())?;
    let clock = ManualClock::new(Timestamp::from_millis(START));
    builder(workload, &clock)
        .open(path)
        .map_err(|e| format!("recovery failed: {e}"))
}

fn check_store(store: &Store, model: &Model) -> std::result::Result<usize, String> {
    let report = store.verify().map_err(|e| format!("verify failed: {e}"))?;
    if !report.is_clean() {
        return Err(format!("verify: {report:?}"));
    }
    let keys = model.check(store, LEASE.as_millis() as u64)?;
    // The recovered store takes new writes.
    let key = Key::new("after-crash").map_err(|e| e.to_string())?;
    let outcome = store
        .claim(&key, fingerprint("after-crash"))
        .map_err(|e| format!("a claim after recovery failed: {e}"))?;
    let Claim::Acquired(lease) = outcome else {
        return Err(format!("a fresh claim after recovery got {outcome:?}"));
    };
    store
        .complete(&lease, response_for("after-crash", lease.token()))
        .map_err(|e| format!("a completion after recovery failed: {e}"))?;
    Ok(keys)
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
