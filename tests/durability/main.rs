//! Durability: SIGKILL crashes, simulated and syscall-level power loss, damaged files, full
//! disks, poisoning, format upgrades and the fuzz corpus: one test binary, a module per former
//! test file. Tests that run this binary as their child name their child test with its module
//! path (`crash::crash_child_process`).

// Helpers that several modules share, each compiled once. `reference` at the crate root, where
// its macros and the fuzz target expect it.
#[path = "../acks/mod.rs"]
mod acks;
#[path = "../common/mod.rs"]
mod common;
#[path = "../raw/mod.rs"]
mod raw;
#[path = "../reference/mod.rs"]
mod reference;
#[path = "../common/threads.rs"]
mod threads;

mod crash;
mod damaged;
mod format_upgrade;
mod full_disk;
mod fuzz_corpus;
mod poison;
mod power_loss;
mod power_loss_syscalls;
mod sweep_crash;
mod unlogged_sweep;
