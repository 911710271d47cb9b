//! Limits: the key length and the response size.

use idempotency_store::{Claim, Error, IdempotencyStore, Key, RecordState, Response, Result};

use super::{Factory, Settings, acquire, fp};

pub(super) fn max_key_len_is_enforced<S: IdempotencyStore>(open: Factory<S>) -> Result<()> {
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

pub(super) fn oversized_response_is_rejected_and_the_lease_still_holds<S: IdempotencyStore>(
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
