//! The write operations, applied inside one redb write transaction.
//!
//! Every operation reads and validates before it mutates anything, so an operation that
//! fails for its own reasons (a lost lease, a corrupted record) leaves the shared transaction
//! untouched and the rest of its batch can still commit. A storage error, by contrast, may
//! leave the transaction half-written and fails the whole batch.

use redb::{
    ReadOnlyTable, ReadTransaction, ReadableTable, Table, TableDefinition, WriteTransaction,
};

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, ForceRelease, Lease};
use crate::api::record::{Attempt, Record, State, Verdict, verdict};
use crate::api::response::Response;
use crate::engine::overlay::{Overlay, Shared};
use crate::engine::tables::{self, EXPIRY, ExpiryTable, RECORDS};
use crate::engine::wal::{Change, Counter};
use crate::error::{Error, from_storage};

/// Format version, the fencing-token counter, the clock's high-water mark and usage counters.
pub(crate) const META: TableDefinition<&str, u64> = TableDefinition::new("idempotency_meta");

pub(crate) const META_FORMAT: &str = "format_version";
/// The layout of the tables and the record format they hold (each record also carries its own
/// version byte). 2: records of format 2. 3: records filed under their key's hash, the expiry
/// index by `(time, hash)` (see `tables`).
pub(crate) const STORE_FORMAT: u64 = 3;
pub(crate) const META_NEXT_TOKEN: &str = "next_token";
pub(crate) const META_CLOCK: &str = "clock_high_water_ms";
pub(crate) const META_RECORDS: &str = "record_count";
pub(crate) const META_BYTES: &str = "record_bytes";
/// The last write-ahead log entry that a durable commit covers (see `wal`).
pub(crate) const META_LOG_SEQ: &str = "log_applied_seq";

/// How many expired records a claim that finds the store full deletes before giving up.
const ROOM_SWEEP: usize = 64;
/// How far into the expiry index eviction looks for a completed record.
const EVICT_SCAN: usize = 256;

/// A write call, as queued for the group commit.
pub(crate) enum Op {
    Claim {
        key: Key,
        fingerprint: Fingerprint,
    },
    Complete {
        key: Key,
        token: u64,
        response: Response,
    },
    Release {
        key: Key,
        token: u64,
    },
    Heartbeat {
        key: Key,
        token: u64,
    },
    Checkpoint {
        key: Key,
        token: u64,
        data: Vec<u8>,
    },
    Sweep {
        limit: usize,
    },
    /// An operator deleting an in-progress record without its lease.
    ForceRelease {
        key: Key,
    },
}

impl Op {
    /// Sweeps touch many records and commit in a transaction of their own.
    pub(crate) fn runs_alone(&self) -> bool {
        matches!(self, Op::Sweep { .. })
    }

    /// The key whose waiters must be woken once this operation commits, if it settles one.
    pub(crate) fn settles(&self) -> Option<&Key> {
        match self {
            Op::Complete { key, .. } | Op::Release { key, .. } | Op::ForceRelease { key } => {
                Some(key)
            }
            _ => None,
        }
    }
}

/// What a write call returns when it succeeds.
pub(crate) enum Done {
    Claim(Claim),
    Settled,
    Heartbeat(Timestamp),
    /// Records deleted, and whether the index held more expired entries than the limit.
    Swept {
        deleted: usize,
        more: bool,
    },
    ForceReleased(ForceRelease),
}

/// Why an operation failed: on its own, or for the whole batch.
pub(crate) enum Fail {
    Op(Error),
    Batch(Error),
}

impl Fail {
    pub(crate) fn into_error(self) -> Error {
        match self {
            Fail::Op(err) | Fail::Batch(err) => err,
        }
    }
}

impl From<Error> for Fail {
    fn from(err: Error) -> Self {
        Fail::Op(err)
    }
}

impl From<redb::StorageError> for Fail {
    fn from(err: redb::StorageError) -> Self {
        Fail::Batch(from_storage("writing a batch", err))
    }
}

