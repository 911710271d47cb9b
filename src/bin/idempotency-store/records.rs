//! Records as the commands show them: states, keys, JSON, and the client outbox's intents.

use idempotency_store::client::{Outbox, SCOPE, Sent};
use idempotency_store::{IdempotencyStore, Key, RecordState, RecordView, Timestamp};
use serde_json::{Value, json};

use crate::format::{base64, hex};
use crate::output::{EXIT_FAILED, Fail, describe, fail};

/// `list` cuts keys and scopes longer than this (characters) unless `--full`.
pub(crate) const KEY_WIDTH: usize = 64;

/// The key named on the command line.
pub(crate) fn make_key(key: &str, scope: Option<&str>) -> Result<Key, Fail> {
    match scope {
        Some(scope) => Key::scoped(scope, key),
        None => Key::new(key),
    }
    .map_err(|e| fail(EXIT_FAILED, "invalid-key", describe(&e)))
}

/// For a key that was not found and is wrapped in quotes: a hint that the quotes are part of
/// it. An `Idempotency-Key` header carries the key as a quoted string, and the HTTP mapping
/// stores it without the quotes; copied from the header, the quotes come along.
pub(crate) fn quote_hint(store: &dyn IdempotencyStore, key: &Key, command: &str) -> String {
    let text = key.key();
    let inner = ['"', '\''].iter().find_map(|&q| {
        text.strip_prefix(q)
            .and_then(|rest| rest.strip_suffix(q))
            .filter(|inner| !inner.is_empty())
    });
    let Some(inner) = inner else {
        return String::new();
    };
    let bare = match key.scope() {
        Some(scope) => Key::scoped(scope, inner),
        None => Key::new(inner),
    };
    let found = bare
        .ok()
        .and_then(|bare| store.inspect(&bare).ok())
        .is_some_and(|record| record.is_some());
    let scope = key
        .scope()
        .map(|scope| format!(" --scope {scope}"))
        .unwrap_or_default();
    format!(
        "; the quotes are part of the key you gave: an Idempotency-Key header quotes its key, \
         and the store keeps it without the quotes ({}: {command} PATH {inner}{scope})",
        if found {
            "there is a record without them"
        } else {
            "try without them"
        }
    )
}

/// The lease deadline of an in-progress record.
pub(crate) fn lease(record: &RecordView) -> Option<Timestamp> {
    match record.state {
        RecordState::InProgress { lease_until, .. } => Some(lease_until),
        _ => None,
    }
}

/// The state shown for a record: an outbound intent's (queued, sent, answered, finished), or
/// expired, stuck, in-progress, completed.
pub(crate) fn label(key: &Key, record: &RecordView, now: Timestamp) -> &'static str {
    if record.expires_at <= now {
        "expired"
    } else if let Some(intent) = Outbound::of(key, record) {
        intent.state
    } else if record.is_stuck(now) {
        "stuck"
    } else if lease(record).is_some() {
        "in-progress"
    } else {
        "completed"
    }
}

/// Whether a record is stuck: its lease lapsed, and it is not an intent of the client's
/// outbox (which holds its intents until they are answered, whatever their lease).
pub(crate) fn is_stuck(key: &Key, record: &RecordView, now: Timestamp) -> bool {
    record.is_stuck(now) && !is_intent(key)
}

/// Whether a record is the client outbox's: an outbound intent (its key is the operation id,
/// under the outbox's scope), never a request a server is handling.
pub(crate) fn is_intent(key: &Key) -> bool {
    key.scope() == Some(SCOPE)
}

/// An outbound intent of the client's outbox, as the commands show it.
pub(crate) struct Outbound {
    /// The caller's id of the operation (the record's key).
    pub(crate) operation_id: String,
    /// The idempotency key its sends carry; unknown once it is finished (the record then
    /// holds the final answer only) or if its state cannot be read.
    pub(crate) key_sent: Option<String>,
    /// Sends recorded so far, if known.
    pub(crate) sends: Option<u32>,
    /// queued (nothing sent yet), sent (a send may have reached the server, no answer
    /// recorded), answered (the last send was answered, not finally), finished (the final
    /// answer is stored) or unreadable.
    pub(crate) state: &'static str,
}

