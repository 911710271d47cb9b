//! Poisoning: a write or sync of the store's file that fails with `EIO` at any step of a batch, a flush, a merge or the close makes the store
//! refuse every later write with `Error::Poisoned` while reads go on, and so does a sync that
//! fails with `ENOSPC` or `EDQUOT`; a full disk (`ENOSPC`, `EDQUOT`) refused before the write
//! does not. Reopened from what the disk holds (the synced image,
//! as after a power cut, and the live one, as after a clean restart), the store keeps every
//! acknowledged result and serves nothing unacknowledged as completed. Half the completions
//! write a ledger row through an effect (`acks::complete`): rows and responses must match.
//!
//! The storage backend models the kernel after a failed sync as in PostgreSQL's "fsyncgate":
//! the unsynced writes stay readable but are marked clean, so a later successful sync never
//! makes them durable. A store that went on writing and merging after such a failure
//! would record as durable a state the disk does not hold.

use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Error, Key, ManualClock, Result, Store, Timestamp};

use crate::acks;
use crate::common::disk::{Faults, Op, Sim, SimDisk};
use acks::{Acks, Event, LEDGER, check_ledger, complete, fingerprint, response_for};

const RETENTION: Duration = Duration::from_secs(3600);
/// Enough for the log (halves of 8 KiB) to switch halves and merge a few times.
const KEYS: usize = 80;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `write` and `set_len`.
    Write,
    Sync,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    Eio,
    Enospc,
    Edquot,
}

impl Failure {
    /// Whether this failure of a call of `kind` poisons the store: anything on a sync (its
    /// writes were handed over already), and anything but a full disk on a write.
    fn poisons(self, kind: Kind) -> bool {
        kind == Kind::Sync || self == Failure::Eio
    }
}

#[derive(Debug, Clone, Copy)]
struct Plan {
    kind: Kind,
    /// The failing call is this many calls of `kind` in.
    nth: u64,
    failure: Failure,
}

/// The planned fault of a [`FaultyDisk`], and its calls so far.
#[derive(Debug, Default)]
struct Counts {
    writes: u64,
    syncs: u64,
    plan: Option<Plan>,
    fired: bool,
}

impl Counts {
    /// Counts a call of `kind`; the planned failure if this is it.
    fn tick(&mut self, kind: Kind) -> Option<Failure> {
        let count = match kind {
            Kind::Write => &mut self.writes,
            Kind::Sync => &mut self.syncs,
        };
        let n = *count;
        *count += 1;
        let plan = self.plan.filter(|p| p.kind == kind && p.nth == n)?;
        self.plan = None;
        self.fired = true;
        Some(plan.failure)
    }
}

fn fail(failure: Failure) -> std::io::Error {
    match failure {
        // Linux's numbers; the store tells them apart by `ErrorKind` (StorageFull for ENOSPC).
        Failure::Eio => std::io::Error::from_raw_os_error(5),
        Failure::Enospc => std::io::Error::from(std::io::ErrorKind::StorageFull),
        Failure::Edquot => std::io::Error::from(std::io::ErrorKind::QuotaExceeded),
    }
}

impl Faults for Counts {
    // Sizes are synced at once here; the writes are what a failed sync loses.
    const SIZES_DURABLE: bool = true;

    fn check(sim: &mut Sim<Self>, op: Op) -> std::io::Result<()> {
        let kind = if op == Op::Sync {
            Kind::Sync
        } else {
            Kind::Write
        };
        let Some(failure) = sim.faults.tick(kind) else {
            return Ok(());
        };
        if op == Op::Sync {
            // fsyncgate: the pages that failed to write are dropped from the writeback, clean.
            sim.pending.clear();
        }
        Err(fail(failure))
    }
}

type FaultyDisk = SimDisk<Counts>;

fn faulty(plan: Option<Plan>) -> FaultyDisk {
    SimDisk::of(
        Vec::new(),
        Counts {
            plan,
            ..Counts::default()
        },
    )
}

fn open(disk: FaultyDisk, clock: &ManualClock) -> Result<Store> {
    Store::builder()
        .retention(RETENTION)
        .lease(Duration::from_secs(30))
        // The smallest log: its halves fill every dozen pairs, so faults land in log writes,
        // in the flush thread's merges and in the batches that merge themselves.
        .log_size(16 << 10)
        .effect_table(LEDGER)
        .clock(clock.clone())
        .open_with_backend(disk)
}

