//! `complete_with_effects`: the caller's rows share the group-commit batch of the stored
//! response, and commit with it or not at all.

use std::sync::{Arc, Barrier};

use idempotency_store::IdempotencyStore;
use idempotency_store::redb::{self, ReadableTable, ReadableTableMetadata, TableDefinition};
use idempotency_store::{Claim, Error, Fingerprint, Key, Lease, Response, Result, Store};

use crate::common::disk::SimDisk;

const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("ledger");
const BALANCE: TableDefinition<&str, u64> = TableDefinition::new("balance");
const OTHER: TableDefinition<&str, u64> = TableDefinition::new("other");

fn builder() -> idempotency_store::StoreBuilder {
    let mut builder = Store::builder();
    builder.effect_table(LEDGER).effect_table(BALANCE);
    builder
}

fn acquire(store: &Store, name: &str) -> Result<Lease> {
    match store.claim(&Key::new(name)?, Fingerprint::of([name]))? {
        Claim::Acquired(lease) => Ok(lease),
        other => panic!("{name}: expected Acquired, got {other:?}"),
    }
}

fn rows(store: &Store, table: TableDefinition<&str, u64>) -> Vec<(String, u64)> {
    store
        .read_with(|txn| -> std::result::Result<_, redb::Error> {
            let table = match txn.open_table(table) {
                Ok(table) => table,
                Err(redb::TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
                Err(err) => return Err(err.into()),
            };
            table
                .iter()?
                .map(|row| {
                    let (k, v) = row?;
                    Ok((k.value().to_owned(), v.value()))
                })
                .collect()
        })
        .expect("read")
        .expect("ledger")
}

fn replayed(store: &Store, name: &str) -> Result<Option<Vec<u8>>> {
    Ok(
        match store.claim(&Key::new(name)?, Fingerprint::of([name]))? {
            Claim::Completed(replay) => Some(replay.response.body),
            _ => None,
        },
    )
}

#[test]
fn rows_and_response_commit_together_and_survive_a_reopen() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    {
        let store = builder().open(&path)?;
        let lease = acquire(&store, "pay-1")?;
        let value =
            store.complete_with_effects(&lease, Response::new(201, "charged"), |fx| {
                fx.insert(LEDGER, "pay-1", 4999)?;
                let seen = fx.get(LEDGER, "pay-1")?.map(|v| v.value());
                Ok::<_, Error>(seen)
            })??;
        assert_eq!(value, Some(4999), "the effect reads its own write");
        assert_eq!(replayed(&store, "pay-1")?.as_deref(), Some(&b"charged"[..]));
        assert_eq!(rows(&store, LEDGER), [("pay-1".to_owned(), 4999)]);
        assert!(store.verify()?.is_clean());
    }
    let store = builder().open(&path)?;
    assert_eq!(rows(&store, LEDGER), [("pay-1".to_owned(), 4999)]);
    assert_eq!(replayed(&store, "pay-1")?.as_deref(), Some(&b"charged"[..]));
    Ok(())
}

#[test]
fn a_failing_effect_writes_nothing_and_keeps_the_lease() -> Result<()> {
    let store = builder().open_in_memory()?;
    let lease = acquire(&store, "pay-1")?;
    let outcome = store.complete_with_effects(&lease, Response::new(201, "charged"), |fx| {
        fx.insert(LEDGER, "pay-1", 4999)
            .map_err(|e| e.to_string())?;
        Err::<(), _>("card declined after the row was written".to_owned())
    })?;
    assert_eq!(
        outcome,
        Err("card declined after the row was written".to_owned())
    );
    assert!(
        rows(&store, LEDGER).is_empty(),
        "the declined row was written"
    );
    assert!(matches!(
        store.claim(&Key::new("pay-1")?, Fingerprint::of(["pay-1"]))?,
        Claim::InProgress { .. }
    ));
    // The lease still holds: the failure can be stored.
    store.complete(&lease, Response::new(402, "declined"))?;
    assert_eq!(
        replayed(&store, "pay-1")?.as_deref(),
        Some(&b"declined"[..])
    );
    Ok(())
}

