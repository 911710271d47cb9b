//! Storage quotas: new keys fail closed when full; in-progress records are never evicted;
//! completed ones only when the user opts in. Every test runs on the redb store (a file) and,
//! with `--features postgres`, on PostgreSQL (a fresh schema per test; needs
//! `IDEMPOTENCY_PG_URL`, skipped with a printed reason without it, failed under `CI=true`).

use std::time::Duration;

use idempotency_store::{
    Claim, Error, Fingerprint, IdempotencyStore, Key, ManualClock, Response, Result, Store,
    Timestamp, WhenFull,
};

/// The quota settings a test asks a backend for.
#[derive(Debug, Clone, Default)]
struct Quota {
    max_records: Option<u64>,
    max_bytes: Option<u64>,
    evict: bool,
    retention: Option<Duration>,
    clock: Option<ManualClock>,
}

/// Storage that stores can be opened on, one after another (a file, a schema).
trait Backend {
    type Store: IdempotencyStore;
    fn open(&self, quota: &Quota) -> Result<Self::Store>;
}

struct RedbFile(tempfile::TempDir);

impl Backend for RedbFile {
    type Store = Store;
    fn open(&self, quota: &Quota) -> Result<Store> {
        let mut builder = Store::builder();
        if let Some(n) = quota.max_records {
            builder.max_records(n);
        }
        if let Some(n) = quota.max_bytes {
            builder.max_bytes(n);
        }
        if quota.evict {
            builder.when_full(WhenFull::EvictOldestCompleted);
        }
        if let Some(retention) = quota.retention {
            builder.retention(retention);
        }
        if let Some(clock) = &quota.clock {
            builder.clock(clock.clone());
        }
        builder.open(self.0.path().join("q.redb"))
    }
}

fn redb() -> RedbFile {
    RedbFile(tempfile::tempdir().expect("tempdir"))
}

fn fp() -> Fingerprint {
    Fingerprint::of(["req"])
}

fn fill<S: IdempotencyStore>(store: &S, n: usize, complete: bool) -> Result<()> {
    for i in 0..n {
        let Claim::Acquired(lease) = store.claim(&Key::new(&format!("k{i}"))?, fp())? else {
            panic!("k{i} not acquired while filling");
        };
        if complete {
            store.complete(&lease, Response::new(200, vec![b'x'; 100]))?;
        }
    }
    Ok(())
}

fn a_full_store_refuses_new_keys_but_serves_existing_ones<B: Backend>(backend: B) -> Result<()> {
    let store = backend.open(&Quota {
        max_records: Some(10),
        ..Quota::default()
    })?;
    fill(&store, 10, true)?;
    match store.claim(&Key::new("one-more")?, fp()) {
        Err(Error::QuotaExceeded { limit, used, max }) => {
            assert_eq!((limit, used, max), ("max_records", 10, 10));
        }
        other => panic!("expected QuotaExceeded, got {other:?}"),
    }
    assert_eq!(
        store.lookup(&Key::new("one-more")?)?,
        None,
        "nothing written"
    );
    // Replays of stored keys still work, and so does the rest of the API.
    assert!(matches!(
        store.claim(&Key::new("k3")?, fp())?,
        Claim::Completed(_)
    ));
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    Ok(())
}

fn expired_records_make_room_before_a_claim_is_refused<B: Backend>(backend: B) -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(1_000));
    let store = backend.open(&Quota {
        max_records: Some(5),
        retention: Some(Duration::from_secs(10)),
        clock: Some(clock.clone()),
        ..Quota::default()
    })?;
    fill(&store, 5, true)?;
    clock.advance(Duration::from_secs(10));
    assert!(matches!(
        store.claim(&Key::new("new")?, fp())?,
        Claim::Acquired(_)
    ));
    assert_eq!(store.stats()?.completed, 0);
    assert!(store.verify()?.is_clean());
    Ok(())
}

