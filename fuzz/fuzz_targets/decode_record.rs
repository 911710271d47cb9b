//! The record decoder on arbitrary bytes: never a panic; whatever decodes re-encodes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_store::fuzz_decode_record(data));
