//! PostgreSQL fixtures: the server's URL, and schemas that exist for one test.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use idempotency_store::{Error, ManualClock, Result, Timestamp, pg::PgStore};

use super::{Settings, T0};

pub use crate::common::pg::url;

/// A fixture's own failure, as an error the test returns.
pub fn fixture(e: postgres::Error) -> Error {
    Error::InvalidConfig {
        reason: format!("test fixture: {e}"),
    }
}

/// A schema of its own, dropped (with everything in it) when this is dropped.
pub struct Db {
    url: String,
    schema: String,
}

impl Db {
    /// A fresh schema for the test `name`, or `None` if there is no server to test on.
    pub fn fresh(name: &str) -> Option<Db> {
        url().map(|url| Db::named(url, name))
    }

    /// A schema unique to this process and call, derived from `name`.
    pub fn named(url: String, name: &str) -> Db {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let short: String = name.chars().take(40).collect();
        let schema = format!("conf_{short}_{}_{n}", std::process::id());
        let db = Db { url, schema };
        db.drop_schema();
        db
    }

    /// A store on this schema (created on first use) with the test's settings.
    pub fn open(&self, settings: &Settings) -> Result<(PgStore, ManualClock)> {
        let clock = ManualClock::new(Timestamp::from_millis(T0));
        Ok((self.connect(settings, &clock)?, clock))
    }

    pub fn connect(&self, settings: &Settings, clock: &ManualClock) -> Result<PgStore> {
        let mut builder = crate::common::pg::builder();
        builder
            .schema(self.schema.as_str())
            .lease(settings.lease)
            .retention(settings.retention)
            .pool_size(4)
            .clock(clock.clone());
        if let Some(len) = settings.max_key_len {
            builder.max_key_len(len);
        }
        if let Some(bytes) = settings.max_response_bytes {
            builder.max_response_bytes(bytes);
        }
        builder.connect(&self.url)
    }

    /// A store on this schema without prepared statements, as behind a transaction
    /// pooler, migrating (and so creating its routines) only if `migrate`.
    pub fn open_unprepared(&self, migrate: bool) -> Result<PgStore> {
        crate::common::pg::builder()
            .schema(self.schema.as_str())
            .lease(super::LEASE)
            .pool_size(2)
            .prepare_statements(false)
            .migrate(migrate)
            .connect(&self.url)
    }

    /// A store on this schema with default settings and the server's clock.
    pub fn open_with_server_clock(&self) -> Result<PgStore> {
        crate::common::pg::builder()
            .schema(self.schema.as_str())
            .lease(super::LEASE)
            .pool_size(2)
            .connect(&self.url)
    }

    /// A store on this schema with one pooled connection, named `application_name`.
    pub fn open_named(&self, application_name: &str) -> Result<PgStore> {
        self.open_with("application_name", application_name, true)
    }

    /// A store on this schema with one connection, whose connection string also sets
    /// `key` to `value`, preparing its statements if `prepare`.
    pub fn open_with(&self, key: &str, value: &str, prepare: bool) -> Result<PgStore> {
        let url = if self.url.starts_with("postgres") {
            let sep = if self.url.contains('?') { '&' } else { '?' };
            let value = value.replace(' ', "%20").replace('=', "%3D");
            format!("{}{sep}{key}={value}", self.url)
        } else {
            format!("{} {key}='{}'", self.url, value.replace('\'', "\\'"))
        };
        crate::common::pg::builder()
            .schema(self.schema.as_str())
            .pool_size(1)
            .prepare_statements(prepare)
            .connect(&url)
    }

    /// Runs `sql` with `{schema}` replaced by this schema's quoted name.
    pub fn execute(&self, sql: &str) -> Result<()> {
        self.admin(&self.sql(sql))
    }

    /// `sql` with `{schema}` replaced by this schema's quoted name.
    pub fn sql(&self, sql: &str) -> String {
        sql.replace("{schema}", &format!("\"{}\"", self.schema))
    }

    /// A connection of the test's own (for transactions it holds open).
    pub fn client(&self) -> Result<postgres::Client> {
        postgres::Client::connect(
            &self.url.replace(" prepare_statements=false", ""),
            postgres::NoTls,
        )
        .map_err(fixture)
    }

    /// The first column of the first row of `sql` (with `{schema}` replaced).
    pub fn query_i64(&self, sql: &str) -> Result<i64> {
        let sql = sql.replace("{schema}", &format!("\"{}\"", self.schema));
        let mut client = postgres::Client::connect(
            &self.url.replace(" prepare_statements=false", ""),
            postgres::NoTls,
        )
        .map_err(|e| Error::InvalidConfig {
            reason: format!("test fixture: {e}"),
        })?;
        // Unnamed (`query_typed`), so that it works through a transaction-pooling proxy.
        client
            .query_typed_one(sql.as_str(), &[])
            .and_then(|row| row.try_get(0))
            .map_err(|e| Error::InvalidConfig {
                reason: format!("test fixture: {e}"),
            })
    }

    /// The key lock of the table's comment (`$1` scope, `$2` key).
    pub fn key_lock(&self) -> Result<String> {
        crate::common::pg::documented_key_lock(&mut self.client()?, &self.schema)
    }

    /// Deletes every record (keeps the schema).
    pub fn truncate(&self) -> Result<()> {
        self.admin(&format!(
            "DO $$ BEGIN IF to_regclass('\"{0}\".idempotency_keys') IS NOT NULL THEN \
             TRUNCATE \"{0}\".idempotency_keys; END IF; END $$",
            self.schema
        ))
    }

    fn drop_schema(&self) {
        if let Err(e) = self.admin(&format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        )) {
            eprintln!("could not drop schema {}: {e}", self.schema);
        }
    }

    /// Runs `sql` on one connection shared by every fixture of the process (a connection
    /// costs a SCRAM handshake, slow in debug builds).
    fn admin(&self, sql: &str) -> Result<()> {
        static ADMIN: Mutex<Option<postgres::Client>> = Mutex::new(None);
        let fail = |e: postgres::Error| Error::InvalidConfig {
            reason: format!("test fixture: {e}"),
        };
        let mut admin = ADMIN.lock().unwrap_or_else(PoisonError::into_inner);
        let client = match &mut *admin {
            Some(client) if !client.is_closed() => client,
            slot => slot.insert(
                postgres::Client::connect(
                    &self.url.replace(" prepare_statements=false", ""),
                    postgres::NoTls,
                )
                .map_err(fail)?,
            ),
        };
        client.batch_execute(sql).map_err(fail)
    }
}

impl Drop for Db {
    fn drop(&mut self) {
        self.drop_schema();
    }
}