/// The records the index entry `(expires_at, hash)` stands for, by stored key: those under
/// the hash that expire then, and those that do not decode. None: the entry is stale.
fn owners(
    records: &RecordsTable<'_>,
    expires_at: u64,
    hash: u64,
) -> Result<Vec<(Vec<u8>, Owner)>, Fail> {
    let mut found = Vec::new();
    for (key, bytes) in tables::under_hash(records, hash)? {
        // A key under another key's hash is damage no lookup reaches; `verify` reports it.
        let Some(stored) = tables::stored_key(&key) else {
            continue;
        };
        match Record::decode(stored, &bytes) {
            Ok(record) if record.expires_at == expires_at => {
                found.push((stored.to_vec(), Owner::Record(record)));
            }
            Ok(_) => {}
            Err(_) => found.push((stored.to_vec(), Owner::Damaged)),
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

/// The settings and counters one batch works with.
pub(crate) struct Ctx {
    pub now: Timestamp,
    pub lease_ms: u64,
    pub retention_ms: u64,
    pub next_token: u64,
    pub quota: Quota,
}

/// Storage limits for new claims (see `StoreBuilder::max_records`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Quota {
    pub max_records: Option<u64>,
    pub max_bytes: Option<u64>,
    pub evict_completed: bool,
}

impl Quota {
    /// The limit that one more record would break, if any.
    fn exceeded(&self, usage: Usage) -> Option<Error> {
        let over = |used: u64, max: Option<u64>, limit| {
            max.filter(|&max| used >= max)
                .map(|max| Error::QuotaExceeded { limit, used, max })
        };
        over(usage.records, self.max_records, "max_records")
            .or_else(|| over(usage.bytes, self.max_bytes, "max_bytes"))
    }
}

/// What the records table holds: record count, and bytes of stored keys plus record values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub records: u64,
    pub bytes: u64,
}

impl Usage {
    pub(crate) fn replaced(&mut self, key: usize, new: usize, old: Option<usize>) {
        self.removed(key, old);
        // Saturating: a damaged counter must not overflow (verify reports the mismatch).
        self.records = self.records.saturating_add(1);
        self.bytes = self.bytes.saturating_add((key + new) as u64);
    }

    pub(crate) fn removed(&mut self, key: usize, old: Option<usize>) {
        if let Some(old) = old {
            self.records = self.records.saturating_sub(1);
            self.bytes = self.bytes.saturating_sub((key + old) as u64);
        }
    }
}

/// The counters of the meta table. They live in memory between checkpoints: a batch logs
/// the ones it changes (`Change::Counter`) and only a checkpoint writes them to the table, so
/// that most commits leave the meta table out (a tree fewer to rewrite per commit).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub next_token: u64,
    /// The clock's high-water mark (ms).
    pub clock: u64,
    pub usage: Usage,
}

impl Counters {
    pub(crate) fn load(meta: &Table<'_, &'static str, u64>) -> Result<Counters, Error> {
        let stored = |k| -> Result<u64, Error> {
            Ok(meta
                .get(k)
                .map_err(|e| from_storage("reading the metadata", e))?
                .map_or(0, |v| v.value()))
        };
        Ok(Counters {
            next_token: stored(META_NEXT_TOKEN)?.max(1),
            clock: stored(META_CLOCK)?,
            usage: Usage {
                records: stored(META_RECORDS)?,
                bytes: stored(META_BYTES)?,
            },
        })
    }

    pub(crate) fn save(&self, meta: &mut Table<'_, &'static str, u64>) -> Result<(), Error> {
        for (counter, value) in self.values() {
            meta.insert(counter.name(), value)
                .map_err(|e| from_storage("writing the metadata", e))?;
        }
        Ok(())
    }

    /// Makes `txn` a checkpoint: it writes these counters and records that the log is applied
    /// up to entry `seq` (and, with `quick_repair`, redb's allocator state).
    pub(crate) fn checkpoint(
        &self,
        txn: &mut WriteTransaction,
        seq: u64,
        quick_repair: bool,
    ) -> Result<(), Error> {
        txn.set_quick_repair(quick_repair);
        let mut meta = txn.open_table(META)?;
        self.save(&mut meta)?;
        meta.insert(META_LOG_SEQ, seq)
            .map_err(|e| from_storage("writing the metadata", e))?;
        Ok(())
    }

    /// The changes that turn `before` into `self`, for the log.
    pub(crate) fn changes_since(&self, before: &Counters) -> impl Iterator<Item = Change> {
        self.values()
            .into_iter()
            .zip(before.values())
            .filter(|(now, then)| now != then)
            .map(|((counter, value), _)| Change::Counter { counter, value })
    }

