//! Replays answered from memory: a claim of a completed key (and the tower layer's
//! [`IdempotencyStore::cached_replay`](crate::IdempotencyStore::cached_replay), on the async thread) is answered
//! without a read transaction, a page-cache lookup or a record decode.
//!
//! Why an entry can be served without reading the record: a completed record never changes
//! and is never deleted before its expiry, except by quota eviction
//! ([`WhenFull::EvictOldestCompleted`](crate::WhenFull::EvictOldestCompleted)), and a store
//! with eviction keeps no cache. `release` and `force_release` delete in-progress records only;
//! a sweep deletes only expired ones; an entry is served only while the store's time (which
//! never goes back) is before the record's expiry, exactly the test a claim applies. Only
//! visible records are kept, and a visible record is durable (the log holds it).
//!
//! Filled by claims that replay from the store. Bounded in bytes; the oldest entries go first.
//! Split into shards by key, each with its own lock on its own cache line, so that replays of
//! different keys on different cores share no line (one lock for all made the cores queue).

use std::collections::{HashMap, VecDeque};

use parking_lot::Mutex;

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::Replay;

/// What an entry costs beyond its key and response bytes (map and queue slots, the replay's
/// fields), counted against the capacity.
const ENTRY_OVERHEAD: usize = 160;

/// The most shards, and the least capacity a shard gets: a small cache stays one shard, so
/// that its bound still keeps the most recent entries of all keys.
const MAX_SHARDS: usize = 16;
const MIN_SHARD_BYTES: usize = 64 << 10;

/// The completed records recently replayed, by key.
#[derive(Debug)]
pub(crate) struct ReplayCache {
    /// Each shard's byte bound.
    shard_capacity: usize,
    shards: Box<[Shard]>,
}

/// One shard, alone on its cache lines.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(Mutex<Entries>);

#[derive(Debug, Default)]
struct Entries {
    by_key: HashMap<Key, (Fingerprint, Replay)>,
    /// Keys in insertion order, for eviction.
    order: VecDeque<Key>,
    bytes: usize,
}

fn cost(key: &Key, replay: &Replay) -> usize {
    let headers: usize = replay
        .response
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len())
        .sum();
    key.as_stored().len() + replay.response.body.len() + headers + ENTRY_OVERHEAD
}

impl ReplayCache {
    /// A cache of at most `capacity` bytes; 0 keeps nothing.
    pub(crate) fn new(capacity: usize) -> ReplayCache {
        let count = (capacity / MIN_SHARD_BYTES).clamp(1, MAX_SHARDS);
        ReplayCache {
            shard_capacity: capacity / count,
            shards: (0..count).map(|_| Shard::default()).collect(),
        }
    }

    /// The shard that holds `key`. FNV-1a: cheap, and an adversary who crowds one shard only
    /// brings back the single lock; each shard's map hashes with a random key.
    fn shard(&self, key: &Key) -> &Shard {
        let hash = key
            .as_stored()
            .iter()
            .fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| {
                (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
            });
        let count = self.shards.len() as u64;
        let at = usize::try_from(hash % count).unwrap_or(0);
        // `at` < the shard count, which is at least 1.
        &self.shards[at]
    }

    /// The replay of `key` for `fingerprint` if it is cached and live at `now`; `None` means:
    /// claim.
    pub(crate) fn get(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        now: Timestamp,
    ) -> Option<Replay> {
        if self.shard_capacity == 0 {
            return None;
        }
        let entries = self.shard(key).0.lock();
        let (stored, replay) = entries.by_key.get(key)?;
        (*stored == fingerprint && now < replay.expires_at).then(|| replay.clone())
    }

    /// Keeps the replay a claim of `key` with `fingerprint` just answered.
    pub(crate) fn insert(&self, key: &Key, fingerprint: Fingerprint, replay: &Replay) {
        if self.shard_capacity == 0 {
            return;
        }
        let size = cost(key, replay);
        if size > self.shard_capacity {
            return;
        }
        let mut entries = self.shard(key).0.lock();
        if let Some((stored, cached)) = entries.by_key.get(key)
            && *stored == fingerprint
            && cached.expires_at == replay.expires_at
        {
            return;
        }
        entries.evict(key);
        while entries.bytes + size > self.shard_capacity {
            let Some(oldest) = entries.order.pop_front() else {
                break;
            };
            entries.forget(&oldest);
        }
        entries.bytes += size;
        entries.order.push_back(key.clone());
        entries
            .by_key
            .insert(key.clone(), (fingerprint, replay.clone()));
    }

    /// How many replays are cached.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.0.lock().by_key.len()).sum()
    }

    /// How many bytes the cache counts, and its bound.
    #[cfg(test)]
    fn bytes(&self) -> (usize, usize) {
        let used = self.shards.iter().map(|s| s.0.lock().bytes).sum();
        (used, self.shard_capacity * self.shards.len())
    }
}

