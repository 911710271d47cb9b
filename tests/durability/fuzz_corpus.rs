//! The fuzz targets' bodies, run on the stable toolchain as part of `cargo test`: every
//! committed corpus input (including past crashes, kept as regressions) plus a few thousand
//! generated inputs per target. The long runs use cargo-fuzz (see CONTRIBUTING.md, "Long runs").

use std::path::Path;

use crate::reference;

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut inputs: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| {
            let path = entry.expect("corpus entry").path();
            let data = std::fs::read(&path).expect("corpus file");
            (path.display().to_string(), data)
        })
        .collect();
    inputs.sort();
    inputs
}

/// Byte strings biased towards the interesting: short (random ones below `max_random_len`
/// bytes), printable, and mutations of the corpus.
fn generated(seeds: &[(String, Vec<u8>)], count: usize, max_random_len: u64) -> Vec<Vec<u8>> {
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    (0..count)
        .map(|i| {
            let mut data = match seeds.get(i % (seeds.len() + 1)) {
                Some((_, seed)) if i % 2 == 0 => seed.clone(),
                _ => (0..next() % max_random_len).map(|_| next() as u8).collect(),
            };
            for _ in 0..1 + next() % 4 {
                if data.is_empty() {
                    break;
                }
                let at = (next() % data.len() as u64) as usize;
                match next() % 3 {
                    0 => data[at] ^= 1 << (next() % 8),
                    1 => data.truncate(at),
                    _ => data.insert(at, 0x20 + (next() % 95) as u8),
                }
            }
            data
        })
        .collect()
}

fn run(target: &str, body: fn(&[u8]), generated_count: usize, max_random_len: u64) {
    let inputs = corpus(target);
    assert!(!inputs.is_empty(), "fuzz/corpus/{target} holds no inputs");
    for (name, data) in &inputs {
        if std::panic::catch_unwind(|| body(data)).is_err() {
            panic!("fuzz target {target} failed on corpus file {name}");
        }
    }
    for (i, data) in generated(&inputs, generated_count, max_random_len)
        .iter()
        .enumerate()
    {
        if std::panic::catch_unwind(|| body(data)).is_err() {
            panic!("fuzz target {target} failed on generated input {i}: {data:?}");
        }
    }
    println!(
        "{target}: {} corpus inputs and {generated_count} generated inputs",
        inputs.len()
    );
}

#[test]
fn decode_record_corpus() {
    run(
        "decode_record",
        idempotency_store::fuzz_decode_record,
        5_000,
        300,
    );
}

#[test]
fn key_corpus() {
    run("key", idempotency_store::fuzz_key, 5_000, 300);
}

/// Operation sequences against the store (on reopenable in-memory storage) and the reference
/// model of `tests/reference/`. Each input opens a store and checks the whole of it after
/// every step, which is slow in a debug build: fewer and shorter generated inputs (random ones
/// below 100 bytes) keep this test near 10 s.
#[test]
fn store_ops_corpus() {
    run("store_ops", reference::run_ops, 1_000, 100);
}

/// Log entries replayed at open (each input opens a store twice): the decoder and redo meet
/// arbitrary changes.
#[test]
fn log_replay_corpus() {
    run("log_replay", idempotency_store::fuzz_log_replay, 1_000, 200);
}