    fn values(&self) -> [(Counter, u64); 4] {
        [
            (Counter::NextToken, self.next_token),
            (Counter::Clock, self.clock),
            (Counter::Records, self.usage.records),
            (Counter::Bytes, self.usage.bytes),
        ]
    }
}

/// The two data tables as one batch sees them, their usage counters, and the changes made so
/// far (for the write-ahead log). Every mutation goes through the methods below, so that none
/// escapes the log.
pub(crate) struct Tables<'a> {
    data: Data<'a>,
    pub usage: Usage,
    pub changes: Vec<Change>,
}

type RecordsTable<'a> = Table<'a, &'static [u8], &'static [u8]>;

/// Where a batch reads and writes.
enum Data<'a> {
    /// redb's tables in a write transaction, begun after the overlay was flushed into them.
    Direct {
        records: RecordsTable<'a>,
        expiry: ExpiryTable<'a>,
    },
    /// redb's records as of the last commit, the overlay over them, and the batch's own
    /// changes over both (see `overlay`). Scans of the tables are not possible here.
    Layered {
        base: ReadOnlyTable<&'static [u8], &'static [u8]>,
        overlay: &'a Shared,
        batch: Overlay,
    },
}

impl<'a> Tables<'a> {
    /// The tables of the write transaction `txn`.
    pub(crate) fn direct(txn: &'a WriteTransaction) -> Result<Self, Error> {
        Ok(Self::new(Data::Direct {
            records: txn.open_table(RECORDS)?,
            expiry: txn.open_table(EXPIRY)?,
        }))
    }

    /// The records of the read transaction `snapshot` under `overlay`.
    pub(crate) fn layered(snapshot: &ReadTransaction, overlay: &'a Shared) -> Result<Self, Error> {
        Ok(Self::new(Data::Layered {
            base: snapshot.open_table(RECORDS)?,
            overlay,
            batch: Overlay::default(),
        }))
    }

    fn new(data: Data<'a>) -> Self {
        Tables {
            data,
            usage: Usage::default(),
            changes: Vec::new(),
        }
    }

    /// The changes of a layered batch, for the overlay once the batch is durable.
    pub(crate) fn into_batch(self) -> Option<Overlay> {
        match self.data {
            Data::Layered { batch, .. } => Some(batch),
            Data::Direct { .. } => None,
        }
    }

    /// The key's record bytes.
    fn bytes(&self, key: &[u8]) -> Result<Option<Vec<u8>>, Fail> {
        Ok(match &self.data {
            Data::Direct { records, .. } => {
                let key = tables::record_key(key);
                records.get(key.as_slice())?.map(|v| v.value().to_vec())
            }
            Data::Layered {
                base,
                overlay,
                batch,
            } => {
                let known = match batch.record(key) {
                    Some(known) => Some(known.map(<[u8]>::to_vec)),
                    None => overlay.with_record(key, |known| known.map(<[u8]>::to_vec)),
                };
                match known {
                    Some(known) => known,
                    None => {
                        let key = tables::record_key(key);
                        base.get(key.as_slice())?.map(|v| v.value().to_vec())
                    }
                }
            }
        })
    }

    /// Sets (or with `None` deletes) the key's record bytes; returns the old length.
    fn set(&mut self, key: &[u8], record: Option<&[u8]>) -> Result<Option<usize>, Fail> {
        if let Data::Direct { records, .. } = &mut self.data {
            let key = tables::record_key(key);
            let old = match record {
                Some(bytes) => records.insert(key.as_slice(), bytes)?,
                None => records.remove(key.as_slice())?,
            };
            return Ok(old.map(|v| v.value().len()));
        }
        let old = self.bytes(key)?.map(|b| b.len());
        if let Data::Layered { batch, .. } = &mut self.data {
            batch.set_record(key, record);
        }
        Ok(old)
    }

    fn set_index(&mut self, expires_at: u64, key: &[u8], present: bool) -> Result<(), Fail> {
        match &mut self.data {
            Data::Direct { expiry, .. } if present => tables::index(expiry, expires_at, key)?,
            Data::Direct { records, expiry } => tables::unindex(expiry, records, expires_at, key)?,
            Data::Layered { batch, .. } => batch.set_index(expires_at, key, present),
        }
        Ok(())
    }

