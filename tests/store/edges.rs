//! Edges of the API that must answer with an error rather than hang or make a store that
//! cannot be reopened.

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Error, Fingerprint, Key, Response, Result, Store, redb};

use crate::common::disk::{FailingSyncs, PowerCut, SimDisk};

const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");

#[test]
fn log_size_is_bounded_at_creation_as_at_open() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    for bytes in [
        (1u64 << 40) + 4096,
        u64::MAX - 4095,
        8 << 10,
        (16 << 10) + 1,
    ] {
        let err = Store::builder()
            .log_size(bytes)
            .open(dir.path().join(format!("{bytes}.store")))
            .expect_err("out of range");
        assert!(
            matches!(&err, Error::InvalidConfig { reason } if reason.contains("1 TiB")),
            "{bytes}: {err}"
        );
        assert!(
            !dir.path().join(format!("{bytes}.store")).exists(),
            "{bytes}: a file was created for a refused setting"
        );
    }
    // The bounds themselves are accepted (the largest only checked, not created: 1 TiB).
    let store = Store::builder()
        .log_size(16 << 10)
        .open(dir.path().join("small.store"))?;
    drop(store);
    Store::builder()
        .log_size(16 << 10)
        .open(dir.path().join("small.store"))?;
    Ok(())
}

/// A `complete_with` effect runs while its thread holds the writer; a store call from it that
/// needs the writer must fail with `Reentrant` at once instead of waiting for itself.
#[test]
fn a_store_call_inside_complete_with_is_refused_not_a_deadlock() -> Result<()> {
    let store = Store::builder().open_in_memory()?;
    let fp = Fingerprint::of(["charge"]);
    let key = Key::new("charge-1")?;
    let Claim::Acquired(lease) = store.claim(&key, fp)? else {
        panic!("not acquired");
    };
    let Claim::Acquired(other) = store.claim(&Key::new("other")?, fp)? else {
        panic!("not acquired");
    };
    let mut seen = Vec::new();
    store.complete_with(&lease, Response::new(201, "charged"), |txn| {
        seen.push(("claim", store.claim(&Key::new("fresh")?, fp).err()));
        seen.push((
            "complete",
            store.complete(&other, Response::new(200, "x")).err(),
        ));
        seen.push(("stats", store.stats().err()));
        seen.push(("verify", store.verify().err()));
        seen.push(("sweep", store.sweep(10).err()));
        let nested =
            store.complete_with(
                &other,
                Response::new(200, "y"),
                |_| Ok::<_, redb::Error>(()),
            );
        seen.push(("complete_with", nested.err()));
        // Reads do not need the writer.
        assert!(store.lookup(&key)?.is_some());
        let ledger = |e: &dyn std::fmt::Display| Error::InvalidKey {
            reason: e.to_string(),
        };
        let mut table = txn.open_table(LEDGER).map_err(|e| ledger(&e))?;
        table.insert("charge-1", 4999).map_err(|e| ledger(&e))?;
        Ok::<_, Error>(())
    })??;
    for (call, err) in &seen {
        assert!(
            matches!(err, Some(Error::Reentrant)),
            "{call} inside an effect: {err:?}"
        );
    }
    assert_eq!(seen.len(), 6);
    // The effect and the completion landed, and the store works as usual afterwards.
    assert!(matches!(store.claim(&key, fp)?, Claim::Completed(_)));
    store.complete(&other, Response::new(200, "after"))?;
    assert!(store.stats().is_ok());
    Ok(())
}

/// The sweeper's waits after failures in a row double from 10 ms up to its interval (1 s):
/// its attempts start at 0, 10, 30, 70, 150, 310, 630, 1270, 2270, … ms at the earliest. A
/// busy machine only delays them, so the test bounds the time to the sixth failure from below
/// and the failures seen by a given moment from above; a fixed 10 ms wait fails both.
#[test]
fn a_failing_sweepers_backoff_grows() -> Result<()> {
    use std::time::{Duration, Instant};
    let disk = FailingSyncs::default();
    let failing = std::sync::Arc::clone(&disk.sim().faults.0);
    let store = std::sync::Arc::new(Store::builder().open_with_backend(disk)?);
    failing.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(
        store
            .claim(&Key::new("k")?, Fingerprint::of(["k"]))
            .is_err()
    );
    let interval = Duration::from_secs(1);
    // The earliest moment of each attempt, from the sweeper's start.
    let earliest: Vec<Duration> = std::iter::successors(
        Some((Duration::ZERO, Duration::from_millis(10))),
        |&(at, wait)| Some((at + wait, (wait * 2).min(interval))),
    )
    .map(|(at, _)| at)
    .take(64)
    .collect();
    let start = Instant::now();
    let sweeper = store.start_sweeper(interval, 64);
    while sweeper.errors() < 6 {
        assert!(start.elapsed() < Duration::from_secs(30), "no retries");
        std::thread::sleep(Duration::from_millis(1));
    }
    let sixth = start.elapsed();
    assert!(
        sixth >= earliest[5],
        "six failures in {sixth:?}: the waits did not grow (at the earliest {:?})",
        earliest[5]
    );
    std::thread::sleep(Duration::from_millis(1500).saturating_sub(sixth));
    let errors = sweeper.errors();
    let elapsed = start.elapsed();
    let possible = earliest.iter().filter(|&&at| at <= elapsed).count() as u64;
    assert!(
        errors <= possible,
        "{errors} failures in {elapsed:?}, at most {possible} with waits doubling to 1 s"
    );
    assert!(errors >= 6, "{errors}");
    drop(sweeper);
    Ok(())
}

