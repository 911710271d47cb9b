//! Spans and events through `tracing` (feature `tracing`): every item here is a no-op without
//! the feature, so call sites need no `cfg`. Keys can be personal data: events carry a key only
//! when the store was built with `trace_keys(true)`.

use std::time::Duration;

use crate::api::key::Key;

/// Enters a debug-level span named `$name` (with a `backend` field) until the guard drops,
/// if a `tracing` subscriber is current (the global one, or one set on this thread).
///
/// Why not otherwise: with none, if any crate in the build enables `tracing`'s `log` feature
/// (axum does by default), every span is recorded and its entry and exit are described for
/// `log`, whether or not a logger wants them, a cost a replay measurably pays (BENCHMARKS.md,
/// "Figures behind the defaults"). Events still reach `log` then; spans serve subscribers.
macro_rules! enter {
    ($name:literal, $backend:expr) => {{
        #[cfg(feature = "tracing")]
        let guard = tracing::dispatcher::get_default(|current| {
            !current.is::<tracing::subscriber::NoSubscriber>()
        })
        .then(|| tracing::debug_span!($name, backend = $backend).entered());
        #[cfg(not(feature = "tracing"))]
        let guard = $crate::api::trace::NoSpan;
        let _ = $backend;
        guard
    }};
}
pub(crate) use enter;

/// What a span guard is without the feature.
#[cfg(not(feature = "tracing"))]
#[derive(Debug)]
pub(crate) struct NoSpan;

/// The key's text for an event, if the user opted in.
#[cfg(feature = "tracing")]
fn shown(key: &Key, show_keys: bool) -> String {
    if show_keys {
        format!("{key:?}")
    } else {
        String::from("<hidden>")
    }
}

/// A claim took over a lapsed lease.
pub(crate) fn taken_over(backend: &str, key: &Key, attempt: u32, show_keys: bool) {
    #[cfg(feature = "tracing")]
    tracing::debug!(backend, attempt, key = %shown(key, show_keys), "took over a lapsed lease");
    #[cfg(not(feature = "tracing"))]
    let _ = (backend, key, attempt, show_keys);
}

/// A settling call found its lease lost.
pub(crate) fn lease_lost(backend: &str, call: &str) {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        backend,
        call,
        "lease lost: the key was taken over, settled or expired"
    );
    #[cfg(not(feature = "tracing"))]
    let _ = (backend, call);
}

/// An operation ran but its answer could not be stored (`why`): a substitute was stored in
/// its place, so that retries replay it instead of running the operation again.
pub(crate) fn answer_not_stored(why: &dyn std::fmt::Display) {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        %why,
        "the answer could not be stored: a 500 substitute is stored and replayed instead"
    );
    #[cfg(not(feature = "tracing"))]
    let _ = why;
}

/// A `PgStore` connected to a server whose acknowledged commits a failover can lose.
#[cfg(feature = "postgres")]
pub(crate) fn not_failover_safe(report: &dyn std::fmt::Display) {
    #[cfg(feature = "tracing")]
    tracing::warn!(backend = "postgres", "{report}");
    #[cfg(not(feature = "tracing"))]
    let _ = report;
}

/// A `PgStore` without prepared statements found no routine for these statements and sends
/// them as they are: the server then plans them on every call.
#[cfg(feature = "postgres")]
pub(crate) fn routines_missing(statements: &str) {
    #[cfg(feature = "tracing")]
    tracing::warn!(
        backend = "postgres",
        statements,
        "no routine for these statements in the schema, so the server plans them on every \
         call: connect once with migrations on (PgStoreBuilder::migrate) to create them"
    );
    #[cfg(not(feature = "tracing"))]
    let _ = statements;
}

/// A claim was refused for quota.
pub(crate) fn quota_refused(backend: &str) {
    #[cfg(feature = "tracing")]
    tracing::warn!(backend, "claim refused: quota exceeded");
    #[cfg(not(feature = "tracing"))]
    let _ = backend;
}

/// A round of the background sweeper failed; it retries after a backoff.
pub(crate) fn sweeper_failed(error: &crate::error::Error) {
    #[cfg(feature = "tracing")]
    tracing::warn!(%error, "the background sweeper failed; it will retry");
    #[cfg(not(feature = "tracing"))]
    let _ = error;
}

/// Merges slower than this are warned about.
#[cfg(feature = "tracing")]
pub(crate) const SLOW_MERGE: Duration = Duration::from_secs(1);

/// A merge committed after `elapsed`.
pub(crate) fn merged(elapsed: Duration) {
    #[cfg(feature = "tracing")]
    if elapsed >= SLOW_MERGE {
        tracing::warn!(?elapsed, "slow merge of the log into the database");
    } else {
        tracing::debug!(?elapsed, "merged the log into the database");
    }
    #[cfg(not(feature = "tracing"))]
    let _ = elapsed;
}

/// A batch leader ran a batch of `ops` write calls.
pub(crate) fn batch(ops: usize) {
    #[cfg(feature = "tracing")]
    tracing::trace!(ops, "batch leader: running a batch");
    #[cfg(not(feature = "tracing"))]
    let _ = ops;
}

/// Opening moved a format-3 file's `records` into the tables of format 5, and left out
/// `dropped` records filed under a hash that was not their key's (no lookup reached them).
pub(crate) fn migrated(records: u64, dropped: u64) {
    #[cfg(feature = "tracing")]
    if dropped == 0 {
        tracing::info!(records, "opening moved the records to store format 5");
    } else {
        tracing::warn!(
            records,
            dropped,
            "opening moved the records to store format 5 and left out records filed under a \
             hash that was not their key's (the earlier release's `verify` reported them)"
        );
    }
    #[cfg(not(feature = "tracing"))]
    let _ = (records, dropped);
}

/// Opening replayed `entries` log entries written after the last merge.
pub(crate) fn recovered(entries: usize) {
    #[cfg(feature = "tracing")]
    tracing::debug!(entries, "recovery at open: replayed the log");
    #[cfg(not(feature = "tracing"))]
    let _ = entries;
}
