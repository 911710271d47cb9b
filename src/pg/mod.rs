//! The PostgreSQL backend: [`PgStore`], the same API and semantics as [`Store`](crate::Store)
//! on one table shared by every service instance.
//!
//! The schema, the statements and the time source are documented on [`PgStore`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ::postgres::types::{FromSql, ToSql};
use ::postgres::{Client, GenericClient, IsolationLevel, Row, Statement};
use postgres_native_tls::MakeTlsConnector;
use r2d2_postgres::PostgresConnectionManager;

#[cfg(doc)]
use crate::api::backend::IdempotencyStore;
use crate::api::backend::SWEEP_BATCH;
use crate::api::clock::{Clock, Timestamp, millis};
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::Counters;
use crate::api::outcome::{Claim, ClaimId, Lease, RecordView};
use crate::api::record::{Record, State, Verdict, verdict};
use crate::api::report::{Stats, VerifyReport};
use crate::api::response::Response;
use crate::api::series;
use crate::api::settings::{Settings, WhenFull, invalid_config};
use crate::error::{Error, Result};
use crate::pg::metrics::Unmetered;
pub use admin::PgRecords;

mod admin;
mod blocking;
mod effects;
mod metrics;
mod quota;
mod tls;

/// The schema version this build migrates to.
const SCHEMA_VERSION: i32 = 6;

/// The longest pause between the pool's attempts to reconnect to a server that is down.
const RECONNECT_BACKOFF_CAP: Duration = Duration::from_millis(500);

/// How often one claim starts over after losing a race before it reports an error.
const CLAIM_ROUNDS: usize = 64;

/// Records one sweep statement deletes at most ([`SWEEP_BATCH`]): it holds one advisory lock
/// per record until it commits, and PostgreSQL's lock table is shared by all sessions (by
/// default 64 locks per connection slot), claims included.
const SWEEP_STATEMENT: usize = SWEEP_BATCH;

/// Rows fetched per round trip by `verify`.
const VERIFY_BATCH: i32 = 1000;

/// Durations are capped here (about 36 million years) and times at twice that, so that sums in
/// SQL never overflow a `bigint`.
const MAX_DURATION_MS: u64 = 1 << 60;
const MAX_TIME_MS: u64 = 1 << 61;

/// The current time inside a statement: the injected clock's (`$1`) or the server's.
const NOW: &str = "WITH c AS MATERIALIZED (SELECT COALESCE($1::bigint, \
                   floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now)";

/// The class of the advisory locks that serialise the claims of one key (the two-`int4` form,
/// whose space is apart from single-`bigint` advisory locks): "idem" in ASCII.
const CLAIM_LOCK_CLASS: i32 = 0x6964_656d;

/// The key's advisory lock (the two-`int4` form, class [`CLAIM_LOCK_CLASS`]), held to the end
/// of the transaction: every claim of the key and every deletion of its record takes it, so
/// that a claim reads the time and draws its token only once nothing else can acquire the key
/// or delete its record. `scope` and `key` are SQL expressions.
fn key_lock(scope: &str, key: &str) -> String {
    format!(
        "pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, hashtext({scope}::text || chr(1) || {key}::text))"
    )
}

/// The same lock if it is free, for a sweep, which skips a key that a claim holds.
fn try_key_lock(scope: &str, key: &str) -> String {
    format!(
        "pg_try_advisory_xact_lock({CLAIM_LOCK_CLASS}, \
         hashtext({scope}::text || chr(1) || {key}::text))"
    )
}

/// `idempotency_lock_key` (migration 2; PL/pgSQL since migration 3, cheaper since 4): the key's
/// advisory lock, then its row lock if there is a row, on a snapshot taken after the advisory
/// lock (each statement of a volatile PL/pgSQL function takes a fresh one at READ COMMITTED),
/// so that it also waits out a write to a row that the claim it waited for committed; the
/// statement's own snapshot, taken before the wait, would not see that row.
fn lock_function(schema: &str, scope: &str, key: &str) -> String {
    format!("\"{schema}\".idempotency_lock_key({scope}::text, {key}::text)")
}

/// The start of a statement that must read the time after taking a lock: `w` runs `lock`, and
/// only then does `c` read the time (`$1`, or the server's clock).
fn after_lock(lock: &str) -> String {
    format!(
        "WITH w AS MATERIALIZED (SELECT {lock} AS n), c AS MATERIALIZED (SELECT \
         COALESCE($1::bigint, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now \
         FROM w)"
    )
}

/// The columns a record is read from, after `c.now`.
const RECORD_COLUMNS: &str = "r.fingerprint, r.fingerprint_version, r.state, r.token, \
     r.attempt, r.lease_until, r.checkpoint, r.response_status, r.response_headers, \
     r.response_body, r.created_at, r.completed_at, r.expires_at, r.claim_id";

/// The fence of `complete`, `release`, `heartbeat` and `checkpoint` (`$4` is the token).
const FENCE: &str = "r.scope = $2::text AND r.key = $3::text AND r.token = $4::bigint \
                     AND r.state = 'in_progress' AND r.expires_at > c.now";

/// A store on a PostgreSQL table, shared by any number of processes and machines.
///
/// Same operations, types and outcomes as the redb [`Store`](crate::Store), through the
/// [`IdempotencyStore`] trait (import it to call them). Connections come from a pool; `PgStore`
/// is `Send + Sync`, so share one per process (for example in an `Arc`).
///
/// ```no_run
/// use idempotency_store::{Claim, Fingerprint, IdempotencyStore, Key, PgStore, Response};
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
/// without it, or with `sslrootcert=system`, the system's roots are trusted. TLS is
/// `native-tls` (OpenSSL on Linux).
///
/// ```no_run
/// # use idempotency_store::PgStore;
/// let store = PgStore::connect(
///     "postgresql://idem:idem@db.internal/idem?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem",
/// )?;
/// # Ok::<(), idempotency_store::Error>(())
/// ```
///
/// # Schema
///
/// Everything lives in one PostgreSQL schema (`public` unless [`PgStoreBuilder::schema`] says
/// otherwise), created and migrated when a store connects:
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
/// CREATE INDEX idempotency_keys_expires_at ON idempotency_keys (expires_at);
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
/// hashtext(scope || chr(1) || key))`, the two-`int4` form: keep that class free in your own
/// advisory locks). Every statement that acquires a key or deletes a record takes it first: the
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
/// `SELECT pg_advisory_xact_lock(1768187245, hashtext(scope || chr(1) || key))`. A claim of
/// the same key that runs while a deletion without the lock is in flight may start its lease
/// up to that deletion's duration early (never already lapsed, tokens still in order). For the
/// same reason, stop every instance of a build from before migration 5 before the first
/// instance of this one connects: the version check runs only when a store connects.
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
/// expires_at, key LIMIT $n FOR UPDATE SKIP LOCKED` whose key lock it gets: oldest expiry first
/// like the redb store, with ties by key here (the redb store breaks them by key hash);
/// concurrent sweepers skip each other's rows, and a sweep skips a key being claimed (a claim
/// of a key that a sweep holds waits for the sweep's statement to commit). As a sweep holds
/// one lock per record to its commit, and PostgreSQL's lock table is shared and bounded
/// (`max_locks_per_transaction`, 64 per connection slot by default), `sweep(n)` deletes in
/// statements of at most 64 records each ([`SWEEP_BATCH`]), and runs another when a statement
/// skipped a key being claimed; an error keeps what earlier statements of the call deleted.
///
/// [`complete_with`](PgStore::complete_with) is one transaction: the fenced record is locked
/// (`SELECT … FOR UPDATE`), the caller's statements run, the fenced `UPDATE` stores the
/// response, and the transaction commits.
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
    /// What this store has done, for `PgStore::metrics`.
    metrics: Counters,
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

