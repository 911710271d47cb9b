//! The schema's versioned migrations, applied when a store connects, or only checked (see
//! [`PgStoreBuilder::migrate`](super::PgStoreBuilder::migrate)).

use ::postgres::Client;

use super::lock::{CLAIM_LOCK_CLASS, key_hash};
use super::quota;
use super::rows::{col, pg};
use super::typed::Query;
use crate::error::{Error, Result};

/// The schema version this build migrates to.
const SCHEMA_VERSION: i32 = 8;

/// Versioned migrations: `(version, description, statements)`, applied in order, each once;
/// each of the statements goes to the server on its own. A statement that changes a
/// distributed table must (migration 8 on a schema Citus already distributes): Citus forwards
/// it to the shards as the text it came in, and refuses a text of two commands.
fn migrations(schema: &str) -> [(i32, &'static str, Vec<String>); 8] {
    let s = format!("\"{schema}\"");
    [
        (
            1,
            "idempotency_keys table, token sequence, expires_at index",
            vec![format!(
                "CREATE SEQUENCE {s}.idempotency_token_seq AS bigint MINVALUE 1; \
             CREATE TABLE {s}.idempotency_keys ( \
                 scope               text     NOT NULL, \
                 key                 text     NOT NULL, \
                 fingerprint         bytea    NOT NULL, \
                 fingerprint_version smallint NOT NULL, \
                 state               text     NOT NULL \
                     CHECK (state IN ('in_progress', 'completed')), \
                 token               bigint   NOT NULL, \
                 attempt             bigint   NOT NULL, \
                 lease_until         bigint, \
                 checkpoint          bytea, \
                 response_status     integer, \
                 response_headers    bytea, \
                 response_body       bytea, \
                 created_at          bigint   NOT NULL, \
                 completed_at        bigint, \
                 expires_at          bigint   NOT NULL, \
                 PRIMARY KEY (scope, key)); \
             CREATE INDEX idempotency_keys_expires_at ON {s}.idempotency_keys (expires_at);"
            )],
        ),
        (
            2,
            "idempotency_lock_key: a claim's advisory lock, then its row lock (issue 21)",
            vec![format!(
                "CREATE FUNCTION {s}.idempotency_lock_key(p_scope text, p_key text) \
             RETURNS bigint LANGUAGE sql VOLATILE AS $f$ \
                 SELECT pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, \
                     hashtext(p_scope || chr(1) || p_key)); \
                 SELECT count(*) FROM (SELECT 1 FROM {s}.idempotency_keys AS x \
                     WHERE x.scope = p_scope AND x.key = p_key FOR UPDATE) AS held; \
             $f$;"
            )],
        ),
        (
            3,
            "idempotency_lock_key in PL/pgSQL: its plans cached per session (issues 17, 21)",
            // The same two steps as migration 2. A `LANGUAGE sql` function with two statements
            // is not inlined, so PostgreSQL parsed and planned both on every call (about a
            // third of a new key's claim); PL/pgSQL keeps their plans for the session. Each of
            // its statements still takes a fresh snapshot at READ COMMITTED, so the row lock
            // sees a row that the claim it waited for committed.
            vec![format!(
                "CREATE OR REPLACE FUNCTION {s}.idempotency_lock_key(p_scope text, p_key text) \
             RETURNS bigint LANGUAGE plpgsql VOLATILE AS $f$ \
             DECLARE held bigint; \
             BEGIN \
                 PERFORM pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, \
                     hashtext(p_scope || chr(1) || p_key)); \
                 SELECT count(*) INTO held FROM (SELECT 1 FROM {s}.idempotency_keys AS x \
                     WHERE x.scope = p_scope AND x.key = p_key FOR UPDATE) AS r; \
                 RETURN held; \
             END $f$;"
            )],
        ),
        (
            4,
            "idempotency_lock_key without two executor runs per call (issues 17, 21)",
            // The same two steps again, cheaper. `PERFORM` of the advisory lock started an
            // executor for what is one function call: as an assignment it is a PL/pgSQL
            // "simple expression", evaluated directly. The row lock needs no aggregate: `FOUND`
            // says whether there was a row. The row lock is still a statement of its own, so
            // it still runs on a fresh snapshot taken after the advisory lock.
            vec![format!(
                "CREATE OR REPLACE FUNCTION {s}.idempotency_lock_key(p_scope text, p_key text) \
             RETURNS bigint LANGUAGE plpgsql VOLATILE AS $f$ \
             DECLARE done text; \
             BEGIN \
                 done := pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, \
                     hashtext(p_scope || chr(1) || p_key))::text; \
                 PERFORM FROM {s}.idempotency_keys AS x \
                     WHERE x.scope = p_scope AND x.key = p_key FOR UPDATE; \
                 RETURN CASE WHEN FOUND THEN 1 ELSE 0 END; \
             END $f$;"
            )],
        ),
        (
            5,
            "deletions take the key's advisory lock; a new key's insert takes only that (issue 21)",
            // No change to the tables: a change of protocol. From this version on every
            // deletion takes the key's lock, so a claim of a new key no longer locks the row
            // first; a build that deletes without the lock must not share the schema, and the
            // version keeps it out. The comment tells anyone deleting rows by hand.
            vec![format!(
                "COMMENT ON TABLE {s}.idempotency_keys IS 'idempotency-store records. Delete \
                 rows only through the store or its CLI, or in a transaction that first takes \
                 the key''s lock: SELECT pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, \
                 hashtext(scope || chr(1) || key));'"
            )],
        ),
        (
            6,
            "claim ids: a claim whose answer was lost gets its lease back (issue 30)",
            // Nullable, no default: PostgreSQL adds it without rewriting the table. Rows of
            // builds before this one carry NULL, which no claim id matches.
            vec![format!(
                "ALTER TABLE {s}.idempotency_keys ADD COLUMN IF NOT EXISTS claim_id bigint"
            )],
        ),
        (
            7,
            "the key's advisory lock names the schema: schemas no longer hold up each other (issue 59)",
            // Advisory locks are the database's, not the schema's: with the old hash a claim
            // in one schema waited for a claim of the same key in another, and a sweep skipped
            // a record whose key another schema was claiming, deleting fewer than had expired.
            // A change of protocol, as migration 5: a build that locks by the old hash must
            // not share the schema, and the version keeps it out.
            vec![format!(
                "CREATE OR REPLACE FUNCTION {s}.idempotency_lock_key(p_scope text, p_key text) \
             RETURNS bigint LANGUAGE plpgsql VOLATILE AS $f$ \
             DECLARE done text; \
             BEGIN \
                 done := pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, {lock})::text; \
                 PERFORM FROM {s}.idempotency_keys AS x \
                     WHERE x.scope = p_scope AND x.key = p_key FOR UPDATE; \
                 RETURN CASE WHEN FOUND THEN 1 ELSE 0 END; \
             END $f$; \
             COMMENT ON TABLE {s}.idempotency_keys IS 'idempotency-store records. Delete \
                 rows only through the store or its CLI, or in a transaction that first takes \
                 the key''s lock: SELECT pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, {comment});'",
                lock = key_hash(schema, "p_scope", "p_key"),
                comment = key_hash(schema, "scope", "key").replace('\'', "''"),
            )],
        ),
        (
            8,
            "the expiry index holds the sweep's whole order (issue 58)",
            // A sweep takes the oldest expired rows, ties by stored key (`sql::Sql::sweep`).
            // An index on `expires_at` alone left the ties to a sort of every row of that
            // millisecond: with a day's records expiring in one, each 64-row statement sorted
            // all of them. On the whole order, the index hands out the first rows and stops.
            // It serves every lookup by expiry the old index did, which it replaces.
            vec![
                format!(
                    "CREATE INDEX idempotency_keys_sweep_order ON {s}.idempotency_keys \
                     (expires_at, octet_length(scope), (scope COLLATE \"C\"), (key COLLATE \"C\"))"
                ),
                format!("DROP INDEX {s}.idempotency_keys_expires_at"),
            ],
        ),
    ]
}

/// Brings the schema to [`SCHEMA_VERSION`] in one transaction, under an advisory lock per
/// schema, so that instances starting together apply each migration exactly once; with
/// `track_usage` (a store with a quota) also turns quota accounting on; `distributed`, the
/// records table is made a Citus distributed table (see `distributed`).
pub(super) fn migrate(
    client: &mut Client,
    schema: &str,
    track_usage: bool,
    distributed: bool,
) -> Result<()> {
    const CONTEXT: &str = "migrating the PostgreSQL schema";
    let mut txn = client.transaction().map_err(|e| pg(CONTEXT, e))?;
    lock_schema(&mut txn, schema).map_err(|e| pg(CONTEXT, e))?;
    // DDL only when something is missing, so that a role without CREATE rights can open an
    // already migrated schema.
    let exists = |txn: &mut ::postgres::Transaction<'_>, sql: &str| -> Result<bool> {
        let row = Query::new(sql.to_owned())
            .query_one(txn, &[&schema])
            .map_err(|e| pg(CONTEXT, e))?;
        col(&row, 0)
    };
    if !exists(
        &mut txn,
        "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1::text)",
    )? {
        txn.batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
            .map_err(|e| pg(CONTEXT, e))?;
    }
    if !exists(
        &mut txn,
        "SELECT to_regclass(quote_ident($1::text) || '.idempotency_schema_migrations') IS NOT NULL",
    )? {
        txn.batch_execute(&format!(
            "CREATE TABLE \"{schema}\".idempotency_schema_migrations ( \
                 version integer PRIMARY KEY, \
                 description text NOT NULL, \
                 applied_at timestamptz NOT NULL DEFAULT now())"
        ))
        .map_err(|e| pg(CONTEXT, e))?;
    }
    let applied: Vec<i32> = Query::new(format!(
        "SELECT version FROM \"{schema}\".idempotency_schema_migrations"
    ))
    .query(&mut txn, &[])
    .map_err(|e| pg(CONTEXT, e))?
    .iter()
    .map(|row| col(row, 0))
    .collect::<Result<_>>()?;
    if let Some(newer) = applied.iter().copied().find(|&v| v > SCHEMA_VERSION) {
        return Err(newer_schema(schema, newer));
    }
    for (version, description, statements) in migrations(schema) {
        if applied.contains(&version) {
            continue;
        }
        for sql in statements {
            run_migration(&mut txn, schema, &sql)?;
        }
        Query::new(format!(
            "INSERT INTO \"{schema}\".idempotency_schema_migrations (version, description) \
             VALUES ($1::integer, $2::text)"
        ))
        .execute(&mut txn, &[&version, &description])
        .map_err(|e| pg(CONTEXT, e))?;
    }
    if track_usage {
        quota::track_usage(&mut txn, &format!("\"{schema}\""))?;
    }
    if distributed {
        super::distributed::distribute(&mut txn, schema)?;
    }
    txn.commit().map_err(|e| pg(CONTEXT, e))
}

