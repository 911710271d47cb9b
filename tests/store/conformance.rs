//! One conformance suite for every backend: each test is written once, generic over a factory
//! that opens an [`IdempotencyStore`] driven by a [`ManualClock`], and runs against the redb
//! [`Store`] (in memory) and, with `--features postgres`, against [`PgStore`] (each test on a
//! fresh PostgreSQL schema, dropped afterwards). The model-based check runs the shared
//! reference model's step sequences (`tests/reference/mod.rs`) against both as well.
//!
//! PostgreSQL tests read the server from `IDEMPOTENCY_PG_URL` (`.ci/run` starts a server and
//! sets it). Without it they print why and pass as skipped, except under `CI=true`, where a
//! missing server fails them.

use std::sync::Barrier;
use std::time::Duration;

use idempotency_store::{
    Claim, Clock, Error, Fingerprint, IdempotencyStore, Key, Lease, ManualClock, RecordState,
    Response, Result, Store, Timestamp,
};
use proptest::prelude::*;

use crate::reference;

const LEASE: Duration = Duration::from_secs(60);
const RETENTION: Duration = Duration::from_secs(24 * 3600);
const T0: u64 = 1_700_000_000_000;

/// The settings a test asks the factory for; lease and retention as above unless given.
#[derive(Debug, Clone, Copy)]
struct Settings {
    lease: Duration,
    retention: Duration,
    max_key_len: Option<usize>,
    max_response_bytes: Option<usize>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            lease: LEASE,
            retention: RETENTION,
            max_key_len: None,
            max_response_bytes: None,
        }
    }
}

/// Opens a store on fresh storage with a manual clock standing at `T0`.
type Factory<'a, S> = &'a dyn Fn(&Settings) -> Result<(S, ManualClock)>;

fn open_redb(settings: &Settings) -> Result<(Store, ManualClock)> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let mut builder = Store::builder();
    builder
        .lease(settings.lease)
        .retention(settings.retention)
        .clock(clock.clone());
    if let Some(len) = settings.max_key_len {
        builder.max_key_len(len);
    }
    if let Some(bytes) = settings.max_response_bytes {
        builder.max_response_bytes(bytes);
    }
    Ok((builder.open_in_memory()?, clock))
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", body])
}

fn acquire<S: IdempotencyStore>(store: &S, key: &Key, f: Fingerprint) -> Lease {
    match store.claim(key, f) {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn at(ms: u64) -> Timestamp {
    Timestamp::from_millis(T0 + ms)
}

// ---------------------------------------------------------------------------------------------
// Claim: every branch
// ---------------------------------------------------------------------------------------------

fn fresh_key_is_acquired_with_attempt_one<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
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

fn live_lease_answers_in_progress_until_the_deadline<S: IdempotencyStore>(
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

fn different_fingerprint_is_a_mismatch_in_every_state<S: IdempotencyStore>(
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

fn completed_key_replays_byte_for_byte<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
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

fn lapsed_lease_is_taken_over_with_attempt_and_checkpoint<S: IdempotencyStore>(
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

fn expired_record_is_claimed_afresh_by_any_request<S: IdempotencyStore>(
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

fn in_progress_record_lives_until_created_plus_retention<S: IdempotencyStore>(
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
fn a_lease_kept_for_its_own_retention_expires_by_it<S: IdempotencyStore>(
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

fn a_lease_longer_than_retention_keeps_the_record<S: IdempotencyStore>(
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

// ---------------------------------------------------------------------------------------------
// Settling: fencing, release, heartbeat, checkpoint
// ---------------------------------------------------------------------------------------------

fn fencing_rejects_the_old_holder_and_changes_nothing<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
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
        a.checkpoint(),
        None,
        "a fenced checkpoint leaves the lease alone"
    );
    assert_eq!(
        store.lookup(&key)?,
        before,
        "a fenced call changed the record"
    );
    store.complete(&b, Response::new(200, "B"))?;
    let Claim::Completed(replay) = store.claim(&key, fp("a"))? else {
        panic!("expected B's replay");
    };
    assert_eq!((replay.response.body, replay.attempt), (b"B".to_vec(), 2));
    Ok(())
}

fn a_lapsed_lease_nobody_took_over_still_completes<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    clock.advance(LEASE * 3);
    store.complete(&lease, Response::new(200, "late"))?;
    assert!(matches!(store.claim(&key, fp("a"))?, Claim::Completed(_)));
    Ok(())
}

fn a_settled_lease_cannot_settle_again<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, _) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let mut lease = acquire(&store, &key, fp("a"));
    store.complete(&lease, Response::new(200, "once"))?;
    assert!(matches!(
        store.complete(&lease, Response::new(200, "twice")),
        Err(Error::LeaseLost)
    ));
    assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
    assert!(matches!(store.heartbeat(&mut lease), Err(Error::LeaseLost)));
    assert!(matches!(
        store.checkpoint(&mut lease, b"x".to_vec()),
        Err(Error::LeaseLost)
    ));
    assert!(matches!(store.claim(&key, fp("a"))?,
        Claim::Completed(r) if r.response.body == b"once"));
    Ok(())
}

fn release_lets_a_retry_run_afresh<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, _) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    store.release(&lease)?;
    assert_eq!(store.lookup(&key)?, None);
    assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
    // A released key may even be reused for another request.
    let again = acquire(&store, &key, fp("b"));
    assert_eq!(again.attempt(), 1);
    assert!(matches!(
        store.complete(&lease, Response::new(200, "stale")),
        Err(Error::LeaseLost)
    ));
    Ok(())
}

fn heartbeat_extends_the_lease_from_now<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let mut lease = acquire(&store, &key, fp("a"));
    clock.advance(Duration::from_secs(50));
    let until = store.heartbeat(&mut lease)?;
    assert_eq!(until, at(110_000));
    assert_eq!(lease.lease_until(), until);
    clock.advance(Duration::from_secs(30)); // past the original lease, inside the new one
    assert!(matches!(
        store.claim(&key, fp("a"))?,
        Claim::InProgress { lease_until, attempt: 1 } if lease_until == until
    ));
    Ok(())
}

fn checkpoints_replace_each_other_and_survive_a_takeover<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let mut lease = acquire(&store, &key, fp("a"));
    store.checkpoint(&mut lease, b"step-1".to_vec())?;
    store.checkpoint(&mut lease, vec![0u8, 1, 255])?;
    assert_eq!(lease.checkpoint(), Some(&[0u8, 1, 255][..]));
    let view = store.lookup(&key)?.expect("record");
    assert_eq!(
        view.state,
        RecordState::InProgress {
            lease_until: lease.lease_until(),
            checkpoint: Some(vec![0, 1, 255])
        }
    );
    clock.advance(LEASE);
    let next = acquire(&store, &key, fp("a"));
    assert_eq!(next.checkpoint(), Some(&[0u8, 1, 255][..]));
    Ok(())
}

