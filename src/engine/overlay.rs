//! Changes that the log has made durable but redb's tables do not hold yet.
//!
//! A redb commit, even without a sync, copies every page a batch touches, checksums them and
//! writes new roots: after the sync itself, the largest cost of a write batch. So a batch of
//! claims and settlements applies to this overlay instead of to redb: its changes go to the
//! log and, once durable, into the overlay, where readers look first. Once the active
//! generation holds 1024 records (per MiB of log; 16,384 in memory) it is frozen and the
//! store's flush thread (`flush`) writes it into redb in one commit without a sync, while
//! batches fill the next. The whole overlay is written by the writer itself
//! (`Engine::flush_overlay`) before anything that writes redb directly or walks its tables: a
//! merge, a sweep's direct round, a batch of a store with quotas, `complete_with`, `stats`,
//! `verify`, `records`. The log holds everything the overlay does, so a crash loses nothing.
//!
//! Readers look here first and then in redb; writers hold the writer lock, so the overlay only
//! changes under it (the flush thread only reads the frozen generation, and the writer empties
//! it once the thread reports). The shared overlay is split into shards by key, each behind
//! its own read-write locks: a writer adding a batch or emptying the overlay locks one shard at
//! a time, so a reader waits for a writer only when both touch the same shard at once. With
//! one lock, the writer's frequent brief locks parked the readers queued behind it (replays
//! with 16 writing threads fell to 0.65 of the replay-only rate; 0.92 before the overlay).

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::ops::Range;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::engine::effects::Registry;
use crate::error::Result;
use parking_lot::RwLock;

/// A record set (`Some`) or deleted (`None`).
pub(crate) type RecordChange<'a> = (&'a [u8], Option<&'a [u8]>);
/// An index entry `(expires_at, key)` added (true) or removed (false).
pub(crate) type IndexChange<'a> = (u64, &'a [u8], bool);
/// An effect row (see [`effect_key`]) set (`Some`) or removed (`None`).
pub(crate) type EffectChange<'a> = (&'a [u8], Option<&'a [u8]>);

/// Everything a generation (or a batch) holds, as redb must receive it.
#[derive(Debug, Default)]
pub(crate) struct Changes<'a> {
    pub records: Vec<RecordChange<'a>>,
    pub index: Vec<IndexChange<'a>>,
    pub effects: Vec<EffectChange<'a>>,
}

/// The overlay's key of an effect row: the table's position in the registry, then the key.
pub(crate) fn effect_key(table: usize, key: &[u8]) -> Vec<u8> {
    let table = u32::try_from(table).unwrap_or(u32::MAX);
    [&table.to_be_bytes()[..], key].concat()
}

/// Every key and record lives in one byte buffer, with hash-chained entries pointing into it,
/// rather than in an allocation each, and the buffer keeps its capacity: the overlay is filled
/// and emptied thousands of times a second.
#[derive(Debug, Default)]
pub(crate) struct Overlay {
    bytes: Vec<u8>,
    /// Stored key → record bytes (`None`: deleted).
    records: Map,
    /// Expiry-index key (`expires_at`, big-endian, then the stored key) → `Some` if added,
    /// `None` if removed.
    index: Map,
    /// Effect row (`effect_key`) → value bytes (`None`: removed).
    effects: Map,
}

/// A key's hash, keyed per process (so that no one can pick keys that collide), computed once
/// per key and used for its shard and for its entry in either generation: hashing the key
/// for each of them, and the hash again for each map, was a measurable share of an in-memory
/// claim and completion's instructions (BENCHMARKS.md, "Figures behind the defaults").
pub(crate) fn key_hash(key: &[u8]) -> u64 {
    static STATE: OnceLock<RandomState> = OnceLock::new();
    STATE.get_or_init(RandomState::new).hash_one(key)
}

/// Uses a [`key_hash`], already keyed and uniform, as the map's hash as it is.
#[derive(Debug, Default)]
struct Prehashed(u64);

impl Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used (the maps' keys are `u64`); anything else still hashes.
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }
}

