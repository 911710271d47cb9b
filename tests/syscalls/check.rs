//! What a recovered store must hold, from the workload's notes up to the crash point.
//!
//! The workload writes `try <op> <key> <token> <value>` before a call and `ack <op> <key>
//! <token> <value>` after it returned `Ok`, each with one `write(2)`, so they sit in the trace
//! between the store file's calls. Ops: `A` claim (ack value: `lease_until`), `H` heartbeat
//! (value: the new `lease_until`), `P` checkpoint (value: which data), `C` complete, `W`
//! `complete_with` (its effect inserts `key -> token` into `LEDGER`), `R` release; `O`/`X`
//! open and close the store. A key belongs to one thread, so its notes are in call order, and
//! at most its last call is in flight (tried, not acknowledged).
//!
//! After a crash, each key's record must be what its acknowledged calls left, or that plus its
//! one call in flight: an acknowledged claim is present, an acknowledged completion replays
//! the exact response, a release is gone; no record exists for a key never claimed, and no
//! completion carries a response no call was ever made with.

use std::collections::HashMap;

use idempotency_store::IdempotencyStore;
use idempotency_store::redb::{self, ReadableTable};
use idempotency_store::{Fingerprint, Key, RecordState, RecordView, Response, Store, Timestamp};

use super::trace::Note;

pub const LEDGER: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("ledger");

pub fn fingerprint(key: &str) -> Fingerprint {
    Fingerprint::of([key, "syscall-power-loss"])
}

/// The response a lease with `token` stores for `key`: bodies from 8 bytes to 1.4 KiB, so
/// that some entries cross sector and page boundaries of the log.
pub fn response_for(key: &str, token: u64) -> Response {
    let pad = "x".repeat((token % 8) as usize * 200);
    Response::new(201, format!("{key}:{token}:{pad}")).with_header("x-token", token.to_le_bytes())
}

/// The data of a lease's `n`-th checkpoint.
pub fn checkpoint_data(key: &str, n: u64) -> Vec<u8> {
    format!("{key}@{n}").into_bytes()
}

/// A parsed note.
#[derive(Debug, Clone)]
pub struct Call {
    pub acked: bool,
    pub op: char,
    pub key: String,
    pub token: u64,
    pub value: u64,
}

impl Call {
    pub fn parse(text: &str) -> Result<Call, String> {
        let parts: Vec<&str> = text.split(' ').collect();
        let [kind, op, key, token, value] = parts[..] else {
            return Err(format!("bad note {text:?}"));
        };
        let number = |s: &str| s.parse::<u64>().map_err(|_| format!("bad note {text:?}"));
        Ok(Call {
            acked: match kind {
                "ack" => true,
                "try" => false,
                _ => return Err(format!("bad note {text:?}")),
            },
            op: op.chars().next().ok_or("empty op")?,
            key: key.to_owned(),
            token: number(token)?,
            value: number(value)?,
        })
    }
}

/// What a key's acknowledged calls left.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Absent,
    Held {
        lease_until: u64,
        checkpoint: Option<Vec<u8>>,
    },
    Completed {
        token: u64,
    },
}

#[derive(Debug, Clone)]
struct KeyModel {
    state: State,
    in_flight: Option<Call>,
    /// Whether the key's completion is `complete_with` (its ledger row must match).
    effects: bool,
}

/// The calls acknowledged (and in flight) before one crash point.
pub struct Model {
    keys: HashMap<String, KeyModel>,
    /// The highest `lease_until` acknowledged, to check that time did not go back.
    pub latest_lease_until: u64,
    /// Whether `Store::open` had returned (the file was fully created) before the point.
    pub opened: bool,
}

impl Model {
    pub fn new(notes: &[(usize, Call)], point: usize) -> Model {
        let mut model = Model {
            keys: HashMap::new(),
            latest_lease_until: 0,
            opened: false,
        };
        for (_, call) in notes.iter().take_while(|(start, _)| *start < point) {
            model.note(call);
        }
        model
    }

    fn note(&mut self, call: &Call) {
        if call.op == 'O' || call.op == 'X' {
            self.opened |= call.op == 'O' && call.acked;
            return;
        }
        let key = self.keys.entry(call.key.clone()).or_insert(KeyModel {
            state: State::Absent,
            in_flight: None,
            effects: false,
        });
        key.effects |= call.op == 'W';
        if !call.acked {
            key.in_flight = Some(call.clone());
            return;
        }
        key.in_flight = None;
        key.state = after(&key.state, call);
        if matches!(call.op, 'A' | 'H') {
            self.latest_lease_until = self.latest_lease_until.max(call.value);
        }
    }

    /// Checks `store` (opened from a crash image) against the model; returns the keys checked.
    pub fn check(&self, store: &Store, lease: u64) -> Result<usize, String> {
        let mut checked = 0;
        for (name, key) in &self.keys {
            let view = store
                .lookup(&Key::new(name).map_err(|e| e.to_string())?)
                .map_err(|e| format!("{name}: lookup failed: {e}"))?;
            let allowed = matches(name, &key.state, &view)
                || key
                    .in_flight
                    .as_ref()
                    .is_some_and(|call| in_flight(name, &key.state, call, &view));
            if !allowed {
                return Err(format!(
                    "{name}: acknowledged {:?}, in flight {:?}, but the store holds {view:?}",
                    key.state, key.in_flight
                ));
            }
            checked += 1;
        }
        self.check_strangers(store)?;
        self.check_ledger(store)?;
        let floor = self.latest_lease_until.saturating_sub(lease);
        let now = store.now().map_err(|e| e.to_string())?;
        if now < Timestamp::from_millis(floor) {
            return Err(format!(
                "time went back: the store's time is {now:?}, but a call acknowledged at {floor}"
            ));
        }
        Ok(checked)
    }

