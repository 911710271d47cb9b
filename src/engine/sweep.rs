//! Sweeps that claims hardly feel (`docs/design.md`, "Sweep").
//!
//! A sweep goes in steps of at most [`STEP`] records. Each step finds expired records in a
//! read snapshot of redb, outside the writer lock, from where the last step stopped, and then
//! rides along in the next batch of other callers' write calls (`Committer::ride`): its
//! deletions go through the overlay and the log like any call's, re-checked against the
//! batch's own view of each key, so it adds no sync of its own and no claim queues behind a
//! transaction of its own. While the flush thread is busy (writing a generation, merging), a
//! step waits, so that deletions cannot pile up in the overlay and the log faster than redb
//! takes them. What a snapshot cannot show (expired records only the overlay holds, an index
//! entry with no record, a record that does not decode) is left to a direct round: it writes
//! the overlay into redb and sweeps there, as every sweep round did before. So records go in
//! the index's order (oldest expiry first, ties by key hash) as they always did.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::api::clock::Timestamp;
use crate::api::record::Record;
use crate::engine::batch::{Access, Ctx, Fail, Tables};
use crate::engine::commit::{Job, Slot};
use crate::engine::effects::not_in_effect;
use crate::engine::handle::Engine;
use crate::engine::ops::Write;
use crate::engine::scan::{Cursor, Pace, STEP, Swept};
use crate::engine::snapshot::{Snapshot, Snapshots};
use crate::engine::tables::EXPIRY;
use crate::error::Result;

/// The most records a step deletes when the last one found no batch to ride (no claims are
/// being made): it doubles from [`STEP`] up to this.
const STEP_ALONE: usize = 1024;

/// How many records one round of `sweep_all` asks for: as many as the largest step.
pub(crate) const ROUND: usize = STEP_ALONE;

/// How long a step waits for a batch of other calls to ride in before it leads one of its
/// own: a caller that claims again at once takes far less to queue its next call.
const PATIENCE: Duration = Duration::from_millis(1);

/// How long a step waits at a time for the flush thread, and at most in all (so that a
/// flush thread kept busy by claims slows a sweep down but cannot stop it).
const PACE: Duration = Duration::from_millis(1);
const PACE_LIMIT: Duration = Duration::from_secs(1);

/// How long a scan runs before it offers its CPU to any thread waiting for one (`yield_now`).
/// A claim whose log write completed was often woken onto the CPU a scan ran on, and Linux's
/// scheduler let the scan run on: the claim waited out the rest of it, up to a millisecond,
/// with the other CPU idle. That wait was most of the tail of claim latency during a sweep
/// (BENCHMARKS.md, "Sweep, space, recovery").
const SCAN_SLICE: Duration = Duration::from_micros(50);

/// An expired record a scan found: its stored key, its expiry and its bytes in redb.
struct Found {
    key: Vec<u8>,
    expires_at: u64,
    bytes: Vec<u8>,
}

/// The most record bytes one scan keeps (beyond its first record): a step holds the records
/// it found until its batch runs, and responses may be up to `max_response_bytes` each.
const SCAN_BYTES: usize = 4 << 20;

/// What one scan of a snapshot found.
enum Scan {
    /// Expired records, and where the next scan starts.
    Found(Vec<Found>, Cursor),
    /// Nothing a step can delete from the cursor on: the next round is direct.
    Nothing,
}

/// A step's deletions: each record still as the scan found it, and expired at the batch's
/// time, is deleted with its index entry; any other is left as the batch finds it.
struct DeleteExpired {
    found: Vec<Found>,
    /// The snapshot counter of the scan (see `Access::bytes_as_scanned`).
    at: u64,
}

impl Write for DeleteExpired {
    type Output = usize;

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<usize, Fail> {
        let mut deleted = 0;
        for found in self.found {
            let Some(bytes) = tables
                .access
                .bytes_as_scanned(&found.key, self.at, &found.bytes)?
            else {
                continue;
            };
            let expired = Record::decode(&found.key, &bytes)
                .is_ok_and(|r| r.expires_at == found.expires_at && r.is_expired(ctx.now));
            if expired {
                tables.delete_expired(&found.key, found.expires_at)?;
                deleted += 1;
            }
        }
        Ok(deleted)
    }
}

impl Engine {
    /// Deletes up to `limit` expired records, in steps (see the module's docs).
    pub(crate) fn sweep(&self, limit: usize) -> Result<Swept> {
        self.writable()?;
        not_in_effect()?;
        self.poison.check()?;
        let started = Instant::now();
        let mut pace = self.sweep_pace.lock();
        let mut swept = Swept {
            deleted: 0,
            more: false,
        };
        while swept.deleted < limit {
            let step = self.sweep_step(&mut pace, limit - swept.deleted)?;
            swept.deleted += step.deleted;
            swept.more = step.more;
            if !step.more {
                break;
            }
        }
        self.stats.swept(started.elapsed());
        Ok(swept)
    }

