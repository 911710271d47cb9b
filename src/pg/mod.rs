//! The PostgreSQL backend: [`PgStore`], the same API and semantics as [`Store`](crate::Store)
//! on one table shared by every service instance.
//!
//! The schema, the statements and the time source are documented on [`PgStore`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ::postgres::Client;

#[cfg(doc)]
use crate::api::backend::SWEEP_BATCH;
#[cfg(doc)]
use crate::api::clock::Clock;
use crate::api::clock::Timestamp;
use crate::api::key::Key;
use crate::api::metrics::Meter;
#[cfg(doc)]
use crate::api::outcome::Claim;
#[cfg(doc)]
use crate::api::store::IdempotencyStore;
use crate::error::{Error, Result};
pub use builder::PgStoreBuilder;
use conn::Manager;
pub use replication::FailoverSafety;
use rows::{capped, millis_col, pg};
use sql::Sql;

/// The `postgres` client version [`PgStore`] uses, for the transactions of
/// [`PgStore::complete_with`] and [`PgStore::read_with`].
pub use ::postgres;

mod admin;
mod blocking;
mod builder;
mod calls;
mod claim;
mod conn;
mod distributed;
mod effects;
mod lock;
mod migrations;
mod quota;
mod replication;
mod routines;
mod rows;
mod sql;
mod sync_wait;
mod tls;
mod typed;
mod watch;

/// Durations are capped here (about 36 million years) and times at twice that, so that sums in
/// SQL never overflow a `bigint`.
const MAX_DURATION_MS: u64 = 1 << 60;
const MAX_TIME_MS: u64 = 1 << 61;

