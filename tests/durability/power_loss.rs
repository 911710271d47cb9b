//! Power-loss simulation: a redb `StorageBackend` keeps the *durable* image (what the last
//! `sync_data` covered) apart from the *live* one and cuts the power at a chosen write. The
//! crash image is the durable image plus a random subset of the unsynced writes (a disk may
//! have written any of them, in any mix). Reopening from it must keep every acknowledged
//! result, and ledger rows written by effects must match the completed responses key by key.
//! This reaches states a SIGKILL cannot: after a kill the OS still writes what the
//! process handed it; after a power cut, unsynced writes are lost or torn. 30 cuts per test
//! under `cargo test`, 150 with `IDEMPOTENCY_TEST_SCALE=full` (as CI runs it).

use std::sync::Mutex;
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Key, ManualClock, Recovery, Result, Store, Timestamp};

use crate::acks;
use crate::common::disk::{PowerCut, SimDisk};
use crate::common::{Rng, scaled};
use acks::{Acks, Event, LEDGER, check_ledger, complete, fingerprint};

const RETENTION: Duration = Duration::from_secs(3600);

/// The simulated disk, its power cut after a budget of writes, resizes and syncs.
type SimBackend = SimDisk<PowerCut>;

fn open(backend: SimBackend, clock: &ManualClock, durability: Recovery) -> Result<Store> {
    Store::builder()
        .retention(RETENTION)
        .lease(Duration::from_secs(30))
        .recovery(durability)
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

fn run(durability: Recovery, iterations: usize, seed: u64) -> Result<()> {
    let mut rng = Rng(seed);
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let acks = Mutex::new(Acks::default());
    let mut image = Vec::new();
    let (mut cuts_in_open, mut checked, mut torn_writes, mut rows) = (0, 0, 0, 0);
    for iteration in 0..iterations {
        let budget = 1 + rng.next() % 600;
        let backend = SimDisk::of(image.clone(), PowerCut::after(Some(budget)));
        match open(backend.clone(), &clock, durability) {
            Ok(store) => {
                workload(&store, &acks, iteration);
                drop(store);
            }
            Err(_) => cuts_in_open += 1,
        }
        let disk = backend.sim();
        torn_writes += disk.pending.len();
        let crash = disk.crash_image(|| rng.next().is_multiple_of(2));
        drop(disk);

        // Power back: reopen from what the disk kept.
        let recovered = SimDisk::of(crash, PowerCut::after(None));
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
        image = recovered.sim().live.clone();
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
    run(Recovery::FullRepair, scaled(30, 150), 0x1234_5678_9abc_def1)
}

#[test]
fn power_loss_keeps_every_acknowledged_result_quick_repair() -> Result<()> {
    run(
        Recovery::QuickRepair,
        scaled(30, 150),
        0x0fed_cba9_8765_4321,
    )
}
