//! Group commit: many threads' write calls share one transaction and one durable commit.
//!
//! Leader/follower with no thread of its own. A caller queues its call; if no leader is
//! active it becomes the leader, takes up to `max_batch` queued calls in arrival order,
//! runs them in one transaction and commits, then hands each caller its result and appoints
//! the caller at the head of the queue as the next leader. Callers that queued while that
//! commit was syncing form the next batch, so batches grow with load by themselves and a lone
//! caller never waits for company.
//!
//! Each caller waits on a slot of its own, typed by its call's result, so a commit wakes
//! exactly its batch's callers and the next leader, not every waiter (with 64 callers a shared
//! condvar made every commit a thundering herd, and shrank the batches: BENCHMARKS.md, "Figures
//! behind the defaults"), and no caller can be handed another call's kind of result.
//!
//! A caller that must not block (an async task) queues its call with [`Committer::enqueue`]
//! and awaits its slot as a future ([`Waiting`]). It cannot lead on its own thread, so its call
//! carries an [`Appoint`]: when the call is at the head of the queue and must lead, the
//! appointment starts a leader on a thread that may block ([`Committer::lead_async`]), which
//! goes on leading as long as the next call is another such caller's. A lone async caller then
//! costs one hand-over to that thread, and under load one thread leads batch after batch while
//! the callers only wait for their wake-ups. Where a batch waits for no I/O (a store in
//! memory), an async caller that finds no leader leads on its own thread instead
//! ([`Committer::enqueue_inline`]): the hand-over and the wake-up cost more than the batch.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

use parking_lot::{Condvar, Mutex};

use crate::api::clock::Timestamp;
use crate::engine::batch::{Access, Ctx, Direct, Fail, Layered, Tables};
use crate::engine::ops::Write;
use crate::engine::scan::Swept;
use crate::error::{Error, Result};

mod ride;

pub(crate) struct Committer {
    queue: Mutex<Queue>,
    max_batch: usize,
    /// Write calls that shared a batch with a rider (see [`Committer::ride`]).
    carried: AtomicU64,
}

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// A leader is running a batch, or has been appointed and will.
    leader: bool,
    /// A call waiting to join the next batch of other calls (see [`Committer::ride`]).
    rider: Option<Box<dyn Pending>>,
}

/// Where one caller waits for its turn to lead or for its result: a thread on the condvar,
/// a task through its waker.
pub(crate) struct Slot<T> {
    state: Mutex<State<T>>,
    changed: Condvar,
}

struct State<T> {
    turn: Turn<T>,
    /// The task to wake when the turn changes (an async caller's).
    waker: Option<Waker>,
}

enum Turn<T> {
    Queued,
    Lead,
    Done(Result<T>),
}

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Slot {
            state: Mutex::new(State {
                turn: Turn::Queued,
                waker: None,
            }),
            changed: Condvar::new(),
        }
    }
}

