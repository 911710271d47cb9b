//! A history checker for any [`IdempotencyStore`]: record what many threads did to a few
//! keys, then check it.
//!
//! [`record`] runs threads that call random operations (claim, `claim_wait` where the backend
//! has it, complete, release, heartbeat, checkpoint, lookup, sweep) on a small pool of keys
//! while the clock moves, and records every call: its arguments and answer, its place in a
//! global order of invocations and responses (`inv`, `resp`), and the clock just before it
//! was invoked and just after it returned (`before`, `after`).
//!
//! [`check`] then checks the history per key (operations on different keys are independent,
//! so a history is linearizable if each key's part is):
//!
//! 1. **Linearizability** against the reference model (`tests/reference`): a Wing–Gong style
//!    depth-first search, memoised on (set of linearized calls, model state), for an order of
//!    the calls that respects real time (a call that returned before another was invoked comes
//!    first) in which each call, run on the model at some time `now` with `before <= now <=
//!    after`, gives exactly the recorded answer. A claim's and a heartbeat's `now` is read off
//!    their lease deadline; any other call's is tried at `before` and at each of the record's
//!    deadlines inside its window, and a completion's also at every completion time that a
//!    later read revealed, which covers every distinct outcome. Each acquisition's token must
//!    exceed every earlier one of the key in that order. A claim that answers `InProgress`
//!    may also be a grant whose lease had lapsed by the time it returned (its deadline is at
//!    most `after`; see [`Times::exact_lapse`]), which the store answers "as if it lost".
//! 2. **Token order in real time**: an acquisition that returned before another was invoked
//!    has the smaller token.
//! 3. **At most one live lease**: taking the key's leases in token order, none begins (in the
//!    store's time) before an earlier lease has surely ended: lapsed (its last deadline) or
//!    settled (no later than the clock before its settling call).
//!
//! Sweeps are recorded and run concurrently but are not part of any key's history: an expired
//! record counts as absent in every answer, so a sweep of an expired record changes no answer,
//! and a sweep that deleted a live record shows as a wrong answer of a later call.
//! A `claim_wait` is one claim, possibly preceded by grants whose lease lapsed before the
//! call returned (the store answers those "as if lost" and `claim_wait` claims again): the
//! search may apply such a grant while the call is pending, at a time that another call's
//! answer revealed (a record's `created_at` or lease deadline).

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idempotency_store::{Claim, Error, IdempotencyStore, Lease, RecordState, Result, Timestamp};

use crate::reference::{
    LeaseLost, Model, Shape, ViewShape, checkpoint_data, fingerprint, key, response, shape,
};

// ---------------------------------------------------------------------------------------------
// Histories
// ---------------------------------------------------------------------------------------------

/// One call's arguments. Fenced calls name the lease by its token.
#[derive(Debug, Clone, PartialEq)]
pub enum Call {
    Claim { fp: usize, wait: bool },
    Complete { token: u64, body: u8 },
    Release { token: u64 },
    Heartbeat { token: u64 },
    Checkpoint { token: u64, data: u8 },
    Lookup,
    Sweep { limit: usize },
}

/// One call's answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Ret {
    /// A claim's outcome, with the token if it acquired.
    Claim {
        shape: Shape,
        token: Option<u64>,
    },
    Fenced(std::result::Result<(), LeaseLost>),
    Heartbeat(std::result::Result<u64, LeaseLost>),
    View(Option<ViewShape>),
    Swept(usize),
}

/// One recorded call.
#[derive(Debug, Clone, PartialEq)]
pub struct Op {
    pub thread: usize,
    /// The key's index in the reference pool (unused for a sweep).
    pub key: usize,
    pub call: Call,
    pub ret: Ret,
    /// Places in one global order of invocations and responses.
    pub inv: u64,
    pub resp: u64,
    /// The clock (milliseconds) just before the invocation and just after the response.
    pub before: u64,
    pub after: u64,
}

