//! `execute`: runs once, releases on error, works through a trait object.

use idempotency_store::{Claim, IdempotencyStore, Key, Response, Result};

use super::{Factory, Settings, acquire, at, fp};

pub(super) fn execute_runs_once_and_releases_on_error<S: IdempotencyStore>(
    open: Factory<S>,
) -> Result<()> {
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

pub(super) fn execute_works_through_a_trait_object<S: IdempotencyStore + 'static>(
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

pub(super) fn execute_reports_in_progress_without_running<S: IdempotencyStore>(
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
