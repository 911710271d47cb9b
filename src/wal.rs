//! The write-ahead log: how a batch becomes durable with one small sequential write.
//!
//! A durable redb commit rewrites about ten scattered 4 KiB pages and syncs them (see
//! BENCHMARKS.md). Instead, a batch's changes (the record bytes and index entries it wrote,
//! and the counters it left) go to the log region as one entry, the entry is synced, and only
//! then is the redb transaction committed without a sync (`Durability::None`): readers see a
//! batch only once it is durable. Every so often, when the log is full, a batch commits
//! durably instead (a checkpoint), which also persists every earlier non-durable commit, and
//! the log starts again at its beginning.
//!
//! Entries: `[payload length u32][sequence u64][checksum 8 B][payload]`, little-endian, the
//! checksum (blake3, truncated) covering the first 12 bytes and the payload. The metadata
//! table records the last sequence number a checkpoint covers (`META_LOG_SEQ`); the log then
//! holds the entries after it, in order, from its first byte. Opening replays them: it reads
//! from the start while each entry checks out and carries the next sequence number, and stops
//! at the first that does not (a torn last write, zeros, or an older entry left over from
//! before the checkpoint). Redo is physical, so replaying an entry twice changes nothing.

use redb::WriteTransaction;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::layout::{Region, Shared};
use crate::ops::{EXPIRY, META, META_BYTES, META_CLOCK, META_NEXT_TOKEN, META_RECORDS, RECORDS};

const ENTRY_HEADER: u64 = 20;

/// One change a batch made to the tables, with the bytes it wrote: redo decides nothing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Change {
    Put { key: Vec<u8>, record: Vec<u8> },
    Delete { key: Vec<u8> },
    Index { expires_at: u64, key: Vec<u8> },
    Unindex { expires_at: u64, key: Vec<u8> },
    Counter { counter: Counter, value: u64 },
}

/// The metadata values a batch sets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum Counter {
    NextToken,
    Clock,
    Records,
    Bytes,
}

impl Counter {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Counter::NextToken => META_NEXT_TOKEN,
            Counter::Clock => META_CLOCK,
            Counter::Records => META_RECORDS,
            Counter::Bytes => META_BYTES,
        }
    }
}

/// The log's write position. Used only while holding redb's write transaction, which
/// serialises the writers.
#[derive(Debug)]
pub(crate) struct Log {
    storage: Shared,
    region: Region,
    /// Where the next entry goes, from the start of the log region.
    pos: u64,
    /// The sequence number of the next entry; every number is used once, even by a failed
    /// write, so that an entry of unknown fate can never be mistaken for a later one.
    next_seq: u64,
    /// False after a failed log write or commit: the next batch must checkpoint.
    healthy: bool,
}

impl Log {
    /// The last sequence number handed out; a checkpoint covers every entry up to it.
    pub(crate) fn last_seq(&self) -> u64 {
        self.next_seq - 1
    }

    /// Whether a batch with this payload can go to the log rather than checkpoint.
    pub(crate) fn takes(&self, payload: usize) -> bool {
        self.healthy && self.pos + ENTRY_HEADER + payload as u64 <= self.region.log_len
    }

    /// Writes one entry and syncs it. Once this returns `Ok`, the batch is durable.
    pub(crate) fn append(&mut self, payload: &[u8]) -> Result<()> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = frame(seq, payload);
        let offset = self.region.log_start() + self.pos;
        self.pos += entry.len() as u64;
        let written = self
            .storage
            .write(offset, &entry)
            .and_then(|()| self.storage.sync_data());
        written.map_err(|err| {
            self.healthy = false;
            Error::storage("writing the log", err)
        })
    }

    /// The redb commit after a log write failed: the entry is durable but the tables do not
    /// show it until a reopen replays it; a checkpoint first makes it dead.
    pub(crate) fn commit_failed(&mut self) {
        self.healthy = false;
    }

    /// A durable commit recording `last_seq()` has returned: the log starts again.
    pub(crate) fn checkpointed(&mut self) {
        self.pos = 0;
        self.healthy = true;
    }
}

fn frame(seq: u64, payload: &[u8]) -> Vec<u8> {
    let mut entry = Vec::with_capacity(ENTRY_HEADER as usize + payload.len());
    entry.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    entry.extend_from_slice(&seq.to_le_bytes());
    entry.extend_from_slice(&[0; 8]);
    entry.extend_from_slice(payload);
    let sum = entry_checksum(&entry);
    entry[12..20].copy_from_slice(&sum);
    entry
}