    /// One step of at most `limit` records, and at most as many as `pace` allows, from its
    /// cursor, which it moves on.
    fn sweep_step(&self, pace: &mut Pace, limit: usize) -> Result<Swept> {
        let now = self.now();
        let limit = limit.min(pace.step);
        // Records only the overlay holds that expired: the snapshot cannot show them in their
        // place in the index's order, so the direct round takes them.
        if self.overlay.first_expiry() <= now.as_millis() {
            pace.cursor = (0, 0);
            return self.sweep_direct(limit);
        }
        // Before the scan: a wait for the flush thread ends with its generation dropped,
        // which moves the snapshot counter, and the batch would then read every found record
        // again from redb under the writer lock.
        self.pace();
        let snapshot = self.snapshots.get(self.db()?)?;
        match scan(&snapshot, pace.cursor, now, limit)? {
            Scan::Found(found, next) => {
                pace.cursor = next;
                let at = Snapshots::epoch(&snapshot);
                drop(snapshot);
                let (deleted, rode) = self.ride(DeleteExpired { found, at })?;
                pace.step = if rode {
                    STEP
                } else {
                    (pace.step * 2).min(STEP_ALONE)
                };
                Ok(Swept {
                    deleted,
                    more: true,
                })
            }
            Scan::Nothing => {
                drop(snapshot);
                pace.cursor = (0, 0);
                self.sweep_direct(limit)
            }
        }
    }

    /// Runs `write` in the next batch of other calls (see `Committer::ride`); also whether it
    /// did, or led a batch of its own.
    fn ride<W: Write>(&self, write: W) -> Result<(W::Output, bool)> {
        let slot = Arc::new(Slot::default());
        let rider = Job::pending(write, Arc::clone(&slot));
        self.committer
            .ride(rider, &slot, PATIENCE, |batch| self.run_batch(batch))
    }

    /// Waits while the flush thread is busy, for at most [`PACE_LIMIT`]. Deletions fill the
    /// overlay and the log like any change: added while the thread writes a generation or
    /// merges, they would hasten the moment when a claim's batch finds the log's half full or
    /// the overlay at its limit with the thread still busy, and waits for it.
    fn pace(&self) {
        let started = Instant::now();
        while self.flusher.busy() && started.elapsed() < PACE_LIMIT {
            std::thread::sleep(PACE);
        }
        self.stats.paced(started.elapsed());
    }

    /// Deletes up to `limit` expired records in a transaction of their own, on redb's tables
    /// after the overlay is written into them.
    fn sweep_direct(&self, limit: usize) -> Result<Swept> {
        let slot = Arc::new(Slot::default());
        let job = Job::sweep(limit, Arc::clone(&slot));
        self.committer
            .submit(job, &slot, |batch| self.run_batch(batch))
    }
}

/// Up to `limit` expired records at `now` in `snapshot`'s expiry index from `from` on. It
/// stops before an entry whose records a step cannot delete (none, or one that does not
/// decode), which is then the next scan's first: it finds `Nothing`.
fn scan(snapshot: &Snapshot, from: Cursor, now: Timestamp, limit: usize) -> Result<Scan> {
    let expiry = snapshot.txn.open_table(EXPIRY)?;
    let end = (now.as_millis().saturating_add(1), 0);
    let mut found = Vec::new();
    let mut bytes = 0;
    let mut next = from;
    if from >= end {
        return Ok(Scan::Nothing);
    }
    let mut slice = Instant::now();
    for entry in expiry.range(from..end)? {
        if slice.elapsed() >= SCAN_SLICE {
            std::thread::yield_now();
            slice = Instant::now();
        }
        let (expires_at, hash) = entry?.0.value();
        let (mut owners, mut damaged) = (Vec::new(), false);
        for (key, bytes) in snapshot.records.under_hash(hash)? {
            match Record::decode(&key, &bytes) {
                Ok(record) if record.expires_at == expires_at => owners.push(Found {
                    key,
                    expires_at,
                    bytes,
                }),
                Ok(_) => {}
                Err(_) => damaged = true,
            }
        }
        let more: usize = owners.iter().map(|owner| owner.bytes.len()).sum();
        let full = !found.is_empty() && bytes + more > SCAN_BYTES;
        if damaged || owners.is_empty() || found.len() + owners.len() > limit || full {
            break;
        }
        bytes += more;
        found.append(&mut owners);
        next = after((expires_at, hash));
    }
    Ok(if found.is_empty() {
        Scan::Nothing
    } else {
        Scan::Found(found, next)
    })
}

/// The index position just after `at`.
fn after((expires_at, hash): Cursor) -> Cursor {
    match hash.checked_add(1) {
        Some(hash) => (expires_at, hash),
        None => (expires_at.saturating_add(1), 0),
    }
}
