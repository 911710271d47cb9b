//! The outbound-key client (`idempotency_store::client`): keys that survive a reopen,
//! mismatches, expiry, `pending()` order, and the retry helper's stop rules and retention
//! cut-off on a `ManualClock`. The crash test with real processes is
//! tests/client/edge_client_crash.rs.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::client::{Delivery, Failure, Intent, Outbox, RetryPolicy, Sent};
use idempotency_store::{Claim, Fingerprint, ManualClock, Response, Result, Store, Timestamp};

const T0: u64 = 1_700_000_000_000;

fn fp(amount: &str) -> Fingerprint {
    Fingerprint::of(["POST /payments", amount])
}

fn outbox(clock: &ManualClock) -> Result<Outbox> {
    let store = Store::builder().clock(clock.clone()).open_in_memory()?;
    Ok(Outbox::new(Arc::new(store)))
}

fn open(begun: Claim<Intent>) -> Intent {
    match begun {
        Claim::Acquired(intent) => intent,
        other => panic!("expected an open intent, got {other:?}"),
    }
}

/// A policy that never really sleeps: it advances the clock and logs the pauses.
fn instant(clock: &ManualClock, pauses: &Arc<Mutex<Vec<Duration>>>) -> RetryPolicy {
    let (clock, pauses) = (clock.clone(), Arc::clone(pauses));
    RetryPolicy::new().sleep(move |pause| {
        pauses.lock().expect("pauses").push(pause);
        clock.advance(pause);
    })
}

#[test]
fn the_key_and_the_sends_survive_a_reopen() -> Result<()> {
    let dir = tempfile::tempdir().map_err(|e| idempotency_store::Error::InvalidConfig {
        reason: e.to_string(),
    })?;
    let path = dir.path().join("device.redb");
    let key = {
        let outbox = Outbox::new(Arc::new(Store::open(&path)?));
        let mut intent = open(outbox.begin("sale-1", fp("4999"))?);
        assert!(uuid_v4(intent.key()), "{}", intent.key());
        assert_eq!(outbox.start(&mut intent)?, 1);
        // The process dies here, with the request out.
        intent.key().to_owned()
    };
    let outbox = Outbox::new(Arc::new(Store::open(&path)?));
    let mut intent = open(outbox.begin("sale-1", fp("4999"))?);
    assert_eq!(intent.key(), key);
    let attempts = intent.attempts();
    assert_eq!(
        (attempts.len(), attempts[0].number, attempts[0].sent),
        (1, 1, Sent::Unknown)
    );
    assert_eq!(outbox.start(&mut intent)?, 2);
    outbox.record(&mut intent, Sent::Answered(201))?;
    outbox.finish(&intent, Response::new(201, "paid"))?;
    drop(outbox);
    let outbox = Outbox::new(Arc::new(Store::open(&path)?));
    assert!(
        matches!(outbox.begin("sale-1", fp("4999"))?, Claim::Completed(r) if r.response.body == b"paid")
    );
    assert!(outbox.pending()?.is_empty());
    Ok(())
}

fn uuid_v4(key: &str) -> bool {
    let b = key.as_bytes();
    key.len() == 36 && b[14] == b'4' && matches!(b[19], b'8' | b'9' | b'a' | b'b')
}

#[test]
fn begin_returns_the_same_key_and_refuses_another_request() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let outbox = outbox(&clock)?;
    let first = open(outbox.begin("sale-2", fp("4999"))?);
    let again = open(outbox.begin("sale-2", fp("4999"))?);
    assert_eq!(first.key(), again.key());
    assert!(matches!(
        outbox.begin("sale-2", fp("5000"))?,
        Claim::Mismatch { stored } if stored == fp("4999")
    ));
    // Another operation gets another key; the caller's own key is kept.
    assert_ne!(open(outbox.begin("sale-3", fp("4999"))?).key(), first.key());
    let own = open(outbox.begin_with_key("sale-4", fp("1"), "my-key-4")?);
    assert_eq!(own.key(), "my-key-4");
    let kept = open(outbox.begin_with_key("sale-4", fp("1"), "another")?);
    assert_eq!(kept.key(), "my-key-4");
    assert!(
        outbox
            .begin_with_key("sale-5", fp("1"), "bad key\n")
            .is_err()
    );
    // Past the lease, begin takes the intent over, still with the same key.
    clock.advance(Duration::from_secs(120));
    assert_eq!(open(outbox.begin("sale-2", fp("4999"))?).key(), first.key());
    Ok(())
}

