//! How a store on a file moves between its log's halves: with the flush thread idle, a batch
//! leaves a nearly full half before its entry would not fit (`engine::handle::SWITCH_EARLY`),
//! so that switch does not wait for the thread; and it merges after enough deletions without a
//! log entry (`engine::generation::Unlogged`), which fill no half.

use std::time::Duration;

use crate::api::clock::{ManualClock, Timestamp};
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::Claim;
use crate::api::response::Response;
use crate::api::store::IdempotencyStore;
use crate::error::Result;
use crate::store::Store;

#[test]
fn with_the_flush_thread_idle_the_log_leaves_a_half_before_it_is_full() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::builder()
        .log_size(16 << 10)
        .open(dir.path().join("store.redb"))?;
    let mut switches = 0;
    for i in 0..400 {
        let (start, pos, end) = store.engine.log_at();
        let claim = store.claim(&Key::new(&format!("key-{i}"))?, Fingerprint::of(["r"]))?;
        assert!(matches!(claim, Claim::Acquired(_)), "key-{i}: {claim:?}");
        // Waits for the flush thread to finish what it was given, and collects its report.
        store.stats()?;
        let (new_start, new_pos, _) = store.engine.log_at();
        if new_start != start {
            switches += 1;
            let entry = new_pos - new_start;
            assert!(
                end - pos >= entry,
                "switch {switches}: the half had {} bytes left and the {entry}-byte entry went to \
                 the other half: the batch switched because its entry did not fit, not early",
                end - pos
            );
            assert!(
                (pos - start) * 8 >= (end - start) * 7,
                "switch {switches}: the half was only {pos}/{end} full"
            );
        }
    }
    assert!(switches >= 3, "only {switches} switches in 400 claims");
    Ok(())
}

/// The merges during a sweep of 400 expired records with `bound` set as the deletions without
/// a log entry that make a merge due (`None`: the default).
fn merges_during_a_sweep(bound: Option<usize>) -> Result<u64> {
    let dir = tempfile::tempdir().expect("tempdir");
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let open = || {
        Store::builder()
            .clock(clock.clone())
            .retention(Duration::from_secs(60))
            .open(dir.path().join("store.redb"))
    };
    let store = open()?;
    for i in 0..400 {
        let claim = store.claim(&Key::new(&format!("key-{i}"))?, Fingerprint::of(["r"]))?;
        let Claim::Acquired(lease) = claim else {
            panic!("key-{i}: {claim:?}");
        };
        store.complete(&lease, Response::new(200, "done"))?;
    }
    store.close()?;
    clock.advance(Duration::from_secs(61));
    let store = open()?;
    if let Some(bound) = bound {
        store.engine.set_unlogged_bound(bound);
    }
    let merges = || store.metrics().engine.map_or(0, |e| e.merges);
    let before = merges();
    assert_eq!(store.sweep_all()?, 400);
    // Waits for the flush thread's merge and collects its report.
    store.stats()?;
    Ok(merges() - before)
}

/// A sweep's deletions take no room in the log (`Tables::delete_expired`), so a store that
/// only sweeps would fill no half and never merge, and redb would reuse none of the pages its
/// commits without a sync free; past a bound of such deletions the next batch merges.
#[test]
fn deletions_without_a_log_entry_bring_a_merge_once_enough_pile_up() -> Result<()> {
    assert_eq!(
        merges_during_a_sweep(None)?,
        0,
        "400 deletions filled the log or reached the default bound"
    );
    let merges = merges_during_a_sweep(Some(100))?;
    assert!(merges >= 2, "{merges} merges for 400 deletions at 100 each");
    Ok(())
}
