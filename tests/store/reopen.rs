//! What survives closing and reopening the file.

use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{
    Claim, Error, Fingerprint, Key, ManualClock, Response, Result, Store, Timestamp,
};

fn open(path: &std::path::Path, clock: &ManualClock) -> Result<Store> {
    Store::builder()
        .lease(Duration::from_secs(60))
        .clock(clock.clone())
        .open(path)
}

#[test]
fn completed_response_replays_after_reopen() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let key = Key::scoped("t", "k")?;
    let f = Fingerprint::of(["a"]);
    let response = Response::new(202, vec![7u8; 5000]).with_header("Location", "/x/1");
    {
        let store = open(&path, &clock)?;
        let Claim::Acquired(lease) = store.claim(&key, f)? else {
            panic!()
        };
        store.complete(&lease, response.clone())?;
    }
    let store = open(&path, &clock)?;
    let Claim::Completed(replay) = store.claim(&key, f)? else {
        panic!("no replay after reopen")
    };
    assert_eq!(replay.response, response);
    assert!(store.verify()?.is_clean());
    Ok(())
}

#[test]
fn in_progress_survives_reopen_and_is_taken_over_only_after_its_lease() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let key = Key::new("k")?;
    let f = Fingerprint::of(["a"]);
    let first_token = {
        let store = open(&path, &clock)?;
        let Claim::Acquired(lease) = store.claim(&key, f)? else {
            panic!()
        };
        lease.token()
        // Dropped unsettled: the process "died" holding the lease.
    };
    let store = open(&path, &clock)?;
    clock.advance(Duration::from_secs(59));
    assert!(matches!(
        store.claim(&key, f)?,
        Claim::InProgress { attempt: 1, .. }
    ));
    clock.advance(Duration::from_secs(1));
    let Claim::Acquired(lease) = store.claim(&key, f)? else {
        panic!("no takeover")
    };
    assert_eq!(lease.attempt(), 2);
    assert!(
        lease.token() > first_token,
        "tokens are unique for the life of the file"
    );
    Ok(())
}

#[test]
fn a_second_open_of_the_same_file_is_refused() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("s.redb");
    let _store = Store::open(&path)?;
    assert!(matches!(Store::open(&path), Err(Error::AlreadyOpen)));
    Ok(())
}