/// One statement of a migration. A table of the same name that the schema's record of
/// migrations does not know of is a schema this store did not make.
fn run_migration(txn: &mut ::postgres::Transaction<'_>, schema: &str, sql: &str) -> Result<()> {
    const CONTEXT: &str = "migrating the PostgreSQL schema";
    txn.batch_execute(sql).map_err(|e| {
        if e.code() == Some(&::postgres::error::SqlState::DUPLICATE_TABLE) {
            Error::NotAStore {
                reason: format!(
                    "schema \"{schema}\" already holds a table or sequence this store would \
                     create, but no record of its migrations: {e}"
                ),
            }
        } else {
            pg(CONTEXT, e)
        }
    })
}

/// Takes the schema's migration lock until the end of `txn`: whoever changes the schema's
/// objects holds it, so that instances starting together change each thing exactly once.
pub(super) fn lock_schema(
    txn: &mut ::postgres::Transaction<'_>,
    schema: &str,
) -> std::result::Result<(), ::postgres::Error> {
    let hash = blake3::hash(format!("idempotency-store migrations {schema}").as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&hash.as_bytes()[..8]);
    Query::new("SELECT pg_advisory_xact_lock($1::bigint)".to_owned())
        .execute(txn, &[&i64::from_le_bytes(first)])
        .map(drop)
}