fn entry_checksum(entry: &[u8]) -> [u8; 8] {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&entry[..12]);
    hasher.update(&entry[20..]);
    let mut out = [0u8; 8];
    out.copy_from_slice(&hasher.finalize().as_bytes()[..8]);
    out
}

pub(crate) fn encode(changes: &[Change]) -> Result<Vec<u8>> {
    postcard::to_allocvec(changes)
        .map_err(|err| Error::storage("encoding a log entry", std::io::Error::other(err)))
}

/// Reads the entries after `applied` and returns them with the log positioned after them.
pub(crate) fn recover(
    storage: Shared,
    region: Region,
    applied: u64,
) -> Result<(Log, Vec<Vec<Change>>)> {
    let mut log = Log {
        storage,
        region,
        pos: 0,
        next_seq: applied + 1,
        healthy: true,
    };
    let mut entries = Vec::new();
    while let Some(payload) = log.read_next()? {
        let changes: Vec<Change> = postcard::from_bytes(&payload).map_err(|err| {
            Error::corrupted(format!(
                "log entry {} passes its checksum but does not decode ({err})",
                log.next_seq
            ))
        })?;
        entries.push(changes);
        log.next_seq += 1;
    }
    Ok((log, entries))
}

impl Log {
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

/// Applies logged changes in `txn`, in order.
pub(crate) fn redo(txn: &WriteTransaction, entries: Vec<Vec<Change>>) -> Result<()> {
    let mut records = txn.open_table(RECORDS)?;
    let mut expiry = txn.open_table(EXPIRY)?;
    let mut meta = txn.open_table(META)?;
    for change in entries.into_iter().flatten() {
        match change {
            Change::Put { key, record } => drop(records.insert(key.as_slice(), record.as_slice())?),
            Change::Delete { key } => drop(records.remove(key.as_slice())?),
            Change::Index { expires_at, key } => {
                drop(expiry.insert((expires_at, key.as_slice()), ())?);
            }
            Change::Unindex { expires_at, key } => {
                drop(expiry.remove((expires_at, key.as_slice()))?);
            }
            Change::Counter { counter, value } => drop(meta.insert(counter.name(), value)?),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout;
    use std::sync::Arc;

    fn storage() -> (Shared, Region) {
        let storage: Shared = Arc::new(redb::backends::InMemoryBackend::new());
        let region = layout::open(&storage, layout::DEFAULT_LOG_LEN).expect("layout");
        (storage, region)
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
        let (mut log, found) = recover(storage.clone(), region, 0).expect("recover");
        assert!(found.is_empty());
        for i in 1..=3 {
            log.append(&encode(&put(i)).expect("encode"))
                .expect("append");
        }
        let (_, found) = recover(storage.clone(), region, 0).expect("recover");
        assert_eq!(found, vec![put(1), put(2), put(3)]);
        let (_, found) = recover(storage.clone(), region, 2).expect("recover");
        assert!(
            found.is_empty(),
            "entries must start at the log's first byte"
        );
        // Tear the third entry's last byte.
        let third = log.pos - 1;
        storage
            .write(region.log_start() + third, &[0xFF])
            .expect("write");
        let (_, found) = recover(storage, region, 0).expect("recover");
        assert_eq!(found, vec![put(1), put(2)]);
    }

    #[test]
    fn after_a_checkpoint_older_entries_are_not_replayed() {
        let (storage, region) = storage();
        let (mut log, _) = recover(storage.clone(), region, 0).expect("recover");
        for i in 1..=3 {
            log.append(&encode(&put(i)).expect("encode"))
                .expect("append");
        }
        log.checkpointed();
        log.append(&encode(&put(4)).expect("encode"))
            .expect("append");
        // The checkpoint covered 1..=3: entry 4 overwrote entry 1, and what is left of 2 and 3
        // carries older numbers.
        let (log, found) = recover(storage, region, 3).expect("recover");
        assert_eq!(found, vec![put(4)]);
        assert_eq!(log.last_seq(), 4);
    }

    #[test]
    fn a_full_log_refuses_and_a_failed_write_forces_a_checkpoint() {
        let (storage, region) = storage();
        let (mut log, _) = recover(storage, region, 0).expect("recover");
        assert!(log.takes(100));
        assert!(!log.takes(region.log_len as usize));
        log.commit_failed();
        assert!(!log.takes(1));
        log.checkpointed();
        assert!(log.takes(1));
    }
}