fn lookup_reports_the_record_view<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let key = Key::new("k")?;
    assert_eq!(store.lookup(&key)?, None);
    let lease = acquire(&store, &key, fp("a"));
    let view = store.lookup(&key)?.expect("record");
    assert_eq!(
        (
            view.fingerprint,
            view.created_at,
            view.expires_at,
            view.attempt
        ),
        (fp("a"), at(0), at(86_400_000), 1)
    );
    assert_eq!(
        view.state,
        RecordState::InProgress {
            lease_until: at(60_000),
            checkpoint: None
        }
    );
    clock.advance(Duration::from_secs(2));
    store.complete(&lease, Response::new(201, "made").with_header("h", "v"))?;
    let view = store.lookup(&key)?.expect("record");
    assert_eq!(view.expires_at, at(2_000 + 86_400_000));
    assert_eq!(
        view.state,
        RecordState::Completed {
            completed_at: at(2_000),
            response: Response::new(201, "made").with_header("h", "v")
        }
    );
    Ok(())
}

fn scopes_are_isolated<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, _) = open(&Settings::default())?;
    let a = Key::scoped("tenant-a", "order-1")?;
    let b = Key::scoped("tenant-b", "order-1")?;
    let plain = Key::new("order-1")?;
    let la = acquire(&store, &a, fp("a"));
    // Same key string, other scope, other request: an independent record, not a mismatch.
    let lb = acquire(&store, &b, fp("b"));
    let lp = acquire(&store, &plain, fp("c"));
    store.complete(&la, Response::new(200, "A"))?;
    assert!(matches!(
        store.claim(&b, fp("b"))?,
        Claim::InProgress { .. }
    ));
    store.complete(&lb, Response::new(200, "B"))?;
    store.release(&lp)?;
    let Claim::Completed(ra) = store.claim(&a, fp("a"))? else {
        panic!("a")
    };
    let Claim::Completed(rb) = store.claim(&b, fp("b"))? else {
        panic!("b")
    };
    assert_eq!(
        (ra.response.body, rb.response.body),
        (b"A".to_vec(), b"B".to_vec())
    );
    assert_eq!(store.lookup(&plain)?, None);
    // A lease of one scope cannot settle the same key in another.
    let lp = acquire(&store, &plain, fp("c"));
    assert!(store.lookup(&a)?.is_some());
    store.complete(&lp, Response::new(200, "P"))?;
    assert!(matches!(store.claim(&a, fp("a"))?,
        Claim::Completed(r) if r.response.body == b"A"));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Limits
// ---------------------------------------------------------------------------------------------

fn max_key_len_is_enforced<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, _) = open(&Settings {
        max_key_len: Some(8),
        ..Settings::default()
    })?;
    let ok = Key::new("12345678")?;
    let long = Key::new("123456789")?;
    let long_scope = Key::scoped("123456789", "k")?;
    assert!(matches!(store.claim(&ok, fp("a"))?, Claim::Acquired(_)));
    for key in [&long, &long_scope] {
        assert!(matches!(
            store.claim(key, fp("a")),
            Err(Error::InvalidKey { .. })
        ));
        assert!(matches!(store.lookup(key), Err(Error::InvalidKey { .. })));
    }
    // The longest key the format allows works too.
    let (store, _) = open(&Settings::default())?;
    let longest = Key::scoped(&"s".repeat(255), &"k".repeat(255))?;
    let lease = acquire(&store, &longest, fp("a"));
    store.complete(&lease, Response::new(200, "ok"))?;
    assert!(matches!(
        store.claim(&longest, fp("a"))?,
        Claim::Completed(_)
    ));
    Ok(())
}

fn oversized_response_is_rejected_and_the_lease_still_holds<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, _) = open(&Settings {
        max_response_bytes: Some(1024),
        ..Settings::default()
    })?;
    let key = Key::new("k")?;
    let mut lease = acquire(&store, &key, fp("a"));
    let big = Response::new(200, vec![0u8; 1000]).with_header("X-Pad", vec![0u8; 100]);
    match store.complete(&lease, big) {
        Err(Error::ResponseTooLarge { size, limit }) => assert_eq!((size, limit), (1105, 1024)),
        other => panic!("expected ResponseTooLarge, got {other:?}"),
    }
    assert!(matches!(
        store.checkpoint(&mut lease, vec![0u8; 1025]),
        Err(Error::ResponseTooLarge { .. })
    ));
    assert!(matches!(
        store.lookup(&key)?.map(|v| v.state),
        Some(RecordState::InProgress {
            checkpoint: None,
            ..
        })
    ));
    store.complete(&lease, Response::new(500, vec![7u8; 1024]))?;
    assert!(matches!(store.claim(&key, fp("a"))?,
        Claim::Completed(r) if r.response.status == 500 && r.response.body.len() == 1024));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Maintenance: sweep, stats, verify
// ---------------------------------------------------------------------------------------------

fn sweep_deletes_only_expired_records_in_bounded_batches<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    for i in 0..10 {
        let lease = acquire(&store, &Key::new(&format!("old-{i}"))?, fp("a"));
        store.complete(&lease, Response::new(200, "x"))?;
    }
    let _crashed = acquire(&store, &Key::new("old-crashed")?, fp("a"));
    clock.advance(RETENTION);
    let live = Key::new("live")?;
    let lease = acquire(&store, &live, fp("a"));
    store.complete(&lease, Response::new(200, "y"))?;
    assert_eq!(store.sweep(0)?, 0);
    assert_eq!(store.sweep(3)?, 3);
    assert_eq!(store.stats()?.expired, 8);
    assert_eq!(store.sweep_all()?, 8);
    assert_eq!(store.sweep(100)?, 0);
    let stats = store.stats()?;
    assert_eq!(
        (stats.in_progress, stats.completed, stats.expired),
        (0, 1, 0)
    );
    assert!(store.lookup(&live)?.is_some());
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!((report.records, report.expiry_entries), (1, 1));
    Ok(())
}

