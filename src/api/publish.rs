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
//! looks (at most every [`LOOK_INTERVAL`], only while none has been found, and without the
//! calling thread waiting for it).

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
    // Not joined: a store call may run on an async worker thread, which must not wait. This
    // call and those before the look ends ask the recorder, as for any other.
    let _ = std::thread::Builder::new()
        .name("idempotency-metrics".into())
        .spawn(|| {
            let found =
                metrics::with_recorder(|r| (std::mem::size_of_val(r) > 0).then(|| address(r)));
            if let Some(found) = found {
                GLOBAL.store(found, Relaxed);
            }
        });
    false
}

/// Runs `act` on `series`' handle in the current recorder: the cached one when that is the
/// global recorder, else one registered for this call.
#[cfg(feature = "metrics")]
fn with_handle<H>(
    series: &Series,
    register: fn(&dyn metrics::Recorder, &metrics::Key) -> H,
    wrap: fn(H) -> Handle,
    cached: fn(&Handle) -> Option<&H>,
    act: impl FnOnce(&H),
) {
    metrics::with_recorder(|recorder| {
        let fresh = || register(recorder, &series.0);
        if !is_global(recorder) {
            return act(&fresh());
        }
        match cached(series.1.get_or_init(|| wrap(fresh()))) {
            Some(handle) => act(handle),
            None => act(&fresh()),
        }
    });
}

/// Adds `by` to the counter `series`.
#[cfg(feature = "metrics")]
pub(crate) fn count(series: &Series, by: u64) {
    with_handle(
        series,
        |recorder, key| recorder.register_counter(key, &METADATA),
        Handle::Counter,
        |handle| match handle {
            Handle::Counter(counter) => Some(counter),
            _ => None,
        },
        |counter| counter.increment(by),
    );
}

/// Records `elapsed`, in seconds, in the histogram `series`.
#[cfg(feature = "metrics")]
pub(crate) fn time(series: &Series, elapsed: Duration) {
    with_handle(
        series,
        |recorder, key| recorder.register_histogram(key, &METADATA),
        Handle::Histogram,
        |handle| match handle {
            Handle::Histogram(histogram) => Some(histogram),
            _ => None,
        },
        |histogram| histogram.record(elapsed.as_secs_f64()),
    );
}

/// Sets the gauge `series` to `value`.
#[cfg(feature = "metrics")]
pub(crate) fn level(series: &Series, value: u64) {
    #[allow(clippy::cast_precision_loss)]
    // gauges are f64 in the facade; sizes stay far below 2^53
    let value = value as f64;
    with_handle(
        series,
        |recorder, key| recorder.register_gauge(key, &METADATA),
        Handle::Gauge,
        |handle| match handle {
            Handle::Gauge(gauge) => Some(gauge),
            _ => None,
        },
        |gauge| gauge.set(value),
    );
}

#[cfg(not(feature = "metrics"))]
pub(crate) fn count(_series: &Series, _by: u64) {}

#[cfg(not(feature = "metrics"))]
pub(crate) fn time(_series: &Series, _elapsed: Duration) {}

#[cfg(not(feature = "metrics"))]
pub(crate) fn level(_series: &Series, _value: u64) {}