impl Op {
    /// The token of the lease this call acquired, if it did.
    fn acquired(&self) -> Option<u64> {
        match &self.ret {
            Ret::Claim { token, .. } => *token,
            _ => None,
        }
    }
}

/// The store's lease and retention, which the model needs, and how it judges a lapse.
#[derive(Debug, Clone, Copy)]
pub struct Times {
    pub lease_ms: u64,
    pub retention_ms: u64,
    /// Whether a claim answers "lost" for its own lease only once that lease has lapsed on
    /// the recorded clock (true with an injected clock). `PgStore` on the server's clock
    /// judges the lapse in the client, erring on the safe side: it may answer "lost" for a
    /// lease that had not quite lapsed yet (never the reverse).
    pub exact_lapse: bool,
}

// ---------------------------------------------------------------------------------------------
// Recording
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// Checking
// ---------------------------------------------------------------------------------------------

/// What [`check`] found.
#[derive(Debug, Default)]
pub struct Report {
    pub ops: usize,
    pub keys: usize,
    /// Distinct (linearized set, model state) pairs the searches visited.
    pub states: u64,
    pub violations: Vec<String>,
}

/// Checks a history (see the module's documentation).
pub fn check(history: &[Op], times: Times) -> Report {
    let mut per_key: HashMap<usize, Vec<&Op>> = HashMap::new();
    for op in history {
        if !matches!(op.call, Call::Sweep { .. }) {
            per_key.entry(op.key).or_default().push(op);
        }
    }
    let mut report = Report {
        ops: history.len(),
        keys: per_key.len(),
        ..Report::default()
    };
    let mut keys: Vec<_> = per_key.into_iter().collect();
    keys.sort_by_key(|(k, _)| *k);
    for (k, ops) in keys {
        let (states, failure) = linearize(k, &ops, times);
        report.states += states;
        report.violations.extend(failure);
        report.violations.extend(token_order(k, &ops));
        report.violations.extend(live_leases(k, &ops, times));
    }
    report
}

/// The model's state for one key, with the highest token granted so far, and a digest of
/// both for the search's memo.
#[derive(Debug, Clone)]
struct State {
    model: Model,
    last_token: u64,
    digest: u64,
}

impl State {
    fn new(model: Model, last_token: u64) -> State {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        format!("{model:?}").hash(&mut h);
        last_token.hash(&mut h);
        State {
            model,
            last_token,
            digest: h.finish(),
        }
    }

    fn digest(&self) -> u64 {
        self.digest
    }
}