fn eviction_takes_the_oldest_completed_never_in_progress<B: Backend>(backend: B) -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(1_000));
    let store = backend.open(&Quota {
        max_records: Some(4),
        evict: true,
        clock: Some(clock.clone()),
        ..Quota::default()
    })?;
    // Two in progress first (they expire first in the index), then two completed.
    for name in ["busy-1", "busy-2"] {
        let Claim::Acquired(_lease) = store.claim(&Key::new(name)?, fp())? else {
            panic!()
        };
    }
    for name in ["done-old", "done-new"] {
        clock.advance(Duration::from_secs(1));
        let Claim::Acquired(lease) = store.claim(&Key::new(name)?, fp())? else {
            panic!()
        };
        store.complete(&lease, Response::new(200, name))?;
    }
    assert!(matches!(
        store.claim(&Key::new("new-1")?, fp())?,
        Claim::Acquired(_)
    ));
    assert_eq!(
        store.lookup(&Key::new("done-old")?)?,
        None,
        "the oldest completed goes"
    );
    assert!(store.lookup(&Key::new("done-new")?)?.is_some());
    assert!(matches!(
        store.claim(&Key::new("new-2")?, fp())?,
        Claim::Acquired(_)
    ));
    assert_eq!(store.lookup(&Key::new("done-new")?)?, None);
    // Only in-progress records are left: eviction stops and the store fails closed.
    assert!(matches!(
        store.claim(&Key::new("new-3")?, fp()),
        Err(Error::QuotaExceeded { .. })
    ));
    for name in ["busy-1", "busy-2", "new-1", "new-2"] {
        assert!(
            store.lookup(&Key::new(name)?)?.is_some(),
            "{name} was evicted"
        );
    }
    assert!(store.verify()?.is_clean());
    Ok(())
}

fn a_byte_quota_refuses_new_keys_and_never_refuses_a_completion<B: Backend>(
    backend: B,
) -> Result<()> {
    let store = backend.open(&Quota {
        max_bytes: Some(2_000),
        ..Quota::default()
    })?;
    let mut leases = Vec::new();
    for i in 0..5 {
        let Claim::Acquired(lease) = store.claim(&Key::new(&format!("k{i}"))?, fp())? else {
            panic!()
        };
        leases.push(lease);
    }
    // Completions push usage past the limit: they are accepted (the work already ran).
    for lease in &leases {
        store.complete(lease, Response::new(200, vec![0u8; 500]))?;
    }
    match store.claim(&Key::new("more")?, fp()) {
        Err(Error::QuotaExceeded {
            limit: "max_bytes",
            used,
            max: 2_000,
        }) => assert!(used > 2_000),
        other => panic!("expected a byte quota error, got {other:?}"),
    }
    assert!(store.verify()?.is_clean());
    Ok(())
}

fn usage_counters_survive_reopen_and_deletes<B: Backend>(backend: B) -> Result<()> {
    let quota = Quota {
        max_records: Some(3),
        ..Quota::default()
    };
    {
        let store = backend.open(&quota)?;
        fill(&store, 3, false)?;
    }
    let store = backend.open(&quota)?;
    assert!(matches!(
        store.claim(&Key::new("x")?, fp()),
        Err(Error::QuotaExceeded { .. })
    ));
    let Claim::InProgress { .. } = store.claim(&Key::new("k0")?, fp())? else {
        panic!()
    };
    assert!(store.verify()?.is_clean());
    Ok(())
}

on_both_backends! {
    redb: super::redb(),
    postgres(schema = super::pg::fresh): schema;
    a_full_store_refuses_new_keys_but_serves_existing_ones,
    expired_records_make_room_before_a_claim_is_refused,
    eviction_takes_the_oldest_completed_never_in_progress,
    a_byte_quota_refuses_new_keys_and_never_refuses_a_completion,
    usage_counters_survive_reopen_and_deletes,
}

#[cfg(feature = "postgres")]
mod pg {
    use idempotency_store::{Result, WhenFull, pg::PgStore};

    use super::{Backend, Quota};

    pub use crate::common::pg::Schema;

    /// A schema for one quota test, dropped before and after.
    pub fn fresh(test: &str) -> Option<Schema> {
        Schema::fresh("quota", test)
    }

    impl Schema {
        pub(super) fn builder(&self, quota: &Quota) -> idempotency_store::pg::PgStoreBuilder {
            let mut builder = self.store_builder();
            if let Some(n) = quota.max_records {
                builder.max_records(n);
            }
            if let Some(n) = quota.max_bytes {
                builder.max_bytes(n);
            }
            if quota.evict {
                builder.when_full(WhenFull::EvictOldestCompleted);
            }
            if let Some(retention) = quota.retention {
                builder.retention(retention);
            }
            if let Some(clock) = &quota.clock {
                builder.clock(clock.clone());
            }
            builder
        }
    }

    impl Backend for Schema {
        type Store = PgStore;
        fn open(&self, quota: &Quota) -> Result<PgStore> {
            self.builder(quota).connect(&self.url)
        }
    }
}

/// PostgreSQL only: quotas per scope, counting records written before quotas were turned on
/// or by stores without a quota, and exact counters under concurrent writers.
#[cfg(feature = "postgres")]
mod postgres_only {
    use std::sync::Arc;

    use idempotency_store::{Claim, Error, IdempotencyStore, Key, Response, Result, pg::PgStore};

    use super::pg::Schema;
    use super::{Quota, fp};

    fn claim_in(store: &PgStore, scope: &str, name: &str) -> Result<Claim> {
        store.claim(&Key::scoped(scope, name)?, fp())
    }

