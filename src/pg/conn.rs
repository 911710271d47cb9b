//! Pooled connections, each with its copy of the store's statements, prepared on it once
//! (unless `prepare_statements` is off: see `typed`).

use ::postgres::Client;
use r2d2_postgres::PostgresConnectionManager;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::rows::pg;
use super::sql::Sql;
use crate::error::Result;

/// A pooled connection.
pub(super) struct Conn {
    pub(super) client: Client,
    /// Its statements, from its first use on (after the migration).
    sql: Option<Sql>,
    /// A call on it failed with a storage error: drop it rather than reuse it.
    pub(super) broken: bool,
    /// Its server's failover safety was read on it (a new connection may reach another
    /// server: after a failover, the new primary).
    pub(super) checked: bool,
}

impl Conn {
    /// The client and the statements, copying them from `template` (and preparing them, if
    /// `prepare`) on first use.
    pub(super) fn parts(&mut self, template: &Sql, prepare: bool) -> Result<(&mut Client, &Sql)> {
        let Conn { client, sql, .. } = self;
        let sql = match sql {
            Some(sql) => sql,
            None => {
                let mut copy = template.clone();
                if prepare {
                    copy.prepare(client)
                        .map_err(|e| pg("preparing the store's statements", e))?;
                }
                sql.insert(copy)
            }
        };
        Ok((client, sql))
    }
}

/// `r2d2_postgres`'s manager, with the broken flag.
pub(super) struct Manager {
    pub(super) inner: PostgresConnectionManager<MakeRustlsConnect>,
}

impl r2d2::ManageConnection for Manager {
    type Connection = Conn;
    type Error = ::postgres::Error;

    fn connect(&self) -> std::result::Result<Conn, ::postgres::Error> {
        Ok(Conn {
            client: self.inner.connect()?,
            sql: None,
            broken: false,
            checked: false,
        })
    }

    fn is_valid(&self, conn: &mut Conn) -> std::result::Result<(), ::postgres::Error> {
        self.inner.is_valid(&mut conn.client)
    }

    fn has_broken(&self, conn: &mut Conn) -> bool {
        conn.broken || self.inner.has_broken(&mut conn.client)
    }
}
