//! Storage quotas for edge devices: new keys fail closed when full; in-progress records are
//! never evicted; completed ones only when the user opts in.

use std::time::Duration;

use idempotency_store::{
    Claim, Error, Fingerprint, Key, ManualClock, Response, Result, Store, Timestamp, WhenFull,
};

fn fp() -> Fingerprint {
    Fingerprint::of(["req"])
}

fn fill(store: &Store, n: usize, complete: bool) -> Result<()> {
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

#[test]
fn a_full_store_refuses_new_keys_but_serves_existing_ones() -> Result<()> {
    let store = Store::builder().max_records(10).open_in_memory()?;
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

#[test]
fn expired_records_make_room_before_a_claim_is_refused() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(1_000));
    let store = Store::builder()
        .max_records(5)
        .retention(Duration::from_secs(10))
        .clock(clock.clone())
        .open_in_memory()?;
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

#[test]
fn eviction_takes_the_oldest_completed_never_in_progress() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(1_000));
    let store = Store::builder()
        .max_records(4)
        .when_full(WhenFull::EvictOldestCompleted)
        .clock(clock.clone())
        .open_in_memory()?;
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

#[test]
fn a_byte_quota_refuses_new_keys_and_never_refuses_a_completion() -> Result<()> {
    let store = Store::builder().max_bytes(2_000).open_in_memory()?;
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

#[test]
fn usage_counters_survive_reopen_and_deletes() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("q.redb");
    {
        let store = Store::builder().max_records(3).open(&path)?;
        fill(&store, 3, false)?;
    }
    let store = Store::builder().max_records(3).open(&path)?;
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
