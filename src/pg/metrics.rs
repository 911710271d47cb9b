//! `PgStore`'s calls, counted: the store's calls run unmetered in `calls.rs`, and the
//! [`IdempotencyStore`] implementation here counts each outcome and time around them, under the
//! same names as the redb store's.

use std::time::{Duration, Instant};

use crate::api::backend::{self, IdempotencyStore};
use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::{Call, Metrics};
use crate::api::outcome::{Claim, ClaimId, ForceRelease, Lease, RecordView};
use crate::api::records::Records;
use crate::api::report::{Stats, VerifyReport};
use crate::api::response::Response;
use crate::api::trace;
use crate::error::Result;
use crate::pg::PgStore;

/// The store's calls as `calls.rs` implements them, before counting.
pub(crate) trait Unmetered {
    fn now(&self) -> Result<Timestamp>;
    fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim>;
    fn claim_with_id(&self, key: &Key, fingerprint: Fingerprint, id: ClaimId) -> Result<Claim>;
    fn complete(&self, lease: &Lease, response: Response) -> Result<()>;
    fn release(&self, lease: &Lease) -> Result<()>;
    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp>;
    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()>;
    fn lookup(&self, key: &Key) -> Result<Option<RecordView>>;
    fn sweep(&self, limit: usize) -> Result<usize>;
    fn verify(&self) -> Result<VerifyReport>;
    fn stats(&self) -> Result<Stats>;
}

impl IdempotencyStore for PgStore {
    fn now(&self) -> Result<Timestamp> {
        Unmetered::now(self)
    }

    /// Counts this process's calls only (other instances sharing the table keep their own).
    fn metrics(&self) -> Metrics {
        self.metrics.snapshot()
    }

    fn records(&self) -> Result<Records<'_>> {
        Ok(PgStore::records(self))
    }

    fn inspect(&self, key: &Key) -> Result<Option<RecordView>> {
        PgStore::inspect(self, key)
    }

    fn force_release(&self, key: &Key) -> Result<ForceRelease> {
        PgStore::force_release(self, key)
    }

    fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim> {
        let started = Instant::now();
        let _span = trace::enter!("claim", "postgres");
        let result = Unmetered::claim(self, key, fingerprint);
        self.metrics.claimed(&result, started);
        result
    }

    fn claim_with_id(&self, key: &Key, fingerprint: Fingerprint, id: ClaimId) -> Result<Claim> {
        let started = Instant::now();
        let _span = trace::enter!("claim", "postgres");
        let result = Unmetered::claim_with_id(self, key, fingerprint, id);
        self.metrics.claimed(&result, started);
        result
    }

    fn claim_wait(&self, key: &Key, fingerprint: Fingerprint, timeout: Duration) -> Result<Claim> {
        let count = |timed_out| self.metrics.waited(timed_out);
        backend::poll_claim_wait(self, key, fingerprint, timeout, count)
    }

    fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
        let started = Instant::now();
        let _span = trace::enter!("complete", "postgres");
        let result = Unmetered::complete(self, lease, response);
        self.metrics.settled(Call::Complete, &result, started);
        result
    }

    fn release(&self, lease: &Lease) -> Result<()> {
        let started = Instant::now();
        let _span = trace::enter!("release", "postgres");
        let result = Unmetered::release(self, lease);
        self.metrics.settled(Call::Release, &result, started);
        result
    }

    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
        let started = Instant::now();
        let result = Unmetered::heartbeat(self, lease);
        self.metrics.settled(Call::Heartbeat, &result, started);
        result
    }

    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
        let started = Instant::now();
        let result = Unmetered::checkpoint(self, lease, data);
        self.metrics.settled(Call::Checkpoint, &result, started);
        result
    }

    fn lookup(&self, key: &Key) -> Result<Option<RecordView>> {
        Unmetered::lookup(self, key)
    }

    fn sweep(&self, limit: usize) -> Result<usize> {
        let _span = trace::enter!("sweep", "postgres");
        let result = Unmetered::sweep(self, limit);
        match &result {
            Ok(deleted) => self
                .metrics
                .swept(u64::try_from(*deleted).unwrap_or(u64::MAX)),
            Err(err) => self.metrics.failed(err),
        }
        result
    }

    fn verify(&self) -> Result<VerifyReport> {
        Unmetered::verify(self)
    }

    fn stats(&self) -> Result<Stats> {
        Unmetered::stats(self)
    }
}
