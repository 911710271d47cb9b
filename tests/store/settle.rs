//! Settling after an error whose outcome is unknown, on both backends through the shared
//! trait: a claim retried with its claim id gets its own lease back, a completion retried with
//! the same lease and response finds its own completion, a release retried finds the record
//! gone; and each fails (`InProgress`, `LeaseLost`) when another attempt holds or settled the
//! key. The PostgreSQL half needs `IDEMPOTENCY_PG_URL` (skipped with a printed reason without
//! it, failed under `CI=true`); tests/pg_faults.rs makes the errors real.

use std::time::Duration;

use idempotency_store::{
    Claim, ClaimId, Error, Fingerprint, IdempotencyStore, Key, ManualClock, Response, Result,
    Store, Timestamp,
};

const LEASE: Duration = Duration::from_secs(10);

fn fp() -> Fingerprint {
    Fingerprint::of(["POST", "/payments", "4999"])
}

fn acquired(claim: Claim) -> idempotency_store::Lease {
    match claim {
        Claim::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// The same claim id gets the same lease back while it is live; any other id (or none) hears
/// "in progress"; once the lease lapsed, the same id takes it over as a new attempt.
fn claim_id_recovers_its_lease(store: &dyn IdempotencyStore, clock: &ManualClock) -> Result<()> {
    let key = Key::new("claim-id")?;
    let (mine, other) = (ClaimId::random(), ClaimId::random());
    let won = acquired(store.claim_with_id(&key, fp(), mine)?);
    let again = acquired(store.claim_with_id(&key, fp(), mine)?);
    assert_eq!(
        (again.token(), again.attempt(), again.lease_until()),
        (won.token(), won.attempt(), won.lease_until())
    );
    assert!(matches!(
        store.claim_with_id(&key, fp(), other)?,
        Claim::InProgress { .. }
    ));
    assert!(matches!(store.claim(&key, fp())?, Claim::InProgress { .. }));
    // Another request with the same id is still another request.
    assert!(matches!(
        store.claim_with_id(&key, Fingerprint::of(["other"]), mine)?,
        Claim::Mismatch { .. }
    ));
    // The recovered lease is the lease: it completes, and the first handle is then settled.
    store.complete(&again, Response::new(201, "paid"))?;
    assert!(matches!(
        store.complete(&won, Response::new(201, "paid")),
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.claim_with_id(&key, fp(), mine)?,
        Claim::Completed(r) if r.response.body == b"paid"
    ));

    let key = Key::new("claim-id-lapsed")?;
    let first = acquired(store.claim_with_id(&key, fp(), mine)?);
    clock.advance(LEASE);
    let taken = acquired(store.claim_with_id(&key, fp(), mine)?);
    assert!(taken.token() > first.token());
    assert_eq!(taken.attempt(), 2);
    Ok(())
}

/// A completion retried after an outcome-unknown error answers `Ok` when its own completion
/// is stored, and `LeaseLost` for another response or when another attempt settled the key.
/// Without the error before it, a settled lease stays settled.
fn completion_retry_finds_its_own(store: &dyn IdempotencyStore, clock: &ManualClock) -> Result<()> {
    let key = Key::new("complete-retry")?;
    let lease = acquired(store.claim(&key, fp())?);
    store.complete(&lease, Response::new(201, "paid"))?;
    assert!(matches!(
        store.complete(&lease, Response::new(201, "paid")),
        Err(Error::LeaseLost)
    ));
    lease.mark_in_doubt();
    store.complete(&lease, Response::new(201, "paid"))?;
    assert!(matches!(
        store.complete(&lease, Response::new(201, "paid twice")),
        Err(Error::LeaseLost)
    ));

    // Taken over and settled by the next attempt: the old lease's retry is refused.
    let key = Key::new("complete-retry-taken")?;
    let old = acquired(store.claim(&key, fp())?);
    clock.advance(LEASE);
    let new = acquired(store.claim(&key, fp())?);
    store.complete(&new, Response::new(201, "paid"))?;
    old.mark_in_doubt();
    assert!(matches!(
        store.complete(&old, Response::new(201, "paid")),
        Err(Error::LeaseLost)
    ));
    assert!(matches!(store.release(&old), Err(Error::LeaseLost)));
    Ok(())
}

/// A release retried after an outcome-unknown error answers `Ok` once the record is gone,
/// and `LeaseLost` once another attempt holds the key.
fn release_retry_finds_it_gone(store: &dyn IdempotencyStore) -> Result<()> {
    let key = Key::new("release-retry")?;
    let lease = acquired(store.claim(&key, fp())?);
    store.release(&lease)?;
    assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
    lease.mark_in_doubt();
    store.release(&lease)?;
    let next = acquired(store.claim(&key, fp())?);
    assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
    store.release(&next)?;
    Ok(())
}

/// `execute` stores a substitute for a response too large to keep, and runs the operation
/// once across retries, also after the lease would have lapsed.
fn execute_keeps_an_oversize_answer_out<S: IdempotencyStore>(
    store: &S,
    clock: &ManualClock,
    limit: usize,
) -> Result<()> {
    let key = Key::new("oversize")?;
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let big = |_: &mut idempotency_store::Lease| {
        runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok::<_, ()>(Response::new(201, vec![b'x'; limit + 1]))
    };
    let Claim::Acquired(Ok(stored)) = store.execute(&key, fp(), big)? else {
        panic!("not executed");
    };
    assert_eq!(stored.status, 500);
    assert!(String::from_utf8_lossy(&stored.body).contains("response-not-stored"));
    for _ in 0..3 {
        clock.advance(LEASE);
        match store.execute(&key, fp(), big)? {
            Claim::Completed(replay) => assert_eq!(replay.response, stored),
            other => panic!("expected the substitute replayed, got {other:?}"),
        }
    }
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    Ok(())
}

fn all<S: IdempotencyStore>(store: &S, clock: &ManualClock, limit: usize) -> Result<()> {
    claim_id_recovers_its_lease(store, clock)?;
    completion_retry_finds_its_own(store, clock)?;
    release_retry_finds_it_gone(store)?;
    execute_keeps_an_oversize_answer_out(store, clock, limit)
}

fn settles_after_unknown_outcomes<S: IdempotencyStore>(
    (store, clock): (S, ManualClock),
) -> Result<()> {
    all(&store, &clock, 1024)
}

fn redb() -> Result<(Store, ManualClock)> {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let store = Store::builder()
        .clock(clock.clone())
        .lease(LEASE)
        .max_response_bytes(1024)
        .open_in_memory()?;
    Ok((store, clock))
}

#[cfg(feature = "postgres")]
fn pg_schema(test: &str) -> Option<crate::common::pg::Schema> {
    crate::common::pg::Schema::fresh("settle", test)
}

#[cfg(feature = "postgres")]
fn pg(schema: &crate::common::pg::Schema) -> Result<(idempotency_store::pg::PgStore, ManualClock)> {
    let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
    let store = schema
        .store_builder()
        .clock(clock.clone())
        .lease(LEASE)
        .max_response_bytes(1024)
        .connect(&schema.url)?;
    Ok((store, clock))
}

on_both_backends! {
    redb: super::redb()?,
    postgres(schema = super::pg_schema): super::pg(&schema)?;
    settles_after_unknown_outcomes,
}

/// The claim id and the completing token survive a reopen of the file (they are in the
/// record, not in memory).
#[test]
fn redb_store_keeps_claim_ids_and_completing_tokens_in_the_file() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| Error::InvalidConfig {
        reason: e.to_string(),
    })?;
    let path = dir.path().join("settle.redb");
    let key = Key::new("reopen")?;
    let (id, done) = (ClaimId::random(), Key::new("reopen-done")?);
    let (token, lease) = {
        let store = Store::builder().open(&path)?;
        let done_lease = acquired(store.claim(&done, fp())?);
        store.complete(&done_lease, Response::new(201, "paid"))?;
        let lease = acquired(store.claim_with_id(&key, fp(), id)?);
        (lease.token(), done_lease)
    };
    let store = Store::builder().open(&path)?;
    assert_eq!(
        acquired(store.claim_with_id(&key, fp(), id)?).token(),
        token
    );
    lease.mark_in_doubt();
    store.complete(&lease, Response::new(201, "paid"))?;
    Ok(())
}
