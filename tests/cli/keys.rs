//! `list`'s long keys and `get`'s quoted keys.

use idempotency_store::{Key, Store};

use super::{claim, expect, fixture, json, p};

#[test]
fn list_cuts_long_keys_unless_full() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("long.redb");
    let long = "k".repeat(200) + "-tail";
    {
        let store = Store::open(&path).expect("create");
        let _long = claim(&store, &Key::new(&long).expect("long key"));
        let _short = claim(&store, &Key::new("short").expect("key"));
        store.close().expect("close");
    }
    let table = expect(0, &["list", p(&path)]);
    let row = table
        .stdout
        .lines()
        .find(|l| l.starts_with('k'))
        .expect("the long key's row");
    let cell = row.split_whitespace().next().expect("key cell");
    assert_eq!(cell.chars().count(), 64, "{cell}");
    assert!(cell.ends_with('…') && !cell.contains("tail"), "{cell}");
    assert!(table.stdout.lines().any(|l| l.starts_with("short ")));
    assert!(table.stderr.contains("--full"), "{}", table.stderr);

    let full = expect(0, &["list", p(&path), "--full"]);
    assert!(
        full.stdout
            .lines()
            .any(|l| l.starts_with(&format!("{long} "))),
        "{}",
        full.stdout
    );
    assert!(full.stderr.is_empty(), "{}", full.stderr);
    let listed = json(&expect(0, &["list", p(&path), "--json"]));
    assert!(
        listed
            .as_array()
            .expect("array")
            .iter()
            .any(|r| r["key"] == long.as_str())
    );
}

#[test]
fn a_quoted_key_gets_a_hint_about_the_quotes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = fixture(dir.path());
    let run = expect(1, &["get", p(&path), "\"order-7\"", "--scope", "tenant-a"]);
    for expected in [
        "the quotes are part of the key",
        "there is a record without them",
        "get PATH order-7 --scope tenant-a",
    ] {
        assert!(
            run.stderr.contains(expected),
            "{expected:?} in {}",
            run.stderr
        );
    }
    let run = expect(1, &["get", p(&path), "'no-such'"]);
    assert!(run.stderr.contains("try without them"), "{}", run.stderr);
    let run = expect(1, &["get", p(&path), "no-such"]);
    assert!(!run.stderr.contains("quotes"), "{}", run.stderr);
}
