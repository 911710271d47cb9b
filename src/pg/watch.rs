//! The failover-safety check while a [`PgStore`] runs: when one is due (a new pooled
//! connection's first use, or the period elapsed), what the last one found, and the refusal of
//! writes that [`PgStoreBuilder::require_failover_safe`] asks for while the server is not safe.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

#[cfg(doc)]
use super::PgStore;
#[cfg(doc)]
use super::PgStoreBuilder;
use super::replication::FailoverSafety;
use crate::api::report::FailoverStatus;
use crate::api::trace;
use crate::error::Error;

/// The period between checks on a busy store, unless the builder sets another: a Patroni
/// promotion window (6 to 11 s) shows within it, for one round trip per period.
pub(super) const DEFAULT_PERIOD: Duration = Duration::from_secs(2);

/// The last check and when the next is due. Shared by every call of one store; the hot path
/// reads one atomic.
pub(super) struct Watch {
    /// Zero: only new connections are checked.
    period: Duration,
    started: Instant,
    /// Milliseconds after `started` from which a call checks again.
    next_due_ms: AtomicU64,
    safe: AtomicBool,
    require: bool,
    last: Mutex<FailoverStatus>,
}

impl Watch {
    /// The watch after the check at connect.
    pub(super) fn new(first: &FailoverSafety, period: Duration, require: bool) -> Self {
        let watch = Watch {
            period,
            started: Instant::now(),
            next_due_ms: AtomicU64::new(0),
            safe: AtomicBool::new(first.is_failover_safe()),
            require,
            last: Mutex::new(FailoverStatus {
                safe: first.is_failover_safe(),
                detail: first.to_string(),
                checked_at: SystemTime::now(),
                checks: 1,
                unsafe_checks: u64::from(!first.is_failover_safe()),
            }),
        };
        watch.schedule();
        watch
    }

    fn elapsed_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn schedule(&self) {
        let period = u64::try_from(self.period.as_millis()).unwrap_or(u64::MAX);
        let next = if period == 0 {
            u64::MAX
        } else {
            self.elapsed_ms().saturating_add(period)
        };
        self.next_due_ms.store(next, Ordering::Relaxed);
    }

    /// Whether this call checks: the period has elapsed and no other call took the check.
    pub(super) fn due(&self) -> bool {
        let due = self.next_due_ms.load(Ordering::Relaxed);
        let now = self.elapsed_ms();
        // One caller per period wins the exchange; the others go on unchecked.
        now >= due
            && self
                .next_due_ms
                .compare_exchange(due, u64::MAX, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// A check could not be made: the next call tries again.
    pub(super) fn retry(&self) {
        self.next_due_ms.store(0, Ordering::Relaxed);
    }

    /// Records a check's report; a change to not safe is logged as at connect.
    pub(super) fn record(&self, report: &FailoverSafety) {
        let safe = report.is_failover_safe();
        let was = self.safe.swap(safe, Ordering::Relaxed);
        if was && !safe {
            trace::not_failover_safe(report);
        }
        let mut last = self
            .last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        last.safe = safe;
        last.detail = report.to_string();
        last.checked_at = SystemTime::now();
        last.checks += 1;
        last.unsafe_checks += u64::from(!safe);
        drop(last);
        self.schedule();
    }

    /// The last check's findings.
    pub(super) fn status(&self) -> FailoverStatus {
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The refusal of a write while the last check found the server not failover-safe, with
    /// `require_failover_safe`: nothing was sent, so nothing was done.
    pub(super) fn refusal(&self) -> Option<Error> {
        if !self.require || self.safe.load(Ordering::Relaxed) {
            return None;
        }
        let detail = self.status().detail;
        Some(Error::not_applied(
            "writing: require_failover_safe is set and the server's last check found it not \
             failover-safe, so writes are refused (reads are served) until a check finds a \
             synchronous standby; retry later",
            std::io::Error::other(detail),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(names: &str) -> FailoverSafety {
        FailoverSafety {
            synchronous_standby_names: names.to_owned(),
            synchronous_commit: "on".to_owned(),
            synchronous_standbys: Some(Vec::new()),
        }
    }

    #[test]
    fn a_check_is_due_once_per_period() {
        let watch = Watch::new(&report("*"), Duration::from_millis(30), false);
        assert!(!watch.due());
        std::thread::sleep(Duration::from_millis(40));
        assert!(watch.due());
        assert!(!watch.due(), "one caller takes the check");
        watch.retry();
        assert!(
            watch.due(),
            "a failed check is tried again by the next call"
        );
        watch.record(&report("*"));
        assert!(!watch.due());
        let never = Watch::new(&report("*"), Duration::ZERO, false);
        std::thread::sleep(Duration::from_millis(5));
        assert!(!never.due());
    }

    #[test]
    fn the_status_follows_the_checks_and_writes_are_refused_while_unsafe() {
        let watch = Watch::new(&report("*"), DEFAULT_PERIOD, true);
        assert!(watch.status().safe);
        assert!(watch.refusal().is_none());
        watch.record(&report(""));
        let status = watch.status();
        assert!(!status.safe);
        assert!(status.detail.starts_with("not failover-safe"), "{status:?}");
        assert_eq!((status.checks, status.unsafe_checks), (2, 1));
        let refusal = watch.refusal().expect("refused while not safe");
        assert!(!refusal.outcome_unknown());
        assert!(
            refusal.to_string().contains("require_failover_safe"),
            "{refusal}"
        );
        watch.record(&report("ANY 1 (a, b)"));
        assert!(watch.status().safe);
        assert!(watch.refusal().is_none());
        let lax = Watch::new(&report(""), DEFAULT_PERIOD, false);
        assert!(
            lax.refusal().is_none(),
            "without require_failover_safe nothing is refused"
        );
    }
}