/// Claims and completes (or releases) keys one by one until a call fails; returns the
/// error.
fn workload(store: &Store, acks: &mut Acks, clock: &ManualClock) -> Option<Error> {
    for i in 0..KEYS {
        let name = format!("k{i}");
        clock.advance(Duration::from_millis(1));
        if let Err(err) = step(store, acks, &name, i) {
            return Some(err);
        }
    }
    None
}

fn step(store: &Store, acks: &mut Acks, name: &str, i: usize) -> Result<()> {
    let now = store.now()?.as_millis();
    let mut ack = |kind, token| {
        acks.record(
            name,
            Event {
                kind,
                token,
                clock: now,
            },
        )
    };
    let Claim::Acquired(lease) = store.claim(&Key::new(name)?, fingerprint(name))? else {
        panic!("{name}: fresh key not acquired");
    };
    ack('A', lease.token());
    if i % 5 == 4 {
        ack('r', lease.token());
        store.release(&lease)?;
        ack('R', lease.token());
    } else {
        complete(store, &lease, name)?;
        ack('C', lease.token());
    }
    Ok(())
}

/// The outcome of one run with one planned fault.
struct Run {
    fired: bool,
    opened: bool,
}

fn run(plan: Option<Plan>) -> Result<Run> {
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let disk = faulty(plan);
    let mut acks = Acks::default();
    let store = match open(disk.clone(), &clock) {
        Ok(store) => store,
        Err(_) => {
            // Nothing was acknowledged; the half-made file is checked by
            // tests/durability/damaged.rs.
            return Ok(Run {
                fired: true,
                opened: false,
            });
        }
    };
    let failed = workload(&store, &mut acks, &clock);
    // Waits for the flush thread's report, so a fault there has been seen.
    let settled = store.stats();
    let poisons = plan.is_some_and(|p| p.failure.poisons(p.kind));
    let fired = disk.sim().faults.fired;
    let fresh = store.claim(&Key::new("fresh")?, fingerprint("fresh"));
    if fired && poisons {
        // Poisoned, or the fault fired in its own flush.
        assert!(
            matches!(settled, Err(Error::Poisoned { .. } | Error::Storage { .. })),
            "{plan:?}: stats after the fault: {settled:?}"
        );
        assert!(
            matches!(fresh, Err(Error::Poisoned { .. })),
            "{plan:?}: a write after the fault (first error {failed:?}): {fresh:?}"
        );
        let message = fresh.as_ref().err().map(ToString::to_string);
        assert!(message.unwrap_or_default().contains("reopen"));
    } else {
        // No fault yet (or one that fires in this very claim), or a full disk refusing a
        // write: not poison.
        assert!(
            !matches!(fresh, Err(Error::Poisoned { .. })),
            "{plan:?}: poisoned without a fault that may lose data: {fresh:?}"
        );
    }
    let fired_before_close = disk.sim().faults.fired;
    let closed = store.close();
    if fired_before_close && poisons {
        assert!(
            matches!(closed, Err(Error::Poisoned { .. })),
            "{plan:?}: close of a poisoned store: {closed:?}"
        );
    } else if disk.sim().faults.fired && !fired_before_close {
        // The fault fired in the close (its merge, or redb's own close).
        assert!(
            closed.is_err(),
            "{plan:?}: a fault in the close went unreported"
        );
    } else if !fired_before_close {
        closed?;
    }
    let fired = disk.sim().faults.fired;
    // Power back on with what was synced, and a clean restart with what the kernel kept.
    let (durable, live) = {
        let disk = disk.sim();
        (disk.durable.clone(), disk.live.clone())
    };
    for image in [durable, live] {
        let store = open(FaultyDisk::of(image, Counts::default()), &clock)?;
        assert!(store.verify()?.is_clean(), "{plan:?}");
        acks.check(&store, store.now()?.as_millis(), RETENTION)?;
        check_ledger(&store, store.now()?.as_millis(), RETENTION)?;
        let Claim::Acquired(lease) = store.claim(&Key::new("after")?, fingerprint("after"))? else {
            panic!("{plan:?}: the reopened store refused a fresh claim");
        };
        store.release(&lease)?;
        store.close()?;
    }
    Ok(Run {
        fired,
        opened: true,
    })
}

