//! Steps from fuzz bytes, and the fuzz entry point.

use super::{FINGERPRINTS, LEASE_MS, MAX_STEPS, RETENTION_MS, SEQ_KEYS, Step, run_in_memory};

/// Reads fuzz bytes; past the end every field reads as zero.
struct Bytes<'a> {
    data: &'a [u8],
}

impl Bytes<'_> {
    fn tag(&mut self) -> Option<u8> {
        let (&first, rest) = self.data.split_first()?;
        self.data = rest;
        Some(first)
    }

    fn byte(&mut self) -> u8 {
        self.tag().unwrap_or(0)
    }

    /// An `n`-byte little-endian number.
    fn uint(&mut self, n: usize) -> u64 {
        (0..n).fold(0, |acc, i| acc | u64::from(self.byte()) << (8 * i))
    }
}

/// A clock move, around the lease (10 s) and retention (100 s) boundaries as often as not.
fn advance_ms(bytes: &mut Bytes<'_>) -> u64 {
    match bytes.byte() % 8 {
        0 => 1 + bytes.uint(2) % 3_000,
        1 => LEASE_MS - 1,
        2 => LEASE_MS,
        3 => LEASE_MS - 1_000 + bytes.uint(2) % 2_001,
        4 => RETENTION_MS,
        5 => RETENTION_MS - 2_000 + bytes.uint(2) % 4_001,
        6 => 1 + bytes.uint(3) % (2 * RETENTION_MS),
        _ => 1,
    }
}

/// Steps from fuzz bytes: a tag byte picks the kind (its low four bits, weighted roughly as
/// the proptest strategy is), the following bytes its fields. At most [`MAX_STEPS`] steps.
pub fn decode_steps(data: &[u8]) -> Vec<Step> {
    let mut bytes = Bytes { data };
    let mut steps = Vec::new();
    while steps.len() < MAX_STEPS {
        let Some(tag) = bytes.tag() else { break };
        let step = match tag % 16 {
            0..=4 => {
                let b = usize::from(bytes.byte());
                Step::Claim {
                    key: b % SEQ_KEYS,
                    fp: (b / SEQ_KEYS) % FINGERPRINTS,
                }
            }
            5 | 6 => Step::Complete {
                lease: usize::from(bytes.byte()),
                body: bytes.byte(),
            },
            7 => Step::Release {
                lease: usize::from(bytes.byte()),
            },
            8 => Step::Heartbeat {
                lease: usize::from(bytes.byte()),
            },
            9 => Step::Checkpoint {
                lease: usize::from(bytes.byte()),
                data: bytes.byte(),
            },
            10 => Step::Lookup {
                key: usize::from(bytes.byte()) % SEQ_KEYS,
            },
            11..=13 => Step::Advance {
                ms: advance_ms(&mut bytes),
            },
            14 => Step::Sweep {
                limit: 1 + usize::from(bytes.byte() % 3),
            },
            _ => Step::Reopen,
        };
        steps.push(step);
    }
    steps
}

/// The `store_ops` fuzz target's body: decodes the bytes into steps and runs them on an
/// in-memory store that reopens, panicking on any disagreement with the model.
pub fn run_ops(data: &[u8]) {
    let steps = decode_steps(data);
    let contained = idempotency_store::contained_panics();
    if let Err(failure) = run_in_memory(&steps) {
        panic!("store and model disagree: {failure}\nsteps: {steps:#?}");
    }
    // The memory disk never damages a page, so a panic the store turned into an error was a
    // bug of ours (or redb's), not damage.
    assert_eq!(
        idempotency_store::contained_panics(),
        contained,
        "a panic was contained\nsteps: {steps:#?}"
    );
}