#[derive(Debug, Default)]
struct Map {
    /// Key hash → the newest entry with that hash; older ones follow `next`.
    heads: HashMap<u64, usize, BuildHasherDefault<Prehashed>>,
    entries: Vec<Entry>,
}

#[derive(Debug)]
struct Entry {
    key: Range<usize>,
    value: Option<Range<usize>>,
    next: Option<usize>,
    /// The key's [`key_hash`], kept so that absorbing the entry into the shared overlay need
    /// not hash the key again.
    hash: u64,
    /// An index entry whose first change in this overlay was an add: removed again, redb need
    /// not hear of it (see `set`).
    added: bool,
}

impl Overlay {
    /// What the overlay knows of `key`, whose [`key_hash`] is `hash`: `None` if nothing (look
    /// in redb), `Some(None)` if the record was deleted.
    pub(crate) fn record_hashed(&self, key: &[u8], hash: u64) -> Option<Option<&[u8]>> {
        let i = self.position(&self.records, key, hash)?;
        Some(
            self.records.entries[i]
                .value
                .clone()
                .map(|v| &self.bytes[v]),
        )
    }

    /// What the overlay knows of the effect row `at` (see [`effect_key`]), as `record`.
    pub(crate) fn effect(&self, at: &[u8]) -> Option<Option<&[u8]>> {
        self.effect_hashed(at, key_hash(at))
    }

    /// `effect`, for a row whose [`key_hash`] is `hash`.
    fn effect_hashed(&self, at: &[u8], hash: u64) -> Option<Option<&[u8]>> {
        let i = self.position(&self.effects, at, hash)?;
        Some(
            self.effects.entries[i]
                .value
                .clone()
                .map(|v| &self.bytes[v]),
        )
    }

    /// How many records and effect rows it holds.
    pub(crate) fn len(&self) -> usize {
        self.records.entries.len() + self.effects.entries.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.records.entries.is_empty()
            && self.index.entries.is_empty()
            && self.effects.entries.is_empty()
    }

    fn has_effects(&self) -> bool {
        !self.effects.entries.is_empty()
    }