#[test]
fn an_error_the_effect_ignored_fails_the_call_and_writes_nothing() -> Result<()> {
    let store = builder().open_in_memory()?;
    let lease = acquire(&store, "pay-1")?;
    let result = store.complete_with_effects(&lease, Response::new(201, "x"), |fx| {
        fx.insert(LEDGER, "pay-1", 1)?;
        // Not registered: the error is swallowed, but the call must still fail.
        let _ignored = fx.insert(OTHER, "pay-1", 1);
        Ok::<_, Error>(())
    });
    match result {
        Err(Error::EffectTable { table, reason }) => {
            assert_eq!(table, "other");
            assert!(reason.contains("effect_table"), "{reason}");
        }
        other => panic!("expected EffectTable, got {other:?}"),
    }
    assert!(rows(&store, LEDGER).is_empty());
    // Nothing was written and the lease still holds.
    store.complete_with_effects(&lease, Response::new(201, "x"), |fx| {
        fx.insert(LEDGER, "pay-1", 1)
    })??;
    assert_eq!(rows(&store, LEDGER), [("pay-1".to_owned(), 1)]);
    Ok(())
}

#[test]
fn a_table_with_other_types_is_refused() -> Result<()> {
    const WRONG: TableDefinition<&str, &str> = TableDefinition::new("ledger");
    let store = builder().open_in_memory()?;
    let lease = acquire(&store, "pay-1")?;
    let result = store.complete_with_effects(&lease, Response::new(201, "x"), |fx| {
        fx.insert(WRONG, "pay-1", "4999")
    });
    // The effect returned the error it met, so it comes back as the effect's own.
    assert!(
        matches!(result, Ok(Err(Error::EffectTable { .. }))),
        "{result:?}"
    );
    Ok(())
}

#[test]
fn a_lost_lease_runs_no_effect() -> Result<()> {
    let store = builder().open_in_memory()?;
    let lease = acquire(&store, "pay-1")?;
    store.release(&lease)?;
    let ran = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = Arc::clone(&ran);
    let result = store.complete_with_effects(&lease, Response::new(201, "x"), move |fx| {
        flag.store(true, std::sync::atomic::Ordering::SeqCst);
        fx.insert(LEDGER, "pay-1", 1)
    });
    assert!(matches!(result, Err(Error::LeaseLost)), "{result:?}");
    assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    assert!(rows(&store, LEDGER).is_empty());
    Ok(())
}

#[test]
fn a_panicking_effect_panics_its_caller_only() -> Result<()> {
    let store = builder().open_in_memory()?;
    let lease = acquire(&store, "pay-1")?;
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        store.complete_with_effects(&lease, Response::new(201, "x"), |fx| {
            fx.insert(LEDGER, "pay-1", 1)?;
            if fx.get(LEDGER, "pay-1")?.is_some() {
                panic!("the effect's own bug");
            }
            Ok::<_, Error>(())
        })
    }));
    let payload = caught.expect_err("the panic reaches the caller");
    assert_eq!(
        payload.downcast_ref::<&str>(),
        Some(&"the effect's own bug")
    );
    // Not poisoned, nothing written, the lease still holds.
    assert!(rows(&store, LEDGER).is_empty());
    store.complete_with_effects(&lease, Response::new(201, "x"), |fx| {
        fx.insert(LEDGER, "pay-1", 2)
    })??;
    assert_eq!(rows(&store, LEDGER), [("pay-1".to_owned(), 2)]);
    Ok(())
}

#[test]
fn a_store_call_from_an_effect_is_refused_not_deadlocked() -> Result<()> {
    let store = Arc::new(builder().open_in_memory()?);
    let lease = acquire(&store, "pay-1")?;
    let other = acquire(&store, "pay-2")?;
    let inner = Arc::clone(&store);
    let inside = store.complete_with_effects(&lease, Response::new(201, "x"), move |_| {
        Ok::<_, Error>(inner.complete(&other, Response::new(200, "y")))
    })??;
    assert!(matches!(inside, Err(Error::Reentrant)), "{inside:?}");
    Ok(())
}

