//! Every branch of claim / complete / release / heartbeat / checkpoint / lookup / sweep, one
//! scenario each, driven by a `ManualClock` (no test sleeps to pass time).

use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{
    Claim, Error, Fingerprint, Key, Lease, ManualClock, RecordState, Response, Result, Store,
    Timestamp,
};

const LEASE: Duration = Duration::from_secs(60);
const RETENTION: Duration = Duration::from_secs(24 * 3600);
const T0: u64 = 1_700_000_000_000;

fn store() -> Result<(Store, ManualClock)> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let store = Store::builder()
        .lease(LEASE)
        .retention(RETENTION)
        .clock(clock.clone())
        .open_in_memory()?;
    Ok((store, clock))
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", body])
}

fn acquire(store: &Store, key: &Key, f: Fingerprint) -> Lease {
    match store.claim(key, f) {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// An expiry entry redb already holds, which one overlay generation removes, adds again and
/// removes again (a key released and claimed again in the same millisecond, so with the same
/// expiry, then completed later), is removed from redb: only an entry the generation itself
/// added first may be left out.
#[test]
fn a_released_key_claimed_again_and_completed_leaves_no_stale_expiry_entry() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let first = acquire(&store, &key, fp("a"));
    // `stats` writes the overlay into redb's tables: the claim's entry is there now.
    store.stats()?;
    store.release(&first)?;
    let second = acquire(&store, &key, fp("a"));
    clock.advance(Duration::from_millis(1));
    store.complete(&second, Response::new(201, "done"))?;
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    Ok(())
}

#[test]
fn fresh_key_is_acquired_with_attempt_one() -> Result<()> {
    let (store, _) = store()?;
    let key = Key::new("k1")?;
    let lease = acquire(&store, &key, fp("a"));
    assert_eq!(lease.attempt(), 1);
    assert_eq!(lease.key(), &key);
    assert_eq!(lease.lease_until(), Timestamp::from_millis(T0 + 60_000));
    assert_eq!(lease.checkpoint(), None);
    Ok(())
}

#[test]
fn live_lease_answers_in_progress_with_its_deadline() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let _lease = acquire(&store, &key, fp("a"));
    clock.advance(Duration::from_secs(59));
    match store.claim(&key, fp("a"))? {
        Claim::InProgress {
            lease_until,
            attempt,
        } => {
            assert_eq!(lease_until, Timestamp::from_millis(T0 + 60_000));
            assert_eq!(attempt, 1);
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    Ok(())
}

#[test]
fn different_fingerprint_is_a_mismatch_in_every_state() -> Result<()> {
    let (store, _) = store()?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    assert!(matches!(store.claim(&key, fp("b"))?, Claim::Mismatch { stored } if stored == fp("a")));
    store.complete(&lease, Response::new(201, "done"))?;
    assert!(matches!(store.claim(&key, fp("b"))?, Claim::Mismatch { stored } if stored == fp("a")));
    Ok(())
}

#[test]
fn completed_key_replays_byte_for_byte() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    let response = Response::new(201, vec![0u8, 255, 10, 13])
        .with_header("Content-Type", "application/json")
        .with_header("X-Dup", vec![0xff, 0x00])
        .with_header("X-Dup", "second");
    clock.advance(Duration::from_secs(5));
    store.complete(&lease, response.clone())?;
    let Claim::Completed(replay) = store.claim(&key, fp("a"))? else {
        panic!("expected a replay");
    };
    assert_eq!(replay.response, response);
    assert_eq!(replay.created_at, Timestamp::from_millis(T0));
    assert_eq!(replay.completed_at, Timestamp::from_millis(T0 + 5_000));
    assert_eq!(
        replay.expires_at,
        Timestamp::from_millis(T0 + 5_000 + 86_400_000)
    );
    assert_eq!(replay.attempt, 1);
    Ok(())
}

#[test]
fn lapsed_lease_is_taken_over_with_attempt_and_checkpoint() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let mut first = acquire(&store, &key, fp("a"));
    store.checkpoint(&mut first, b"charge-created".to_vec())?;
    assert_eq!(first.checkpoint(), Some(&b"charge-created"[..]));
    clock.advance(LEASE);
    let second = acquire(&store, &key, fp("a"));
    assert_eq!(second.attempt(), 2);
    assert!(second.token() > first.token());
    assert_eq!(second.checkpoint(), Some(&b"charge-created"[..]));
    Ok(())
}

