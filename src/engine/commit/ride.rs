//! Riders: a sweep's step that joins the next batch of other callers' calls instead of
//! leading one of its own (see `engine::sweep`).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{Batch, Committer, Job, Pending, Slot, Turn};
use crate::error::Result;

impl<T> Slot<T> {
    /// Waits up to `timeout` for this caller's turn to lead or its result; `None` if neither
    /// came (or the wait woke early).
    fn wait_for(&self, timeout: Duration) -> Option<Turn<T>> {
        let mut state = self.state.lock();
        if matches!(state.turn, Turn::Queued) {
            self.changed.wait_for(&mut state, timeout);
        }
        match std::mem::replace(&mut state.turn, Turn::Queued) {
            Turn::Queued => None,
            turn => Some(turn),
        }
    }
}

impl Committer {
    /// Write calls so far that shared a batch with a rider.
    pub(crate) fn carried(&self) -> u64 {
        self.carried.load(Ordering::Relaxed)
    }

    /// Runs `rider` (a sweep's step), whose caller waits on `slot`, in the next batch of other
    /// callers' calls, after them: it adds no sync of its own, and no caller queues behind a
    /// batch of its own. Only if no leader is active when `patience` has passed (the store is
    /// idle) does it lead a batch of its own. A second rider while one waits is queued as any
    /// call. Also says whether it rode in another caller's batch.
    pub(crate) fn ride<T, F>(
        &self,
        rider: Box<dyn Pending>,
        slot: &Slot<T>,
        patience: Duration,
        run: F,
    ) -> Result<(T, bool)>
    where
        F: Fn(&mut Batch) -> Result<()>,
    {
        {
            let mut queue = self.queue.lock();
            if queue.rider.is_some() {
                drop(queue);
                return self
                    .submit(Job::Write(rider), slot, run)
                    .map(|t| (t, false));
            }
            queue.rider = Some(rider);
        }
        let mut rode = true;
        loop {
            match slot.wait_for(patience) {
                Some(Turn::Done(result)) => return result.map(|t| (t, rode)),
                Some(Turn::Lead) => self.lead(&run),
                // `wait_for` answers `None` for a turn still queued.
                Some(Turn::Queued) | None => {
                    let mut queue = self.queue.lock();
                    // No leader: the queue is empty, so the rider goes to its head and leads.
                    if !queue.leader
                        && let Some(rider) = queue.rider.take()
                    {
                        queue.jobs.push_back(Job::Write(rider));
                        queue.leader = true;
                        drop(queue);
                        rode = false;
                        slot.set(Turn::Lead);
                    }
                }
            }
        }
    }
}