/// A store on a PostgreSQL table, shared by any number of processes and machines.
///
/// Same operations, types and outcomes as the redb [`Store`](crate::Store), through the
/// [`IdempotencyStore`] trait (import it to call them). Connections come from a pool; `PgStore`
/// is `Send + Sync`, so share one per process (for example in an `Arc`).
///
/// ```no_run
/// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, pg::PgStore, Response};
///
/// let store = PgStore::builder()
///     .pool_size(16)
///     .connect("host=127.0.0.1 user=idem password=idem dbname=idem")?;
/// let key = Key::new("8e03978e-40d5-43e8-bc93-6894a57f9324")?;
/// let fp = Fingerprint::of(["POST", "/payments", r#"{"amount":4999}"#]);
/// if let Claim::Acquired(lease) = store.claim(&key, fp)? {
///     store.complete(&lease, Response::new(201, r#"{"id":"pay_1"}"#))?;
/// }
/// # Ok::<(), idempotency_store::Error>(())
/// ```
///
/// Differences from the redb store: every call is a network round trip (see below);
/// `Stats::file_bytes` is the table's total size on the server (indexes and TOAST included);
/// `VerifyReport::expiry_entries` equals the record count, as PostgreSQL maintains the
/// `expires_at` index itself; there is no group commit (PostgreSQL groups WAL flushes of
/// concurrent commits itself); quotas may apply per scope, and are checked, not locked (see
/// [`PgStoreBuilder::max_records`]). A pooled connection
/// that the server dropped fails one call with [`Error::Storage`] and is then replaced.
///
/// # TLS
///
/// The connection string's `sslmode` decides, as in libpq: `disable` (plain TCP), `prefer`
/// (the default: TLS if the server offers it), `require` (TLS, certificate not checked),
/// `verify-ca` (the certificate must chain to a trusted root) and `verify-full` (and also name
/// the host or IP address connected to). `sslrootcert` names a PEM file holding the trusted
/// roots (replacing the system's; `require` with such a file checks the chain, as libpq does);
/// without it, or with `sslrootcert=system`, the system's roots are trusted. TLS is rustls
/// (`ring` provider; no system library is needed to build). rustls, unlike OpenSSL, refuses a
/// CA certificate as the server's own: a self-signed server certificate that the verifying
/// modes trust must say `basicConstraints = CA:FALSE` (or come from a CA of its own).
///
/// ```no_run
/// # use idempotency_store::pg::PgStore;
/// let store = PgStore::connect(
///     "postgresql://idem:idem@db.internal/idem?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem",
/// )?;
/// # Ok::<(), idempotency_store::Error>(())
/// ```
///
/// # Schema
///
/// Everything lives in one PostgreSQL schema (`public` unless [`PgStoreBuilder::schema`] says
/// otherwise), created and migrated when a store connects (unless
/// [`PgStoreBuilder::migrate`] is off):
///
/// ```sql
/// CREATE SEQUENCE idempotency_token_seq;            -- fencing tokens
/// CREATE TABLE idempotency_keys (
///     scope               text     NOT NULL,      -- '' for an unscoped key
///     key                 text     NOT NULL,
///     fingerprint         bytea    NOT NULL,      -- the 32-byte digest
///     fingerprint_version smallint NOT NULL,
///     state               text     NOT NULL,      -- 'in_progress' | 'completed'
///     token               bigint   NOT NULL,      -- the last lease's token
///     attempt             bigint   NOT NULL,
///     lease_until         bigint,                 -- in progress only
///     checkpoint          bytea,                  -- in progress only
///     response_status     integer,                -- completed only
///     response_headers    bytea,                  -- completed only (postcard, see below)
///     response_body       bytea,                  -- completed only
///     created_at          bigint   NOT NULL,
///     completed_at        bigint,                 -- completed only
///     expires_at          bigint   NOT NULL,
///     PRIMARY KEY (scope, key)
/// );
/// CREATE INDEX idempotency_keys_sweep_order ON idempotency_keys  -- the sweep's order
///     (expires_at, octet_length(scope), (scope COLLATE "C"), (key COLLATE "C"));
/// CREATE FUNCTION idempotency_lock_key(scope text, key text) RETURNS bigint ...;
///                                                 -- a claim's locks (see "Statements")
/// CREATE TABLE idempotency_schema_migrations (version integer PRIMARY KEY, ...);
/// ```
///
/// Times are `bigint` milliseconds since the Unix epoch, exactly the crate's [`Timestamp`]s, so
/// nothing is rounded between the two backends. Response headers are the postcard encoding of
/// the `Vec<(String, Vec<u8>)>` (a varint count, then per header a varint-prefixed name and a
/// varint-prefixed value). The migrations table is prefixed so that it never collides with an
/// application's own `schema_migrations`.
///
/// # Statements
///
/// Every operation is one autocommit statement at READ COMMITTED (`verify` is one read-only
/// snapshot, a sweep one statement per 64 records); nothing takes a table lock. A claim is `INSERT … ON CONFLICT DO NOTHING
/// RETURNING` (a new key: done); otherwise a `SELECT` decides the answer exactly as the redb
/// store does (replay, mismatch, in progress); an expired record or a lapsed lease is taken with
/// a conditional `UPDATE … WHERE (expired OR (in progress AND lease lapsed AND same
/// fingerprint)) RETURNING`, which PostgreSQL re-checks on the latest row version, so of
/// concurrent claimers exactly one gets the row. A claimer that loses a race (the row was
/// released or swept between two statements, or another claimer took it over) starts again.
///
/// Each key has a lock: a transaction-scoped advisory lock (`pg_advisory_xact_lock(0x6964656d,
/// hashtext('schema' || chr(1) || scope || chr(1) || key))`, the two-`int4` form: keep that
/// class free in your own advisory locks). Advisory locks are the database's, so the hash names
/// the schema: stores in two schemas of one database do not hold up each other's keys. Every statement that acquires a key or deletes a record takes it first: the
/// insert of a new key, the takeover, `release`, `force_release`, and sweeps and quota
/// evictions (which skip a key whose lock is taken rather than wait). A claim reads the time
/// and draws its token from the sequence only once it holds the lock. The takeover also locks
/// the row first, in `idempotency_lock_key(scope, key)` (PL/pgSQL; its row lock runs on a
/// snapshot taken after the advisory lock, so it sees a row that the claim it waited for
/// committed), so that it is stamped after a completion or heartbeat in flight; an insert needs
/// no row lock, since a deletion in flight holds the key's lock. So claims of one
/// key run one at a time (claims of other keys do not wait, apart from a rare hash collision),
/// and a claim that waited behind another claim, a release, a completion or a sweep is stamped
/// after it: per key, tokens strictly increase in the order of acquisition and a lease never
/// begins before the previous holder's release. (Drawing them when the statement starts, as
/// before, let a claim that stalled between drawing and inserting land after another caller's
/// whole acquire-and-release, with a smaller token and a lease that began, and ended, early.)
/// With an injected clock, read in this process rather than in SQL, the claim runs in a
/// transaction that calls `idempotency_lock_key` first, then reads the clock.
///
/// **Deleting rows by hand**: do it through the store or the CLI (`release`, `sweep`), or
/// take the key's lock first in the same transaction, as the table's comment says:
/// `SELECT pg_advisory_xact_lock(1768187245, hashtext('schema' || chr(1) || scope || chr(1) ||
/// key))`, with the schema's name. A claim of the same key that runs while a deletion without
/// the lock is in flight may start its lease up to that deletion's duration early (never
/// already lapsed, tokens still in order). For the same reason, stop every instance of a build
/// from before migration 7 (which put the schema into the lock) before the first instance of
/// this one connects: the version check runs only when a store connects.
///
/// A lease is never handed out already lapsed: a claim whose lease may have lapsed before the
/// call returns answers [`Claim::InProgress`] with that deadline instead, as if another
/// caller had won, and a retry takes the key over. With the server's clock, "may have lapsed"
/// is judged in this process: a whole lease duration passed since the acquiring statement was
/// sent (the lease began after that); with an injected clock, that clock read after the
/// commit has reached the deadline.
/// `complete`, `release`, `heartbeat` and `checkpoint` are single statements fenced by `WHERE
/// token = $token AND state = 'in_progress' AND expires_at > now`. A sweep is a bounded
/// `DELETE` of the rows chosen by a materialized `SELECT ctid … WHERE expires_at <= now ORDER BY
/// expires_at, key LIMIT $n FOR UPDATE SKIP LOCKED` whose key lock it gets, read off an index on
/// that whole order (migration 8), so that it stops after `$n` rows: oldest expiry first
/// like the redb store, with ties by key here (the redb store breaks them by key hash);
/// concurrent sweepers skip each other's rows, and a sweep skips a key being claimed (a claim
/// of a key that a sweep holds waits for the sweep's statement to commit). As a sweep holds
/// one lock per record to its commit, and PostgreSQL's lock table is shared and bounded
/// (`max_locks_per_transaction`, 64 per connection slot by default), `sweep(n)` deletes in
/// statements of at most 64 records each, and runs another when a statement
/// skipped a key being claimed; an error keeps what earlier statements of the call deleted.
///
/// [`complete_with`](PgStore::complete_with) is one transaction: the fenced record is locked
/// (`SELECT … FOR UPDATE`), the caller's statements run, the fenced `UPDATE` stores the
/// response, and the transaction commits.
///
/// Every statement but the sweep's raises `synchronous_commit` to at least `on` for its own
/// transaction (`set_config(…, true)` in its first CTE; no extra round trip, nothing kept in
/// the session), so that a role's or session's `local` or `off` cannot weaken what it
/// acknowledges, and a commit whose wait for a synchronous standby was cancelled (PostgreSQL
/// then answers success with a WARNING) fails with an outcome-unknown [`Error::Storage`]. The
/// sweep's statements on a single server set it to `off` instead: they delete only expired
/// records, which a lost deletion leaves expired for the next sweep (docs/postgres.md, "Its
/// own commits"). Whether
/// the server's commits survive its failover at all is [`FailoverSafety`], read at connect and
/// checked again while the store runs (see [`PgStoreBuilder::failover_check_period`]).
///
/// Round trips: a new key's claim is one statement, a replay or any other answer two, a
/// takeover three (with an injected clock, three more: `BEGIN`, the lock, `COMMIT`); every
/// settling call is one.
///
/// # Async services
///
/// `PgStore` is synchronous (the `postgres` client, which drives its connection with a tokio
/// runtime of its own). Building, calling and dropping it on a thread that runs a tokio
/// runtime is safe: the store notices the runtime and does the blocking work on a short-lived
/// helper thread (tens of microseconds per call) while the calling thread waits. The calling
/// thread still waits for the database, so in an async service call the store from
/// `tokio::task::spawn_blocking` so that the runtime's workers stay free; the helper thread
/// is then spent as well, since tokio cannot tell its blocking pool from its workers.
///
/// # Time
///
/// By default time comes from the database server (`clock_timestamp()`, evaluated once per
/// statement), so instances with skewed clocks agree on when a lease lapses. A [`Clock`]
/// given to the builder replaces it (for tests with [`ManualClock`](crate::ManualClock)): its
/// time, never going backwards within one `PgStore`, is then passed to every statement.
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub struct PgStore {
    /// `None` only while the store is dropped.
    pool: Option<r2d2::Pool<Manager>>,
    sql: Arc<Sql>,
    settings: PgStoreBuilder,
    lease_ms: i64,
    retention_ms: i64,
    /// The highest time an injected clock has shown; unused with the database's clock.
    high_water: AtomicU64,
    limits: Option<quota::Limits>,
    /// The server's failover safety when the store connected.
    failover: FailoverSafety,
    /// Its failover safety as checked since.
    watch: watch::Watch,
    /// What this store has done, for its `metrics`.
    meter: Meter,
}

