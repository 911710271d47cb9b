//! The write-ahead log: how a batch becomes durable with one small sequential write.
//!
//! A durable redb commit rewrites about ten scattered 4 KiB pages and syncs them (see
//! BENCHMARKS.md, "Machine"). Instead, a batch's changes (the record bytes and index entries it
//! wrote, and the token counter and clock it moved) go to the log region as one entry, the
//! entry is made durable, and only then do the changes become visible (in the overlay, or in a
//! redb commit without a sync): readers see a batch only once it is durable. A sweep's
//! deletions of expired records are the one change left out (`Tables::delete_expired`). The
//! log is used as two halves: when the one being written is full, everything logged so far is
//! committed durably to redb (a merge, on the flush thread), which also persists every earlier
//! non-durable commit, while entries go on at the start of the other half.
//!
//! Entries: `[payload length u32][sequence u64][checksum 8 B][payload]`, little-endian, the
//! checksum (blake3, truncated) covering the first 12 bytes and the payload. The metadata
//! table records the last sequence number a merge covers (`META_LOG_SEQ`); the entries
//! after it start at the beginning of one half and may go on at the beginning of the other.
//! Opening replays them: it reads while each entry checks out and carries the next sequence
//! number, and stops at the first that does not (a torn last write, zeros, or an older entry
//! left over from before a merge), and `redo` applies them.

use serde::{Deserialize, Serialize};

use crate::engine::layout::{Region, Storage};
use crate::engine::log_handle::LogHandle;
use crate::engine::meta::Counter;
#[cfg(test)]
use crate::engine::poison::Io;
use crate::engine::poison::Poison;
use crate::error::{Error, Result};

const ENTRY_HEADER: u64 = 20;
/// The largest entry buffer kept between batches: room for a whole batch of responses (at most
/// 4 MiB of them, `commit::BATCH_BYTES`), which an entry a little over 4 MiB grows to 8 MiB of
/// capacity. An entry larger still (one response over 4 MiB) gets a buffer of its own that is
/// then dropped. At 1 MiB, every batch of large responses allocated and freed a buffer of
/// several MiB on whichever thread led it, and glibc's arenas kept them: `tests/store/memory.rs`
/// (64 threads, 1 MiB responses) peaked higher, and more often over its bound, than with
/// 8 MiB (BENCHMARKS.md, "Figures behind the defaults").
const KEEP_BUFFER: usize = 8 << 20;

/// The storage a store was opened on, as its write-ahead log uses it.
pub(crate) struct LogFile {
    pub storage: Storage,
    pub region: Region,
    /// See `log_handle::open_log_writer`; `None` for a custom backend.
    pub log_writer: Option<LogHandle>,
    /// Poisoned by a failed write or sync of `storage` or of the log handle.
    pub poison: std::sync::Arc<Poison>,
}

/// One change a batch made to the tables, with the bytes it wrote: redo decides nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Change {
    Put {
        #[serde(with = "crate::engine::bytes")]
        key: Vec<u8>,
        #[serde(with = "crate::engine::bytes")]
        record: Vec<u8>,
    },
    Delete {
        #[serde(with = "crate::engine::bytes")]
        key: Vec<u8>,
    },
    Index {
        expires_at: u64,
        #[serde(with = "crate::engine::bytes")]
        key: Vec<u8>,
    },
    Unindex {
        expires_at: u64,
        #[serde(with = "crate::engine::bytes")]
        key: Vec<u8>,
    },
    /// The token counter's or the clock's new value (earlier releases also logged the usage
    /// counters, which redo now counts itself).
    Counter { counter: Counter, value: u64 },
    /// A stale expiry-index entry, which has no key to name it by (see `tables`).
    DropEntry { expires_at: u64, hash: u64 },
    /// A row of a caller's effect table (see `effects`), named by the table's name: the
    /// order in which tables are registered may differ at the next open.
    Effect {
        table: String,
        #[serde(with = "crate::engine::bytes")]
        key: Vec<u8>,
        #[serde(with = "crate::engine::bytes::option")]
        value: Option<Vec<u8>>,
    },
}