/// Every state the model can be in after running `op` (the `i`-th of the key) on `state`
/// with the recorded answer; none if no time in its window gives that answer.
fn successors(
    k: usize,
    i: usize,
    op: &Op,
    state: &State,
    times: Times,
    revealed: &[u64],
) -> Vec<State> {
    let in_window = |now: u64| (op.before..=op.after).contains(&now);
    // Times at which the answer may differ: the window's start and each deadline inside it.
    let mut nows = vec![op.before];
    nows.extend(
        state
            .model
            .deadlines(k)
            .into_iter()
            .filter(|&d| d > op.before && d <= op.after),
    );
    if matches!(op.call, Call::Complete { .. }) {
        nows.extend(revealed.iter().copied().filter(|&t| in_window(t)));
    }
    nows.sort_unstable();
    nows.dedup();
    let mut out: Vec<State> = Vec::new();
    let mut push = |s: State| {
        if !out.iter().any(|o| o.digest() == s.digest()) {
            out.push(s);
        }
    };
    let unchanged = |answer_matches: bool| answer_matches.then(|| state.clone());
    match (&op.call, &op.ret) {
        (
            Call::Claim { fp, .. },
            Ret::Claim {
                shape,
                token: Some(token),
            },
        ) => {
            let Shape::Acquired { lease_until, .. } = shape else {
                return out;
            };
            let now = lease_until.as_millis().saturating_sub(times.lease_ms);
            if *token <= state.last_token || !in_window(now) {
                return out;
            }
            let mut model = state.model.clone();
            if model.claim(k, *fp, now, holder(*token)) == *shape {
                push(State::new(model, *token));
            }
        }
        (Call::Claim { fp, .. }, Ret::Claim { shape, token: None }) => {
            for &now in &nows {
                let mut model = state.model.clone();
                let got = model.claim(k, *fp, now, usize::MAX);
                if got == *shape && !matches!(got, Shape::Acquired { .. }) {
                    push(state.clone());
                }
            }
            // A grant whose lease lapsed before the call returned, answered as lost.
            if let Shape::InProgress {
                lease_until,
                attempt,
            } = shape
            {
                let now = lease_until.as_millis().saturating_sub(times.lease_ms);
                let lapsed = lease_until.as_millis() <= op.after || !times.exact_lapse;
                if in_window(now) && lapsed {
                    let mut model = state.model.clone();
                    let orphan = usize::MAX - 1 - i;
                    if let Shape::Acquired {
                        lease_until: l,
                        attempt: a,
                        ..
                    } = model.claim(k, *fp, now, orphan)
                        && l == *lease_until
                        && a == *attempt
                    {
                        push(State::new(model, state.last_token));
                    }
                }
            }
        }
        (Call::Complete { token, body }, Ret::Fenced(r)) => {
            for &now in &nows {
                let mut model = state.model.clone();
                if model.complete(k, holder(*token), now, response(*body)) == *r {
                    push(State::new(model, state.last_token));
                }
            }
        }
        (Call::Release { token }, Ret::Fenced(r)) => {
            for &now in &nows {
                let mut model = state.model.clone();
                if model.release(k, holder(*token), now) == *r {
                    push(State::new(model, state.last_token));
                }
            }
        }
        (Call::Checkpoint { token, data }, Ret::Fenced(r)) => {
            for &now in &nows {
                let mut model = state.model.clone();
                if model.checkpoint(k, holder(*token), now, checkpoint_data(*data)) == *r {
                    push(State::new(model, state.last_token));
                }
            }
        }
        (Call::Heartbeat { token }, Ret::Heartbeat(Ok(until))) => {
            let now = until.saturating_sub(times.lease_ms);
            let mut model = state.model.clone();
            if in_window(now) && model.heartbeat(k, holder(*token), now) == Ok(*until) {
                push(State::new(model, state.last_token));
            }
        }
        (Call::Heartbeat { token }, Ret::Heartbeat(Err(LeaseLost))) => {
            for &now in &nows {
                let mut model = state.model.clone();
                if let Some(s) = unchanged(model.heartbeat(k, holder(*token), now).is_err()) {
                    push(s);
                }
            }
        }
        (Call::Lookup, Ret::View(view)) => {
            for &now in &nows {
                if let Some(s) = unchanged(state.model.view(k, now) == *view) {
                    push(s);
                }
            }
        }
        _ => {}
    }
    out
}

/// The model's holder for a token (tokens fit a `usize` on the 64-bit targets tests run on).
fn holder(token: u64) -> usize {
    usize::try_from(token).unwrap_or(usize::MAX - 1)
}

/// Times of calls that only other calls reveal: completions (through `completed_at`) and
/// grants nobody received (through `created_at` and lease deadlines).
struct Revealed {
    completions: Vec<u64>,
    grants: Vec<u64>,
}

impl Revealed {
    fn of(ops: &[&Op], lease_ms: u64) -> Revealed {
        let mut grants: Vec<u64> = ops
            .iter()
            .flat_map(|op| match &op.ret {
                Ret::View(Some(view)) => {
                    let mut times = vec![view.created_at.as_millis()];
                    if let RecordState::InProgress { lease_until, .. } = &view.state {
                        times.push(lease_until.as_millis().saturating_sub(lease_ms));
                    }
                    times
                }
                Ret::Claim {
                    shape: Shape::InProgress { lease_until, .. },
                    ..
                } => vec![lease_until.as_millis().saturating_sub(lease_ms)],
                Ret::Claim {
                    shape: Shape::Completed(replay),
                    ..
                } => vec![replay.created_at.as_millis()],
                _ => Vec::new(),
            })
            .collect();
        grants.sort_unstable();
        grants.dedup();
        Revealed {
            completions: revealed_completions(ops),
            grants,
        }
    }
}