#[test]
fn pending_lists_unfinished_intents_oldest_first_and_expiry_forgets_them() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let outbox = outbox(&clock)?;
    for id in ["c", "a", "b"] {
        open(outbox.begin(id, fp(id))?);
        clock.advance(Duration::from_secs(1));
    }
    let done = open(outbox.begin("d", fp("d"))?);
    outbox.finish(&done, Response::new(201, ""))?;
    let ids = |p: Vec<idempotency_store::client::Pending>| {
        p.into_iter().map(|p| p.operation_id).collect::<Vec<_>>()
    };
    assert_eq!(ids(outbox.pending()?), ["c", "a", "b"]);
    // Retention (24 h) after begin, intents expire like records: gone from pending, swept,
    // and the same operation id begins afresh with a new key.
    let old_key = open(outbox.begin("c", fp("c"))?).key().to_owned();
    clock.advance(Duration::from_secs(24 * 3600));
    assert!(outbox.pending()?.is_empty());
    assert!(outbox.store().sweep_all()? >= 4);
    assert_ne!(open(outbox.begin("c", fp("c"))?).key(), old_key);
    Ok(())
}

#[test]
fn send_retries_with_the_same_key_and_honours_retry_after() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let outbox = outbox(&clock)?;
    let pauses = Arc::new(Mutex::new(Vec::new()));
    let mut intent = open(outbox.begin("sale-6", fp("1"))?);
    let key = intent.key().to_owned();
    let mut seen = Vec::new();
    let answers = [
        Err(Failure::Refused("refused")),
        Err(Failure::NoAnswer("timeout")),
        Ok(Response::new(409, "").with_header("Retry-After", "7")),
        Ok(Response::new(429, "").with_header("retry-after", "Tue, 14 Nov 2023 22:13:40 GMT")),
        Ok(Response::new(503, "")),
        Ok(Response::new(201, "paid")),
    ];
    let mut next = answers.into_iter();
    let delivery = outbox.send(&mut intent, &instant(&clock, &pauses), |k, n| {
        seen.push((k.to_owned(), n));
        next.next().expect("an answer")
    })?;
    assert!(matches!(delivery, Delivery::Answered(r) if r.body == b"paid"));
    assert_eq!(seen, (1..=6).map(|n| (key.clone(), n)).collect::<Vec<_>>());
    let pauses = pauses.lock().expect("pauses").clone();
    assert_eq!(pauses[2], Duration::from_secs(7));
    // T0 + 7 s + the first two pauses is a little past 22:13:27; the date is 22:13:40.
    assert!(
        pauses[3] > Duration::from_secs(5) && pauses[3] <= Duration::from_secs(13),
        "{pauses:?}"
    );
    let sent: Vec<_> = intent.attempts().iter().map(|a| a.sent).collect();
    assert_eq!(
        sent,
        [
            Sent::Refused,
            Sent::NoAnswer,
            Sent::Answered(409),
            Sent::Answered(429),
            Sent::Answered(503),
            Sent::Answered(201)
        ]
    );
    assert!(matches!(
        outbox.begin("sale-6", fp("1"))?,
        Claim::Completed(_)
    ));
    Ok(())
}

