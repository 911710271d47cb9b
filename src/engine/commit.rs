//! Group commit: many threads' write calls share one transaction and one durable commit.
//!
//! Leader/follower with no thread of its own. A caller queues its operation; if no leader is
//! active it becomes the leader, takes up to `max_batch` queued operations in arrival order,
//! runs them in one transaction and commits, then hands each caller its result and appoints
//! the caller at the head of the queue as the next leader. Callers that queued while that
//! commit was syncing form the next batch, so batches grow with load by themselves and a lone
//! caller never waits for company.
//!
//! Each caller waits on a slot of its own, so a commit wakes exactly its batch's callers and the
//! next leader, not every waiter (with 64 callers a shared condvar made every commit a
//! thundering herd, and halved the batches).

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::engine::ops::{Done, Op};
use crate::error::{Error, Result};

pub(crate) struct Committer {
    queue: Mutex<Queue>,
    max_batch: usize,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<(Op, Arc<Slot>)>,
    /// A leader is running a batch, or has been appointed and will.
    leader: bool,
}

/// Where one caller waits for its turn to lead or for its result.
#[derive(Default)]
struct Slot {
    state: Mutex<Turn>,
    changed: Condvar,
}

#[derive(Default)]
enum Turn {
    #[default]
    Queued,
    Lead,
    Done(Result<Done>),
}

impl Slot {
    fn set(&self, turn: Turn) {
        *self.state.lock() = turn;
        self.changed.notify_one();
    }

    /// Waits until this caller leads or has its result.
    fn wait(&self) -> Turn {
        let mut state = self.state.lock();
        while matches!(*state, Turn::Queued) {
            self.changed.wait(&mut state);
        }
        std::mem::take(&mut *state)
    }
}

impl Committer {
    pub(crate) fn new(max_batch: usize) -> Self {
        Committer {
            queue: Mutex::new(Queue::default()),
            max_batch,
        }
    }

    /// Runs `op` in some batch and returns its result once that batch's commit is durable (or
    /// has failed). `run` executes one batch and returns one result per operation, in order.
    pub(crate) fn submit<F>(&self, op: Op, run: F) -> Result<Done>
    where
        F: Fn(Vec<Op>) -> Vec<Result<Done>>,
    {
        let slot = Arc::new(Slot::default());
        let lead_now = {
            let mut queue = self.queue.lock();
            queue.jobs.push_back((op, Arc::clone(&slot)));
            !std::mem::replace(&mut queue.leader, true)
        };
        if lead_now {
            slot.set(Turn::Lead);
        }
        loop {
            match slot.wait() {
                Turn::Done(result) => return result,
                // A leader is always at the head of the queue, so its own operation is in the
                // batch it runs and the next wait returns its result.
                Turn::Lead => self.lead(&run),
                Turn::Queued => {}
            }
        }
    }

    fn lead<F>(&self, run: &F)
    where
        F: Fn(Vec<Op>) -> Vec<Result<Done>>,
    {
        let (ops, slots): (Vec<Op>, Vec<Arc<Slot>>) = {
            let mut queue = self.queue.lock();
            let n = batch_len(&queue.jobs, self.max_batch);
            queue.jobs.drain(..n).unzip()
        };
        let mut handoff = Handoff {
            committer: self,
            slots,
        };
        let results = run(ops);
        // The next batch starts before this one's callers are woken: waking dozens of threads
        // takes the old leader a while, and the disk would sit idle meanwhile.
        let slots = std::mem::take(&mut handoff.slots);
        drop(handoff);
        for (slot, result) in slots.into_iter().zip(results) {
            slot.set(Turn::Done(result));
        }
    }
}

/// How many queued operations the next batch takes: up to `max`, in arrival order, but a
/// sweep runs alone. A claim queued behind a sweep then waits for at most that one sweep
/// transaction, never for a sweep sharing its own batch.
fn batch_len(jobs: &VecDeque<(Op, Arc<Slot>)>, max: usize) -> usize {
    match jobs.front() {
        Some((op, _)) if op.runs_alone() => 1,
        _ => jobs
            .iter()
            .take(max)
            .take_while(|(op, _)| !op.runs_alone())
            .count(),
    }
}

/// Ends a leadership: every caller of the batch gets a result, even if the batch panicked, and
/// the caller at the head of the queue is appointed to lead the next batch.
struct Handoff<'a> {
    committer: &'a Committer,
    slots: Vec<Arc<Slot>>,
}

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        for slot in self.slots.drain(..) {
            slot.set(Turn::Done(Err(Error::storage(
                "committing a batch",
                std::io::Error::other("the batch was abandoned by a panic"),
            ))));
        }
        let mut queue = self.committer.queue.lock();
        match queue.jobs.front() {
            Some((_, next)) => next.set(Turn::Lead),
            None => queue.leader = false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::fingerprint::Fingerprint;
    use crate::api::key::Key;

    fn queue(ops: &str) -> VecDeque<(Op, Arc<Slot>)> {
        ops.chars()
            .map(|c| {
                let op = match c {
                    's' => Op::Sweep { limit: 1 },
                    _ => Op::Claim {
                        key: Key::new("k").expect("key"),
                        fingerprint: Fingerprint::of(["r"]),
                    },
                };
                (op, Arc::new(Slot::default()))
            })
            .collect()
    }

    #[test]
    fn a_sweep_never_shares_a_batch() {
        assert_eq!(batch_len(&queue("ccscc"), 128), 2);
        assert_eq!(batch_len(&queue("scc"), 128), 1);
        assert_eq!(batch_len(&queue("ss"), 128), 1);
        assert_eq!(batch_len(&queue("cccc"), 3), 3);
        assert_eq!(batch_len(&queue(""), 3), 0);
    }
}