/// A sweeper whose sweeps fail keeps retrying (with backoff) and shows the error, instead of
/// ending silently at the first one.
#[test]
fn a_failing_sweeper_retries_and_shows_its_error() -> Result<()> {
    let disk = FailingSyncs::default();
    let failing = std::sync::Arc::clone(&disk.sim().faults.0);
    let store = std::sync::Arc::new(Store::builder().open_with_backend(disk)?);
    failing.store(true, std::sync::atomic::Ordering::SeqCst);
    let failed = store.claim(&Key::new("k")?, Fingerprint::of(["k"]));
    assert!(matches!(failed, Err(Error::Storage { .. })), "{failed:?}");
    // Started after the fault, so that the claim (not a sweep) is what meets it first.
    let sweeper = store.start_sweeper(std::time::Duration::from_millis(40), 64);
    let start = std::time::Instant::now();
    while sweeper.errors() < 3 {
        assert!(
            start.elapsed() < std::time::Duration::from_secs(20),
            "the sweeper stopped retrying after {} errors",
            sweeper.errors()
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert!(
        matches!(sweeper.last_error(), Some(Error::Poisoned { .. })),
        "{:?}",
        sweeper.last_error()
    );
    let stopped = sweeper.stop();
    assert!(
        matches!(stopped, Err(Error::Poisoned { .. })),
        "{stopped:?}"
    );
    Ok(())
}

#[test]
fn a_mistyped_path_is_refused_when_create_if_missing_is_off() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("orders.store");
    let typo = dir.path().join("ordres.store");
    // The default creates, as Store::open always has.
    Store::open(&path)?.close()?;
    let err = Store::builder()
        .create_if_missing(false)
        .open(&typo)
        .expect_err("no file at the mistyped path");
    assert!(
        matches!(&err, Error::NotAStore { reason } if reason.contains("create_if_missing")),
        "{err}"
    );
    assert!(!typo.exists(), "the refused open created a file");
    // The existing file opens with the switch off.
    let store = Store::builder().create_if_missing(false).open(&path)?;
    let Claim::Acquired(lease) = store.claim(&Key::new("k")?, Fingerprint::of(["k"]))? else {
        panic!("not acquired");
    };
    store.complete(&lease, Response::new(200, "ok"))?;
    store.close()
}

/// A disk that loses power after `budget` writes and syncs: what it holds is what the syncs
/// covered, plus (with `keep`) every write handed over after the last one.
type Cut = SimDisk<PowerCut>;

/// A power cut at any write or sync while a store is being created leaves a file that either
/// opens as an empty store or is refused with a message saying its creation was cut short;
/// never redb's misleading "magic number mismatch" for a file no call ever used.
#[test]
fn a_creation_cut_short_is_named_as_such() -> Result<()> {
    let mut cut_short = 0;
    for budget in 0.. {
        let disk = Cut::of(Vec::new(), PowerCut::after(Some(budget)));
        let created = Store::builder()
            .log_size(16 << 10)
            .open_with_backend(disk.clone());
        if let Ok(store) = created {
            drop(store);
            assert!(budget > 0);
            println!("creation takes {budget} writes and syncs; {cut_short} cuts refused");
            break;
        }
        let (durable, live) = {
            let disk = disk.sim();
            (disk.durable.clone(), disk.live.clone())
        };
        for image in [durable, live] {
            let after = Cut::of(image, PowerCut::default());
            match Store::builder().log_size(16 << 10).open_with_backend(after) {
                Ok(store) => store.close()?,
                Err(Error::NotAStore { reason }) if reason.contains("creation was cut short") => {
                    cut_short += 1;
                }
                Err(other) => panic!("cut at {budget}: refused with {other}"),
            }
        }
    }
    assert!(
        cut_short > 0,
        "no cut landed between the layout and the header"
    );
    Ok(())
}
