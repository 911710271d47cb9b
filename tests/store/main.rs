//! The store's contract on both backends, concurrency, lifecycle, the clock, the reference
//! model, edge cases, reopening, read-only opens and quotas: one test binary (one link instead
//! of one per file), a module per former test file. `tests/replay_cache.rs` stays a binary of
//! its own (see there).

// At the crate root: its macros name `$crate::reference`, and the history checker
// `crate::reference`.
#[macro_use]
#[allow(unused_macros)]
#[path = "../reference/mod.rs"]
mod reference;

#[macro_use]
#[path = "../common/mod.rs"]
mod common;
#[path = "../common/threads.rs"]
mod threads;

mod async_store;
mod clock;
mod complete_with;
mod concurrency;
mod conformance;
mod edges;
mod effects;
mod history;
mod lifecycle;
mod memory;
mod model;
mod quota;
mod read_only;
mod reopen;
mod settle;
mod sweep_race;
