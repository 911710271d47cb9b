//! Time: the [`Timestamp`] type and the injectable [`Clock`].

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A wall-clock instant in whole milliseconds since the Unix epoch.
///
/// Leases and retention are stored as timestamps so that they survive a restart; a monotonic
/// `Instant` would not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(u64);

impl Timestamp {
    /// The Unix epoch.
    pub const EPOCH: Timestamp = Timestamp(0);

    /// A timestamp `millis` milliseconds after the Unix epoch.
    #[must_use]
    pub const fn from_millis(millis: u64) -> Self {
        Timestamp(millis)
    }

    /// Milliseconds since the Unix epoch.
    #[must_use]
    pub const fn as_millis(self) -> u64 {
        self.0
    }

    /// The same instant as a [`SystemTime`].
    #[must_use]
    pub fn to_system_time(self) -> SystemTime {
        UNIX_EPOCH + Duration::from_millis(self.0)
    }

    /// How long from `earlier` until `self`; zero if `earlier` is not before `self`.
    #[must_use]
    pub fn saturating_duration_since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    pub(crate) fn plus(self, millis: u64) -> Self {
        Timestamp(self.0.saturating_add(millis))
    }
}

/// A source of wall-clock time for the store.
///
/// The store never reads the system clock directly, so tests can drive time with
/// [`ManualClock`]. The store never lets its own notion of time go backwards: it uses the
/// highest time it has seen (see the crate docs, "Time").
pub trait Clock: Send + Sync + 'static {
    /// The current time.
    fn now(&self) -> Timestamp;
}

/// The operating system's wall clock. The default.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        // A clock set before 1970 reads as the epoch, which the store's never-go-back rule
        // turns into "time stands still" rather than a panic.
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        Timestamp(u64::try_from(since.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock that moves only when told to. Clones share the same time.
///
/// ```
/// use idempotency_store::{Clock, ManualClock, Timestamp};
/// use std::time::Duration;
///
/// let clock = ManualClock::new(Timestamp::from_millis(1_000));
/// clock.advance(Duration::from_secs(2));
/// assert_eq!(clock.now(), Timestamp::from_millis(3_000));
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock(Arc<AtomicU64>);

impl ManualClock {
    /// A clock standing at `start`.
    #[must_use]
    pub fn new(start: Timestamp) -> Self {
        ManualClock(Arc::new(AtomicU64::new(start.0)))
    }

    /// Moves the clock forward by `by` (saturating at the end of time).
    pub fn advance(&self, by: Duration) {
        let millis = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        // fetch_update never fails with a closure that always returns Some.
        let _ = self
            .0
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |t| {
                Some(t.saturating_add(millis))
            });
    }

    /// Sets the clock to `to`, which may be in the past (to test a clock stepping back).
    pub fn set(&self, to: Timestamp) {
        self.0.store(to.0, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}

/// Converts a configured duration to stored milliseconds, saturating far in the future.
pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
