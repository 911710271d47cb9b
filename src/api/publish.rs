//! Publishing counts through the `metrics` crate facade (feature `metrics`): every call here is
//! a no-op without the feature, so call sites need no `cfg`. The series are the statics of
//! `series`.
//!
//! Why static keys: a key built from a call's arguments (what `counter!(name, "backend" =>
//! backend)` does when `name` is not a literal) allocated its label list and had it copied into
//! a shared one by the recorder, and was hashed, on every call.
//!
//! Why handles are cached for the global recorder only: registering a series costs the
//! recorder a lookup on every call (for the Prometheus exporter about 100 ns, a read lock on a
//! shard and a probe), several per claim. A handle skips that, but stays bound to the recorder
//! it was registered with, and an application may install its recorder after opening the
//! store, or swap recorders per thread with `metrics::with_local_recorder`; a local recorder's
//! address can be reused by a later one, so no cache key tells a dropped local recorder from
//! its successor. The global recorder is leaked and can be set only once, so its address is
//! its identity forever: a handle registered with it is cached in the series, and used
//! whenever the current recorder is that one. Any other recorder (a local one, or the no-op
//! one before a global is installed) is asked on every call, as before. The facade does not
//! say which recorder is the global one, so a thread of our own, which has no local recorder,
//! looks (at most every [`LOOK_INTERVAL`], and only while none has been found).

use std::time::Duration;

use crate::api::series::Series;
#[cfg(feature = "metrics")]
use {
    crate::api::series::Handle,
    std::sync::OnceLock,
    std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed},
    std::time::Instant,
};

#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> =
    metrics::Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// How often a store may look for the global recorder while it has not found one.
#[cfg(feature = "metrics")]
const LOOK_INTERVAL: Duration = Duration::from_millis(100);

/// The global recorder's address once found; 0 before.
#[cfg(feature = "metrics")]
static GLOBAL: AtomicUsize = AtomicUsize::new(0);

/// When the next look for the global recorder may run, in milliseconds after `EPOCH`.
#[cfg(feature = "metrics")]
static NEXT_LOOK_MS: AtomicU64 = AtomicU64::new(0);

#[cfg(feature = "metrics")]
static EPOCH: OnceLock<Instant> = OnceLock::new();

#[cfg(feature = "metrics")]
fn address(recorder: &dyn metrics::Recorder) -> usize {
    std::ptr::from_ref(recorder).cast::<()>() as usize
}

/// Whether `recorder` (the current one) is the global recorder, looking for that one first if
/// it has not been found and a look is due. The facade's no-op recorder is zero-sized, so a
/// thread without a local recorder that sees a recorder with a size sees the global one.
#[cfg(feature = "metrics")]
fn is_global(recorder: &dyn metrics::Recorder) -> bool {
    let here = address(recorder);
    let global = GLOBAL.load(Relaxed);
    if global != 0 {
        return here == global;
    }
    if std::mem::size_of_val(recorder) == 0 {
        return false;
    }
    let epoch = EPOCH.get_or_init(Instant::now);
    let now_ms = u64::try_from(epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
    let due = NEXT_LOOK_MS.load(Relaxed);
    let next = now_ms.saturating_add(LOOK_INTERVAL.as_millis() as u64);
    if now_ms < due
        || NEXT_LOOK_MS
            .compare_exchange(due, next, Relaxed, Relaxed)
            .is_err()
    {
        return false;
    }
    let found = std::thread::Builder::new()
        .name("idempotency-metrics".into())
        .spawn(|| metrics::with_recorder(|r| (std::mem::size_of_val(r) > 0).then(|| address(r))))
        .ok()
        .and_then(|thread| thread.join().ok())
        .flatten();
    if let Some(found) = found {
        GLOBAL.store(found, Relaxed);
    }
    found == Some(here)
}

/// Adds `by` to the counter `series`.
#[cfg(feature = "metrics")]
pub(crate) fn count(series: &Series, by: u64) {
    metrics::with_recorder(|recorder| {
        let register = || recorder.register_counter(&series.0, &METADATA);
        if !is_global(recorder) {
            return register().increment(by);
        }
        match series.1.get_or_init(|| Handle::Counter(register())) {
            Handle::Counter(counter) => counter.increment(by),
            _ => register().increment(by),
        }
    });
}

/// Records `elapsed`, in seconds, in the histogram `series`.
#[cfg(feature = "metrics")]
pub(crate) fn time(series: &Series, elapsed: Duration) {
    let seconds = elapsed.as_secs_f64();
    metrics::with_recorder(|recorder| {
        let register = || recorder.register_histogram(&series.0, &METADATA);
        if !is_global(recorder) {
            return register().record(seconds);
        }
        match series.1.get_or_init(|| Handle::Histogram(register())) {
            Handle::Histogram(histogram) => histogram.record(seconds),
            _ => register().record(seconds),
        }
    });
}

/// Sets the gauge `series` to `value`.
#[cfg(feature = "metrics")]
pub(crate) fn level(series: &Series, value: u64) {
    #[allow(clippy::cast_precision_loss)]
    // gauges are f64 in the facade; sizes stay far below 2^53
    let value = value as f64;
    metrics::with_recorder(|recorder| {
        let register = || recorder.register_gauge(&series.0, &METADATA);
        if !is_global(recorder) {
            return register().set(value);
        }
        match series.1.get_or_init(|| Handle::Gauge(register())) {
            Handle::Gauge(gauge) => gauge.set(value),
            _ => register().set(value),
        }
    });
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count(_series: &Series, _by: u64) {}

#[cfg(not(feature = "metrics"))]
pub(crate) fn time(_series: &Series, _elapsed: Duration) {}

#[cfg(not(feature = "metrics"))]
pub(crate) fn level(_series: &Series, _value: u64) {}
