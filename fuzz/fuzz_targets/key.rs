//! Key and scope validation on arbitrary bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| idempotency_store::fuzz_key(data));
