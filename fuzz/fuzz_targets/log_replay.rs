//! Arbitrary log entries replayed when a store opens: never a panic, whatever the entries say.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_store::fuzz_log_replay(data));