/// Why an effect declined: its own reason, or a store error it met.
#[derive(Debug)]
enum Declined {
    Card,
    Store(Error),
}

impl From<Error> for Declined {
    fn from(err: Error) -> Self {
        Declined::Store(err)
    }
}

/// A read-modify-write of one balance from many threads: every effect must see the rows of
/// the effects before it, in its batch too, or increments are lost.
#[test]
fn concurrent_effects_see_each_others_rows() -> Result<()> {
    const THREADS: u64 = 16;
    const EACH: u64 = 40;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    let store = Arc::new(builder().open(&path)?);
    let start = Arc::new(Barrier::new(THREADS as usize));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (store, start) = (Arc::clone(&store), Arc::clone(&start));
            std::thread::spawn(move || -> Result<u64> {
                start.wait();
                let mut declined = 0;
                for i in 0..EACH {
                    let name = format!("t{t}-{i}");
                    let lease = acquire(&store, &name)?;
                    let decline = i % 5 == 0;
                    let row = name.clone();
                    let outcome = store.complete_with_effects(
                        &lease,
                        Response::new(201, name.clone()),
                        move |fx| {
                            let balance = fx.get(BALANCE, "total")?.map_or(0, |v| v.value());
                            fx.insert(BALANCE, "total", balance + 1)?;
                            fx.insert(LEDGER, row.as_str(), balance + 1)?;
                            if decline {
                                return Err(Declined::Card);
                            }
                            Ok(())
                        },
                    )?;
                    if let Err(why) = outcome {
                        if let Declined::Store(err) = why {
                            panic!("the effect met a store error: {err}");
                        }
                        declined += 1;
                        store.release(&lease)?;
                    }
                }
                Ok(declined)
            })
        })
        .collect();
    let declined: u64 = workers
        .into_iter()
        .map(|w| w.join().expect("worker"))
        .sum::<Result<u64>>()?;
    let charged = THREADS * EACH - declined;
    assert_eq!(declined, THREADS * EACH / 5);
    assert_eq!(rows(&store, BALANCE), [("total".to_owned(), charged)]);
    let ledger = rows(&store, LEDGER);
    assert_eq!(ledger.len() as u64, charged);
    let mut seen: Vec<u64> = ledger.iter().map(|(_, v)| *v).collect();
    seen.sort_unstable();
    assert_eq!(
        seen,
        (1..=charged).collect::<Vec<_>>(),
        "each charge saw the one before it"
    );
    for (name, _) in &ledger {
        assert_eq!(replayed(&store, name)?.as_deref(), Some(name.as_bytes()));
    }
    workers_done(store)?;
    let store = builder().open(&path)?;
    assert_eq!(rows(&store, LEDGER).len() as u64, charged);
    Ok(())
}

fn workers_done(store: Arc<Store>) -> Result<()> {
    Arc::try_unwrap(store)
        .map_err(|_| panic!("a worker still holds the store"))
        .and_then(Store::close)
}

#[test]
fn reads_see_rows_still_in_the_overlay() -> Result<()> {
    let store = builder().open_in_memory()?;
    for i in 0..10 {
        let name = format!("pay-{i}");
        let lease = acquire(&store, &name)?;
        store.complete_with_effects(&lease, Response::new(201, "ok"), move |fx| {
            fx.insert(LEDGER, name.as_str(), i)
        })??;
        assert_eq!(rows(&store, LEDGER).len() as u64, i + 1);
    }
    let len = store
        .read_with(|txn| -> std::result::Result<u64, redb::Error> {
            Ok(txn.open_table(LEDGER)?.len()?)
        })
        .expect("read")
        .expect("len");
    assert_eq!(len, 10);
    Ok(())
}