/// Settings for connecting a [`PgStore`]. Every setter states its default; the shared ones
/// are one [`Settings`] type with the redb [`StoreBuilder`](crate::StoreBuilder)'s.
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[derive(Clone)]
pub struct PgStoreBuilder {
    shared: Settings,
    pool_size: u32,
    connection_timeout: Duration,
    schema: String,
    clock: Option<Arc<dyn Clock>>,
    max_records: Option<u64>,
    max_bytes: Option<u64>,
    when_full: WhenFull,
    per_scope_quotas: bool,
}

impl Default for PgStoreBuilder {
    fn default() -> Self {
        PgStoreBuilder {
            shared: Settings::default(),
            pool_size: 10,
            connection_timeout: Duration::from_secs(30),
            schema: "public".to_owned(),
            clock: None,
            max_records: None,
            max_bytes: None,
            when_full: WhenFull::Refuse,
            per_scope_quotas: false,
        }
    }
}

impl std::fmt::Debug for PgStoreBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStoreBuilder")
            .field("shared", &self.shared)
            .field("pool_size", &self.pool_size)
            .field("connection_timeout", &self.connection_timeout)
            .field("schema", &self.schema)
            .field("injected_clock", &self.clock.is_some())
            .field("max_records", &self.max_records)
            .field("max_bytes", &self.max_bytes)
            .field("when_full", &self.when_full)
            .field("per_scope_quotas", &self.per_scope_quotas)
            .finish()
    }
}

impl PgStoreBuilder {
    /// A builder with every setting at its default.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`Settings::retention`]: how long a completed record replays. Defaults to 24 hours.
    pub fn retention(&mut self, retention: Duration) -> &mut Self {
        self.shared.retention = retention;
        self
    }

    /// Sets [`Settings::lease`]: how long a claim holds the key before another caller may take
    /// it over. Defaults to 60 seconds.
    pub fn lease(&mut self, lease: Duration) -> &mut Self {
        self.shared.lease = lease;
        self
    }

    /// Sets [`Settings::max_key_len`]: the longest key accepted, in bytes, at most 255.
    /// Defaults to 255.
    pub fn max_key_len(&mut self, bytes: usize) -> &mut Self {
        self.shared.max_key_len = bytes;
        self
    }

    /// Sets [`Settings::max_response_bytes`]: the largest response or recovery point accepted.
    /// Defaults to 1 MiB.
    pub fn max_response_bytes(&mut self, bytes: usize) -> &mut Self {
        self.shared.max_response_bytes = bytes;
        self
    }

    /// The most connections the store keeps open. Calls beyond it wait for a free connection
    /// (up to [`connection_timeout`](PgStoreBuilder::connection_timeout)). Mind the server's
    /// `max_connections` (100 by default) across all instances. Defaults to 10.
    pub fn pool_size(&mut self, connections: u32) -> &mut Self {
        self.pool_size = connections;
        self
    }

    /// How long connecting, or waiting for a free pooled connection, may take before the call
    /// fails with [`Error::Storage`]. Defaults to 30 seconds.
    pub fn connection_timeout(&mut self, timeout: Duration) -> &mut Self {
        self.connection_timeout = timeout;
        self
    }

    /// The PostgreSQL schema holding the store's table, sequence and migrations table: a
    /// lowercase SQL identifier (`[a-z_][a-z0-9_]*`, at most 63 bytes). Created if missing.
    /// Defaults to `public`.
    pub fn schema(&mut self, schema: impl Into<String>) -> &mut Self {
        self.schema = schema.into();
        self
    }

    /// A time source replacing the database server's clock, for tests (for example a
    /// [`ManualClock`](crate::ManualClock)). In production leave it unset: with the server's
    /// clock, instances with skewed clocks still agree on when leases lapse.
    pub fn clock(&mut self, clock: impl Clock) -> &mut Self {
        self.clock = Some(Arc::new(clock));
        self
    }

    /// The most records the table holds (any state, expired ones included until swept), or
    /// with [`per_scope_quotas`](PgStoreBuilder::per_scope_quotas) each scope. A claim of a new
    /// key beyond it first deletes expired records, then follows
    /// [`when_full`](PgStoreBuilder::when_full), failing with [`Error::QuotaExceeded`] as the
    /// redb store does. Defaults to no limit.
    ///
    /// The first store connecting with a quota turns usage counting on for its schema: a
    /// trigger keeps per-scope counters (sharded, so that concurrent writers rarely wait on
    /// one row) in `idempotency_usage`, and every writer of the schema maintains them from
    /// then on, whatever its own settings. The check is made before the claim, not under a
    /// lock: instances claiming new keys at the same moment can pass the limit by up to the
    /// number of such claims in flight.
    pub fn max_records(&mut self, records: u64) -> &mut Self {
        self.max_records = Some(records);
        self
    }

    /// The most bytes of keys, scopes, fingerprints, checkpoints and responses (not counting
    /// PostgreSQL's own overhead), in the table or with
    /// [`per_scope_quotas`](PgStoreBuilder::per_scope_quotas) each scope. Checked when a new
    /// key is claimed, as [`max_records`](PgStoreBuilder::max_records) is; completions are
    /// never refused. Defaults to no limit.
    pub fn max_bytes(&mut self, bytes: u64) -> &mut Self {
        self.max_bytes = Some(bytes);
        self
    }

    /// What a claim of a new key does when a quota is reached. Defaults to
    /// [`WhenFull::Refuse`].
    pub fn when_full(&mut self, policy: WhenFull) -> &mut Self {
        self.when_full = policy;
        self
    }

    /// Whether `max_records` and `max_bytes` apply to each scope (tenant) on its own, rather
    /// than to the whole table; eviction then takes only the full scope's records. Defaults
    /// to `false`.
    pub fn per_scope_quotas(&mut self, per_scope: bool) -> &mut Self {
        self.per_scope_quotas = per_scope;
        self
    }

    fn limits(&self) -> Option<quota::Limits> {
        (self.max_records.is_some() || self.max_bytes.is_some()).then_some(quota::Limits {
            max_records: self.max_records,
            max_bytes: self.max_bytes,
            when_full: self.when_full,
            per_scope: self.per_scope_quotas,
        })
    }