/// Completion times that reads of key `k` revealed (a completion's `now` is otherwise not
/// visible).
fn revealed_completions(ops: &[&Op]) -> Vec<u64> {
    let mut out: Vec<u64> = ops
        .iter()
        .filter_map(|op| match &op.ret {
            Ret::View(Some(ViewShape {
                state: RecordState::Completed { completed_at, .. },
                ..
            })) => Some(completed_at.as_millis()),
            Ret::Claim {
                shape: Shape::Completed(replay),
                ..
            } => Some(replay.completed_at.as_millis()),
            _ => None,
        })
        .collect();
    out.sort_unstable();
    out.dedup();
    out
}

/// A node of the search's event list: the call or the return of one operation.
#[derive(Clone, Copy)]
struct Node {
    op: usize,
    call: bool,
    prev: usize,
    next: usize,
}

/// The Wing–Gong search (in the form of Lowe's and porcupine's, with memoisation) over key
/// `k`'s calls. Returns the states visited and, if there is no linearization, why.
fn linearize(k: usize, ops: &[&Op], times: Times) -> (u64, Option<String>) {
    let revealed = Revealed::of(ops, times.lease_ms);
    let n = ops.len();
    let mut events: Vec<(u64, usize, bool)> = Vec::with_capacity(2 * n);
    for (i, op) in ops.iter().enumerate() {
        events.push((op.inv, i, true));
        events.push((op.resp, i, false));
    }
    events.sort_unstable();
    // Nodes 0..2n are the events in order; node 2n is the head of the circular list.
    let head = 2 * n;
    let mut nodes: Vec<Node> = events
        .iter()
        .enumerate()
        .map(|(at, &(_, op, call))| Node {
            op,
            call,
            prev: if at == 0 { head } else { at - 1 },
            next: if at + 1 == head { head } else { at + 1 },
        })
        .collect();
    nodes.push(Node {
        op: usize::MAX,
        call: false,
        prev: if n == 0 { head } else { head - 1 },
        next: if n == 0 { head } else { 0 },
    });
    let mut ret_of = vec![0; n];
    for (at, node) in nodes.iter().enumerate().take(2 * n) {
        if !node.call {
            ret_of[node.op] = at;
        }
    }
    let zobrist: Vec<u64> = {
        let mut rng = Rng::new(0x5eed ^ k as u64);
        (0..n).map(|_| rng.next()).collect()
    };
    let relink = |nodes: &mut Vec<Node>, at: usize| {
        let Node { prev, next, .. } = nodes[at];
        nodes[prev].next = at;
        nodes[next].prev = at;
    };
    let mut seen: HashSet<(u64, u64)> = HashSet::new();
    let mut state = State::new(Model::with_times(times.lease_ms, times.retention_ms), 0);
    let mut linear = 0u64;
    // Each frame: the call node, the state before, the untried candidates, and whether the
    // chosen candidate linearized the call (an intermediate step of `claim_wait` does not).
    // A call that linearizes without changing the state (a read, a refused write) is never
    // undone to try another order: if any order works from here, one with it first does
    // (nothing that must precede it is pending, and it changes nothing), so its frame keeps no
    // candidates and backtracking passes through it.
    let mut stack: Vec<Frame> = Vec::new();
    let mut deepest: (usize, usize, String) = (0, usize::MAX, String::new());
    let mut at = nodes[head].next;
    let choose = |at: usize,
                  mut cands: Vec<Step>,
                  state: &mut State,
                  linear: &mut u64,
                  nodes: &mut Vec<Node>,
                  stack: &mut Vec<Frame>,
                  seen: &mut HashSet<(u64, u64)>|
     -> bool {
        let op = nodes[at].op;
        let Some(step) = take_new(seen, &mut cands, *linear, zobrist[op]) else {
            return false;
        };
        let forced = step.lifts && step.state.digest() == state.digest();
        let before = std::mem::replace(state, step.state);
        stack.push(Frame {
            call: at,
            before,
            cands,
            lifted: step.lifts,
            forced,
        });
        if step.lifts {
            *linear ^= zobrist[op];
            let Node { prev, next, .. } = nodes[at];
            nodes[prev].next = next;
            nodes[next].prev = prev;
            let r = ret_of[op];
            let Node { prev, next, .. } = nodes[r];
            nodes[prev].next = next;
            nodes[next].prev = prev;
        }
        true
    };
    while nodes[head].next != head {
        let node = nodes[at];
        if node.call {
            let cands = steps(k, node.op, ops[node.op], &state, times, &revealed);
            at = if choose(
                at,
                cands,
                &mut state,
                &mut linear,
                &mut nodes,
                &mut stack,
                &mut seen,
            ) {
                nodes[head].next
            } else {
                node.next
            };
            continue;
        }
        // A return whose call is not linearized yet: undo the last choice.
        if stack.len() >= deepest.0 && deepest.1 != node.op {
            deepest = (stack.len(), node.op, format!("{state:?}"));
        }
        let Some(Frame {
            call,
            before,
            cands,
            lifted,
            forced,
        }) = stack.pop()
        else {
            let stuck = ops
                .get(deepest.1)
                .map_or_else(String::new, |op| format!("{op:?}"));
            return (
                seen.len() as u64,
                Some(format!(
                    "key {k}: not linearizable ({n} calls); the longest linearized prefix has {} \
                     steps, then no order fits the call {stuck}\nmodel state there: {}",
                    deepest.0, deepest.2
                )),
            );
        };
        let op = nodes[call].op;
        if lifted {
            relink(&mut nodes, ret_of[op]);
            relink(&mut nodes, call);
            linear ^= zobrist[op];
        }
        state = before;
        if forced {
            continue; // `at` is still the return that failed: undo the next choice too
        }
        at = if choose(
            call,
            cands,
            &mut state,
            &mut linear,
            &mut nodes,
            &mut stack,
            &mut seen,
        ) {
            nodes[head].next
        } else {
            nodes[call].next
        };
    }
    (seen.len() as u64, None)
}