    /// redb's tables, for the operations that scan them.
    fn scannable(&self) -> Result<(&RecordsTable<'a>, &ExpiryTable<'a>), Fail> {
        match &self.data {
            Data::Direct { records, expiry } => Ok((records, expiry)),
            Data::Layered { .. } => Err(Fail::Batch(Error::storage(
                "scanning the expiry index",
                std::io::Error::other(
                    "internal error: a scan in a layered batch; please report it",
                ),
            ))),
        }
    }

    fn get(&self, key: &Key) -> Result<Option<Record>, Fail> {
        match self.bytes(key.as_stored())? {
            Some(bytes) => Ok(Some(Record::decode(key.as_stored(), &bytes)?)),
            None => Ok(None),
        }
    }

    /// Writes `record`, moving its expiry entry from `old_expires_at` if it had one and the
    /// time changed.
    fn put(&mut self, key: &Key, old_expires_at: Option<u64>, record: &Record) -> Result<(), Fail> {
        let bytes = record.encode(key.as_stored())?;
        let k = key.as_stored();
        let new = record.expires_at;
        let old = old_expires_at;
        if old != Some(new) {
            if let Some(old) = old {
                self.unindex(old, k)?;
            }
            self.set_index(new, k, true)?;
            self.changes.push(Change::Index {
                expires_at: new,
                key: k.to_vec(),
            });
        }
        let old = self.set(k, Some(&bytes))?;
        self.usage.replaced(k.len(), bytes.len(), old);
        self.changes.push(Change::Put {
            key: k.to_vec(),
            record: bytes,
        });
        Ok(())
    }

    fn delete(&mut self, key: &[u8], expires_at: u64) -> Result<(), Fail> {
        self.unindex(expires_at, key)?;
        self.remove_record(key)
    }

    fn unindex(&mut self, expires_at: u64, key: &[u8]) -> Result<(), Fail> {
        self.set_index(expires_at, key, false)?;
        self.changes.push(Change::Unindex {
            expires_at,
            key: key.to_vec(),
        });
        Ok(())
    }

    /// Drops a stale index entry. Only scans find those, and scans run in direct batches.
    fn drop_entry(&mut self, expires_at: u64, hash: u64) -> Result<(), Fail> {
        if let Data::Direct { expiry, .. } = &mut self.data {
            expiry.remove((expires_at, hash))?;
        }
        self.changes.push(Change::DropEntry { expires_at, hash });
        Ok(())
    }

    fn remove_record(&mut self, key: &[u8]) -> Result<(), Fail> {
        let old = self.set(key, None)?;
        self.usage.removed(key.len(), old);
        self.changes.push(Change::Delete { key: key.to_vec() });
        Ok(())
    }

    /// The record if `token` still holds it; otherwise the lease is lost.
    pub(crate) fn held(&self, key: &Key, token: u64, now: Timestamp) -> Result<Record, Fail> {
        match self.get(key)? {
            Some(record)
                if !record.is_expired(now)
                    && matches!(record.state, State::InProgress { token: t, .. } if t == token) =>
            {
                Ok(record)
            }
            _ => Err(Fail::Op(Error::LeaseLost)),
        }
    }

    pub(crate) fn apply(&mut self, ctx: &mut Ctx, op: Op) -> Result<Done, Fail> {
        match op {
            Op::Claim { key, fingerprint } => self.claim(ctx, key, fingerprint).map(Done::Claim),
            Op::Complete {
                key,
                token,
                response,
            } => self.complete(ctx, &key, token, response),
            Op::Release { key, token } => {
                let record = self.held(&key, token, ctx.now)?;
                self.delete(key.as_stored(), record.expires_at)?;
                Ok(Done::Settled)
            }
            Op::Heartbeat { key, token } => self.heartbeat(ctx, &key, token),
            Op::Checkpoint { key, token, data } => {
                let mut record = self.held(&key, token, ctx.now)?;
                if let State::InProgress { checkpoint, .. } = &mut record.state {
                    *checkpoint = Some(data);
                }
                self.put(&key, Some(record.expires_at), &record)?;
                Ok(Done::Settled)
            }
            Op::Sweep { limit } => self.sweep(ctx.now, limit),
            Op::ForceRelease { key } => self.force_release(ctx.now, &key).map(Done::ForceReleased),
        }
    }

