//! The redb [`Store`] as an [`IdempotencyStore`]: the request path forwards to the inherent
//! methods; the operator calls, which only the trait offers, are in `admin.rs` and `metrics.rs`.

use std::sync::Arc;
use std::time::Duration;

use crate::api::backend::IdempotencyStore;
use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::Metrics;
use crate::api::nonblocking::AsyncStore;
use crate::api::outcome::{Claim, ClaimId, ForceRelease, Lease, RecordView, Replay};
use crate::api::records::Records;
use crate::api::report::{Stats, VerifyReport};
use crate::api::response::Response;
use crate::error::Result;
use crate::store::nonblocking::Nonblocking;
use crate::store::{Store, admin, metrics};

impl IdempotencyStore for Store {
    fn claim(&self, key: &Key, fingerprint: Fingerprint) -> Result<Claim> {
        Store::claim(self, key, fingerprint)
    }

    fn claim_with_id(&self, key: &Key, fingerprint: Fingerprint, id: ClaimId) -> Result<Claim> {
        Store::claim_with_id(self, key, fingerprint, id)
    }

    fn claim_wait(&self, key: &Key, fingerprint: Fingerprint, timeout: Duration) -> Result<Claim> {
        Store::claim_wait(self, key, fingerprint, timeout)
    }

    fn cached_replay(&self, key: &Key, fingerprint: Fingerprint) -> Option<Replay> {
        Store::cached_replay(self, key, fingerprint)
    }

    fn now(&self) -> Result<Timestamp> {
        Ok(self.engine.now())
    }

    fn metrics(&self) -> Metrics {
        metrics::snapshot(self)
    }

    fn records(&self) -> Result<Records<'_>> {
        admin::records(self)
    }

    fn inspect(&self, key: &Key) -> Result<Option<RecordView>> {
        admin::inspect(self, key)
    }

    fn force_release(&self, key: &Key) -> Result<ForceRelease> {
        admin::force_release(self, key)
    }

    fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>> {
        Some(Arc::new(Nonblocking(self)))
    }

    fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
        Store::complete(self, lease, response)
    }

    fn release(&self, lease: &Lease) -> Result<()> {
        Store::release(self, lease)
    }

    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
        Store::heartbeat(self, lease)
    }

    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
        Store::checkpoint(self, lease, data)
    }

    fn lookup(&self, key: &Key) -> Result<Option<RecordView>> {
        Store::lookup(self, key)
    }

    fn sweep(&self, limit: usize) -> Result<usize> {
        Store::sweep(self, limit)
    }

    fn sweep_all(&self) -> Result<u64> {
        Store::sweep_all(self)
    }

    fn verify(&self) -> Result<VerifyReport> {
        Store::verify(self)
    }

    fn stats(&self) -> Result<Stats> {
        Store::stats(self)
    }
}
