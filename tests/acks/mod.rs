//! Acknowledged results of a workload, and the check that a reopened store still holds every
//! one of them. Shared by the SIGKILL and the power-loss tests.

use std::collections::HashMap;
use std::time::Duration;

use idempotency_store::{Fingerprint, Key, RecordState, Response, Result, Store};

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
