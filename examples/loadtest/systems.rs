//! The systems under test: what a cell asks of each, and the keys they share.

use std::sync::atomic::AtomicU64;

use idempotency_store::{Fingerprint, Key};

use crate::Res;
use crate::tools::{err, fingerprint_of, key_name};

/// One thread's connection to a system.
pub(crate) trait Client {
    /// Claims a fresh key (it must be acquired) and completes it with a 200-byte body.
    fn pair(&mut self) -> Res<()>;
    /// Claims an existing completed key with its fingerprint (it must replay).
    fn replay(&mut self) -> Res<()>;
    /// Claims a fresh key and completes it with one ledger row written atomically with the
    /// response.
    fn payment(&mut self) -> Res<()> {
        Err("this system does not run the payments workload".into())
    }
}

/// A system shared by all threads of a cell.
pub(crate) trait System: Sync {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>>;
}

/// The keys completed before a replay run.
pub(crate) struct ReplaySet {
    pub(crate) names: Vec<String>,
    pub(crate) keys: Vec<Key>,
    pub(crate) fps: Vec<Fingerprint>,
}

/// Key stream of the replay set; pair threads use streams below it.
pub(crate) const REPLAY_STREAM: u64 = 1 << 20;

impl ReplaySet {
    pub(crate) fn new(n: usize) -> Res<Self> {
        let names: Vec<String> = (0..n as u64).map(|i| key_name(REPLAY_STREAM, i)).collect();
        let keys = names
            .iter()
            .map(|n| Key::new(n).map_err(|e| err("key", e)))
            .collect::<Res<_>>()?;
        let fps = names.iter().map(|n| fingerprint_of(n)).collect();
        Ok(ReplaySet { names, keys, fps })
    }
}

/// Pair keys: stream = cell id × 4096 + thread, index = a per-thread counter.
pub(crate) struct Fresh {
    pub(crate) stream: u64,
    pub(crate) next: u64,
}

impl Fresh {
    pub(crate) fn next(&mut self) -> String {
        self.next += 1;
        key_name(self.stream, self.next)
    }
}

pub(crate) static CELL: AtomicU64 = AtomicU64::new(1);

pub(crate) fn fresh_for(thread: usize, cell: u64) -> Fresh {
    Fresh {
        stream: (cell << 12) | thread as u64,
        next: 0,
    }
}
