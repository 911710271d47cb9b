//! `metrics()` counts on both backends. Two binaries of their own stay beside it, for state a
//! process keeps once: `tests/metrics_facade.rs` installs the process's global `metrics`
//! recorder, which every other test's stores would then count into, and
//! `tests/tracing_events.rs` asserts on a trace-level event, whose callsite's interest
//! `tracing` caches for the whole process: a store in another test that reaches that callsite
//! first, with no subscriber wanting it, can leave it switched off.

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/threads.rs"]
mod threads;

mod metrics;
