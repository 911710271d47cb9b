//! Criterion benchmarks of the store's single-thread costs, on a real file with the default
//! durability (every write call waits for its `fdatasync`).
//!
//! `cargo bench --bench store`. The multi-thread figures and the comparison with SQLite are in
//! `examples/loadtest/` and `BENCHMARKS.md`.

use std::hint::black_box;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::Duration;

use criterion::{BatchSize, Criterion, SamplingMode, criterion_group, criterion_main};
use idempotency_store::IdempotencyStore;
use idempotency_store::redb::{self, ReadableTableMetadata, TableDefinition};
use idempotency_store::{Claim, Fingerprint, Key, Lease, ManualClock, Response, Store, Timestamp};

const BODY: [u8; 200] = [b'x'; 200];
const REPLAY_KEYS: u64 = 1_000;
const SWEEP_RECORDS: u64 = 100_000;
const RETENTION: Duration = Duration::from_secs(3600);
/// The effects benchmarks' ledger: key → amount.
const LEDGER: TableDefinition<&str, u64> = TableDefinition::new("ledger");
const T0: Timestamp = Timestamp::from_millis(1_800_000_000_000);

fn name(prefix: &str, i: u64) -> String {
    format!("{prefix}-{i:016x}")
}

fn fingerprint(name: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", name])
}

/// Claims and completes one fresh key; panics unless it was acquired.
fn pair(store: &Store, name: &str) {
    let key = Key::new(name).expect("valid key");
    let Claim::Acquired(lease) = store.claim(&key, fingerprint(name)).expect("claim") else {
        panic!("fresh key {name} not acquired");
    };
    store
        .complete(&lease, Response::new(200, BODY.to_vec()))
        .expect("complete");
}

/// Completes records `0..n` named `prefix-i` from many threads, so that group commit batches
/// them (a single thread would pay two fsyncs per record).
fn prefill(store: &Store, prefix: &str, n: u64) {
    let next = AtomicU64::new(0);
    thread::scope(|s| {
        for _ in 0..64 {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return;
                    }
                    pair(store, &name(prefix, i));
                }
            });
        }
    });
}

fn single_ops(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Store::open(dir.path().join("bench.redb")).expect("open");
    prefill(&store, "done", REPLAY_KEYS);
    let done: Vec<(Key, Fingerprint)> = (0..REPLAY_KEYS)
        .map(|i| {
            let n = name("done", i);
            (Key::new(&n).expect("valid key"), fingerprint(&n))
        })
        .collect();

    let mut group = c.benchmark_group("store");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));

    let mut fresh = 0u64;
    group.bench_function("pair_claim_complete_durable", |b| {
        b.iter(|| {
            fresh += 1;
            pair(&store, &name("fresh", fresh));
        });
    });

    let mut i = 0usize;
    group.bench_function("replay_claim", |b| {
        b.iter(|| {
            i = (i + 1) % done.len();
            let (key, fp) = &done[i];
            match store.claim(key, *fp).expect("claim") {
                Claim::Completed(replay) => black_box(replay),
                other => panic!("expected a replay, got {other:?}"),
            }
        });
    });

    group.bench_function("lookup", |b| {
        b.iter(|| {
            i = (i + 1) % done.len();
            black_box(store.lookup(&done[i].0).expect("lookup").expect("present"))
        });
    });
    group.finish();
}

/// Opens the store at `path` with a manual clock standing at `at`.
fn open_at(path: &Path, at: Timestamp) -> Store {
    Store::builder()
        .clock(ManualClock::new(at))
        .retention(RETENTION)
        .open(path)
        .expect("open")
}