/// The log's write position. Used only while holding redb's write transaction, which
/// serialises the writers.
#[derive(Debug)]
pub(crate) struct Log {
    storage: Storage,
    /// Writes entries durably by themselves; without it, a write and an `fdatasync`.
    writer: Option<LogHandle>,
    /// Told of a log write that failed in a way that may have lost data.
    poison: std::sync::Arc<Poison>,
    /// A failure to inject into the log handle's writes, for the store's tests.
    #[cfg(test)]
    pub(crate) fault: Option<LogFault>,
    region: Region,
    /// Where the next entry goes, from the start of the log region.
    pos: u64,
    /// The half of the log being written: entries go into one half until it is full, then
    /// into the other (see `switch`).
    half: Half,
    /// Whether a durable commit covers the other half's entries, so it may be overwritten.
    other_free: bool,
    /// The sequence number of the next entry; every number is used once, even by a failed
    /// write, so that an entry of unknown fate can never be mistaken for a later one.
    next_seq: u64,
    /// False after a failed log write or commit: the next batch must merge.
    healthy: bool,
    /// The entry being written; see `encode`.
    buf: Vec<u8>,
}

impl Log {
    /// The last sequence number handed out; a merge covers every entry up to it.
    pub(crate) fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Writes `changes` as the next entry and syncs it; once this returns `Ok(true)`, the
    /// batch is durable. `Ok(false)`: the log cannot take it (its half is full, or a write
    /// failed earlier), so the batch must switch halves (`switch`) or merge instead;
    /// nothing was written.
    ///
    /// `direct`: the batch wrote redb's tables directly (see `Engine::commit`). Its sync is an
    /// `fdatasync` of the file, which also writes out the pages redb's commits without a sync
    /// left behind, and it may run on into the second half while that half holds nothing a
    /// merge has yet to cover: such a batch merges itself when the log is full, and
    /// each merge stalls the writer for several ms, so it gets the whole log between two.
    pub(crate) fn append(&mut self, changes: &[Change], direct: bool) -> Result<bool> {
        self.encode(changes)?;
        let entry = &mut self.buf;
        let whole_log = direct && self.half == Half::First && self.other_free;
        let end = if whole_log {
            self.region.log_len
        } else {
            self.half.end(self.region)
        };
        if !self.healthy || self.pos + entry.len() as u64 > end {
            if entry.capacity() > KEEP_BUFFER {
                self.buf = Vec::new();
            }
            return Ok(false);
        }
        let seq = self.next_seq;
        self.next_seq = next(seq)?;
        seal(entry, seq);
        let offset = self.region.log_start() + self.pos;
        self.pos += entry.len() as u64;
        if self.half == Half::First && self.pos > Half::First.end(self.region) {
            // Into the second half: the first half's entries wait for a merge.
            self.half = Half::Second;
            self.other_free = false;
        }
        #[cfg(test)]
        let injected = LogFault::fire(&mut self.fault);
        #[cfg(not(test))]
        let injected = None;
        let written = match &self.writer {
            Some(file) if !direct => {
                file.write_durably(entry, offset, injected)
                    .map_err(|(during, err)| {
                        self.poison.io_failed(during, "writing the log", &err);
                        err
                    })
            }
            // The storage reports its own failures to the poison (`poison::Guarded`).
            _ => self
                .storage
                .write(offset, entry)
                .and_then(|()| self.storage.sync_data()),
        };
        if self.buf.capacity() > KEEP_BUFFER {
            self.buf = Vec::new();
        }
        match written {
            Ok(()) => Ok(true),
            Err(err) => {
                self.healthy = false;
                Err(Error::storage("writing the log", err))
            }
        }
    }

    /// Frames `changes` in the log's own buffer, without the sequence number and checksum.
    /// One buffer for the life of the store: a fresh one per batch would come from whichever
    /// thread leads the batch, and many threads' malloc arenas each keeping a batch-sized
    /// buffer cost resident memory.
    fn encode(&mut self, changes: &[Change]) -> Result<()> {
        let mut buf = std::mem::take(&mut self.buf);
        buf.clear();
        buf.extend_from_slice(&[0; ENTRY_HEADER as usize]);
        let mut buf = postcard::to_extend(changes, buf)
            .map_err(|err| Error::storage("encoding a log entry", std::io::Error::other(err)))?;
        let len = buf.len() - ENTRY_HEADER as usize;
        let len = u32::try_from(len).map_err(|_| {
            Error::storage(
                "encoding a log entry",
                std::io::Error::other("a batch of more than 4 GiB"),
            )
        })?;
        buf[..4].copy_from_slice(&len.to_le_bytes());
        self.buf = buf;
        Ok(())
    }

