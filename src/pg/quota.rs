//! Quotas on PostgreSQL: `max_records` / `max_bytes`, for the whole table or per scope, with
//! the redb store's `WhenFull` choices.
//!
//! Usage is counted by a trigger into `idempotency_usage`, one row per scope and shard (the
//! shard is the server process id modulo [`SHARDS`], so that concurrent writers of one scope
//! rarely wait for each other's counter row). The table and trigger are created, and the
//! counters seeded from the records, by the first store that connects with a quota; schemas
//! without quotas pay nothing. A claim of a new key reads the counters first and makes room as the redb store
//! does: expired records go first, then (if allowed) the oldest completed ones.

use ::postgres::types::ToSql;
use ::postgres::{Client, GenericClient, Transaction};

use super::lock::{WRITE_NOW, try_key_lock};
use super::rows::{col, pg};
use super::typed::Query;
use crate::api::settings::WhenFull;
use crate::error::{Error, Result};

/// Counter rows per scope.
const SHARDS: i32 = 16;

/// Expired records deleted per attempt to make room (as the redb store).
const ROOM_SWEEP: i64 = 64;

/// Completed records an eviction considers, oldest first, for the first whose key lock is free.
const EVICT_CANDIDATES: i64 = 8;

/// The limits a store enforces on claims of new keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    pub max_records: Option<u64>,
    pub max_bytes: Option<u64>,
    pub when_full: WhenFull,
    pub per_scope: bool,
}

impl Limits {
    /// The limit that one more record would break, given the usage `(records, bytes)`.
    fn exceeded(&self, (records, bytes): (u64, u64)) -> Option<Error> {
        let over = |used: u64, max: Option<u64>, limit| {
            max.filter(|&max| used >= max)
                .map(|max| Error::QuotaExceeded { limit, used, max })
        };
        over(records, self.max_records, "max_records")
            .or_else(|| over(bytes, self.max_bytes, "max_bytes"))
    }
}

/// The bytes a row counts for: its key, scope, fingerprint, checkpoint and response.
fn row_bytes(row: &str) -> String {
    format!(
        "(octet_length({row}.scope) + octet_length({row}.key) + octet_length({row}.fingerprint) \
         + coalesce(octet_length({row}.checkpoint), 0) \
         + coalesce(octet_length({row}.response_headers), 0) \
         + coalesce(octet_length({row}.response_body), 0))::bigint"
    )
}

/// The counters table and the trigger function that keeps them.
fn usage_objects(s: &str) -> String {
    let (old, new) = (row_bytes("OLD"), row_bytes("NEW"));
    format!(
        "CREATE TABLE IF NOT EXISTS {s}.idempotency_usage ( \
             scope   text     NOT NULL, \
             shard   smallint NOT NULL, \
             records bigint   NOT NULL, \
             bytes   bigint   NOT NULL, \
             PRIMARY KEY (scope, shard)); \
         CREATE OR REPLACE FUNCTION {s}.idempotency_usage_track() RETURNS trigger LANGUAGE plpgsql AS $f$ \
         DECLARE d_records bigint := 0; d_bytes bigint := 0; row_scope text; \
         BEGIN \
             IF TG_OP <> 'INSERT' THEN \
                 d_records := d_records - 1; d_bytes := d_bytes - {old}; row_scope := OLD.scope; \
             END IF; \
             IF TG_OP <> 'DELETE' THEN \
                 d_records := d_records + 1; d_bytes := d_bytes + {new}; row_scope := NEW.scope; \
             END IF; \
             IF d_records <> 0 OR d_bytes <> 0 THEN \
                 INSERT INTO {s}.idempotency_usage AS u (scope, shard, records, bytes) \
                 VALUES (row_scope, pg_backend_pid() % {SHARDS}, d_records, d_bytes) \
                 ON CONFLICT (scope, shard) DO UPDATE \
                 SET records = u.records + EXCLUDED.records, bytes = u.bytes + EXCLUDED.bytes; \
             END IF; \
             RETURN NULL; \
         END $f$;"
    )
}

