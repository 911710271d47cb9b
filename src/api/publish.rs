//! Publishing counts through the `metrics` crate facade (feature `metrics`): every call here is
//! a no-op without the feature, so call sites need no `cfg`. The series are the statics of
//! `series`.
//!
//! Why static keys and no cached handles: a key built from a call's arguments (what
//! `counter!(name, "backend" => backend)` does when `name` is not a literal) allocated its
//! label list and had it copied into a shared one by the recorder, and was hashed, on every
//! call; a static key costs the recorder only its lookup (for the Prometheus exporter, a read
//! lock on one shard and a probe with the precomputed hash). Caching the `Counter` and
//! `Histogram` handles would save that lookup too, but a handle stays bound to the recorder
//! it was registered with: an application may install its recorder after opening the store,
//! and `metrics::with_local_recorder` swaps recorders per thread. The facade does not say
//! whether the current recorder is the global one, and a local recorder's address can be
//! reused by a later one, so no cache key tells a dropped recorder from its successor, which
//! would then miss the counts.

use std::time::Duration;

use crate::api::series::Series;

#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// Adds `by` to the counter `series`.
#[cfg(feature = "metrics")]
pub(crate) fn count(series: &Series, by: u64) {
    metrics::with_recorder(|recorder| recorder.register_counter(&series.0, &METADATA))
        .increment(by);
}

/// Records `elapsed`, in seconds, in the histogram `series`.
#[cfg(feature = "metrics")]
pub(crate) fn time(series: &Series, elapsed: Duration) {
    metrics::with_recorder(|recorder| recorder.register_histogram(&series.0, &METADATA))
        .record(elapsed.as_secs_f64());
}

/// Sets the gauge `series` to `value`.
#[cfg(feature = "metrics")]
pub(crate) fn level(series: &Series, value: u64) {
    #[allow(clippy::cast_precision_loss)]
    // gauges are f64 in the facade; sizes stay far below 2^53
    metrics::with_recorder(|recorder| recorder.register_gauge(&series.0, &METADATA))
        .set(value as f64);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count(_series: &Series, _by: u64) {}

#[cfg(not(feature = "metrics"))]
pub(crate) fn time(_series: &Series, _elapsed: Duration) {}

#[cfg(not(feature = "metrics"))]
pub(crate) fn level(_series: &Series, _value: u64) {}
