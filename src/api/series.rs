//! The series the stores publish through the `metrics` facade (feature `metrics`), named in
//! `docs/operations.md`, "Metrics". Every combination of name, `backend` and label value is a
//! static here, built at compile time, so publishing one allocates nothing and hashes nothing
//! (see `publish`). Without the feature a series is an empty value and the names are unused.

/// One published series: a name with its `backend` label and at most one more label, and its
/// handle in the global recorder once registered there (see `publish`).
#[cfg(feature = "metrics")]
#[derive(Debug)]
pub(crate) struct Series(
    pub(crate) metrics::Key,
    pub(crate) std::sync::OnceLock<Handle>,
);

/// A series' handle in the global recorder; each series is used as one kind.
#[cfg(feature = "metrics")]
#[derive(Debug)]
pub(crate) enum Handle {
    Counter(metrics::Counter),
    Histogram(metrics::Histogram),
    Gauge(metrics::Gauge),
}

/// One published series (nothing without feature `metrics`).
#[cfg(not(feature = "metrics"))]
#[derive(Debug)]
pub(crate) struct Series;

/// `series!(name, backend)` or `series!(name, backend, label => value)`: a [`Series`] whose
/// key and labels are statics, so its hash is computed by the compiler. `backend` comes first,
/// as the exporters list labels in the key's order.
#[cfg(feature = "metrics")]
macro_rules! series {
    ($name:literal, $backend:literal $(, $label:literal => $value:literal)?) => {{
        static LABELS: &[metrics::Label] = &[
            metrics::Label::from_static_parts("backend", $backend),
            $(metrics::Label::from_static_parts($label, $value),)?
        ];
        Series(
            metrics::Key::from_static_parts($name, LABELS),
            std::sync::OnceLock::new(),
        )
    }};
}

#[cfg(not(feature = "metrics"))]
macro_rules! series {
    ($($name_and_labels:tt)*) => {
        Series
    };
}

/// The kinds of error counted (the fields of `ErrorCounts`).
pub(crate) const ERROR_KINDS: usize = 7;

/// The series of the calls both backends count (`Meter` in `metrics.rs`), for one backend.
#[derive(Debug)]
pub(crate) struct CallSeries {
    /// The backend: `"redb"` or `"postgres"`.
    pub(crate) backend: &'static str,
    pub(crate) acquired: Series,
    pub(crate) taken_over: Series,
    pub(crate) in_progress: Series,
    pub(crate) replayed: Series,
    pub(crate) mismatch: Series,
    pub(crate) completes: Series,
    pub(crate) releases: Series,
    pub(crate) heartbeats: Series,
    pub(crate) lease_lost: Series,
    pub(crate) quota_refusals: Series,
    pub(crate) waits: Series,
    pub(crate) wait_timeouts: Series,
    pub(crate) swept: Series,
    /// `idempotency_errors_total` by `kind`, in the order of `ErrorCounts`' fields.
    pub(crate) errors: [Series; ERROR_KINDS],
    pub(crate) claim_seconds: Series,
    pub(crate) complete_seconds: Series,
}

macro_rules! call_series {
    ($backend:literal) => {
        CallSeries {
            backend: $backend,
            acquired: series!("idempotency_claims_total", $backend, "outcome" => "acquired"),
            taken_over: series!("idempotency_claims_total", $backend, "outcome" => "taken_over"),
            in_progress: series!("idempotency_claims_total", $backend, "outcome" => "in_progress"),
            replayed: series!("idempotency_claims_total", $backend, "outcome" => "replayed"),
            mismatch: series!("idempotency_claims_total", $backend, "outcome" => "mismatch"),
            completes: series!("idempotency_completes_total", $backend),
            releases: series!("idempotency_releases_total", $backend),
            heartbeats: series!("idempotency_heartbeats_total", $backend),
            lease_lost: series!("idempotency_lease_lost_total", $backend),
            quota_refusals: series!("idempotency_quota_refusals_total", $backend),
            waits: series!("idempotency_claim_waits_total", $backend),
            wait_timeouts: series!("idempotency_claim_wait_timeouts_total", $backend),
            swept: series!("idempotency_swept_total", $backend),
            errors: [
                series!("idempotency_errors_total", $backend, "kind" => "invalid_key"),
                series!("idempotency_errors_total", $backend, "kind" => "response_too_large"),
                series!("idempotency_errors_total", $backend, "kind" => "lease_lost"),
                series!("idempotency_errors_total", $backend, "kind" => "quota_exceeded"),
                series!("idempotency_errors_total", $backend, "kind" => "corrupted"),
                series!("idempotency_errors_total", $backend, "kind" => "storage"),
                series!("idempotency_errors_total", $backend, "kind" => "other"),
            ],
            claim_seconds: series!("idempotency_claim_seconds", $backend),
            complete_seconds: series!("idempotency_complete_seconds", $backend),
        }
    };
}

/// The calls of the redb store.
pub(crate) static REDB: CallSeries = call_series!("redb");

/// The calls of the PostgreSQL store.
#[cfg(feature = "postgres")]
pub(crate) static POSTGRES: CallSeries = call_series!("postgres");