    /// The bytes of keys and records it holds.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.len()
    }

    #[cfg(test)]
    pub(crate) fn set_record(&mut self, key: &[u8], record: Option<&[u8]>) {
        self.set_record_hashed(key, key_hash(key), record);
    }

    /// Sets (or with `None` deletes) the record of `key`, whose [`key_hash`] is `hash`.
    pub(crate) fn set_record_hashed(&mut self, key: &[u8], hash: u64, record: Option<&[u8]>) {
        let value = record.map(|r| self.append(r));
        self.set(Which::Records, key, hash, value);
    }

    pub(crate) fn set_index(&mut self, expires_at: u64, key: &[u8], present: bool) {
        let indexed = [&expires_at.to_be_bytes()[..], key].concat();
        let hash = key_hash(&indexed);
        self.set(Which::Index, &indexed, hash, present.then_some(0..0));
    }

    /// Sets (or with `None` removes) the effect row `at` (see [`effect_key`]).
    pub(crate) fn set_effect(&mut self, at: &[u8], value: Option<&[u8]>) {
        self.set_effect_hashed(at, key_hash(at), value);
    }

    fn set_effect_hashed(&mut self, at: &[u8], hash: u64, value: Option<&[u8]>) {
        let value = value.map(|v| self.append(v));
        self.set(Which::Effects, at, hash, value);
    }

    /// Every change it holds, in no order.
    pub(crate) fn changes(&self) -> Changes<'_> {
        let mut changes = Changes::default();
        self.add_changes(&mut changes);
        changes
    }

    fn add_changes<'a>(&'a self, changes: &mut Changes<'a>) {
        changes.records.extend(self.pairs(&self.records));
        changes
            .index
            .extend(self.pairs(&self.index).filter_map(|(indexed, present)| {
                let (expires_at, key) = indexed.split_first_chunk::<8>()?;
                Some((u64::from_be_bytes(*expires_at), key, present.is_some()))
            }));
        changes.effects.extend(self.pairs(&self.effects));
    }

    /// Empties it, keeping the capacity of an ordinary generation but giving back that of a
    /// burst (large responses, or a flush thread that fell behind): 16 shards x 2 generations
    /// would otherwise each keep their largest size forever.
    pub(crate) fn clear(&mut self) {
        self.bytes.clear();
        self.bytes.shrink_to(KEEP_BYTES);
        for map in [&mut self.records, &mut self.index, &mut self.effects] {
            map.heads.clear();
            map.entries.clear();
            map.heads.shrink_to(KEEP_ENTRIES);
            map.entries.shrink_to(KEEP_ENTRIES);
        }
    }

    fn append(&mut self, data: &[u8]) -> Range<usize> {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(data);
        start..self.bytes.len()
    }

    /// The entry of `key` (whose hash is `hash`) in `map`.
    fn position(&self, map: &Map, key: &[u8], hash: u64) -> Option<usize> {
        let mut at = map.heads.get(&hash).copied();
        while let Some(i) = at {
            let entry = map.entries.get(i)?;
            if self.bytes[entry.key.clone()] == *key {
                return Some(i);
            }
            at = entry.next;
        }
        None
    }

    fn set(&mut self, which: Which, key: &[u8], hash: u64, value: Option<Range<usize>>) {
        if let Some(i) = self.position(self.map(which), key, hash) {
            self.map_mut(which).entries[i].value = value;
            return;
        }
        // A completion removes the entry its claim added, mostly in the same generation: removing
        // it from redb cost a lookup in the records and one in the index per pair (BENCHMARKS.md,
        // "Figures behind the defaults"). An entry is added only when its record's expiry changes
        // to it, so one whose first change here is an add was in no older layer for this key (redb
        // may hold it for another key with the same hash, which keeps it); removed again, it is
        // left out (see `pairs`). An entry first removed here must reach redb, whatever follows.
        let added = matches!(which, Which::Index) && value.is_some();
        let key = self.append(key);
        let map = self.map_mut(which);
        let next = map.heads.insert(hash, map.entries.len());
        map.entries.push(Entry {
            key,
            value,
            next,
            hash,
            added,
        });
    }

    fn map(&self, which: Which) -> &Map {
        match which {
            Which::Records => &self.records,
            Which::Index => &self.index,
            Which::Effects => &self.effects,
        }
    }

    fn map_mut(&mut self, which: Which) -> &mut Map {
        match which {
            Which::Records => &mut self.records,
            Which::Index => &mut self.index,
            Which::Effects => &mut self.effects,
        }
    }

    /// Each key once, with its value; not the index entries redb need not hear of (added and
    /// removed again, see `Entry::added`).
    fn pairs<'a>(&'a self, map: &'a Map) -> impl Iterator<Item = (&'a [u8], Option<&'a [u8]>)> {
        let void = |entry: &&Entry| entry.added && entry.value.is_none();
        map.entries.iter().filter(move |e| !void(e)).map(|entry| {
            (
                &self.bytes[entry.key.clone()],
                entry.value.clone().map(|v| &self.bytes[v]),
            )
        })
    }
}

/// The overlay readers share: `Overlay`s by key hash, each shard in two generations. The
/// writer adds batches to the active one; a full active generation is frozen (the shard's two
/// swap) and written into redb by the store's flush thread while the next fills, then emptied.
#[derive(Debug)]
pub(crate) struct Shared {
    shards: Box<[Shard]>,
    /// The active generation's records and bytes, so that a batch learns whether it is full without
    /// taking every shard's lock (two rounds of 16 contended read locks per batch showed in an
    /// in-memory POST's profile: BENCHMARKS.md, "Figures behind the defaults"). Changed, like the
    /// active generation, only under the writer lock.
    active_len: AtomicUsize,
    active_bytes: AtomicUsize,
    /// The earliest expiry among the index entries each generation added (`u64::MAX`: none),
    /// so that a sweep learns whether the overlay holds records that expired without walking
    /// it (see `engine::sweep`).
    active_first_expiry: AtomicU64,
    frozen_first_expiry: AtomicU64,
    /// The effect tables, whose positions the effect rows' keys start with.
    registry: std::sync::Arc<Registry>,
}

