//! Pooled connections, each with the store's statements prepared on it once.

use ::postgres::{Client, Statement};
use postgres_native_tls::MakeTlsConnector;
use r2d2_postgres::PostgresConnectionManager;

use super::quota;
use super::rows::pg;
use super::sql::Sql;
use crate::error::Result;

/// The statements, prepared once per pooled connection.
pub(super) struct Statements {
    pub(super) lock: Statement,
    pub(super) insert: Statement,
    pub(super) select: Statement,
    pub(super) takeover: Statement,
    pub(super) complete: Statement,
    pub(super) lock_lease: Statement,
    pub(super) release: Statement,
    pub(super) heartbeat: Statement,
    pub(super) checkpoint: Statement,
    pub(super) sweep: Statement,
    pub(super) stats: Statement,
    pub(super) verify: Statement,
    pub(super) sequence: Statement,
    pub(super) now: Statement,
    pub(super) quota: Option<quota::Statements>,
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
pub(super) struct Conn {
    pub(super) client: Client,
    pub(super) st: Option<Statements>,
    /// A call on it failed with a storage error: drop it rather than reuse it.
    pub(super) broken: bool,
}

impl Conn {
    /// The client and the statements, preparing them first if needed.
    pub(super) fn parts(&mut self, sql: &Sql) -> Result<(&mut Client, &Statements)> {
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
pub(super) struct Manager {
    pub(super) inner: PostgresConnectionManager<MakeTlsConnector>,
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