/// The redb engine's group-commit batches.
pub(crate) static BATCHES: Series = series!("idempotency_batches_total", "redb");
/// The write calls in those batches.
pub(crate) static BATCHED_OPS: Series = series!("idempotency_batched_ops_total", "redb");
/// Entries appended to the redb engine's write-ahead log.
pub(crate) static LOG_WRITES: Series = series!("idempotency_log_writes_total", "redb");
/// Merges of the log into the database.
pub(crate) static MERGES: Series = series!("idempotency_merges_total", "redb");
/// How long merges take.
pub(crate) static MERGE_SECONDS: Series = series!("idempotency_merge_seconds", "redb");
/// Records logged but not yet merged.
pub(crate) static OVERLAY_RECORDS: Series = series!("idempotency_overlay_records", "redb");
/// Their size, in bytes.
pub(crate) static OVERLAY_BYTES: Series = series!("idempotency_overlay_bytes", "redb");
/// The store file's size, in bytes.
pub(crate) static FILE_BYTES: Series = series!("idempotency_file_bytes", "redb");
/// 1 if the last failover-safety check found commits waiting for a synchronous standby, else 0.
#[cfg(feature = "postgres")]
pub(crate) static FAILOVER_SAFE: Series = series!("idempotency_failover_safe", "postgres");

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use metrics::{Key, Label};

    use super::*;

    /// The key `counter!(name, "backend" => backend, label => value)` builds at run time, as
    /// the stores published before their series were statics.
    fn built(name: &'static str, backend: &'static str, label: Option<(&str, &str)>) -> Key {
        let mut labels = vec![Label::new("backend", backend)];
        labels.extend(label.map(|(key, value)| Label::new(key.to_owned(), value.to_owned())));
        Key::from_parts(name, labels)
    }

    fn labels(key: &Key) -> Vec<(String, String)> {
        key.labels()
            .map(|l| (l.key().to_owned(), l.value().to_owned()))
            .collect()
    }

    fn check(series: &Series, want: &Key) {
        assert_eq!(series.0, *want, "{:?}", series.0);
        assert_eq!(series.0.get_hash(), want.get_hash(), "{want:?}");
        assert_eq!(labels(&series.0), labels(want), "labels in order");
    }

    fn check_calls(calls: &CallSeries, backend: &'static str) {
        assert_eq!(calls.backend, backend);
        let claims = "idempotency_claims_total";
        let outcome = |value| Some(("outcome", value));
        let expected = [
            (&calls.acquired, claims, outcome("acquired")),
            (&calls.taken_over, claims, outcome("taken_over")),
            (&calls.in_progress, claims, outcome("in_progress")),
            (&calls.replayed, claims, outcome("replayed")),
            (&calls.mismatch, claims, outcome("mismatch")),
            (&calls.completes, "idempotency_completes_total", None),
            (&calls.releases, "idempotency_releases_total", None),
            (&calls.heartbeats, "idempotency_heartbeats_total", None),
            (&calls.lease_lost, "idempotency_lease_lost_total", None),
            (
                &calls.quota_refusals,
                "idempotency_quota_refusals_total",
                None,
            ),
            (&calls.waits, "idempotency_claim_waits_total", None),
            (
                &calls.wait_timeouts,
                "idempotency_claim_wait_timeouts_total",
                None,
            ),
            (&calls.swept, "idempotency_swept_total", None),
            (&calls.claim_seconds, "idempotency_claim_seconds", None),
            (
                &calls.complete_seconds,
                "idempotency_complete_seconds",
                None,
            ),
        ];
        for (series, name, label) in expected {
            check(series, &built(name, backend, label));
        }
        let kinds = [
            "invalid_key",
            "response_too_large",
            "lease_lost",
            "quota_exceeded",
            "corrupted",
            "storage",
            "other",
        ];
        for (series, kind) in calls.errors.iter().zip(kinds) {
            let want = built("idempotency_errors_total", backend, Some(("kind", kind)));
            check(series, &want);
        }
    }

    #[test]
    fn static_series_are_the_keys_the_stores_published_before() {
        check_calls(&REDB, "redb");
        #[cfg(feature = "postgres")]
        check_calls(&POSTGRES, "postgres");
        let engine = [
            (&BATCHES, "idempotency_batches_total"),
            (&BATCHED_OPS, "idempotency_batched_ops_total"),
            (&LOG_WRITES, "idempotency_log_writes_total"),
            (&MERGES, "idempotency_merges_total"),
            (&MERGE_SECONDS, "idempotency_merge_seconds"),
            (&OVERLAY_RECORDS, "idempotency_overlay_records"),
            (&OVERLAY_BYTES, "idempotency_overlay_bytes"),
            (&FILE_BYTES, "idempotency_file_bytes"),
        ];
        for (series, name) in engine {
            check(series, &built(name, "redb", None));
        }
        #[cfg(feature = "postgres")]
        check(
            &FAILOVER_SAFE,
            &built("idempotency_failover_safe", "postgres", None),
        );
    }
}