/// A choice of the search: the call node, the state before it, the untried candidates,
/// whether the chosen one linearized the call, and whether it changed nothing (see
/// `linearize`).
struct Frame {
    call: usize,
    before: State,
    cands: Vec<Step>,
    lifted: bool,
    forced: bool,
}

/// A possible effect of a call on the model: the state after it, and whether it completes
/// the call (`lifts`) or is an intermediate step that leaves the call pending.
struct Step {
    state: State,
    lifts: bool,
}

/// The call's possible effects: its outcomes (tried first), then, for a `claim_wait`, a grant
/// whose lease lapsed before the wait's next claim (the store answers it "as if lost", and
/// `claim_wait` claims again: the grant is visible to others, the call goes on).
fn steps(
    k: usize,
    i: usize,
    op: &Op,
    state: &State,
    times: Times,
    revealed: &Revealed,
) -> Vec<Step> {
    let mut out: Vec<Step> = Vec::new();
    if let Call::Claim { fp, wait: true } = op.call {
        let from = revealed.grants.partition_point(|&t| t < op.before);
        let to = revealed.grants.partition_point(|&t| t <= op.after);
        let grants = revealed.grants[from..to].iter().copied();
        for now in std::iter::once(op.before)
            .chain(state.model.deadlines(k))
            .chain(grants)
        {
            if now < op.before || now + times.lease_ms > op.after {
                continue;
            }
            let mut model = state.model.clone();
            if let Shape::Acquired { .. } = model.claim(k, fp, now, usize::MAX - 1 - i) {
                out.push(Step {
                    state: State::new(model, state.last_token),
                    lifts: false,
                });
            }
        }
    }
    out.extend(
        successors(k, i, op, state, times, &revealed.completions)
            .into_iter()
            .map(|state| Step { state, lifts: true }),
    );
    out
}

