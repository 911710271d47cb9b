//! Operator tools on PostgreSQL, as on the redb store: walking every record and releasing a
//! stuck key without its lease. The `idempotency-store`
//! CLI is built on these.

use ::postgres::Row;

use super::PgStore;
use super::lock::{after_lock, key_lock};
use super::rows::{RECORD_COLUMNS, col, parts, pg, record_from};
use super::typed::Query;
use crate::api::backend::Backend;
use crate::api::clock::Timestamp;
use crate::api::key::Key;
use crate::api::outcome::{ForceRelease, RecordState};
use crate::api::records::Records;
use crate::api::report::StoredRecord;
#[cfg(doc)]
use crate::api::store::IdempotencyStore;
use crate::error::{Error, Result};

/// Records fetched per round trip by the walk.
const PAGE: i64 = 500;

/// How often `force_release` starts over when a claim replaced the record under it.
const FORCE_RELEASE_ROUNDS: usize = 8;

/// The PostgreSQL walk behind [`IdempotencyStore::records`]: pages of records in key order
/// (scope, then key), each page its own statement.
#[derive(Debug)]
struct Walk<'store> {
    store: &'store PgStore,
    /// The last key read, `None` once the walk has ended.
    after: Option<(String, String)>,
    page: std::vec::IntoIter<Row>,
}

impl Iterator for Walk<'_> {
    type Item = Result<StoredRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(row) = self.page.next() {
                return Some(self.decode(&row));
            }
            let (scope, key) = self.after.take()?;
            match self.store.page_after(&scope, &key) {
                Ok(rows) if rows.is_empty() => return None,
                Ok(rows) => {
                    self.after = Some((scope, key));
                    self.page = rows.into_iter();
                }
                Err(err) => return Some(Err(err)),
            }
        }
    }
}

impl Walk<'_> {
    fn decode(&mut self, row: &Row) -> Result<StoredRecord> {
        let scope: String = col(row, 0)?;
        let name: String = col(row, 1)?;
        if let Some(after) = &mut self.after {
            after.clone_from(&(scope.clone(), name.clone()));
        }
        let shown = if scope.is_empty() {
            name.clone()
        } else {
            format!("{scope}/{name}")
        };
        let damaged = |err: Error| match err {
            Error::Corrupted { reason } | Error::InvalidKey { reason } => {
                Error::corrupted(format!("record {shown:?}: {reason}"))
            }
            other => other,
        };
        let key = if scope.is_empty() {
            Key::new(&name)
        } else {
            Key::scoped(&scope, &name)
        }
        .map_err(damaged)?;
        match record_from(row, 2).map_err(damaged)? {
            Some(record) => Ok(StoredRecord {
                key,
                record: record.into_view(),
            }),
            None => Err(Error::corrupted(format!("record {shown:?} has no state"))),
        }
    }
}

impl PgStore {
    /// Every record, expired ones included, in key order.
    pub(super) fn walk(&self) -> Records<'_> {
        Records::new(Walk {
            store: self,
            after: Some((String::new(), String::new())),
            page: Vec::new().into_iter(),
        })
    }

    fn page_after(&self, scope: &str, key: &str) -> Result<Vec<Row>> {
        let sql = format!(
            "SELECT r.scope, r.key, {RECORD_COLUMNS} FROM {} AS r \
             WHERE (r.scope, r.key) > ($1::text, $2::text) ORDER BY r.scope, r.key LIMIT $3::bigint",
            self.table()
        );
        self.with_conn(|client, _| {
            Query::new(sql)
                .query(client, &[&scope, &key, &PAGE])
                .map_err(|e| pg("listing records", e))
        })
    }

    fn table(&self) -> String {
        format!("\"{}\".idempotency_keys", self.settings.schema)
    }

    /// Deletes the key's in-progress, unexpired record without its lease.
    pub(super) fn release_stuck(&self, key: &Key) -> Result<ForceRelease> {
        self.check_key(key)?;
        let (scope, name) = parts(key);
        let sql = Query::new(format!(
            "{} DELETE FROM {} AS r USING c WHERE r.scope = $2::text AND r.key = $3::text \
             AND r.state = 'in_progress' AND r.expires_at > c.now \
             RETURNING r.attempt, r.lease_until",
            after_lock(&format!(
                "{}{}",
                key_lock(&self.settings.schema, "$2", "$3"),
                // As `Sql::new`: Citus cannot keep a `void` in the CTE's intermediate result.
                if self.settings.distributed {
                    "::text"
                } else {
                    ""
                }
            )),
            self.table()
        ));
        // The delete's snapshot predates its wait for the key's lock: a record that a claim
        // made meanwhile is not one it can see, so it tries again rather than call that
        // record completed.
        for _ in 0..FORCE_RELEASE_ROUNDS {
            let now = self.now_param();
            let deleted = self.with_write_conn(|client, _| {
                sql.query_opt(client, &[&now, &scope, &name])
                    .map_err(|e| pg("releasing a key", e))
            })?;
            if let Some(row) = deleted {
                let attempt: i64 = col(&row, 0)?;
                let until: Option<i64> = col(&row, 1)?;
                return Ok(ForceRelease::Released {
                    attempt: u32::try_from(attempt).unwrap_or(u32::MAX),
                    lease_until: Timestamp::from_millis(
                        until.and_then(|t| u64::try_from(t).ok()).unwrap_or(0),
                    ),
                });
            }
            let now = self.read_now()?;
            match Backend::read(self, key, true)? {
                Some(record) if record.expires_at <= now => return Ok(ForceRelease::NotFound),
                None => return Ok(ForceRelease::NotFound),
                Some(record) if matches!(record.state, RecordState::Completed { .. }) => {
                    return Ok(ForceRelease::Completed);
                }
                Some(_) => {}
            }
        }
        Err(Error::storage(
            "releasing a key",
            std::io::Error::other("the record kept changing under concurrent claims; try again"),
        ))
    }
}