#[derive(Debug, Default)]
struct Shard {
    active: RwLock<Overlay>,
    /// Locked after `active` when both are: a reader holding `active` sees a key either there
    /// or here, never in neither while a generation is frozen.
    frozen: RwLock<Overlay>,
}

const SHARDS: usize = 16;
/// The capacity a cleared generation of a shard keeps: its share of an ordinary generation
/// (1024 records of a few hundred bytes, over 16 shards) with room to spare. The larger
/// generations of a larger log or of a store in memory (up to 16,384 records) grow their
/// shards again after each clear: a few reallocations a shard per generation, which keeps
/// a burst's memory from staying with the overlay.
const KEEP_BYTES: usize = 64 << 10;
const KEEP_ENTRIES: usize = 256;

impl Default for Shared {
    fn default() -> Self {
        Shared::new(std::sync::Arc::default())
    }
}

impl Shared {
    pub(crate) fn new(registry: std::sync::Arc<Registry>) -> Self {
        Shared {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            active_len: AtomicUsize::new(0),
            active_bytes: AtomicUsize::new(0),
            active_first_expiry: AtomicU64::new(u64::MAX),
            frozen_first_expiry: AtomicU64::new(u64::MAX),
            registry,
        }
    }

    pub(crate) fn registry(&self) -> &Registry {
        &self.registry
    }

    /// `read` of what the overlay knows of `key` (the record's bytes, or `None` if it was
    /// deleted), under the shard's read locks; `None` if it knows nothing (look in redb).
    pub(crate) fn with_record<T>(
        &self,
        key: &[u8],
        read: impl FnOnce(Option<&[u8]>) -> T,
    ) -> Option<T> {
        self.with_record_hashed(key, key_hash(key), read)
    }

    /// `with_record`, for a key whose [`key_hash`] is `hash`.
    pub(crate) fn with_record_hashed<T>(
        &self,
        key: &[u8],
        hash: u64,
        read: impl FnOnce(Option<&[u8]>) -> T,
    ) -> Option<T> {
        let shard = self.shard(hash);
        let active = shard.active.read();
        if let Some(known) = active.record_hashed(key, hash) {
            return Some(read(known));
        }
        shard.frozen.read().record_hashed(key, hash).map(read)
    }

    /// `read` of what the overlay knows of the effect row `at`, as [`with_record`](Self::with_record).
    pub(crate) fn with_effect<T>(
        &self,
        at: &[u8],
        read: impl FnOnce(Option<&[u8]>) -> T,
    ) -> Option<T> {
        let hash = key_hash(at);
        let shard = self.shard(hash);
        let active = shard.active.read();
        if let Some(known) = active.effect_hashed(at, hash) {
            return Some(read(known));
        }
        shard.frozen.read().effect_hashed(at, hash).map(read)
    }

    /// Whether either generation holds effect rows (which redb's tables do not have yet).
    pub(crate) fn has_effects(&self) -> bool {
        self.shards
            .iter()
            .any(|s| s.active.read().has_effects() || s.frozen.read().has_effects())
    }