    /// The batch's redb commit failed after its entry was written: the entry is durable, but
    /// the tables do not show it (a reopen would replay it). The next batch merges, which
    /// retires the entry.
    pub(crate) fn commit_failed(&mut self) {
        self.healthy = false;
    }

    /// A durable commit recording `last_seq()` has returned: the log starts again.
    pub(crate) fn merged(&mut self) {
        self.half = Half::First;
        self.pos = 0;
        self.other_free = true;
        self.healthy = true;
    }

    /// Moves to the start of the other half, if a durable commit covers the entries there and
    /// the entry that did not fit (the last `append`'s) fits in a half. Returns the last
    /// sequence number of the half left behind: a durable commit recording it (`freed`) lets
    /// the log come back to that half. Writers thus never wait for a merge's sync, which must
    /// write out every page redb's unsynced commits left since the last one (BENCHMARKS.md,
    /// "Figures behind the defaults").
    pub(crate) fn switch(&mut self) -> Option<u64> {
        let fits = self.buf.len() as u64 <= self.region.log_len / 2;
        if !(self.healthy && self.other_free && fits) {
            return None;
        }
        self.half = self.half.other();
        self.pos = self.half.start(self.region);
        self.other_free = false;
        Some(self.last_seq())
    }

    /// The start of the half being written, the next entry's position and the half's end.
    #[cfg(test)]
    pub(crate) fn at(&self) -> (u64, u64, u64) {
        let half = self.half;
        (half.start(self.region), self.pos, half.end(self.region))
    }

    /// Whether the half being written is at least `num / den` full.
    pub(crate) fn filled(&self, (num, den): (u64, u64)) -> bool {
        let start = self.half.start(self.region);
        let len = self.half.end(self.region) - start;
        (self.pos - start) * den >= len * num
    }

    /// A durable commit covers the entries up to the number `switch` returned.
    pub(crate) fn freed(&mut self) {
        self.other_free = true;
    }
}

/// One half of the log region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Half {
    First,
    Second,
}

impl Half {
    fn start(self, region: Region) -> u64 {
        match self {
            Half::First => 0,
            Half::Second => region.log_len / 2,
        }
    }

    fn end(self, region: Region) -> u64 {
        match self {
            Half::First => region.log_len / 2,
            Half::Second => region.log_len,
        }
    }

    fn other(self) -> Half {
        match self {
            Half::First => Half::Second,
            Half::Second => Half::First,
        }
    }
}

/// The sequence number after `seq`; only a damaged `log_applied_seq` can run out of them.
fn next(seq: u64) -> Result<u64> {
    seq.checked_add(1).ok_or_else(|| {
        Error::corrupted("the log's sequence number is exhausted (damaged metadata)")
    })
}

/// An entry with `payload`, sealed as number `seq` (for the fuzz entry point).
#[cfg(feature = "__test-hooks")]
fn frame(seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut entry = Vec::with_capacity(ENTRY_HEADER as usize + payload.len());
    entry.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    entry.extend_from_slice(&[0; 16]);
    entry.extend_from_slice(payload);
    seal(&mut entry, seq);
    entry
}

/// Writes the sequence number and the checksum into an entry whose length field is set.
fn seal(entry: &mut [u8], seq: u64) {
    entry[4..12].copy_from_slice(&seq.to_le_bytes());
    let sum = entry_checksum(entry);
    entry[12..20].copy_from_slice(&sum);
}

fn entry_checksum(entry: &[u8]) -> [u8; 8] {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&entry[..12]);
    hasher.update(&entry[20..]);
    let mut out = [0u8; 8];
    out.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    out
}

/// A failure injected into the log handle's writes (tests only): the write after
/// `writes_before` more fails with `EIO` before writing (`Io::Write`) or after (`Io::Sync`),
/// or, with `panic`, panics before writing.
#[cfg(test)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogFault {
    pub writes_before: u64,
    pub during: Io,
    pub panic: bool,
}