fn sweep_takes_the_oldest_expiry_first<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    for i in 0..4 {
        let key = Key::new(&format!("k{i}"))?;
        let lease = acquire(&store, &key, fp("a"));
        store.complete(&lease, Response::new(200, "x"))?;
        clock.advance(Duration::from_secs(1));
    }
    // k0 and k1 expired, k2 and k3 not yet.
    clock.advance(RETENTION - Duration::from_secs(3));
    assert_eq!(store.stats()?.expired, 2);
    assert_eq!(store.sweep(1)?, 1);
    assert_eq!(store.verify()?.records, 3);
    clock.advance(Duration::from_secs(1)); // k2 expires too
    assert_eq!(store.sweep(10)?, 2);
    assert_eq!(store.verify()?.records, 1);
    assert!(store.lookup(&Key::new("k3")?)?.is_some());
    Ok(())
}

fn stats_count_records_by_state<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, clock) = open(&Settings::default())?;
    let empty = store.stats()?;
    assert_eq!(
        (
            empty.in_progress,
            empty.stuck,
            empty.completed,
            empty.expired
        ),
        (0, 0, 0, 0)
    );
    let _stuck = acquire(&store, &Key::new("stuck")?, fp("a"));
    let done = acquire(&store, &Key::new("done")?, fp("a"));
    store.complete(&done, Response::new(200, "x"))?;
    clock.advance(LEASE);
    let _live = acquire(&store, &Key::new("live")?, fp("a"));
    let stats = store.stats()?;
    assert_eq!(
        (
            stats.in_progress,
            stats.stuck,
            stats.completed,
            stats.expired
        ),
        (2, 1, 1, 0)
    );
    clock.advance(RETENTION);
    let stats = store.stats()?;
    assert_eq!(
        (
            stats.in_progress,
            stats.stuck,
            stats.completed,
            stats.expired
        ),
        (0, 0, 0, 3)
    );
    let report = store.verify()?;
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.records, 3);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// execute
// ---------------------------------------------------------------------------------------------

fn execute_runs_once_and_releases_on_error<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
    let (store, _) = open(&Settings::default())?;
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
    assert!(matches!(mismatch, Claim::Mismatch { stored } if stored == fp("a")));
    Ok(())
}

fn execute_works_through_a_trait_object<S: IdempotencyStore + 'static>(
    open: Factory<S>,
) -> Result<()> {
    let (store, _) = open(&Settings::default())?;
    let store: Box<dyn IdempotencyStore> = Box::new(store);
    let key = Key::new("k")?;
    // The closure checkpoints through the same store while it holds the lease.
    let outcome = idempotency_store::execute(&*store, &key, fp("a"), |lease| {
        let busy = store
            .claim(lease.key(), fp("a"))
            .map_err(|e| e.to_string())?;
        assert!(matches!(busy, Claim::InProgress { attempt: 1, .. }));
        store
            .checkpoint(lease, b"half".to_vec())
            .map_err(|e| e.to_string())?;
        Ok::<_, String>(Response::new(200, "ok"))
    })?;
    assert!(matches!(outcome, Claim::Acquired(Ok(r)) if r.body == b"ok"));
    let replay = idempotency_store::execute(&*store, &key, fp("a"), |_| {
        Err::<Response, _>("must not run")
    })?;
    assert!(matches!(replay, Claim::Completed(r) if r.response.body == b"ok"));
    Ok(())
}

fn execute_reports_in_progress_without_running<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
    let (store, _) = open(&Settings::default())?;
    let key = Key::new("k")?;
    let _held = acquire(&store, &key, fp("a"));
    let outcome = store.execute(&key, fp("a"), |_| -> std::result::Result<Response, ()> {
        panic!("ran while another attempt holds the key")
    })?;
    assert!(matches!(
        outcome,
        Claim::InProgress { attempt: 1, lease_until } if lease_until == at(60_000)
    ));
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Concurrency: one winner
// ---------------------------------------------------------------------------------------------

const RACERS: usize = 4;

fn concurrent_claims_have_exactly_one_winner<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
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

