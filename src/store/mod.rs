//! The store: opening, the claim/settle calls, lookups and maintenance.

pub(crate) mod admin;
mod backend;
pub(crate) mod builder;
mod effects;
#[cfg(feature = "__test-hooks")]
pub(crate) mod hooks;
#[cfg(test)]
mod log_faults;
#[cfg(test)]
mod log_halves;
pub(crate) mod maintenance;
pub(crate) mod metrics;
pub(crate) mod nonblocking;
mod replay_cache;
pub(crate) mod sweep;
pub(crate) mod wait;

use std::path::PathBuf;

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::metrics::Meter;
use crate::api::outcome::{Claim, ClaimId, Lease};
use crate::api::record::{Record, Verdict, verdict};
use crate::api::response::Response;
use crate::api::series;
use crate::api::settings::WhenFull;
#[cfg(doc)]
use crate::api::store::IdempotencyStore;
use crate::api::store::counted_claim;
use crate::engine::handle::Engine;
use crate::engine::ops::{ClaimKey, Complete, Release};
#[cfg(doc)]
use crate::error::Error;
use crate::error::Result;
use crate::store::builder::StoreBuilder;
use crate::store::metrics::SweeperState;
use crate::store::wait::Waiters;

/// A durable idempotency-key store in one file (a write-ahead log and a redb database).
///
/// `Store` is `Send + Sync`: share one per file (for example in an `Arc`) across all request
/// threads. Reads ([`lookup`](crate::IdempotencyStore::lookup), and claims that only replay or reject) run in
/// read transactions beside the writer. Write calls from many threads share commits (group
/// commit) and each returns only after the commit holding its write is durable.
pub struct Store {
    engine: Engine,
    config: StoreBuilder,
    path: Option<PathBuf>,
    waiters: Waiters,
    pub(crate) meter: Meter,
    pub(crate) sweeper: SweeperState,
    replays: replay_cache::ReplayCache,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("path", &self.path)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Store {
    /// Opens (or creates) the store file at `path` with default settings.
    ///
    /// # Errors
    /// As for [`StoreBuilder::open`].
    pub fn open(path: impl AsRef<std::path::Path>) -> Result<Store> {
        StoreBuilder::new().open(path)
    }

    /// A builder for a store with custom settings.
    #[must_use]
    pub fn builder() -> StoreBuilder {
        StoreBuilder::new()
    }

    pub(crate) fn new(engine: Engine, config: StoreBuilder, path: Option<PathBuf>) -> Store {
        let show_keys = config.settings.trace_keys;
        let evicts = config.settings.when_full == WhenFull::EvictOldestCompleted;
        let replays = replay_cache::ReplayCache::new(if evicts { 0 } else { config.replay_cache });
        Store {
            replays,
            engine,
            config,
            path,
            waiters: Waiters::default(),
            meter: Meter::new(&series::REDB, show_keys),
            sweeper: SweeperState::default(),
        }
    }

    /// Closes the store: a last merge of the log into the database, so that the next open
    /// has no log to replay, then the flush thread and the file are closed. Dropping the
    /// store does the same but cannot report a failure; call `close` where a failed final
    /// merge matters (it does not for durability: every acknowledged write is already in the
    /// log, which the next open replays).
    ///
    /// # Errors
    /// [`Error::Poisoned`] if the store was poisoned (nothing is written then; the next open
    /// recovers from the durable state); [`Error::Storage`] or [`Error::Corrupted`] if the
    /// final merge or closing the file failed.
    pub fn close(mut self) -> Result<()> {
        self.engine.close()
    }

    /// Like [`claim_with_id`](IdempotencyStore::claim_with_id), and a fresh record starts with
    /// `seed` as its recovery point, in the claim's own commit: as if
    /// [`checkpoint`](IdempotencyStore::checkpoint) had been called at once, without a second
    /// durable write. A recovered or taken-over
    /// lease carries the record's own checkpoint instead (`seed` is then unused). The
    /// outbound-key client (feature `client`) stores a new intent's key this way.
    ///
    /// ```
    /// use idempotency_store::{Claim, ClaimId, Fingerprint, Key, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let (key, fp, id) = (Key::new("job-1")?, Fingerprint::of(["job"]), ClaimId::new(7));
    /// let Claim::Acquired(lease) = store.claim_seeded(&key, fp, id, b"plan A".to_vec())? else { unreachable!() };
    /// assert_eq!(lease.checkpoint(), Some(&b"plan A"[..]));
    /// let Claim::Acquired(again) = store.claim_seeded(&key, fp, id, b"plan B".to_vec())? else { unreachable!() };
    /// assert_eq!(again.checkpoint(), Some(&b"plan A"[..])); // the record's, not the new seed
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// As for [`claim`](IdempotencyStore::claim); [`Error::ResponseTooLarge`] if `seed` is
    /// larger than `max_response_bytes` (nothing written).
    pub fn claim_seeded(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        id: ClaimId,
        seed: Vec<u8>,
    ) -> Result<Claim> {
        self.check_size(seed.len())?;
        counted_claim(self, || {
            self.claim_as(key, fingerprint, Some(id), Some(seed))
        })
    }

    /// A claim, uncounted: with `id`, recoverable; with `seed`, a fresh record's first
    /// recovery point.
    fn claim_as(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        id: Option<ClaimId>,
        seed: Option<Vec<u8>>,
    ) -> Result<Claim> {
        match self.claim_read(key, fingerprint, id, seed)? {
            Claiming::Answer(answer) => Ok(answer),
            Claiming::Write(write) => self.engine.write(write).map(|c| self.live(c)),
        }
    }

    /// A claim's answer from the record, where it needs no write, or the write that decides it.
    fn claim_read(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        id: Option<ClaimId>,
        seed: Option<Vec<u8>>,
    ) -> Result<Claiming> {
        self.check_key(key)?;
        let now = self.engine.now();
        // A completed record does not change until it expires: no read transaction, page
        // cache or decode for a key replayed before (see `replay_cache`).
        if let Some(replay) = self.replays.get(key, fingerprint, now) {
            return Ok(Claiming::Answer(Claim::Completed(replay)));
        }
        let (record, absent_at) = self.engine.read_found(key)?;
        if let Verdict::Answer(answer) = verdict(key, record, fingerprint, id, now) {
            if let Claim::Completed(replay) = &answer {
                self.replays.insert(key, fingerprint, replay);
            }
            return Ok(Claiming::Answer(answer));
        }
        Ok(Claiming::Write(ClaimKey {
            key: key.clone(),
            fingerprint,
            id,
            seed,
            absent_at,
        }))
    }

    /// A claim's written answer: the batch stamped the lease when it started, and a batch that
    /// outlasted the lease must not hand it out.
    fn live(&self, claim: Claim) -> Claim {
        claim.unless_lapsed(self.engine.now())
    }

    /// The write of `complete`.
    fn complete_write(&self, lease: &Lease, response: Response) -> Result<Complete> {
        self.check_size(response.size())?;
        Ok(Complete::of(lease, response, lease.in_doubt.get()))
    }

    /// After a settling call (`complete`, `release`): a lease whose call failed with its
    /// outcome unknown is in doubt, and a settled key's waiters wake.
    fn settled(&self, lease: &Lease, done: Result<()>) -> Result<()> {
        lease.in_doubt.after(&done);
        done?;
        self.waiters.wake(&lease.key);
        Ok(())
    }

    /// The file behind the store, if it has one.
    #[must_use]
    pub fn path(&self) -> Option<&std::path::Path> {
        self.path.as_deref()
    }

    fn check_key(&self, key: &Key) -> Result<()> {
        self.config.settings.check_key(key)
    }

    fn check_size(&self, size: usize) -> Result<()> {
        self.config.settings.check_size(size)
    }

    /// The key's record, expired or not.
    fn stored(&self, key: &Key) -> Result<Option<Record>> {
        self.engine.read(key)
    }
}

/// A claim's answer without a write, or its write.
enum Claiming {
    Answer(Claim),
    Write(ClaimKey),
}

/// The write of `release`.
fn release_write(lease: &Lease) -> Release {
    Release {
        key: lease.key.clone(),
        token: lease.token,
        retry: lease.in_doubt.get(),
    }
}
