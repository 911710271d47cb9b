//! `PgStore`'s operations: its [`Backend`] implementation, which makes it an
//! [`IdempotencyStore`] (the counting and spans come from there), with the fenced writes and
//! the settlement check of `complete` and `release`. The walk over every record and the
//! forced release are in `admin.rs`.

use ::postgres::types::ToSql;
use ::postgres::{GenericClient, IsolationLevel, Row};

use super::lock::DURABLE;
use super::rows::{bad_count, check_row, col, millis_col, parts, pg, record_from, token_param};
use super::sql::{Sql, VERIFY_BATCH};
use super::typed::Query;
use super::{PgStore, distributed, quota, replication};
use std::sync::Arc;
use std::time::Duration;

use crate::api::backend::{Backend, SWEEP_BATCH, Swept, poll_claim_wait};
use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::{EngineMetrics, Meter};
use crate::api::nonblocking::AsyncStore;
use crate::api::outcome::{Claim, ClaimId, ForceRelease, Lease, RecordView, Replay};
use crate::api::record::Record;
use crate::api::records::Records;
use crate::api::report::{FailoverStatus, Stats, VerifyReport};
use crate::api::response::Response;
use crate::api::settings::Settings;
use crate::api::store::IdempotencyStore;
use crate::api::{publish, series};
use crate::error::{Error, Result};

/// Records one sweep statement deletes at most ([`SWEEP_BATCH`]): it holds one advisory lock
/// per record until it commits, and PostgreSQL's lock table is shared by all sessions (by
/// default 64 locks per connection slot), claims included.
const SWEEP_STATEMENT: usize = SWEEP_BATCH;

impl PgStore {
    /// Runs a fenced write (`$1` now, `$2` scope, `$3` key, `$4` token, then `extra`) and
    /// returns its rows; none means the lease is lost.
    fn fenced(
        &self,
        pick: fn(&Sql) -> &Query,
        lease: &Lease,
        extra: &[&(dyn ToSql + Sync)],
        context: &'static str,
    ) -> Result<Vec<Row>> {
        let now = self.now_param();
        let token = token_param(lease.token)?;
        let (scope, name) = parts(&lease.key);
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&now, &scope, &name, &token];
        params.extend_from_slice(extra);
        self.with_write_conn(|client, st| {
            let rows = pick(st)
                .query(client, &params)
                .map_err(|e| pg(context, e))?;
            if rows.is_empty() {
                return Err(Error::LeaseLost);
            }
            Ok(rows)
        })
    }

    /// The answer of a settling call (`complete` with its response, or `release`) that
    /// returned `done`. After an outcome-unknown error the lease is in doubt, and a retry
    /// that finds the lease gone checks whether its own earlier call did it: the record holds
    /// this lease's completion with the same response, or (a release) no record is left.
    pub(super) fn settle(
        &self,
        lease: &Lease,
        done: Result<()>,
        response: Option<&Response>,
    ) -> Result<()> {
        lease.in_doubt.after(&done);
        match done {
            Err(Error::LeaseLost) if lease.in_doubt.get() => {
                let (scope, name) = parts(&lease.key);
                let now = self.now_param();
                let record = self.with_conn(|client, st| {
                    let row = st
                        .select
                        .query_one(client, &[&now, &scope, &name])
                        .map_err(|e| pg("reading a record", e))?;
                    record_from(&row, 1)
                })?;
                let own = match (record, response) {
                    (Some(record), Some(response)) => record.completed_by(lease.token, response),
                    (None, None) => true,
                    _ => false,
                };
                if !own {
                    return Err(Error::LeaseLost);
                }
                self.with_write_conn(|client, _| replicated(client))
            }
            other => other,
        }
    }
}

/// Returns once everything this server has committed is as durable as the store's own
/// commits: a commit of its own waits, with synchronous standbys, for one to hold the WAL past
/// every earlier commit. It needs a record in the WAL before its commit record (PostgreSQL does
/// not wait for a transaction that wrote only that), hence an empty transactional logical
/// message, which any role may write at `wal_level` `replica`. An answer read back after an
/// outcome-unknown error (a settlement found, a lease got back by its claim id) may come from
/// a commit whose wait for a standby was cancelled: it is given only once that commit is
/// replicated. Simple-query protocol: no prepared statement.
pub(super) fn replicated(client: &mut impl GenericClient) -> Result<()> {
    client
        .simple_query(&format!(
            "SELECT {DURABLE}, pg_logical_emit_message(true, 'idempotency-store', '')"
        ))
        .map_err(|e| pg("waiting for a synchronous standby", e))?;
    Ok(())
}

impl Backend for PgStore {
    fn meter(&self) -> &Meter {
        &self.meter
    }

    fn settings(&self) -> &Settings {
        &self.settings.shared
    }

    fn now(&self) -> Result<Timestamp> {
        PgStore::read_now(self)
    }

