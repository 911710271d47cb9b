//! Acknowledged results of a workload, and the check that a reopened store still holds every
//! one of them. Shared by the SIGKILL and the power-loss tests.

use std::collections::HashMap;
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::redb::{ReadableTable, TableDefinition};
use idempotency_store::{Fingerprint, Key, Lease, RecordState, Response, Result, Store};

/// The workloads' effect table: key name → (token, the store's time just before the call).
pub const LEDGER: TableDefinition<&str, (u64, u64)> = TableDefinition::new("ledger");

/// Whether a completion of `token` writes a ledger row through an effect: the workloads mix
/// both kinds of completion, and the check tells them apart by the token.
pub fn with_effect(token: u64) -> bool {
    token.is_multiple_of(2)
}

/// Completes `lease` with [`response_for`], writing a ledger row in the same batch if
/// [`with_effect`] says so.
pub fn complete(store: &Store, lease: &Lease, name: &str) -> Result<()> {
    let token = lease.token();
    let response = response_for(name, token);
    if !with_effect(token) {
        return store.complete(lease, response);
    }
    let (row, at) = (name.to_owned(), store.now()?.as_millis());
    store
        .complete_with_effects(lease, response, move |fx| {
            fx.insert(LEDGER, row.as_str(), (token, at))
        })?
        .map_err(|err| panic!("{name}: the ledger effect failed: {err}"))
}

/// Checks that ledger rows and completed responses match key by key: every row's key holds
/// the response of the row's token (unless it may have expired by `now`), and every
/// completion by an effect has its row. Returns the number of rows checked.
pub fn check_ledger(store: &Store, now: u64, retention: Duration) -> Result<usize> {
    let retention = retention.as_millis() as u64;
    let rows: Vec<(String, u64, u64)> = store
        .read_with(
            |txn| -> std::result::Result<_, idempotency_store::redb::Error> {
                let table = match txn.open_table(LEDGER) {
                    Ok(table) => table,
                    Err(idempotency_store::redb::TableError::TableDoesNotExist(_)) => {
                        return Ok(Vec::new());
                    }
                    Err(err) => return Err(err.into()),
                };
                table
                    .iter()?
                    .map(|row| {
                        let (key, value) = row?;
                        let (token, at) = value.value();
                        Ok((key.value().to_owned(), token, at))
                    })
                    .collect()
            },
        )?
        .expect("read the ledger");
    let ledger: HashMap<&str, u64> = rows.iter().map(|(k, t, _)| (k.as_str(), *t)).collect();
    for (name, token, at) in &rows {
        let view = store.lookup(&Key::new(name)?)?;
        let completed = matches!(&view, Some(v) if matches!(&v.state,
            RecordState::Completed { response, .. } if *response == response_for(name, *token)));
        assert!(
            completed || at + retention <= now,
            "{name}: a ledger row of token {token} without its response: {view:?}"
        );
    }
    for record in store.records()? {
        let record = record?;
        let RecordState::Completed { response, .. } = &record.record.state else {
            continue;
        };
        let Some(token) = token_of(response) else {
            continue;
        };
        let name = record.key.key();
        let row = ledger.get(name).copied();
        if with_effect(token) {
            assert_eq!(
                row,
                Some(token),
                "{name}: a response of token {token} without its ledger row"
            );
        }
    }
    Ok(rows.len())
}

/// The token `response_for` wrote into a response.
fn token_of(response: &Response) -> Option<u64> {
    let (_, value) = response
        .headers
        .iter()
        .find(|(name, _)| name == "x-token")?;
    Some(u64::from_le_bytes(value.as_slice().try_into().ok()?))
}

pub fn fingerprint(key: &str) -> Fingerprint {
    Fingerprint::of([key, "crash-body"])
}

/// The response a lease with `token` stores for `key`; a replay must equal it byte for byte.
pub fn response_for(key: &str, token: u64) -> Response {
    Response::new(201, format!("{key}:{token}")).with_header("x-token", token.to_le_bytes())
}

/// One acknowledged event: `A` claim acquired, `C` completed, `r` release about to be called,
/// `R` released. `clock` is the store's time read just before the call (a lower bound of the
/// time the store recorded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub kind: char,
    pub token: u64,
    pub clock: u64,
}

#[derive(Default, Debug)]
pub struct KeyLog {
    pub first_seen: u64,
    pub last: Option<Event>,
}

#[derive(Default, Debug)]
pub struct Acks {
    pub keys: HashMap<String, KeyLog>,
}

impl Acks {
    pub fn record(&mut self, name: &str, event: Event) {
        let entry = self.keys.entry(name.to_owned()).or_default();
        if event.kind == 'A' && entry.last.is_none() {
            entry.first_seen = event.clock;
        }
        entry.last = Some(event);
    }

    /// Checks every acknowledged key against `store` at store time `now`; returns the number
    /// of keys checked. A record may be missing only if it could have expired by `now`.
    pub fn check(&self, store: &Store, now: u64, retention: Duration) -> Result<usize> {
        let retention = retention.as_millis() as u64;
        let mut checks = 0;
        for (name, log) in &self.keys {
            let Some(Event { kind, token, clock }) = log.last else {
                continue;
            };
            let view = store.lookup(&Key::new(name)?)?;
            checks += 1;
            let completed_with = |t: u64| {
                matches!(&view, Some(v) if matches!(&v.state,
                    RecordState::Completed { response, .. } if *response == response_for(name, t)))
            };
            let is_completed =
                matches!(&view, Some(v) if matches!(v.state, RecordState::Completed { .. }));
            match kind {
                'R' => assert!(
                    view.is_none(),
                    "{name}: released but still stored: {view:?}"
                ),
                'r' => assert!(
                    !is_completed,
                    "{name}: completed although only released: {view:?}"
                ),
                'C' => {
                    if view.is_some() || clock + retention > now {
                        assert!(
                            completed_with(token),
                            "{name}: acknowledged completion lost or altered: {view:?}"
                        );
                    }
                }
                'A' => {
                    if view.is_none() {
                        assert!(
                            log.first_seen + retention <= now,
                            "{name}: acknowledged claim lost (first seen {}, now {now})",
                            log.first_seen
                        );
                    } else if is_completed {
                        // The completion committed but was not acknowledged before the crash:
                        // it must be this lease's response, never anything else.
                        assert!(
                            completed_with(token),
                            "{name}: completed with a response never acknowledged: {view:?}"
                        );
                    }
                }
                other => panic!("unknown event kind {other}"),
            }
        }
        Ok(checks)
    }
}