#[test]
fn send_stops_on_final_answers_422_and_its_bounds() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let outbox = outbox(&clock)?;
    let pauses = Arc::new(Mutex::new(Vec::new()));
    let policy = instant(&clock, &pauses);
    let once = |status| move |_: &str, _: u32| Ok::<_, Failure<()>>(Response::new(status, ""));

    // Another 4xx, and 500 by default: final, finished.
    for (id, status) in [("f400", 400), ("f500", 500), ("f404", 404)] {
        let mut intent = open(outbox.begin(id, fp(id))?);
        let delivery = outbox.send(&mut intent, &policy, once(status))?;
        assert!(matches!(delivery, Delivery::Answered(r) if r.status == status));
        assert!(matches!(outbox.begin(id, fp(id))?, Claim::Completed(_)));
    }
    // 422: the caller changed the request. Surfaced, not retried, not finished.
    let mut intent = open(outbox.begin("f422", fp("x"))?);
    let mut calls = 0;
    let delivery = outbox.send(&mut intent, &policy, |_, _| {
        calls += 1;
        Ok::<_, Failure<()>>(Response::new(422, ""))
    })?;
    assert!(matches!(delivery, Delivery::KeyReused(_)));
    assert_eq!(calls, 1);
    assert!(matches!(outbox.begin("f422", fp("x"))?, Claim::Acquired(_)));

    // 500 retried when configured; attempts bounded per call.
    let mut intent = open(outbox.begin("r500", fp("r"))?);
    let mut calls = 0;
    let delivery = outbox.send(
        &mut intent,
        &policy.clone().retry_500(true).max_attempts(3),
        |_, _| {
            calls += 1;
            Ok::<_, Failure<()>>(Response::new(500, ""))
        },
    )?;
    assert!(matches!(delivery, Delivery::GaveUp { last: Ok(r) } if r.status == 500));
    assert_eq!(calls, 3);
    // The next call goes on with the same key, counting on.
    let delivery = outbox.send(&mut intent, &policy, |_, n| {
        assert_eq!(n, 4);
        Ok::<_, Failure<()>>(Response::new(201, ""))
    })?;
    assert!(matches!(delivery, Delivery::Answered(_)));

    // Time bound: a Retry-After past max_elapsed gives up instead of sleeping.
    let mut intent = open(outbox.begin("slow", fp("s"))?);
    let bounded = policy.clone().max_elapsed(Duration::from_secs(60));
    let delivery = outbox.send(&mut intent, &bounded, |_, _| {
        Ok::<_, Failure<()>>(Response::new(503, "").with_header("Retry-After", "120"))
    })?;
    assert!(matches!(delivery, Delivery::GaveUp { .. }));
    Ok(())
}

#[test]
fn send_never_sends_past_the_key_lifetime() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let outbox = outbox(&clock)?;
    let pauses = Arc::new(Mutex::new(Vec::new()));
    let policy = instant(&clock, &pauses).key_lifetime(Duration::from_secs(23 * 3600));
    let mut intent = open(outbox.begin("late", fp("l"))?);
    // 23 h less 30 s after begin, the server asks to come back in a minute: that would be
    // past the lifetime, so the helper stops and asks for reconciliation.
    clock.advance(Duration::from_secs(23 * 3600 - 30));
    let mut calls = 0;
    let delivery = outbox.send(&mut intent, &policy, |_, _| {
        calls += 1;
        Ok::<_, Failure<()>>(Response::new(503, "").with_header("Retry-After", "60"))
    })?;
    assert!(matches!(delivery, Delivery::NeedsReconciliation));
    assert_eq!(calls, 1);
    assert!(pauses.lock().expect("pauses").is_empty());
    // Past the lifetime, nothing is sent at all; the intent stays open (pending).
    clock.advance(Duration::from_secs(60));
    let delivery = outbox.send(
        &mut intent,
        &policy,
        |_, _| -> std::result::Result<Response, Failure<()>> {
            panic!("sent past the key's lifetime")
        },
    )?;
    assert!(matches!(delivery, Delivery::NeedsReconciliation));
    assert_eq!(outbox.pending()?.len(), 1);
    Ok(())
}