#[test]
fn removes_apply_and_reads_see_them() -> Result<()> {
    let store = builder().open_in_memory()?;
    let first = acquire(&store, "a")?;
    store.complete_with_effects(&first, Response::new(201, "ok"), |fx| {
        fx.insert(LEDGER, "x", 1)?;
        fx.insert(LEDGER, "y", 2)
    })??;
    let second = acquire(&store, "b")?;
    let seen = store.complete_with_effects(&second, Response::new(201, "ok"), |fx| {
        fx.remove(LEDGER, "x")?;
        Ok::<_, Error>((
            fx.get(LEDGER, "x")?.map(|v| v.value()),
            fx.get(LEDGER, "y")?.map(|v| v.value()),
        ))
    })??;
    assert_eq!(seen, (None, Some(2)));
    assert_eq!(rows(&store, LEDGER), [("y".to_owned(), 2)]);
    Ok(())
}

#[test]
fn effect_tables_may_not_take_the_stores_names() {
    const MINE: TableDefinition<&str, u64> = TableDefinition::new("idempotency_records");
    let result = Store::builder().effect_table(MINE).open_in_memory();
    assert!(
        matches!(result, Err(Error::InvalidConfig { .. })),
        "{result:?}"
    );
}

/// A file in memory whose bytes can be copied at any instant: a copy is what a SIGKILL at that
/// instant leaves (every write the process made, nothing it did not).
type Image = SimDisk;

fn copy(disk: &Image) -> Image {
    SimDisk::of(disk.sim().live.clone(), ())
}

/// Rows still only in the log at a crash are redone at open, which needs their table: an
/// open without it refuses the file with an error naming the table (it never drops the rows),
/// and an open with it serves them with their response.
#[test]
fn a_crash_image_with_logged_rows_needs_their_table() -> Result<()> {
    let disk = Image::default();
    let store = builder().open_with_backend(disk.clone())?;
    let lease = acquire(&store, "pay-1")?;
    store.complete_with_effects(&lease, Response::new(201, "charged"), |fx| {
        fx.insert(LEDGER, "pay-1", 4999)
    })??;
    let crashed = copy(&disk);
    store.close()?;

    match Store::builder().open_with_backend(copy(&crashed)) {
        Err(Error::EffectTable { table, reason }) => {
            assert_eq!(table, "ledger");
            assert!(reason.contains("effect_table"), "{reason}");
        }
        other => panic!("expected EffectTable, got {other:?}"),
    }
    let store = builder().open_with_backend(crashed)?;
    assert_eq!(rows(&store, LEDGER), [("pay-1".to_owned(), 4999)]);
    assert_eq!(replayed(&store, "pay-1")?.as_deref(), Some(&b"charged"[..]));
    Ok(())
}

/// `effect_row` reads through the overlay: a row waiting in memory is seen without a flush,
/// a removal hides it, and an unregistered table is refused.
#[test]
fn effect_row_reads_acknowledged_rows_through_the_overlay() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    {
        let store = builder().open(&path)?;
        assert!(store.effect_row(LEDGER, "a")?.is_none());
        for (name, amount) in [("a", 1), ("b", 2)] {
            let lease = acquire(&store, name)?;
            store.complete_with_effects(&lease, Response::new(201, "ok"), move |fx| {
                fx.insert(LEDGER, name, amount)
            })??;
        }
        let lease = acquire(&store, "c")?;
        store.complete_with_effects(&lease, Response::new(201, "ok"), |fx| {
            fx.remove(LEDGER, "a")
        })??;
        assert!(store.effect_row(LEDGER, "a")?.is_none(), "removed");
        assert_eq!(store.effect_row(LEDGER, "b")?.map(|v| v.value()), Some(2));
        assert!(matches!(
            store.effect_row(OTHER, "b"),
            Err(Error::EffectTable { .. })
        ));
    }
    let store = builder().open(&path)?;
    assert_eq!(store.effect_row(LEDGER, "b")?.map(|v| v.value()), Some(2));
    assert!(store.effect_row(LEDGER, "a")?.is_none());
    Ok(())
}