    /// No record for a key no call ever named.
    fn check_strangers(&self, store: &Store) -> Result<(), String> {
        let records = store.records().map_err(|e| e.to_string())?;
        for record in records {
            let record = record.map_err(|e| format!("listing records: {e}"))?;
            let name = record.key.key();
            if !self.keys.contains_key(name) {
                return Err(format!("a record for {name}, which no call named"));
            }
        }
        Ok(())
    }

    /// The ledger rows `complete_with` wrote equal the completed records, key by key.
    fn check_ledger(&self, store: &Store) -> Result<(), String> {
        let rows = store
            .read_with(|txn| -> Result<HashMap<String, u64>, redb::Error> {
                let table = match txn.open_table(LEDGER) {
                    Ok(table) => table,
                    Err(redb::TableError::TableDoesNotExist(_)) => return Ok(HashMap::new()),
                    Err(err) => return Err(err.into()),
                };
                let mut rows = HashMap::new();
                for row in table.iter()? {
                    let (k, v) = row?;
                    rows.insert(k.value().to_owned(), v.value());
                }
                Ok(rows)
            })
            .map_err(|e| e.to_string())?
            .map_err(|e| format!("reading the ledger: {e}"))?;
        if let Some(name) = rows
            .keys()
            .find(|name| !self.keys.get(*name).is_some_and(|k| k.effects))
        {
            return Err(format!("a ledger row for {name}, which no effect named"));
        }
        for (name, _) in self.keys.iter().filter(|(_, k)| k.effects) {
            let view = store
                .lookup(&Key::new(name).map_err(|e| e.to_string())?)
                .map_err(|e| e.to_string())?;
            let completed = match view.map(|v| v.state) {
                Some(RecordState::Completed { response, .. }) => Some(response),
                _ => None,
            };
            match (rows.get(name), completed) {
                (None, None) => {}
                (Some(token), Some(response)) if response == response_for(name, *token) => {}
                (row, response) => {
                    return Err(format!(
                        "{name}: ledger row {row:?} does not match the stored completion \
                         {response:?}"
                    ));
                }
            }
        }
        Ok(())
    }
}

fn after(state: &State, call: &Call) -> State {
    match (call.op, state) {
        ('A', _) => State::Held {
            lease_until: call.value,
            checkpoint: None,
        },
        ('H', State::Held { checkpoint, .. }) => State::Held {
            lease_until: call.value,
            checkpoint: checkpoint.clone(),
        },
        ('P', State::Held { lease_until, .. }) => State::Held {
            lease_until: *lease_until,
            checkpoint: Some(checkpoint_data(&call.key, call.value)),
        },
        ('C' | 'W', _) => State::Completed { token: call.token },
        ('R', _) => State::Absent,
        (op, state) => panic!("{}: {op} acknowledged in state {state:?}", call.key),
    }
}

/// Whether `view` is exactly what `state` describes.
fn matches(name: &str, state: &State, view: &Option<RecordView>) -> bool {
    match (state, view) {
        (State::Absent, None) => true,
        (
            State::Held {
                lease_until,
                checkpoint,
            },
            Some(view),
        ) => {
            is_first_attempt(name, view)
                && matches!(&view.state, RecordState::InProgress { lease_until: l, checkpoint: c }
                    if l.as_millis() == *lease_until && c == checkpoint)
        }
        (State::Completed { token }, Some(view)) => {
            matches!(&view.state, RecordState::Completed { response, .. }
                if *response == response_for(name, *token))
        }
        _ => false,
    }
}

/// Whether `view` is what `state` becomes once `call` (in flight at the crash) landed.
fn in_flight(name: &str, state: &State, call: &Call, view: &Option<RecordView>) -> bool {
    let Some(v) = view else {
        return call.op == 'R';
    };
    let held = |check: &dyn Fn(u64, &Option<Vec<u8>>) -> bool| {
        is_first_attempt(name, v)
            && matches!(&v.state, RecordState::InProgress { lease_until, checkpoint }
                if check(lease_until.as_millis(), checkpoint))
    };
    match (call.op, state) {
        // The token of a claim in flight is not known: any fresh lease will do.
        ('A', State::Absent) => held(&|_, c| c.is_none()),
        (
            'H',
            State::Held {
                lease_until,
                checkpoint,
            },
        ) => held(&|l, c| l >= *lease_until && c == checkpoint),
        (
            'P',
            State::Held {
                lease_until,
                checkpoint: _,
            },
        ) => {
            let data = checkpoint_data(name, call.value);
            held(&|l, c| l == *lease_until && c.as_deref() == Some(&data[..]))
        }
        ('C' | 'W', State::Held { .. }) => {
            matches(name, &State::Completed { token: call.token }, view)
        }
        _ => false,
    }
}

fn is_first_attempt(name: &str, view: &RecordView) -> bool {
    view.attempt == 1 && view.fingerprint == fingerprint(name)
}

/// The notes of a trace, parsed, with the trace line of each.
pub fn calls(notes: &[Note]) -> Result<Vec<(usize, Call)>, String> {
    notes
        .iter()
        .map(|note| Ok((note.start, Call::parse(&note.text)?)))
        .collect()
}
