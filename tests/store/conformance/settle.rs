//! Settling: fencing, release, heartbeat and checkpoint; lookups and scopes.

use std::time::Duration;

use idempotency_store::{Claim, Error, IdempotencyStore, Key, RecordState, Response, Result};

use super::{Factory, LEASE, Settings, acquire, at, fp};

pub(super) fn fencing_rejects_the_old_holder_and_changes_nothing<S: IdempotencyStore>(
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

pub(super) fn a_lapsed_lease_nobody_took_over_still_completes<S: IdempotencyStore>(
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

pub(super) fn a_settled_lease_cannot_settle_again<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
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

pub(super) fn release_lets_a_retry_run_afresh<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
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

pub(super) fn heartbeat_extends_the_lease_from_now<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
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

pub(super) fn checkpoints_replace_each_other_and_survive_a_takeover<S: IdempotencyStore>(
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

pub(super) fn lookup_reports_the_record_view<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
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

pub(super) fn scopes_are_isolated<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
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
