//! Concurrency: one winner per key, and fencing tokens in acquisition order under contention.

use std::sync::Barrier;
use std::time::Duration;

use idempotency_store::{Claim, Clock, IdempotencyStore, Key, Response, Result};

use super::{Factory, LEASE, RETENTION, Settings, acquire, fp};

const RACERS: usize = 4;

pub(super) fn concurrent_claims_have_exactly_one_winner<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let keys: Vec<Key> = (0..25)
        .map(|i| Key::new(&format!("race-{i}")))
        .collect::<Result<_>>()?;
    // Round 1: fresh keys. Round 2: the same keys after their leases lapsed (takeover).
    for (round, want_attempt) in [(1, 1), (2, 2)] {
        let start = Barrier::new(RACERS);
        let won: Vec<Vec<(usize, u32)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..RACERS)
                .map(|_| {
                    let (store, keys, start) = (&store, &keys, &start);
                    s.spawn(move || {
                        start.wait();
                        let mut won = Vec::new();
                        for (i, key) in keys.iter().enumerate() {
                            match store.claim(key, fp("a")) {
                                Ok(Claim::Acquired(lease)) => won.push((i, lease.attempt())),
                                Ok(Claim::InProgress { .. }) => {}
                                other => panic!("round {round}: unexpected {other:?}"),
                            }
                        }
                        won
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("racer panicked"))
                .collect()
        });
        let mut per_key = vec![0; keys.len()];
        for (i, attempt) in won.into_iter().flatten() {
            assert_eq!(attempt, want_attempt, "round {round}, key {i}");
            per_key[i] += 1;
        }
        assert!(
            per_key.iter().all(|&n| n == 1),
            "round {round}: winners per key {per_key:?}"
        );
        clock.advance(LEASE);
    }
    Ok(())
}

pub(super) fn expired_keys_are_reclaimed_once_while_sweeps_run<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let keys: Vec<Key> = (0..24)
        .map(|i| Key::new(&format!("old-{i}")))
        .collect::<Result<_>>()?;
    for key in &keys {
        let lease = acquire(&store, key, fp("a"));
        store.complete(&lease, Response::new(200, "old"))?;
    }
    clock.advance(RETENTION);
    // Claimers race for the expired keys while a sweeper deletes them in small batches.
    let start = Barrier::new(RACERS + 1);
    let (won, swept) = std::thread::scope(|s| {
        let claimers: Vec<_> = (0..RACERS)
            .map(|r| {
                let (store, keys, start) = (&store, &keys, &start);
                s.spawn(move || {
                    start.wait();
                    let mut won = Vec::new();
                    // Each claimer walks the keys from another starting point.
                    for n in 0..keys.len() {
                        let i = (n + r * keys.len() / RACERS) % keys.len();
                        match store.claim(&keys[i], fp("b")) {
                            Ok(Claim::Acquired(lease)) => won.push((i, lease.attempt())),
                            Ok(Claim::InProgress { attempt: 1, .. }) => {}
                            other => panic!("old-{i}: unexpected {other:?}"),
                        }
                    }
                    won
                })
            })
            .collect();
        let sweeper = {
            let (store, start) = (&store, &start);
            s.spawn(move || {
                start.wait();
                let mut swept = 0;
                for _ in 0..12 {
                    swept += store.sweep(3).expect("sweep");
                }
                swept
            })
        };
        let won: Vec<(usize, u32)> = claimers
            .into_iter()
            .flat_map(|h| h.join().expect("claimer panicked"))
            .collect();
        (won, sweeper.join().expect("sweeper panicked"))
    });
    let mut per_key = vec![0; keys.len()];
    for (i, attempt) in won {
        assert_eq!(attempt, 1, "old-{i} reclaimed as a takeover");
        per_key[i] += 1;
    }
    assert!(
        per_key.iter().all(|&n| n == 1),
        "winners per key {per_key:?}"
    );
    let stats = store.stats()?;
    assert_eq!((stats.in_progress, stats.expired), (keys.len() as u64, 0));
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.records, keys.len() as u64, "{swept} swept");
    Ok(())
}

/// One acquisition of the hot key, logged while its lease was held.
#[derive(Debug)]
struct Grant {
    token: u64,
    /// The store's time of the grant (`lease_until - lease`).
    granted_at: u64,
    /// The clock just before its holder released it.
    released_after: u64,
}

/// The race that broke PostgreSQL's claim (issue 21): claimers hammer one key, and each winner
/// logs its lease while holding it, then releases it at once, with the clock moving. As leases
/// are exclusive, the log is in acquisition order: tokens must strictly increase along it, and
/// no lease may begin before the previous holder released (a claim that took its token and
/// time before it won the key, then landed after another claimer's whole acquire-and-release,
/// breaks both).
pub(super) fn tokens_increase_and_leases_follow_releases_under_contention<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    const CLAIMERS: usize = 8;
    // Claimers go on until the log holds GRANTS leases: on a loaded machine one holder may be
    // descheduled while the others spin through their attempts, so a fixed number of rounds
    // would leave too few grants to check. MAX_ATTEMPTS only stops a store that never grants.
    const GRANTS: usize = 300;
    const MAX_ATTEMPTS: usize = 20_000;
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("hot")?;
    let log = std::sync::Mutex::new(Vec::<Grant>::new());
    let start = Barrier::new(CLAIMERS);
    std::thread::scope(|s| {
        for _ in 0..CLAIMERS {
            let (store, clock, key, log, start) = (&store, &clock, &key, &log, &start);
            s.spawn(move || {
                start.wait();
                for _ in 0..MAX_ATTEMPTS {
                    if log.lock().expect("log").len() >= GRANTS {
                        break;
                    }
                    clock.advance(Duration::from_millis(1));
                    let lease = match store.claim(key, fp("a")) {
                        Ok(Claim::Acquired(lease)) => lease,
                        Ok(Claim::InProgress { .. }) => continue,
                        other => panic!("unexpected {other:?}"),
                    };
                    let granted_at = lease.lease_until().as_millis() - LEASE.as_millis() as u64;
                    let mut log = log.lock().expect("log");
                    log.push(Grant {
                        token: lease.token(),
                        granted_at,
                        released_after: clock.now().as_millis(),
                    });
                    drop(log);
                    clock.advance(Duration::from_millis(1));
                    store.release(&lease).expect("the holder releases");
                }
            });
        }
    });
    let log = log.into_inner().expect("log");
    assert!(log.len() >= GRANTS, "only {} grants", log.len());
    for pair in log.windows(2) {
        assert!(
            pair[0].token < pair[1].token,
            "the key's tokens went down in acquisition order: {pair:?}"
        );
        assert!(
            pair[1].granted_at >= pair[0].released_after,
            "a lease began before the previous holder released: {pair:?}"
        );
    }
    Ok(())
}
