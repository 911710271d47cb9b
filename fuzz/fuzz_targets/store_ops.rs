//! Arbitrary sequences of store calls (claim, complete, release, heartbeat, checkpoint, lookup,
//! clock moves, sweep, reopen) on reopenable in-memory storage, each answer compared with the
//! reference model shared with `tests/store/model.rs`.
#![no_main]

#[path = "../../tests/reference/mod.rs"]
mod reference;

libfuzzer_sys::fuzz_target!(|data: &[u8]| reference::run_ops(data));
