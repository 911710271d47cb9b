//! The PostgreSQL fixture of the test binaries: the server from `IDEMPOTENCY_PG_URL`, and a
//! schema of a test's own.

use std::sync::atomic::{AtomicUsize, Ordering};

use idempotency_store::pg::{PgStore, PgStoreBuilder};

/// The server's URL from `IDEMPOTENCY_PG_URL`; `None` (with the reason printed) if unset,
/// except under `CI=true`, where a missing server fails the test (`.ci/run` starts one and
/// exports the URL). Through a transaction pooler it ends in ` prepare_statements=false`
/// (`PgStore`'s own option), which [`raw_url`] takes out for the fixtures' raw clients.
pub fn url() -> Option<String> {
    match std::env::var("IDEMPOTENCY_PG_URL") {
        Ok(url) if !url.trim().is_empty() => Some(url),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => {
            panic!("CI=true but IDEMPOTENCY_PG_URL is not set (see .ci/run)")
        }
        _ => {
            eprintln!("skipped: IDEMPOTENCY_PG_URL is not set; see .ci/run");
            None
        }
    }
}

/// Whether the tests run on a Citus coordinator (`IDEMPOTENCY_PG_DISTRIBUTED=1`, set by
/// `.ci/run` for its Citus step), where every store the fixtures build is distributed.
pub fn distributed() -> bool {
    std::env::var("IDEMPOTENCY_PG_DISTRIBUTED").is_ok_and(|v| v == "1")
}

/// `PgStore::builder()`, in the distributed mode when [`distributed`] says so: the fixtures'
/// one way to start a store, so that the same suites run on one server and on Citus.
pub fn builder() -> PgStoreBuilder {
    let mut builder = PgStore::builder();
    builder.distributed(distributed());
    builder
}

/// `url` for a raw `postgres` client, without `PgStore`'s own option.
pub fn raw_url(url: &str) -> String {
    url.replace(" prepare_statements=false", "")
}

/// Runs `sql` (statements of a test's own set-up) on a raw connection of its own to `url`.
pub fn admin(url: &str, sql: &str) {
    let mut client =
        postgres::Client::connect(&raw_url(url), postgres::NoTls).expect("admin connection");
    client.batch_execute(sql).expect("admin statement");
}

/// A schema of one test's own, dropped (with everything in it) before and after.
pub struct Schema {
    pub url: String,
    pub name: String,
}

impl Schema {
    /// A schema for `test` on the server of `IDEMPOTENCY_PG_URL`, or `None` (see [`url`]).
    pub fn fresh(prefix: &str, test: &str) -> Option<Schema> {
        Some(Schema::named(url()?, prefix, test))
    }

    /// `PREFIX_TEST_PID_N`: unique to this process and call (the test's name cut to 40
    /// characters, for PostgreSQL's 63).
    pub fn named(url: String, prefix: &str, test: &str) -> Schema {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let short: String = test.chars().take(40).collect();
        let schema = Schema {
            url,
            name: format!("{prefix}_{short}_{}_{n}", std::process::id()),
        };
        schema.drop_it();
        schema
    }

    /// A builder on this schema with a pool of two connections.
    pub fn store_builder(&self) -> PgStoreBuilder {
        let mut builder = builder();
        builder.schema(self.name.as_str()).pool_size(2);
        builder
    }

    fn drop_it(&self) {
        let dropped =
            postgres::Client::connect(&raw_url(&self.url), postgres::NoTls).and_then(|mut c| {
                c.batch_execute(&format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name))
            });
        if let Err(e) = dropped {
            eprintln!("could not drop schema {}: {e}", self.name);
        }
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        self.drop_it();
    }
}

/// The key lock that the records table's comment tells whoever deletes rows by hand to take,
/// as a statement of `$1` (scope) and `$2` (key), for `schema` (bare name): tests that hold a
/// key's lock take the documented one, so the comment cannot drift from the store's lock.
pub fn documented_key_lock(
    client: &mut postgres::Client,
    schema: &str,
) -> idempotency_store::Result<String> {
    // Unnamed (`query_typed`), so that it works through a transaction-pooling proxy.
    let comment: String = client
        .query_typed_one(
            "SELECT obj_description(format('%I.idempotency_keys', $1::text)::regclass, 'pg_class')",
            &[(&schema, postgres::types::Type::TEXT)],
        )
        .and_then(|row| row.try_get(0))
        .map_err(|e| idempotency_store::Error::InvalidConfig {
            reason: format!("test fixture: {e}"),
        })?;
    let recipe = comment
        .split_once("the key's lock: ")
        .map(|(_, sql)| sql.trim_end_matches(';'))
        .unwrap_or_else(|| panic!("no key lock in the table's comment: {comment}"));
    // `hashtext(scope || chr(1) || key)` (migration 5), or with the schema first (migration 7).
    Ok(recipe
        .replace("(scope ", "($1::text ")
        .replace(" scope ", " $1::text ")
        .replace(" key)", " $2::text)"))
}
