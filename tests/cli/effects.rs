//! `release` and `sweep` on a file an application left with its own effect rows: the rows stay
//! for its next open, and a failing call leaves the file byte-identical.

use idempotency_store::{Error, IdempotencyStore, Key, Store};

use super::{LEDGER, checksum, cli, crashed_with_effects, expect, json, json_error, p};

#[test]
fn release_and_sweep_keep_the_applications_effect_rows_for_its_next_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = crashed_with_effects(dir.path());
    // The finding: an open that does not register the table refuses such a file.
    let probe = dir.path().join("probe.redb");
    std::fs::copy(&path, &probe).expect("copy");
    assert!(matches!(
        Store::open(&probe),
        Err(Error::EffectTable { .. })
    ));

    let released = expect(0, &["release", p(&path), "held", "--yes"]);
    assert!(
        released
            .stdout
            .starts_with(r#"released key "held" (attempt 1)"#),
        "{}",
        released.stdout
    );
    let swept = expect(0, &["sweep", p(&path), "--json"]);
    assert_eq!(json(&swept)["swept"], 0);
    expect(1, &["get", p(&path), "held"]);

    // Kept, not dropped: an open without the table still refuses the file...
    let refused = Store::open(&path).map(drop);
    assert!(
        matches!(&refused, Err(Error::EffectTable { table, .. }) if table == "payments_ledger"),
        "{refused:?}"
    );
    // ...and the application's next open has its ledger row, and the release.
    let app = Store::builder()
        .effect_table(LEDGER)
        .open(&path)
        .expect("the application opens its file");
    let paid = app
        .read_with(
            |txn| -> Result<Option<u64>, idempotency_store::redb::Error> {
                Ok(txn.open_table(LEDGER)?.get("paid")?.map(|v| v.value()))
            },
        )
        .expect("read")
        .expect("the ledger");
    assert_eq!(paid, Some(4999));
    assert!(
        app.lookup(&Key::new("held").expect("key"))
            .expect("lookup")
            .is_none()
    );
    assert!(app.verify().expect("verify").is_clean());
    app.close().expect("close");
    // Applied, so nothing waits any more: any open works again.
    Store::open(&path).expect("open").close().expect("close");
}

#[test]
fn a_failing_release_or_sweep_leaves_the_file_byte_identical() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = crashed_with_effects(dir.path());
    let before = checksum(&path);
    let refusals: [(&[&str], &str); 5] = [
        (&["release", p(&path), "paid", "--yes"], "refused"),
        (&["release", p(&path), "nothing-here", "--yes"], "no-record"),
        (&["release", p(&path), "held"], "refused"),
        (&["release", p(&path), "bad\tkey", "--yes"], "invalid-key"),
        (&["sweep", p(&path), "--limit", "1"], "usage"),
    ];
    for (args, kind) in refusals {
        json_error(2, kind, args);
        assert_eq!(checksum(&path), before, "{args:?} changed the file");
    }
    // The look passes, the writable open fails: a reader holds the file.
    {
        let _reader = Store::builder().open_read_only(&path).expect("read-only");
        expect(0, &["stats", p(&path)]);
        json_error(2, "already-open", &["sweep", p(&path)]);
        json_error(2, "already-open", &["release", p(&path), "held", "--yes"]);
    }
    assert_eq!(
        checksum(&path),
        before,
        "a refused writable open changed the file"
    );
    // A damaged file does not get as far as a writable open.
    let truncated = dir.path().join("truncated.redb");
    let bytes = std::fs::read(&path).expect("read");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).expect("truncate");
    let damaged = checksum(&truncated);
    for args in [
        vec!["sweep", p(&truncated)],
        vec!["release", p(&truncated), "held", "--yes"],
    ] {
        assert_eq!(cli(&args).code, 2, "{args:?}");
        assert_eq!(checksum(&truncated), damaged, "{args:?} changed the file");
    }
    // The test could fail: a release that succeeds does change the file.
    expect(0, &["release", p(&path), "held", "--yes"]);
    assert_ne!(checksum(&path), before);
}
