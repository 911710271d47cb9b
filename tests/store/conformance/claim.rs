//! Claim: every branch (fresh, in progress, mismatch, replay, takeover, expiry) and how long a
//! record lives.

use std::time::Duration;

use idempotency_store::{
    Claim, Error, IdempotencyStore, Key, RecordState, Response, Result, Timestamp,
};

use super::{Factory, LEASE, RETENTION, Settings, acquire, at, fp};

pub(super) fn fresh_key_is_acquired_with_attempt_one<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, _) = open(&Settings::default())?;
    let key = Key::new("k1")?;
    let lease = acquire(&store, &key, fp("a"));
    assert_eq!(lease.attempt(), 1);
    assert_eq!(lease.key(), &key);
    assert_eq!(lease.lease_until(), at(60_000));
    assert_eq!(lease.checkpoint(), None);
    let other = acquire(&store, &Key::new("k2")?, fp("a"));
    assert!(other.token() > lease.token(), "tokens increase");
    Ok(())
}

pub(super) fn live_lease_answers_in_progress_until_the_deadline<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let _lease = acquire(&store, &key, fp("a"));
    clock.advance(LEASE - Duration::from_millis(1));
    match store.claim(&key, fp("a"))? {
        Claim::InProgress {
            lease_until,
            attempt,
        } => assert_eq!((lease_until, attempt), (at(60_000), 1)),
        other => panic!("expected InProgress, got {other:?}"),
    }
    // Exactly at the deadline the lease has lapsed.
    clock.advance(Duration::from_millis(1));
    assert_eq!(acquire(&store, &key, fp("a")).attempt(), 2);
    Ok(())
}

pub(super) fn different_fingerprint_is_a_mismatch_in_every_state<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    let mismatch = |store: &S| -> Result<bool> {
        Ok(matches!(store.claim(&key, fp("b"))?, Claim::Mismatch { stored } if stored == fp("a")))
    };
    assert!(mismatch(&store)?, "live lease");
    clock.advance(LEASE);
    assert!(
        mismatch(&store)?,
        "lapsed lease: no takeover by another request"
    );
    store.complete(&lease, Response::new(201, "done"))?;
    assert!(mismatch(&store)?, "completed");
    Ok(())
}

pub(super) fn completed_key_replays_byte_for_byte<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    let response = Response::new(201, vec![0u8, 255, 10, 13])
        .with_header("Content-Type", "application/json")
        .with_header("X-Dup", vec![0xff, 0x00])
        .with_header("X-Dup", "second")
        .with_header("x-empty", "");
    clock.advance(Duration::from_secs(5));
    store.complete(&lease, response.clone())?;
    let Claim::Completed(replay) = store.claim(&key, fp("a"))? else {
        panic!("expected a replay");
    };
    assert_eq!(replay.response, response);
    assert_eq!(replay.created_at, at(0));
    assert_eq!(replay.completed_at, at(5_000));
    assert_eq!(replay.expires_at, at(5_000 + 86_400_000));
    assert_eq!(replay.attempt, 1);
    // An empty response replays as empty, not as missing.
    let empty = Key::new("empty")?;
    let lease = acquire(&store, &empty, fp("a"));
    store.complete(&lease, Response::new(204, Vec::new()))?;
    assert!(matches!(store.claim(&empty, fp("a"))?,
        Claim::Completed(r) if r.response == Response::new(204, Vec::new())));
    Ok(())
}

pub(super) fn lapsed_lease_is_taken_over_with_attempt_and_checkpoint<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let mut first = acquire(&store, &key, fp("a"));
    store.checkpoint(&mut first, b"charge-created".to_vec())?;
    assert_eq!(first.checkpoint(), Some(&b"charge-created"[..]));
    clock.advance(LEASE);
    let second = acquire(&store, &key, fp("a"));
    assert_eq!(second.attempt(), 2);
    assert!(second.token() > first.token());
    assert_eq!(second.checkpoint(), Some(&b"charge-created"[..]));
    assert_eq!(second.lease_until(), at(120_000));
    let view = store.lookup(&key)?.expect("record");
    assert_eq!(view.created_at, at(0), "a takeover keeps the creation time");
    clock.advance(LEASE);
    assert_eq!(acquire(&store, &key, fp("a")).attempt(), 3);
    Ok(())
}