#[cfg(test)]
impl LogFault {
    /// The failure to inject into this write, if it is the one.
    #[allow(clippy::panic)]
    fn fire(fault: &mut Option<LogFault>) -> Option<Io> {
        let armed = fault.as_mut()?;
        if armed.writes_before > 0 {
            armed.writes_before -= 1;
            return None;
        }
        let fired = fault.take()?;
        if fired.panic {
            panic!("injected panic in the log write");
        }
        Some(fired.during)
    }
}

/// Reads the entries after `applied` and returns them; the log must then be merged.
///
/// They start at the beginning of one half and may go on at the beginning of the other: the
/// entries after a merge start a half, and the log switches halves only between entries.
/// Every sequence number is used once, so the entry numbered `applied + 1` is at the start of
/// at most one half, and an older entry left over in a half ends the run.
pub(crate) fn recover(opened: LogFile, applied: u64) -> Result<(Log, Vec<Vec<Change>>)> {
    let mut log = Log {
        storage: opened.storage,
        writer: opened.log_writer,
        poison: opened.poison,
        #[cfg(test)]
        fault: None,
        region: opened.region,
        pos: 0,
        half: Half::First,
        other_free: true,
        next_seq: next(applied)?,
        healthy: true,
        buf: Vec::new(),
    };
    let mut entries = Vec::new();
    let mut halves = vec![Half::First, Half::Second];
    let mut end = (Half::First, 0);
    while let Some(half) = log.find_next(&mut halves)? {
        log.pos = half.start(log.region);
        while let Some(payload) = log.read_next()? {
            let changes: Vec<Change> = postcard::from_bytes(&payload).map_err(|err| {
                Error::corrupted(format!(
                    "log entry {} passes its checksum but does not decode ({err})",
                    log.next_seq
                ))
            })?;
            entries.push(changes);
            log.next_seq = next(log.next_seq)?;
        }
        end = (half, log.pos);
    }
    (log.half, log.pos) = end;
    Ok((log, entries))
}

impl Log {
    /// The first of `halves` that begins with the next entry, which it removes from `halves`.
    fn find_next(&mut self, halves: &mut Vec<Half>) -> Result<Option<Half>> {
        for i in 0..halves.len() {
            self.pos = halves[i].start(self.region);
            if self.read_next()?.is_some() {
                return Ok(Some(halves.remove(i)));
            }
        }
        Ok(None)
    }

    /// The payload of the entry at `pos` if it is the next one, moving past it.
    fn read_next(&mut self) -> Result<Option<Vec<u8>>> {
        let room = self.region.log_len - self.pos;
        if room < ENTRY_HEADER {
            return Ok(None);
        }
        let at = self.region.log_start() + self.pos;
        let mut header = [0u8; ENTRY_HEADER as usize];
        self.storage
            .read(at, &mut header)
            .map_err(|err| Error::storage("reading the log", err))?;
        let mut word = [0u8; 8];
        word[..4].copy_from_slice(&header[..4]);
        let len = u64::from_le_bytes(word);
        word.copy_from_slice(&header[4..12]);
        let seq = u64::from_le_bytes(word);
        if seq != self.next_seq || len > room - ENTRY_HEADER {
            return Ok(None);
        }
        let mut entry = vec![0u8; (ENTRY_HEADER + len) as usize];
        self.storage
            .read(at, &mut entry)
            .map_err(|err| Error::storage("reading the log", err))?;
        if entry[12..20] != entry_checksum(&entry) {
            return Ok(None);
        }
        self.pos += entry.len() as u64;
        Ok(Some(entry.split_off(ENTRY_HEADER as usize)))
    }
}

