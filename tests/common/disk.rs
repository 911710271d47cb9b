//! Fake disks for redb's `StorageBackend`, shared by the tests that inject storage faults: a
//! simulated disk ([`SimDisk`]) whose faults each test plugs in.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use idempotency_store::redb;

/// An in-memory disk whose syncs fail with `EIO` while its switch (`sim().faults.0`) is on.
pub type FailingSyncs = SimDisk<SyncsFail>;

/// The fault of a [`FailingSyncs`] disk.
#[derive(Debug, Default)]
pub struct SyncsFail(pub Arc<AtomicBool>);

impl Faults for SyncsFail {
    fn check(sim: &mut Sim<Self>, op: Op) -> std::io::Result<()> {
        if op == Op::Sync && sim.faults.0.load(Ordering::SeqCst) {
            return Err(std::io::Error::from_raw_os_error(5));
        }
        Ok(())
    }
}

/// What a fake disk holds: the live image (what reads see), the durable one (what the syncs
/// covered) and the writes and resizes handed over since the last sync, with the state of
/// its faults.
#[derive(Debug, Default)]
pub struct Sim<F> {
    pub live: Vec<u8>,
    pub durable: Vec<u8>,
    pub pending: Vec<Pending>,
    pub faults: F,
}

/// A write or resize not yet covered by a sync.
#[derive(Debug)]
pub enum Pending {
    Data(u64, Vec<u8>),
    Len(u64),
}

/// The calls a fault may fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Write,
    SetLen,
    Sync,
}

/// The faults of a [`SimDisk`]: `()` has none.
pub trait Faults: Sized + Send + 'static {
    /// A resize is durable at once (only writes wait for a sync); else it waits as a write does.
    const SIZES_DURABLE: bool = false;

    /// Runs before the disk is locked, so that a gate may hold the call here.
    fn gate(_disk: &SimDisk<Self>, _op: Op) {}

    /// Runs under the disk's lock before the call changes anything: an error fails the call,
    /// and may change the disk too (a failed sync may drop its writes).
    fn check(_sim: &mut Sim<Self>, _op: Op) -> std::io::Result<()> {
        Ok(())
    }
}

impl Faults for () {}

/// The power goes after `budget` writes, resizes and syncs (`None`: never); every call fails
/// after that.
#[derive(Debug, Default)]
pub struct PowerCut {
    pub budget: Option<u64>,
    pub cut: bool,
}

impl PowerCut {
    pub fn after(budget: Option<u64>) -> Self {
        PowerCut { budget, cut: false }
    }
}

impl Faults for PowerCut {
    fn check(sim: &mut Sim<Self>, _op: Op) -> std::io::Result<()> {
        let cut = &mut sim.faults;
        if cut.cut {
            return Err(std::io::Error::other("power is off"));
        }
        match cut.budget {
            Some(0) => {
                cut.cut = true;
                Err(std::io::Error::other("power cut"))
            }
            Some(n) => {
                cut.budget = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

/// A redb disk in memory that keeps what a power cut would leave apart from what reads see,
/// with the faults `F` injected.
pub struct SimDisk<F = ()>(Arc<Mutex<Sim<F>>>);

impl<F> Clone for SimDisk<F> {
    fn clone(&self) -> Self {
        SimDisk(Arc::clone(&self.0))
    }
}

impl<F: Default> Default for SimDisk<F> {
    fn default() -> Self {
        SimDisk::of(Vec::new(), F::default())
    }
}

impl<F> std::fmt::Debug for SimDisk<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimDisk")
    }
}

impl<F> SimDisk<F> {
    /// A disk that holds `image`, synced.
    pub fn of(image: Vec<u8>, faults: F) -> Self {
        SimDisk(Arc::new(Mutex::new(Sim {
            durable: image.clone(),
            live: image,
            pending: Vec::new(),
            faults,
        })))
    }

    pub fn sim(&self) -> MutexGuard<'_, Sim<F>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<F> Sim<F> {
    /// What the platters hold after a power cut: the durable image plus whichever unsynced
    /// writes happened to land (`keep` decides, in order).
    pub fn crash_image(&self, mut keep: impl FnMut() -> bool) -> Vec<u8> {
        let mut image = self.durable.clone();
        for write in &self.pending {
            if !keep() {
                continue;
            }
            match write {
                Pending::Data(offset, data) => put(&mut image, *offset, data),
                Pending::Len(len) => image.resize(*len as usize, 0),
            }
        }
        image
    }
}

/// Writes `data` at `offset`, growing `image` as a file grows.
pub fn put(image: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let (start, end) = (offset as usize, offset as usize + data.len());
    if image.len() < end {
        image.resize(end, 0);
    }
    image[start..end].copy_from_slice(data);
}

impl<F: Faults> redb::StorageBackend for SimDisk<F> {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.sim().live.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let sim = self.sim();
        let data = sim
            .live
            .get(offset as usize..offset as usize + out.len())
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        out.copy_from_slice(data);
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        F::gate(self, Op::SetLen);
        let mut sim = self.sim();
        F::check(&mut sim, Op::SetLen)?;
        sim.live.resize(len as usize, 0);
        if F::SIZES_DURABLE {
            sim.durable.resize(len as usize, 0);
        } else {
            sim.pending.push(Pending::Len(len));
        }
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        F::gate(self, Op::Sync);
        let mut sim = self.sim();
        F::check(&mut sim, Op::Sync)?;
        // durable + every pending write = live; applying them is cheaper than a copy of live.
        for write in std::mem::take(&mut sim.pending) {
            match write {
                Pending::Data(offset, data) => put(&mut sim.durable, offset, &data),
                Pending::Len(len) => sim.durable.resize(len as usize, 0),
            }
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        F::gate(self, Op::Write);
        let mut sim = self.sim();
        F::check(&mut sim, Op::Write)?;
        put(&mut sim.live, offset, data);
        sim.pending.push(Pending::Data(offset, data.to_vec()));
        Ok(())
    }
}
