//! Recording: threads that call random operations on a few keys while the clock moves.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotency_store::{Claim, Error, IdempotencyStore, Lease, Result, Timestamp};

use super::{Call, Op, Ret};
use crate::reference::{LeaseLost, ViewShape, checkpoint_data, fingerprint, key, response, shape};

/// What [`record`] runs.
pub struct Plan {
    pub threads: usize,
    pub keys: usize,
    /// Calls in all, spread over the threads.
    pub ops: usize,
    pub seed: u64,
}

/// The store under test, as the recorder drives it.
pub trait Target: Sync {
    type Store: IdempotencyStore;
    fn store(&self) -> &Self::Store;
    /// The clock in milliseconds, read before and after each call.
    fn now(&self) -> u64;
    /// Called by the threads between calls: moves a manual clock (a no-op for a real one).
    fn tick(&self, rng: &mut Rng);
    /// Whether the backend has `claim_wait`.
    fn can_wait(&self) -> bool;
    /// `claim_wait` (only called if [`Target::can_wait`]).
    fn claim_wait(&self, key: &idempotency_store::Key, fp: usize) -> Result<Claim>;
}

/// A small deterministic generator (SplitMix64), one per thread.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number below `n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Runs the plan on `target` and returns every call, in no particular order.
pub fn record<T: Target>(target: &T, plan: &Plan) -> Vec<Op> {
    let seq = AtomicU64::new(0);
    let out = Mutex::new(Vec::with_capacity(plan.ops));
    std::thread::scope(|s| {
        for thread in 0..plan.threads {
            let share = plan.ops / plan.threads + usize::from(thread < plan.ops % plan.threads);
            let (seq, out) = (&seq, &out);
            s.spawn(move || {
                let mut rng = Rng::new(plan.seed ^ (thread as u64 + 1).wrapping_mul(0x2545_f491));
                let mut recorder = Recorder {
                    target,
                    seq,
                    thread,
                    leases: Vec::new(),
                    ops: Vec::with_capacity(share),
                };
                for _ in 0..share {
                    target.tick(&mut rng);
                    recorder.random_call(&mut rng, plan.keys);
                }
                out.lock().expect("history").extend(recorder.ops);
            });
        }
    });
    out.into_inner().expect("history")
}

/// Leases a thread keeps for its fenced calls (settled ones too, to exercise fencing).
const HELD: usize = 4;

struct Recorder<'a, T: Target> {
    target: &'a T,
    seq: &'a AtomicU64,
    thread: usize,
    leases: Vec<(usize, Lease)>,
    ops: Vec<Op>,
}

impl<T: Target> Recorder<'_, T> {
    fn random_call(&mut self, rng: &mut Rng, keys: usize) {
        let k = rng.below(keys as u64) as usize;
        let lease = if self.leases.is_empty() {
            None
        } else {
            Some(rng.below(self.leases.len() as u64) as usize)
        };
        match (rng.below(20), lease) {
            (0..=5, _) | (6..=14, None) => {
                let fp = rng.below(2) as usize;
                let wait = rng.below(4) == 0;
                self.claim(k, fp, wait);
            }
            (6..=8, Some(i)) => {
                let body = rng.below(256) as u8;
                let (k, lease) = self.leases.swap_remove(i);
                let call = Call::Complete {
                    token: lease.token(),
                    body,
                };
                let store = self.target.store();
                self.call(k, call, || {
                    Ret::Fenced(fenced(store.complete(&lease, response(body))))
                });
                self.leases.push((k, lease));
            }
            (9..=11, Some(i)) => {
                let (k, lease) = self.leases.swap_remove(i);
                let call = Call::Release {
                    token: lease.token(),
                };
                let store = self.target.store();
                self.call(k, call, || Ret::Fenced(fenced(store.release(&lease))));
                self.leases.push((k, lease));
            }
            (12..=13, Some(i)) => {
                let (k, mut lease) = self.leases.swap_remove(i);
                let call = Call::Heartbeat {
                    token: lease.token(),
                };
                let store = self.target.store();
                self.call(k, call, || {
                    Ret::Heartbeat(fenced(store.heartbeat(&mut lease)).map(Timestamp::as_millis))
                });
                self.leases.push((k, lease));
            }
            (14, Some(i)) => {
                let data = rng.below(256) as u8;
                let (k, mut lease) = self.leases.swap_remove(i);
                let call = Call::Checkpoint {
                    token: lease.token(),
                    data,
                };
                let store = self.target.store();
                self.call(k, call, || {
                    Ret::Fenced(fenced(store.checkpoint(&mut lease, checkpoint_data(data))))
                });
                self.leases.push((k, lease));
            }
            (15..=18, _) => {
                let store = self.target.store();
                self.call(k, Call::Lookup, || {
                    Ret::View(store.lookup(&key(k)).expect("lookup").map(ViewShape::from))
                });
            }
            _ => {
                let limit = 1 + rng.below(3) as usize;
                let store = self.target.store();
                self.call(usize::MAX, Call::Sweep { limit }, || {
                    Ret::Swept(store.sweep(limit).expect("sweep"))
                });
            }
        }
    }

    fn claim(&mut self, k: usize, fp: usize, wait: bool) {
        let target = self.target;
        let wait = wait && target.can_wait();
        let mut won = None;
        self.call(k, Call::Claim { fp, wait }, || {
            let claim = if wait {
                target.claim_wait(&key(k), fp)
            } else {
                target.store().claim(&key(k), fingerprint(fp))
            };
            let (shape, lease) = shape(claim.expect("claim"));
            let token = lease.as_ref().map(Lease::token);
            won = lease;
            Ret::Claim { shape, token }
        });
        if let Some(lease) = won {
            if self.leases.len() == HELD {
                drop(self.leases.remove(0));
            }
            self.leases.push((k, lease));
        }
    }

    /// Records one call.
    fn call(&mut self, key: usize, call: Call, run: impl FnOnce() -> Ret) {
        let before = self.target.now();
        let inv = self.seq.fetch_add(1, Ordering::SeqCst);
        let ret = run();
        let resp = self.seq.fetch_add(1, Ordering::SeqCst);
        let after = self.target.now();
        self.ops.push(Op {
            thread: self.thread,
            key,
            call,
            ret,
            inv,
            resp,
            before,
            after,
        });
    }
}

/// `LeaseLost` is an answer; any other error fails the run.
fn fenced<T>(result: Result<T>) -> std::result::Result<T, LeaseLost> {
    match result {
        Ok(v) => Ok(v),
        Err(Error::LeaseLost) => Err(LeaseLost),
        Err(other) => panic!("unexpected error: {other:?}"),
    }
}

/// How long `claim_wait` waits (real time) in recorded runs.
pub const WAIT: Duration = Duration::from_millis(2);