#[test]
fn fencing_rejects_the_old_holder_and_changes_nothing() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let mut a = acquire(&store, &key, fp("a"));
    clock.advance(LEASE + Duration::from_secs(1));
    let b = acquire(&store, &key, fp("a"));
    let before = store.lookup(&key)?;
    assert!(matches!(
        store.complete(&a, Response::new(200, "A")),
        Err(Error::LeaseLost)
    ));
    assert!(matches!(store.release(&a), Err(Error::LeaseLost)));
    assert!(matches!(store.heartbeat(&mut a), Err(Error::LeaseLost)));
    assert!(matches!(
        store.checkpoint(&mut a, b"x".to_vec()),
        Err(Error::LeaseLost)
    ));
    assert_eq!(
        store.lookup(&key)?,
        before,
        "a fenced call changed the record"
    );
    store.complete(&b, Response::new(200, "B"))?;
    let Claim::Completed(replay) = store.claim(&key, fp("a"))? else {
        panic!("expected B's replay");
    };
    assert_eq!(replay.response.body, b"B");
    assert_eq!(replay.attempt, 2);
    Ok(())
}

#[test]
fn a_lapsed_lease_nobody_took_over_still_completes() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    clock.advance(LEASE * 3);
    store.complete(&lease, Response::new(200, "late"))?;
    assert!(matches!(store.claim(&key, fp("a"))?, Claim::Completed(_)));
    Ok(())
}

#[test]
fn a_settled_lease_cannot_settle_again() -> Result<()> {
    let (store, _) = store()?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    store.complete(&lease, Response::new(200, "once"))?;
    assert!(matches!(
        store.complete(&lease, Response::new(200, "twice")),
        Err(Error::LeaseLost)
    ));
    assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
    Ok(())
}

#[test]
fn release_lets_a_retry_run_afresh() -> Result<()> {
    let (store, _) = store()?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    store.release(&lease)?;
    assert_eq!(store.lookup(&key)?, None);
    // A released key may even be reused for another request.
    let again = acquire(&store, &key, fp("b"));
    assert_eq!(again.attempt(), 1);
    Ok(())
}

#[test]
fn heartbeat_extends_the_lease_from_now() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let mut lease = acquire(&store, &key, fp("a"));
    clock.advance(Duration::from_secs(50));
    let until = store.heartbeat(&mut lease)?;
    assert_eq!(until, Timestamp::from_millis(T0 + 110_000));
    assert_eq!(lease.lease_until(), until);
    clock.advance(Duration::from_secs(30)); // past the original lease, inside the new one
    assert!(matches!(
        store.claim(&key, fp("a"))?,
        Claim::InProgress { .. }
    ));
    Ok(())
}

#[test]
fn completed_record_expires_after_retention_and_never_replays() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    store.complete(&lease, Response::new(200, "old"))?;
    clock.advance(RETENTION - Duration::from_millis(1));
    assert!(store.lookup(&key)?.is_some());
    clock.advance(Duration::from_millis(1));
    assert_eq!(store.lookup(&key)?, None, "expired records are invisible");
    // Not swept yet, but a claim treats it as absent: fresh attempt, even with another body.
    let fresh = acquire(&store, &key, fp("b"));
    assert_eq!(fresh.attempt(), 1);
    assert!(store.verify()?.is_clean());
    Ok(())
}

#[test]
fn in_progress_record_lives_until_created_plus_retention() -> Result<()> {
    let (store, clock) = store()?;
    let key = Key::new("k")?;
    let _crashed = acquire(&store, &key, fp("a"));
    clock.advance(RETENTION - Duration::from_secs(1));
    let view = store.lookup(&key)?.expect("still there");
    assert!(matches!(view.state, RecordState::InProgress { .. }));
    assert_eq!(view.expires_at, Timestamp::from_millis(T0 + 86_400_000));
    clock.advance(Duration::from_secs(1));
    assert_eq!(store.lookup(&key)?, None);
    Ok(())
}

#[test]
fn sweep_deletes_only_expired_records_in_bounded_batches() -> Result<()> {
    let (store, clock) = store()?;
    for i in 0..10 {
        let key = Key::new(&format!("old-{i}"))?;
        let lease = acquire(&store, &key, fp("a"));
        store.complete(&lease, Response::new(200, "x"))?;
    }
    clock.advance(RETENTION);
    let live = Key::new("live")?;
    let lease = acquire(&store, &live, fp("a"));
    store.complete(&lease, Response::new(200, "y"))?;
    assert_eq!(store.sweep(3)?, 3);
    assert_eq!(store.stats()?.expired, 7);
    assert_eq!(store.sweep_all()?, 7);
    assert_eq!(store.sweep(100)?, 0);
    let stats = store.stats()?;
    assert_eq!((stats.completed, stats.expired), (1, 0));
    assert!(store.lookup(&live)?.is_some());
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!((report.records, report.expiry_entries), (1, 1));
    Ok(())
}