/// The first candidate (from the back) whose (linearized set, state) the search has not
/// visited yet; `zobrist` is the call's share of the set's hash.
fn take_new(
    seen: &mut HashSet<(u64, u64)>,
    cands: &mut Vec<Step>,
    linear: u64,
    zobrist: u64,
) -> Option<Step> {
    while let Some(step) = cands.pop() {
        let set = if step.lifts { linear ^ zobrist } else { linear };
        if seen.insert((set, step.state.digest())) {
            return Some(step);
        }
    }
    None
}

/// Check 2: an acquisition that returned before another was invoked has the smaller token.
fn token_order(k: usize, ops: &[&Op]) -> Vec<String> {
    let mut by_resp: Vec<&Op> = ops
        .iter()
        .copied()
        .filter(|op| op.acquired().is_some())
        .collect();
    let mut by_inv = by_resp.clone();
    by_resp.sort_by_key(|op| op.resp);
    by_inv.sort_by_key(|op| op.inv);
    let mut done = by_resp.iter().peekable();
    let mut highest: Option<&Op> = None;
    let mut out = Vec::new();
    for op in by_inv {
        while let Some(prev) = done.next_if(|prev| prev.resp < op.inv) {
            if highest.is_none_or(|h| h.acquired() < prev.acquired()) {
                highest = Some(prev);
            }
        }
        if let Some(h) = highest
            && h.acquired() >= op.acquired()
        {
            out.push(format!(
                "key {k}: token went down in real time: {h:?} returned before {op:?} began"
            ));
        }
    }
    out
}

/// Check 3: in token order, no lease begins before an earlier lease of the key has surely
/// ended (lapsed at its last deadline, or settled no later than its settling call began).
fn live_leases(k: usize, ops: &[&Op], times: Times) -> Vec<String> {
    let mut leases: Vec<(u64, u64, &Op)> = ops
        .iter()
        .filter_map(|op| match (&op.ret, op.acquired()) {
            (
                Ret::Claim {
                    shape: Shape::Acquired { lease_until, .. },
                    ..
                },
                Some(t),
            ) => Some((t, lease_until.as_millis(), *op)),
            _ => None,
        })
        .collect();
    leases.sort_by_key(|l| l.0);
    let mut last_until: HashMap<u64, u64> =
        leases.iter().map(|&(t, until, _)| (t, until)).collect();
    let mut settled: HashMap<u64, u64> = HashMap::new();
    for op in ops {
        match (&op.call, &op.ret) {
            (Call::Heartbeat { token }, Ret::Heartbeat(Ok(until))) => {
                let e = last_until.entry(*token).or_default();
                *e = (*e).max(*until);
            }
            (Call::Complete { token, .. } | Call::Release { token }, Ret::Fenced(Ok(()))) => {
                let e = settled.entry(*token).or_insert(u64::MAX);
                *e = (*e).min(op.before);
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    let mut live: Option<(u64, &Op)> = None; // the latest sure end so far, and whose
    let mut started: Option<(u64, &Op)> = None; // the latest grant time so far
    for &(token, until, op) in &leases {
        let granted = until.saturating_sub(times.lease_ms);
        if let Some((end, prev)) = live
            && granted < end
        {
            out.push(format!(
                "key {k}: two live leases: token {token} granted at {granted} while the \
                 lease of {prev:?} was live until at least {end}: {op:?}"
            ));
        }
        if let Some((at, prev)) = started
            && granted < at
        {
            out.push(format!(
                "key {k}: lease of token {token} granted at {granted}, before the earlier \
                 token's grant at {at} ({prev:?}): {op:?}"
            ));
        }
        let end = last_until[&token].min(settled.get(&token).copied().unwrap_or(u64::MAX));
        if live.is_none_or(|(e, _)| e < end) {
            live = Some((end, op));
        }
        if started.is_none_or(|(s, _)| s < granted) {
            started = Some((granted, op));
        }
    }
    out
}