/// Turns usage counting on for the schema `s` (quoted) unless it is on: creates the counters
/// table, the trigger and its function, and seeds the counters, with writers locked out
/// meanwhile so that nothing is missed. Runs in the migration's transaction, under its lock.
pub(crate) fn track_usage(txn: &mut Transaction<'_>, s: &str) -> Result<()> {
    const CONTEXT: &str = "turning on quota accounting";
    if usage_tracked(txn, s)? {
        return Ok(());
    }
    txn.batch_execute(&format!(
        "LOCK TABLE {s}.idempotency_keys IN SHARE ROW EXCLUSIVE MODE; {objects} \
         CREATE TRIGGER idempotency_usage_track \
             AFTER INSERT OR UPDATE OR DELETE ON {s}.idempotency_keys \
             FOR EACH ROW EXECUTE FUNCTION {s}.idempotency_usage_track(); \
         DELETE FROM {s}.idempotency_usage; \
         INSERT INTO {s}.idempotency_usage (scope, shard, records, bytes) \
             SELECT r.scope, 0, count(*), coalesce(sum({bytes}), 0) \
             FROM {s}.idempotency_keys AS r GROUP BY r.scope;",
        bytes = row_bytes("r"),
        objects = usage_objects(s),
    ))
    .map_err(|e| pg(CONTEXT, e))
}

/// Whether usage counting is on for the schema `s` (quoted): its trigger exists.
pub(crate) fn usage_tracked(client: &mut impl GenericClient, s: &str) -> Result<bool> {
    let row = Query::new(format!(
        "SELECT EXISTS (SELECT FROM pg_trigger WHERE tgname = 'idempotency_usage_track' \
         AND tgrelid = '{s}.idempotency_keys'::regclass)"
    ))
    .query_one(client, &[])
    .map_err(|e| pg("checking quota accounting", e))?;
    col(&row, 0)
}

/// The quota statements, for one schema (`t` the table, `u` the counters); used only by a
/// store with a quota (the counters table exists only then).
#[derive(Clone)]
pub(crate) struct Sql {
    usage: Query,
    exists: Query,
    sweep: Query,
    evict: Query,
    check: Query,
}

impl Sql {
    pub(crate) fn new(schema: &str) -> Sql {
        let s = format!("\"{schema}\"");
        let t = format!("{s}.idempotency_keys");
        let u = format!("{s}.idempotency_usage");
        Sql {
            usage: Query::new(format!(
                "SELECT coalesce(sum(records), 0)::bigint, coalesce(sum(bytes), 0)::bigint \
                 FROM {u} WHERE $1::text IS NULL OR scope = $1::text"
            )),
            exists: Query::new(format!(
                "SELECT EXISTS (SELECT FROM {t} WHERE scope = $1::text AND key = $2::text)"
            )),
            // As the store's sweep: deletions take the key's lock, skipping keys being claimed,
            // and the time is a subquery, so that the index bounds the scan (`Sql::sweep`).
            sweep: Query::new(format!(
                "{WRITE_NOW}, doomed AS MATERIALIZED (\
                     SELECT x.ctid, x.scope, x.key FROM {t} AS x \
                     WHERE x.expires_at <= (SELECT c.now FROM c) \
                     AND ($2::text IS NULL OR x.scope = $2::text) \
                     ORDER BY x.expires_at LIMIT $3::bigint FOR UPDATE OF x SKIP LOCKED), \
                 free AS MATERIALIZED (SELECT d.ctid FROM doomed AS d WHERE {}) \
                 DELETE FROM {t} AS r USING free AS f, c \
                 WHERE r.ctid = f.ctid AND r.expires_at <= c.now",
                try_key_lock(schema, "d.scope", "d.key")
            )),
            // The oldest completed record whose key lock is free, of the oldest few (a replay
            // holds its key's lock for a moment). `victim` reads `victims` in its order, and
            // with no sort of its own stops at the first lock it gets, so it takes only that one.
            evict: Query::new(format!(
                "{WRITE_NOW}, victims AS MATERIALIZED (\
                     SELECT x.ctid, x.scope, x.key, x.expires_at FROM {t} AS x \
                     WHERE x.state = 'completed' \
                     AND x.expires_at > (SELECT c.now FROM c) AND ($2::text IS NULL OR x.scope = $2::text) \
                     ORDER BY x.expires_at LIMIT {EVICT_CANDIDATES} FOR UPDATE OF x SKIP LOCKED), \
                 victim AS MATERIALIZED (SELECT v.ctid FROM victims AS v WHERE {} LIMIT 1) \
                 DELETE FROM {t} AS r USING victim AS v \
                 WHERE r.ctid = v.ctid AND r.state = 'completed'",
                try_key_lock(schema, "v.scope", "v.key")
            )),
            check: Query::new(format!(
                "SELECT (SELECT count(*) FROM {t}), \
                     (SELECT coalesce(sum({bytes}), 0)::bigint FROM {t} AS r), \
                     (SELECT coalesce(sum(records), 0)::bigint FROM {u}), \
                     (SELECT coalesce(sum(bytes), 0)::bigint FROM {u}), \
                     EXISTS (SELECT FROM pg_trigger WHERE tgname = 'idempotency_usage_track' \
                         AND tgrelid = '{t}'::regclass)",
                bytes = row_bytes("r")
            )),
        }
    }
}

