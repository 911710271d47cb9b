//! The text of every statement, for one schema: the fence that statements share, and [`Sql`],
//! built once per store.

use super::lock::{
    CLOCK, DURABLE_CALLS, NOW, SWEEP_NOW, WRITE_NOW, after_lock, key_lock, try_key_lock,
};
use super::rows::RECORD_COLUMNS;
use super::typed::Query;
use super::{distributed, quota};
use ::postgres::Client;

/// `idempotency_lock_key` (migration 2; PL/pgSQL since migration 3, cheaper since 4): the key's
/// advisory lock, then its row lock if there is a row, on a snapshot taken after the advisory
/// lock (each statement of a volatile PL/pgSQL function takes a fresh one at READ COMMITTED),
/// so that it also waits out a write to a row that the claim it waited for committed; the
/// statement's own snapshot, taken before the wait, would not see that row.
fn lock_function(schema: &str, scope: &str, key: &str) -> String {
    format!("\"{schema}\".idempotency_lock_key({scope}::text, {key}::text)")
}

/// The fence of `complete`, `release`, `heartbeat` and `checkpoint` (`$4` is the token).
const FENCE: &str = "r.scope = $2::text AND r.key = $3::text AND r.token = $4::bigint \
                     AND r.state = 'in_progress' AND r.expires_at > c.now";

/// Rows fetched per round trip by `verify`.
pub(super) const VERIFY_BATCH: i32 = 1000;

/// `verify`'s cursor, which lives until its transaction ends.
const VERIFY_CURSOR: &str = "idempotency_verify";

/// The SQL of every statement, for one schema; each pooled connection has its own copy, with
/// its statements prepared on it unless `prepare_statements` is off.
#[derive(Clone)]
pub(super) struct Sql {
    pub(super) lock: Query,
    pub(super) insert: Query,
    pub(super) select: Query,
    pub(super) takeover: Query,
    pub(super) complete: Query,
    /// Locks a lease's row under its fence (`complete_with`).
    pub(super) lock_lease: Query,
    pub(super) release: Query,
    pub(super) heartbeat: Query,
    pub(super) checkpoint: Query,
    pub(super) sweep: Query,
    pub(super) stats: Query,
    /// Opens `verify`'s cursor over every record (a cursor, unlike a protocol-level portal,
    /// needs no named statement).
    pub(super) verify: Query,
    /// The next [`VERIFY_BATCH`] rows of `verify`'s cursor.
    pub(super) verify_fetch: Query,
    pub(super) sequence: Query,
    pub(super) now: Query,
    /// With a quota only.
    pub(super) quota: Option<quota::Sql>,
    /// In the distributed mode only: the sweep's statements (in place of `sweep`).
    pub(super) distributed: Option<distributed::Sql>,
}

