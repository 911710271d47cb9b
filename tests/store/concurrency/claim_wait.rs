//! `claim_wait`: woken by its own key's completion or release, not by others, and answering
//! `InProgress` after its timeout.

use std::thread;
use std::time::{Duration, Instant};

use idempotency_store::{
    Claim, IdempotencyStore, Key, ManualClock, Response, Result, Store, Timestamp,
};

use super::{T0, fp, join, key, key_response};

/// A store, a key already held by the test, and the holder's lease. In memory: waking does not
/// depend on the storage, and no fsync queue on a shared disk blurs the timings.
fn held_key(name: &str) -> Result<(Store, Key, idempotency_store::Lease)> {
    let store = Store::builder()
        .clock(ManualClock::new(Timestamp::from_millis(T0)))
        .lease(Duration::from_secs(60))
        .open_in_memory()?;
    let key = Key::new(name)?;
    let Claim::Acquired(lease) = store.claim(&key, fp(name))? else {
        panic!("fresh key not acquired");
    };
    Ok((store, key, lease))
}

#[test]
fn claim_wait_returns_the_replay_right_after_the_holder_completes() -> Result<()> {
    let (store, key, lease) = held_key("wait-complete")?;
    let f = fp("wait-complete");
    let wakeups = store.wait_wakeups();
    let response = Response::new(201, "done");
    let (claim, returned, called, completed) = thread::scope(|s| -> Result<_> {
        let waiter = s.spawn(|| {
            let claim = store.claim_wait(&key, f, Duration::from_secs(10));
            (claim, Instant::now())
        });
        // Let the waiter block first.
        thread::sleep(Duration::from_millis(200));
        let called = Instant::now();
        store.complete(&lease, response.clone())?;
        let completed = Instant::now();
        let (claim, returned) = join(waiter);
        Ok((claim?, returned, called, completed))
    })?;
    let since_call = returned.duration_since(called);
    let since_return = returned.saturating_duration_since(completed);
    println!(
        "claim_wait returned {since_call:?} after complete() was called \
         ({since_return:?} after it returned; complete() itself took {:?})",
        completed.duration_since(called)
    );
    match claim {
        Claim::Completed(replay) => assert_eq!(replay.response, response),
        other => panic!("expected the replay, got {other:?}"),
    }
    assert!(
        since_call < Duration::from_millis(200),
        "the waiter took {since_call:?} to see the completion"
    );
    assert_eq!(
        store.wait_wakeups(),
        wakeups + 1,
        "the waiter was woken by the completion, not by polling"
    );
    Ok(())
}

#[test]
fn claim_wait_answers_in_progress_after_its_timeout() -> Result<()> {
    let (store, key, lease) = held_key("wait-timeout")?;
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let claim = store.claim_wait(&key, fp("wait-timeout"), timeout)?;
    let waited = started.elapsed();
    println!("claim_wait with a {timeout:?} timeout returned after {waited:?}");
    match claim {
        Claim::InProgress {
            attempt,
            lease_until,
        } => {
            assert_eq!(attempt, 1);
            assert_eq!(lease_until, lease.lease_until());
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert!(waited >= timeout, "returned early, after {waited:?}");
    assert!(
        waited < timeout + Duration::from_secs(2),
        "overslept: {waited:?}"
    );
    assert_eq!(store.wait_wakeups(), 0, "a timeout is not a wake-up");
    Ok(())
}

#[test]
fn claim_wait_is_not_woken_by_other_keys() -> Result<()> {
    const OTHERS: usize = 20;
    let (store, a, _held) = held_key("wait-a")?;
    let fa = fp("wait-a");
    let fb = fp("wait-b");
    let timeout = Duration::from_secs(2);
    let before = store.wait_wakeups();
    let (claim_a, a_returned, others_done) = thread::scope(|s| -> Result<_> {
        let waiter = s.spawn(|| {
            let claim = store.claim_wait(&a, fa, timeout);
            (claim, Instant::now())
        });
        thread::sleep(Duration::from_millis(100));
        // Settle many other keys while A waits: nobody waits on them, so no wake-up at all.
        for i in 0..OTHERS {
            let b = key("wait-b", i);
            let Claim::Acquired(lease) = store.claim(&b, fb)? else {
                panic!("fresh key not acquired");
            };
            if i % 2 == 0 {
                store.complete(&lease, key_response(i))?;
            } else {
                store.release(&lease)?;
            }
        }
        assert_eq!(
            store.wait_wakeups(),
            before,
            "settling other keys woke a waiter"
        );
        // Control: a waiter on another key is woken by that key's completion, once.
        let control = key("wait-b", OTHERS);
        let Claim::Acquired(lease) = store.claim(&control, fb)? else {
            panic!("fresh key not acquired");
        };
        let control_waiter = {
            let store = &store;
            s.spawn(move || store.claim_wait(&control, fb, timeout))
        };
        thread::sleep(Duration::from_millis(100));
        store.complete(&lease, key_response(OTHERS))?;
        let control_claim = join(control_waiter)?;
        assert!(
            matches!(control_claim, Claim::Completed(_)),
            "control waiter: {control_claim:?}"
        );
        let others_done = Instant::now();
        let (claim_a, a_returned) = join(waiter);
        Ok((claim_a?, a_returned, others_done))
    })?;
    assert!(
        others_done < a_returned,
        "the other keys settled only after A's waiter had timed out; the test proves nothing"
    );
    assert!(
        matches!(claim_a, Claim::InProgress { attempt: 1, .. }),
        "A's waiter got {claim_a:?}"
    );
    assert_eq!(
        store.wait_wakeups(),
        before + 1,
        "only the control waiter was woken, once"
    );
    Ok(())
}

#[test]
fn claim_wait_acquires_when_the_holder_releases() -> Result<()> {
    let (store, key, lease) = held_key("wait-release")?;
    let f = fp("wait-release");
    let wakeups = store.wait_wakeups();
    let (claim, since_release) = thread::scope(|s| -> Result<_> {
        let waiter = s.spawn(|| {
            let claim = store.claim_wait(&key, f, Duration::from_secs(10));
            (claim, Instant::now())
        });
        thread::sleep(Duration::from_millis(100));
        let called = Instant::now();
        store.release(&lease)?;
        let (claim, returned) = join(waiter);
        Ok((claim?, returned.duration_since(called)))
    })?;
    println!("claim_wait acquired {since_release:?} after release() was called");
    match claim {
        Claim::Acquired(new) => {
            assert_eq!(new.attempt(), 1, "a released key is claimed afresh");
            assert!(new.token() > lease.token());
        }
        other => panic!("expected Acquired, got {other:?}"),
    }
    assert!(
        since_release < Duration::from_millis(200),
        "took {since_release:?}"
    );
    assert_eq!(store.wait_wakeups(), wakeups + 1);
    Ok(())
}
