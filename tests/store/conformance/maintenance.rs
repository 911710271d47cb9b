//! Maintenance: sweep and stats.

use std::time::Duration;

use idempotency_store::{IdempotencyStore, Key, Response, Result};

use super::{Factory, LEASE, RETENTION, Settings, acquire, fp};

pub(super) fn sweep_deletes_only_expired_records_in_bounded_batches<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    for i in 0..10 {
        let lease = acquire(&store, &Key::new(&format!("old-{i}"))?, fp("a"));
        store.complete(&lease, Response::new(200, "x"))?;
    }
    let _crashed = acquire(&store, &Key::new("old-crashed")?, fp("a"));
    clock.advance(RETENTION);
    let live = Key::new("live")?;
    let lease = acquire(&store, &live, fp("a"));
    store.complete(&lease, Response::new(200, "y"))?;
    assert_eq!(store.sweep(0)?, 0);
    assert_eq!(store.sweep(3)?, 3);
    assert_eq!(store.stats()?.expired, 8);
    assert_eq!(store.sweep_all()?, 8);
    assert_eq!(store.sweep(100)?, 0);
    let stats = store.stats()?;
    assert_eq!(
        (stats.in_progress, stats.completed, stats.expired),
        (0, 1, 0)
    );
    assert!(store.lookup(&live)?.is_some());
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!((report.records, report.expiry_entries), (1, 1));
    Ok(())
}

pub(super) fn sweep_takes_the_oldest_expiry_first<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    for i in 0..4 {
        let key = Key::new(&format!("k{i}"))?;
        let lease = acquire(&store, &key, fp("a"));
        store.complete(&lease, Response::new(200, "x"))?;
        clock.advance(Duration::from_secs(1));
    }
    // k0 and k1 expired, k2 and k3 not yet.
    clock.advance(RETENTION - Duration::from_secs(3));
    assert_eq!(store.stats()?.expired, 2);
    assert_eq!(store.sweep(1)?, 1);
    assert_eq!(store.verify()?.records, 3);
    clock.advance(Duration::from_secs(1)); // k2 expires too
    assert_eq!(store.sweep(10)?, 2);
    assert_eq!(store.verify()?.records, 1);
    assert!(store.lookup(&Key::new("k3")?)?.is_some());
    Ok(())
}

pub(super) fn stats_count_records_by_state<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let empty = store.stats()?;
    assert_eq!(
        (
            empty.in_progress,
            empty.stuck,
            empty.completed,
            empty.expired
        ),
        (0, 0, 0, 0)
    );
    let _stuck = acquire(&store, &Key::new("stuck")?, fp("a"));
    let done = acquire(&store, &Key::new("done")?, fp("a"));
    store.complete(&done, Response::new(200, "x"))?;
    clock.advance(LEASE);
    let _live = acquire(&store, &Key::new("live")?, fp("a"));
    let stats = store.stats()?;
    assert_eq!(
        (
            stats.in_progress,
            stats.stuck,
            stats.completed,
            stats.expired
        ),
        (2, 1, 1, 0)
    );
    clock.advance(RETENTION);
    let stats = store.stats()?;
    assert_eq!(
        (
            stats.in_progress,
            stats.stuck,
            stats.completed,
            stats.expired
        ),
        (0, 0, 0, 3)
    );
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.records, 3);
    Ok(())
}
