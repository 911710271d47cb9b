//! Every subcommand on a PostgreSQL table: the same fixture written with `PgStore` into a
//! fresh schema, the CLI given a `postgresql://` URL and `--schema`. Needs
//! `IDEMPOTENCY_PG_URL` (skipped with a printed reason without it, failed under `CI=true`).

use std::time::Duration;

use idempotency_store::{
    Clock, IdempotencyStore, Key, ManualClock, SystemClock, Timestamp, pg::PgStore,
};

use super::{HOUR, claim, cli, expect, json, write_fixture};

/// A fresh schema holding the fixture of `super::fixture`, dropped afterwards.
struct Db {
    url: String,
    plain: String,
    schema: String,
}

impl Db {
    /// A schema name of this test's own, with no schema of that name.
    fn empty(test: &str) -> Option<Db> {
        let plain = match std::env::var("IDEMPOTENCY_PG_URL") {
            Ok(url) if !url.trim().is_empty() => url,
            _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
                panic!("CI=true but IDEMPOTENCY_PG_URL is not set (see .ci/run)")
            }
            _ => {
                eprintln!("skipped: IDEMPOTENCY_PG_URL is not set; see .ci/run");
                return None;
            }
        };
        let db = Db {
            url: as_url(&plain),
            plain,
            schema: format!("cli_{test}_{}", std::process::id()),
        };
        db.admin(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", db.schema));
        Some(db)
    }

    fn fixture(test: &str) -> Option<Db> {
        let db = Db::empty(test)?;
        let now = SystemClock.now().as_millis();
        let clock = ManualClock::new(Timestamp::from_millis(now - 48 * HOUR));
        let store = PgStore::builder()
            .schema(db.schema.as_str())
            .retention(Duration::from_secs(24 * 3600))
            .lease(Duration::from_secs(3600))
            .clock(clock.clone())
            .pool_size(1)
            .connect(&db.plain)
            .expect("connect");
        write_fixture(&store, &clock, now);
        Some(db)
    }

    /// `args` with the URL in place of `{}` and `--schema` added.
    fn run(&self, code: i32, args: &[&str]) -> super::Run {
        let mut all: Vec<&str> = args
            .iter()
            .map(|a| if *a == "{}" { self.url.as_str() } else { a })
            .collect();
        all.extend(["--schema", self.schema.as_str()]);
        expect(code, &all)
    }

    fn store(&self) -> PgStore {
        PgStore::builder()
            .schema(self.schema.as_str())
            .pool_size(1)
            .connect(&self.plain)
            .expect("connect")
    }

    fn admin(&self, sql: &str) {
        let mut client =
            postgres::Client::connect(&self.plain, postgres::NoTls).expect("admin connection");
        client.batch_execute(sql).expect("admin statement");
    }

    /// The one `bigint` that `sql` answers.
    fn number(&self, sql: &str) -> i64 {
        let mut client =
            postgres::Client::connect(&self.plain, postgres::NoTls).expect("admin connection");
        client
            .query_one(sql, &[])
            .and_then(|row| row.try_get(0))
            .expect("a number")
    }

    fn schema_exists(&self) -> bool {
        let sql = format!(
            "SELECT count(*) FROM pg_namespace WHERE nspname = '{}'",
            self.schema
        );
        self.number(&sql) > 0
    }

    /// The highest migration the schema records.
    fn migration(&self) -> i64 {
        self.number(&format!(
            "SELECT max(version)::bigint FROM \"{}\".idempotency_schema_migrations",
            self.schema
        ))
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        self.admin(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        ));
    }
}