    fn claim(&mut self, ctx: &mut Ctx, key: Key, fingerprint: Fingerprint) -> Result<Claim, Fail> {
        let existing = self.get(&key)?;
        let old_expires_at = existing.as_ref().map(|r| r.expires_at);
        let attempt = match verdict(existing, fingerprint, ctx.now) {
            Verdict::Answer(answer) => return Ok(answer),
            Verdict::Fresh => {
                if old_expires_at.is_none() {
                    self.make_room(ctx)?;
                }
                Attempt::first(ctx.now)
            }
            Verdict::Takeover(old) => old.takeover(),
        };
        let token = ctx.next_token;
        // Only a damaged counter gets here: 2^64 claims would take millennia.
        ctx.next_token = token.checked_add(1).ok_or_else(|| {
            Fail::Op(Error::corrupted(
                "the fencing-token counter is exhausted (damaged metadata)",
            ))
        })?;
        let lease_until = ctx.now.plus(ctx.lease_ms).as_millis();
        let (number, checkpoint) = (attempt.number, attempt.checkpoint.clone());
        let record = Record::claimed(fingerprint, attempt, token, lease_until, ctx.retention_ms);
        self.put(&key, old_expires_at, &record)?;
        Ok(Claim::Acquired(Lease {
            key,
            token,
            attempt: number,
            lease_until: Timestamp::from_millis(lease_until),
            checkpoint,
        }))
    }

    fn complete(
        &mut self,
        ctx: &Ctx,
        key: &Key,
        token: u64,
        response: Response,
    ) -> Result<Done, Fail> {
        let held = self.held(key, token, ctx.now)?;
        let old_expires_at = held.expires_at;
        let record = held.completed(response, ctx.now, ctx.retention_ms);
        self.put(key, Some(old_expires_at), &record)?;
        Ok(Done::Settled)
    }

    fn heartbeat(&mut self, ctx: &Ctx, key: &Key, token: u64) -> Result<Done, Fail> {
        let record = self.held(key, token, ctx.now)?;
        let old_expires_at = record.expires_at;
        let new_until = ctx.now.plus(ctx.lease_ms).as_millis();
        let record = record.extended(new_until);
        self.put(key, Some(old_expires_at), &record)?;
        Ok(Done::Heartbeat(Timestamp::from_millis(new_until)))
    }

    fn force_release(&mut self, now: Timestamp, key: &Key) -> Result<ForceRelease, Fail> {
        Ok(match self.get(key)? {
            Some(record) if record.is_expired(now) => ForceRelease::NotFound,
            None => ForceRelease::NotFound,
            Some(Record {
                state: State::Completed { .. },
                ..
            }) => ForceRelease::Completed,
            Some(Record {
                expires_at,
                attempt,
                state: State::InProgress { lease_until, .. },
                ..
            }) => {
                self.delete(key.as_stored(), expires_at)?;
                ForceRelease::Released {
                    attempt,
                    lease_until: Timestamp::from_millis(lease_until),
                }
            }
        })
    }

    /// Takes up to `limit` expired records in index order (oldest first, ties by key hash)
    /// and deletes them with their index entries; a stale entry (no record under its hash
    /// expires then) only goes itself, but uses up a place. `more` says whether expired
    /// entries remain.
    fn sweep(&mut self, now: Timestamp, limit: usize) -> Result<Done, Fail> {
        let end = now.as_millis().saturating_add(1);
        let (mut doomed, mut more) = (Vec::<Doomed>::new(), false);
        let (records, expiry) = self.scannable()?;
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
        Ok(Done::Swept { deleted, more })
    }

    /// Makes room for one more record, or fails closed with `QuotaExceeded`. Expired records
    /// go first; completed ones only if the user opted in; in-progress records never. The
    /// deletions are valid on their own, so they stay in the batch even if the claim fails.
    fn make_room(&mut self, ctx: &Ctx) -> Result<(), Fail> {
        if ctx.quota.exceeded(self.usage).is_none() {
            return Ok(());
        }
        self.sweep(ctx.now, ROOM_SWEEP)?;
        if ctx.quota.evict_completed {
            while ctx.quota.exceeded(self.usage).is_some() && self.evict_oldest_completed()? {}
        }
        match ctx.quota.exceeded(self.usage) {
            Some(err) => Err(Fail::Op(err)),
            None => Ok(()),
        }
    }

    /// Deletes the completed record that expires first (the oldest completion, as all share
    /// one retention); false if none is found near the front of the expiry index.
    fn evict_oldest_completed(&mut self) -> Result<bool, Fail> {
        let mut victim = None;
        let (records, expiry) = self.scannable()?;
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