/// Every call of `kind` in turn fails with `failure`; returns how many runs opened a store.
fn every_step(kind: Kind, failure: Failure) -> Result<usize> {
    let clean = faulty(None);
    {
        let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
        let store = open(clean.clone(), &clock)?;
        let mut acks = Acks::default();
        assert!(workload(&store, &mut acks, &clock).is_none());
        store.close()?;
    }
    let calls = match kind {
        Kind::Write => clean.sim().faults.writes,
        Kind::Sync => clean.sim().faults.syncs,
    };
    let mut opened = 0;
    for nth in 0..=calls {
        let plan = Plan { kind, nth, failure };
        let outcome = run(Some(plan))?;
        opened += usize::from(outcome.opened);
        assert!(
            outcome.fired || nth == calls,
            "{plan:?}: the fault never fired (the workload's calls changed)"
        );
    }
    println!(
        "{failure:?} on {kind:?}: {} steps, {opened} with a store open",
        calls + 1
    );
    assert!(
        opened > calls as usize / 2,
        "most faults must land after the open"
    );
    Ok(opened)
}

#[test]
fn eio_on_any_write_poisons_and_loses_nothing_acknowledged() -> Result<()> {
    every_step(Kind::Write, Failure::Eio).map(drop)
}

#[test]
fn eio_on_any_sync_poisons_and_loses_nothing_acknowledged() -> Result<()> {
    every_step(Kind::Sync, Failure::Eio).map(drop)
}

#[test]
fn enospc_on_any_write_does_not_poison_and_loses_nothing_acknowledged() -> Result<()> {
    every_step(Kind::Write, Failure::Enospc).map(drop)
}

#[test]
fn enospc_on_any_sync_poisons_and_loses_nothing_acknowledged() -> Result<()> {
    every_step(Kind::Sync, Failure::Enospc).map(drop)
}

#[test]
fn edquot_on_any_sync_poisons_and_loses_nothing_acknowledged() -> Result<()> {
    every_step(Kind::Sync, Failure::Edquot).map(drop)
}

#[test]
fn edquot_on_any_write_does_not_poison_and_loses_nothing_acknowledged() -> Result<()> {
    every_step(Kind::Write, Failure::Edquot).map(drop)
}

#[test]
fn reads_go_on_while_poisoned() -> Result<()> {
    let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
    let disk = faulty(None);
    let store = open(disk.clone(), &clock)?;
    let mut acks = Acks::default();
    for i in 0..3 {
        step(&store, &mut acks, &format!("k{i}"), i)?;
    }
    // The next sync fails: the next batch's log entry.
    let syncs = disk.sim().faults.syncs;
    disk.sim().faults.plan = Some(Plan {
        kind: Kind::Sync,
        nth: syncs,
        failure: Failure::Eio,
    });
    let failed = step(&store, &mut acks, "k3", 3);
    assert!(matches!(failed, Err(Error::Storage { .. })), "{failed:?}");
    for i in 0..3 {
        let name = format!("k{i}");
        match store.claim(&Key::new(&name)?, fingerprint(&name))? {
            Claim::Completed(replay) => assert_eq!(
                replay.response.body,
                response_for(&name, replay.response_token()).body
            ),
            other => panic!("{name}: {other:?}"),
        }
        assert!(store.lookup(&Key::new(&name)?)?.is_some());
    }
    let refused = store.claim(&Key::new("k9")?, fingerprint("k9"));
    assert!(
        matches!(refused, Err(Error::Poisoned { .. })),
        "{refused:?}"
    );
    Ok(())
}

/// The token a replayed response was stored with (`response_for` puts it in a header).
trait Token {
    fn response_token(&self) -> u64;
}

impl Token for idempotency_store::Replay {
    fn response_token(&self) -> u64 {
        self.response
            .headers
            .iter()
            .find(|(name, _)| name == "x-token")
            .and_then(|(_, v)| v.as_slice().try_into().ok())
            .map_or(0, u64::from_le_bytes)
    }
}
