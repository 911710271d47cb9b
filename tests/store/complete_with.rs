//! `complete_with`: the caller's own rows and the stored response commit together or not at
//! all.

use std::sync::Arc;

use idempotency_store::redb::{self, ReadableTableMetadata};
use idempotency_store::{
    Claim, Error, Fingerprint, IdempotencyStore, Key, Lease, Response, Result, Store,
};

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
    // The release loses the lease; a short lease would instead let a slow group commit answer
    // the first claim with InProgress (its documented lapse rule) and fail the setup.
    let store = Store::builder().open_in_memory()?;
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

/// The same promises on PostgreSQL: the caller's statements and the response share one
/// transaction. Needs `IDEMPOTENCY_PG_URL` (skipped with a printed reason without it, failed
/// under `CI=true`).
#[cfg(feature = "postgres")]
mod postgres_backend {
    use std::time::Duration;

    use idempotency_store::pg::postgres::{self, Transaction};
    use idempotency_store::{
        Claim, Error, Fingerprint, IdempotencyStore, Key, Lease, ManualClock, RecordState,
        Response, Result, Timestamp, pg::PgStore,
    };

    /// A schema of its own with a `ledger` table, dropped before and after.
    struct Db {
        url: String,
        schema: String,
    }

    impl Db {
        fn fresh(test: &str) -> Option<Db> {
            let url = crate::common::pg::url()?;
            let db = Db {
                url,
                schema: format!("effects_{test}_{}", std::process::id()),
            };
            db.admin(&format!(
                "DROP SCHEMA IF EXISTS \"{0}\" CASCADE; CREATE SCHEMA \"{0}\"; \
                 CREATE TABLE \"{0}\".ledger (key text NOT NULL, amount bigint NOT NULL)",
                db.schema
            ));
            Some(db)
        }

        fn admin(&self, sql: &str) {
            crate::common::pg::admin(&self.url, sql);
        }

        fn open(&self, clock: &ManualClock, lease: Duration, retention: Duration) -> PgStore {
            PgStore::builder()
                .schema(self.schema.as_str())
                .lease(lease)
                .retention(retention)
                .clock(clock.clone())
                .pool_size(2)
                .connect(&self.url)
                .expect("connect")
        }

        fn ledger_rows(&self, store: &PgStore) -> i64 {
            let sql = format!("SELECT count(*) FROM \"{}\".ledger", self.schema);
            store
                .read_with(|tx| tx.query_one(sql.as_str(), &[])?.try_get(0))
                .expect("read")
                .expect("count")
        }

        fn charge(&self, tx: &mut Transaction<'_>, key: &str) -> Result<(), postgres::Error> {
            let sql = format!(
                "INSERT INTO \"{}\".ledger (key, amount) VALUES ($1, 4999)",
                self.schema
            );
            tx.execute(sql.as_str(), &[&key]).map(drop)
        }
    }

