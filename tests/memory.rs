//! Memory is bounded in bytes, not only in records: 64 threads completing 1 MiB responses
//! (the default `max_response_bytes`) keep the process's peak resident memory under a
//! documented bound (docs/durability.md, "Memory"). Linux only: it reads `VmHWM` from /proc/self/status.
//! One test in this binary, so that the peak is this workload's.

use std::sync::Arc;

use idempotency_store::{Claim, Fingerprint, Key, Response, Result, Store};

const THREADS: usize = 64;
const ROUNDS: usize = 1;
const BODY: usize = (1 << 20) - 4096;
/// The documented bound on peak RSS for this workload (docs/durability.md, "Memory"): the callers' own
/// 64 responses (64 MiB), at most 4 MiB of responses per batch with the store's copies of
/// them, overlay generations of at most 4 MiB (16 MiB before a batch writes them itself),
/// redb's cache and write buffer, and the test harness. Measured: 144 MiB.
const BOUND_MIB: u64 = 176;

#[cfg(target_os = "linux")]
fn peak_rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmHWM in kB");
    kib / 1024
}

#[cfg(target_os = "linux")]
#[test]
fn sixty_four_threads_of_one_mib_responses_stay_under_the_bound() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Arc::new(Store::open(dir.path().join("memory.store"))?);
    let before = peak_rss_mib();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let store = Arc::clone(&store);
            s.spawn(move || -> Result<()> {
                for round in 0..ROUNDS {
                    let name = format!("t{t}-r{round}");
                    let key = Key::new(&name)?;
                    let fp = Fingerprint::of([name.as_str()]);
                    let Claim::Acquired(lease) = store.claim(&key, fp)? else {
                        panic!("{name}: not acquired");
                    };
                    store.complete(&lease, Response::new(200, vec![t as u8; BODY]))?;
                }
                Ok(())
            });
        }
    });
    let peak = peak_rss_mib();
    for t in [0, THREADS - 1] {
        let name = format!("t{t}-r{}", ROUNDS - 1);
        assert!(matches!(
            store.claim(&Key::new(&name)?, Fingerprint::of([name.as_str()]))?,
            Claim::Completed(r) if r.response.body == vec![t as u8; BODY]
        ));
    }
    println!(
        "{THREADS} threads x {ROUNDS} x 1 MiB responses: peak RSS {peak} MiB (before the \
         workload {before} MiB; bound {BOUND_MIB} MiB)"
    );
    assert!(
        peak <= BOUND_MIB,
        "peak RSS {peak} MiB over the documented {BOUND_MIB} MiB"
    );
    Ok(())
}
