//! The distributed mode ([`PgStoreBuilder::distributed`](super::PgStoreBuilder::distributed)):
//! the records table as a Citus distributed table, sharded by `key`, and the sweep in a form
//! that Citus runs across shards.
//!
//! Why by `key` alone: every statement of a request's path filters on `scope = $2 AND key = $3`,
//! so Citus routes it to the one shard of `key` whatever the scope; the primary key
//! `(scope, key)` contains the distribution column, as Citus requires of a unique constraint.
//!
//! Where each part of a statement runs (Citus 13, checked by `tests/postgres/pg_citus.rs`): a
//! statement that writes keeps its volatile parts (the key's advisory lock, the clock, the
//! durability settings, the token's `nextval`) in a materialized CTE, which Citus evaluates on
//! the coordinator as a subplan; the write itself is one task on the key's shard (a new key's
//! insert puts the same parts, in the same order, in a row of `VALUES` instead: see
//! `sql::distributed_insert`). So the key's lock is the coordinator's (exclusive per key as
//! long as every client connects to the coordinator, which `connect` checks), the token comes
//! from the coordinator's one sequence (unique and increasing cluster-wide), and leases are
//! granted and fenced on the coordinator's clock, whichever worker holds the shard. A lookup
//! has nothing volatile to hoist but the clock, and runs whole on the worker: its `now` is the
//! worker's.
//!
//! The sweep: a multi-shard `DELETE` with `LIMIT`, `ctid` and `FOR UPDATE SKIP LOCKED` is not
//! something Citus distributes. Here a sweep reads the clock once, picks at most its limit of
//! expired keys across the shards (ordered and limited per shard, merged on the coordinator),
//! takes the key lock of each it can (on the coordinator, skipping keys being claimed), and
//! deletes those that are still expired, in one transaction.

use ::postgres::Client;

use super::lock::{CLAIM_LOCK_CLASS, CLOCK, key_hash};
use super::rows::{col, pg};
use super::typed::Query;
use crate::error::{Error, Result};

/// The sweep's statements in the distributed mode.
#[derive(Clone)]
pub(super) struct Sql {
    /// `$1` or the coordinator's clock, in milliseconds.
    now: Query,
    /// At most `$2` expired keys at `$1`, oldest expiry first: `(scope, key)` rows.
    pick: Query,
    /// Of the keys `$1` (scopes) and `$2` (keys), the indexes (from 1) whose lock it took.
    lock: Query,
    /// Deletes the keys `$2`/`$3` that are still expired at `$1`; answers one row each.
    delete: Query,
}

impl Sql {
    pub(super) fn new(schema: &str) -> Sql {
        let t = format!("\"{schema}\".idempotency_keys");
        Sql {
            now: Query::new(format!("SELECT COALESCE($1::bigint, {CLOCK})")),
            pick: Query::new(format!(
                "SELECT x.scope, x.key FROM {t} AS x WHERE x.expires_at <= $1::bigint \
                 ORDER BY x.expires_at, octet_length(x.scope), x.scope COLLATE \"C\", \
                     x.key COLLATE \"C\" \
                 LIMIT $2::bigint"
            )),
            lock: Query::new(format!(
                "SELECT u.i FROM unnest($1::text[], $2::text[]) WITH ORDINALITY AS u(s, k, i) \
                 WHERE pg_try_advisory_xact_lock({CLAIM_LOCK_CLASS}, {}) ORDER BY u.i",
                key_hash(schema, "u.s", "u.k")
            )),
            delete: Query::new(format!(
                "DELETE FROM {t} AS r WHERE r.key = ANY($3::text[]) AND r.expires_at <= $1::bigint \
                 AND (r.scope, r.key) IN (SELECT u.s, u.k FROM unnest($2::text[], $3::text[]) \
                     AS u(s, k)) \
                 RETURNING 1"
            )),
        }
    }

    pub(super) fn all_mut(&mut self) -> [&mut Query; 4] {
        [
            &mut self.now,
            &mut self.pick,
            &mut self.lock,
            &mut self.delete,
        ]
    }

    #[cfg(test)]
    pub(super) fn all(&self) -> [&Query; 4] {
        [&self.now, &self.pick, &self.lock, &self.delete]
    }
}

