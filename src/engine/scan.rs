//! The scans of the expiry index, which only a direct batch can run: sweeping expired
//! records, and making room for a new record under a quota.

use redb::ReadableTable;

use crate::api::clock::Timestamp;
use crate::api::record::{Record, State};
use crate::engine::batch::{Direct, Fail, Quota, Tables};
use crate::engine::tables::RecordsMut;

/// How many expired records a claim that finds the store full deletes before giving up.
const ROOM_SWEEP: usize = 64;
/// How far into the expiry index eviction looks for a completed record.
const EVICT_SCAN: usize = 256;

/// The most records one step of a sweep deletes (see `sweep`), so that the batch it rides
/// in grows by little: the same bound as PostgreSQL's sweep statements.
pub(crate) const STEP: usize = crate::api::backend::SWEEP_BATCH;

/// Where in the expiry index a sweep's next step starts: `(expires_at, hash)`.
pub(crate) type Cursor = (u64, u64);

/// Where a sweep's next step starts, and how many records it may delete (see `sweep`).
pub(crate) struct Pace {
    pub cursor: Cursor,
    pub step: usize,
}

impl Default for Pace {
    fn default() -> Self {
        Pace {
            cursor: (0, 0),
            step: STEP,
        }
    }
}

/// What one sweep did.
pub(crate) struct Swept {
    /// Records deleted.
    pub deleted: usize,
    /// Whether the index held more expired entries than the limit.
    pub more: bool,
}

impl Tables<Direct<'_>> {
    /// Takes up to `limit` expired records in index order (oldest first, ties by key hash)
    /// and deletes them with their index entries; a stale entry (no record under its hash
    /// expires then) only goes itself, but uses up a place. `more` says whether expired
    /// entries remain.
    pub(crate) fn sweep(&mut self, now: Timestamp, limit: usize) -> Result<Swept, Fail> {
        let end = now.as_millis().saturating_add(1);
        let (mut doomed, mut more) = (Vec::<Doomed>::new(), false);
        let Direct {
            records, expiry, ..
        } = &self.access;
        for entry in expiry.range(..(end, 0))? {
            if doomed.len() >= limit {
                more = true;
                break;
            }
            let (expires_at, hash) = entry?.0.value();
            let found = owners(records, expires_at, hash)?;
            if found.is_empty() {
                doomed.push(Doomed {
                    expires_at,
                    key: None,
                    hash,
                });
            }
            for (key, owner) in found {
                // A damaged record answers to every entry under its hash: delete it once.
                let again = matches!(owner, Owner::Damaged)
                    && doomed.iter().any(|d| d.key.as_ref() == Some(&key));
                if !again {
                    doomed.push(Doomed {
                        expires_at,
                        key: Some(key),
                        hash,
                    });
                }
            }
        }
        // Keys sharing a hash share an entry; one left over keeps it for the next sweep.
        if doomed.len() > limit {
            doomed.truncate(limit);
            more = true;
        }
        let mut deleted = 0;
        for doomed in doomed {
            match doomed.key {
                None => self.drop_entry(doomed.expires_at, doomed.hash)?,
                Some(key) => {
                    self.delete(&key, doomed.expires_at)?;
                    deleted += 1;
                }
            }
        }
        Ok(Swept { deleted, more })
    }

    /// Makes room for one more record, or fails closed with `QuotaExceeded`. Expired records
    /// go first; completed ones only if the user opted in; in-progress records never. The
    /// deletions are valid on their own, so they stay in the batch even if the claim fails.
    pub(crate) fn make_room(&mut self, quota: Quota, now: Timestamp) -> Result<(), Fail> {
        if quota.exceeded(self.usage).is_none() {
            return Ok(());
        }
        self.sweep(now, ROOM_SWEEP)?;
        if quota.evict_completed {
            while quota.exceeded(self.usage).is_some() && self.evict_oldest_completed()? {}
        }
        match quota.exceeded(self.usage) {
            Some(err) => Err(Fail::Op(err)),
            None => Ok(()),
        }
    }

    /// Deletes the completed record that expires first (the oldest completion, as all share
    /// one retention); false if none is found near the front of the expiry index.
    fn evict_oldest_completed(&mut self) -> Result<bool, Fail> {
        let mut victim = None;
        let Direct {
            records, expiry, ..
        } = &self.access;
        'scan: for entry in expiry.iter()?.take(EVICT_SCAN) {
            let (expires_at, hash) = entry?.0.value();
            for (key, owner) in owners(records, expires_at, hash)? {
                if let Owner::Record(Record {
                    state: State::Completed { .. },
                    ..
                }) = owner
                {
                    victim = Some((expires_at, key));
                    break 'scan;
                }
            }
        }
        match victim {
            Some((expires_at, key)) => self.delete(&key, expires_at).map(|()| true),
            None => Ok(false),
        }
    }
}

/// The records the index entry `(expires_at, hash)` stands for, by stored key: those under
/// the hash that expire then, and those that do not decode. None: the entry is stale.
fn owners(
    records: &RecordsMut<'_>,
    expires_at: u64,
    hash: u64,
) -> Result<Vec<(Vec<u8>, Owner)>, Fail> {
    let mut found = Vec::new();
    for (stored, bytes) in records.under_hash(hash)? {
        match Record::decode(&stored, &bytes) {
            Ok(record) if record.expires_at == expires_at => {
                found.push((stored, Owner::Record(record)));
            }
            Ok(_) => {}
            Err(_) => found.push((stored, Owner::Damaged)),
        }
    }
    Ok(found)
}

/// An owner of an expiry-index entry.
enum Owner {
    Record(Record),
    /// The record does not decode; a sweep deletes it like an expired one.
    Damaged,
}

/// One deletion a sweep chose.
struct Doomed {
    expires_at: u64,
    /// The record's stored key; None for a stale entry, which only goes itself.
    key: Option<Vec<u8>>,
    hash: u64,
}