/// A sweep takes a record at the millisecond it expires, not before and not later, even when
/// another record expires in the same second.
#[test]
fn sweep_takes_each_record_exactly_when_it_expires() -> Result<()> {
    let (store, clock) = store()?;
    // Completed 300 ms apart inside one second: they expire 300 ms apart in one due second.
    clock.advance(Duration::from_millis(100));
    let first = Key::new("first")?;
    let lease = acquire(&store, &first, fp("a"));
    store.complete(&lease, Response::new(200, "1"))?;
    clock.advance(Duration::from_millis(300));
    let second = Key::new("second")?;
    let lease = acquire(&store, &second, fp("a"));
    store.complete(&lease, Response::new(200, "2"))?;
    clock.advance(RETENTION - Duration::from_millis(301));
    assert_eq!(store.sweep_all()?, 0, "nothing has expired yet");
    clock.advance(Duration::from_millis(1));
    assert!(store.lookup(&first)?.is_none());
    assert_eq!(store.sweep_all()?, 1, "the first record expired just now");
    assert!(store.lookup(&second)?.is_some());
    assert_eq!(store.sweep(10)?, 0, "the second is due in 300 ms");
    clock.advance(Duration::from_millis(300));
    assert_eq!(store.sweep_all()?, 1);
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!((report.records, report.expiry_entries), (0, 0));
    Ok(())
}

#[test]
fn lookup_reports_the_record_view() -> Result<()> {
    let (store, _) = store()?;
    let key = Key::new("k")?;
    assert_eq!(store.lookup(&key)?, None);
    let mut lease = acquire(&store, &key, fp("a"));
    store.checkpoint(&mut lease, b"step-1".to_vec())?;
    let view = store.lookup(&key)?.expect("record");
    assert_eq!(view.fingerprint, fp("a"));
    assert_eq!(view.attempt, 1);
    assert_eq!(
        view.state,
        RecordState::InProgress {
            lease_until: lease.lease_until(),
            checkpoint: Some(b"step-1".to_vec())
        }
    );
    Ok(())
}

#[test]
fn scopes_are_isolated() -> Result<()> {
    let (store, _) = store()?;
    let a = Key::scoped("tenant-a", "order-1")?;
    let b = Key::scoped("tenant-b", "order-1")?;
    let plain = Key::new("order-1")?;
    let la = acquire(&store, &a, fp("a"));
    // Same key string, other scope, other request: an independent record, not a mismatch.
    let lb = acquire(&store, &b, fp("b"));
    let _lp = acquire(&store, &plain, fp("c"));
    store.complete(&la, Response::new(200, "A"))?;
    assert!(matches!(
        store.claim(&b, fp("b"))?,
        Claim::InProgress { .. }
    ));
    store.complete(&lb, Response::new(200, "B"))?;
    let Claim::Completed(ra) = store.claim(&a, fp("a"))? else {
        panic!()
    };
    let Claim::Completed(rb) = store.claim(&b, fp("b"))? else {
        panic!()
    };
    assert_eq!(
        (ra.response.body, rb.response.body),
        (b"A".to_vec(), b"B".to_vec())
    );
    Ok(())
}

#[test]
fn execute_runs_once_and_releases_on_error() -> Result<()> {
    let (store, _) = store()?;
    let key = Key::new("k")?;
    let failed = store.execute(&key, fp("a"), |_| Err::<Response, _>("downstream down"))?;
    assert!(matches!(failed, Claim::Acquired(Err("downstream down"))));
    assert_eq!(
        store.lookup(&key)?,
        None,
        "a failed execution releases the key"
    );
    let mut runs = 0;
    for _ in 0..3 {
        let outcome = store.execute(&key, fp("a"), |lease| {
            runs += 1;
            assert_eq!(lease.attempt(), 1);
            Ok::<_, ()>(Response::new(201, "made"))
        })?;
        assert!(matches!(
            outcome,
            Claim::Acquired(Ok(_)) | Claim::Completed(_)
        ));
    }
    assert_eq!(runs, 1);
    let mismatch = store.execute(&key, fp("other"), |_| Ok::<_, ()>(Response::default()))?;
    assert!(matches!(mismatch, Claim::Mismatch { .. }));
    Ok(())
}