impl Sql {
    /// The statements for `schema`, with a quota's if `quota`, in the distributed mode's form
    /// if `distributed` (see `distributed`).
    pub(super) fn new(schema: &str, quota: bool, distributed: bool) -> Sql {
        let t = format!("\"{schema}\".idempotency_keys");
        let seq = format!("\"{schema}\".idempotency_token_seq");
        let takeover_fresh = "r.expires_at <= c.now";
        // A new key's insert needs only the advisory lock: no row means no write in flight
        // that does not hold it (deletions take it too). A takeover waits out writes to the row.
        // Citus keeps a CTE it runs on the coordinator as an intermediate result, which
        // cannot hold the lock's `void`: the distributed mode casts it to text.
        let void = if distributed { "::text" } else { "" };
        let insert_now = after_lock(&format!("{}{void}", key_lock(schema, "$2", "$3")));
        let takeover_now = after_lock(&lock_function(schema, "$2", "$3"));
        // Citus refuses a volatile function in an UPDATE's SET on a distributed table: the
        // token is drawn in the CTE instead, which Citus evaluates on the coordinator, still
        // after the key's lock. (One server keeps the draw in the SET, where a takeover that
        // finds the record changed draws none.)
        let (takeover_now, new_token) = if distributed {
            (
                takeover_now.replacen(
                    " AS now, ",
                    &format!(" AS now, nextval('{seq}') AS token, "),
                    1,
                ),
                "c.token".to_owned(),
            )
        } else {
            (takeover_now, format!("nextval('{seq}')"))
        };
        // The shell table on a Citus coordinator holds nothing: its shards' sizes are Citus's.
        let size = if distributed {
            "citus_total_relation_size"
        } else {
            "pg_total_relation_size"
        };
        Sql {
            lock: Query::new(format!("SELECT {}", lock_function(schema, "$1", "$2"))),
            insert: Query::new(if distributed {
                distributed_insert(&t, &seq, &key_lock(schema, "$2", "$3"))
            } else {
                format!(
                    "{insert_now} INSERT INTO {t} AS r (scope, key, fingerprint, fingerprint_version, state, \
                 token, attempt, lease_until, created_at, expires_at, claim_id) \
                 SELECT $2::text, $3::text, $4::bytea, $5::smallint, 'in_progress', \
                 nextval('{seq}'), 1, c.now + $6::bigint, c.now, \
                 GREATEST(c.now + $7::bigint, c.now + $6::bigint), $8::bigint FROM c \
                 ON CONFLICT (scope, key) DO NOTHING \
                 RETURNING r.token, r.lease_until"
                )
            }),
            select: Query::new(format!(
                "{NOW} SELECT c.now, {RECORD_COLUMNS} FROM c \
                 LEFT JOIN {t} AS r ON r.scope = $2::text AND r.key = $3::text"
            )),
            takeover: Query::new(format!(
                "{takeover_now} UPDATE {t} AS r SET \
                 fingerprint = $4::bytea, fingerprint_version = $5::smallint, \
                 state = 'in_progress', token = {new_token}, \
                 attempt = CASE WHEN {takeover_fresh} THEN 1 \
                     ELSE LEAST(r.attempt + 1, 4294967295) END, \
                 created_at = CASE WHEN {takeover_fresh} THEN c.now ELSE r.created_at END, \
                 checkpoint = CASE WHEN {takeover_fresh} THEN NULL ELSE r.checkpoint END, \
                 lease_until = c.now + $6::bigint, \
                 expires_at = GREATEST(CASE WHEN {takeover_fresh} THEN c.now \
                     ELSE r.created_at END + $7::bigint, c.now + $6::bigint), \
                 response_status = NULL, response_headers = NULL, response_body = NULL, \
                 completed_at = NULL, claim_id = $8::bigint \
                 FROM c WHERE r.scope = $2::text AND r.key = $3::text \
                 AND ({takeover_fresh} OR (r.state = 'in_progress' AND r.lease_until <= c.now \
                     AND r.fingerprint = $4::bytea AND r.fingerprint_version = $5::smallint)) \
                 RETURNING r.token, r.attempt, r.lease_until, r.checkpoint"
            )),
            complete: Query::new(format!(
                "{WRITE_NOW} UPDATE {t} AS r SET state = 'completed', lease_until = NULL, \
                 checkpoint = NULL, response_status = $5::integer, response_headers = $6::bytea, \
                 response_body = $7::bytea, completed_at = c.now, \
                 expires_at = c.now + $8::bigint \
                 FROM c WHERE {FENCE} RETURNING r.token"
            )),
            // `complete_with`: holds the record while the caller's statements run.
            lock_lease: Query::new(format!(
                "{NOW} SELECT r.token FROM {t} AS r, c WHERE {FENCE} FOR UPDATE OF r"
            )),
            release: Query::new(format!(
                "{} DELETE FROM {t} AS r USING c WHERE {FENCE} RETURNING r.token",
                after_lock(&format!("{}{void}", key_lock(schema, "$2", "$3")))
            )),
            heartbeat: Query::new(format!(
                "{WRITE_NOW} UPDATE {t} AS r SET lease_until = c.now + $5::bigint, \
                 expires_at = GREATEST(r.expires_at, c.now + $5::bigint) \
                 FROM c WHERE {FENCE} RETURNING r.lease_until"
            )),
            checkpoint: Query::new(format!(
                "{WRITE_NOW} UPDATE {t} AS r SET checkpoint = $5::bytea \
                 FROM c WHERE {FENCE} RETURNING r.token"
            )),
            // The victims are chosen once, in a materialized CTE: as `ctid IN (subquery)` the
            // planner may rescan the subquery per outer row, and a rescan skips the rows this
            // statement already deleted and locks the next ones, deleting more than the limit.
            // Of those, it deletes the ones whose key lock it gets (after the limit, so that it
            // takes at most `$2` locks). Answers (deleted, candidates). The time is a subquery,
            // not a join with `c`: as a join the planner scans the index from its first entry
            // and filters, which reads every live row when few have expired; as a subquery it
            // bounds the scan (`Index Cond`), in the index's order (migration 8).
            sweep: Query::new(format!(
                "{SWEEP_NOW}, doomed AS MATERIALIZED (\
                     SELECT x.ctid, x.scope, x.key FROM {t} AS x \
                     WHERE x.expires_at <= (SELECT c.now FROM c) \
                     ORDER BY x.expires_at, octet_length(x.scope), x.scope COLLATE \"C\", \
                         x.key COLLATE \"C\" \
                     LIMIT $2::bigint FOR UPDATE OF x SKIP LOCKED), \
                 free AS MATERIALIZED (SELECT d.ctid FROM doomed AS d WHERE {}), \
                 gone AS (DELETE FROM {t} AS r USING free AS f, c \
                     WHERE r.ctid = f.ctid AND r.expires_at <= c.now RETURNING 1) \
                 SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM doomed)",
                try_key_lock(schema, "d.scope", "d.key")
            )),
            // The second count is `RecordView::is_stuck`, in SQL.
            stats: Query::new(format!(
                "{NOW} SELECT \
                 count(*) FILTER (WHERE r.expires_at > c.now AND r.state = 'in_progress'), \
                 count(*) FILTER (WHERE r.expires_at > c.now AND r.state = 'in_progress' \
                     AND r.lease_until <= c.now), \
                 count(*) FILTER (WHERE r.expires_at > c.now AND r.state = 'completed'), \
                 count(*) FILTER (WHERE r.expires_at <= c.now), \
                 {size}('{t}') \
                 FROM c LEFT JOIN {t} AS r ON true"
            )),
            verify: Query::new(format!(
                "DECLARE {VERIFY_CURSOR} NO SCROLL CURSOR FOR SELECT r.scope, r.key, octet_length(r.fingerprint), r.fingerprint_version, \
                 r.state, r.token, r.attempt, r.lease_until, r.checkpoint IS NOT NULL, \
                 r.response_status, r.response_headers, r.response_body IS NOT NULL, \
                 r.created_at, r.completed_at, r.expires_at FROM {t} AS r"
            )),
            verify_fetch: Query::new(format!("FETCH {VERIFY_BATCH} FROM {VERIFY_CURSOR}")),
            sequence: Query::new(format!("SELECT last_value, is_called FROM {seq}")),
            now: Query::new(format!("SELECT {CLOCK}")),
            quota: quota.then(|| quota::Sql::new(schema)),
            distributed: distributed.then(|| distributed::Sql::new(schema)),
        }
    }
}

