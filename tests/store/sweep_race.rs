//! Claims racing a sweep of their own expired keys: each key gets one answer (one fresh lease,
//! every other claim sees it in progress), never a replay of the expired record, and the
//! sweep never deletes the fresh record.

use std::collections::HashMap;
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{
    Claim, Fingerprint, Key, Lease, ManualClock, RecordState, Response, Result, Store, Timestamp,
};

const RETENTION: Duration = Duration::from_secs(3600);
const CONTESTED: usize = 300;
const FILLER: usize = 600;
const CLAIMERS: usize = 4;
const ITERATIONS: usize = 10;

fn fp(name: &str) -> Fingerprint {
    Fingerprint::of(["POST", name])
}

/// A store on a file with a small log, so the race also meets log switches and merges.
fn store(dir: &std::path::Path, clock: &ManualClock) -> Result<Store> {
    Store::builder()
        .retention(RETENTION)
        .lease(Duration::from_secs(600))
        .log_size(64 << 10)
        .clock(clock.clone())
        .open(dir.join("store.redb"))
}

/// Completes every key in `names`, from 8 threads so the calls share batches.
fn prefill(store: &Store, names: &[String]) -> Result<()> {
    thread::scope(|s| {
        let workers: Vec<_> = names
            .chunks(names.len().div_ceil(8))
            .map(|chunk| {
                s.spawn(move || -> Result<()> {
                    for name in chunk {
                        let Claim::Acquired(lease) = store.claim(&Key::new(name)?, fp(name))?
                        else {
                            panic!("a fresh key was not acquired");
                        };
                        store.complete(&lease, Response::new(200, "old"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        workers
            .into_iter()
            .try_for_each(|w| w.join().expect("prefill thread"))
    })
}

#[test]
fn claims_racing_a_sweep_of_their_keys_get_one_answer_each() -> Result<()> {
    for iteration in 0..ITERATIONS {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
        let store = Arc::new(store(dir.path(), &clock)?);
        let contested: Vec<String> = (0..CONTESTED)
            .map(|i| format!("c{iteration}-{i}"))
            .collect();
        // Filler keys expire around the contested ones, so the sweep is mid-way when claims
        // meet it.
        let all: Vec<String> = (0..CONTESTED + FILLER)
            .map(|i| match i % 3 {
                0 => contested[i / 3].clone(),
                _ => format!("f{iteration}-{i}"),
            })
            .collect();
        prefill(&store, &all)?;
        clock.advance(RETENTION + Duration::from_millis(1));

        let start = Arc::new(Barrier::new(CLAIMERS + 1));
        let answers = thread::scope(|s| -> Result<Vec<Vec<(String, Claim)>>> {
            let sweeper = s.spawn(|| -> Result<u64> {
                start.wait();
                let mut swept = 0;
                for _ in 0..3 {
                    swept += store.sweep_all()?;
                }
                Ok(swept)
            });
            let claimers: Vec<_> = (0..CLAIMERS)
                .map(|t| {
                    let (contested, start) = (&contested, Arc::clone(&start));
                    let store = &store;
                    s.spawn(move || -> Result<Vec<(String, Claim)>> {
                        start.wait();
                        let mut got = Vec::new();
                        // Each claimer starts at a different key, so claims of one key
                        // arrive at different moments of the sweep.
                        for i in 0..CONTESTED {
                            let name = &contested[(i + t * CONTESTED / CLAIMERS) % CONTESTED];
                            got.push((name.clone(), store.claim(&Key::new(name)?, fp(name))?));
                        }
                        Ok(got)
                    })
                })
                .collect();
            let swept = sweeper.join().expect("sweeper")?;
            assert!(swept >= FILLER as u64, "the filler was swept: {swept}");
            claimers
                .into_iter()
                .map(|c| c.join().expect("claimer"))
                .collect()
        })?;

        let mut winners: HashMap<String, Lease> = HashMap::new();
        for (name, claim) in answers.into_iter().flatten() {
            match claim {
                Claim::Acquired(lease) => {
                    assert!(
                        winners.insert(name.clone(), lease).is_none(),
                        "{name} acquired twice (iteration {iteration})"
                    );
                }
                Claim::InProgress { .. } => {}
                other => panic!("{name}: an expired key answered {other:?}"),
            }
        }
        assert_eq!(winners.len(), CONTESTED, "every key acquired once");
        // The fresh records survive the sweeps: each lease still holds and completes.
        for (name, lease) in &winners {
            store.complete(lease, Response::new(201, name.as_str()))?;
        }
        assert_eq!(store.sweep_all()?, 0, "nothing expired is left");
        for name in &contested {
            let view = store
                .lookup(&Key::new(name)?)?
                .expect("the completed record");
            let RecordState::Completed { response, .. } = view.state else {
                panic!("{name} is not completed");
            };
            assert_eq!(response.body, name.as_bytes());
        }
        let report = store.verify()?;
        assert!(report.is_clean(), "{report:?}");
        assert_eq!(report.records, CONTESTED as u64);
    }
    Ok(())
}
