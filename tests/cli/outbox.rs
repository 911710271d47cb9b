//! A store file a client `Outbox` wrote: its intents are listed, never counted as stuck, and
//! release refuses them without the flag.

use std::path::{Path, PathBuf};
use std::time::Duration;

use idempotency_store::{Fingerprint, Key, Response, Store};

use super::{checksum, claim, expect, fixture, json, json_error, p};

/// A store file a point-of-sale device's `Outbox` wrote, in real time and with a lease of
/// 300 ms that has lapsed by the time the CLI looks (what `stats` once counted as stuck). In
/// order of creation: `pos-6` answered 201 and finished; `pos-5` begun, not sent; `pos-4`
/// sent once with no answer; then a server-side record `srv-1`, in progress. Returns the path
/// and the keys `pos-4` and `pos-5` carry.
fn outbox_fixture(dir: &Path) -> (PathBuf, String, String) {
    use idempotency_store::Claim;
    use idempotency_store::client::{Outbox, Sent};

    let path = dir.join("device.redb");
    let store = Store::builder()
        .lease(Duration::from_millis(300))
        .open(&path)
        .expect("create the store");
    let store = std::sync::Arc::new(store);
    let outbox = Outbox::new(std::sync::Arc::clone(&store));
    let fp = Fingerprint::of(["POST /payments", r#"{"amount":4999}"#]);
    let open = |id: &str| match outbox.begin(id, fp).expect("begin") {
        Claim::Acquired(intent) => intent,
        other => panic!("{id} not open: {other:?}"),
    };
    let mut done = open("pos-6");
    outbox.start(&mut done).expect("start");
    outbox
        .record(&mut done, Sent::Answered(201))
        .expect("record");
    outbox
        .finish(&done, Response::new(201, r#"{"id":"pay_6"}"#))
        .expect("finish");
    std::thread::sleep(Duration::from_millis(3));
    let queued = open("pos-5");
    std::thread::sleep(Duration::from_millis(3));
    let mut sent = open("pos-4");
    outbox.start(&mut sent).expect("start");
    outbox.record(&mut sent, Sent::NoAnswer).expect("record");
    std::thread::sleep(Duration::from_millis(3));
    let _server = claim(&store, &Key::new("srv-1").expect("key"));
    let keys = (sent.key().to_owned(), queued.key().to_owned());
    drop((outbox, sent, queued, done));
    std::sync::Arc::into_inner(store)
        .expect("the only handle")
        .close()
        .expect("close");
    std::thread::sleep(Duration::from_millis(400));
    (path, keys.0, keys.1)
}

#[test]
fn release_of_an_outbox_intent_is_refused_without_the_flag_and_changes_nothing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, _, _) = outbox_fixture(dir.path());
    let before = std::fs::read(&path).expect("read");
    let scope = idempotency_store::client::SCOPE;
    for (id, extra) in [
        ("pos-4", &["--yes"][..]),
        ("pos-4", &[][..]), // refused before any prompt
        ("pos-5", &["--yes"][..]),
    ] {
        let mut args = vec!["release", p(&path), id, "--scope", scope];
        args.extend(extra);
        let refused = expect(2, &args);
        assert!(
            refused.stderr.contains("--allow-new-key-may-charge-twice")
                && refused.stderr.contains("outbound intent"),
            "{}",
            refused.stderr
        );
        let message = json_error(2, "refused", &args);
        assert!(message.contains("charge"), "{message}");
        assert_eq!(std::fs::read(&path).expect("read"), before, "{args:?}");
    }
    // The server-side record beside them is still released as before.
    let released = expect(0, &["release", p(&path), "srv-1", "--yes"]);
    assert!(released.stdout.contains("released key \"srv-1\""));
    // Named, the risk is taken.
    let taken = expect(
        0,
        &[
            "release",
            p(&path),
            "pos-4",
            "--scope",
            scope,
            "--yes",
            "--allow-new-key-may-charge-twice",
        ],
    );
    assert!(taken.stdout.contains("released key"), "{}", taken.stdout);
}

#[test]
fn outbox_intents_are_listed_with_the_key_sent_and_never_as_stuck() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (path, sent_key, queued_key) = outbox_fixture(dir.path());
    let before = checksum(&path);

    // stats: the intents are not stuck, and nothing advises releasing them.
    let stats = expect(0, &["stats", p(&path)]);
    assert!(stats.stdout.contains("outbound"), "{}", stats.stdout);
    assert!(
        stats.stdout.contains("1 stuck"),
        "srv-1 only: {}",
        stats.stdout
    );
    let counts = json(&expect(0, &["stats", p(&path), "--json"]));
    assert_eq!(counts["outbound_intents"], 2);
    assert_eq!(counts["in_progress"], 1);
    assert_eq!(counts["stuck"], 1);

    // list: oldest first, the intents' states and the keys they sent.
    let rows = json(&expect(0, &["list", p(&path), "--json"]));
    let rows = rows.as_array().expect("array");
    let keys: Vec<&str> = rows.iter().filter_map(|r| r["key"].as_str()).collect();
    assert_eq!(keys, ["pos-6", "pos-5", "pos-4", "srv-1"]);
    let intent = |i: usize| &rows[i]["intent"];
    assert_eq!(intent(0)["state"], "finished");
    assert_eq!(intent(1)["state"], "queued");
    assert_eq!(intent(1)["key_sent"], queued_key.as_str());
    assert_eq!(intent(2)["state"], "sent");
    assert_eq!(intent(2)["key_sent"], sent_key.as_str());
    assert_eq!(intent(2)["sends"], 1);
    assert_eq!(rows[2]["stuck"], false);
    assert!(rows[3].get("intent").is_none());
    assert_eq!(rows[3]["stuck"], true);
    let table = expect(0, &["list", p(&path)]);
    assert!(table.stdout.contains("KEY SENT"), "{}", table.stdout);
    assert!(table.stdout.contains(&sent_key), "{}", table.stdout);
    let stuck_rows: Vec<&str> = table
        .stdout
        .lines()
        .filter(|l| l.contains(" stuck "))
        .collect();
    assert_eq!(stuck_rows.len(), 1, "{}", table.stdout);
    assert!(stuck_rows[0].starts_with("srv-1"), "{}", table.stdout);
    let stuck = json(&expect(0, &["list", p(&path), "--stuck", "--json"]));
    assert_eq!(stuck.as_array().map(Vec::len), Some(1));

    // get: by operation id without the scope, and by the key that was sent.
    let by_id = expect(0, &["get", p(&path), "pos-4"]);
    assert!(by_id.stdout.contains(&sent_key), "{}", by_id.stdout);
    assert!(by_id.stdout.contains("never release"), "{}", by_id.stdout);
    assert!(
        by_id.stderr.contains("--scope idempotency-client"),
        "{}",
        by_id.stderr
    );
    let by_key = json(&expect(0, &["get", p(&path), &sent_key, "--json"]));
    assert_eq!(by_key["key"], "pos-4");
    assert_eq!(by_key["scope"], "idempotency-client");
    assert_eq!(by_key["intent"]["key_sent"], sent_key.as_str());
    let finished = expect(0, &["get", p(&path), "pos-6"]);
    assert!(finished.stdout.contains("finished"), "{}", finished.stdout);
    assert_eq!(checksum(&path), before, "looking changed the file");

    // A key that is only in another scope: the message names the scope to try.
    let other = fixture(dir.path());
    let missing = expect(1, &["get", p(&other), "order-7"]);
    assert!(
        missing.stderr.contains("try --scope tenant-a"),
        "{}",
        missing.stderr
    );
}
