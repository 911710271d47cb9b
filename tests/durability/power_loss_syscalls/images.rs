//! The parent's side, second half: building the crash images of a workload's trace and
//! checking a store recovered from each against the acknowledged calls.

use std::collections::HashSet;
use std::path::Path;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Key, ManualClock, Store, Timestamp};

use super::points::{crash_points, fates, record};
use super::syscalls::check::{self, Model, fingerprint, response_for};
use super::syscalls::image::{Fate, History};
use super::syscalls::trace;
use super::{Figures, LEASE, Points, START, Workload, builder, env_number};
use crate::common::Rng;

pub(super) fn check_workload(
    workload: &Workload,
    wanted: Points,
    seed: u64,
    figures: &mut Figures,
) {
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
