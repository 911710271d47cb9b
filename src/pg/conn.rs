//! Pooled connections. They hold no prepared statements or session settings (see `typed`), so
//! that a transaction-pooling proxy may stand between the pool and the server.

use ::postgres::Client;
use r2d2_postgres::PostgresConnectionManager;
use tokio_postgres_rustls::MakeRustlsConnect;

/// A pooled connection.
pub(super) struct Conn {
    pub(super) client: Client,
    /// A call on it failed with a storage error: drop it rather than reuse it.
    pub(super) broken: bool,
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