/// `IDEMPOTENCY_PG_URL` (a URL or `key=value` pairs) as `key=value` pairs, as the README
/// writes it.
fn as_pairs(text: &str) -> String {
    let config: postgres::Config = text.parse().expect("IDEMPOTENCY_PG_URL parses");
    let host = match config.get_hosts().first() {
        Some(postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let quote = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"));
    let mut pairs = format!(
        "host={host} port={} user={} dbname={}",
        config.get_ports().first().copied().unwrap_or(5432),
        quote(config.get_user().unwrap_or("postgres")),
        quote(config.get_dbname().unwrap_or("postgres")),
    );
    if let Some(password) = config.get_password() {
        pairs += &format!(" password={}", quote(&String::from_utf8_lossy(password)));
    }
    pairs
}

/// `IDEMPOTENCY_PG_URL` (`key=value` pairs or a URL) as a `postgresql://` URL.
fn as_url(text: &str) -> String {
    if text.starts_with("postgres") {
        return text.to_owned();
    }
    let config: postgres::Config = text.parse().expect("IDEMPOTENCY_PG_URL parses");
    let host = match config.get_hosts().first() {
        Some(postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "127.0.0.1".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let encode = |s: &str| -> String {
        s.bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    char::from(b).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    };
    let user = encode(config.get_user().unwrap_or("postgres"));
    let password = config
        .get_password()
        .map(|p| format!(":{}", encode(&String::from_utf8_lossy(p))))
        .unwrap_or_default();
    let db = encode(config.get_dbname().unwrap_or("postgres"));
    format!("postgresql://{user}{password}@{host}:{port}/{db}")
}

#[test]
fn stats_counts_each_state() {
    let Some(db) = Db::fixture("stats") else {
        return;
    };
    let human = db.run(0, &["stats", "{}"]);
    let line = |name: &str| {
        human
            .stdout
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("no {name} line"))
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    };
    assert!(line("in progress").starts_with("in progress 2 (1 stuck"));
    assert_eq!(line("completed"), "completed 1");
    assert!(line("expired").starts_with("expired 1"));
    assert_eq!(line("total"), "total 4");
    // A table, not a file: the names say so.
    assert!(line("table size:").ends_with(" bytes)"));
    // And whether a failover can lose what it acknowledged (issue 40).
    assert!(line("replication:").contains("failover-safe"));
    assert!(!human.stdout.contains("file"), "{}", human.stdout);
    let stats = json(&db.run(0, &["stats", "{}", "--json"]));
    assert_eq!(
        (&stats["records"], &stats["stuck"], &stats["expired"]),
        (&4.into(), &1.into(), &1.into())
    );
    assert!(stats["table_bytes"].as_u64().is_some_and(|b| b > 0));
    assert!(stats.get("file_bytes").is_none(), "{stats}");
    assert!(stats["failover_safe"].is_boolean(), "{stats}");
    assert!(
        stats["replication"]
            .as_str()
            .is_some_and(|r| r.contains("failover-safe")),
        "{stats}"
    );
}

#[test]
fn get_shows_records_and_exits_1_without_one() {
    let Some(db) = Db::fixture("get") else { return };
    let done = db.run(0, &["get", "{}", "order-7", "--scope", "tenant-a"]);
    for expected in [
        "key          order-7",
        "scope        tenant-a",
        "state        completed",
        "status       201",
        "header       content-type: application/json",
        r#"body         14 bytes: {"id":"pay_1"}"#,
    ] {
        assert!(
            done.stdout.contains(expected),
            "{expected}: {}",
            done.stdout
        );
    }
    let stuck = json(&db.run(0, &["get", "{}", "stuck-order", "--json"]));
    assert_eq!(stuck["stuck"], true);
    assert_eq!(stuck["checkpoint_base64"], "c3RlcC0y");
    let old = json(&db.run(0, &["get", "{}", "old-order", "--json"]));
    assert_eq!(old["expired"], true);
    let missing = db.run(1, &["get", "{}", "no-such-order"]);
    assert!(missing.stderr.contains("no record"), "{}", missing.stderr);
}

#[test]
fn list_filters_and_limits() {
    let Some(db) = Db::fixture("list") else {
        return;
    };
    let keys = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["list", "{}", "--json"];
        all.extend_from_slice(args);
        json(&db.run(0, &all))
            .as_array()
            .expect("an array")
            .iter()
            .map(|r| r["key"].as_str().expect("key").to_owned())
            .collect()
    };
    // Oldest first (issue 41): created 48 h ago, 2 h ago, then two at the same time,
    // which keep the table's order (unscoped keys before scope "tenant-a").
    assert_eq!(
        keys(&[]),
        ["old-order", "stuck-order", "live-order", "order-7"]
    );
    assert_eq!(
        keys(&["--state", "in-progress"]),
        ["stuck-order", "live-order"]
    );
    assert_eq!(keys(&["--stuck"]), ["stuck-order"]);
    assert_eq!(keys(&["--state", "completed"]), ["order-7"]);
    assert_eq!(keys(&["--state", "expired"]), ["old-order"]);
    let limited = db.run(0, &["list", "{}", "--json", "--limit", "1"]);
    assert_eq!(json(&limited).as_array().map(Vec::len), Some(1));
    assert!(limited.stderr.contains("more match"), "{}", limited.stderr);
    let table = db.run(0, &["list", "{}"]);
    assert_eq!(table.stdout.lines().count(), 5, "{}", table.stdout);
}

#[test]
fn release_needs_confirmation_and_deletes_only_in_progress_records() {
    let Some(db) = Db::fixture("release") else {
        return;
    };
    let refused = db.run(2, &["release", "{}", "stuck-order"]);
    assert!(
        refused.stderr.contains("not a terminal"),
        "{}",
        refused.stderr
    );
    let completed = db.run(
        2,
        &["release", "{}", "order-7", "--scope", "tenant-a", "--yes"],
    );
    assert!(
        completed.stderr.contains("completed"),
        "{}",
        completed.stderr
    );
    let expired = db.run(2, &["release", "{}", "old-order", "--yes"]);
    assert!(expired.stderr.contains("no record"), "{}", expired.stderr);
    let released = db.run(0, &["release", "{}", "stuck-order", "--yes"]);
    assert!(
        released
            .stdout
            .starts_with(r#"released key "stuck-order" (attempt 1)"#),
        "{}",
        released.stdout
    );
    db.run(1, &["get", "{}", "stuck-order"]);
    let live = json(&db.run(0, &["release", "{}", "live-order", "-y", "--json"]));
    assert_eq!(live["released"], true);
    assert_eq!(live["lease_was_live"], true);
    let store = db.store();
    assert_eq!(
        claim(&store, &Key::new("stuck-order").expect("key")).attempt(),
        1
    );
    assert!(store.verify().expect("verify").is_clean());
}

#[test]
fn sweep_verify_and_export() {
    let Some(db) = Db::fixture("sweep") else {
        return;
    };
    let ok = db.run(0, &["verify", "{}"]);
    assert_eq!(
        ok.stdout.trim(),
        "ok: 4 records, 4 expiry entries, no problems"
    );
    let export = db.run(0, &["export", "{}", "--jsonl"]);
    let lines: Vec<serde_json::Value> = export
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(lines.len(), 4);
    let done = lines
        .iter()
        .find(|r| r["key"] == "order-7")
        .expect("order-7 exported");
    assert_eq!(done["scope"], "tenant-a");
    assert_eq!(done["response"]["body_base64"], "eyJpZCI6InBheV8xIn0=");
    let swept = db.run(0, &["sweep", "{}"]);
    assert_eq!(swept.stdout.trim(), "deleted 1 expired record");
    assert_eq!(json(&db.run(0, &["sweep", "{}", "--json"]))["swept"], 0);
    assert!(
        db.run(0, &["verify", "{}"])
            .stdout
            .starts_with("ok: 3 records")
    );

    // A damaged row: verify lists it and exits 1.
    db.admin(&format!(
        "UPDATE \"{}\".idempotency_keys SET fingerprint = '\\x0102' WHERE key = 'live-order'",
        db.schema
    ));
    let bad = db.run(1, &["verify", "{}"]);
    assert!(
        bad.stdout.contains("fingerprint of 2 bytes"),
        "{}",
        bad.stdout
    );
    assert!(bad.stderr.contains("1 problem found"), "{}", bad.stderr);
}

/// Every command, on a schema given by `Db::run`.
const COMMANDS: [&[&str]; 7] = [
    &["stats", "{}"],
    &["get", "{}", "k"],
    &["list", "{}"],
    &["verify", "{}"],
    &["export", "{}"],
    &["sweep", "{}"],
    &["release", "{}", "k", "--yes"],
];

#[test]
fn no_command_creates_a_missing_schema() {
    let Some(db) = Db::empty("missing") else {
        return;
    };
    for args in COMMANDS {
        let run = db.run(2, args);
        for expected in ["does not exist", "never creates or migrates a schema"] {
            assert!(run.stderr.contains(expected), "{args:?}: {}", run.stderr);
        }
        assert!(!db.schema_exists(), "{args:?} created the schema");
    }
    let message = super::json_error(
        2,
        "not-a-store",
        &["stats", db.plain.as_str(), "--schema", db.schema.as_str()],
    );
    assert!(message.contains(&db.schema), "{message}");
}

#[test]
fn no_command_migrates_a_schema_at_another_migration() {
    let Some(db) = Db::fixture("older") else {
        return;
    };
    let current = db.migration();
    // As a build one migration older left it (the last migration's column stays: the
    // CLI must refuse before it reads anything).
    db.admin(&format!(
        "DELETE FROM \"{}\".idempotency_schema_migrations WHERE version = {current}",
        db.schema
    ));
    for args in COMMANDS {
        let run = db.run(2, args);
        let older = format!("is at migration {}", current - 1);
        assert!(run.stderr.contains(&older), "{args:?}: {}", run.stderr);
        assert_eq!(db.migration(), current - 1, "{args:?} migrated the schema");
    }
    // As a newer build leaves it.
    db.admin(&format!(
        "INSERT INTO \"{}\".idempotency_schema_migrations (version, description) \
         VALUES ({current}, 'back'), ({}, 'from the future')",
        db.schema,
        current + 1
    ));
    let run = db.run(2, &["verify", "{}"]);
    let newer = format!("is at migration {}", current + 1);
    assert!(run.stderr.contains(&newer), "{}", run.stderr);
    assert_eq!(db.migration(), current + 1);
}

#[test]
fn a_key_value_connection_string_is_a_database() {
    let Some(db) = Db::fixture("pairs") else {
        return;
    };
    let pairs = as_pairs(&db.plain);
    let stats = expect(0, &["stats", &pairs, "--schema", &db.schema, "--json"]);
    assert_eq!(json(&stats)["records"], 4);
    let listed = expect(0, &["list", &pairs, "--schema", &db.schema, "--json"]);
    assert_eq!(json(&listed).as_array().map(Vec::len), Some(4));
}

#[test]
fn an_unreachable_server_is_one_line_without_the_password() {
    if Db::fixture("unreachable").is_none() {
        return;
    }
    let run = cli(&[
        "stats",
        "postgresql://idem:s3cret@127.0.0.1:1/idem?sslmode=disable",
    ]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr
            .starts_with("error: postgresql://idem@127.0.0.1:1/idem:"),
        "{}",
        run.stderr
    );
    assert!(!run.stderr.contains("s3cret"), "{}", run.stderr);
    // key=value pairs: the password pair is left out, quoted or not.
    for password in ["s3cret", r"'s3cret \' x'"] {
        let pairs = format!("host=127.0.0.1 port=1 user=idem password={password} dbname=idem");
        let run = cli(&["stats", &pairs]);
        assert_eq!(run.code, 2, "{}", run.stderr);
        assert!(
            run.stderr
                .starts_with("error: host=127.0.0.1 port=1 user=idem dbname=idem:"),
            "{}",
            run.stderr
        );
        assert!(!run.stderr.contains("s3cret"), "{}", run.stderr);
    }
}