    /// Takes in `batch` (a committed batch's changes), which win over the overlay's own: its
    /// records, then its index entries, then its effect rows, each under the hash the batch
    /// filed it by (an index entry's shard is that of the entry, not of its record's key).
    pub(crate) fn absorb(&self, batch: &Overlay) {
        let (mut len, mut bytes) = (0, 0);
        for which in [Which::Records, Which::Index, Which::Effects] {
            for entry in &batch.map(which).entries {
                let key = &batch.bytes[entry.key.clone()];
                let mut active = self.shard(entry.hash).active.write();
                let before = (active.len(), active.bytes());
                let value = entry
                    .value
                    .as_ref()
                    .map(|v| active.append(&batch.bytes[v.clone()]));
                active.set(which, key, entry.hash, value);
                len += active.len().saturating_sub(before.0);
                bytes += active.bytes().saturating_sub(before.1);
                if let (Which::Index, Some(_), Some(at)) = (which, &entry.value, key.first_chunk())
                {
                    let expires_at = u64::from_be_bytes(*at);
                    self.active_first_expiry
                        .fetch_min(expires_at, Ordering::Relaxed);
                }
            }
        }
        self.active_len.fetch_add(len, Ordering::Relaxed);
        self.active_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    /// How many records the active generation holds.
    pub(crate) fn len(&self) -> usize {
        self.active_len.load(Ordering::Relaxed)
    }

    /// The bytes of keys and records the active generation holds.
    pub(crate) fn bytes(&self) -> usize {
        self.active_bytes.load(Ordering::Relaxed)
    }

    fn active_emptied(&self) {
        self.active_len.store(0, Ordering::Relaxed);
        self.active_bytes.store(0, Ordering::Relaxed);
        self.active_first_expiry.store(u64::MAX, Ordering::Relaxed);
    }

    /// The earliest expiry of an index entry either generation added (`u64::MAX`: none); one
    /// removed again may still count.
    pub(crate) fn first_expiry(&self) -> u64 {
        self.active_first_expiry
            .load(Ordering::Relaxed)
            .min(self.frozen_first_expiry.load(Ordering::Relaxed))
    }

    /// How many records, and bytes, both generations hold.
    pub(crate) fn size(&self) -> (u64, u64) {
        let mut size = (0, 0);
        for shard in &self.shards {
            for generation in [&shard.active, &shard.frozen] {
                let generation = generation.read();
                size.0 += u64::try_from(generation.len()).unwrap_or(u64::MAX);
                size.1 += u64::try_from(generation.bytes.len()).unwrap_or(u64::MAX);
            }
        }
        size
    }

    /// Makes the active generation the frozen one, which must be empty.
    pub(crate) fn freeze(&self) {
        for shard in &self.shards {
            let mut active = shard.active.write();
            let mut frozen = shard.frozen.write();
            debug_assert!(frozen.is_empty(), "froze over a generation not yet written");
            std::mem::swap(&mut *active, &mut *frozen);
        }
        let first = self.active_first_expiry.load(Ordering::Relaxed);
        self.frozen_first_expiry.store(first, Ordering::Relaxed);
        self.active_emptied();
    }

    /// Runs `write` with every change of the frozen generation, then of the active one if
    /// `active` (newer changes come later).
    pub(crate) fn with_changes<T>(
        &self,
        active: bool,
        mut write: impl FnMut(&mut Changes<'_>) -> Result<T>,
    ) -> Result<T> {
        let frozen: Vec<_> = self.shards.iter().map(|s| s.frozen.read()).collect();
        let mut written = write_changes(&frozen, &mut write)?;
        if active {
            let shards: Vec<_> = self.shards.iter().map(|s| s.active.read()).collect();
            written = write_changes(&shards, &mut write)?;
        }
        Ok(written)
    }

    /// Whether both generations are empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.shards
            .iter()
            .all(|s| s.active.read().is_empty() && s.frozen.read().is_empty())
    }

    pub(crate) fn frozen_is_empty(&self) -> bool {
        self.shards.iter().all(|s| s.frozen.read().is_empty())
    }

    /// Empties the frozen generation, once redb holds it; and the active one too if `active`.
    pub(crate) fn clear(&self, active: bool) {
        for shard in &self.shards {
            if active {
                shard.active.write().clear();
            }
            shard.frozen.write().clear();
        }
        self.frozen_first_expiry.store(u64::MAX, Ordering::Relaxed);
        if active {
            self.active_emptied();
        }
    }

    /// The shard of the key whose [`key_hash`] is `hash`, by bits that the maps' tables use
    /// for nothing (they index by the low bits and tag by the top seven), so that a shard's keys
    /// share none of those.
    fn shard(&self, hash: u64) -> &Shard {
        let at = (hash >> 32) % SHARDS as u64;
        &self.shards[at as usize]
    }
}

fn write_changes<T, G: std::ops::Deref<Target = Overlay>>(
    shards: &[G],
    write: &mut impl FnMut(&mut Changes<'_>) -> Result<T>,
) -> Result<T> {
    let mut changes = Changes::default();
    for shard in shards {
        shard.add_changes(&mut changes);
    }
    write(&mut changes)
}

#[derive(Debug, Clone, Copy)]
enum Which {
    Records,
    Index,
    Effects,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_changes_win_and_deletions_are_remembered() {
        let overlay = Shared::default();
        let mut first = Overlay::default();
        first.set_record(b"a", Some(b"1"));
        first.set_record(b"b", Some(b"2"));
        first.set_index(7, b"a", true);
        overlay.absorb(&first);
        let mut batch = Overlay::default();
        batch.set_record(b"a", None);
        batch.set_record(b"b", Some(b"3"));
        batch.set_index(7, b"a", false);
        batch.set_index(9, b"b", true);
        overlay.absorb(&batch);
        let read = |key: &[u8]| overlay.with_record(key, |r| r.map(<[u8]>::to_vec));
        assert_eq!(read(b"a"), Some(None));
        assert_eq!(read(b"b"), Some(Some(b"3".to_vec())));
        assert_eq!(read(b"c"), None);
        assert_eq!(overlay.len(), 2);
        let mut records = Vec::new();
        overlay
            .with_changes(true, |changes| {
                records.extend(
                    changes
                        .records
                        .iter()
                        .map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec))),
                );
                Ok(())
            })
            .expect("changes");
        records.sort();
        assert_eq!(
            records,
            [(b"a".to_vec(), None), (b"b".to_vec(), Some(b"3".to_vec()))]
        );
        // The entry the first batch added and the second removed never reaches redb.
        assert_eq!(index_changes(&overlay, true), [(9, b"b".to_vec(), true)]);
        overlay.clear(true);
        assert!(overlay.is_empty());
    }

    /// The index changes of `overlay`'s generations (active too with `all`), sorted.
    fn index_changes(overlay: &Shared, all: bool) -> Vec<(u64, Vec<u8>, bool)> {
        let mut index = Vec::new();
        overlay
            .with_changes(all, |changes| {
                index.extend(
                    changes
                        .index
                        .iter()
                        .map(|(at, k, present)| (*at, k.to_vec(), *present)),
                );
                Ok(())
            })
            .expect("changes");
        index.sort_unstable();
        index
    }

    #[test]
    fn only_entries_a_generation_did_not_add_are_removed_from_redb() {
        let overlay = Shared::default();
        let mut batch = Overlay::default();
        // Added and removed within one batch: the generation takes the removal as it is.
        batch.set_index(1, b"a", true);
        batch.set_index(1, b"a", false);
        // Added by one batch, removed by the next: nothing for redb.
        batch.set_index(2, b"b", true);
        // Removed without being added here: redb may hold it, so it stays removed after an
        // add and another removal.
        batch.set_index(3, b"c", false);
        batch.set_index(3, b"c", true);
        batch.set_index(3, b"c", false);
        // Added, removed, added again: added.
        batch.set_index(4, b"d", true);
        batch.set_index(4, b"d", false);
        batch.set_index(4, b"d", true);
        overlay.absorb(&batch);
        let mut next = Overlay::default();
        next.set_index(2, b"b", false);
        next.set_index(1, b"a", false);
        overlay.absorb(&next);
        assert_eq!(
            index_changes(&overlay, true),
            [
                (1, b"a".to_vec(), false),
                (3, b"c".to_vec(), false),
                (4, b"d".to_vec(), true)
            ],
            "a removal after an entry added and removed within a batch is a plain removal"
        );
        // An entry the frozen generation adds, the active one removes: redb hears of both.
        overlay.clear(true);
        let mut claim = Overlay::default();
        claim.set_index(5, b"e", true);
        overlay.absorb(&claim);
        overlay.freeze();
        let mut done = Overlay::default();
        done.set_index(5, b"e", false);
        overlay.absorb(&done);
        assert_eq!(index_changes(&overlay, false), [(5, b"e".to_vec(), true)]);
        assert_eq!(
            index_changes(&overlay, true),
            [(5, b"e".to_vec(), false), (5, b"e".to_vec(), true)]
        );
    }

    #[test]
    fn the_active_generations_size_is_what_its_shards_hold() {
        let overlay = Shared::default();
        let counted = |overlay: &Shared| {
            let shards = overlay.shards.iter().map(|s| s.active.read());
            shards.fold((0, 0), |(l, b), a| (l + a.len(), b + a.bytes()))
        };
        for round in 0..3u8 {
            let mut batch = Overlay::default();
            for i in 0..40u8 {
                batch.set_record(&[round, i], Some(&[i; 9]));
                batch.set_record(&[0, i], (i % 3 != 0).then_some(&b"again"[..]));
                batch.set_index(u64::from(i), &[round, i], true);
            }
            overlay.absorb(&batch);
            assert_eq!((overlay.len(), overlay.bytes()), counted(&overlay));
        }
        assert_ne!(overlay.len(), 0);
        overlay.freeze();
        assert_eq!((overlay.len(), overlay.bytes()), (0, 0));
        let mut batch = Overlay::default();
        batch.set_record(b"x", Some(b"1"));
        overlay.absorb(&batch);
        assert_eq!((overlay.len(), overlay.bytes()), counted(&overlay));
        overlay.clear(true);
        assert_eq!((overlay.len(), overlay.bytes()), (0, 0));
    }

    #[test]
    fn a_frozen_generation_stays_readable_until_cleared_and_newer_changes_win() {
        let overlay = Shared::default();
        let mut first = Overlay::default();
        first.set_record(b"a", Some(b"1"));
        first.set_record(b"b", Some(b"2"));
        overlay.absorb(&first);
        overlay.freeze();
        assert_eq!(overlay.len(), 0, "the active generation starts empty");
        let mut second = Overlay::default();
        second.set_record(b"b", None);
        overlay.absorb(&second);
        let read = |key: &[u8]| overlay.with_record(key, |r| r.map(<[u8]>::to_vec));
        assert_eq!(
            read(b"a"),
            Some(Some(b"1".to_vec())),
            "read from the frozen one"
        );
        assert_eq!(read(b"b"), Some(None), "the active deletion wins");
        let mut written = Vec::new();
        overlay
            .with_changes(false, |changes| {
                written.extend(
                    changes
                        .records
                        .iter()
                        .map(|(k, v)| (k.to_vec(), v.map(<[u8]>::to_vec))),
                );
                Ok(())
            })
            .expect("changes");
        written.sort();
        assert_eq!(
            written,
            [
                (b"a".to_vec(), Some(b"1".to_vec())),
                (b"b".to_vec(), Some(b"2".to_vec()))
            ],
            "the flush thread writes the frozen generation only"
        );
        overlay.clear(false);
        assert!(overlay.frozen_is_empty());
        assert_eq!(read(b"a"), None, "once cleared, redb answers");
        assert_eq!(read(b"b"), Some(None));
    }
}

#[cfg(test)]
mod capacity_tests {
    use super::*;

    #[test]
    fn a_cleared_generation_gives_back_a_burst() {
        let mut overlay = Overlay::default();
        for i in 0..1000u32 {
            overlay.set_record(&i.to_le_bytes(), Some(&[7; 4096]));
        }
        assert!(overlay.bytes.capacity() >= 4 << 20);
        overlay.clear();
        assert!(overlay.is_empty());
        assert!(
            overlay.bytes.capacity() <= KEEP_BYTES,
            "{}",
            overlay.bytes.capacity()
        );
        assert!(overlay.records.entries.capacity() <= KEEP_ENTRIES);
        assert!(overlay.records.heads.capacity() <= 2 * KEEP_ENTRIES);
    }
}
