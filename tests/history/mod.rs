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
//!    deadlines inside its window, and a completion's also just before each such deadline,
//!    at its `after`, at every completion time that a later read revealed, and at the latest
//!    time that each later call's view of the record's expiry allows (`search`'s
//!    `completion_times` argues why these cover every distinct outcome). Each acquisition's
//!    token must exceed every earlier one of the key in that order. A claim that answers
//!    `InProgress` may also be a grant whose lease had lapsed by the time it returned (its
//!    deadline is at most `after`; see [`Times::exact_lapse`]), which the store answers "as
//!    if it lost".
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

mod checking;
mod recording;
mod search;

pub use checking::*;
pub use recording::*;

use crate::reference::{LeaseLost, Shape, ViewShape};

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