fn expired_keys_are_reclaimed_once_while_sweeps_run<S: IdempotencyStore>(
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
fn tokens_increase_and_leases_follow_releases_under_contention<S: IdempotencyStore>(
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

// ---------------------------------------------------------------------------------------------
// Model-based: the shared reference model's step sequences
// ---------------------------------------------------------------------------------------------

/// A model run's store: lease and retention of the reference model, and its clock.
fn model_settings() -> Settings {
    Settings {
        lease: Duration::from_millis(reference::LEASE_MS),
        retention: Duration::from_millis(reference::RETENTION_MS),
        ..Settings::default()
    }
}

/// Opens a store on one case's storage (again at each `Reopen`), with the given clock.
type Opener<S> = Box<dyn Fn(&ManualClock) -> Result<S>>;

/// Runs step sequences decoded from random bytes (the fuzz target's decoder) against a fresh
/// store of the backend per case, every answer compared with the reference model. A `Reopen`
/// step drops the store and opens another on the same storage (redb: the same in-memory disk;
/// PostgreSQL: a new `PgStore` on the same schema).
fn matches_the_reference_model<S: IdempotencyStore>(
    cases: u32,
    ties: reference::Ties,
    fresh: &dyn Fn() -> Result<Opener<S>>,
) {
    let config = ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let case = |bytes: &[u8]| {
        let steps = reference::decode_steps(bytes);
        let clock = ManualClock::new(reference::ts(reference::T0));
        let open = fresh().map_err(|e| TestCaseError::fail(e.to_string()))?;
        let checks = reference::Checks::EveryStep;
        reference::run_steps(&steps, ties, checks, &clock, &|| open(&clock), &|_, _| {
            Ok(())
        })
        .map_err(|f| TestCaseError::fail(format!("{f}\nsteps: {steps:?}")))
    };
    for (i, bytes) in MODEL_REGRESSIONS.iter().enumerate() {
        if let Err(err) = case(bytes) {
            panic!("regression case {i}: the backend disagrees with the reference model: {err}");
        }
    }
    let mut runner = proptest::test_runner::TestRunner::new(config);
    if let Err(err) = runner.run(&prop::collection::vec(any::<u8>(), 1..160), |bytes| {
        case(&bytes)
    }) {
        panic!("the backend disagrees with the reference model: {err}");
    }
}

/// Inputs that once failed, run first on every backend.
const MODEL_REGRESSIONS: &[&[u8]] = &[
    // PostgreSQL's sweep(1) deleted 2 records: `ctid IN (SELECT … LIMIT n FOR UPDATE SKIP
    // LOCKED)` can be rescanned, and a rescan skips the rows the statement already deleted.
    &[
        204, 19, 141, 175, 95, 142, 129, 66, 163, 173, 213, 170, 216, 231, 86, 68, 146, 55, 117,
        92, 235, 130, 30, 89, 174, 81, 41, 167, 64, 44, 160, 125, 50, 120, 153, 180, 203, 124, 92,
        178, 220, 168, 67, 29, 149, 98, 154, 18, 78, 9, 17, 56, 103, 225, 137, 169, 50, 39, 39,
        242, 138, 34, 2, 173, 19, 122, 222, 105, 71, 16, 8, 204, 4, 212, 118, 76, 157, 226, 215,
        112, 105, 22, 207, 106, 103, 2, 128, 37, 162, 227, 119, 154, 191, 66, 174, 44, 12, 20, 184,
        30, 15, 240, 82, 243, 143, 140,
    ],
];

// ---------------------------------------------------------------------------------------------
// The two backends
// ---------------------------------------------------------------------------------------------

on_both_backends! {
    redb: &super::open_redb,
    postgres(db = super::pg::Db::fresh): &|settings| db.open(settings);
    fresh_key_is_acquired_with_attempt_one,
    live_lease_answers_in_progress_until_the_deadline,
    different_fingerprint_is_a_mismatch_in_every_state,
    completed_key_replays_byte_for_byte,
    lapsed_lease_is_taken_over_with_attempt_and_checkpoint,
    expired_record_is_claimed_afresh_by_any_request,
    in_progress_record_lives_until_created_plus_retention,
    a_lease_kept_for_its_own_retention_expires_by_it,
    a_lease_longer_than_retention_keeps_the_record,
    fencing_rejects_the_old_holder_and_changes_nothing,
    a_lapsed_lease_nobody_took_over_still_completes,
    a_settled_lease_cannot_settle_again,
    release_lets_a_retry_run_afresh,
    heartbeat_extends_the_lease_from_now,
    checkpoints_replace_each_other_and_survive_a_takeover,
    lookup_reports_the_record_view,
    scopes_are_isolated,
    max_key_len_is_enforced,
    oversized_response_is_rejected_and_the_lease_still_holds,
    sweep_deletes_only_expired_records_in_bounded_batches,
    sweep_takes_the_oldest_expiry_first,
    stats_count_records_by_state,
    execute_runs_once_and_releases_on_error,
    execute_works_through_a_trait_object,
    execute_reports_in_progress_without_running,
    concurrent_claims_have_exactly_one_winner,
    expired_keys_are_reclaimed_once_while_sweeps_run,
    tokens_increase_and_leases_follow_releases_under_contention,
}

#[test]
fn redb_backend_matches_the_reference_model() {
    matches_the_reference_model::<Store>(64, reference::Ties::KeyHash, &|| {
        // Storage that survives a reopen, fresh for each case.
        let disk = reference::MemDisk::default();
        Ok(Box::new(move |clock: &ManualClock| {
            let settings = model_settings();
            let mut builder = Store::builder();
            builder
                .lease(settings.lease)
                .retention(settings.retention)
                .clock(clock.clone());
            builder.open_with_backend(disk.clone())
        }))
    });
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_backend_matches_the_reference_model() {
    use std::sync::Arc;
    let Some(url) = pg::url() else { return };
    // One schema for the whole run, emptied before each case; dropped at the end.
    let db = Arc::new(pg::Db::named(url, "model"));
    let cases = std::env::var("CONFORMANCE_MODEL_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(24);
    matches_the_reference_model::<idempotency_store::pg::PgStore>(
        cases,
        reference::Ties::Key,
        &|| {
            db.truncate()?;
            let db = Arc::clone(&db);
            Ok(Box::new(move |clock: &ManualClock| {
                db.connect(&model_settings(), clock)
            }))
        },
    );
}

/// Migrations are applied once, recorded, and refused when the schema is newer or foreign.
#[cfg(feature = "postgres")]
#[test]
fn postgres_migrations_are_idempotent_and_versioned() -> Result<()> {
    let Some(db) = pg::Db::fresh("migrations") else {
        return Ok(());
    };
    let (first, _) = db.open(&Settings::default())?;
    let lease = acquire(&first, &Key::new("k")?, fp("a"));
    // A second instance on the same schema migrates nothing and sees the record.
    let (second, _) = db.open(&Settings::default())?;
    assert!(matches!(
        second.claim(&Key::new("k")?, fp("a"))?,
        Claim::InProgress { .. }
    ));
    second.complete(&lease, Response::new(200, "by the other instance"))?;
    assert_eq!(
        db.query_i64("SELECT count(*) FROM {schema}.idempotency_schema_migrations")?,
        7
    );
    // A schema migrated by a newer version is refused.
    db.execute("INSERT INTO {schema}.idempotency_schema_migrations VALUES (99, 'future')")?;
    assert!(matches!(
        db.open(&Settings::default()),
        Err(Error::NotAStore { .. })
    ));
    // So is a schema holding a table of the same name that this crate did not create.
    let Some(foreign) = pg::Db::fresh("foreign") else {
        return Ok(());
    };
    foreign.execute("CREATE SCHEMA {schema}; CREATE TABLE {schema}.idempotency_keys (x int)")?;
    assert!(matches!(
        foreign.open(&Settings::default()),
        Err(Error::NotAStore { .. })
    ));
    Ok(())
}

/// Without prepared statements (behind a transaction pooler) the statements of a request's
/// path run as routines (PL/pgSQL procedures whose plans the server keeps), created once per
/// schema by a store that migrates; a store that does not migrate calls the routines it finds
/// and sends the statements themselves for the rest, with the same answers.
#[cfg(feature = "postgres")]
#[test]
fn postgres_without_prepared_statements_runs_routines() -> Result<()> {
    let Some(db) = pg::Db::fresh("routines") else {
        return Ok(());
    };
    if crate::common::pg::distributed() {
        // The routines are not distributed functions: the distributed mode refuses them.
        let refused = db.open_unprepared(true);
        assert!(
            matches!(&refused, Err(Error::InvalidConfig { reason }) if reason.contains("prepare_statements(false)")),
            "{refused:?}"
        );
        return Ok(());
    }
    let routines = "SELECT count(*) FROM pg_proc WHERE pronamespace = '{schema}'::regnamespace \
                    AND proname LIKE 'idempotency\\_q\\_%'";
    let first = db.open_unprepared(true)?;
    assert_eq!(db.query_i64(routines)?, 8);
    let key = Key::new("k")?;
    let lease = acquire(&first, &key, fp("a"));
    first.complete(&lease, Response::new(201, "charged"))?;
    assert!(
        matches!(first.claim(&key, fp("a"))?, Claim::Completed(r) if r.response == Response::new(201, "charged"))
    );
    assert!(matches!(
        first.claim(&key, fp("b"))?,
        Claim::Mismatch { .. }
    ));
    // A second store of this build finds them all and creates nothing.
    drop(db.open_unprepared(true)?);
    assert_eq!(db.query_i64(routines)?, 8);
    // The store calls them: a routine that fails fails the store's call.
    db.execute(
        "DO $$ DECLARE f regprocedure; BEGIN \
             SELECT p.oid::regprocedure INTO f FROM pg_proc AS p \
             WHERE p.pronamespace = '{schema}'::regnamespace \
             AND p.proname LIKE 'idempotency\\_q\\_insert\\_%'; \
             EXECUTE format('ALTER ROUTINE %s RENAME TO sabotaged', f); \
         END $$",
    )?;
    let without_insert = db.open_unprepared(false)?;
    let fresh = Key::new("fresh")?;
    let lease = acquire(&without_insert, &fresh, fp("a"));
    without_insert.complete(&lease, Response::new(200, "sent as a statement"))?;
    assert!(matches!(
        without_insert.claim(&fresh, fp("a"))?,
        Claim::Completed(r) if r.response == Response::new(200, "sent as a statement")
    ));
    assert!(first.claim(&Key::new("other")?, fp("a")).is_err());
    Ok(())
}

/// The store keeps nothing on a server session between its transactions, so that a
/// transaction pooler may hand the session to another client (PgBouncer 1.21+ carries the
/// prepared statements): with a session default of `synchronous_commit = local`, claims and
/// completions, prepared (the default) or not, leave it in force; each write raises it for its
/// own transaction only.
#[cfg(feature = "postgres")]
#[test]
fn postgres_sets_nothing_for_the_session() -> Result<()> {
    let Some(db) = pg::Db::fresh("session") else {
        return Ok(());
    };
    if std::env::var_os("IDEMPOTENCY_PG_POOLER").is_some() {
        // PgBouncer ignores the startup option (`ignore_startup_parameters`).
        eprintln!("skipped: IDEMPOTENCY_PG_POOLER is set, and this needs a direct server");
        return Ok(());
    }
    for prepare in [true, false] {
        if !prepare && crate::common::pg::distributed() {
            // Refused in the distributed mode (postgres_without_prepared_statements_runs_routines).
            continue;
        }
        let store = db.open_with("options", "-c synchronous_commit=local", prepare)?;
        for n in 0..3 {
            let key = Key::new(&format!("{prepare}-{n}"))?;
            let lease = acquire(&store, &key, fp("a"));
            store.complete(&lease, Response::new(201, "charged"))?;
            assert!(matches!(store.claim(&key, fp("a"))?, Claim::Completed(_)));
        }
        let session = store.read_with(|txn| {
            txn.query_one("SHOW synchronous_commit", &[])
                .map(|row| row.get::<_, String>(0))
        })?;
        assert_eq!(session.ok().as_deref(), Some("local"), "prepare: {prepare}");
    }
    Ok(())
}

/// A schema left at migration 2 by an older build (`idempotency_lock_key` in `LANGUAGE sql`)
/// is brought to the current version (the same function in PL/pgSQL, then in its cheaper
/// form), its records intact.
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_schema_at_migration_2_migrates() -> Result<()> {
    let Some(db) = pg::Db::fresh("migration_2") else {
        return Ok(());
    };
    let plpgsql = "SELECT count(*) FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang \
         WHERE p.pronamespace = '{schema}'::regnamespace AND p.proname = 'idempotency_lock_key' \
         AND l.lanname = 'plpgsql'";
    let (first, _) = db.open(&Settings::default())?;
    let held = acquire(&first, &Key::new("held")?, fp("a"));
    drop(first);
    assert_eq!(db.query_i64(plpgsql)?, 1);
    // Back to what migration 2 left: its function, and no record of the later migrations.
    db.execute(
        "DELETE FROM {schema}.idempotency_schema_migrations WHERE version >= 3; \
         CREATE OR REPLACE FUNCTION {schema}.idempotency_lock_key(p_scope text, p_key text) \
         RETURNS bigint LANGUAGE sql VOLATILE AS $f$ \
             SELECT pg_advisory_xact_lock(1768187245, hashtext(p_scope || chr(1) || p_key)); \
             SELECT count(*) FROM (SELECT 1 FROM {schema}.idempotency_keys AS x \
                 WHERE x.scope = p_scope AND x.key = p_key FOR UPDATE) AS held; \
         $f$;",
    )?;
    assert_eq!(db.query_i64(plpgsql)?, 0);
    let (store, _) = db.open(&Settings::default())?;
    assert_eq!(db.query_i64(plpgsql)?, 1);
    // Migration 4's form: the advisory lock as an assignment, the row lock by `PERFORM`.
    let cheap = format!(
        "{plpgsql} AND p.prosrc LIKE '%done := pg_advisory_xact_lock%' \
         AND p.prosrc NOT LIKE '%count(*)%'"
    );
    assert_eq!(db.query_i64(&cheap)?, 1);
    assert_eq!(
        db.query_i64("SELECT max(version)::bigint FROM {schema}.idempotency_schema_migrations")?,
        7
    );
    // The record survived, and claims (which call the new function) work.
    assert!(matches!(
        store.claim(&Key::new("held")?, fp("a"))?,
        Claim::InProgress { .. }
    ));
    store.complete(&held, Response::new(200, "before the migration"))?;
    let fresh = acquire(&store, &Key::new("fresh")?, fp("b"));
    assert!(fresh.token() > held.token());
    store.complete(&fresh, Response::new(200, "after the migration"))?;
    Ok(())
}

/// Without an injected clock, time is the database server's.
#[cfg(feature = "postgres")]
#[test]
fn postgres_uses_the_server_clock_by_default() -> Result<()> {
    let Some(db) = pg::Db::fresh("server_clock") else {
        return Ok(());
    };
    let store = db.open_with_server_clock()?;
    let before = store.now()?;
    let Claim::Acquired(lease) = store.claim(&Key::new("k")?, fp("a"))? else {
        panic!("not acquired");
    };
    let after = store.now()?;
    let started = lease.lease_until().as_millis() - LEASE.as_millis() as u64;
    assert!(
        (before.as_millis()..=after.as_millis()).contains(&started),
        "claimed at {started}, outside [{before:?}, {after:?}]"
    );
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    assert!(
        started.abs_diff(wall) < 60_000,
        "server time {started}, local {wall}"
    );
    Ok(())
}

/// A claim of `k` (fingerprint "b") started while a transaction of the test's own deleted the
/// key's record (under the key's lock if `key_lock`) and has not committed: checks that the
/// claim waits, commits once `released_at` gave the release's time, and returns the lease the
/// claim then got, with that time.
#[cfg(feature = "postgres")]
fn claim_behind_a_deletion(
    db: &pg::Db,
    store: &idempotency_store::pg::PgStore,
    key_lock: bool,
    released_at: impl FnOnce() -> Result<u64>,
) -> Result<(Lease, u64)> {
    let mut client = db.client()?;
    let mut txn = client.transaction().map_err(pg::fixture)?;
    if key_lock {
        txn.execute(&db.key_lock()?, &[&"", &"k"])
            .map_err(pg::fixture)?;
    }
    txn.execute(
        db.sql("DELETE FROM {schema}.idempotency_keys WHERE key = 'k'")
            .as_str(),
        &[],
    )
    .map_err(pg::fixture)?;
    std::thread::scope(|s| {
        let claimer = s.spawn(|| store.claim(&Key::new("k")?, fp("b")));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !claimer.is_finished(),
            "the claim did not wait for the release in flight"
        );
        let released_at = released_at()?;
        txn.commit().map_err(pg::fixture)?;
        match claimer.join().expect("claimer panicked")? {
            Claim::Acquired(lease) => Ok((lease, released_at)),
            other => panic!("expected Acquired, got {other:?}"),
        }
    })
}

/// A claim that waits behind a release in flight (its transaction deleted the record but has
/// not committed) takes its token and time after the release, not when the claim started: its
/// lease is live when it returns and begins no earlier than the release.
#[cfg(feature = "postgres")]
#[test]
fn postgres_claim_behind_a_release_in_flight_is_stamped_after_it() -> Result<()> {
    let Some(db) = pg::Db::fresh("release_in_flight") else {
        return Ok(());
    };
    let (store, clock) = db.open(&Settings::default())?;
    let first = acquire(&store, &Key::new("k")?, fp("a"));
    let (lease, released_at) = claim_behind_a_deletion(&db, &store, false, || {
        clock.advance(2 * LEASE);
        Ok(clock.now().as_millis())
    })?;
    let granted_at = lease.lease_until().as_millis() - LEASE.as_millis() as u64;
    assert!(
        granted_at >= released_at,
        "the lease began at {granted_at}, before the release at {released_at}"
    );
    assert!(
        lease.lease_until() > clock.now(),
        "granted a lease that had already lapsed ({:?})",
        lease.lease_until()
    );
    assert!(lease.token() > first.token(), "{lease:?} after {first:?}");
    Ok(())
}

/// The same with the server's clock, where the claim of a new key is one statement that takes
/// the key's lock and only then reads the time: a deletion made as the table's comment says
/// (under the key's lock) holds the claim back until it commits, so the lease begins no
/// earlier than the release's commit, by the server's clock.
#[cfg(feature = "postgres")]
#[test]
fn postgres_claim_behind_a_release_in_flight_is_stamped_after_it_on_the_server_clock() -> Result<()>
{
    let Some(db) = pg::Db::fresh("release_in_flight_server") else {
        return Ok(());
    };
    let store = db.open_with_server_clock()?;
    let first = acquire(&store, &Key::new("k")?, fp("a"));
    let (lease, released_at) =
        claim_behind_a_deletion(&db, &store, true, || Ok(store.now()?.as_millis()))?;
    let granted_at = lease.lease_until().as_millis() - LEASE.as_millis() as u64;
    assert!(
        granted_at >= released_at,
        "the lease began at {granted_at}, before the release at {released_at}"
    );
    assert!(lease.token() > first.token(), "{lease:?} after {first:?}");
    Ok(())
}

/// Every claim and every deletion takes the key's lock: while another transaction holds it, a
/// claim of a new key and a release wait for it, and a sweep leaves that key's expired record
/// alone (and deletes it once the lock is free); keys whose lock is free are not held up.
#[cfg(feature = "postgres")]
#[test]
fn postgres_claims_and_deletions_take_the_key_lock() -> Result<()> {
    let Some(db) = pg::Db::fresh("key_lock") else {
        return Ok(());
    };
    let (store, clock) = db.open(&Settings::default())?;
    let held = acquire(&store, &Key::new("held")?, fp("a"));
    let expired = acquire(&store, &Key::new("expired")?, fp("a"));
    let other = acquire(&store, &Key::new("other")?, fp("a"));
    drop((expired, other));
    clock.advance(Duration::from_secs(25 * 3600));
    let held = {
        // Its record expired too: take it over so that there is a live lease to release.
        let lease = acquire(&store, &Key::new("held")?, fp("a"));
        assert!(lease.token() > held.token());
        lease
    };
    let key_lock = db.key_lock()?;
    let mut client = db.client()?;
    let mut txn = client.transaction().map_err(pg::fixture)?;
    for key in ["new", "held", "expired"] {
        txn.execute(&key_lock, &[&"", &key]).map_err(pg::fixture)?;
    }
    std::thread::scope(|s| -> Result<()> {
        let claimer = s.spawn(|| store.claim(&Key::new("new")?, fp("b")));
        let releaser = s.spawn(|| store.release(&held));
        // A sweep does not wait: it deletes `other` and skips `expired`.
        assert_eq!(store.sweep(10)?, 1);
        assert_eq!(store.sweep(10)?, 0);
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !claimer.is_finished(),
            "the claim did not wait for the key lock"
        );
        assert!(
            !releaser.is_finished(),
            "the release did not wait for the key lock"
        );
        assert!(
            store.lookup(&Key::new("held")?)?.is_some(),
            "released under the lock"
        );
        txn.commit().map_err(pg::fixture)?;
        assert!(matches!(
            claimer.join().expect("claimer panicked")?,
            Claim::Acquired(_)
        ));
        releaser.join().expect("releaser panicked")?;
        Ok(())
    })?;
    assert!(store.lookup(&Key::new("held")?)?.is_none());
    assert_eq!(
        store.sweep(10)?,
        1,
        "the expired record, once its lock was free"
    );
    Ok(())
}

/// `force_release` waits for the key's lock with a snapshot taken before the wait; when a claim
/// replaced the record meanwhile, it releases the new in-progress record rather than call it
/// completed.
#[cfg(feature = "postgres")]
#[test]
fn postgres_force_release_behind_a_replaced_record_releases_the_new_one() -> Result<()> {
    let Some(db) = pg::Db::fresh("force_release_replaced") else {
        return Ok(());
    };
    let (store, clock) = db.open(&Settings::default())?;
    let key = Key::new("k")?;
    let _old = acquire(&store, &key, fp("a"));
    let now = clock.now().as_millis() as i64;
    let mut client = db.client()?;
    let mut txn = client.transaction().map_err(pg::fixture)?;
    txn.execute(&db.key_lock()?, &[&"", &"k"])
        .map_err(pg::fixture)?;
    std::thread::scope(|s| -> Result<()> {
        let releaser = s.spawn(|| store.force_release(&key));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !releaser.is_finished(),
            "force_release did not wait for the key lock"
        );
        // What a release and a new claim (attempt 3, to tell it apart) would leave.
        txn.batch_execute(&db.sql(&format!(
            "DELETE FROM {{schema}}.idempotency_keys WHERE key = 'k'; \
             INSERT INTO {{schema}}.idempotency_keys (scope, key, fingerprint, \
                 fingerprint_version, state, token, attempt, lease_until, created_at, expires_at) \
             VALUES ('', 'k', '\\x{}'::bytea, 1, 'in_progress', 1000000, 3, {}, {now}, {})",
            "00".repeat(32),
            now + 60_000,
            now + 86_400_000
        )))
        .map_err(pg::fixture)?;
        txn.commit().map_err(pg::fixture)?;
        let released = releaser.join().expect("releaser panicked")?;
        assert!(
            matches!(
                released,
                idempotency_store::admin::ForceRelease::Released { attempt: 3, .. }
            ),
            "{released:?}"
        );
        Ok(())
    })?;
    assert!(store.lookup(&key)?.is_none());
    Ok(())
}

/// A sweep larger than one statement's share of locks runs in several statements and deletes
/// exactly its limit, oldest first.
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_large_sweep_deletes_exactly_its_limit() -> Result<()> {
    let Some(db) = pg::Db::fresh("large_sweep") else {
        return Ok(());
    };
    let (store, clock) = db.open(&Settings::default())?;
    for i in 0..1_200 {
        let lease = acquire(&store, &Key::new(&format!("k{i:04}"))?, fp("a"));
        store.complete(&lease, Response::new(200, "done"))?;
        clock.advance(Duration::from_millis(1));
    }
    clock.advance(Duration::from_secs(25 * 3600));
    assert_eq!(store.sweep(1_100)?, 1_100);
    assert!(store.lookup(&Key::new("k1099")?)?.is_none());
    assert_eq!(
        db.query_i64("SELECT count(*) FROM {schema}.idempotency_keys WHERE key >= 'k1100'")?,
        100
    );
    assert_eq!(store.sweep(1_100)?, 100);
    Ok(())
}

/// A pooled connection that the server dropped fails at most one call, then is replaced.
#[cfg(feature = "postgres")]
#[test]
fn postgres_replaces_a_connection_the_server_dropped() -> Result<()> {
    let Some(db) = pg::Db::fresh("dropped") else {
        return Ok(());
    };
    if std::env::var_os("IDEMPOTENCY_PG_POOLER").is_some() {
        // Through a pooler, the server drops the pooler's connection, not the store's.
        eprintln!("skipped: IDEMPOTENCY_PG_POOLER is set, and this needs a direct server");
        return Ok(());
    }
    let name = format!("conformance_dropped_{}", std::process::id());
    let store = db.open_named(&name)?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    db.execute(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{name}'"
    ))?;
    let mut failures = 0;
    let outcome = loop {
        match store.complete(&lease, Response::new(200, "after the drop")) {
            Err(Error::Storage { .. }) if failures == 0 => failures += 1,
            other => break other,
        }
    };
    outcome?;
    assert!(matches!(store.claim(&key, fp("a"))?, Claim::Completed(_)));
    println!("calls failed by the dropped connection: {failures}");
    Ok(())
}