impl Drop for PgStore {
    fn drop(&mut self) {
        // Closing a connection blocks on the client's own runtime, like every call.
        let pool = self.pool.take();
        blocking::off_runtime(move || drop(pool));
    }
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl PgStore {
    /// The store's current time: the injected clock's (never going backwards), or else the
    /// database server's.
    fn read_now(&self) -> Result<Timestamp> {
        if let Some(now) = self.injected_now() {
            return Ok(Timestamp::from_millis(now));
        }
        self.with_conn(|client, st| {
            let row = st
                .now
                .query_one(client, &[])
                .map_err(|e| pg("reading the server's clock", e))?;
            Ok(Timestamp::from_millis(millis_col(&row, 0)?))
        })
    }

    /// Whether claims acknowledged by the server this store connected to survive its
    /// failover, as read when the store connected (see [`FailoverSafety`]).
    #[must_use]
    pub fn failover_safety_at_connect(&self) -> &FailoverSafety {
        &self.failover
    }

    /// Whether claims acknowledged by the server survive its failover, read now on a pooled
    /// connection (after a failover, from the server now serving).
    ///
    /// # Errors
    /// [`Error::Storage`] if the server cannot be asked; [`Error::InvalidConfig`] if it has
    /// become read-only (a standby).
    pub fn failover_safety(&self) -> Result<FailoverSafety> {
        self.with_conn(|client, _| {
            let report = replication::read(client)?;
            self.watch.record(&report);
            Ok(report)
        })
    }

    fn injected_now(&self) -> Option<u64> {
        let clock = self.settings.clock.as_ref()?;
        let wall = clock.now().as_millis().min(MAX_TIME_MS);
        let before = self.high_water.fetch_max(wall, Ordering::SeqCst);
        Some(before.max(wall))
    }

    /// `$1` of every statement: the injected clock's time, or NULL for the server's.
    fn now_param(&self) -> Option<i64> {
        self.injected_now().map(|t| capped(t, MAX_TIME_MS))
    }

    /// Runs `body`, which only reads, on a pooled connection (see `on_conn`).
    fn with_conn<T: Send>(
        &self,
        body: impl FnOnce(&mut Client, &Sql) -> Result<T> + Send,
    ) -> Result<T> {
        self.on_conn(false, body)
    }

    /// Runs `body`, which writes, on a pooled connection: refused while
    /// `require_failover_safe` is set and the last check found the server not safe.
    fn with_write_conn<T: Send>(
        &self,
        body: impl FnOnce(&mut Client, &Sql) -> Result<T> + Send,
    ) -> Result<T> {
        self.on_conn(true, body)
    }

    /// Runs `body` on a pooled connection. A storage error marks the connection broken, so
    /// that the pool replaces it instead of handing a dead connection out again. First, on a
    /// new connection or when the period is due, the server's failover safety is read again.
    /// Inside a tokio runtime it runs on a helper thread (see `blocking`).
    fn on_conn<T: Send>(
        &self,
        write: bool,
        body: impl FnOnce(&mut Client, &Sql) -> Result<T> + Send,
    ) -> Result<T> {
        blocking::off_runtime(|| {
            let pool = self.pool.as_ref().ok_or_else(|| {
                Error::storage(
                    "getting a PostgreSQL connection",
                    std::io::Error::other("the store is being dropped"),
                )
            })?;
            // Nothing was sent yet: the call did nothing (`Error::outcome_unknown` is false). The wait
            // is the caller's `connection_timeout`; the pool's own setting only caps its backoff.
            let mut conn = pool
                .get_timeout(self.settings.connection_timeout)
                .map_err(|e| Error::not_applied("getting a PostgreSQL connection", e))?;
            if !conn.checked || self.watch.due() {
                match replication::recheck(&mut conn.client) {
                    Ok(report) => {
                        self.watch.record(&report);
                        conn.checked = true;
                    }
                    Err(e) => {
                        // A read-only server (a standby) is no place for this store either:
                        // a new connection may find the primary.
                        conn.broken = true;
                        self.watch.retry();
                        return Err(e);
                    }
                }
            }
            if let Some(refusal) = self.watch.refusal().filter(|_| write) {
                return Err(refusal);
            }
            let result = conn
                .parts(&self.sql, self.settings.prepare_statements)
                .and_then(|(client, st)| sync_wait::watched(|| body(client, st)));
            if matches!(result, Err(Error::Storage { .. })) {
                conn.broken = true;
            }
            result
        })
    }

    fn check_key(&self, key: &Key) -> Result<()> {
        self.settings.shared.check_key(key)
    }

    fn check_size(&self, size: usize) -> Result<()> {
        self.settings.shared.check_size(size)
    }

    /// How long `lease`'s completed record replays, in milliseconds: its own
    /// ([`Lease::keep_for`](crate::api::outcome::Lease::keep_for)), else the store's.
    fn retention_of(&self, lease: &crate::api::outcome::Lease) -> i64 {
        lease
            .retention_ms
            .map_or(self.retention_ms, |ms| rows::capped(ms, MAX_DURATION_MS))
    }
}
