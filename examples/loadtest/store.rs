//! This store as a system under test (with and without group commit, on a transaction of its own
//! for payments).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use idempotency_store::redb;
use idempotency_store::{Claim, IdempotencyStore, Key, Recovery, Response, Store};

use crate::systems::{Client, Fresh, ReplaySet, System, fresh_for};
use crate::tools::{Out, Rng, body, err, fingerprint_of};
use crate::{AMOUNT, BODY_LEN, CUSTOMER, LEDGER, Res};

pub(crate) struct StoreSys {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    /// The same store as a redb `Store`, for payments (`None` on PostgreSQL).
    pub(crate) redb: Option<Arc<Store>>,
    /// Payments through `complete_with` (a commit of its own) instead of the batch's effects.
    pub(crate) slow_effects: bool,
    pub(crate) set: Arc<ReplaySet>,
    pub(crate) cell: u64,
    pub(crate) body: Vec<u8>,
}

pub(crate) struct StoreClient<'a> {
    pub(crate) sys: &'a StoreSys,
    pub(crate) fresh: Fresh,
    pub(crate) rng: Rng,
}

impl System for StoreSys {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        Ok(Box::new(StoreClient {
            sys: self,
            fresh: fresh_for(thread, self.cell),
            rng: Rng::new(thread as u64 ^ (self.cell << 32)),
        }))
    }
}

impl Client for StoreClient<'_> {
    fn pair(&mut self) -> Res<()> {
        let name = self.fresh.next();
        let key = Key::new(&name).map_err(|e| err("key", e))?;
        let store = &self.sys.store;
        match store.claim(&key, fingerprint_of(&name)) {
            Ok(Claim::Acquired(lease)) => store
                .complete(&lease, Response::new(200, self.sys.body.clone()))
                .map_err(|e| err("complete", e)),
            Ok(other) => Err(format!("fresh key {name} not acquired: {other:?}")),
            Err(e) => Err(err("claim", e)),
        }
    }

    fn replay(&mut self) -> Res<()> {
        let set = &self.sys.set;
        let i = self.rng.below(set.keys.len());
        match self.sys.store.claim(&set.keys[i], set.fps[i]) {
            Ok(Claim::Completed(replay)) if replay.response.body.len() == BODY_LEN => Ok(()),
            Ok(other) => Err(format!("key {} did not replay: {other:?}", set.names[i])),
            Err(e) => Err(err("replay claim", e)),
        }
    }

    fn payment(&mut self) -> Res<()> {
        let store = self
            .sys
            .redb
            .as_ref()
            .ok_or("payments run on the redb store only")?;
        let name = self.fresh.next();
        let key = Key::new(&name).map_err(|e| err("key", e))?;
        let lease = match store.claim(&key, fingerprint_of(&name)) {
            Ok(Claim::Acquired(lease)) => lease,
            Ok(other) => return Err(format!("fresh key {name} not acquired: {other:?}")),
            Err(e) => return Err(err("claim", e)),
        };
        let response = Response::new(201, self.sys.body.clone());
        if self.sys.slow_effects {
            let written = store.complete_with(&lease, response, |txn| {
                txn.open_table(LEDGER)?
                    .insert(name.as_str(), (AMOUNT, CUSTOMER))?;
                Ok::<_, redb::Error>(())
            });
            return written
                .map_err(|e| err("complete_with", e))?
                .map_err(|e| err("ledger row", e));
        }
        store
            .complete_with_effects(&lease, response, move |fx| {
                fx.insert(LEDGER, name.as_str(), (AMOUNT, CUSTOMER))
            })
            .map_err(|e| err("complete_with_effects", e))?
            .map_err(|e| err("ledger row", e))
    }
}

pub(crate) fn open_store(
    dir: &Path,
    nogc: bool,
    durability: Recovery,
    log_size: Option<u64>,
) -> Res<Store> {
    let mut builder = Store::builder();
    builder.recovery(durability).effect_table(LEDGER);
    if nogc {
        builder.max_batch(1);
    }
    if let Some(bytes) = log_size {
        builder.log_size(bytes);
    }
    builder
        .open(dir.join("store.redb"))
        .map_err(|e| err("opening the store", e))
}

/// Completes `n` records (claim + complete, 200-byte body) from `threads` threads so that group
/// commit makes the batches big. `name(i)` names record `i`.
pub(crate) fn prefill_store(
    store: &dyn IdempotencyStore,
    n: u64,
    threads: usize,
    name: &(dyn Fn(u64) -> String + Sync),
    out: &Out,
) -> Res<Duration> {
    let next = AtomicU64::new(0);
    let failed = Mutex::new(None::<String>);
    let body = body();
    let started = Instant::now();
    let step = (n / 10).max(1);
    thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n || failed.lock().is_ok_and(|f| f.is_some()) {
                        return;
                    }
                    let name = name(i);
                    let result = Key::new(&name).map_err(|e| err("key", e)).and_then(|key| {
                        match store.claim(&key, fingerprint_of(&name)) {
                            Ok(Claim::Acquired(lease)) => store
                                .complete(&lease, Response::new(200, body.clone()))
                                .map_err(|e| err("prefill complete", e)),
                            Ok(other) => Err(format!("prefill key not acquired: {other:?}")),
                            Err(e) => Err(err("prefill claim", e)),
                        }
                    });
                    if let Err(e) = result {
                        if let Ok(mut f) = failed.lock() {
                            f.get_or_insert(e);
                        }
                        return;
                    }
                    if (i + 1).is_multiple_of(step) {
                        out.note(format!(
                            "prefill {}/{n} after {:.1} s",
                            i + 1,
                            started.elapsed().as_secs_f64()
                        ));
                    }
                }
            });
        }
    });
    match failed.into_inner().ok().flatten() {
        Some(e) => Err(e),
        None => Ok(started.elapsed()),
    }
}
