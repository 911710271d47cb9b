//! The commands that look: `stats`, `get`, `list` and `export`. They never change the store.

use std::io::Write;
use std::process::ExitCode;

use idempotency_store::admin::{Stats, StoredRecord};
use idempotency_store::client::SCOPE;
use idempotency_store::{IdempotencyStore, Key, RecordState, RecordView, Timestamp};
use serde_json::{Value, json};

use crate::StateFilter;
use crate::format::{hex, human_bytes, printable, relative, shown_bytes, span, table, utc};
use crate::output::{
    EXIT_FAILED, EXIT_PROBLEM, Fail, Format, Outcome, damaged_outcome, describe, fail, warn,
};
use crate::records::{
    KEY_WIDTH, Outbound, is_intent, is_stuck, label, lease, make_key, quote_hint, record_json,
    shown, truncate,
};
use crate::target::{Source, store_fail};

/// `stats`: records by state. The outbox's intents are counted apart from the in-progress
/// requests, and never as stuck: releasing one would give its operation a new key.
pub(crate) fn stats(out: &mut dyn Write, format: Format, source: Source) -> Outcome {
    let path = source.path;
    let opened = source.open()?;
    let store = &*opened.store;
    let mut s: Stats = store.stats().map_err(|e| store_fail(path, &e))?;
    let total = s.in_progress + s.completed + s.expired;
    let (size_name, size_field) = opened.size_names();
    let intents = if s.in_progress > 0 {
        count_intents(store, path)?
    } else {
        Intents::default()
    };
    s.in_progress = s.in_progress.saturating_sub(intents.live);
    s.stuck = s.stuck.saturating_sub(intents.lapsed);
    if format.is_json() {
        let mut value = json!({
            "records": total,
            "in_progress": s.in_progress,
            "outbound_intents": intents.live,
            "stuck": s.stuck,
            "completed": s.completed,
            "expired": s.expired,
        });
        if let Value::Object(map) = &mut value {
            map.insert(size_field.into(), json!(s.file_bytes));
            if let Some(failover) = &opened.failover {
                map.insert("failover_safe".into(), json!(failover.is_failover_safe()));
                map.insert("replication".into(), json!(failover.to_string()));
            }
        }
        writeln!(out, "{value}")?;
    } else {
        let stuck = if s.stuck > 0 {
            format!(
                "({} stuck: lease lapsed, waiting for a retry or `release`)",
                s.stuck
            )
        } else {
            String::new()
        };
        let row = |name: &str, count: u64, note: &str| {
            vec![name.to_owned(), count.to_string(), note.to_owned()]
        };
        let mut rows = vec![
            row("in progress", s.in_progress, &stuck),
            row(
                "outbound",
                intents.live,
                "(intents of the client's outbox: resent with the same key until answered)",
            ),
            row("completed", s.completed, ""),
            row("expired", s.expired, "(deleted by the next sweep)"),
            row("total", total, ""),
        ];
        if intents.live == 0 {
            rows.remove(1);
        }
        table(out, &["STATE", "RECORDS", ""], &rows)?;
        if let Some(bytes) = s.file_bytes {
            writeln!(out, "\n{size_name}: {} ({bytes} bytes)", human_bytes(bytes))?;
        }
        if let Some(failover) = &opened.failover {
            writeln!(out, "replication: {failover}")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Unexpired in-progress intents of the client's outbox, and how many of them have a lapsed
/// lease (which `Stats` counts as stuck).
#[derive(Default)]
struct Intents {
    live: u64,
    lapsed: u64,
}

fn count_intents(store: &dyn IdempotencyStore, path: &std::path::Path) -> Result<Intents, Fail> {
    let now = store.now().map_err(|e| store_fail(path, &e))?;
    let mut intents = Intents::default();
    for item in store.records().map_err(|e| store_fail(path, &e))? {
        // A damaged record is reported by `list` and `verify`; the counts stay the store's.
        let Ok(StoredRecord { key, record, .. }) = item else {
            continue;
        };
        if is_intent(&key) && record.expires_at > now && lease(&record).is_some() {
            intents.live += 1;
            intents.lapsed += u64::from(record.is_stuck(now));
        }
    }
    Ok(intents)
}

/// `get`: one record. A key not found as given is looked for as an operation id of the
/// client's outbox and as a key its intents sent; failing that, the scopes holding that key
/// are named.
pub(crate) fn get(
    out: &mut dyn Write,
    format: Format,
    source: Source,
    key: &str,
    scope: Option<&str>,
) -> Outcome {
    let path = source.path;
    let key = make_key(key, scope)?;
    let opened = source.open()?;
    let store = &*opened.store;
    let now = store.now().map_err(|e| store_fail(path, &e))?;
    let found = match store.inspect(&key).map_err(|e| store_fail(path, &e))? {
        Some(record) => Some((key.clone(), record)),
        None if key.scope().is_none() => elsewhere(store, path, &key, format)?,
        None => None,
    };
    let Some((key, record)) = found else {
        let hint = match key.scope() {
            Some(_) => String::new(),
            None => scope_hint(store, path, &key)?,
        };
        return Err(fail(
            EXIT_PROBLEM,
            "no-record",
            format!(
                "no record for key {}{}{hint}",
                shown(&key),
                quote_hint(store, &key, "get")
            ),
        ));
    };
    let as_json = format.is_json();
    if as_json {
        writeln!(out, "{}", record_json(&key, &record, now, true))?;
        return Ok(ExitCode::SUCCESS);
    }
    let when = |t: Timestamp| format!("{} ({})", utc(t), relative(t, now));
    let mut rows: Vec<[String; 2]> = vec![
        ["key".into(), key.key().into()],
        ["scope".into(), key.scope().unwrap_or("-").into()],
        ["state".into(), label(&key, &record, now).into()],
        ["attempt".into(), record.attempt.to_string()],
        [
            "fingerprint".into(),
            format!(
                "v{} {}",
                record.fingerprint.version(),
                hex(record.fingerprint.digest())
            ),
        ],
        ["created".into(), when(record.created_at)],
    ];
    if let Some(intent) = Outbound::of(&key, &record) {
        rows.push([
            "intent".into(),
            "outbound, kept by the client's outbox: every send carries the key sent below, \
             until the server answers; never release it"
                .into(),
        ]);
        rows.push(["operation id".into(), intent.operation_id]);
        rows.push([
            "key sent".into(),
            intent
                .key_sent
                .unwrap_or_else(|| "- (not kept once finished)".into()),
        ]);
        rows.push([
            "sends".into(),
            intent.sends.map_or_else(|| "-".into(), |n| n.to_string()),
        ]);
    }
    match &record.state {
        RecordState::InProgress {
            lease_until,
            checkpoint,
        } => {
            let lease = if *lease_until > now {
                format!(
                    "{} (live for {} more)",
                    utc(*lease_until),
                    span(*lease_until, now)
                )
            } else {
                format!(
                    "{} (lapsed {} ago)",
                    utc(*lease_until),
                    span(now, *lease_until)
                )
            };
            rows.push(["lease until".into(), lease]);
            rows.push(["expires".into(), when(record.expires_at)]);
            rows.push([
                "checkpoint".into(),
                checkpoint
                    .as_deref()
                    .map_or_else(|| "-".into(), shown_bytes),
            ]);
        }
        RecordState::Completed {
            completed_at,
            response,
        } => {
            rows.push(["completed".into(), when(*completed_at)]);
            rows.push(["expires".into(), when(record.expires_at)]);
            rows.push(["status".into(), response.status.to_string()]);
            for (name, value) in &response.headers {
                rows.push([
                    "header".into(),
                    format!(
                        "{name}: {}",
                        printable(value).unwrap_or_else(|| shown_bytes(value))
                    ),
                ]);
            }
            rows.push(["body".into(), shown_bytes(&response.body)]);
        }
        // A state a later library version adds: shown by name only.
        _ => rows.push(["state".into(), format!("{:?}", record.state)]),
    }
    for [name, value] in rows {
        writeln!(out, "{name:<12} {value}")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The record a scope-less key that was not found stands for, if there is one: the outbox's
/// intent with that operation id, or the intent that sent that key. Says so on stderr.
fn elsewhere(
    store: &dyn IdempotencyStore,
    path: &std::path::Path,
    key: &Key,
    format: Format,
) -> Result<Option<(Key, RecordView)>, Fail> {
    if let Ok(intent) = Key::scoped(SCOPE, key.key())
        && let Some(record) = store.inspect(&intent).map_err(|e| store_fail(path, &e))?
    {
        warn(
            format,
            &format!(
                "no record for key {} without a scope; showing the outbox's intent with that \
                 operation id (--scope {SCOPE})",
                shown(key)
            ),
        );
        return Ok(Some((intent, record)));
    }
    for item in store.records().map_err(|e| store_fail(path, &e))? {
        let Ok(StoredRecord {
            key: found, record, ..
        }) = item
        else {
            continue;
        };
        let sent = Outbound::of(&found, &record).and_then(|intent| intent.key_sent);
        if sent.as_deref() == Some(key.key()) {
            warn(
                format,
                &format!(
                    "key {} was sent by the outbox's intent {:?}; showing it (--scope {SCOPE})",
                    shown(key),
                    found.key()
                ),
            );
            return Ok(Some((found, record)));
        }
    }
    Ok(None)
}

/// For a scope-less key not found: the scopes that hold a record with that key, as `--scope`
/// to try.
fn scope_hint(
    store: &dyn IdempotencyStore,
    path: &std::path::Path,
    key: &Key,
) -> Result<String, Fail> {
    let mut scopes: Vec<String> = Vec::new();
    for item in store.records().map_err(|e| store_fail(path, &e))? {
        let Ok(StoredRecord { key: found, .. }) = item else {
            continue;
        };
        if let Some(scope) = found.scope()
            && found.key() == key.key()
            && !scopes.iter().any(|s| s == scope)
        {
            scopes.push(scope.to_owned());
        }
    }
    Ok(match scopes.as_slice() {
        [] => String::new(),
        [one] => format!("; a record with that key is in a scope: try --scope {one}"),
        many => format!(
            "; records with that key are in scopes: try --scope with one of {}",
            many.join(", ")
        ),
    })
}

/// Which records `list` shows.
pub(crate) struct Filter {
    pub(crate) state: Option<StateFilter>,
    pub(crate) stuck: bool,
    pub(crate) limit: Option<usize>,
}

/// `list`: the records that pass the filter, oldest first (by creation time, then key). The
/// outbox's intents show their state and the key they sent, and are never stuck.
pub(crate) fn list(
    out: &mut dyn Write,
    format: Format,
    source: Source,
    filter: Filter,
    full: bool,
) -> Outcome {
    let path = source.path;
    let as_json = format.is_json();
    let Filter {
        state,
        stuck,
        limit,
    } = filter;
    if stuck && matches!(state, Some(StateFilter::Completed | StateFilter::Expired)) {
        return Err(fail(
            EXIT_FAILED,
            "usage",
            "--stuck selects in-progress records; it cannot be combined with that --state",
        ));
    }
    let opened = source.open()?;
    let store = &*opened.store;
    let now = store.now().map_err(|e| store_fail(path, &e))?;
    let limit = limit.unwrap_or(usize::MAX);
    let mut shown = Vec::new();
    let mut damaged = 0u64;
    for item in store.records().map_err(|e| store_fail(path, &e))? {
        let entry = match item {
            Ok(entry) => entry,
            Err(err) => {
                damaged += 1;
                warn(format, &format!("skipped: {}", describe(&err)));
                continue;
            }
        };
        let r = &entry.record;
        let expired = r.expires_at <= now;
        let keep = match state {
            None => true,
            Some(StateFilter::Expired) => expired,
            Some(StateFilter::InProgress) => !expired && lease(r).is_some(),
            Some(StateFilter::Completed) => !expired && lease(r).is_none(),
        } && (!stuck || is_stuck(&entry.key, r, now));
        if keep {
            shown.push(entry);
        }
    }
    shown.sort_by(|a, b| {
        (a.record.created_at, a.key.scope(), a.key.key()).cmp(&(
            b.record.created_at,
            b.key.scope(),
            b.key.key(),
        ))
    });
    let more = shown.len() > limit;
    shown.truncate(limit);
    if as_json {
        let rows: Vec<Value> = shown
            .iter()
            .map(|e| record_json(&e.key, &e.record, now, false))
            .collect();
        writeln!(out, "{}", Value::Array(rows))?;
    } else if shown.is_empty() {
        writeln!(out, "no matching records")?;
    } else {
        let width = if full { usize::MAX } else { KEY_WIDTH };
        let mut cut = false;
        let mut fit = |text: &str| {
            let (text, was_cut) = truncate(text, width);
            cut |= was_cut;
            text
        };
        // Columns for the outbox's intents, only when some are shown.
        let intents = shown.iter().any(|e| is_intent(&e.key));
        let rows: Vec<Vec<String>> = shown
            .iter()
            .map(|e| {
                let r = &e.record;
                let (until, status) = match &r.state {
                    RecordState::InProgress { lease_until, .. } => (utc(*lease_until), "-".into()),
                    RecordState::Completed {
                        completed_at,
                        response,
                    } => (utc(*completed_at), response.status.to_string()),
                    _ => ("-".into(), "-".into()),
                };
                let mut row = vec![
                    fit(e.key.key()),
                    fit(e.key.scope().unwrap_or("-")),
                    label(&e.key, r, now).to_owned(),
                    r.attempt.to_string(),
                    utc(r.created_at),
                    until,
                    utc(r.expires_at),
                    status,
                ];
                if intents {
                    let intent = Outbound::of(&e.key, r);
                    let sends = intent.as_ref().and_then(|i| i.sends);
                    let sent = intent.and_then(|i| i.key_sent);
                    row.push(sends.map_or_else(|| "-".into(), |n| n.to_string()));
                    row.push(sent.map_or_else(|| "-".into(), |k| fit(&k)));
                }
                row
            })
            .collect();
        let mut header = vec![
            "KEY",
            "SCOPE",
            "STATE",
            "ATTEMPT",
            "CREATED (UTC)",
            "LEASE UNTIL / COMPLETED",
            "EXPIRES",
            "STATUS",
        ];
        if intents {
            header.extend(["SENDS", "KEY SENT"]);
        }
        table(out, &header, &rows)?;
        if cut {
            warn(
                format,
                &format!(
                    "keys or scopes longer than {KEY_WIDTH} characters are cut short (…); \
                 `--full` shows them whole, `get` shows one record"
                ),
            );
        }
    }
    if more {
        warn(
            format,
            &format!("showing the first {limit} matching records; more match (raise --limit)"),
        );
    }
    damaged_outcome(damaged)
}

/// `export`: every record as a JSON line, in the store's order.
pub(crate) fn export(out: &mut dyn Write, format: Format, source: Source) -> Outcome {
    let path = source.path;
    let opened = source.open()?;
    let store = &*opened.store;
    let now = store.now().map_err(|e| store_fail(path, &e))?;
    let mut damaged = 0u64;
    for item in store.records().map_err(|e| store_fail(path, &e))? {
        match item {
            Ok(entry) => writeln!(out, "{}", record_json(&entry.key, &entry.record, now, true))?,
            Err(err) => {
                damaged += 1;
                warn(format, &format!("not exported: {}", describe(&err)));
            }
        }
    }
    damaged_outcome(damaged)
}