pub(super) fn expired_record_is_claimed_afresh_by_any_request<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let done = Key::new("done")?;
    let stuck = Key::new("stuck")?;
    let lease = acquire(&store, &done, fp("a"));
    store.complete(&lease, Response::new(200, "old"))?;
    let mut crashed = acquire(&store, &stuck, fp("a"));
    store.checkpoint(&mut crashed, b"half".to_vec())?;
    clock.advance(RETENTION - Duration::from_millis(1));
    assert!(store.lookup(&done)?.is_some());
    clock.advance(Duration::from_millis(1));
    assert_eq!(store.lookup(&done)?, None, "expired records are invisible");
    assert_eq!(store.lookup(&stuck)?, None);
    // Not swept yet, but a claim treats them as absent: attempt 1, no checkpoint, any body.
    for key in [&done, &stuck] {
        let fresh = acquire(&store, key, fp("b"));
        assert_eq!((fresh.attempt(), fresh.checkpoint()), (1, None));
        let view = store.lookup(key)?.expect("record");
        assert_eq!(
            (view.fingerprint, view.created_at),
            (fp("b"), at(86_400_000))
        );
    }
    assert!(matches!(
        store.complete(&crashed, Response::new(200, "late")),
        Err(Error::LeaseLost)
    ));
    assert!(store.verify()?.is_clean());
    Ok(())
}

pub(super) fn in_progress_record_lives_until_created_plus_retention<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    clock.advance(RETENTION - Duration::from_secs(1));
    let view = store.lookup(&key)?.expect("still there");
    assert!(matches!(view.state, RecordState::InProgress { .. }));
    assert_eq!(view.expires_at, at(86_400_000));
    clock.advance(Duration::from_secs(1));
    assert_eq!(store.lookup(&key)?, None);
    // An expired lease can no longer settle.
    assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
    Ok(())
}

/// A lease kept for its own retention (`Lease::keep_for`, the HTTP layer's per-route TTL)
/// completes a record that replays for that long from its completion, shorter or longer than
/// the store's; other keys keep the store's; the key space stays one (a different request for
/// the key is a mismatch whatever the TTL), and sweeps delete each record at its own expiry.
pub(super) fn a_lease_kept_for_its_own_retention_expires_by_it<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let hour = Duration::from_secs(3600);
    let (short, week, plain) = (Key::new("hour")?, Key::new("week")?, Key::new("plain")?);
    let mut lease = acquire(&store, &short, fp("a"));
    lease.keep_for(hour);
    assert_eq!(lease.retention(), Some(hour));
    store.complete(&lease, Response::new(201, "an hour"))?;
    let mut lease = acquire(&store, &week, fp("a"));
    lease.keep_for(7 * RETENTION);
    store.complete(&lease, Response::new(201, "a week"))?;
    let lease = acquire(&store, &plain, fp("a"));
    assert_eq!(lease.retention(), None);
    store.complete(&lease, Response::new(201, "the store's"))?;
    let expiry = |key: &Key| -> Result<Option<Timestamp>> {
        Ok(store.lookup(key)?.map(|view| view.expires_at))
    };
    assert_eq!(expiry(&short)?, Some(at(3_600_000)));
    assert_eq!(expiry(&week)?, Some(at(7 * 86_400_000)));
    assert_eq!(expiry(&plain)?, Some(at(86_400_000)));
    assert!(matches!(
        store.claim(&short, fp("b"))?,
        Claim::Mismatch { .. }
    ));
    clock.advance(hour);
    assert_eq!(store.lookup(&short)?, None, "expired after its own hour");
    assert_eq!(store.sweep(10)?, 1);
    assert!(matches!(store.claim(&week, fp("a"))?, Claim::Completed(_)));
    clock.advance(RETENTION - hour);
    assert_eq!(
        store.sweep(10)?,
        1,
        "the store's retention for the plain key"
    );
    assert!(matches!(store.claim(&week, fp("a"))?, Claim::Completed(_)));
    clock.advance(6 * RETENTION);
    assert_eq!(store.lookup(&week)?, None);
    assert_eq!(store.sweep(10)?, 1);
    Ok(())
}

pub(super) fn a_lease_longer_than_retention_keeps_the_record<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let settings = Settings {
        lease: Duration::from_secs(100),
        retention: Duration::from_secs(10),
        ..Settings::default()
    };
    let (store, clock) = open(&settings)?;
    let key = Key::new("k")?;
    let mut lease = acquire(&store, &key, fp("a"));
    assert_eq!(store.lookup(&key)?.map(|v| v.expires_at), Some(at(100_000)));
    clock.advance(Duration::from_secs(90));
    assert_eq!(store.heartbeat(&mut lease)?, at(190_000));
    assert_eq!(store.lookup(&key)?.map(|v| v.expires_at), Some(at(190_000)));
    store.complete(&lease, Response::new(200, "ok"))?;
    assert_eq!(store.lookup(&key)?.map(|v| v.expires_at), Some(at(100_000)));
    Ok(())
}