/// Before a claim: makes room for the key if it is new and the store is at a limit, or fails
/// closed with [`Error::QuotaExceeded`]. `now` gives each statement its `$1`.
pub(crate) fn make_room(
    client: &mut Client,
    st: &Sql,
    limits: &Limits,
    now: &(dyn Fn() -> Option<i64> + Sync),
    (scope, name): (&str, &str),
) -> Result<()> {
    let counted = limits.per_scope.then_some(scope);
    let usage = |client: &mut Client| -> Result<(u64, u64)> {
        let row = st
            .usage
            .query_one(client, &[&counted])
            .map_err(|e| pg("reading quota usage", e))?;
        let count = |i| -> Result<u64> { Ok(u64::try_from(col::<i64>(&row, i)?).unwrap_or(0)) };
        Ok((count(0)?, count(1)?))
    };
    if limits.exceeded(usage(client)?).is_none() {
        return Ok(());
    }
    // A key that has a record (even an expired one) adds no row: claim it as usual.
    let exists: bool = col(
        &st.exists
            .query_one(client, &[&scope, &name])
            .map_err(|e| pg("reading a record", e))?,
        0,
    )?;
    if exists {
        return Ok(());
    }
    let delete = |client: &mut Client, statement: &Query, extra: &[&(dyn ToSql + Sync)]| {
        let mut params: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(3);
        let now = now();
        params.push(&now);
        params.push(&counted);
        params.extend_from_slice(extra);
        statement
            .execute(client, &params)
            .map_err(|e| pg("making room for a new key", e))
    };
    delete(client, &st.sweep, &[&ROOM_SWEEP])?;
    if limits.when_full == WhenFull::EvictOldestCompleted {
        while limits.exceeded(usage(client)?).is_some() && delete(client, &st.evict, &[])? > 0 {}
    }
    match limits.exceeded(usage(client)?) {
        Some(err) => Err(err),
        None => Ok(()),
    }
}

/// `verify`: with quota accounting on, the counters must match the table.
pub(crate) fn check_usage(
    txn: &mut Transaction<'_>,
    st: &Sql,
    problems: &mut Vec<String>,
) -> Result<()> {
    let row = st
        .check
        .query_one(txn, &[])
        .map_err(|e| pg("verifying quota usage", e))?;
    let tracked: bool = col(&row, 4)?;
    let (records, bytes): (i64, i64) = (col(&row, 0)?, col(&row, 1)?);
    let (counted_records, counted_bytes): (i64, i64) = (col(&row, 2)?, col(&row, 3)?);
    if tracked && (records, bytes) != (counted_records, counted_bytes) {
        problems.push(format!(
            "quota counters say {counted_records} records and {counted_bytes} bytes, the table \
             holds {records} records and {bytes} bytes"
        ));
    }
    Ok(())
}

impl Sql {
    /// Every quota statement.
    #[cfg(test)]
    pub(crate) fn all(&self) -> [&Query; 5] {
        [
            &self.usage,
            &self.exists,
            &self.sweep,
            &self.evict,
            &self.check,
        ]
    }

    /// Every quota statement, to prepare.
    pub(crate) fn all_mut(&mut self) -> [&mut Query; 5] {
        [
            &mut self.usage,
            &mut self.exists,
            &mut self.sweep,
            &mut self.evict,
            &mut self.check,
        ]
    }
}