/// A wrong password or an unparsable URL fails `connect` at once, with the reason.
#[cfg(feature = "postgres")]
#[test]
fn postgres_connect_fails_fast_on_bad_credentials() {
    let Some(url) = pg::url() else { return };
    assert!(matches!(
        idempotency_store::pg::PgStore::connect("postgresql://[::1"),
        Err(Error::InvalidConfig { .. })
    ));
    if url.starts_with("postgres") {
        return; // a URL-style address cannot simply be overridden below
    }
    let started = std::time::Instant::now();
    let wrong = idempotency_store::pg::PgStore::connect(&format!("{url} password=wrong-{}", T0));
    match wrong {
        Err(err @ Error::Storage { .. }) => {
            let mut chain = Vec::new();
            let mut cause = std::error::Error::source(&err);
            while let Some(c) = cause {
                chain.push(c.to_string());
                cause = c.source();
            }
            assert!(
                chain
                    .iter()
                    .any(|c| c.contains("password authentication failed")),
                "{chain:?}"
            );
        }
        other => panic!("expected a storage error, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}

/// PostgreSQL fixtures: the server's URL, and schemas that exist for one test.
#[cfg(feature = "postgres")]
mod pg {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Mutex, PoisonError};

    use idempotency_store::{Error, ManualClock, Result, Timestamp, pg::PgStore};

    use super::{Settings, T0};

    pub use crate::common::pg::url;

    /// A fixture's own failure, as an error the test returns.
    pub fn fixture(e: postgres::Error) -> Error {
        Error::InvalidConfig {
            reason: format!("test fixture: {e}"),
        }
    }

    /// A schema of its own, dropped (with everything in it) when this is dropped.
    pub struct Db {
        url: String,
        schema: String,
    }

    impl Db {
        /// A fresh schema for the test `name`, or `None` if there is no server to test on.
        pub fn fresh(name: &str) -> Option<Db> {
            url().map(|url| Db::named(url, name))
        }

        /// A schema unique to this process and call, derived from `name`.
        pub fn named(url: String, name: &str) -> Db {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::Relaxed);
            let short: String = name.chars().take(40).collect();
            let schema = format!("conf_{short}_{}_{n}", std::process::id());
            let db = Db { url, schema };
            db.drop_schema();
            db
        }

        /// A store on this schema (created on first use) with the test's settings.
        pub fn open(&self, settings: &Settings) -> Result<(PgStore, ManualClock)> {
            let clock = ManualClock::new(Timestamp::from_millis(T0));
            Ok((self.connect(settings, &clock)?, clock))
        }

        pub fn connect(&self, settings: &Settings, clock: &ManualClock) -> Result<PgStore> {
            let mut builder = crate::common::pg::builder();
            builder
                .schema(self.schema.as_str())
                .lease(settings.lease)
                .retention(settings.retention)
                .pool_size(4)
                .clock(clock.clone());
            if let Some(len) = settings.max_key_len {
                builder.max_key_len(len);
            }
            if let Some(bytes) = settings.max_response_bytes {
                builder.max_response_bytes(bytes);
            }
            builder.connect(&self.url)
        }

        /// A store on this schema without prepared statements, as behind a transaction
        /// pooler, migrating (and so creating its routines) only if `migrate`.
        pub fn open_unprepared(&self, migrate: bool) -> Result<PgStore> {
            crate::common::pg::builder()
                .schema(self.schema.as_str())
                .lease(super::LEASE)
                .pool_size(2)
                .prepare_statements(false)
                .migrate(migrate)
                .connect(&self.url)
        }

        /// A store on this schema with default settings and the server's clock.
        pub fn open_with_server_clock(&self) -> Result<PgStore> {
            crate::common::pg::builder()
                .schema(self.schema.as_str())
                .lease(super::LEASE)
                .pool_size(2)
                .connect(&self.url)
        }

        /// A store on this schema with one pooled connection, named `application_name`.
        pub fn open_named(&self, application_name: &str) -> Result<PgStore> {
            self.open_with("application_name", application_name, true)
        }

        /// A store on this schema with one connection, whose connection string also sets
        /// `key` to `value`, preparing its statements if `prepare`.
        pub fn open_with(&self, key: &str, value: &str, prepare: bool) -> Result<PgStore> {
            let url = if self.url.starts_with("postgres") {
                let sep = if self.url.contains('?') { '&' } else { '?' };
                let value = value.replace(' ', "%20").replace('=', "%3D");
                format!("{}{sep}{key}={value}", self.url)
            } else {
                format!("{} {key}='{}'", self.url, value.replace('\'', "\\'"))
            };
            crate::common::pg::builder()
                .schema(self.schema.as_str())
                .pool_size(1)
                .prepare_statements(prepare)
                .connect(&url)
        }

        /// Runs `sql` with `{schema}` replaced by this schema's quoted name.
        pub fn execute(&self, sql: &str) -> Result<()> {
            self.admin(&self.sql(sql))
        }

        /// `sql` with `{schema}` replaced by this schema's quoted name.
        pub fn sql(&self, sql: &str) -> String {
            sql.replace("{schema}", &format!("\"{}\"", self.schema))
        }

        /// A connection of the test's own (for transactions it holds open).
        pub fn client(&self) -> Result<postgres::Client> {
            postgres::Client::connect(
                &self.url.replace(" prepare_statements=false", ""),
                postgres::NoTls,
            )
            .map_err(fixture)
        }

        /// The first column of the first row of `sql` (with `{schema}` replaced).
        pub fn query_i64(&self, sql: &str) -> Result<i64> {
            let sql = sql.replace("{schema}", &format!("\"{}\"", self.schema));
            let mut client = postgres::Client::connect(
                &self.url.replace(" prepare_statements=false", ""),
                postgres::NoTls,
            )
            .map_err(|e| Error::InvalidConfig {
                reason: format!("test fixture: {e}"),
            })?;
            // Unnamed (`query_typed`), so that it works through a transaction-pooling proxy.
            client
                .query_typed_one(sql.as_str(), &[])
                .and_then(|row| row.try_get(0))
                .map_err(|e| Error::InvalidConfig {
                    reason: format!("test fixture: {e}"),
                })
        }

        /// The key lock of the table's comment (`$1` scope, `$2` key).
        pub fn key_lock(&self) -> Result<String> {
            crate::common::pg::documented_key_lock(&mut self.client()?, &self.schema)
        }

        /// Deletes every record (keeps the schema).
        pub fn truncate(&self) -> Result<()> {
            self.admin(&format!(
                "DO $$ BEGIN IF to_regclass('\"{0}\".idempotency_keys') IS NOT NULL THEN \
                 TRUNCATE \"{0}\".idempotency_keys; END IF; END $$",
                self.schema
            ))
        }

        fn drop_schema(&self) {
            if let Err(e) = self.admin(&format!(
                "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
                self.schema
            )) {
                eprintln!("could not drop schema {}: {e}", self.schema);
            }
        }

        /// Runs `sql` on one connection shared by every fixture of the process (a connection
        /// costs a SCRAM handshake, slow in debug builds).
        fn admin(&self, sql: &str) -> Result<()> {
            static ADMIN: Mutex<Option<postgres::Client>> = Mutex::new(None);
            let fail = |e: postgres::Error| Error::InvalidConfig {
                reason: format!("test fixture: {e}"),
            };
            let mut admin = ADMIN.lock().unwrap_or_else(PoisonError::into_inner);
            let client = match &mut *admin {
                Some(client) if !client.is_closed() => client,
                slot => slot.insert(
                    postgres::Client::connect(
                        &self.url.replace(" prepare_statements=false", ""),
                        postgres::NoTls,
                    )
                    .map_err(fail)?,
                ),
            };
            client.batch_execute(sql).map_err(fail)
        }
    }

    impl Drop for Db {
        fn drop(&mut self) {
            self.drop_schema();
        }
    }
}
