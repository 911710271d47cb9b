//! Replays answered from memory, so that the tower layer can answer a retry of a completed
//! key on the async thread instead of handing the claim to the blocking pool (a round trip
//! between threads that costs more than the claim itself).
//!
//! Why an entry can be served without reading the record: a completed record never changes
//! and is never deleted before its expiry, except by quota eviction
//! ([`WhenFull::EvictOldestCompleted`](crate::WhenFull::EvictOldestCompleted)), and a store
//! with eviction keeps no cache. `force_release` leaves completed records alone; a sweep
//! deletes only expired ones; an entry is served only while the store's time (which never
//! goes back) is before the record's expiry, exactly the test a claim applies.
//!
//! Filled by claims that replay from the store, and only once the cache has been asked
//! ([`Store::cached_replay`](crate::Store::cached_replay)), so that a store used only through
//! `claim` pays nothing for it. Bounded in bytes; the oldest entries go first.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::Replay;

/// What an entry costs beyond its key and response bytes (map and queue slots, the replay's
/// fields), counted against the capacity.
const ENTRY_OVERHEAD: usize = 160;

/// The completed records recently replayed, by key.
#[derive(Debug)]
pub(crate) struct ReplayCache {
    capacity: usize,
    asked: AtomicBool,
    inner: Mutex<Entries>,
}

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
        ReplayCache {
            capacity,
            asked: AtomicBool::new(false),
            inner: Mutex::new(Entries::default()),
        }
    }

    /// The replay of `key` for `fingerprint` if it is cached and live at `now`; `None` means:
    /// claim.
    pub(crate) fn get(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        now: Timestamp,
    ) -> Option<Replay> {
        if self.capacity == 0 {
            return None;
        }
        // A load first: every layered request asks, and a store to a shared line each time
        // would make the cores contend for it.
        if !self.asked.load(Ordering::Relaxed) {
            self.asked.store(true, Ordering::Relaxed);
        }
        let entries = self.inner.lock();
        let (stored, replay) = entries.by_key.get(key)?;
        (*stored == fingerprint && now < replay.expires_at).then(|| replay.clone())
    }

    /// Keeps the replay a claim of `key` with `fingerprint` just answered.
    pub(crate) fn insert(&self, key: &Key, fingerprint: Fingerprint, replay: &Replay) {
        if self.capacity == 0 || !self.asked.load(Ordering::Relaxed) {
            return;
        }
        let size = cost(key, replay);
        if size > self.capacity {
            return;
        }
        let mut entries = self.inner.lock();
        if let Some((stored, cached)) = entries.by_key.get(key)
            && *stored == fingerprint
            && cached.expires_at == replay.expires_at
        {
            return;
        }
        entries.evict(key);
        while entries.bytes + size > self.capacity {
            let Some(oldest) = entries.order.front().cloned() else {
                break;
            };
            entries.evict(&oldest);
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
        self.inner.lock().by_key.len()
    }
}

impl Entries {
    fn evict(&mut self, key: &Key) {
        if let Some((_, replay)) = self.by_key.remove(key) {
            self.bytes = self.bytes.saturating_sub(cost(key, &replay));
            if let Some(at) = self.order.iter().position(|k| k == key) {
                self.order.remove(at);
            }
        }
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
    fn keeps_nothing_until_asked_nor_when_off() {
        let (fp, at) = (Fingerprint::of(["a"]), Timestamp::from_millis(10));
        let cache = ReplayCache::new(1 << 20);
        cache.insert(&key("k"), fp, &replay("x", 100));
        assert_eq!(cache.len(), 0);
        assert!(cache.get(&key("k"), fp, at).is_none());
        cache.insert(&key("k"), fp, &replay("x", 100));
        assert_eq!(cache.get(&key("k"), fp, at), Some(replay("x", 100)));

        let off = ReplayCache::new(0);
        assert!(off.get(&key("k"), fp, at).is_none());
        off.insert(&key("k"), fp, &replay("x", 100));
        assert_eq!(off.len(), 0);
    }

    #[test]
    fn answers_only_the_same_fingerprint_before_expiry() {
        let fp = Fingerprint::of(["a"]);
        let cache = ReplayCache::new(1 << 20);
        let _ = cache.get(&key("k"), fp, Timestamp::from_millis(0));
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
        let _ = cache.get(&key("k-00"), fp, Timestamp::from_millis(0));
        for i in 0..20 {
            cache.insert(&key(&format!("k-{i:02}")), fp, &replay(&body, 100));
            assert!(cache.inner.lock().bytes <= one * 5);
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
}