/// The transaction-local setting that carries a distributed claim's time from its token's
/// column to the columns after it.
const CLAIM_NOW: &str = "idempotency_store.claim_now";

/// The distributed mode's insert of a new key (`lock` is the key's lock): one row of `VALUES`,
/// which Citus routes to the key's shard as one task. (One server's form, an `INSERT … SELECT`
/// from CTEs, Citus pulls to the coordinator, several round trips: BENCHMARKS.md, "PgStore on
/// Citus".)
///
/// Citus evaluates the row's functions on the coordinator before it sends the row: column by
/// column in the table's order, each function or operator call whole (its arguments in order,
/// as PostgreSQL evaluates them), each `CASE` or `COALESCE` part by part (so a `CASE` cannot
/// make a call conditional). The token's column is therefore one call that takes the key's
/// lock, then reads the time into a transaction-local setting, then sets the durability
/// (`durable!`), and only then draws the token: the order of one server's CTEs. The time's
/// columns come later in the table and read `$1` (an injected clock), else that setting. Read
/// before it is set, the setting is unset or empty, which makes `created_at` NULL: the claim
/// would fail rather than run on another time.
fn distributed_insert(t: &str, seq: &str, lock: &str) -> String {
    let now =
        format!("COALESCE($1::bigint, NULLIF(current_setting('{CLAIM_NOW}', true), '')::bigint)");
    format!(
        "INSERT INTO {t} AS r (scope, key, fingerprint, fingerprint_version, state, token, \
         attempt, lease_until, created_at, expires_at, claim_id) \
         VALUES ($2::text, $3::text, $4::bytea, $5::smallint, 'in_progress', \
         0 * length(concat({lock}::text, \
             set_config('{CLAIM_NOW}', COALESCE($1::bigint, {CLOCK})::text, true), \
             {DURABLE_CALLS})) + nextval('{seq}'), \
         1, {now} + $6::bigint, {now}, GREATEST({now} + $7::bigint, {now} + $6::bigint), \
         $8::bigint) \
         ON CONFLICT (scope, key) DO NOTHING RETURNING r.token, r.lease_until"
    )
}

