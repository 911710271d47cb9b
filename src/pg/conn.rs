//! Pooled connections, each with its copy of the store's statements, prepared on it once
//! (unless `prepare_statements` is off: see `typed`).

use ::postgres::Client;
use r2d2_postgres::PostgresConnectionManager;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::lock::SESSION_DURABLE;
use super::rows::pg;
use super::sql::Sql;
use crate::error::Result;

/// The store's statements in the two forms a connection may send (see [`Conn::parts`]).
pub(super) struct Templates {
    /// Each write raises its commit's durability itself.
    pub(super) durable: Sql,
    /// Each write relies on its session's settings.
    pub(super) lean: Sql,
}

/// A pooled connection.
pub(super) struct Conn {
    pub(super) client: Client,
    /// Its lean statements, from their first use on (after the migration).
    lean: Option<Sql>,
    /// Its durable statements, from their first use on.
    durable: Option<Sql>,
    /// The caller's code ran on it (`complete_with`, `read_with`) and may have changed its
    /// session's settings.
    foreign: bool,
    /// A call on it failed with a storage error: drop it rather than reuse it.
    pub(super) broken: bool,
}

impl Conn {
    /// The client and the statements to send on it, copied from `templates` (and prepared, if
    /// `prepare`) on first use. A connection that prepares its statements is the store's
    /// alone (a transaction pooler would lose them), so it sets its session's durability once
    /// and sends the lean statements; one that does not may share its server session through
    /// a pooler, and one that ran the caller's code (`foreign`, from this call on) may have had
    /// its settings changed, so they send the durable ones.
    pub(super) fn parts(
        &mut self,
        templates: &Templates,
        prepare: bool,
        foreign: bool,
    ) -> Result<(&mut Client, &Sql)> {
        self.foreign |= foreign;
        let lean = prepare && !self.foreign;
        let Conn {
            client,
            lean: lean_slot,
            durable,
            ..
        } = self;
        let (slot, template) = if lean {
            (lean_slot, &templates.lean)
        } else {
            (durable, &templates.durable)
        };
        let sql = match slot {
            Some(sql) => sql,
            None => {
                let mut copy = template.clone();
                if lean {
                    client
                        .batch_execute(SESSION_DURABLE)
                        .map_err(|e| pg("setting the session's durability", e))?;
                }
                if prepare {
                    copy.prepare(client)
                        .map_err(|e| pg("preparing the store's statements", e))?;
                }
                slot.insert(copy)
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
            lean: None,
            durable: None,
            foreign: false,
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
