//! One wrapper for injecting faults into a store: `Faulty` forwards every call to the store
//! it wraps, except a claim and a completion, which go through the test's own functions. It
//! offers no async calls and keeps no replays, as `PgStore`, so the layers use the blocking
//! pool through it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use idempotency_store::admin::{ForceRelease, Records, Stats, VerifyReport};
use idempotency_store::backend::{Backend, Meter, Swept};
use idempotency_store::metrics::EngineMetrics;
use idempotency_store::nonblocking::AsyncStore;
use idempotency_store::{
    Claim, ClaimId, Fingerprint, Key, Lease, RecordView, Replay, Response, Result, Settings,
    Timestamp,
};

type ClaimFn<S> = dyn Fn(&S, &Key, Fingerprint, Option<ClaimId>) -> Result<Claim> + Send + Sync;
type CompleteFn<S> = dyn Fn(&S, &Lease, Response) -> Result<()> + Send + Sync;

/// `inner`, with its claims and completions made by the given functions (by default, the
/// inner store's own).
pub struct Faulty<S> {
    inner: S,
    claim: Box<ClaimFn<S>>,
    complete: Box<CompleteFn<S>>,
}

impl<S: Backend> Faulty<S> {
    pub fn new(inner: S) -> Self {
        Faulty {
            inner,
            claim: Box::new(|s, key, fp, id| Backend::claim(s, key, fp, id)),
            complete: Box::new(|s, lease, response| Backend::complete(s, lease, response)),
        }
    }

    /// Claims made by `claim` (given the inner store).
    pub fn claims(
        mut self,
        claim: impl Fn(&S, &Key, Fingerprint, Option<ClaimId>) -> Result<Claim> + Send + Sync + 'static,
    ) -> Self {
        self.claim = Box::new(claim);
        self
    }

    /// Completions made by `complete` (given the inner store).
    pub fn completes(
        mut self,
        complete: impl Fn(&S, &Lease, Response) -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        self.complete = Box::new(complete);
        self
    }
}

impl<S: Backend> Backend for Faulty<S> {
    fn meter(&self) -> &Meter {
        self.inner.meter()
    }
    fn settings(&self) -> &Settings {
        self.inner.settings()
    }
    fn now(&self) -> Result<Timestamp> {
        self.inner.now()
    }
    fn claim(&self, key: &Key, fp: Fingerprint, id: Option<ClaimId>) -> Result<Claim> {
        (self.claim)(&self.inner, key, fp, id)
    }
    /// Claims again every 10 ms through the injected claim, until the key is not in progress
    /// or `timeout` passes.
    fn claim_wait(&self, key: &Key, fp: Fingerprint, timeout: Duration) -> Result<Claim> {
        let deadline = Instant::now().checked_add(timeout);
        loop {
            let claim = (self.claim)(&self.inner, key, fp, None)?;
            let due = deadline.is_some_and(|deadline| Instant::now() >= deadline);
            if due || !matches!(claim, Claim::InProgress { .. }) {
                return Ok(claim);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    fn cached_replay(&self, _: &Key, _: Fingerprint) -> Option<Replay> {
        None
    }
    fn nonblocking(self: Arc<Self>) -> Option<Arc<dyn AsyncStore>> {
        None
    }
    fn complete(&self, lease: &Lease, response: Response) -> Result<()> {
        (self.complete)(&self.inner, lease, response)
    }
    fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease)
    }
    fn heartbeat(&self, lease: &mut Lease) -> Result<Timestamp> {
        self.inner.heartbeat(lease)
    }
    fn checkpoint(&self, lease: &mut Lease, data: Vec<u8>) -> Result<()> {
        self.inner.checkpoint(lease, data)
    }
    fn read(&self, key: &Key, expired: bool) -> Result<Option<RecordView>> {
        self.inner.read(key, expired)
    }
    fn sweep(&self, limit: usize) -> Result<Swept> {
        self.inner.sweep(limit)
    }
    fn sweep_all_round(&self) -> usize {
        self.inner.sweep_all_round()
    }
    fn verify(&self) -> Result<VerifyReport> {
        self.inner.verify()
    }
    fn stats(&self) -> Result<Stats> {
        self.inner.stats()
    }
    fn records(&self) -> Result<Records<'_>> {
        self.inner.records()
    }
    fn force_release(&self, key: &Key) -> Result<ForceRelease> {
        self.inner.force_release(key)
    }
    fn engine_metrics(&self) -> Option<EngineMetrics> {
        self.inner.engine_metrics()
    }
}
