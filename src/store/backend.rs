//! The redb [`Store`]'s operations: its [`Backend`] implementation, which makes it an
//! [`IdempotencyStore`](crate::IdempotencyStore) (the counting and spans come from there).
//! The operator calls' bodies are in `admin.rs`, `maintenance.rs` and `sweep.rs`.

use std::sync::Arc;
use std::time::Duration;

use crate::api::backend::{Backend, Swept};
use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::{EngineMetrics, Meter};
use crate::api::nonblocking::AsyncStore;
use crate::api::outcome::{Claim, ClaimId, ForceRelease, Lease, RecordView, Replay};
use crate::api::record::Record;
use crate::api::records::Records;
use crate::api::report::{Stats, VerifyReport};
use crate::api::response::Response;
use crate::api::settings::Settings;
use crate::engine::ops::{Checkpoint, Heartbeat};
use crate::error::Result;
use crate::store::nonblocking::Nonblocking;
use crate::store::{Store, admin, metrics, release_write};

impl Backend for Store {
    fn meter(&self) -> &Meter {
        &self.meter
    }

    fn settings(&self) -> &Settings {
        &self.config.settings
    }

    fn now(&self) -> Result<Timestamp> {
        Ok(self.engine.now())
    }

    fn claim(&self, key: &Key, fingerprint: Fingerprint, id: Option<ClaimId>) -> Result<Claim> {
        self.claim_as(key, fingerprint, id, None)
    }

    fn claim_wait(&self, key: &Key, fingerprint: Fingerprint, timeout: Duration) -> Result<Claim> {
        self.wait_for(key, fingerprint, timeout)
    }

    fn cached_replay(&self, key: &Key, fingerprint: Fingerprint) -> Option<Replay> {
        self.replays.get(key, fingerprint, self.engine.now())
    }

    fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>> {
        Some(Arc::new(Nonblocking(self)))
    }

    fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
        let done = self
            .complete_write(lease, response)
            .and_then(|write| self.engine.write(write));
        self.settled(lease, done)
    }

    fn release(&self, lease: &Lease) -> Result<()> {
        let done = self.engine.write(release_write(lease));
        self.settled(lease, done)
    }

    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
        let until = self.engine.write(Heartbeat {
            key: lease.key.clone(),
            token: lease.token,
        })?;
        lease.lease_until = until;
        Ok(until)
    }

    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
        self.check_size(data.len())?;
        self.engine.write(Checkpoint {
            key: lease.key.clone(),
            token: lease.token,
            data: data.clone(),
        })?;
        lease.checkpoint = Some(data);
        Ok(())
    }

    fn read(&self, key: &Key, expired: bool) -> Result<Option<RecordView>> {
        self.check_key(key)?;
        let now = self.engine.now();
        Ok(self
            .stored(key)?
            .filter(|r| expired || !r.is_expired(now))
            .map(Record::into_view))
    }

    fn sweep(&self, limit: usize) -> Result<Swept> {
        self.sweep_round(limit)
    }

    /// Larger than a step: a round rides claims' batches in steps of 64, and only a store
    /// with no claims to ride lets a step grow (see `engine::sweep`).
    fn sweep_all_round(&self) -> usize {
        crate::engine::sweep::ROUND
    }

    fn verify(&self) -> Result<VerifyReport> {
        self.check_tables()
    }

    fn stats(&self) -> Result<Stats> {
        self.count_records()
    }

    fn records(&self) -> Result<Records<'_>> {
        admin::records(self)
    }

    fn force_release(&self, key: &Key) -> Result<ForceRelease> {
        admin::force_release(self, key)
    }

    fn engine_metrics(&self) -> Option<EngineMetrics> {
        Some(metrics::engine(self))
    }
}