impl Outbound {
    /// The intent a record holds, if it is the outbox's.
    pub(crate) fn of(key: &Key, record: &RecordView) -> Option<Outbound> {
        if !is_intent(key) {
            return None;
        }
        let operation_id = key.key().to_owned();
        let unknown = |state| Outbound {
            operation_id: operation_id.clone(),
            key_sent: None,
            sends: None,
            state,
        };
        Some(match Outbox::intent_of(key, record) {
            Ok(Some(pending)) => Outbound {
                state: match (pending.attempts, pending.last) {
                    (0, _) => "queued",
                    (_, Some(Sent::Answered(_))) => "answered",
                    _ => "sent",
                },
                operation_id: pending.operation_id,
                key_sent: Some(pending.key),
                sends: Some(pending.attempts),
            },
            Ok(None) if lease(record).is_none() => unknown("finished"),
            Ok(None) | Err(_) => unknown("unreadable"),
        })
    }

    /// The intent as JSON, for `record_json`.
    fn json(&self) -> Value {
        json!({
            "operation_id": self.operation_id,
            "key_sent": self.key_sent,
            "sends": self.sends,
            "state": self.state,
        })
    }
}

/// A record as JSON; `full` adds the checkpoint and the whole response (export, get).
pub(crate) fn record_json(key: &Key, record: &RecordView, now: Timestamp, full: bool) -> Value {
    let (state, lease_until, completed_at, status) = match &record.state {
        RecordState::InProgress { lease_until, .. } => {
            ("in-progress", Some(lease_until.as_millis()), None, None)
        }
        RecordState::Completed {
            completed_at,
            response,
        } => (
            "completed",
            None,
            Some(completed_at.as_millis()),
            Some(response.status),
        ),
        _ => ("unknown", None, None, None),
    };
    let mut value = json!({
        "key": key.key(),
        "scope": key.scope(),
        "state": state,
        "stuck": is_stuck(key, record, now),
        "expired": record.expires_at <= now,
        "attempt": record.attempt,
        "fingerprint": hex(record.fingerprint.digest()),
        "fingerprint_version": record.fingerprint.version(),
        "created_at_ms": record.created_at.as_millis(),
        "expires_at_ms": record.expires_at.as_millis(),
        "lease_until_ms": lease_until,
        "completed_at_ms": completed_at,
        "status": status,
    });
    if let (Some(intent), Value::Object(map)) = (Outbound::of(key, record), &mut value) {
        map.insert("intent".into(), intent.json());
    }
    if full && let Value::Object(map) = &mut value {
        let (checkpoint, response) = match &record.state {
            RecordState::InProgress { checkpoint, .. } => {
                (checkpoint.as_deref().map(base64), Value::Null)
            }
            RecordState::Completed { response, .. } => {
                let headers: Vec<Value> = response
                    .headers
                    .iter()
                    .map(|(name, value)| json!({ "name": name, "value_base64": base64(value) }))
                    .collect();
                let response = json!({
                    "status": response.status,
                    "headers": headers,
                    "body_base64": base64(&response.body),
                });
                (None, response)
            }
            _ => (None, Value::Null),
        };
        map.insert("checkpoint_base64".into(), json!(checkpoint));
        map.insert("response".into(), response);
    }
    value
}

/// `text` cut to `width` characters, its last one `…`, and whether it was cut.
pub(crate) fn truncate(text: &str, width: usize) -> (String, bool) {
    if text.chars().count() <= width {
        return (text.to_owned(), false);
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    (cut, true)
}

/// A key for messages: quoted, with its scope.
pub(crate) fn shown(key: &Key) -> String {
    match key.scope() {
        Some(scope) => format!("{:?} (scope {scope:?})", key.key()),
        None => format!("{:?}", key.key()),
    }
}