impl<T> Slot<T> {
    fn set(&self, turn: Turn<T>) {
        let waker = {
            let mut state = self.state.lock();
            state.turn = turn;
            state.waker.take()
        };
        self.changed.notify_one();
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Waits until this caller leads or has its result.
    fn wait(&self) -> Turn<T> {
        let mut state = self.state.lock();
        while matches!(state.turn, Turn::Queued) {
            self.changed.wait(&mut state);
        }
        std::mem::replace(&mut state.turn, Turn::Queued)
    }

    /// The result, or `Pending` with `cx`'s waker kept for `set`.
    fn poll(&self, cx: &Context<'_>) -> Poll<Result<T>> {
        let mut state = self.state.lock();
        match std::mem::replace(&mut state.turn, Turn::Queued) {
            Turn::Done(result) => Poll::Ready(result),
            // An async caller is never handed the lead (its appointment is), but it must not
            // wait forever if it were.
            Turn::Lead => Poll::Ready(Err(Error::storage(
                "committing a batch",
                std::io::Error::other("an async caller was asked to lead a batch"),
            ))),
            Turn::Queued => {
                match &mut state.waker {
                    Some(waker) => waker.clone_from(cx.waker()),
                    None => state.waker = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

/// An async caller's result on its way (see [`Committer::enqueue`]): ready once its batch is
/// durable or has failed. Dropping it does not withdraw the call, which runs all the same.
pub(crate) struct Waiting<T> {
    slot: Arc<Slot<T>>,
}

impl<T> Future for Waiting<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        self.slot.poll(cx)
    }
}

/// What an async caller's call does when it must lead its batch: start
/// [`Committer::lead_async`] (through the engine) on a thread that may block, without
/// blocking itself. It is called at most once, and dropped uncalled when another leader takes
/// the call into its batch.
pub(crate) type Appoint = Box<dyn FnOnce() + Send>;

/// A caller's result on its way: the call's own result once applied, handed over only when the
/// batch's fate is known. Dropped without a verdict (a batch abandoned by a panic), it hands
/// over an error, so no caller waits forever and none is told `Ok` for an uncommitted write.
struct Reply<T> {
    slot: Arc<Slot<T>>,
    applied: Option<Result<T>>,
    outcome: Option<Result<T>>,
}

impl<T> Reply<T> {
    fn new(slot: Arc<Slot<T>>) -> Self {
        Reply {
            slot,
            applied: None,
            outcome: None,
        }
    }

    fn committed(&mut self) {
        self.outcome = self.applied.take();
    }

    fn failed(&mut self, err: &Error) {
        self.outcome = Some(Err(err.clone()));
    }
}

impl<T> Drop for Reply<T> {
    fn drop(&mut self) {
        let result = self.outcome.take().unwrap_or_else(|| {
            Err(Error::storage(
                "committing a batch",
                std::io::Error::other("the batch was abandoned by a panic"),
            ))
        });
        self.slot.set(Turn::Done(result));
    }
}

/// A queued write call with its result type erased, so calls of every kind share a batch.
pub(crate) trait Pending: Send {
    /// Appoints this call's caller to lead the next batch; for an async caller, the
    /// appointment to call once the queue's lock is let go.
    fn lead(&mut self) -> Option<Appoint>;
    /// Whether the caller is async (see [`Committer::lead_async`]).
    fn is_async(&self) -> bool;
    /// Applies the call; `Err` fails the whole batch.
    fn apply_direct(&mut self, tables: &mut Tables<Direct<'_>>, ctx: &mut Ctx) -> Result<()>;
    /// Applies the call; `Err` fails the whole batch.
    fn apply_layered(&mut self, tables: &mut Tables<Layered<'_>>, ctx: &mut Ctx) -> Result<()>;
    /// The batch is durable: the caller gets the call's own result.
    fn committed(&mut self);
    /// The batch failed: the caller gets `err`.
    fn failed(&mut self, err: &Error);
    /// The bytes of response or checkpoint the call carries (see `take_batch`).
    fn payload(&self) -> usize;
}

/// A write call and where its result goes.
struct Queued<W: Write> {
    write: Option<W>,
    reply: Reply<W::Output>,
    /// An async caller's appointment; `None` for a caller that leads on its own thread.
    appoint: Option<Appoint>,
    is_async: bool,
}

impl<W: Write> Queued<W> {
    fn apply<A: Access>(&mut self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<()> {
        let Some(write) = self.write.take() else {
            return Ok(());
        };
        self.reply.applied = Some(match write.apply(tables, ctx) {
            Ok(output) => Ok(output),
            Err(Fail::Op(err)) => Err(err),
            Err(Fail::Batch(err)) => return Err(err),
        });
        Ok(())
    }
}

impl<W: Write> Pending for Queued<W> {
    fn lead(&mut self) -> Option<Appoint> {
        if self.is_async {
            return self.appoint.take();
        }
        self.reply.slot.set(Turn::Lead);
        None
    }

    fn is_async(&self) -> bool {
        self.is_async
    }

    fn apply_direct(&mut self, tables: &mut Tables<Direct<'_>>, ctx: &mut Ctx) -> Result<()> {
        self.apply(tables, ctx)
    }

    fn apply_layered(&mut self, tables: &mut Tables<Layered<'_>>, ctx: &mut Ctx) -> Result<()> {
        self.apply(tables, ctx)
    }

    fn committed(&mut self) {
        self.reply.committed();
    }

    fn failed(&mut self, err: &Error) {
        self.reply.failed(err);
    }

    fn payload(&self) -> usize {
        self.write.as_ref().map_or(0, Write::payload)
    }
}

/// A sweep: it scans the expiry index, so it runs alone, in a direct transaction.
pub(crate) struct SweepCall {
    limit: usize,
    reply: Reply<Swept>,
}

impl SweepCall {
    /// Sweeps in `tables`; `Err` fails the transaction.
    pub(crate) fn apply(&mut self, tables: &mut Tables<Direct<'_>>, now: Timestamp) -> Result<()> {
        self.reply.applied = Some(match tables.sweep(now, self.limit) {
            Ok(swept) => Ok(swept),
            Err(Fail::Op(err)) => Err(err),
            Err(Fail::Batch(err)) => return Err(err),
        });
        Ok(())
    }
}

/// A queued call.
pub(crate) enum Job {
    Write(Box<dyn Pending>),
    Sweep(SweepCall),
}

impl Job {
    /// `write`, answered in `slot`.
    pub(crate) fn write<W: Write>(write: W, slot: Arc<Slot<W::Output>>) -> Job {
        Job::Write(Box::new(Queued {
            write: Some(write),
            reply: Reply::new(slot),
            appoint: None,
            is_async: false,
        }))
    }

    /// `write` as a call of its own, for [`Committer::ride`].
    pub(crate) fn pending<W: Write>(write: W, slot: Arc<Slot<W::Output>>) -> Box<dyn Pending> {
        Box::new(Queued {
            write: Some(write),
            reply: Reply::new(slot),
            appoint: None,
            is_async: false,
        })
    }

    /// `write` from an async caller, answered in `slot`, which leads through `appoint`.
    pub(crate) fn write_async<W: Write>(
        write: W,
        slot: Arc<Slot<W::Output>>,
        appoint: Appoint,
    ) -> Job {
        Job::Write(Box::new(Queued {
            write: Some(write),
            reply: Reply::new(slot),
            appoint: Some(appoint),
            is_async: true,
        }))
    }

    /// A sweep of up to `limit` records, answered in `slot`.
    pub(crate) fn sweep(limit: usize, slot: Arc<Slot<Swept>>) -> Job {
        Job::Sweep(SweepCall {
            limit,
            reply: Reply::new(slot),
        })
    }

    fn lead(&mut self) -> Option<Appoint> {
        match self {
            Job::Write(write) => write.lead(),
            Job::Sweep(sweep) => {
                sweep.reply.slot.set(Turn::Lead);
                None
            }
        }
    }

    fn is_async(&self) -> bool {
        matches!(self, Job::Write(write) if write.is_async())
    }
}

/// What one leader runs: write calls that share a transaction, or one sweep.
pub(crate) enum Batch {
    Writes(Vec<Box<dyn Pending>>),
    Sweep(SweepCall),
}

impl Batch {
    fn committed(&mut self) {
        match self {
            Batch::Writes(writes) => writes.iter_mut().for_each(|w| w.committed()),
            Batch::Sweep(sweep) => sweep.reply.committed(),
        }
    }

    fn failed(&mut self, err: &Error) {
        match self {
            Batch::Writes(writes) => writes.iter_mut().for_each(|w| w.failed(err)),
            Batch::Sweep(sweep) => sweep.reply.failed(err),
        }
    }
}

impl Committer {
    pub(crate) fn new(max_batch: usize) -> Self {
        Committer {
            queue: Mutex::new(Queue::default()),
            max_batch,
            carried: AtomicU64::new(0),
        }
    }

    /// Queues `job`; true if no leader was active, so that its caller now leads (its job is
    /// then the only one queued, at the head).
    fn push(&self, job: Job) -> bool {
        let mut queue = self.queue.lock();
        queue.jobs.push_back(job);
        !std::mem::replace(&mut queue.leader, true)
    }

    /// Runs `job`, whose caller waits on `slot`, in some batch and returns its result once that
    /// batch's commit is durable (or has failed). `run` executes one batch: `Ok` means it
    /// committed.
    pub(crate) fn submit<T, F>(&self, job: Job, slot: &Slot<T>, run: F) -> Result<T>
    where
        F: Fn(&mut Batch) -> Result<()>,
    {
        if self.push(job) {
            slot.set(Turn::Lead);
        }
        loop {
            match slot.wait() {
                Turn::Done(result) => return result,
                // A leader is always at the head of the queue, so its own call is in the batch
                // it runs and the next wait returns its result.
                Turn::Lead => self.lead(&run),
                Turn::Queued => {}
            }
        }
    }

    /// Queues an async caller's `job`, answered in `slot`, and returns the future of its
    /// result. If no leader is active, the job's appointment starts one.
    pub(crate) fn enqueue<T>(&self, job: Job, slot: Arc<Slot<T>>) -> Waiting<T> {
        let appoint = {
            let mut queue = self.queue.lock();
            queue.jobs.push_back(job);
            if std::mem::replace(&mut queue.leader, true) {
                None
            } else {
                // No leader: the queue was empty, so the job is at its head.
                queue.jobs.front_mut().and_then(Job::lead)
            }
        };
        if let Some(appoint) = appoint {
            appoint();
        }
        Waiting { slot }
    }

    /// Like [`enqueue`](Self::enqueue), for a store whose batches never wait for I/O (one
    /// held in memory): if no leader is active, this caller leads on its own thread at once,
    /// its batch and the next ones while async callers' calls head the queue, so the returned
    /// future is mostly ready when it is first polled. Its batches take async callers' calls
    /// only: a blocking caller's call may run the caller's own code (an effect), which must
    /// not run on an async runtime's thread. No thread is handed the call and none
    /// is woken for it; a caller that finds a leader at work waits for that leader's wake-up
    /// as in `enqueue`, and a sync caller at the head is appointed as always.
    pub(crate) fn enqueue_inline<T, F>(&self, job: Job, slot: Arc<Slot<T>>, run: &F) -> Waiting<T>
    where
        F: Fn(&mut Batch) -> Result<()>,
    {
        if self.push(job) {
            self.lead_inline(run);
        }
        Waiting { slot }
    }

    /// Leads on an async caller's own thread (see `enqueue_inline`), but for at most
    /// [`INLINE_BATCHES`] batches in a row: callers that keep coming from other threads must
    /// not hold this one, whose other tasks wait, so after that the lead goes to the caller at
    /// the head of the queue as it would from any leader (an async caller's appointment).
    fn lead_inline<F>(&self, run: &F)
    where
        F: Fn(&mut Batch) -> Result<()>,
    {
        for _ in 0..INLINE_BATCHES {
            if !self.lead_batch(run, true, true) {
                return;
            }
        }
        self.pass_on(false);
    }

    /// Leads for an appointed async caller, on a thread that may block: its batch, and the
    /// next ones as long as an async caller's call heads the queue (that caller only waits
    /// for a wake-up, so this thread need not hand over to another). Returns when the queue
    /// is empty or a caller that leads on its own thread is appointed.
    pub(crate) fn lead_async<F>(&self, run: &F)
    where
        F: Fn(&mut Batch) -> Result<()>,
    {
        while self.lead_batch(run, true, false) {}
    }

    fn lead<F>(&self, run: &F)
    where
        F: Fn(&mut Batch) -> Result<()>,
    {
        self.lead_batch(run, false, false);
    }

    /// Runs the batch at the head of the queue; true if this thread is to lead the next one
    /// too (only with `keep`, see `lead_async`).
    fn lead_batch<F>(&self, run: &F, keep: bool, async_only: bool) -> bool
    where
        F: Fn(&mut Batch) -> Result<()>,
    {
        let mut batch = {
            let mut queue = self.queue.lock();
            let mut batch = take_batch(&mut queue.jobs, self.max_batch, async_only);
            if let Batch::Writes(writes) = &mut batch
                && !writes.is_empty()
                && let Some(rider) = queue.rider.take()
            {
                let carried = u64::try_from(writes.len()).unwrap_or(u64::MAX);
                self.carried.fetch_add(carried, Ordering::Relaxed);
                writes.push(rider);
            }
            batch
        };
        // Declared after `batch`, so dropped before it even in a panic: the next leader is
        // appointed before this batch's callers get their results.
        let handoff = Handoff {
            committer: self,
            passed: false,
        };
        match run(&mut batch) {
            Ok(()) => batch.committed(),
            Err(err) => batch.failed(&err),
        }
        // The next batch starts before this one's callers are woken: waking dozens of threads
        // takes the old leader a while, and the disk would sit idle meanwhile. (A leader that
        // keeps the lead wakes its async callers first: a wake-up is short.)
        let again = handoff.pass(keep);
        drop(batch);
        again
    }

    /// Ends a leadership: the caller at the head of the queue is appointed to lead the next
    /// batch, or, with `keep` and an async caller at the head, the leader keeps the lead
    /// (true).
    fn pass_on(&self, keep: bool) -> bool {
        let appoint = {
            let mut queue = self.queue.lock();
            match queue.jobs.front_mut() {
                Some(next) if keep && next.is_async() => return true,
                Some(next) => next.lead(),
                None => {
                    queue.leader = false;
                    None
                }
            }
        };
        // Outside the lock: an appointment hands work to another thread.
        if let Some(appoint) = appoint {
            appoint();
        }
        false
    }
}

/// Takes the next batch from the front of `jobs`: up to `max` write calls in arrival order,
/// (and at most `BATCH_BYTES` of responses), but a direct sweep round runs alone: a claim
/// queued behind it waits for at most that one transaction. (A sweep's step rides in a batch
/// of write calls instead: `commit::ride`.)
fn take_batch(jobs: &mut VecDeque<Job>, max: usize, async_only: bool) -> Batch {
    if matches!(jobs.front(), Some(Job::Sweep(_)))
        && let Some(Job::Sweep(sweep)) = jobs.pop_front()
    {
        return Batch::Sweep(sweep);
    }
    let (mut writes, mut bytes) = (Vec::new(), 0);
    while writes.len() < max {
        let Some(Job::Write(next)) = jobs.front() else {
            break;
        };
        if async_only && !next.is_async() {
            break;
        }
        let payload = next.payload();
        if !writes.is_empty() && bytes + payload > BATCH_BYTES {
            break;
        }
        bytes += payload;
        if let Some(Job::Write(write)) = jobs.pop_front() {
            writes.push(write);
        }
    }
    Batch::Writes(writes)
}

/// The most response and checkpoint bytes one batch takes (but always one call): a batch
/// holds several copies of what it writes (the encoded records, the log entry, the overlay),
/// so 128 responses of 1 MiB made a batch of several hundred MiB.
const BATCH_BYTES: usize = 4 << 20;

/// The most batches an async caller leads in a row on its own thread (`lead_inline`).
const INLINE_BATCHES: usize = 8;

/// Ends a leadership (see `Committer::pass_on`), also when the batch panicked.
struct Handoff<'a> {
    committer: &'a Committer,
    passed: bool,
}

impl Handoff<'_> {
    /// Passes the lead on now; true if this leader keeps it (`keep`, see `pass_on`).
    fn pass(mut self, keep: bool) -> bool {
        self.passed = true;
        self.committer.pass_on(keep)
    }
}

impl Drop for Handoff<'_> {
    fn drop(&mut self) {
        if !self.passed {
            self.committer.pass_on(false);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::fingerprint::Fingerprint;
    use crate::api::key::Key;
    use crate::api::outcome::Claim;
    use crate::engine::ops::ClaimKey;

    fn queue(calls: &str) -> VecDeque<Job> {
        calls
            .chars()
            .map(|c| match c {
                's' => Job::sweep(1, Arc::default()),
                _ => Job::write(
                    ClaimKey {
                        key: Key::new("k").expect("key"),
                        fingerprint: Fingerprint::of(["r"]),
                        id: None,
                        seed: None,
                        absent_at: None,
                    },
                    Arc::default(),
                ),
            })
            .collect()
    }

    fn batch_len(calls: &str, max: usize) -> usize {
        match take_batch(&mut queue(calls), max, false) {
            Batch::Writes(writes) => writes.len(),
            Batch::Sweep(_) => 1,
        }
    }

    fn completes(sizes: &[usize]) -> VecDeque<Job> {
        sizes
            .iter()
            .map(|&size| {
                let complete = crate::engine::ops::Complete {
                    key: Key::new("k").expect("key"),
                    token: 1,
                    response: crate::api::response::Response::new(200, vec![0; size]),
                    retry: false,
                    retention_ms: None,
                };
                Job::write(complete, Arc::default())
            })
            .collect()
    }

    fn writes(mut jobs: VecDeque<Job>, max: usize) -> usize {
        match take_batch(&mut jobs, max, false) {
            Batch::Writes(writes) => writes.len(),
            Batch::Sweep(_) => 1,
        }
    }

    #[test]
    fn a_batch_takes_at_most_batch_bytes_of_responses_but_always_one_call() {
        let mib = 1 << 20;
        assert_eq!(writes(completes(&[mib; 64]), 128), 4);
        assert_eq!(writes(completes(&[8 * mib, 1]), 128), 1);
        assert_eq!(writes(completes(&[100; 64]), 128), 64);
    }

    #[test]
    fn an_inline_leader_hands_the_lead_on_after_a_few_batches() {
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let committer = Committer::new(128);
        let appointed = Arc::new(AtomicBool::new(false));
        let batches = AtomicUsize::new(0);
        let async_call = || {
            let appointed = Arc::clone(&appointed);
            let claim = ClaimKey {
                key: Key::new("k").expect("key"),
                fingerprint: Fingerprint::of(["r"]),
                id: None,
                seed: None,
                absent_at: None,
            };
            Job::write_async(
                claim,
                Arc::default(),
                Box::new(move || appointed.store(true, Ordering::SeqCst)),
            )
        };
        // Another async caller arrives during every batch, so the queue never runs dry.
        let run = |_: &mut Batch| {
            batches.fetch_add(1, Ordering::SeqCst);
            drop(committer.enqueue(async_call(), Arc::<Slot<Claim>>::default()));
            Ok(())
        };
        drop(committer.enqueue_inline(async_call(), Arc::<Slot<Claim>>::default(), &run));
        assert_eq!(batches.load(Ordering::SeqCst), INLINE_BATCHES);
        assert!(
            appointed.load(Ordering::SeqCst),
            "the caller at the head was appointed to lead"
        );
    }

    #[test]
    fn an_inline_leader_runs_no_blocking_callers_call() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let committer = Committer::new(128);
        let claim = || ClaimKey {
            key: Key::new("k").expect("key"),
            fingerprint: Fingerprint::of(["r"]),
            id: None,
            seed: None,
            absent_at: None,
        };
        let async_call = || Job::write_async(claim(), Arc::default(), Box::new(|| {}));
        let blocking_slot = Arc::<Slot<Claim>>::default();
        let batches = AtomicUsize::new(0);
        // During the first batch an async call, then a blocking caller's, then another
        // async one queue up behind it.
        let run = |batch: &mut Batch| {
            let Batch::Writes(writes) = batch else {
                panic!("an inline leader ran a sweep");
            };
            assert!(
                writes.iter().all(|w| w.is_async()),
                "a blocking call ran inline"
            );
            if batches.fetch_add(1, Ordering::SeqCst) == 0 {
                drop(committer.enqueue(async_call(), Arc::<Slot<Claim>>::default()));
                let blocking = Job::write(claim(), Arc::clone(&blocking_slot));
                drop(committer.enqueue(blocking, Arc::clone(&blocking_slot)));
                drop(committer.enqueue(async_call(), Arc::<Slot<Claim>>::default()));
            }
            Ok(())
        };
        drop(committer.enqueue_inline(async_call(), Arc::<Slot<Claim>>::default(), &run));
        assert_eq!(
            batches.load(Ordering::SeqCst),
            2,
            "its own call, then the async one"
        );
        assert!(
            matches!(blocking_slot.state.lock().turn, Turn::Lead),
            "the blocking caller was appointed to lead on its own thread"
        );
    }

    #[test]
    fn a_sweep_never_shares_a_batch() {
        assert_eq!(batch_len("ccscc", 128), 2);
        assert_eq!(batch_len("scc", 128), 1);
        assert_eq!(batch_len("ss", 128), 1);
        assert_eq!(batch_len("cccc", 3), 3);
        assert_eq!(batch_len("", 3), 0);
    }
}
