//! The flush thread: writes the overlay's frozen generation into redb, off the writers' path.
//!
//! Writing the overlay into redb (a B-tree insert per record and index entry, then a commit without
//! a sync) took a large share of the group-commit leader's time at 64 threads, while the machine's
//! other core sat idle (BENCHMARKS.md, "Figures behind the defaults"). The leader now freezes a
//! full overlay generation and goes on with the next batch; this thread writes the frozen one and
//! reports back. The leader collects the report under the writer lock and only then empties the
//! frozen generation, so a batch's view (a redb snapshot plus both generations) never loses the
//! frozen changes halfway. One thread per store, stopped and joined when the store closes; redb's
//! page buffers for these commits come from this one thread's allocator arena, not from whichever
//! caller leads.
//!
//! When the log's half fills up, the frozen generation is everything logged so far, and the
//! thread commits it durably as a merge (`Task::Merge`) while the writers go on in
//! the log's other half.

use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};
use redb::Database;

use crate::engine::apply;
use crate::engine::contain::contain_then;
use crate::engine::meta::Counters;
use crate::engine::overlay::Shared;
use crate::engine::poison::Poison;
use crate::engine::snapshot::Snapshots;
use crate::engine::stats::EngineStats;
use crate::error::{Error, Result};

pub(crate) struct Flusher {
    shared: Arc<Channel>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Channel {
    state: Mutex<Phase>,
    changed: Condvar,
}

#[derive(Default)]
enum Phase {
    #[default]
    Idle,
    /// The frozen generation waits to be written.
    Requested(Task),
    Writing,
    /// Written (or failed); not yet collected.
    Done(Task, Result<()>),
    Stop,
}

/// What the thread does with a frozen generation.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Task {
    /// A commit without a sync: the log holds the changes.
    Flush,
    /// A durable commit that also records the counters and that the log is applied up to
    /// `seq` (the generation holds every change logged until then).
    Merge {
        seq: u64,
        counters: Counters,
        quick_repair: bool,
    },
}

impl Flusher {
    pub(crate) fn start(
        db: Arc<Database>,
        overlay: Arc<Shared>,
        snapshots: Arc<Snapshots>,
        poison: Arc<Poison>,
        stats: Arc<EngineStats>,
    ) -> Result<Flusher> {
        let shared = Arc::new(Channel::default());
        let channel = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("idempotency-store-flush".into())
            .spawn(move || {
                let tables = Tables {
                    db: &db,
                    overlay: &overlay,
                    snapshots: &snapshots,
                };
                run(&channel, &tables, &poison, &stats)
            })
            .map_err(|err| Error::storage("starting the flush thread", err))?;
        Ok(Flusher {
            shared,
            thread: Some(thread),
        })
    }

    /// Whether the thread may be given a generation: it is not writing one, and its last
    /// report has been collected.
    pub(crate) fn idle(&self) -> bool {
        matches!(*self.shared.state.lock(), Phase::Idle)
    }

    /// Whether the thread is writing a generation (or about to): a finished one waiting to be
    /// collected does not count.
    pub(crate) fn busy(&self) -> bool {
        matches!(
            *self.shared.state.lock(),
            Phase::Requested(_) | Phase::Writing
        )
    }

    /// Hands the frozen generation to the thread; it must be idle.
    pub(crate) fn request(&self, job: Task) {
        *self.shared.state.lock() = Phase::Requested(job);
        self.shared.changed.notify_all();
    }

    /// The outcome of the thread's last job, if it has finished one not yet collected; with
    /// `wait`, first waits for a job in progress to finish.
    pub(crate) fn collect(&self, wait: bool) -> Option<(Task, Result<()>)> {
        let mut state = self.shared.state.lock();
        while wait && matches!(*state, Phase::Requested(_) | Phase::Writing) {
            self.shared.changed.wait(&mut state);
        }
        match std::mem::take(&mut *state) {
            Phase::Done(job, result) => Some((job, result)),
            other => {
                *state = other;
                None
            }
        }
    }

    /// Stops the thread (after the write in progress, if any) and joins it.
    pub(crate) fn stop(&mut self) {
        {
            let mut state = self.shared.state.lock();
            while matches!(*state, Phase::Requested(_) | Phase::Writing) {
                self.shared.changed.wait(&mut state);
            }
            *state = Phase::Stop;
        }
        self.shared.changed.notify_all();
        if let Some(thread) = self.thread.take() {
            // The thread contains its own panics; a join error cannot carry anything to report.
            let _ = thread.join();
        }
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What the thread writes: the frozen generation of `overlay` into `db`, each commit followed
/// by a release of the shared snapshot in `snapshots` (see `write`).
struct Tables<'a> {
    db: &'a Database,
    overlay: &'a Shared,
    snapshots: &'a Snapshots,
}

fn run(channel: &Channel, tables: &Tables<'_>, poison: &Poison, stats: &EngineStats) {
    loop {
        let job = {
            let mut state = channel.state.lock();
            let job = loop {
                match *state {
                    Phase::Requested(job) => break job,
                    Phase::Stop => return,
                    _ => channel.changed.wait(&mut state),
                }
            };
            *state = Phase::Writing;
            job
        };
        // A poisoned store writes nothing more: a merge would record as durable a state the
        // disk may not hold. A panic halfway through a commit poisons it.
        let result = contain_then(
            "writing the overlay into the tables",
            || {
                poison.check()?;
                write(tables, job, stats)
            },
            |err| poison.set(Arc::new(err.clone())),
        );
        *channel.state.lock() = Phase::Done(job, result);
        channel.changed.notify_all();
    }
}

/// The frozen generation into redb, in one commit. Readers need not know of the commit (the
/// overlay keeps the generation until the writer drops it), but it drops their shared
/// snapshot: one kept across commits would keep redb from reusing the pages they free.
fn write(tables: &Tables<'_>, job: Task, stats: &EngineStats) -> Result<()> {
    let Tables {
        db,
        overlay,
        snapshots,
    } = *tables;
    let started = std::time::Instant::now();
    let mut txn = db.begin_write()?;
    overlay.with_changes(false, |changes| {
        apply::write(&txn, changes, overlay.registry())
    })?;
    match job {
        Task::Flush => txn
            .set_durability(redb::Durability::None)
            .map_err(|err| Error::storage("committing a batch", err))?,
        Task::Merge {
            seq,
            counters,
            quick_repair,
        } => counters.merge(&mut txn, seq, quick_repair)?,
    }
    txn.commit()?;
    snapshots.release();
    if matches!(job, Task::Merge { .. }) {
        stats.merged(started);
    }
    Ok(())
}
