//! The 409's `Retry-After`: how long a run of the route usually takes, measured per route.

use std::collections::HashMap;
use std::time::Duration;

use parking_lot::Mutex;

use crate::api::clock::Timestamp;

/// At most this many routes get an estimate of their own; the rest share one, so that paths
/// with ids in them cannot grow the map without bound.
const MAX_ROUTES: usize = 256;
/// The weight of a new sample in the moving average.
const ALPHA: f64 = 0.2;

/// Moving averages of how long handlers take, per route (method and path).
#[derive(Debug, Default)]
pub(crate) struct Durations {
    prior: Option<Duration>,
    routes: Mutex<HashMap<String, f64>>,
    shared: Mutex<Option<f64>>,
}

impl Durations {
    pub(crate) fn with_prior(prior: Duration) -> Self {
        Durations {
            prior: Some(prior),
            ..Durations::default()
        }
    }

    /// Records one run of `route` that took `took`.
    pub(crate) fn record(&self, route: &str, took: Duration) {
        let sample = took.as_secs_f64();
        let blend = |old: Option<f64>| old.map_or(sample, |old| old + ALPHA * (sample - old));
        let mut routes = self.routes.lock();
        if let Some(old) = routes.get_mut(route) {
            *old = blend(Some(*old));
        } else if routes.len() < MAX_ROUTES {
            routes.insert(route.to_owned(), sample);
        } else {
            drop(routes);
            let mut shared = self.shared.lock();
            *shared = Some(blend(*shared));
        }
    }

    /// The expected duration of a run of `route`: its moving average, else the caller's
    /// expected duration.
    pub(crate) fn expected(&self, route: &str) -> Option<Duration> {
        let measured = self.routes.lock().get(route).copied();
        let measured = measured.or_else(|| *self.shared.lock());
        measured
            .and_then(|secs| Duration::try_from_secs_f64(secs).ok())
            .or(self.prior)
    }

    /// `Retry-After` in whole seconds: the expected duration (1 s if there is none yet) less
    /// what the holder has run, never above the time left on the holder's lease, and at
    /// least 1.
    ///
    /// `held_for` is how long the holder has run, where this process knows it (a tower
    /// layer's or actix middleware's own holders): the hint is then the time it is expected
    /// to have left.
    pub(crate) fn retry_after(
        &self,
        route: &str,
        lease_until: Timestamp,
        now: Timestamp,
        held_for: Option<Duration>,
    ) -> u64 {
        let left = lease_until.as_millis().saturating_sub(now.as_millis());
        let millis = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        let expected = self.expected(route).map_or(1000, millis);
        let remaining = expected.saturating_sub(held_for.map_or(0, millis));
        remaining.min(left).div_ceil(1000).max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hint_is_the_route_average_capped_by_the_lease_and_at_least_one_second() {
        let at = Timestamp::from_millis;
        let d = Durations::default();
        assert_eq!(d.retry_after("POST /a", at(60_000), at(0), None), 1);
        d.record("POST /a", Duration::from_millis(3_000));
        assert_eq!(d.retry_after("POST /a", at(60_000), at(0), None), 3);
        assert_eq!(d.retry_after("POST /a", at(1_500), at(0), None), 2);
        assert_eq!(d.retry_after("POST /a", at(0), at(10), None), 1);
        d.record("POST /a", Duration::from_millis(8_000)); // 3 + 0.2 * 5 = 4 s
        assert_eq!(d.retry_after("POST /a", at(60_000), at(0), None), 4);
        assert_eq!(d.retry_after("POST /b", at(60_000), at(0), None), 1);
        let held = Some(Duration::from_millis(2_500)); // 4 s expected: 1.5 s left
        assert_eq!(d.retry_after("POST /a", at(60_000), at(0), held), 2);
        let overdue = Some(Duration::from_secs(30));
        assert_eq!(d.retry_after("POST /a", at(60_000), at(0), overdue), 1);
        let given = Durations::with_prior(Duration::from_secs(7));
        assert_eq!(given.retry_after("POST /b", at(60_000), at(0), None), 7);
    }

    #[test]
    fn routes_beyond_the_cap_share_one_estimate() {
        let d = Durations::default();
        for i in 0..MAX_ROUTES {
            d.record(&format!("POST /r{i}"), Duration::from_secs(2));
        }
        d.record("POST /extra", Duration::from_secs(9));
        assert_eq!(d.routes.lock().len(), MAX_ROUTES);
        assert_eq!(d.expected("POST /other"), Some(Duration::from_secs(9)));
    }
}
