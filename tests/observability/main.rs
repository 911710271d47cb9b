//! `metrics()` counts on both backends and the `tracing` events: one test binary, a module per
//! former test file. `tests/metrics_facade.rs` stays a binary of its own: it installs the
//! process's global `metrics` recorder, which every other test's stores would then count into.

#[path = "../common/mod.rs"]
mod common;

mod metrics;
mod tracing_events;