    impl Drop for Db {
        fn drop(&mut self) {
            self.admin(&format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema
            ));
        }
    }

    fn clock() -> ManualClock {
        ManualClock::new(Timestamp::from_millis(1_700_000_000_000))
    }

    fn acquire(store: &PgStore, name: &str) -> Result<Lease> {
        match store.claim(&Key::new(name)?, Fingerprint::of([name]))? {
            Claim::Acquired(lease) => Ok(lease),
            other => panic!("{name}: expected Acquired, got {other:?}"),
        }
    }

    const LEASE: Duration = Duration::from_secs(60);
    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn success_commits_the_rows_and_the_response_together() -> Result<()> {
        let Some(db) = Db::fresh("success") else {
            return Ok(());
        };
        let store = db.open(&clock(), LEASE, DAY);
        let lease = acquire(&store, "pay-1")?;
        store
            .complete_with(&lease, Response::new(201, "charged"), |tx| {
                db.charge(tx, "pay-1")
            })?
            .expect("effect");
        assert!(matches!(
            store.claim(&Key::new("pay-1")?, Fingerprint::of(["pay-1"]))?,
            Claim::Completed(r) if r.response.body == b"charged"
        ));
        assert_eq!(db.ledger_rows(&store), 1);
        assert!(store.verify()?.is_clean());
        Ok(())
    }

    #[test]
    fn a_failing_closure_leaves_no_row_and_no_response() -> Result<()> {
        let Some(db) = Db::fresh("closure_error") else {
            return Ok(());
        };
        let store = db.open(&clock(), LEASE, DAY);
        let lease = acquire(&store, "pay-1")?;
        let outcome = store.complete_with(&lease, Response::new(201, "charged"), |tx| {
            db.charge(tx, "pay-1").map_err(|e| e.to_string())?;
            Err("card declined after the row was written".to_owned())
        })?;
        assert_eq!(
            outcome,
            Err("card declined after the row was written".to_owned())
        );
        assert_eq!(
            db.ledger_rows(&store),
            0,
            "the failed effect's row was committed"
        );
        let view = store.lookup(&Key::new("pay-1")?)?.expect("record");
        assert!(
            matches!(view.state, RecordState::InProgress { .. }),
            "a response was stored: {view:?}"
        );
        // The lease still holds: the caller can store the failure or release.
        store.release(&lease)?;
        assert_eq!(store.lookup(&Key::new("pay-1")?)?, None);
        assert!(store.verify()?.is_clean());
        Ok(())
    }

    #[test]
    fn a_lease_lost_before_the_call_runs_nothing() -> Result<()> {
        let Some(db) = Db::fresh("lost_before") else {
            return Ok(());
        };
        let clock = clock();
        let store = db.open(&clock, LEASE, DAY);
        let lease = acquire(&store, "pay-1")?;
        clock.advance(LEASE);
        let newer = acquire(&store, "pay-1")?;
        assert_eq!(newer.attempt(), 2);
        let mut ran = false;
        let result = store.complete_with(&lease, Response::new(201, "x"), |tx| {
            ran = true;
            db.charge(tx, "pay-1")
        });
        assert!(matches!(result, Err(Error::LeaseLost)), "{result:?}");
        assert!(!ran, "the effect ran for a lost lease");
        assert_eq!(db.ledger_rows(&store), 0);
        // The newer attempt still holds the key and completes.
        store
            .complete_with(&newer, Response::new(201, "by attempt 2"), |tx| {
                db.charge(tx, "pay-1")
            })?
            .expect("effect");
        assert_eq!(db.ledger_rows(&store), 1);
        Ok(())
    }

    #[test]
    fn a_lease_lost_while_the_closure_runs_rolls_its_rows_back() -> Result<()> {
        let Some(db) = Db::fresh("lost_during") else {
            return Ok(());
        };
        let clock = clock();
        let store = db.open(&clock, LEASE, LEASE);
        let lease = acquire(&store, "pay-1")?;
        // The record expires while the effect runs: the fenced store of the response fails.
        let result = store.complete_with(&lease, Response::new(201, "x"), |tx| {
            db.charge(tx, "pay-1")?;
            clock.advance(LEASE);
            Ok::<_, postgres::Error>(())
        });
        assert!(matches!(result, Err(Error::LeaseLost)), "{result:?}");
        assert_eq!(db.ledger_rows(&store), 0, "the effect outlived its lease");
        assert_eq!(
            store.lookup(&Key::new("pay-1")?)?,
            None,
            "expired, not completed"
        );
        Ok(())
    }

    #[test]
    fn a_failed_statement_the_closure_ignored_commits_nothing() -> Result<()> {
        let Some(db) = Db::fresh("ignored_error") else {
            return Ok(());
        };
        let store = db.open(&clock(), LEASE, DAY);
        let lease = acquire(&store, "pay-1")?;
        let result = store.complete_with(&lease, Response::new(201, "x"), |tx| {
            db.charge(tx, "pay-1")?;
            // Fails and aborts the transaction; the closure swallows the error.
            let _ = tx.execute("SELECT 1/0", &[]);
            Ok::<_, postgres::Error>(())
        });
        assert!(matches!(result, Err(Error::Storage { .. })), "{result:?}");
        assert_eq!(db.ledger_rows(&store), 0);
        let view = store.lookup(&Key::new("pay-1")?)?.expect("record");
        assert!(matches!(view.state, RecordState::InProgress { .. }));
        Ok(())
    }
}
