//! Publishing counts through the `metrics` crate facade (feature `metrics`): every call here is
//! a no-op without the feature, so call sites need no `cfg`. Names and labels are listed in the
//! README's "Metrics" section; every series carries `backend` (`redb` or `postgres`).

use std::time::Duration;

/// Adds `by` to the counter `name`, with `label` if given (e.g. `("outcome", "replayed")`).
#[cfg(feature = "metrics")]
pub(crate) fn count(
    name: &'static str,
    backend: &'static str,
    label: Option<(&'static str, &'static str)>,
    by: u64,
) {
    match label {
        Some((label, value)) => {
            metrics::counter!(name, "backend" => backend, label => value).increment(by);
        }
        None => metrics::counter!(name, "backend" => backend).increment(by),
    }
}

/// Records `elapsed`, in seconds, in the histogram `name`.
#[cfg(feature = "metrics")]
pub(crate) fn time(name: &'static str, backend: &'static str, elapsed: Duration) {
    metrics::histogram!(name, "backend" => backend).record(elapsed.as_secs_f64());
}

/// Sets the gauge `name` to `value`.
#[cfg(feature = "metrics")]
pub(crate) fn level(name: &'static str, backend: &'static str, value: u64) {
    #[allow(clippy::cast_precision_loss)]
    // gauges are f64 in the facade; sizes stay far below 2^53
    metrics::gauge!(name, "backend" => backend).set(value as f64);
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count(
    _name: &'static str,
    _backend: &'static str,
    _label: Option<(&'static str, &'static str)>,
    _by: u64,
) {
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn time(_name: &'static str, _backend: &'static str, _elapsed: Duration) {}

#[cfg(not(feature = "metrics"))]
pub(crate) fn level(_name: &'static str, _backend: &'static str, _value: u64) {}
