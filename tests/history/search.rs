//! The linearizability search: a depth-first walk over the calls' event list, memoised on the
//! set of linearized calls and the model state.

use std::collections::HashSet;
use std::hash::{Hash, Hasher};

use idempotency_store::RecordState;

use super::{Call, Op, Ret, Rng, Times};
use crate::reference::{LeaseLost, Model, Shape, ViewShape, checkpoint_data, response};

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
        // The latest time of each stretch of one answer (see `completion_times`).
        let ends: Vec<u64> = nows[1..].iter().map(|d| d - 1).chain([op.after]).collect();
        nows.extend(ends);
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
    /// Times to try a completion at besides its window's start and its stretches' ends (see
    /// `completion_times`).
    completions: Vec<u64>,
    grants: Vec<u64>,
}

impl Revealed {
    fn of(ops: &[&Op], times: Times) -> Revealed {
        let lease_ms = times.lease_ms;
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
            completions: completion_times(ops, times),
            grants,
        }
    }
}

/// Times at which a completion of key `k` may have run, to try besides its window's start,
/// its record's deadlines and the latest time before each (which give every answer of its
/// own): the completion times that reads revealed, and the latest completion times that
/// later calls allow.
///
/// Unless a read reveals it, a completion's time shows later only through its record's
/// expiry (that time plus the retention). A later call that saw the record live bounds the
/// time from below; one that saw it expired bounds it from above, by that call's time (at
/// most its `after`, or the fixed time of an acquisition or a heartbeat) less the retention.
/// Lower bounds favour the latest time: if any time in a stretch of one answer fits every
/// bound, the latest that fits does, and it is the stretch's end or one of the upper bounds.
/// (Trying only the start and the deadlines missed a completion that ran late in a long
/// call, which a later claim revealed only by seeing the record live.)
fn completion_times(ops: &[&Op], times: Times) -> Vec<u64> {
    let expired_by = |t: u64| t.checked_sub(times.retention_ms);
    let fixed = |op: &Op| match &op.ret {
        Ret::Claim {
            shape: Shape::Acquired { lease_until, .. } | Shape::InProgress { lease_until, .. },
            ..
        } => Some(lease_until.as_millis().saturating_sub(times.lease_ms)),
        Ret::Heartbeat(Ok(until)) => Some(until.saturating_sub(times.lease_ms)),
        _ => None,
    };
    let mut out: Vec<u64> = ops
        .iter()
        .flat_map(|op| {
            let revealed = match &op.ret {
                Ret::View(Some(ViewShape {
                    state: RecordState::Completed { completed_at, .. },
                    ..
                })) => Some(completed_at.as_millis()),
                Ret::Claim {
                    shape: Shape::Completed(replay),
                    ..
                } => Some(replay.completed_at.as_millis()),
                _ => None,
            };
            let bounds = [expired_by(op.after), fixed(op).and_then(expired_by)];
            bounds.into_iter().chain([revealed]).flatten()
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
pub(super) fn linearize(k: usize, ops: &[&Op], times: Times) -> (u64, Option<String>) {
    let revealed = Revealed::of(ops, times);
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
