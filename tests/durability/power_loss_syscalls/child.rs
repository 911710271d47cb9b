//! The traced child's side: its notes file and the run of one key.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Key, ManualClock, Result, Store};

use super::Mix;
use super::syscalls::check::{LEDGER, checkpoint_data, fingerprint, response_for};

/// The notes file: one `write(2)` per line, so a line is one call in the trace.
pub(super) struct Notes(std::fs::File);

impl Notes {
    pub(super) fn note(&mut self, kind: &str, op: char, key: &str, token: u64, value: u64) {
        let line = format!("{kind} {op} {key} {token} {value}\n");
        self.0.write_all(line.as_bytes()).expect("note");
    }
}

pub(super) fn open_notes(dir: &Path) -> Notes {
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("notes.txt"))
        .expect("notes file");
    Notes(file)
}

pub(super) fn run_key(
    store: &Store,
    clock: &ManualClock,
    notes: &mut Notes,
    mix: Mix,
    name: &str,
    i: usize,
) -> Result<()> {
    clock.advance(Duration::from_millis(1));
    notes.note("try", 'A', name, 0, 0);
    let Claim::Acquired(mut lease) = store.claim(&Key::new(name)?, fingerprint(name))? else {
        panic!("{name}: a fresh key was not acquired");
    };
    let token = lease.token();
    notes.note("ack", 'A', name, token, lease.lease_until().as_millis());
    if mix == Mix::Leases {
        for n in 1..=2 {
            clock.advance(Duration::from_millis(3));
            notes.note("try", 'H', name, token, 0);
            let until = store.heartbeat(&mut lease)?;
            notes.note("ack", 'H', name, token, until.as_millis());
            notes.note("try", 'P', name, token, n);
            store.checkpoint(&mut lease, checkpoint_data(name, n))?;
            notes.note("ack", 'P', name, token, n);
        }
    }
    let settle = match mix {
        Mix::Complete => [0, 0, 0, 1, 2][i % 5],
        Mix::Leases => i % 3,
        Mix::Effects => 3 + i % 2,
    };
    match settle {
        0 | 4 => {
            notes.note("try", 'C', name, token, 0);
            store.complete(&lease, response_for(name, token))?;
            notes.note("ack", 'C', name, token, 0);
        }
        1 => {
            notes.note("try", 'R', name, token, 0);
            store.release(&lease)?;
            notes.note("ack", 'R', name, token, 0);
        }
        3 => {
            notes.note("try", 'W', name, token, 0);
            store
                .complete_with(&lease, response_for(name, token), |txn| {
                    txn.open_table(LEDGER)?.insert(name, token)?;
                    Ok::<(), idempotency_store::redb::Error>(())
                })?
                .expect("the ledger effect");
            notes.note("ack", 'W', name, token, 0);
        }
        // Left in progress: the lease outlives the run.
        _ => {}
    }
    Ok(())
}