fn sweep(c: &mut Criterion) {
    // One template file of 10^5 completed records, made once; every iteration sweeps a copy
    // of it, opened with the clock past the records' retention.
    let template_dir = tempfile::tempdir().expect("temp dir");
    let template = template_dir.path().join("template.redb");
    {
        let store = open_at(&template, T0);
        prefill(&store, "old", SWEEP_RECORDS);
    }
    let later = Timestamp::from_millis(T0.as_millis() + RETENTION.as_millis() as u64 + 1_000);

    let mut group = c.benchmark_group("store");
    group
        .sample_size(10)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    group.bench_function("sweep_all_100k_expired", |b| {
        b.iter_batched(
            || {
                let dir = tempfile::tempdir().expect("temp dir");
                let path = dir.path().join("bench.redb");
                std::fs::copy(&template, &path).expect("copy template");
                (dir, open_at(&path, later))
            },
            |(dir, store)| {
                assert_eq!(store.sweep_all().expect("sweep"), SWEEP_RECORDS);
                // Returned, so that closing and deleting happen outside the timing.
                (dir, store)
            },
            BatchSize::PerIteration,
        );
    });
    group.finish();
}

fn acquire(store: &Store, name: &str) -> Lease {
    let key = Key::new(name).expect("valid key");
    match store.claim(&key, fingerprint(name)).expect("claim") {
        Claim::Acquired(lease) => lease,
        other => panic!("fresh key {name} not acquired: {other:?}"),
    }
}

/// A payment on the fast path: claim, then a ledger row and the response in one batch.
fn pay_with_effect(store: &Store, name: String) {
    let lease = acquire(store, &name);
    store
        .complete_with_effects(&lease, Response::new(201, BODY.to_vec()), move |fx| {
            fx.insert(LEDGER, name.as_str(), 4999)
        })
        .expect("complete_with_effects")
        .expect("ledger row");
}

fn ledger_rows(store: &Store) -> u64 {
    store
        .read_with(|txn| -> Result<u64, redb::Error> {
            match txn.open_table(LEDGER) {
                Ok(table) => Ok(table.len()?),
                Err(redb::TableError::TableDoesNotExist(_)) => Ok(0),
                Err(other) => Err(other.into()),
            }
        })
        .expect("read_with")
        .expect("ledger length")
}

/// One thread's cost of an exactly-once payment on each path, and of `read_with` with and
/// without effect rows waiting in the overlay (it flushes them first; see `Store::read_with`).
fn effects(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = Store::builder()
        .effect_table(LEDGER)
        .open(dir.path().join("bench.redb"))
        .expect("open");
    let mut group = c.benchmark_group("effects");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    let mut fresh = 0u64;
    group.bench_function("payment_complete_with_effects_durable", |b| {
        b.iter(|| {
            fresh += 1;
            pay_with_effect(&store, name("fx", fresh));
        });
    });
    group.bench_function("payment_complete_with_durable", |b| {
        b.iter(|| {
            fresh += 1;
            let name = name("txn", fresh);
            let lease = acquire(&store, &name);
            store
                .complete_with(&lease, Response::new(201, BODY.to_vec()), |txn| {
                    txn.open_table(LEDGER)?.insert(name.as_str(), 4999)?;
                    Ok::<_, redb::Error>(())
                })
                .expect("complete_with")
                .expect("ledger row");
        });
    });
    ledger_rows(&store);
    group.bench_function("read_with_nothing_pending", |b| {
        b.iter(|| black_box(ledger_rows(&store)));
    });
    group.bench_function("read_with_one_effect_row_pending", |b| {
        b.iter_batched(
            || {
                fresh += 1;
                pay_with_effect(&store, name("pending", fresh));
            },
            |()| black_box(ledger_rows(&store)),
            BatchSize::PerIteration,
        );
    });
    group.bench_function("effect_row_one_effect_row_pending", |b| {
        b.iter_batched(
            || {
                fresh += 1;
                let name = name("row", fresh);
                pay_with_effect(&store, name.clone());
                name
            },
            |name| {
                let row = store.effect_row(LEDGER, name.as_str()).expect("effect_row");
                black_box(row.map(|r| r.value()).expect("the row"))
            },
            BatchSize::PerIteration,
        );
    });
    group.finish();
}

criterion_group!(benches, single_ops, sweep, effects);
criterion_main!(benches);
