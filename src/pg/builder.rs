//! [`PgStoreBuilder`]: a [`PgStore`]'s settings, their checks, and connecting (migrating the
//! schema on a connection of its own, then opening the pool).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use r2d2_postgres::PostgresConnectionManager;

use super::conn::Manager;
use super::migrations::{check, migrate};
#[cfg(doc)]
use super::replication::FailoverSafety;
use super::rows::{capped, pg};
use super::sql::Sql;
use super::{
    MAX_DURATION_MS, PgStore, blocking, distributed, quota, replication, routines, sync_wait, tls,
    watch,
};
use crate::api::clock::{Clock, millis};
use crate::api::metrics::Meter;
use crate::api::series;
use crate::api::settings::{Settings, invalid_config};
use crate::api::trace;
use crate::error::{Error, Result};

/// The longest pause between the pool's attempts to reconnect to a server that is down.
const RECONNECT_BACKOFF_CAP: Duration = Duration::from_millis(500);

/// Settings for connecting a [`PgStore`]. Every setter states its default; the shared ones
/// are one [`Settings`] type with the redb [`StoreBuilder`](crate::StoreBuilder)'s.
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[derive(Clone)]
pub struct PgStoreBuilder {
    pub(super) shared: Settings,
    pub(super) pool_size: u32,
    pub(super) connection_timeout: Duration,
    pub(super) schema: String,
    pub(super) clock: Option<Arc<dyn Clock>>,
    pub(super) per_scope_quotas: bool,
    pub(super) migrate: bool,
    pub(super) require_failover_safe: bool,
    pub(super) failover_check_period: Duration,
    pub(super) prepare_statements: bool,
    pub(super) distributed: bool,
}

impl Default for PgStoreBuilder {
    fn default() -> Self {
        PgStoreBuilder {
            shared: Settings::default(),
            pool_size: 10,
            connection_timeout: Duration::from_secs(30),
            schema: "public".to_owned(),
            clock: None,
            per_scope_quotas: false,
            migrate: true,
            require_failover_safe: false,
            failover_check_period: watch::DEFAULT_PERIOD,
            prepare_statements: true,
            distributed: false,
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
            .field("per_scope_quotas", &self.per_scope_quotas)
            .field("migrate", &self.migrate)
            .field("require_failover_safe", &self.require_failover_safe)
            .field("failover_check_period", &self.failover_check_period)
            .field("prepare_statements", &self.prepare_statements)
            .field("distributed", &self.distributed)
            .finish()
    }
}

impl PgStoreBuilder {
    /// A builder with every setting at its default.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    crate::api::settings::shared_setters!(shared);