impl Sql {
    /// Prepares every statement on `client`, the quota's included.
    pub(super) fn prepare(&mut self, client: &mut Client) -> Result<(), ::postgres::Error> {
        for query in self.all_mut() {
            query.prepare(client)?;
        }
        Ok(())
    }

    /// Every statement, the quota's included.
    #[cfg(test)]
    pub(super) fn all(&self) -> Vec<&Query> {
        let mut all = vec![
            &self.lock,
            &self.insert,
            &self.select,
            &self.takeover,
            &self.complete,
            &self.lock_lease,
            &self.release,
            &self.heartbeat,
            &self.checkpoint,
            &self.sweep,
            &self.stats,
            &self.verify,
            &self.verify_fetch,
            &self.sequence,
            &self.now,
        ];
        if let Some(quota) = &self.quota {
            all.extend(quota.all());
        }
        if let Some(distributed) = &self.distributed {
            all.extend(distributed.all());
        }
        all
    }

    /// The statements of a request's path, by a name for each: the ones that a store with
    /// `prepare_statements` off sends as calls of functions of their own (see `routines`).
    pub(super) fn routable_mut(&mut self) -> [(&'static str, &mut Query); 8] {
        [
            ("insert", &mut self.insert),
            ("select", &mut self.select),
            ("takeover", &mut self.takeover),
            ("complete", &mut self.complete),
            ("lock_lease", &mut self.lock_lease),
            ("release", &mut self.release),
            ("heartbeat", &mut self.heartbeat),
            ("checkpoint", &mut self.checkpoint),
        ]
    }

    /// Every statement to prepare, the quota's included: not `verify`'s cursor statements, as
    /// a `FETCH` cannot be described before its cursor exists (and `verify` is rare).
    fn all_mut(&mut self) -> Vec<&mut Query> {
        let mut all = vec![
            &mut self.lock,
            &mut self.insert,
            &mut self.select,
            &mut self.takeover,
            &mut self.complete,
            &mut self.lock_lease,
            &mut self.release,
            &mut self.heartbeat,
            &mut self.checkpoint,
            &mut self.sweep,
            &mut self.stats,
            &mut self.sequence,
            &mut self.now,
        ];
        if let Some(quota) = &mut self.quota {
            all.extend(quota.all_mut());
        }
        if let Some(distributed) = &mut self.distributed {
            all.extend(distributed.all_mut());
        }
        all
    }
}