impl Entries {
    /// Removes `key`'s entry and its place in the eviction order.
    fn evict(&mut self, key: &Key) {
        if self.forget(key)
            && let Some(at) = self.order.iter().position(|k| k == key)
        {
            self.order.remove(at);
        }
    }

    /// Removes `key`'s entry, whose place in the order is gone already; whether there was one.
    fn forget(&mut self, key: &Key) -> bool {
        let Some((_, replay)) = self.by_key.remove(key) else {
            return false;
        };
        self.bytes = self.bytes.saturating_sub(cost(key, &replay));
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::response::Response;

    fn replay(body: &str, expires_at: u64) -> Replay {
        Replay {
            response: Response::new(200, body),
            created_at: Timestamp::from_millis(1),
            completed_at: Timestamp::from_millis(2),
            expires_at: Timestamp::from_millis(expires_at),
            attempt: 1,
        }
    }

    fn key(name: &str) -> Key {
        Key::new(name).expect("key")
    }

    #[test]
    fn keeps_from_the_first_insert_and_nothing_when_off() {
        let (fp, at) = (Fingerprint::of(["a"]), Timestamp::from_millis(10));
        let cache = ReplayCache::new(1 << 20);
        assert!(cache.get(&key("k"), fp, at).is_none());
        cache.insert(&key("k"), fp, &replay("x", 100));
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.get(&key("k"), fp, at), Some(replay("x", 100)));

        let off = ReplayCache::new(0);
        assert!(off.get(&key("k"), fp, at).is_none());
        off.insert(&key("k"), fp, &replay("x", 100));
        assert_eq!(off.len(), 0);
        assert!(off.get(&key("k"), fp, at).is_none());
    }

    #[test]
    fn answers_only_the_same_fingerprint_before_expiry() {
        let fp = Fingerprint::of(["a"]);
        let cache = ReplayCache::new(1 << 20);
        cache.insert(&key("k"), fp, &replay("x", 100));
        let other = Fingerprint::of(["b"]);
        assert!(
            cache
                .get(&key("k"), other, Timestamp::from_millis(10))
                .is_none()
        );
        assert!(
            cache
                .get(&key("k"), fp, Timestamp::from_millis(99))
                .is_some()
        );
        assert!(
            cache
                .get(&key("k"), fp, Timestamp::from_millis(100))
                .is_none()
        );
        // A key completed again after its expiry replaces the old entry.
        cache.insert(&key("k"), fp, &replay("y", 300));
        assert_eq!(cache.len(), 1);
        let got = cache.get(&key("k"), fp, Timestamp::from_millis(200));
        assert_eq!(got.map(|r| r.response.body), Some(b"y".to_vec()));
    }

    #[test]
    fn stays_within_its_bytes_dropping_the_oldest() {
        let fp = Fingerprint::of(["a"]);
        let body = "b".repeat(1000);
        let one = cost(&key("k-00"), &replay(&body, 100));
        let cache = ReplayCache::new(one * 5);
        for i in 0..20 {
            cache.insert(&key(&format!("k-{i:02}")), fp, &replay(&body, 100));
            assert!(cache.bytes().0 <= one * 5);
        }
        assert_eq!(cache.len(), 5);
        let at = Timestamp::from_millis(1);
        assert!(cache.get(&key("k-14"), fp, at).is_none());
        assert!(cache.get(&key("k-15"), fp, at).is_some());
        assert!(cache.get(&key("k-19"), fp, at).is_some());
        // Larger than the whole cache: not kept.
        cache.insert(&key("big"), fp, &replay(&body.repeat(10), 100));
        assert!(cache.get(&key("big"), fp, at).is_none());
    }

    #[test]
    fn a_sharded_cache_stays_within_its_bytes_and_keeps_the_newest_of_each_shard() {
        let fp = Fingerprint::of(["a"]);
        let body = "b".repeat(1000);
        let cache = ReplayCache::new(4 << 20);
        assert_eq!(cache.shards.len(), MAX_SHARDS);
        let (at, keys) = (Timestamp::from_millis(1), 20_000);
        for i in 0..keys {
            cache.insert(&key(&format!("k-{i:05}")), fp, &replay(&body, 100));
        }
        let (used, bound) = cache.bytes();
        assert!(used <= bound && bound <= 4 << 20, "{used} of {bound}");
        let kept = cache.len();
        assert!(kept > keys / 8 && kept < keys, "{kept} kept");
        // The newest entries of every shard survive, the oldest of all are gone.
        assert!((keys - 50..keys).all(|i| cache.get(&key(&format!("k-{i:05}")), fp, at).is_some()));
        assert!((0..50).all(|i| cache.get(&key(&format!("k-{i:05}")), fp, at).is_none()));
    }
}