    /// Whether each pooled connection prepares the store's statements once (named prepared
    /// statements that live as long as the connection). Defaults to `true`.
    ///
    /// Set it to `false` behind a **transaction-pooling proxy** that cannot carry prepared
    /// statements (PgBouncer with `pool_mode = transaction` before 1.21 or with
    /// `max_prepared_statements = 0`; other proxies that pool by transaction): such a proxy
    /// hands each transaction to any server connection, where a statement prepared on another
    /// one does not exist (SQLSTATE 26000). Every statement is then sent unnamed, with its
    /// parameter types, in one round trip, the request path's as calls of routines that keep
    /// their plans on the server (`docs/postgres.md`, "Poolers"). The price is the server's
    /// CPU for each call (BENCHMARKS.md, "PgStore through PgBouncer"). PgBouncer 1.21 or later
    /// with `max_prepared_statements` above 0, session pooling and direct connections work
    /// with the default: the store keeps no other state on a server session. The connection string may say it too, and then wins:
    /// `prepare_statements=false` (a `key=value` pair or a URL query parameter; `PgStore`
    /// takes it out before the `postgres` crate parses the rest).
    pub fn prepare_statements(&mut self, prepare: bool) -> &mut Self {
        self.prepare_statements = prepare;
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
    /// lowercase SQL identifier (`[a-z_][a-z0-9_]*`, at most 63 bytes). Created if missing
    /// (unless [`migrate`](PgStoreBuilder::migrate) is off). Defaults to `public`.
    pub fn schema(&mut self, schema: impl Into<String>) -> &mut Self {
        self.schema = schema.into();
        self
    }

    /// Whether `max_records` and `max_bytes` apply to each scope (tenant) on its own, rather
    /// than to the whole table; eviction then takes only the full scope's records. Defaults
    /// to `false`.
    pub fn per_scope_quotas(&mut self, per_scope: bool) -> &mut Self {
        self.per_scope_quotas = per_scope;
        self
    }

    /// Whether [`connect`](PgStoreBuilder::connect) creates and migrates the schema (the
    /// default), or only checks it and changes nothing: a schema that is missing, holds no
    /// store, or is at another migration than this build's fails with [`Error::NotAStore`]
    /// (with a quota, so does a schema whose quota accounting is off). For tools that must not
    /// change what they look at (the `idempotency-store` CLI: a newer CLI must not migrate a
    /// schema that older instances still run on) and for deployments that migrate in a step
    /// of their own. Defaults to true.
    pub fn migrate(&mut self, migrate: bool) -> &mut Self {
        self.migrate = migrate;
        self
    }

    /// Whether [`connect`](PgStoreBuilder::connect) refuses a server whose acknowledged commits
    /// a failover can lose (no synchronous standby named: see [`FailoverSafety`]), with
    /// [`Error::InvalidConfig`] naming the settings. Off, such a server is served and
    /// `connect` logs a `tracing` warning (feature `tracing`) saying "not failover-safe".
    ///
    /// On, it also holds while the store runs: from a check (see
    /// [`failover_check_period`](PgStoreBuilder::failover_check_period)) that finds the server
    /// not failover-safe until one finds it safe again, every write (claim, complete, release,
    /// heartbeat, checkpoint, sweep, `complete_with`, `force_release`) fails with a
    /// not-applied [`Error::Storage`] (`outcome_unknown()` false: nothing was sent) naming
    /// the reason, and reads (`get`, `stats`, `verify`, the walk, `read_with`) are served.
    /// That is Patroni's promotion window with `synchronous_mode_strict` off: a few seconds in
    /// which a claim acknowledged by the new primary would not survive its failover.
    /// Defaults to false.
    pub fn require_failover_safe(&mut self, require: bool) -> &mut Self {
        self.require_failover_safe = require;
        self
    }

    /// How often a busy store reads its server's failover safety again ([`FailoverSafety`]):
    /// at most once per period, on the connection of the call that finds it due (one more
    /// round trip for that call; no thread of its own, so an idle store does not check), in
    /// addition to the check on every new pooled connection's first use (after a reconnect or
    /// a failover). Its findings are in `stats()` and `metrics()`
    /// ([`FailoverStatus`](crate::admin::FailoverStatus)). Zero: new connections only.
    /// Defaults to 2 s.
    pub fn failover_check_period(&mut self, period: Duration) -> &mut Self {
        self.failover_check_period = period;
        self
    }

    /// Whether the records table is a **Citus distributed table**, sharded by the key over
    /// the cluster's workers, for a service whose claims outgrow one primary. `url` then names
    /// the Citus coordinator (with the `citus` extension in its database); the migration
    /// distributes the table by its `key` column (`create_distributed_table`), so that each
    /// statement of a request's path (claim, lookup, heartbeat, completion, release) names one
    /// key and runs on the one worker holding its shard. The scope stays in the primary key and
    /// in every statement's filter, so keys of different scopes still never meet; a key's
    /// records of all scopes share a shard. Fencing tokens still come from one sequence on the
    /// coordinator: unique and increasing cluster-wide. `docs/postgres.md`, "Past one primary",
    /// says what stays on one shard, what costs a distributed transaction, and what a shard
    /// move between workers does to leases.
    ///
    /// Not with a quota (`max_records`, `max_bytes`): their accounting is one row that every
    /// write updates, which would make each claim a distributed transaction; nor with
    /// `prepare_statements(false)` (the pooler routines are not distributed functions).
    /// Either is refused at [`connect`](PgStoreBuilder::connect) with
    /// [`Error::InvalidConfig`], as is a server without Citus. An existing table that is not
    /// distributed yet is distributed by the migration (Citus copies its rows). Defaults to
    /// false.
    pub fn distributed(&mut self, distributed: bool) -> &mut Self {
        self.distributed = distributed;
        self
    }

    fn limits(&self) -> Option<quota::Limits> {
        self.shared.has_quota().then_some(quota::Limits {
            max_records: self.shared.max_records,
            max_bytes: self.shared.max_bytes,
            when_full: self.shared.when_full,
            per_scope: self.per_scope_quotas,
        })
    }

    /// Connects to the database at `url` (a `postgresql://` URL or a `key=value` connection
    /// string; TLS as its `sslmode` says, see [`PgStore`]'s TLS section), creates or migrates
    /// the schema (idempotently, under an advisory lock, so that instances starting together do
    /// not race; with [`migrate`](PgStoreBuilder::migrate) off, only checks it) and opens the
    /// connection pool.
    ///
    /// May be called on any thread, one that runs a tokio runtime included (in an `async fn`
    /// under `#[tokio::main]`, either flavour): the sync client cannot run on such a thread, so
    /// when a runtime is current the work runs on a short-lived helper thread of its own. The
    /// calling thread still waits for the whole connect (TLS, the schema's migration or check,
    /// the replication check; against an unreachable server up to
    /// [`connection_timeout`](PgStoreBuilder::connection_timeout)), and the runtime's other
    /// tasks on that thread wait with it: fine at start-up, before the service runs; later,
    /// call it from `tokio::task::spawn_blocking`. The same holds for every call of the store
    /// (see [`PgStore`]'s section on async services).
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for an out-of-range setting, an unparsable `url` or an
    /// unreadable `sslrootcert`; [`Error::Storage`] if the server cannot be reached, the TLS
    /// handshake or certificate check fails (the message names the `sslmode`) or the migration
    /// fails;
    /// [`Error::InvalidConfig`] also if the server is read-only (a standby: the message names
    /// `target_session_attrs=read-write`), or, with
    /// [`require_failover_safe`](PgStoreBuilder::require_failover_safe), not failover-safe;
    /// [`Error::NotAStore`] if the schema holds a table of the same name that this crate did
    /// not create, or was migrated by a newer version of this crate (with `migrate` off: or
    /// is missing, or at an older migration).
    pub fn connect(&self, url: &str) -> Result<PgStore> {
        blocking::off_runtime(|| self.connect_here(url))
    }

    fn connect_here(&self, url: &str) -> Result<PgStore> {
        self.validate()?;
        let tls::Connection {
            mut config,
            tls,
            mode,
            prepare_statements,
        } = tls::parse(url)?;
        let mut settings = self.clone();
        settings.prepare_statements = prepare_statements.unwrap_or(self.prepare_statements);
        config.connect_timeout(self.connection_timeout);
        config.notice_callback(sync_wait::on_notice);
        let manager = Manager {
            inner: PostgresConnectionManager::new(config, tls),
        };
        let limits = self.limits();
        if self.distributed {
            distributed::refuse(limits.is_some(), settings.prepare_statements)?;
        }
        let mut sql = Sql::new(&self.schema, limits.is_some(), self.distributed);
        let failover;
        {
            // A connection of its own, so that a wrong address, password or certificate fails
            // at once with the server's answer rather than after the pool's timeout.
            let mut client = r2d2::ManageConnection::connect(&manager.inner)
                .map_err(|e| pg(mode.context(), e))?;
            // Before migrating: a read-only server fails here, naming the fix.
            failover = replication::read(&mut client)?;
            if !failover.is_failover_safe() {
                if self.require_failover_safe {
                    return Err(replication::refuse(&failover));
                }
                trace::not_failover_safe(&failover);
            }
            if self.distributed {
                distributed::check_coordinator(&mut client)?;
            }
            if self.migrate {
                migrate(
                    &mut client,
                    &self.schema,
                    limits.is_some(),
                    self.distributed,
                )?;
            } else {
                check(&mut client, &self.schema, limits.is_some())?;
                if self.distributed {
                    distributed::check(&mut client, &self.schema)?;
                }
            }
            if !settings.prepare_statements {
                routines::route(&mut client, &self.schema, self.migrate, &mut sql)?;
            }
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
            sql: Arc::new(sql),
            lease_ms: capped(millis(self.shared.lease), MAX_DURATION_MS),
            retention_ms: capped(millis(self.shared.retention), MAX_DURATION_MS),
            settings,
            high_water: AtomicU64::new(0),
            limits,
            watch: watch::Watch::new(
                &failover,
                self.failover_check_period,
                self.require_failover_safe,
            ),
            failover,
            meter: Meter::new(&series::POSTGRES, self.shared.trace_keys),
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
}
