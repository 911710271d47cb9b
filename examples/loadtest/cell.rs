//! Running a cell: threads, warm-up, the measurement window, and the disk's `fdatasync` rate.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::Res;
use crate::systems::System;
use crate::tools::{Lat, Rng, err, percentiles};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Work {
    Pairs,
    Replay,
    Payments,
}

/// What one kind of worker did inside the window.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) ops: u64,
    pub(crate) latencies_ns: Vec<u64>,
}

pub(crate) struct CellResult {
    pub(crate) pairs: Option<(f64, Option<Lat>)>,
    pub(crate) replay: Option<f64>,
}

/// Runs `plan` (work kind, thread count) against `sys`: a warm-up, then a window of `secs`.
/// Counts operations completing inside the window; records pair latencies.
pub(crate) fn run_cell(sys: &dyn System, plan: &[(Work, usize)], secs: f64) -> Res<CellResult> {
    let total: usize = plan.iter().map(|(_, n)| n).sum();
    let warmup = Duration::from_secs_f64((secs / 6.0).clamp(0.2, 1.0));
    let window = Duration::from_secs_f64(secs);
    let ready = Barrier::new(total + 1);
    let go = Barrier::new(total + 1);
    let bounds: Mutex<Option<(Instant, Instant)>> = Mutex::new(None);
    let abort = AtomicBool::new(false);
    let results = thread::scope(|s| {
        let mut handles = Vec::new();
        let mut thread_id = 0;
        for &(work, n) in plan {
            for _ in 0..n {
                let (ready, go, bounds, abort) = (&ready, &go, &bounds, &abort);
                let id = thread_id;
                thread_id += 1;
                let handle = thread::Builder::new()
                    .stack_size(512 << 10)
                    .spawn_scoped(s, move || -> Res<(Work, Tally)> {
                        let client = sys.client(id);
                        ready.wait();
                        go.wait();
                        let mut client = client?;
                        let (start, end) = bounds
                            .lock()
                            .map_err(|_| "poisoned".to_owned())?
                            .ok_or("no window")?;
                        let mut tally = Tally::default();
                        loop {
                            let t0 = Instant::now();
                            if t0 >= end || abort.load(Ordering::Relaxed) {
                                return Ok((work, tally));
                            }
                            let result = match work {
                                Work::Pairs => client.pair(),
                                Work::Replay => client.replay(),
                                Work::Payments => client.payment(),
                            };
                            if let Err(e) = result {
                                abort.store(true, Ordering::Relaxed);
                                return Err(e);
                            }
                            let t1 = Instant::now();
                            if t1 >= start && t1 <= end {
                                tally.ops += 1;
                                if work != Work::Replay {
                                    tally.latencies_ns.push((t1 - t0).as_nanos() as u64);
                                }
                            }
                        }
                    })
                    .map_err(|e| err("spawning a thread", e));
                handles.push(handle);
            }
        }
        ready.wait();
        let now = Instant::now();
        if let Ok(mut b) = bounds.lock() {
            *b = Some((now + warmup, now + warmup + window));
        }
        go.wait();
        handles
            .into_iter()
            .map(|h| match h?.join() {
                Ok(r) => r,
                Err(_) => Err("a worker panicked".to_owned()),
            })
            .collect::<Vec<Res<(Work, Tally)>>>()
    });
    let mut pairs: Option<Tally> = None;
    let mut replay: Option<Tally> = None;
    for r in results {
        let (work, tally) = r?;
        // A cell runs one kind of write, so payments take the pairs' slot.
        let slot = match work {
            Work::Pairs | Work::Payments => &mut pairs,
            Work::Replay => &mut replay,
        };
        let acc = slot.get_or_insert_with(Tally::default);
        acc.ops += tally.ops;
        acc.latencies_ns.extend(tally.latencies_ns);
    }
    Ok(CellResult {
        pairs: pairs.map(|t| (t.ops as f64 / secs, percentiles(t.latencies_ns))),
        replay: replay.map(|t| t.ops as f64 / secs),
    })
}

/// Pages of 4 KiB that a one-operation commit of this store writes (measured with strace: 9
/// pages plus a 320-byte header at offset 0).
pub(crate) const COMMIT_PAGES: u64 = 9;

/// `pwrite`s then `fdatasync`, in a loop, on a fresh 1 MiB file: with `pages == 0`, 100 bytes at
/// offset 0 (the disk's bound on commits); otherwise a 320-byte header at 0 plus `pages` pages
/// at scattered offsets, the shape of one small redb commit.
pub(crate) fn fdatasync_rate(dir: &Path, secs: f64, pages: u64) -> Res<(f64, Option<Lat>)> {
    const SPAN: u64 = 256;
    let path = dir.join(format!("fdatasync-{pages}.bin"));
    let file = File::create(&path).map_err(|e| err("create", e))?;
    file.write_all_at(&vec![0u8; (SPAN * 4096) as usize], 0)
        .map_err(|e| err("pwrite", e))?;
    file.sync_all().map_err(|e| err("fsync", e))?;
    let small = [7u8; 100];
    let header = [7u8; 320];
    let page = [9u8; 4096];
    let mut rng = Rng::new(pages);
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut lat = Vec::new();
    let start = Instant::now();
    while Instant::now() < end {
        let t0 = Instant::now();
        if pages == 0 {
            file.write_all_at(&small, 0).map_err(|e| err("pwrite", e))?;
        } else {
            for _ in 0..pages {
                let at = 1 + rng.below(SPAN as usize - 1) as u64;
                file.write_all_at(&page, at * 4096)
                    .map_err(|e| err("pwrite", e))?;
            }
            file.write_all_at(&header, 0)
                .map_err(|e| err("pwrite", e))?;
        }
        file.sync_data().map_err(|e| err("fdatasync", e))?;
        lat.push(t0.elapsed().as_nanos() as u64);
    }
    let rate = lat.len() as f64 / start.elapsed().as_secs_f64();
    Ok((rate, percentiles(lat)))
}