    #[test]
    fn per_scope_quotas_limit_each_scope_on_its_own() -> Result<()> {
        let Some(schema) = Schema::fresh("quota", "per_scope") else {
            return Ok(());
        };
        let quota = Quota {
            max_records: Some(3),
            ..Quota::default()
        };
        let store = schema
            .builder(&quota)
            .per_scope_quotas(true)
            .connect(&schema.url)?;
        for i in 0..3 {
            assert!(matches!(
                claim_in(&store, "tenant-a", &format!("k{i}"))?,
                Claim::Acquired(_)
            ));
        }
        match claim_in(&store, "tenant-a", "k3") {
            Err(Error::QuotaExceeded { limit, used, max }) => {
                assert_eq!((limit, used, max), ("max_records", 3, 3));
            }
            other => panic!("expected QuotaExceeded, got {other:?}"),
        }
        for i in 0..3 {
            assert!(matches!(
                claim_in(&store, "tenant-b", &format!("k{i}"))?,
                Claim::Acquired(_)
            ));
        }
        // The same limit for the whole table: six records are over it in every scope.
        let total = schema.builder(&quota).connect(&schema.url)?;
        assert!(matches!(
            claim_in(&total, "tenant-c", "k0"),
            Err(Error::QuotaExceeded {
                used: 6,
                max: 3,
                ..
            })
        ));
        assert!(store.verify()?.is_clean());
        Ok(())
    }

    #[test]
    fn records_written_before_or_without_a_quota_count() -> Result<()> {
        let Some(schema) = Schema::fresh("quota", "seeded") else {
            return Ok(());
        };
        let plain = schema.builder(&Quota::default()).connect(&schema.url)?;
        super::fill(&plain, 2, true)?;
        let limited = schema
            .builder(&Quota {
                max_records: Some(4),
                ..Quota::default()
            })
            .connect(&schema.url)?;
        assert!(matches!(
            limited.claim(&Key::new("k2")?, fp())?,
            Claim::Acquired(_)
        ));
        // A store without a quota on the same schema is counted too, now that counting is on.
        let Claim::Acquired(lease) = plain.claim(&Key::new("k3")?, fp())? else {
            panic!("k3 not acquired")
        };
        assert!(matches!(
            limited.claim(&Key::new("k4")?, fp()),
            Err(Error::QuotaExceeded {
                used: 4,
                max: 4,
                ..
            })
        ));
        // A delete gives the room back.
        plain.release(&lease)?;
        assert!(matches!(
            limited.claim(&Key::new("k4")?, fp())?,
            Claim::Acquired(_)
        ));
        assert!(limited.verify()?.is_clean());
        Ok(())
    }

    #[test]
    fn counters_stay_exact_under_concurrent_writers() -> Result<()> {
        const THREADS: usize = 8;
        const KEYS: usize = 60;
        const MAX: u64 = 200;
        let Some(schema) = Schema::fresh("quota", "concurrent") else {
            return Ok(());
        };
        let store = Arc::new(
            schema
                .builder(&Quota {
                    max_records: Some(MAX),
                    ..Quota::default()
                })
                .pool_size(THREADS as u32)
                .connect(&schema.url)?,
        );
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let store = Arc::clone(&store);
                std::thread::spawn(move || -> Result<(u64, u64)> {
                    let (mut stored, mut refused) = (0, 0);
                    for i in 0..KEYS {
                        match store.claim(&Key::new(&format!("t{t}-{i}"))?, fp()) {
                            Ok(Claim::Acquired(lease)) => {
                                if i % 2 == 0 {
                                    store.complete(&lease, Response::new(200, vec![1; i]))?;
                                } else if i % 3 == 0 {
                                    store.release(&lease)?;
                                    continue;
                                }
                                stored += 1;
                            }
                            Err(Error::QuotaExceeded { .. }) => refused += 1,
                            other => panic!("t{t}-{i}: {other:?}"),
                        }
                    }
                    Ok((stored, refused))
                })
            })
            .collect();
        let (mut stored, mut refused) = (0, 0);
        for worker in workers {
            let (s, r) = worker.join().expect("worker")?;
            stored += s;
            refused += r;
        }
        let stats = store.stats()?;
        let held = stats.in_progress + stats.completed;
        println!(
            "{THREADS} threads x {KEYS} new keys, max_records {MAX}: {held} held, {refused} \
             refused"
        );
        assert_eq!(held, stored);
        assert!(refused > 0, "the quota was never reached");
        // The check is not a lock: at most one claim per thread in flight past the limit.
        assert!(held <= MAX + THREADS as u64, "{held} records");
        let report = store.verify()?;
        assert!(report.is_clean(), "counters drifted: {report:?}");
        Ok(())
    }
}