    fn claim(&self, key: &Key, fingerprint: Fingerprint, id: Option<ClaimId>) -> Result<Claim> {
        self.claim_as(key, fingerprint, id)
    }

    /// Shared by several processes, a settling call elsewhere cannot wake this one: it polls.
    fn claim_wait(&self, key: &Key, fingerprint: Fingerprint, timeout: Duration) -> Result<Claim> {
        let claim = || IdempotencyStore::claim(self, key, fingerprint);
        poll_claim_wait(claim, timeout, &self.meter)
    }

    /// Every answer is a round trip: nothing is kept.
    fn cached_replay(&self, _key: &Key, _fingerprint: Fingerprint) -> Option<Replay> {
        None
    }

    /// The sync client has no async form: callers use the blocking calls.
    fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>> {
        None
    }

    fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
        self.check_size(response.size())?;
        let headers = postcard::to_allocvec(&response.headers)
            .map_err(|e| Error::storage("encoding response headers", e))?;
        let status = i32::from(response.status);
        let done = self.fenced(
            |st| &st.complete,
            lease,
            &[&status, &headers, &response.body, &self.retention_of(lease)],
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

    fn read(&self, key: &Key, expired: bool) -> Result<Option<RecordView>> {
        self.check_key(key)?;
        let (scope, name) = parts(key);
        let now = self.now_param();
        self.with_conn(|client, st| {
            let row = st
                .select
                .query_one(client, &[&now, &scope, &name])
                .map_err(|e| pg("reading a record", e))?;
            let db_now = Timestamp::from_millis(millis_col(&row, 0)?);
            Ok(record_from(&row, 1)?
                .filter(|r| expired || !r.is_expired(db_now))
                .map(Record::into_view))
        })
    }

    fn sweep(&self, limit: usize) -> Result<Swept> {
        let mut swept = Swept {
            deleted: 0,
            more: limit > 0,
        };
        self.with_conn(|client, st| {
            while swept.more && swept.deleted < limit {
                let deleted = swept.deleted;
                let chunk = (limit - deleted).min(SWEEP_STATEMENT);
                let now = self.now_param();
                let chunk_param = i64::try_from(chunk).unwrap_or(i64::MAX);
                let (gone, candidates) = if let Some(distributed) = &st.distributed {
                    distributed::sweep_once(client, distributed, now, chunk_param)?
                } else {
                    let row = st
                        .sweep
                        .query_one(client, &[&now, &chunk_param])
                        .map_err(|e| pg("sweeping expired records", e))?;
                    let count = |i| usize::try_from(col::<i64>(&row, i)?).map_err(bad_count);
                    (count(0)?, count(1)?)
                };
                swept.deleted += gone;
                // Fewer candidates: none left. None deleted: every one is being claimed.
                swept.more = candidates == chunk && gone > 0;
            }
            Ok(swept)
        })
    }

    fn sweep_all_round(&self) -> usize {
        SWEEP_BATCH
    }

    fn verify(&self) -> Result<VerifyReport> {
        self.with_write_conn(|client, st| {
            let mut txn = client
                .build_transaction()
                .isolation_level(IsolationLevel::RepeatableRead)
                .read_only(true)
                .start()
                .map_err(|e| pg("verifying", e))?;
            st.verify
                .execute(&mut txn, &[])
                .map_err(|e| pg("verifying", e))?;
            let mut report = VerifyReport::default();
            let mut max_token = 0u64;
            loop {
                let rows = st
                    .verify_fetch
                    .query(&mut txn, &[])
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
            let row = st
                .sequence
                .query_one(&mut txn, &[])
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
            let row = st
                .stats
                .query_one(client, &[&now])
                .map_err(|e| pg("counting records", e))?;
            let count =
                |i| -> Result<u64> { u64::try_from(col::<i64>(&row, i)?).map_err(bad_count) };
            let report = replication::read(client)?;
            self.watch.record(&report);
            Ok(Stats {
                in_progress: count(0)?,
                stuck: count(1)?,
                completed: count(2)?,
                expired: count(3)?,
                file_bytes: Some(count(4)?),
                failover: Some(self.watch.status()),
            })
        })
    }

    fn records(&self) -> Result<Records<'_>> {
        Ok(self.walk())
    }

    fn force_release(&self, key: &Key) -> Result<ForceRelease> {
        self.release_stuck(key)
    }

    /// No engine of its own: the server's figures are the server's.
    fn engine_metrics(&self) -> Option<EngineMetrics> {
        None
    }

    /// The last check, as the store's calls made it (see `PgStoreBuilder::failover_check_period`);
    /// also the `idempotency_failover_safe` gauge, set here as the redb store's gauges are.
    fn failover_status(&self) -> Option<FailoverStatus> {
        let status = self.watch.status();
        publish::level(&series::FAILOVER_SAFE, u64::from(status.safe));
        Some(status)
    }
}