    /// Connects to the database at `url` (a `postgresql://` URL or a `key=value` connection
    /// string; TLS as its `sslmode` says, see [`PgStore`]'s TLS section), creates or migrates the schema (idempotently, under an advisory
    /// lock, so that instances starting together do not race) and opens the connection pool.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an out-of-range setting, an unparsable `url` or an
    /// unreadable `sslrootcert`; [`Error::Storage`] if the server cannot be reached, the TLS
    /// handshake or certificate check fails (the message names the `sslmode`) or the migration
    /// fails;
    /// [`Error::NotAStore`] if the schema holds a table of the same name that this crate did
    /// not create, or was migrated by a newer version of this crate.
    pub fn connect(&self, url: &str) -> Result<PgStore> {
        blocking::off_runtime(|| self.connect_here(url))
    }

    fn connect_here(&self, url: &str) -> Result<PgStore> {
        self.validate()?;
        let tls::Connection {
            mut config,
            tls,
            mode,
        } = tls::parse(url)?;
        config.connect_timeout(self.connection_timeout);
        let manager = Manager {
            inner: PostgresConnectionManager::new(config, tls),
        };
        let limits = self.limits();
        let sql = Arc::new(Sql::new(&self.schema, limits.is_some()));
        {
            // A connection of its own, so that a wrong address, password or certificate fails
            // at once with the server's answer rather than after the pool's timeout.
            let mut client = r2d2::ManageConnection::connect(&manager.inner)
                .map_err(|e| pg(mode.context(), e))?;
            migrate(&mut client, &self.schema, limits.is_some())?;
        }
        let pool = r2d2::Pool::builder()
            .max_size(self.pool_size)
            .min_idle(Some(0))
            // r2d2 backs reconnects off up to half this; callers wait their own
            // `connection_timeout` (`get_timeout`). So after an outage of any length the pool
            // tries again at least twice a second, and serves within a second of the server
            // accepting connections.
            .connection_timeout(2 * RECONNECT_BACKOFF_CAP)
            .test_on_check_out(false)
            .build(manager)
            .map_err(|e| Error::storage("opening the PostgreSQL connection pool", e))?;
        Ok(PgStore {
            pool: Some(pool),
            sql,
            lease_ms: capped(millis(self.shared.lease), MAX_DURATION_MS),
            retention_ms: capped(millis(self.shared.retention), MAX_DURATION_MS),
            settings: self.clone(),
            high_water: AtomicU64::new(0),
            limits,
            metrics: Counters::new(&series::POSTGRES, self.shared.trace_keys),
        })
    }

    fn validate(&self) -> Result<()> {
        self.shared.validate()?;
        if self.pool_size == 0 {
            return invalid_config("pool_size must be at least 1");
        }
        if self.connection_timeout.is_zero() {
            return invalid_config("connection_timeout must be longer than zero");
        }
        let schema = self.schema.as_bytes();
        let valid = (1..=63).contains(&schema.len())
            && schema
                .iter()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'_')
            && !schema[0].is_ascii_digit();
        if !valid {
            return invalid_config(
                "schema must be a lowercase SQL identifier ([a-z_][a-z0-9_]*, 1 to 63 bytes)",
            );
        }
        Ok(())
    }
}

impl PgStore {
    /// A builder for a store with custom settings.
    #[must_use]
    pub fn builder() -> PgStoreBuilder {
        PgStoreBuilder::new()
    }

    /// Connects with default settings; see [`PgStoreBuilder::connect`].
    ///
    /// # Errors
    /// As for [`PgStoreBuilder::connect`].
    pub fn connect(url: &str) -> Result<PgStore> {
        PgStoreBuilder::new().connect(url)
    }

    /// The settings this store shares with every backend, as it was connected with them.
    #[must_use]
    pub fn settings(&self) -> &Settings {
        &self.settings.shared
    }