/// Checks, changing nothing, that the schema holds a store at exactly [`SCHEMA_VERSION`]
/// (and, with `track_usage`, that quota accounting is on), for a store that connects without
/// migrating: a missing, older or newer schema is [`Error::NotAStore`], saying what to do.
pub(super) fn check(client: &mut Client, schema: &str, track_usage: bool) -> Result<()> {
    const CONTEXT: &str = "checking the PostgreSQL schema";
    let row = Query::new(
        "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1::text), \
         to_regclass(quote_ident($1::text) || '.idempotency_schema_migrations') IS NOT NULL"
            .to_owned(),
    )
    .query_one(client, &[&schema])
    .map_err(|e| pg(CONTEXT, e))?;
    let not_a_store = |what: String| {
        Err(Error::NotAStore {
            reason: format!(
                "{what}; nothing was created, as migrations are off (PgStoreBuilder::migrate)"
            ),
        })
    };
    if !col::<bool>(&row, 0)? {
        return not_a_store(format!("schema \"{schema}\" does not exist"));
    }
    if !col::<bool>(&row, 1)? {
        return not_a_store(format!(
            "schema \"{schema}\" holds no idempotency store (no idempotency_schema_migrations)"
        ));
    }
    let row = Query::new(format!(
        "SELECT max(version) FROM \"{schema}\".idempotency_schema_migrations"
    ))
    .query_one(client, &[])
    .map_err(|e| pg(CONTEXT, e))?;
    match col::<Option<i32>>(&row, 0)?.unwrap_or(0) {
        SCHEMA_VERSION => {}
        newer if newer > SCHEMA_VERSION => return Err(newer_schema(schema, newer)),
        older => {
            return Err(Error::NotAStore {
                reason: format!(
                    "schema \"{schema}\" is at migration {older} and this build needs \
                     {SCHEMA_VERSION}; nothing was changed, as migrations are off \
                     (PgStoreBuilder::migrate): use a build of the version the services run, or \
                     let a service of this build migrate it"
                ),
            });
        }
    }
    if track_usage && !quota::usage_tracked(client, &format!("\"{schema}\""))? {
        return not_a_store(format!(
            "quota accounting is off in schema \"{schema}\" (a store with a quota turns it on)"
        ));
    }
    Ok(())
}

/// A schema that a newer build migrated: this build would misread it.
fn newer_schema(schema: &str, newer: i32) -> Error {
    Error::NotAStore {
        reason: format!(
            "schema \"{schema}\" is at migration {newer}; this build knows up to \
             {SCHEMA_VERSION}: use a build at least as new as the one that migrated it"
        ),
    }
}