/// One round of the distributed sweep, of at most `limit` keys, in one transaction: answers
/// (deleted, candidates), as the single-server sweep's statement does.
pub(super) fn sweep_once(
    client: &mut Client,
    st: &Sql,
    now: Option<i64>,
    limit: i64,
) -> Result<(usize, usize)> {
    const CONTEXT: &str = "sweeping expired records";
    let mut txn = client.transaction().map_err(|e| pg(CONTEXT, e))?;
    let row = st
        .now
        .query_one(&mut txn, &[&now])
        .map_err(|e| pg(CONTEXT, e))?;
    let now: i64 = col(&row, 0)?;
    let picked = st
        .pick
        .query(&mut txn, &[&now, &limit])
        .map_err(|e| pg(CONTEXT, e))?;
    let mut scopes = Vec::with_capacity(picked.len());
    let mut keys = Vec::with_capacity(picked.len());
    for row in &picked {
        scopes.push(col::<String>(row, 0)?);
        keys.push(col::<String>(row, 1)?);
    }
    if picked.is_empty() {
        txn.commit().map_err(|e| pg(CONTEXT, e))?;
        return Ok((0, 0));
    }
    let locked = st
        .lock
        .query(&mut txn, &[&scopes, &keys])
        .map_err(|e| pg(CONTEXT, e))?;
    let (mut free_scopes, mut free_keys) = (Vec::new(), Vec::new());
    for row in &locked {
        let i = usize::try_from(col::<i64>(row, 0)?).unwrap_or(usize::MAX);
        if let (Some(scope), Some(key)) = (
            i.checked_sub(1).and_then(|i| scopes.get(i)),
            i.checked_sub(1).and_then(|i| keys.get(i)),
        ) {
            free_scopes.push(scope.clone());
            free_keys.push(key.clone());
        }
    }
    let deleted = if free_keys.is_empty() {
        0
    } else {
        st.delete
            .query(&mut txn, &[&now, &free_scopes, &free_keys])
            .map_err(|e| pg(CONTEXT, e))?
            .len()
    };
    txn.commit().map_err(|e| pg(CONTEXT, e))?;
    Ok((deleted, picked.len()))
}

/// Refuses a server where the distributed mode cannot work: no Citus in the database, or a
/// node that is not the coordinator (the key's lock is the coordinator's: a client on a
/// worker would take another node's).
pub(super) fn check_coordinator(client: &mut impl ::postgres::GenericClient) -> Result<()> {
    const CONTEXT: &str = "checking for Citus";
    let row =
        Query::new("SELECT EXISTS (SELECT FROM pg_extension WHERE extname = 'citus')".to_owned())
            .query_one(client, &[])
            .map_err(|e| pg(CONTEXT, e))?;
    if !col::<bool>(&row, 0)? {
        return Err(Error::InvalidConfig {
            reason: "distributed(true) needs the citus extension in the database (\
                     shared_preload_libraries = 'citus', then CREATE EXTENSION citus on the \
                     coordinator): connect to a Citus coordinator, or turn distributed off"
                .to_owned(),
        });
    }
    let row = Query::new("SELECT citus_is_coordinator()".to_owned())
        .query_one(client, &[])
        .map_err(|e| pg(CONTEXT, e))?;
    if !col::<bool>(&row, 0)? {
        return Err(Error::InvalidConfig {
            reason: "distributed(true) must connect to the Citus coordinator, not a worker: \
                     the key's lock is taken on the node the store connects to"
                .to_owned(),
        });
    }
    Ok(())
}

/// Whether the schema's records table is a distributed table.
fn is_distributed(client: &mut impl ::postgres::GenericClient, schema: &str) -> Result<bool> {
    let row = Query::new(
        "SELECT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = \
         to_regclass(quote_ident($1::text) || '.idempotency_keys'))"
            .to_owned(),
    )
    .query_one(client, &[&schema])
    .map_err(|e| pg("checking the distributed table", e))?;
    col(&row, 0)
}

/// Distributes the records table by `key`, unless it already is (in the migration's
/// transaction, under the schema's migration lock), on a server [`check_coordinator`] passed.
pub(super) fn distribute(txn: &mut ::postgres::Transaction<'_>, schema: &str) -> Result<()> {
    if is_distributed(txn, schema)? {
        return Ok(());
    }
    Query::new(
        "SELECT create_distributed_table(quote_ident($1::text) || '.idempotency_keys', 'key')"
            .to_owned(),
    )
    .execute(txn, &[&schema])
    .map_err(|e| pg("distributing the records table", e))?;
    Ok(())
}

/// Checks, changing nothing, that the records table is distributed (a store that connects
/// without migrating).
pub(super) fn check(client: &mut Client, schema: &str) -> Result<()> {
    if is_distributed(client, schema)? {
        return Ok(());
    }
    Err(Error::NotAStore {
        reason: format!(
            "schema \"{schema}\" holds a store whose records table is not distributed; nothing \
             was changed, as migrations are off (PgStoreBuilder::migrate): let a distributed \
             store migrate it"
        ),
    })
}

/// The combinations the distributed mode refuses, before anything is sent.
pub(super) fn refuse(quota: bool, prepare_statements: bool) -> Result<()> {
    if quota {
        return Err(Error::InvalidConfig {
            reason: "distributed(true) does not support max_records or max_bytes: their \
                     accounting row would make every claim a distributed transaction; bound \
                     the table with retention and sweeps instead"
                .to_owned(),
        });
    }
    if !prepare_statements {
        return Err(Error::InvalidConfig {
            reason: "distributed(true) does not support prepare_statements(false): the \
                     routines for transaction poolers are not distributed functions; use \
                     PgBouncer 1.21+ with max_prepared_statements, or a session pooler"
                .to_owned(),
        });
    }
    Ok(())
}
