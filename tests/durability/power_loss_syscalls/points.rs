//! The parent's side, first half: recording a workload under strace, and choosing the crash
//! points and the fates of the pending writes at each.

use std::collections::HashSet;
use std::path::Path;
use std::process::{Command, Stdio};

use super::syscalls::check;
use super::syscalls::image::{self, Fate, History, PAGE, SECTOR};
use super::syscalls::trace;
use super::{CHILD_ENV, Points, Workload};
use crate::common::Rng;

/// Runs `workload` under strace in `dir` and returns the trace, parsed.
pub(super) fn record(workload: &Workload, dir: &Path) -> trace::Trace {
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
pub(super) fn fates(
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

/// The crash points to try, in increasing order, and how many there were to choose from: just
/// before and just after each call on the store file, and the end of the trace.
pub(super) fn crash_points(
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