#[test]
fn invalid_keys_are_rejected_with_the_reason() {
    let long = "k".repeat(256);
    for (input, reason) in [
        ("", "empty"),
        (long.as_str(), "256 bytes"),
        ("tab\there", "printable ASCII"),
        ("nul\0", "printable ASCII"),
        ("é", "printable ASCII"),
    ] {
        match Key::new(input) {
            Err(Error::InvalidKey { reason: r }) => assert!(r.contains(reason), "{r}"),
            other => panic!("{input:?}: expected InvalidKey, got {other:?}"),
        }
    }
    assert!(Key::new(&"k".repeat(255)).is_ok());
    assert!(matches!(
        Key::scoped("", "k"),
        Err(Error::InvalidKey { .. })
    ));
    assert!(matches!(
        Key::scoped("bad\n", "k"),
        Err(Error::InvalidKey { .. })
    ));
}

#[test]
fn store_max_key_len_is_enforced() -> Result<()> {
    let store = Store::builder().max_key_len(8).open_in_memory()?;
    let ok = Key::new("12345678")?;
    let long = Key::new("123456789")?;
    assert!(matches!(store.claim(&ok, fp("a"))?, Claim::Acquired(_)));
    assert!(matches!(
        store.claim(&long, fp("a")),
        Err(Error::InvalidKey { .. })
    ));
    assert!(matches!(store.lookup(&long), Err(Error::InvalidKey { .. })));
    Ok(())
}

#[test]
fn oversized_response_is_rejected_and_the_lease_still_holds() -> Result<()> {
    let store = Store::builder().max_response_bytes(1024).open_in_memory()?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    let big = Response::new(200, vec![0u8; 1000]).with_header("X-Pad", vec![0u8; 100]);
    match store.complete(&lease, big) {
        Err(Error::ResponseTooLarge { size, limit }) => assert_eq!((size, limit), (1105, 1024)),
        other => panic!("expected ResponseTooLarge, got {other:?}"),
    }
    assert!(matches!(
        store.lookup(&key)?.map(|v| v.state),
        Some(RecordState::InProgress { .. })
    ));
    store.complete(&lease, Response::new(500, "response too large"))?;
    assert!(matches!(store.claim(&key, fp("a"))?, Claim::Completed(r) if r.response.status == 500));
    Ok(())
}

#[test]
fn invalid_configuration_is_refused() {
    for builder in [
        Store::builder().retention(Duration::ZERO).clone(),
        Store::builder().lease(Duration::ZERO).clone(),
        Store::builder().max_key_len(0).clone(),
        Store::builder().max_key_len(256).clone(),
        Store::builder().max_batch(0).clone(),
        Store::builder().log_size(8 << 10).clone(),
        Store::builder().log_size((64 << 10) + 1).clone(),
    ] {
        assert!(matches!(
            builder.open_in_memory(),
            Err(Error::InvalidConfig { .. })
        ));
    }
}

/// Whatever the log size, including batches bigger than the whole log (which then commit
/// durably into the database instead), every result survives a reopen.
#[test]
fn a_small_log_checkpoints_and_loses_nothing() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("small-log.redb");
    let open = || Store::builder().log_size(16 << 10).open(&path);
    let body = |i: usize| vec![i as u8; if i.is_multiple_of(10) { 40 << 10 } else { 300 }];
    {
        let store = open()?;
        for i in 0..200 {
            let lease = acquire(&store, &Key::new(&format!("k{i}"))?, fp("a"));
            store.complete(&lease, Response::new(200, body(i)))?;
        }
    }
    let store = open()?;
    for i in 0..200 {
        match store.claim(&Key::new(&format!("k{i}"))?, fp("a"))? {
            Claim::Completed(replay) => assert_eq!(replay.response.body, body(i), "k{i}"),
            other => panic!("k{i}: {other:?}"),
        }
    }
    assert!(store.verify()?.is_clean());
    Ok(())
}

#[test]
fn background_sweeper_deletes_expired_records_and_stops() -> Result<()> {
    let (store, clock) = store()?;
    let store = std::sync::Arc::new(store);
    for i in 0..50 {
        let lease = acquire(&store, &Key::new(&format!("k{i}"))?, fp("a"));
        store.complete(&lease, Response::new(200, "x"))?;
    }
    clock.advance(RETENTION);
    // A long interval: the first pass runs at once, in batches of 8, then the thread waits.
    let sweeper = store.start_sweeper(Duration::from_secs(3600), 8);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while store.stats()?.expired > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the sweeper made no progress"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let swept = sweeper.stop()?;
    assert_eq!(swept, 50);
    assert_eq!(store.stats()?.expired, 0);
    assert!(store.verify()?.is_clean());
    Ok(())
}
