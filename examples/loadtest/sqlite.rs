//! SQLite (WAL, `synchronous=FULL`, one connection per thread) as a system under test.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rusqlite::{Connection, ErrorCode, OptionalExtension, TransactionBehavior, params};

use crate::systems::{Client, Fresh, ReplaySet, System, fresh_for};
use crate::tools::{Rng, body, err, fingerprint_of, now_ms};
use crate::{AMOUNT, BODY_LEN, CUSTOMER, Res, SQLITE_DB};

pub(crate) struct SqliteSys {
    pub(crate) path: PathBuf,
    pub(crate) set: Arc<ReplaySet>,
    pub(crate) cell: u64,
    pub(crate) body: Vec<u8>,
}

pub(crate) struct SqliteClient<'a> {
    pub(crate) sys: &'a SqliteSys,
    pub(crate) conn: Connection,
    pub(crate) fresh: Fresh,
    pub(crate) rng: Rng,
    pub(crate) thread: u64,
    pub(crate) tokens: u64,
}

pub(crate) const SQL_SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS idempotency_keys(
        key TEXT PRIMARY KEY,
        fingerprint BLOB NOT NULL,
        status TEXT NOT NULL,
        token INTEGER,
        lease_until INTEGER,
        response_status INTEGER,
        response_headers BLOB,
        response_body BLOB,
        created_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL);
    CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys(expires_at);
    CREATE TABLE IF NOT EXISTS ledger(
        key TEXT PRIMARY KEY,
        amount INTEGER NOT NULL,
        customer TEXT NOT NULL);";
pub(crate) const SQL_LEDGER: &str =
    "INSERT INTO ledger (key, amount, customer) VALUES (?1, ?2, ?3)";
pub(crate) const SQL_CLAIM: &str = "INSERT INTO idempotency_keys
    (key, fingerprint, status, token, lease_until, created_at, expires_at)
    VALUES (?1, ?2, 'in_progress', ?3, ?4, ?5, ?6)";
pub(crate) const SQL_COMPLETE: &str = "UPDATE idempotency_keys
    SET status = 'completed', token = NULL, lease_until = NULL, response_status = ?3,
        response_headers = ?4, response_body = ?5, expires_at = ?6
    WHERE key = ?1 AND token = ?2 AND status = 'in_progress'";
pub(crate) const SQL_GET: &str =
    "SELECT fingerprint, status, lease_until, response_status, response_headers,
    response_body, expires_at FROM idempotency_keys WHERE key = ?1";
pub(crate) const LEASE_MS: i64 = 60_000;
pub(crate) const RETENTION_MS: i64 = 24 * 3600 * 1000;

/// A stored row as the claim sees it.
pub(crate) struct Row {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) status: String,
    pub(crate) response_status: Option<i64>,
    pub(crate) response_body: Option<Vec<u8>>,
    pub(crate) expires_at: i64,
}

pub(crate) fn sqlite_connect(path: &Path) -> Res<Connection> {
    let conn = Connection::open(path).map_err(|e| err("sqlite open", e))?;
    conn.busy_timeout(Duration::from_secs(120))
        .map_err(|e| err("busy_timeout", e))?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(|e| err("journal_mode", e))?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(|e| err("synchronous", e))?;
    conn.set_prepared_statement_cache_capacity(16);
    Ok(conn)
}

impl SqliteSys {
    pub(crate) fn create(dir: &Path, set: Arc<ReplaySet>, cell: u64) -> Res<Self> {
        let path = dir.join(SQLITE_DB);
        let conn = sqlite_connect(&path)?;
        conn.execute_batch(SQL_SCHEMA)
            .map_err(|e| err("sqlite schema", e))?;
        Ok(SqliteSys {
            path,
            set,
            cell,
            body: body(),
        })
    }

    /// Inserts the replay set as completed rows, in one transaction.
    pub(crate) fn prefill(&self) -> Res<()> {
        let mut conn = sqlite_connect(&self.path)?;
        let tx = conn.transaction().map_err(|e| err("sqlite begin", e))?;
        {
            let mut stmt = tx
                .prepare(
                    "INSERT INTO idempotency_keys (key, fingerprint, status, response_status,
                     response_headers, response_body, created_at, expires_at)
                     VALUES (?1, ?2, 'completed', 200, x'', ?3, ?4, ?5)",
                )
                .map_err(|e| err("sqlite prepare", e))?;
            let now = now_ms();
            for (name, fp) in self.set.names.iter().zip(&self.set.fps) {
                stmt.execute(params![
                    name,
                    &fp.digest()[..],
                    &self.body,
                    now,
                    now + RETENTION_MS
                ])
                .map_err(|e| err("sqlite prefill", e))?;
            }
        }
        tx.commit().map_err(|e| err("sqlite commit", e))
    }
}