    /// The store's current time: the injected clock's (never going backwards), or else the
    /// database server's.
    ///
    /// # Errors
    /// [`Error::Storage`] if the server cannot be asked.
    pub fn now(&self) -> Result<Timestamp> {
        if let Some(now) = self.injected_now() {
            return Ok(Timestamp::from_millis(now));
        }
        self.with_conn(|client, st| {
            let row = client
                .query_one(&st.now, &[])
                .map_err(|e| pg("reading the server's clock", e))?;
            Ok(Timestamp::from_millis(millis_col(&row, 0)?))
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

    /// Runs `body` on a pooled connection. A storage error marks the connection broken, so
    /// that the pool replaces it instead of handing a dead connection out again.
    /// Inside a tokio runtime it runs on a helper thread (see `blocking`).
    fn with_conn<T: Send>(
        &self,
        body: impl FnOnce(&mut Client, &Statements) -> Result<T> + Send,
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
            let result = conn
                .parts(&self.sql)
                .and_then(|(client, st)| body(client, st));
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

    /// Runs a fenced write (`$1` now, `$2` scope, `$3` key, `$4` token, then `extra`) and
    /// returns its rows; none means the lease is lost.
    fn fenced(
        &self,
        pick: fn(&Statements) -> &Statement,
        lease: &Lease,
        extra: &[&(dyn ToSql + Sync)],
        context: &'static str,
    ) -> Result<Vec<Row>> {
        let now = self.now_param();
        let token = token_param(lease.token)?;
        let (scope, name) = parts(&lease.key);
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&now, &scope, &name, &token];
        params.extend_from_slice(extra);
        self.with_conn(|client, st| {
            let rows = client
                .query(pick(st), &params)
                .map_err(|e| pg(context, e))?;
            if rows.is_empty() {
                return Err(Error::LeaseLost);
            }
            Ok(rows)
        })
    }
}

/// A claim's parameters, as the statements take them.
struct ClaimArgs<'a> {
    key: &'a Key,
    scope: &'a str,
    name: &'a str,
    digest: &'a [u8],
    version: i16,
    fingerprint: Fingerprint,
    id: Option<ClaimId>,
    /// `id` as the column stores it (the bits of the `u64`).
    claim_id: Option<i64>,
}

impl PgStore {
    /// A claim, with the caller's claim id if any.
    fn claim_as(&self, key: &Key, fingerprint: Fingerprint, id: Option<ClaimId>) -> Result<Claim> {
        self.check_key(key)?;
        let args = ClaimArgs {
            key,
            scope: key.scope().unwrap_or(""),
            name: key.key(),
            digest: fingerprint.digest(),
            version: i16::from(fingerprint.version()),
            fingerprint,
            id,
            claim_id: id.map(|id| i64::from_ne_bytes(id.get().to_ne_bytes())),
        };
        self.with_conn(|client, st| {
            if let (Some(limits), Some(quota)) = (&self.limits, &st.quota) {
                let key_parts = (args.scope, args.name);
                quota::make_room(client, quota, limits, &|| self.now_param(), key_parts)?;
            }
            if self.settings.clock.is_none() {
                // The statements lock the key, then read the server's clock and draw the token.
                let claim = self.claim_rounds(client, st, &args)?;
                return Ok(claim);
            }
            // An injected clock is read here, not in SQL: lock the key first, in a transaction,
            // so that the time is read after the claim has the key to itself.
            let mut txn = client.transaction().map_err(|e| pg("claiming a key", e))?;
            txn.query(&st.lock, &[&args.scope, &args.name])
                .map_err(|e| pg("claiming a key", e))?;
            let claim = self.claim_rounds(&mut txn, st, &args)?;
            txn.commit().map_err(|e| pg("claiming a key", e))?;
            Ok(match self.injected_now() {
                Some(now) => claim.unless_lapsed(Timestamp::from_millis(now)),
                None => claim,
            })
        })
    }

    /// The answer of a settling call (`complete` with its response, or `release`) that
    /// returned `done`. After an outcome-unknown error the lease is in doubt, and a retry
    /// that finds the lease gone checks whether its own earlier call did it: the record holds
    /// this lease's completion with the same response, or (a release) no record is left.
    fn settle(&self, lease: &Lease, done: Result<()>, response: Option<&Response>) -> Result<()> {
        lease.in_doubt.after(&done);
        match done {
            Err(Error::LeaseLost) if lease.in_doubt.get() => {
                let (scope, name) = parts(&lease.key);
                let now = self.now_param();
                let record = self.with_conn(|client, st| {
                    let row = client
                        .query_one(&st.select, &[&now, &scope, &name])
                        .map_err(|e| pg("reading a record", e))?;
                    record_from(&row, 1)
                })?;
                let own = match (record, response) {
                    (Some(record), Some(response)) => record.completed_by(lease.token, response),
                    (None, None) => true,
                    _ => false,
                };
                if own { Ok(()) } else { Err(Error::LeaseLost) }
            }
            other => other,
        }
    }

    /// The claim's statements, started over when the record changes between them: insert a
    /// new key, else read the record and decide, else take an expired or lapsed record over.
    fn claim_rounds(
        &self,
        client: &mut impl GenericClient,
        st: &Statements,
        args: &ClaimArgs<'_>,
    ) -> Result<Claim> {
        let key = args.key;
        for _ in 0..CLAIM_ROUNDS {
            let now = self.now_param();
            let claim_params: [&(dyn ToSql + Sync); 8] = [
                &now,
                &args.scope,
                &args.name,
                &args.digest,
                &args.version,
                &self.lease_ms,
                &self.retention_ms,
                &args.claim_id,
            ];
            // A new key: the insert wins or loses atomically on the primary key.
            let sent = Instant::now();
            if let Some(row) = client
                .query_opt(&st.insert, &claim_params)
                .map_err(|e| pg("claiming a key", e))?
            {
                let lease = Lease::new(
                    key.clone(),
                    token_col(&row, 0)?,
                    1,
                    Timestamp::from_millis(millis_col(&row, 1)?),
                    None,
                );
                return Ok(self.unless_lapsed(lease, sent));
            }
            // The key exists: decide as the redb store does, on a fresh snapshot.
            let row = client
                .query_one(&st.select, &[&now, &args.scope, &args.name])
                .map_err(|e| pg("reading a record", e))?;
            let db_now = Timestamp::from_millis(millis_col(&row, 0)?);
            let Some(record) = record_from(&row, 1)? else {
                continue; // released or swept since the insert: start over
            };
            if let Verdict::Answer(answer) =
                verdict(key, Some(record), args.fingerprint, args.id, db_now)
            {
                return Ok(answer);
            }
            // Expired or lapsed: take it over if it still is, re-checked on the latest row.
            let sent = Instant::now();
            if let Some(row) = client
                .query_opt(&st.takeover, &claim_params)
                .map_err(|e| pg("taking a key over", e))?
            {
                let lease = Lease::new(
                    key.clone(),
                    token_col(&row, 0)?,
                    attempt_col(&row, 1)?,
                    Timestamp::from_millis(millis_col(&row, 2)?),
                    col(&row, 3)?,
                );
                return Ok(self.unless_lapsed(lease, sent));
            }
        }
        Err(Error::storage(
            "claiming a key",
            std::io::Error::other("the record kept changing under concurrent claims; try again"),
        ))
    }

    /// A lease won by a statement sent at `sent`, unless it may have lapsed before reaching
    /// the caller. With the server's clock the lease began after `sent`, so it has lapsed for
    /// sure only once a whole lease has passed since; counting from `sent` errs on the safe
    /// side. (With an injected clock the caller checks that clock after the commit.)
    fn unless_lapsed(&self, lease: Lease, sent: Instant) -> Claim {
        if self.settings.clock.is_some() || sent.elapsed() < self.settings.shared.lease() {
            return Claim::Acquired(lease);
        }
        Claim::InProgress {
            lease_until: lease.lease_until,
            attempt: lease.attempt,
        }
    }
}

impl Unmetered for PgStore {
    fn now(&self) -> Result<Timestamp> {
        PgStore::now(self)
    }

    fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim> {
        self.claim_as(key, fingerprint, None)
    }

    fn claim_with_id(&self, key: &Key, fingerprint: Fingerprint, id: ClaimId) -> Result<Claim> {
        self.claim_as(key, fingerprint, Some(id))
    }

    fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
        self.check_size(response.size())?;
        let headers = postcard::to_allocvec(&response.headers)
            .map_err(|e| Error::storage("encoding response headers", e))?;
        let status = i32::from(response.status);
        let done = self.fenced(
            |st| &st.complete,
            lease,
            &[&status, &headers, &response.body, &self.retention_ms],
            "completing a lease",
        );
        self.settle(lease, done.map(drop), Some(&response))
    }

    fn release(&self, lease: &Lease) -> Result<()> {
        let done = self.fenced(|st| &st.release, lease, &[], "releasing a lease");
        self.settle(lease, done.map(drop), None)
    }

    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
        let rows = self.fenced(
            |st| &st.heartbeat,
            lease,
            &[&self.lease_ms],
            "extending a lease",
        )?;
        let until = match rows.first() {
            Some(row) => Timestamp::from_millis(millis_col(row, 0)?),
            None => return Err(Error::LeaseLost),
        };
        lease.lease_until = until;
        Ok(until)
    }

    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
        self.check_size(data.len())?;
        self.fenced(|st| &st.checkpoint, lease, &[&data], "storing a checkpoint")?;
        lease.checkpoint = Some(data);
        Ok(())
    }

    fn lookup(&self, key: &Key) -> Result<Option<RecordView>> {
        self.check_key(key)?;
        let (scope, name) = parts(key);
        let now = self.now_param();
        self.with_conn(|client, st| {
            let row = client
                .query_one(&st.select, &[&now, &scope, &name])
                .map_err(|e| pg("reading a record", e))?;
            let db_now = Timestamp::from_millis(millis_col(&row, 0)?);
            Ok(record_from(&row, 1)?
                .filter(|r| !r.is_expired(db_now))
                .map(Record::into_view))
        })
    }

    fn sweep(&self, limit: usize) -> Result<usize> {
        if limit == 0 {
            return Ok(0);
        }
        self.with_conn(|client, st| {
            let mut deleted = 0;
            while deleted < limit {
                let chunk = (limit - deleted).min(SWEEP_STATEMENT);
                let now = self.now_param();
                let row = client
                    .query_one(
                        &st.sweep,
                        &[&now, &i64::try_from(chunk).unwrap_or(i64::MAX)],
                    )
                    .map_err(|e| pg("sweeping expired records", e))?;
                let count = |i| usize::try_from(col::<i64>(&row, i)?).map_err(bad_count);
                let (gone, candidates) = (count(0)?, count(1)?);
                deleted += gone;
                // Fewer candidates: none left. None deleted: every one is being claimed.
                if candidates < chunk || gone == 0 {
                    break;
                }
            }
            Ok(deleted)
        })
    }

    fn verify(&self) -> Result<VerifyReport> {
        self.with_conn(|client, st| {
            let mut txn = client
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .map_err(|e| pg("verifying", e))?;
            let portal = txn.bind(&st.verify, &[]).map_err(|e| pg("verifying", e))?;
            let mut report = VerifyReport::default();
            let mut max_token = 0u64;
            loop {
                let rows = txn
                    .query_portal(&portal, VERIFY_BATCH)
                    .map_err(|e| pg("verifying", e))?;
                for row in &rows {
                    report.records += 1;
                    check_row(row, &mut report.problems, &mut max_token)?;
                }
                if rows.len() < usize::try_from(VERIFY_BATCH).unwrap_or(usize::MAX) {
                    break;
                }
            }
            // Read after the walk: sequences are not transactional, so this is at least as high as
            // any token the snapshot holds.
            let row = txn
                .query_one(&st.sequence, &[])
                .map_err(|e| pg("verifying", e))?;
            let (last, called): (i64, bool) = (col(&row, 0)?, col(&row, 1)?);
            let issued = if called { last } else { last - 1 };
            if i128::from(max_token) > i128::from(issued) {
                report.problems.push(format!(
                    "a record holds token {max_token}, above the last token issued ({issued})"
                ));
            }
            if let Some(quota) = &st.quota {
                quota::check_usage(&mut txn, quota, &mut report.problems)?;
            }
            txn.commit().map_err(|e| pg("verifying", e))?;
            report.expiry_entries = report.records;
            Ok(report)
        })
    }

    fn stats(&self) -> Result<Stats> {
        let now = self.now_param();
        self.with_conn(|client, st| {
            let row = client
                .query_one(&st.stats, &[&now])
                .map_err(|e| pg("counting records", e))?;
            let count =
                |i| -> Result<u64> { u64::try_from(col::<i64>(&row, i)?).map_err(bad_count) };
            Ok(Stats {
                in_progress: count(0)?,
                stuck: count(1)?,
                completed: count(2)?,
                expired: count(3)?,
                file_bytes: Some(count(4)?),
            })
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Statements and connections
// ---------------------------------------------------------------------------------------------

/// The SQL of every statement, for one schema.
struct Sql {
    lock: String,
    insert: String,
    select: String,
    takeover: String,
    complete: String,
    /// Locks a lease's row under its fence (`complete_with`).
    lock_lease: String,
    release: String,
    heartbeat: String,
    checkpoint: String,
    sweep: String,
    stats: String,
    verify: String,
    sequence: String,
    now: String,
    /// With a quota only.
    quota: Option<quota::Sql>,
}

impl Sql {
    fn new(schema: &str, quota: bool) -> Sql {
        let t = format!("\"{schema}\".idempotency_keys");
        let seq = format!("\"{schema}\".idempotency_token_seq");
        let takeover_fresh = "r.expires_at <= c.now";
        // A new key's insert needs only the advisory lock: no row means no write in flight
        // that does not hold it (deletions take it too). A takeover waits out writes to the row.
        let insert_now = after_lock(&key_lock("$2", "$3"));
        let takeover_now = after_lock(&lock_function(schema, "$2", "$3"));
        Sql {
            lock: format!("SELECT {}", lock_function(schema, "$1", "$2")),
            insert: format!(
                "{insert_now} INSERT INTO {t} AS r (scope, key, fingerprint, fingerprint_version, state, \
                 token, attempt, lease_until, created_at, expires_at, claim_id) \
                 SELECT $2::text, $3::text, $4::bytea, $5::smallint, 'in_progress', \
                 nextval('{seq}'), 1, c.now + $6::bigint, c.now, \
                 GREATEST(c.now + $7::bigint, c.now + $6::bigint), $8::bigint FROM c \
                 ON CONFLICT (scope, key) DO NOTHING \
                 RETURNING r.token, r.lease_until"
            ),
            select: format!(
                "{NOW} SELECT c.now, {RECORD_COLUMNS} FROM c \
                 LEFT JOIN {t} AS r ON r.scope = $2::text AND r.key = $3::text"
            ),
            takeover: format!(
                "{takeover_now} UPDATE {t} AS r SET \
                 fingerprint = $4::bytea, fingerprint_version = $5::smallint, \
                 state = 'in_progress', token = nextval('{seq}'), \
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
            ),
            complete: format!(
                "{NOW} UPDATE {t} AS r SET state = 'completed', lease_until = NULL, \
                 checkpoint = NULL, response_status = $5::integer, response_headers = $6::bytea, \
                 response_body = $7::bytea, completed_at = c.now, \
                 expires_at = c.now + $8::bigint \
                 FROM c WHERE {FENCE} RETURNING r.token"
            ),
            // `complete_with`: holds the record while the caller's statements run.
            lock_lease: format!(
                "{NOW} SELECT r.token FROM {t} AS r, c WHERE {FENCE} FOR UPDATE OF r"
            ),
            release: format!(
                "{} DELETE FROM {t} AS r USING c WHERE {FENCE} RETURNING r.token",
                after_lock(&key_lock("$2", "$3"))
            ),
            heartbeat: format!(
                "{NOW} UPDATE {t} AS r SET lease_until = c.now + $5::bigint, \
                 expires_at = GREATEST(r.expires_at, c.now + $5::bigint) \
                 FROM c WHERE {FENCE} RETURNING r.lease_until"
            ),
            checkpoint: format!(
                "{NOW} UPDATE {t} AS r SET checkpoint = $5::bytea \
                 FROM c WHERE {FENCE} RETURNING r.token"
            ),
            // The victims are chosen once, in a materialized CTE: as `ctid IN (subquery)` the
            // planner may rescan the subquery per outer row, and a rescan skips the rows this
            // statement already deleted and locks the next ones, deleting more than the limit.
            // Of those, it deletes the ones whose key lock it gets (after the limit, so that it
            // takes at most `$2` locks). Answers (deleted, candidates).
            sweep: format!(
                "{NOW}, doomed AS MATERIALIZED (\
                     SELECT x.ctid, x.scope, x.key FROM {t} AS x, c WHERE x.expires_at <= c.now \
                     ORDER BY x.expires_at, octet_length(x.scope), x.scope COLLATE \"C\", \
                         x.key COLLATE \"C\" \
                     LIMIT $2::bigint FOR UPDATE OF x SKIP LOCKED), \
                 free AS MATERIALIZED (SELECT d.ctid FROM doomed AS d WHERE {}), \
                 gone AS (DELETE FROM {t} AS r USING free AS f, c \
                     WHERE r.ctid = f.ctid AND r.expires_at <= c.now RETURNING 1) \
                 SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM doomed)",
                try_key_lock("d.scope", "d.key")
            ),
            // The second count is `RecordView::is_stuck`, in SQL.
            stats: format!(
                "{NOW} SELECT \
                 count(*) FILTER (WHERE r.expires_at > c.now AND r.state = 'in_progress'), \
                 count(*) FILTER (WHERE r.expires_at > c.now AND r.state = 'in_progress' \
                     AND r.lease_until <= c.now), \
                 count(*) FILTER (WHERE r.expires_at > c.now AND r.state = 'completed'), \
                 count(*) FILTER (WHERE r.expires_at <= c.now), \
                 pg_total_relation_size('{t}') \
                 FROM c LEFT JOIN {t} AS r ON true"
            ),
            verify: format!(
                "SELECT r.scope, r.key, octet_length(r.fingerprint), r.fingerprint_version, \
                 r.state, r.token, r.attempt, r.lease_until, r.checkpoint IS NOT NULL, \
                 r.response_status, r.response_headers, r.response_body IS NOT NULL, \
                 r.created_at, r.completed_at, r.expires_at FROM {t} AS r"
            ),
            sequence: format!("SELECT last_value, is_called FROM {seq}"),
            now: "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint".to_owned(),
            quota: quota.then(|| quota::Sql::new(&format!("\"{schema}\""))),
        }
    }
}

/// The statements, prepared once per pooled connection.
struct Statements {
    lock: Statement,
    insert: Statement,
    select: Statement,
    takeover: Statement,
    complete: Statement,
    lock_lease: Statement,
    release: Statement,
    heartbeat: Statement,
    checkpoint: Statement,
    sweep: Statement,
    stats: Statement,
    verify: Statement,
    sequence: Statement,
    now: Statement,
    quota: Option<quota::Statements>,
}

impl Statements {
    fn prepare(client: &mut Client, sql: &Sql) -> std::result::Result<Self, ::postgres::Error> {
        Ok(Statements {
            lock: client.prepare(&sql.lock)?,
            insert: client.prepare(&sql.insert)?,
            select: client.prepare(&sql.select)?,
            takeover: client.prepare(&sql.takeover)?,
            complete: client.prepare(&sql.complete)?,
            lock_lease: client.prepare(&sql.lock_lease)?,
            release: client.prepare(&sql.release)?,
            heartbeat: client.prepare(&sql.heartbeat)?,
            checkpoint: client.prepare(&sql.checkpoint)?,
            sweep: client.prepare(&sql.sweep)?,
            stats: client.prepare(&sql.stats)?,
            verify: client.prepare(&sql.verify)?,
            sequence: client.prepare(&sql.sequence)?,
            now: client.prepare(&sql.now)?,
            quota: match &sql.quota {
                Some(quota) => Some(quota::Statements::prepare(client, quota)?),
                None => None,
            },
        })
    }
}

/// A pooled connection and its prepared statements (prepared on first use, after the
/// migration).
struct Conn {
    client: Client,
    st: Option<Statements>,
    /// A call on it failed with a storage error: drop it rather than reuse it.
    broken: bool,
}

impl Conn {
    /// The client and the statements, preparing them first if needed.
    fn parts(&mut self, sql: &Sql) -> Result<(&mut Client, &Statements)> {
        let Conn { client, st, .. } = self;
        let st = match st {
            Some(st) => st,
            None => st.insert(
                Statements::prepare(client, sql)
                    .map_err(|e| pg("preparing the store's statements", e))?,
            ),
        };
        Ok((client, st))
    }
}

/// `r2d2_postgres`'s manager, with a slot for the prepared statements.
struct Manager {
    inner: PostgresConnectionManager<MakeTlsConnector>,
}

impl r2d2::ManageConnection for Manager {
    type Connection = Conn;
    type Error = ::postgres::Error;

    fn connect(&self) -> std::result::Result<Conn, ::postgres::Error> {
        Ok(Conn {
            client: self.inner.connect()?,
            st: None,
            broken: false,
        })
    }

    fn is_valid(&self, conn: &mut Conn) -> std::result::Result<(), ::postgres::Error> {
        self.inner.is_valid(&mut conn.client)
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.broken || self.inner.has_broken(&mut conn.client)
    }
}

// ---------------------------------------------------------------------------------------------
// Migrations
// ---------------------------------------------------------------------------------------------

/// Versioned migrations: `(version, description, SQL)`, applied in order, each once.
fn migrations(schema: &str) -> [(i32, &'static str, String); 6] {
    let s = format!("\"{schema}\"");
    [
        (
            1,
            "idempotency_keys table, token sequence, expires_at index",
            format!(
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
            ),
        ),
        (
            2,
            "idempotency_lock_key: a claim's advisory lock, then its row lock (issue 21)",
            format!(
                "CREATE FUNCTION {s}.idempotency_lock_key(p_scope text, p_key text) \
             RETURNS bigint LANGUAGE sql VOLATILE AS $f$ \
                 SELECT pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, \
                     hashtext(p_scope || chr(1) || p_key)); \
                 SELECT count(*) FROM (SELECT 1 FROM {s}.idempotency_keys AS x \
                     WHERE x.scope = p_scope AND x.key = p_key FOR UPDATE) AS held; \
             $f$;"
            ),
        ),
        (
            3,
            "idempotency_lock_key in PL/pgSQL: its plans cached per session (issues 17, 21)",
            // The same two steps as migration 2. A `LANGUAGE sql` function with two statements
            // is not inlined, so PostgreSQL parsed and planned both on every call (about a
            // third of a new key's claim); PL/pgSQL keeps their plans for the session. Each of
            // its statements still takes a fresh snapshot at READ COMMITTED, so the row lock
            // sees a row that the claim it waited for committed.
            format!(
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
            ),
        ),
        (
            4,
            "idempotency_lock_key without two executor runs per call (issues 17, 21)",
            // The same two steps again, cheaper. `PERFORM` of the advisory lock started an
            // executor for what is one function call: as an assignment it is a PL/pgSQL
            // "simple expression", evaluated directly. The row lock needs no aggregate: `FOUND`
            // says whether there was a row. The row lock is still a statement of its own, so
            // it still runs on a fresh snapshot taken after the advisory lock.
            format!(
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
            ),
        ),
        (
            5,
            "deletions take the key's advisory lock; a new key's insert takes only that (issue 21)",
            // No change to the tables: a change of protocol. From this version on every
            // deletion takes the key's lock, so a claim of a new key no longer locks the row
            // first; a build that deletes without the lock must not share the schema, and the
            // version keeps it out. The comment tells anyone deleting rows by hand.
            format!(
                "COMMENT ON TABLE {s}.idempotency_keys IS 'idempotency-store records. Delete \
                 rows only through the store or its CLI, or in a transaction that first takes \
                 the key''s lock: SELECT pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, \
                 hashtext(scope || chr(1) || key));'"
            ),
        ),
        (
            6,
            "claim ids: a claim whose answer was lost gets its lease back (issue 30)",
            // Nullable, no default: PostgreSQL adds it without rewriting the table. Rows of
            // builds before this one carry NULL, which no claim id matches.
            format!("ALTER TABLE {s}.idempotency_keys ADD COLUMN IF NOT EXISTS claim_id bigint"),
        ),
    ]
}

/// Brings the schema to [`SCHEMA_VERSION`] in one transaction, under an advisory lock per
/// schema, so that instances starting together apply each migration exactly once; with
/// `track_usage` (a store with a quota) also turns quota accounting on.
fn migrate(client: &mut Client, schema: &str, track_usage: bool) -> Result<()> {
    const CONTEXT: &str = "migrating the PostgreSQL schema";
    let lock = {
        let hash = blake3::hash(format!("idempotency-store migrations {schema}").as_bytes());
        let mut first = [0u8; 8];
        first.copy_from_slice(&hash.as_bytes()[..8]);
        i64::from_le_bytes(first)
    };
    let mut txn = client.transaction().map_err(|e| pg(CONTEXT, e))?;
    txn.execute("SELECT pg_advisory_xact_lock($1)", &[&lock])
        .map_err(|e| pg(CONTEXT, e))?;
    // DDL only when something is missing, so that a role without CREATE rights can open an
    // already migrated schema.
    let exists = |txn: &mut ::postgres::Transaction<'_>, sql: &str| -> Result<bool> {
        let row = txn.query_one(sql, &[&schema]).map_err(|e| pg(CONTEXT, e))?;
        col(&row, 0)
    };
    if !exists(
        &mut txn,
        "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)",
    )? {
        txn.batch_execute(&format!("CREATE SCHEMA \"{schema}\""))
            .map_err(|e| pg(CONTEXT, e))?;
    }
    if !exists(
        &mut txn,
        "SELECT to_regclass(quote_ident($1) || '.idempotency_schema_migrations') IS NOT NULL",
    )? {
        txn.batch_execute(&format!(
            "CREATE TABLE \"{schema}\".idempotency_schema_migrations ( \
                 version integer PRIMARY KEY, \
                 description text NOT NULL, \
                 applied_at timestamptz NOT NULL DEFAULT now())"
        ))
        .map_err(|e| pg(CONTEXT, e))?;
    }
    let applied: Vec<i32> = txn
        .query(
            &format!("SELECT version FROM \"{schema}\".idempotency_schema_migrations"),
            &[],
        )
        .map_err(|e| pg(CONTEXT, e))?
        .iter()
        .map(|row| col(row, 0))
        .collect::<Result<_>>()?;
    if let Some(newer) = applied.iter().copied().find(|&v| v > SCHEMA_VERSION) {
        return Err(Error::NotAStore {
            reason: format!(
                "schema \"{schema}\" is at migration {newer}; this build knows up to \
                 {SCHEMA_VERSION}"
            ),
        });
    }
    for (version, description, sql) in migrations(schema) {
        if applied.contains(&version) {
            continue;
        }
        txn.batch_execute(&sql).map_err(|e| {
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
        })?;
        txn.execute(
            &format!(
                "INSERT INTO \"{schema}\".idempotency_schema_migrations (version, description) \
                 VALUES ($1, $2)"
            ),
            &[&version, &description],
        )
        .map_err(|e| pg(CONTEXT, e))?;
    }
    if track_usage {
        quota::track_usage(&mut txn, &format!("\"{schema}\""))?;
    }
    txn.commit().map_err(|e| pg(CONTEXT, e))
}

// ---------------------------------------------------------------------------------------------
// Rows
// ---------------------------------------------------------------------------------------------

/// A failed statement as an error. An `ERROR` the server answered for the statement means it
/// was rolled back (every call is one statement or one transaction): nothing was applied.
/// Anything else (the connection lost, a `FATAL` from a terminated backend) may have come after
/// the statement committed: the sync client reports a connection's `FATAL` even when the
/// statement's success had already arrived, so the outcome is unknown.
fn pg(context: &'static str, err: ::postgres::Error) -> Error {
    let rolled_back = err
        .as_db_error()
        .is_some_and(|db| db.parsed_severity() == Some(::postgres::error::Severity::Error));
    if rolled_back {
        Error::not_applied(context, err)
    } else {
        Error::storage(context, err)
    }
}

fn parts(key: &Key) -> (&str, &str) {
    (key.scope().unwrap_or(""), key.key())
}

fn capped(value: u64, max: u64) -> i64 {
    i64::try_from(value.min(max)).unwrap_or(i64::MAX)
}

fn token_param(token: u64) -> Result<i64> {
    // Tokens come from a bigint sequence; a larger one cannot hold any record.
    i64::try_from(token).map_err(|_| Error::LeaseLost)
}

fn col<'a, T: FromSql<'a>>(row: &'a Row, idx: usize) -> Result<T> {
    row.try_get(idx)
        .map_err(|e| pg("reading a PostgreSQL row", e))
}

fn millis_col(row: &Row, idx: usize) -> Result<u64> {
    let v: i64 = col(row, idx)?;
    u64::try_from(v).map_err(|_| Error::corrupted(format!("negative time {v} in a record")))
}

fn token_col(row: &Row, idx: usize) -> Result<u64> {
    let v: i64 = col(row, idx)?;
    u64::try_from(v).map_err(|_| Error::corrupted(format!("negative token {v} in a record")))
}

fn attempt_col(row: &Row, idx: usize) -> Result<u32> {
    let v: i64 = col(row, idx)?;
    u32::try_from(v).map_err(|_| Error::corrupted(format!("attempt {v} out of range")))
}

fn bad_count(_: std::num::TryFromIntError) -> Error {
    Error::corrupted("a negative count from the server")
}

fn decode_headers(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>> {
    let (headers, rest): (Vec<(String, Vec<u8>)>, _) = postcard::take_from_bytes(bytes)
        .map_err(|e| Error::corrupted(format!("response headers do not decode: {e}")))?;
    if !rest.is_empty() {
        return Err(Error::corrupted(format!(
            "response headers have {} trailing bytes",
            rest.len()
        )));
    }
    Ok(headers)
}

/// The record in `row` from column `at` on ([`RECORD_COLUMNS`]), or `None` if the join found
/// no row.
fn record_from(row: &Row, at: usize) -> Result<Option<Record>> {
    let Some(state) = col::<Option<String>>(row, at + 2)? else {
        return Ok(None);
    };
    let need = |what: &str| Error::corrupted(format!("a {state} record has no {what}"));
    let digest: Vec<u8> = col(row, at)?;
    let digest: [u8; 32] = digest
        .as_slice()
        .try_into()
        .map_err(|_| Error::corrupted(format!("a fingerprint of {} bytes", digest.len())))?;
    let version: i16 = col(row, at + 1)?;
    let version = u8::try_from(version)
        .map_err(|_| Error::corrupted(format!("fingerprint version {version}")))?;
    let state = match state.as_str() {
        "in_progress" => State::InProgress {
            token: token_col(row, at + 3)?,
            lease_until: col::<Option<i64>>(row, at + 5)?
                .ok_or_else(|| need("lease deadline"))
                .and_then(|v| {
                    u64::try_from(v).map_err(|_| Error::corrupted("a negative lease deadline"))
                })?,
            checkpoint: col(row, at + 6)?,
            claim_id: col::<Option<i64>>(row, at + 13)?
                .map(|id| u64::from_ne_bytes(id.to_ne_bytes())),
        },
        "completed" => {
            let status: i32 = col::<Option<i32>>(row, at + 7)?.ok_or_else(|| need("status"))?;
            let headers: Vec<u8> =
                col::<Option<Vec<u8>>>(row, at + 8)?.ok_or_else(|| need("headers"))?;
            let body: Vec<u8> = col::<Option<Vec<u8>>>(row, at + 9)?.ok_or_else(|| need("body"))?;
            let completed_at: i64 =
                col::<Option<i64>>(row, at + 11)?.ok_or_else(|| need("completion time"))?;
            State::Completed {
                completed_at: u64::try_from(completed_at)
                    .map_err(|_| Error::corrupted("a negative completion time"))?,
                response: Response {
                    status: u16::try_from(status)
                        .map_err(|_| Error::corrupted(format!("response status {status}")))?,
                    headers: decode_headers(&headers)?,
                    body,
                },
                token: Some(token_col(row, at + 3)?),
            }
        }
        other => return Err(Error::corrupted(format!("unknown record state {other:?}"))),
    };
    Ok(Some(Record {
        fingerprint: Fingerprint::from_raw(version, digest),
        created_at: millis_col(row, at + 10)?,
        expires_at: millis_col(row, at + 12)?,
        attempt: attempt_col(row, at + 4)?,
        state,
    }))
}

/// Checks one row of the `verify` walk, appending a line per problem.
fn check_row(row: &Row, problems: &mut Vec<String>, max_token: &mut u64) -> Result<()> {
    let scope: String = col(row, 0)?;
    let key: String = col(row, 1)?;
    let name = if scope.is_empty() {
        key.clone()
    } else {
        format!("{scope}/{key}")
    };
    let mut problem = |what: String| problems.push(format!("record {name:?}: {what}"));
    let parsed = if scope.is_empty() {
        Key::new(&key)
    } else {
        Key::scoped(&scope, &key)
    };
    if let Err(e) = parsed {
        problem(e.to_string());
    }
    let fp_len: i32 = col(row, 2)?;
    if fp_len != 32 {
        problem(format!("fingerprint of {fp_len} bytes, not 32"));
    }
    let fp_version: i16 = col(row, 3)?;
    if u8::try_from(fp_version).is_err() {
        problem(format!("fingerprint version {fp_version} out of range"));
    }
    let state: String = col(row, 4)?;
    let token: i64 = col(row, 5)?;
    let attempt: i64 = col(row, 6)?;
    let lease_until: Option<i64> = col(row, 7)?;
    let has_checkpoint: bool = col(row, 8)?;
    let status: Option<i32> = col(row, 9)?;
    let headers: Option<Vec<u8>> = col(row, 10)?;
    let has_body: bool = col(row, 11)?;
    let created_at: i64 = col(row, 12)?;
    let completed_at: Option<i64> = col(row, 13)?;
    let expires_at: i64 = col(row, 14)?;
    match u64::try_from(token) {
        Ok(t) if t > 0 => *max_token = (*max_token).max(t),
        _ => problem(format!("token {token} is not positive")),
    }
    if u32::try_from(attempt).map_or(true, |a| a == 0) {
        problem(format!("attempt {attempt} out of range"));
    }
    if created_at < 0 || expires_at <= created_at {
        problem(format!(
            "expires at {expires_at}, not after its creation at {created_at}"
        ));
    }
    match state.as_str() {
        "in_progress" => {
            match lease_until {
                None => problem("in progress without a lease deadline".to_owned()),
                Some(until) if until > expires_at => problem(format!(
                    "expires at {expires_at}, before its lease ends at {until}"
                )),
                Some(_) => {}
            }
            if status.is_some() || headers.is_some() || has_body || completed_at.is_some() {
                problem("in progress but holds a response".to_owned());
            }
        }
        "completed" => {
            if lease_until.is_some() || has_checkpoint {
                problem("completed but holds a lease or checkpoint".to_owned());
            }
            match status {
                Some(s) if u16::try_from(s).is_ok() => {}
                other => problem(format!("completed with response status {other:?}")),
            }
            match headers.as_deref().map(decode_headers) {
                Some(Ok(_)) => {}
                Some(Err(e)) => problem(e.to_string()),
                None => problem("completed without response headers".to_owned()),
            }
            if !has_body {
                problem("completed without a response body".to_owned());
            }
            match completed_at {
                Some(at) if at >= created_at && expires_at > at => {}
                other => problem(format!(
                    "completed at {other:?}, not between its creation at {created_at} and its \
                     expiry at {expires_at}"
                )),
            }
        }
        other => problem(format!("unknown state {other:?}")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_validated() {
        for bad in ["", "Public", "1abc", "a-b", "a\"b", &"a".repeat(64)] {
            let mut builder = PgStore::builder();
            builder.schema(bad);
            assert!(
                matches!(builder.validate(), Err(Error::InvalidConfig { .. })),
                "{bad:?}"
            );
        }
        let mut builder = PgStore::builder();
        builder.schema("idem_2026");
        assert!(builder.validate().is_ok());
    }

    #[test]
    fn a_bad_url_is_a_configuration_error() {
        assert!(matches!(
            PgStore::connect("postgresql://[::1"),
            Err(Error::InvalidConfig { .. })
        ));
    }

    #[test]
    fn headers_round_trip_through_their_encoding() -> Result<()> {
        let headers = vec![
            ("Content-Type".to_owned(), b"application/json".to_vec()),
            ("X-Dup".to_owned(), vec![0xff, 0]),
        ];
        let bytes = postcard::to_allocvec(&headers).map_err(|e| Error::storage("test", e))?;
        assert_eq!(decode_headers(&bytes)?, headers);
        let mut long = bytes.clone();
        long.push(0);
        assert!(decode_headers(&long).is_err());
        Ok(())
    }
}
