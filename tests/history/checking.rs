//! Checking a recorded history per key: linearizability (the search is in `search`), token
//! order in real time and at most one live lease.

use std::collections::HashMap;

use super::search::linearize;
use super::{Call, Op, Ret, Times};
use crate::reference::Shape;

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