/// Writes `data` as log entries into the log of a new store on `storage` (one whose next entry
/// is number 1): `[length u8][payload]` each, framed with the right sequence numbers and
/// checksums, so that the decoder and redo meet the bytes. For the log-replay fuzz target.
#[cfg(feature = "__test-hooks")]
pub(crate) fn forge_entries(storage: &Storage, data: &[u8]) {
    use crate::engine::layout::{HEADER_LEN, MIN_LOG_LEN};
    let (mut at, mut seq, mut rest) = (HEADER_LEN, 1, data);
    while let Some((&len, tail)) = rest.split_first() {
        let (payload, after) = tail.split_at(usize::from(len).min(tail.len()));
        let entry = frame(seq, payload);
        if at + entry.len() as u64 > HEADER_LEN + MIN_LOG_LEN || storage.write(at, &entry).is_err()
        {
            break;
        }
        (at, seq, rest) = (at + entry.len() as u64, seq + 1, after);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::layout;
    use std::sync::Arc;

    fn storage() -> (Storage, Region) {
        let storage: Storage = Arc::new(redb::backends::InMemoryBackend::new());
        let (region, _) = layout::open(&storage, layout::DEFAULT_LOG_LEN).expect("layout");
        (storage, region)
    }

    fn opened(storage: Storage, region: Region) -> LogFile {
        LogFile {
            storage,
            region,
            log_writer: None,
            poison: std::sync::Arc::default(),
        }
    }

    fn put(i: u8) -> Vec<Change> {
        vec![Change::Put {
            key: vec![i],
            record: vec![i; 10],
        }]
    }

    #[test]
    fn entries_come_back_in_order_and_stop_at_a_torn_one() {
        let (storage, region) = storage();
        let (mut log, found) = recover(opened(storage.clone(), region), 0).expect("recover");
        assert!(found.is_empty());
        for i in 1..=3 {
            assert!(log.append(&put(i), false).expect("append"));
        }
        let (_, found) = recover(opened(storage.clone(), region), 0).expect("recover");
        assert_eq!(found, vec![put(1), put(2), put(3)]);
        let (_, found) = recover(opened(storage.clone(), region), 2).expect("recover");
        assert!(
            found.is_empty(),
            "entries must start at the log's first byte"
        );
        // Tear the third entry's last byte.
        let third = log.pos - 1;
        storage
            .write(region.log_start() + third, &[0xFF])
            .expect("write");
        let (_, found) = recover(opened(storage, region), 0).expect("recover");
        assert_eq!(found, vec![put(1), put(2)]);
    }

    #[test]
    fn after_a_merge_older_entries_are_not_replayed() {
        let (storage, region) = storage();
        let (mut log, _) = recover(opened(storage.clone(), region), 0).expect("recover");
        for i in 1..=3 {
            assert!(log.append(&put(i), false).expect("append"));
        }
        log.merged();
        assert!(log.append(&put(4), false).expect("append"));
        // The merge covered 1..=3: entry 4 overwrote entry 1, and what is left of 2 and 3
        // carries older numbers.
        let (log, found) = recover(opened(storage, region), 3).expect("recover");
        assert_eq!(found, vec![put(4)]);
        assert_eq!(log.last_seq(), 4);
    }

    /// Appends 200-byte entries until the half is full; returns their numbers' range.
    fn fill_half(log: &mut Log, first: u64) -> std::ops::RangeInclusive<u64> {
        let mut seq = first;
        while log.append(&big(seq), false).expect("append") {
            seq += 1;
        }
        first..=seq - 1
    }

    fn big(seq: u64) -> Vec<Change> {
        vec![Change::Put {
            key: seq.to_le_bytes().to_vec(),
            record: vec![7; 200],
        }]
    }

    fn numbers(found: &[Vec<Change>]) -> Vec<u64> {
        found
            .iter()
            .map(|changes| match &changes[0] {
                Change::Put { key, .. } => u64::from_le_bytes(key[..8].try_into().expect("8")),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn entries_go_on_in_the_other_half_and_come_back_across_both() {
        let (storage, region) = storage();
        let (mut log, _) = recover(opened(storage.clone(), region), 0).expect("recover");
        let first = fill_half(&mut log, 1);
        assert!(
            log.pos <= region.log_len / 2,
            "an entry crossed into the second half"
        );
        let covered = log.switch().expect("the second half is free");
        assert_eq!(covered, *first.end());
        assert!(log.switch().is_none(), "the first half awaits its merge");
        let second = fill_half(&mut log, covered + 1);
        assert!(log.pos > region.log_len / 2 && log.pos <= region.log_len);
        // No merge yet: everything after 0 comes back, first half then second.
        let (_, found) = recover(opened(storage.clone(), region), 0).expect("recover");
        let all: Vec<u64> = first.clone().chain(second.clone()).collect();
        assert_eq!(numbers(&found), all);
        // The first half's merge: only the second half's entries are left to replay.
        let (_, found) = recover(opened(storage.clone(), region), covered).expect("recover");
        assert_eq!(numbers(&found), second.clone().collect::<Vec<_>>());
        // Back to the first half, over its old entries: the second half's, then the new ones,
        // and the old tail (older numbers) ends the run.
        assert!(
            log.switch().is_none(),
            "the first half's merge is not durable yet"
        );
        log.freed();
        let covered_2 = log.switch().expect("the first half is free again");
        assert_eq!(covered_2, *second.end());
        for seq in covered_2 + 1..=covered_2 + 3 {
            assert!(log.append(&big(seq), false).expect("append"));
        }
        let (_, found) = recover(opened(storage.clone(), region), covered).expect("recover");
        let expected: Vec<u64> = second.chain(covered_2 + 1..=covered_2 + 3).collect();
        assert_eq!(numbers(&found), expected);
        let (_, found) = recover(opened(storage, region), covered_2).expect("recover");
        assert_eq!(
            numbers(&found),
            (covered_2 + 1..=covered_2 + 3).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_half_left_at_seven_eighths_recovers_across_the_switch() {
        let (storage, region) = storage();
        let (mut log, _) = recover(opened(storage.clone(), region), 0).expect("recover");
        let mut seq = 1;
        while !log.filled((7, 8)) {
            assert!(log.append(&big(seq), false).expect("append"), "entry {seq}");
            seq += 1;
        }
        assert!(
            !log.filled((1, 1)),
            "entries of this size leave room at the end of the half"
        );
        let covered = log.switch().expect("the second half is free");
        assert_eq!(covered, seq - 1);
        assert_eq!(log.pos, region.log_len / 2, "the second half starts");
        for _ in 0..3 {
            assert!(log.append(&big(seq), false).expect("append"));
            seq += 1;
        }
        let (_, found) = recover(opened(storage.clone(), region), 0).expect("recover");
        assert_eq!(numbers(&found), (1..seq).collect::<Vec<_>>());
        let (_, found) = recover(opened(storage, region), covered).expect("recover");
        assert_eq!(numbers(&found), (covered + 1..seq).collect::<Vec<_>>());
    }

    #[test]
    fn a_direct_batch_runs_on_into_a_free_second_half() {
        let (storage, region) = storage();
        let (mut log, _) = recover(opened(storage.clone(), region), 0).expect("recover");
        let mut seq = 1;
        while log.pos <= region.log_len / 2 {
            assert!(log.append(&big(seq), true).expect("append"), "entry {seq}");
            seq += 1;
        }
        assert!(log.switch().is_none(), "the first half awaits a merge");
        assert!(
            log.append(&big(seq), false).expect("append"),
            "on in the second half"
        );
        let (_, found) = recover(opened(storage, region), 0).expect("recover");
        assert_eq!(numbers(&found), (1..=seq).collect::<Vec<_>>());
        log.merged();
        assert_eq!((log.half, log.pos), (Half::First, 0));
    }

    #[test]
    fn an_exhausted_sequence_number_is_corruption_not_an_overflow() {
        let (storage, region) = storage();
        let err = recover(opened(storage, region), u64::MAX).expect_err("no number after u64::MAX");
        assert!(matches!(err, Error::Corrupted { .. }), "{err:?}");
    }

    #[test]
    fn a_full_log_refuses_and_a_failed_write_forces_a_merge() {
        let (storage, region) = storage();
        let (mut log, _) = recover(opened(storage, region), 0).expect("recover");
        let huge = vec![Change::Delete {
            key: vec![0; region.log_len as usize],
        }];
        assert!(
            !log.append(&huge, false).expect("append"),
            "bigger than the log"
        );
        assert_eq!(log.last_seq(), 0, "a refused entry uses no number");
        assert!(log.append(&put(1), false).expect("append"));
        log.commit_failed();
        assert!(
            !log.append(&put(2), false).expect("append"),
            "must merge first"
        );
        log.merged();
        assert!(log.append(&put(2), false).expect("append"));
        assert_eq!(log.last_seq(), 2);
    }
}
