//! `complete_with`: the caller's own rows and the stored response commit together or not at
//! all.

use std::sync::Arc;

use idempotency_store::redb::{self, ReadableTableMetadata};
use idempotency_store::{Claim, Error, Fingerprint, Key, Lease, Response, Result, Store};

const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");

fn acquire(store: &Store, name: &str) -> Result<Lease> {
    match store.claim(&Key::new(name)?, Fingerprint::of([name]))? {
        Claim::Acquired(lease) => Ok(lease),
        other => panic!("{name}: expected Acquired, got {other:?}"),
    }
}

fn charge(
    txn: &redb::WriteTransaction,
    name: &str,
    amount: u64,
) -> std::result::Result<(), redb::Error> {
    txn.open_table(LEDGER)?.insert(name, amount)?;
    Ok(())
}

/// Ledger rows, read after reopening the store (what survived is what a restart sees).
fn ledger_rows(path: &std::path::Path) -> u64 {
    let store = Store::open(path).expect("reopen for the ledger");
    store
        .read_with(|txn| {
            Ok::<u64, redb::Error>(txn.open_table(LEDGER).map_or(0, |t| t.len().expect("len")))
        })
        .expect("read")
        .expect("ledger")
}

#[test]
fn success_commits_the_effect_and_the_response_together() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    {
        let store = Store::open(&path)?;
        let lease = acquire(&store, "pay-1")?;
        store
            .complete_with(&lease, Response::new(201, "charged"), |txn| {
                charge(txn, "pay-1", 4999)
            })?
            .expect("effect");
        assert!(matches!(
            store.claim(&Key::new("pay-1")?, Fingerprint::of(["pay-1"]))?,
            Claim::Completed(r) if r.response.body == b"charged"
        ));
        assert!(store.verify()?.is_clean());
    }
    assert_eq!(ledger_rows(&path), 1);
    Ok(())
}

#[test]
fn a_failing_effect_leaves_neither_its_rows_nor_the_response() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    {
        let store = Store::open(&path)?;
        let lease = acquire(&store, "pay-1")?;
        let outcome = store.complete_with(&lease, Response::new(201, "charged"), |txn| {
            charge(txn, "pay-1", 4999).map_err(|e| e.to_string())?;
            Err("card declined after the row was written".to_owned())
        })?;
        assert_eq!(
            outcome,
            Err("card declined after the row was written".to_owned())
        );
        assert!(matches!(
            store.claim(&Key::new("pay-1")?, Fingerprint::of(["pay-1"]))?,
            Claim::InProgress { .. }
        ));
        // The lease still holds: the caller can store the failure or release.
        store.release(&lease)?;
        assert!(store.verify()?.is_clean());
    }
    assert_eq!(
        ledger_rows(&path),
        0,
        "the failed effect's row was committed"
    );
    Ok(())
}

#[test]
fn a_lost_lease_does_not_run_the_effect() -> Result<()> {
    let store = Store::builder()
        .lease(std::time::Duration::from_millis(1))
        .open_in_memory()?;
    let lease = acquire(&store, "pay-1")?;
    store.release(&lease)?;
    let mut ran = false;
    let result = store.complete_with(&lease, Response::new(201, "x"), |_| {
        ran = true;
        Ok::<_, ()>(())
    });
    assert!(matches!(result, Err(Error::LeaseLost)));
    assert!(!ran, "the effect ran for a lost lease");
    Ok(())
}

#[test]
fn many_threads_mix_complete_with_and_ordinary_calls() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    let (charged, failed) = {
        let store = Arc::new(Store::open(&path)?);
        let workers: Vec<_> = (0..8)
            .map(|t| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || -> Result<(u64, u64)> {
                    let (mut charged, mut failed) = (0, 0);
                    for i in 0..60 {
                        let name = format!("t{t}-{i}");
                        let lease = acquire(&store, &name)?;
                        if t % 2 == 0 {
                            // Ordinary completions beside the transactional ones.
                            store.complete(&lease, Response::new(200, name.clone()))?;
                            continue;
                        }
                        let fail = i % 3 == 0;
                        let outcome = store.complete_with(
                            &lease,
                            Response::new(201, name.clone()),
                            |txn| {
                                charge(txn, &name, 100).map_err(|e| e.to_string())?;
                                if fail {
                                    Err("declined".to_owned())
                                } else {
                                    Ok(())
                                }
                            },
                        )?;
                        if outcome.is_ok() {
                            charged += 1;
                        } else {
                            failed += 1;
                            store.release(&lease)?;
                        }
                    }
                    Ok((charged, failed))
                })
            })
            .collect();
        let mut totals = (0, 0);
        for worker in workers {
            let (c, f) = worker.join().expect("worker")?;
            totals = (totals.0 + c, totals.1 + f);
        }
        let stats = store.stats()?;
        assert_eq!(stats.completed, 4 * 60 + totals.0);
        assert_eq!(stats.in_progress, 0);
        assert!(store.verify()?.is_clean());
        totals
    };
    assert_eq!((charged, failed), (4 * 40, 4 * 20));
    assert_eq!(
        ledger_rows(&path),
        charged,
        "exactly one ledger row per stored charge"
    );
    Ok(())
}
