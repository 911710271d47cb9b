//! The floor: group commit of a bare log, no store at all.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::Res;
use crate::systems::{CELL, Client, Fresh, System, fresh_for};
use crate::tools::{body, err, fingerprint_of};

/// What any store with this API shape must at least do per operation on this machine: queue
/// the caller, append a record to a preallocated log, share one `fdatasync` per batch, wake the
/// caller. Leader/follower with a slot per caller, like the store's committer, but no lookups,
/// no encoding, no B-tree: its pairs/s bound what a blocking, durable, group-committed `claim`
/// plus `complete` can reach here, whatever the store does.
pub(crate) struct LogBound {
    pub(crate) file: File,
    pub(crate) queue: parking_lot::Mutex<BoundQueue>,
}

#[derive(Default)]
pub(crate) struct BoundQueue {
    pub(crate) buf: Vec<u8>,
    pub(crate) waiting: Vec<Arc<BoundSlot>>,
    pub(crate) leader: bool,
    /// Where the next batch goes in the log, which wraps around like the store's.
    pub(crate) at: u64,
}

#[derive(Default)]
pub(crate) struct BoundSlot {
    /// 0 queued, 1 lead, 2 durable.
    pub(crate) state: parking_lot::Mutex<u8>,
    pub(crate) changed: parking_lot::Condvar,
}

impl BoundSlot {
    pub(crate) fn set(&self, state: u8) {
        *self.state.lock() = state;
        self.changed.notify_one();
    }

    pub(crate) fn wait(&self) -> u8 {
        let mut state = self.state.lock();
        while *state == 0 {
            self.changed.wait(&mut state);
        }
        *state
    }
}

/// The log's length: the store's default `log_size`.
pub(crate) const BOUND_LOG: u64 = 4 << 20;

impl LogBound {
    pub(crate) fn create(dir: &Path) -> Res<Self> {
        let file = File::create(dir.join("bound.log")).map_err(|e| err("create", e))?;
        file.write_all_at(&vec![0u8; BOUND_LOG as usize], 0)
            .map_err(|e| err("pwrite", e))?;
        file.sync_all().map_err(|e| err("fsync", e))?;
        Ok(LogBound {
            file,
            queue: parking_lot::Mutex::new(BoundQueue::default()),
        })
    }

    /// Returns once `record` is on disk.
    pub(crate) fn append(&self, record: &[u8]) -> Res<()> {
        let slot = Arc::new(BoundSlot::default());
        let lead = {
            let mut q = self.queue.lock();
            q.buf.extend_from_slice(record);
            q.waiting.push(Arc::clone(&slot));
            !std::mem::replace(&mut q.leader, true)
        };
        if !lead && slot.wait() == 2 {
            return Ok(());
        }
        let (buf, batch, at) = {
            let mut q = self.queue.lock();
            let buf = std::mem::take(&mut q.buf);
            let at = if q.at + buf.len() as u64 > BOUND_LOG {
                0
            } else {
                q.at
            };
            q.at = at + buf.len() as u64;
            (buf, std::mem::take(&mut q.waiting), at)
        };
        let written = self
            .file
            .write_all_at(&buf, at)
            .and_then(|()| self.file.sync_data());
        {
            let mut q = self.queue.lock();
            match q.waiting.first() {
                Some(next) => next.set(1),
                None => q.leader = false,
            }
        }
        for other in batch.iter().filter(|s| !Arc::ptr_eq(s, &slot)) {
            other.set(2);
        }
        written.map_err(|e| err("log-bound write", e))
    }
}

pub(crate) struct LogBoundClient<'a> {
    pub(crate) log: &'a LogBound,
    pub(crate) fresh: Fresh,
    pub(crate) body: Vec<u8>,
}

impl System for LogBound {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        Ok(Box::new(LogBoundClient {
            log: self,
            fresh: fresh_for(thread, CELL.fetch_add(1, Ordering::Relaxed)),
            body: body(),
        }))
    }
}

impl Client for LogBoundClient<'_> {
    /// Two durable appends, the sizes of a claim's and a completion's log entries.
    fn pair(&mut self) -> Res<()> {
        let name = self.fresh.next();
        let fp = fingerprint_of(&name);
        let mut claim = name.into_bytes();
        claim.extend_from_slice(fp.digest());
        self.log.append(&claim)?;
        claim.extend_from_slice(&self.body);
        self.log.append(&claim)
    }

    fn replay(&mut self) -> Res<()> {
        Err("log-bound measures pairs only".into())
    }
}
