//! The reference model of the store and the step machinery that checks a store against it,
//! shared by the model-based proptests (`tests/store/model.rs`), the `store_ops` fuzz target
//! (`fuzz/fuzz_targets/store_ops.rs`) and its corpus replay (`tests/durability/fuzz_corpus.rs`).
//!
//! The model, in milliseconds of the store's time `now`:
//! - a record with `now >= expires_at` is expired and counts as absent everywhere;
//! - a fresh claim makes `created_at = now`, attempt 1, `lease_until = now + lease` and
//!   `expires_at = max(created_at + retention, lease_until)`;
//! - a takeover (same fingerprint, `now >= lease_until`) keeps `created_at` and the checkpoint,
//!   makes attempt + 1 and recomputes `lease_until` and `expires_at` the same way;
//! - `complete` / `release` / `heartbeat` / `checkpoint` need the record unexpired, in progress
//!   and held by the same lease, else `Error::LeaseLost` and nothing changes;
//! - `complete` sets `expires_at = now + retention`; `heartbeat` sets `lease_until = now + lease`
//!   and `expires_at = max(expires_at, lease_until)`;
//! - `sweep(limit)` deletes up to `limit` expired records, oldest `(expires_at, stored key)`
//!   first.
//!
//! Every check returns `Err(Failure)` instead of panicking, so that proptest can shrink; the
//! fuzz entry point [`run_ops`] turns a failure into a panic, which libFuzzer reports.
//!
//! The step machinery works on any [`IdempotencyStore`] backend ([`run_steps`]), so the
//! conformance suite (`tests/store/conformance/`) runs the same sequences against PostgreSQL.

// Each including crate uses a different part of this module.
#![allow(dead_code)]

use idempotency_store::{Fingerprint, Key, Response, Timestamp};

pub const T0: u64 = 1_700_000_000_000;
pub const LEASE_MS: u64 = 10_000;
pub const RETENTION_MS: u64 = 100_000;
/// Keys in the sequential runs' pool (index 3 is the scoped one).
pub const SEQ_KEYS: usize = 4;
pub const FINGERPRINTS: usize = 2;
/// The longest step sequence [`decode_steps`] builds.
pub const MAX_STEPS: usize = 64;

// ---------------------------------------------------------------------------------------------
// Failures
// ---------------------------------------------------------------------------------------------

/// A disagreement between the store and the model, or an unexpected error.
#[derive(Debug)]
pub struct Failure(pub String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for Failure {
    fn from(err: E) -> Self {
        Failure(format!("unexpected error: {err:?}"))
    }
}

pub type Outcome<T = ()> = Result<T, Failure>;

/// Fails unless the condition holds; the rest is a `format!` message.
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::reference::Failure(format!(
                "{} (failed: {})",
                format!($($msg)+),
                stringify!($cond)
            )));
        }
    };
}

/// Fails unless `got == want`; the optional rest is a `format!` message.
macro_rules! ensure_eq {
    ($got:expr, $want:expr $(,)?) => {
        ensure_eq!($got, $want, "{}", stringify!($got))
    };
    ($got:expr, $want:expr, $($msg:tt)+) => {{
        let (got, want) = (&$got, &$want);
        if got != want {
            return Err($crate::reference::Failure(format!(
                "{}: the store gave\n  {got:?}\nthe model expects\n  {want:?}",
                format!($($msg)+)
            )));
        }
    }};
}

// The parts, after the macros above so that they can use them; re-exported so that every
// including crate names them `reference::…` as before.
mod decode;
mod mem_disk;
mod model;
mod steps;

pub use decode::*;
pub use mem_disk::*;
pub use model::*;
pub use steps::*;

// ---------------------------------------------------------------------------------------------
// Keys, fingerprints, payloads
// ---------------------------------------------------------------------------------------------

/// Key `idx` of the pool: every fourth one is scoped, reusing an unscoped key's name so that
/// scope separation is exercised too.
fn key_parts(idx: usize) -> (Option<String>, String) {
    if idx % 4 == 3 {
        (Some("tenant".to_owned()), format!("k{}", idx - 3))
    } else {
        (None, format!("k{idx}"))
    }
}

pub fn key(idx: usize) -> Key {
    let built = match key_parts(idx) {
        (Some(scope), name) => Key::scoped(&scope, &name),
        (None, name) => Key::new(&name),
    };
    built.expect("pool keys are valid")
}

/// How a backend orders expired records of one millisecond in a sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ties {
    /// By stored key (PostgreSQL).
    Key,
    /// By the key hash the redb store files records under (the first 8 bytes of the stored
    /// key's BLAKE3 digest, big-endian), then by stored key.
    KeyHash,
}

impl Ties {
    fn order(self, idx: usize) -> Vec<u8> {
        let stored = stored_key(idx);
        match self {
            Ties::Key => stored,
            Ties::KeyHash => [&blake3::hash(&stored).as_bytes()[..8], &stored[..]].concat(),
        }
    }
}

/// The stored byte form documented on `Key` (`[scope length][scope][key]`).
fn stored_key(idx: usize) -> Vec<u8> {
    let (scope, name) = key_parts(idx);
    let scope = scope.unwrap_or_default();
    let mut out = vec![u8::try_from(scope.len()).expect("short scope")];
    out.extend_from_slice(scope.as_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

pub fn fingerprint(fp: usize) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", &format!("body-{fp}")])
}

pub fn response(body: u8) -> Response {
    Response::new(200 + u16::from(body % 4), vec![body; usize::from(body % 7)])
        .with_header("x-body", vec![body])
}

pub fn checkpoint_data(data: u8) -> Vec<u8> {
    vec![data; 1 + usize::from(data % 5)]
}

pub fn ts(millis: u64) -> Timestamp {
    Timestamp::from_millis(millis)
}
