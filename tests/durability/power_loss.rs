//! Power-loss simulation: a redb `StorageBackend` keeps the *durable* image (what the last
//! `sync_data` covered) apart from the *live* one and cuts the power at a chosen write. The
//! crash image is the durable image plus a random subset of the unsynced writes (a disk may
//! have written any of them, in any mix). Reopening from it must keep every acknowledged
//! result, and ledger rows written by effects must match the completed responses key by key.
//! This reaches states a SIGKILL cannot: after a kill the OS still writes what the
//! process handed it; after a power cut, unsynced writes are lost or torn.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Durability, Key, ManualClock, Result, Store, Timestamp};

use crate::acks;
use acks::{Acks, Event, LEDGER, check_ledger, complete, fingerprint};

const RETENTION: Duration = Duration::from_secs(3600);

#[derive(Debug)]
enum Pending {
    Data(u64, Vec<u8>),
    Len(u64),
}

#[derive(Debug, Default)]
struct Disk {
    live: Vec<u8>,
    durable: Vec<u8>,
    pending: Vec<Pending>,
    /// Writes (and resizes) left before the power goes; `None` means never.
    budget: Option<u64>,
    cut: bool,
}

impl Disk {
    fn tick(&mut self) -> std::io::Result<()> {
        if self.cut {
            return Err(std::io::Error::other("power is off"));
        }
        match self.budget {
            Some(0) => {
                self.cut = true;
                Err(std::io::Error::other("power cut"))
            }
            Some(n) => {
                self.budget = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// What the platters hold after the cut: the durable image plus whichever unsynced
    /// writes happened to land (`keep` decides, in order).
    fn crash_image(&self, mut keep: impl FnMut() -> bool) -> Vec<u8> {
        let mut image = self.durable.clone();
        for write in &self.pending {
            if !keep() {
                continue;
            }
            match write {
                Pending::Data(offset, data) => apply(&mut image, *offset, data),
                Pending::Len(len) => image.resize(*len as usize, 0),
            }
        }
        image
    }
}

fn apply(image: &mut Vec<u8>, offset: u64, data: &[u8]) {
    let (start, end) = (offset as usize, offset as usize + data.len());
    if image.len() < end {
        image.resize(end, 0);
    }
    image[start..end].copy_from_slice(data);
}

#[derive(Debug, Clone)]
struct SimBackend(Arc<Mutex<Disk>>);

impl SimBackend {
    fn new(image: Vec<u8>, budget: Option<u64>) -> Self {
        SimBackend(Arc::new(Mutex::new(Disk {
            durable: image.clone(),
            live: image,
            budget,
            ..Disk::default()
        })))
    }

    fn disk(&self) -> std::sync::MutexGuard<'_, Disk> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl redb::StorageBackend for SimBackend {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.disk().live.len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let disk = self.disk();
        let (start, end) = (offset as usize, offset as usize + out.len());
        let data = disk
            .live
            .get(start..end)
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        out.copy_from_slice(data);
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        let mut disk = self.disk();
        disk.tick()?;
        disk.live.resize(len as usize, 0);
        disk.pending.push(Pending::Len(len));
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        let mut disk = self.disk();
        disk.tick()?;
        // durable + every pending write = live; applying them is cheaper than a copy of live.
        let pending = std::mem::take(&mut disk.pending);
        for write in pending {
            match write {
                Pending::Data(offset, data) => apply(&mut disk.durable, offset, &data),
                Pending::Len(len) => disk.durable.resize(len as usize, 0),
            }
        }
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let mut disk = self.disk();
        disk.tick()?;
        apply(&mut disk.live, offset, data);
        disk.pending.push(Pending::Data(offset, data.to_vec()));
        Ok(())
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn open(backend: SimBackend, clock: &ManualClock, durability: Durability) -> Result<Store> {
    Store::builder()
        .retention(RETENTION)
        .lease(Duration::from_secs(30))
        .durability(durability)
        .max_batch(16)
        // A small log, so that checkpoints (durable redb commits) happen every few dozen
        // batches and the cuts land in them as well as in log writes.
        .log_size(32 << 10)
        .effect_table(LEDGER)
        .clock(clock.clone())
        .open_with_backend(backend)
}

/// Four threads claim, complete and release their own keys until the power goes.
fn workload(store: &Store, acks: &Mutex<Acks>, iteration: usize) {
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || {
                for i in 0..200 {
                    let name = format!("p{iteration}-t{t}-{i}");
                    if step(store, acks, &name, i).is_err() {
                        return;
                    }
                }
            });
        }
    });
}

fn step(store: &Store, acks: &Mutex<Acks>, name: &str, i: usize) -> Result<()> {
    let ack = |kind, token, clock| {
        let event = Event { kind, token, clock };
        acks.lock().expect("acks").record(name, event);
    };
    let now = store.now()?.as_millis();
    let Claim::Acquired(lease) = store.claim(&Key::new(name)?, fingerprint(name))? else {
        panic!("{name}: fresh key not acquired");
    };
    ack('A', lease.token(), now);
    match i % 4 {
        0 | 1 => {
            complete(store, &lease, name)?;
            ack('C', lease.token(), now);
        }
        2 => {
            ack('r', lease.token(), now);
            store.release(&lease)?;
            ack('R', lease.token(), now);
        }
        _ => {}
    }
    Ok(())
}

fn run(durability: Durability, iterations: usize, seed: u64) -> Result<()> {
    let mut rng = Rng(seed);
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let acks = Mutex::new(Acks::default());
    let mut image = Vec::new();
    let (mut cuts_in_open, mut checked, mut torn_writes, mut rows) = (0, 0, 0, 0);
    for iteration in 0..iterations {
        let budget = 1 + rng.next() % 600;
        let backend = SimBackend::new(image.clone(), Some(budget));
        match open(backend.clone(), &clock, durability) {
            Ok(store) => {
                workload(&store, &acks, iteration);
                drop(store);
            }
            Err(_) => cuts_in_open += 1,
        }
        let disk = backend.disk();
        torn_writes += disk.pending.len();
        let crash = disk.crash_image(|| rng.next().is_multiple_of(2));
        drop(disk);

        // Power back: reopen from what the disk kept.
        let recovered = SimBackend::new(crash, None);
        let store = open(recovered.clone(), &clock, durability)?;
        let report = store.verify()?;
        assert!(report.is_clean(), "iteration {iteration}: {report:?}");
        checked += acks
            .lock()
            .expect("acks")
            .check(&store, store.now()?.as_millis(), RETENTION)?;
        rows += check_ledger(&store, store.now()?.as_millis(), RETENTION)?;
        let fresh = Key::new(&format!("after-{iteration}"))?;
        let Claim::Acquired(lease) = store.claim(&fresh, fingerprint("after"))? else {
            panic!("iteration {iteration}: the recovered store refused a fresh claim");
        };
        store.release(&lease)?;
        drop(store);
        image = recovered.disk().live.clone();
    }
    println!(
        "power loss ({durability:?}): {iterations} cuts ({cuts_in_open} during open), \
         {torn_writes} unsynced writes randomly kept or lost, {checked} key checks, \
         {rows} ledger rows matched to their responses"
    );
    assert!(rows > 0, "no completion wrote a ledger row");
    Ok(())
}

#[test]
fn power_loss_keeps_every_acknowledged_result_immediate() -> Result<()> {
    run(Durability::Immediate, 150, 0x1234_5678_9abc_def1)
}

#[test]
fn power_loss_keeps_every_acknowledged_result_quick_repair() -> Result<()> {
    run(Durability::QuickRepair, 150, 0x0fed_cba9_8765_4321)
}
