//! `release`: deleting a key's in-progress record without its lease, with every guard.

use std::io::{self, BufRead, IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;

use idempotency_store::admin::ForceRelease;
use idempotency_store::{IdempotencyStore, Key, RecordView, Timestamp};
use serde_json::json;

use crate::format::span;
use crate::output::{EXIT_FAILED, Fail, Format, Outcome, fail};
use crate::records::{Outbound, is_intent, lease, make_key, quote_hint, shown};
use crate::target::{Source, store_fail};

/// The flag that lets `release` delete an intent of the client's outbox.
const INTENT_FLAG: &str = "--allow-new-key-may-charge-twice";

/// What the operator allowed on the command line.
pub(crate) struct Options {
    /// Do not ask (`--yes`).
    pub(crate) yes: bool,
    /// Release an intent of the client's outbox too (`--allow-new-key-may-charge-twice`).
    pub(crate) intents: bool,
}

/// `release`: deletes a key's in-progress record so that the next claim runs afresh. Refused
/// for completed records, and for the client outbox's intents unless the operator named the
/// risk (`--allow-new-key-may-charge-twice`): a released intent is begun again under a new
/// key, so a send that reached the server would be carried out twice.
pub(crate) fn release(
    out: &mut dyn Write,
    format: Format,
    source: Source,
    key: &str,
    scope: Option<&str>,
    options: Options,
) -> Outcome {
    let path = source.path;
    let as_json = format.is_json();
    let key = make_key(key, scope)?;
    // Decided on a read-only look: a refusal, or a "no" at the prompt, leaves a file as it was.
    let looked = source.open()?;
    let now = looked.store.now().map_err(|e| store_fail(path, &e))?;
    let (record, lease_until) = releasable(&*looked.store, path, &key, now)?;
    if is_intent(&key) && !options.intents {
        return Err(refuse_intent(&key, &record));
    }
    if !options.yes && !confirmed(&key, &record, lease_until, now)? {
        // The operator's decision, not a failure.
        if as_json {
            let value = json!({ "released": false, "key": key.key(), "scope": key.scope() });
            writeln!(out, "{value}")?;
        } else {
            writeln!(out, "nothing released")?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    // The look's shared lock must go before a writable open can lock the file.
    drop(looked);
    let released = source.change(format, |store| {
        store.force_release(&key).map_err(|e| store_fail(path, &e))
    })?;
    match released {
        ForceRelease::Released {
            attempt,
            lease_until,
        } => {
            if as_json {
                let value = json!({
                    "released": true,
                    "key": key.key(),
                    "scope": key.scope(),
                    "attempt": attempt,
                    "lease_until_ms": lease_until.as_millis(),
                    "lease_was_live": lease_until > now,
                });
                writeln!(out, "{value}")?;
            } else {
                writeln!(
                    out,
                    "released key {} (attempt {attempt}); the next claim runs the operation afresh",
                    shown(&key)
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        ForceRelease::Completed => Err(fail(
            EXIT_FAILED,
            "refused",
            format!(
                "key {} completed meanwhile; nothing was changed",
                shown(&key)
            ),
        )),
        _ => Err(fail(
            EXIT_FAILED,
            "refused",
            format!("key {} is gone meanwhile; nothing was changed", shown(&key)),
        )),
    }
}

/// The key's record and its lease deadline, if `release` may delete it: it exists, has not
/// expired and is in progress.
fn releasable(
    store: &dyn IdempotencyStore,
    path: &Path,
    key: &Key,
    now: Timestamp,
) -> Result<(RecordView, Timestamp), Fail> {
    let record = store.inspect(key).map_err(|e| store_fail(path, &e))?;
    let Some(record) = record.filter(|r| r.expires_at > now) else {
        return Err(fail(
            EXIT_FAILED,
            "no-record",
            format!(
                "no record for key {} (nothing to release){}",
                shown(key),
                quote_hint(store, key, "release")
            ),
        ));
    };
    let Some(lease_until) = lease(&record) else {
        return Err(fail(
            EXIT_FAILED,
            "refused",
            format!(
                "refusing to release key {}: it is completed and replays its response; \
                 release only un-sticks in-progress keys",
                shown(key)
            ),
        ));
    };
    Ok((record, lease_until))
}

/// The refusal to release an intent of the client's outbox without the flag that names the
/// risk.
fn refuse_intent(key: &Key, record: &RecordView) -> Fail {
    let about = Outbound::of(key, record).map_or_else(String::new, |intent| {
        format!(
            " (operation id {:?}, {} so far, key sent {})",
            intent.operation_id,
            intent
                .sends
                .map_or_else(|| "sends unknown".to_owned(), |n| format!("{n} send(s)")),
            intent.key_sent.as_deref().unwrap_or("unknown"),
        )
    });
    fail(
        EXIT_FAILED,
        "refused",
        format!(
            "refusing to release key {}: it is an outbound intent of the client's outbox{about}, \
             not a stuck request. Releasing it deletes the key the device sends; its next \
             begin mints a NEW key, and if a send reached the server the payment is made \
             twice. The device resends it with the same key by itself. Only if the server \
             is known never to have received it, pass {INTENT_FLAG}",
            shown(key)
        ),
    )
}

/// Asks on the terminal whether to release the key; refuses without a terminal.
fn confirmed(
    key: &Key,
    record: &RecordView,
    lease_until: Timestamp,
    now: Timestamp,
) -> Result<bool, Fail> {
    if !io::stdin().is_terminal() {
        return Err(fail(
            EXIT_FAILED,
            "refused",
            format!(
                "refusing to release key {} without confirmation: stdin is not a terminal; \
                 check downstream, then pass --yes",
                shown(key)
            ),
        ));
    }
    let holder = if lease_until > now {
        format!(
            "its lease is LIVE for {} more: attempt {} may still be running",
            span(lease_until, now),
            record.attempt
        )
    } else {
        format!(
            "its lease lapsed {} ago (attempt {})",
            span(now, lease_until),
            record.attempt
        )
    };
    let mut err = io::stderr().lock();
    write!(
        err,
        "Key {} is in progress; {holder}.\nReleasing deletes the record without the lease: \
         the next retry runs the operation AGAIN.\nIf the operation (or its side effect) \
         may have happened, it will happen twice. Check downstream first.\n\
         Release key {}? [y/N] ",
        shown(key),
        shown(key)
    )?;
    err.flush()?;
    let mut answer = String::new();
    io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}