impl System for SqliteSys {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        Ok(Box::new(SqliteClient {
            sys: self,
            conn: sqlite_connect(&self.path)?,
            fresh: fresh_for(thread, self.cell),
            rng: Rng::new(thread as u64 ^ (self.cell << 32)),
            thread: thread as u64,
            tokens: 0,
        }))
    }
}

impl SqliteClient<'_> {
    pub(crate) fn get(&self, key: &str) -> Res<Option<Row>> {
        let mut stmt = self
            .conn
            .prepare_cached(SQL_GET)
            .map_err(|e| err("prepare", e))?;
        stmt.query_row([key], |r| {
            Ok(Row {
                fingerprint: r.get(0)?,
                status: r.get(1)?,
                response_status: r.get(3)?,
                response_body: r.get(5)?,
                expires_at: r.get(6)?,
            })
        })
        .optional()
        .map_err(|e| err("select", e))
    }
}

impl SqliteClient<'_> {
    /// Claims a fresh key in a commit of its own; returns its name and token.
    pub(crate) fn claim_fresh(&mut self) -> Res<(String, i64)> {
        let name = self.fresh.next();
        let fp = fingerprint_of(&name);
        self.tokens += 1;
        let token = ((self.thread << 40) | self.tokens) as i64;
        let now = now_ms();
        let inserted = {
            let mut claim = self
                .conn
                .prepare_cached(SQL_CLAIM)
                .map_err(|e| err("prepare", e))?;
            claim.execute(params![
                name,
                &fp.digest()[..],
                token,
                now + LEASE_MS,
                now,
                now + RETENTION_MS
            ])
        };
        match inserted {
            Ok(1) => Ok((name, token)),
            Ok(n) => Err(format!("claim inserted {n} rows")),
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == ErrorCode::ConstraintViolation =>
            {
                // Taken: classify the stored row (never expected for a fresh key).
                let row = self.get(&name)?;
                Err(format!(
                    "fresh key {name} already taken (status {:?})",
                    row.map(|r| r.status)
                ))
            }
            Err(e) => Err(err("claim insert", e)),
        }
    }
}

/// Stores the response of `name`'s claim `token` in `conn` (autocommit or a transaction).
pub(crate) fn sqlite_complete(conn: &Connection, name: &str, token: i64, body: &[u8]) -> Res<()> {
    let mut complete = conn
        .prepare_cached(SQL_COMPLETE)
        .map_err(|e| err("prepare", e))?;
    match complete.execute(params![
        name,
        token,
        200,
        &b""[..],
        body,
        now_ms() + RETENTION_MS
    ]) {
        Ok(1) => Ok(()),
        Ok(n) => Err(format!("complete updated {n} rows (lease lost)")),
        Err(e) => Err(err("complete update", e)),
    }
}

impl Client for SqliteClient<'_> {
    fn pair(&mut self) -> Res<()> {
        let (name, token) = self.claim_fresh()?;
        sqlite_complete(&self.conn, &name, token, &self.sys.body)
    }

    /// The claim's commit, then the ledger row and the response in one transaction.
    fn payment(&mut self) -> Res<()> {
        let (name, token) = self.claim_fresh()?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| err("sqlite begin", e))?;
        tx.prepare_cached(SQL_LEDGER)
            .and_then(|mut insert| insert.execute(params![name, AMOUNT as i64, CUSTOMER]))
            .map_err(|e| err("ledger insert", e))?;
        sqlite_complete(&tx, &name, token, &self.sys.body)?;
        tx.commit().map_err(|e| err("sqlite commit", e))
    }

    fn replay(&mut self) -> Res<()> {
        let set = &self.sys.set;
        let i = self.rng.below(set.names.len());
        let row = self.get(&set.names[i])?;
        match row {
            Some(row)
                if row.fingerprint == set.fps[i].digest()[..]
                    && row.status == "completed"
                    && row.expires_at > now_ms()
                    && row.response_status == Some(200)
                    && row
                        .response_body
                        .as_ref()
                        .is_some_and(|b| b.len() == BODY_LEN) =>
            {
                Ok(())
            }
            _ => Err(format!("key {} did not replay", set.names[i])),
        }
    }
}
