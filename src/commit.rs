//! Group commit: many threads' write calls share one transaction and one durable commit.
//!
//! Leader/follower on one mutex and condvar, with no thread of its own. A caller queues its
//! operation; if no leader is active it becomes the leader, takes up to `max_batch` queued
//! operations in arrival order, runs them in one transaction and commits, then hands each
//! caller its result. Callers that queued while that commit was syncing form the next batch,
//! so batches grow with load by themselves and a lone caller never waits for company.

use std::collections::VecDeque;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use crate::error::{Error, Result};
use crate::ops::{Done, Op};

type Slot = Arc<Mutex<Option<Result<Done>>>>;

pub(crate) struct Committer {
    queue: Mutex<Queue>,
    settled: Condvar,
    max_batch: usize,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<(Op, Slot)>,
    leader: bool,
}

impl Committer {
    pub(crate) fn new(max_batch: usize) -> Self {
        Committer {
            queue: Mutex::new(Queue::default()),
            settled: Condvar::new(),
            max_batch,
        }
    }

    /// Runs `op` in some batch and returns its result once that batch's commit is durable (or
    /// has failed). `run` executes one batch and returns one result per operation, in order.
    pub(crate) fn submit<F>(&self, op: Op, run: F) -> Result<Done>
    where
        F: Fn(Vec<Op>) -> Vec<Result<Done>>,
    {
        let slot: Slot = Arc::new(Mutex::new(None));
        let mut queue = self.queue.lock();
        queue.jobs.push_back((op, Arc::clone(&slot)));
        loop {
            if let Some(result) = slot.lock().take() {
                return result;
            }
            if queue.leader {
                self.settled.wait(&mut queue);
                continue;
            }
            queue.leader = true;
            let n = batch_len(&queue.jobs, self.max_batch);
            let (ops, slots): (Vec<Op>, Vec<Slot>) = queue.jobs.drain(..n).unzip();
            drop(queue);
            let handoff = Handoff {
                committer: self,
                slots,
            };
            for (slot, result) in handoff.slots.iter().zip(run(ops)) {
                *slot.lock() = Some(result);
            }
            drop(handoff);
            queue = self.queue.lock();
        }
    }
}

/// How many queued operations the next batch takes: up to `max`, in arrival order, but a
/// sweep runs alone. A claim queued behind a sweep then waits for at most that one sweep
/// transaction, never for a sweep sharing its own batch.
fn batch_len(jobs: &VecDeque<(Op, Slot)>, max: usize) -> usize {
    match jobs.front() {
        Some((op, _)) if op.runs_alone() => 1,
        _ => jobs
            .iter()
            .take(max)
            .take_while(|(op, _)| !op.runs_alone())
            .count(),
    }
}

/// Ends a leadership: every caller of the batch gets a result, even if the batch panicked,
/// and the waiting callers are woken so one of them can lead the next batch.
struct Handoff<'a> {
    committer: &'a Committer,
    slots: Vec<Slot>,
}

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        for slot in &self.slots {
            let mut slot = slot.lock();
            if slot.is_none() {
                *slot = Some(Err(Error::storage(
                    "committing a batch",
                    std::io::Error::other("the batch was abandoned by a panic"),
                )));
            }
        }
        self.committer.queue.lock().leader = false;
        self.committer.settled.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::key::Key;

    fn queue(ops: &str) -> VecDeque<(Op, Slot)> {
        ops.chars()
            .map(|c| {
                let op = match c {
                    's' => Op::Sweep { limit: 1 },
                    _ => Op::Claim {
                        key: Key::new("k").expect("key"),
                        fingerprint: Fingerprint::of(["r"]),
                    },
                };
                (op, Slot::default())
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
