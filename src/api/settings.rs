//! The settings every backend shares, their defaults and their validation.

use std::time::Duration;

use crate::api::key::{Key, MAX_KEY_LEN};
use crate::error::{Error, Result};

/// The settings both backends share: what a record keeps and for how long, the size limits of
/// keys and responses, and the quotas. [`StoreBuilder`](crate::StoreBuilder) and
/// `PgStoreBuilder` (feature `postgres`) each embed one and set it through the same setters
/// (written once for both), and their stores return it from `settings()`:
///
/// ```
/// use idempotency_store::IdempotencyStore;
/// use idempotency_store::Store;
/// use std::time::Duration;
///
/// let store = Store::builder().lease(Duration::from_secs(5)).open_in_memory()?;
/// assert_eq!(store.settings().lease(), Duration::from_secs(5));
/// assert_eq!(store.settings().retention(), Duration::from_secs(24 * 3600));
/// # Ok::<(), idempotency_store::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub(crate) retention: Duration,
    pub(crate) lease: Duration,
    pub(crate) max_key_len: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) trace_keys: bool,
    pub(crate) max_records: Option<u64>,
    pub(crate) max_bytes: Option<u64>,
    pub(crate) when_full: WhenFull,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(10),
            max_key_len: MAX_KEY_LEN,
            max_response_bytes: 1 << 20,
            trace_keys: false,
            max_records: None,
            max_bytes: None,
            when_full: WhenFull::Refuse,
        }
    }
}

impl Settings {
    /// Whether `tracing` events (feature `tracing`) may show keys; keys can be personal data.
    /// Set with the builders' `trace_keys`. Default: false (events say `<hidden>`).
    #[must_use]
    pub fn trace_keys(&self) -> bool {
        self.trace_keys
    }

    /// How long a completed record replays, counted from its completion. An in-progress record
    /// is kept until `retention` after its first claim (or its lease, if later), so a takeover
    /// still sees the attempt count and recovery point. Default: 24 hours.
    #[must_use]
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// How long a claim holds the key before another caller may take it over (the holder may
    /// have crashed); `heartbeat` extends it. Default: 10 seconds, so that a key whose holder
    /// crashed is free again within 10 s; a live operation keeps its key by heartbeating
    /// (`execute`, `http::handle` and the tower layer do it every third of the lease).
    #[must_use]
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The longest key (and scope) accepted, in bytes, at most 255. Default: 255.
    #[must_use]
    pub fn max_key_len(&self) -> usize {
        self.max_key_len
    }

    /// The largest response (body plus header names and values) or recovery point accepted, in
    /// bytes. Default: 1 MiB.
    #[must_use]
    pub fn max_response_bytes(&self) -> usize {
        self.max_response_bytes
    }

    /// The most records the store holds (any state, expired ones included until swept), if
    /// limited. Default: no limit.
    #[must_use]
    pub fn max_records(&self) -> Option<u64> {
        self.max_records
    }

    /// The most bytes of stored keys and records, if limited. Default: no limit.
    #[must_use]
    pub fn max_bytes(&self) -> Option<u64> {
        self.max_bytes
    }

    /// What a claim of a new key does when a quota is reached. Default: [`WhenFull::Refuse`].
    #[must_use]
    pub fn when_full(&self) -> WhenFull {
        self.when_full
    }

    /// Whether a quota is set.
    pub(crate) fn has_quota(&self) -> bool {
        self.max_records.is_some() || self.max_bytes.is_some()
    }

    /// Rejects out-of-range values with [`Error::InvalidConfig`].
    pub(crate) fn validate(&self) -> Result<()> {
        if self.retention.is_zero() {
            return invalid_config("retention must be longer than zero");
        }
        if self.lease.is_zero() {
            return invalid_config("lease must be longer than zero");
        }
        if !(1..=MAX_KEY_LEN).contains(&self.max_key_len) {
            return invalid_config("max_key_len must be between 1 and 255");
        }
        Ok(())
    }

    /// Rejects a key longer than `max_key_len`.
    pub(crate) fn check_key(&self, key: &Key) -> Result<()> {
        key.check_len(self.max_key_len)
    }

    /// Rejects a response (or recovery point) of `size` bytes above `max_response_bytes`.
    pub(crate) fn check_size(&self, size: usize) -> Result<()> {
        let limit = self.max_response_bytes;
        if size > limit {
            return Err(Error::ResponseTooLarge { size, limit });
        }
        Ok(())
    }
}

/// The setters of the settings every builder shares, written once: each builder invokes it in
/// its `impl` with the name of its [`Settings`] field (it also needs a field `clock: Option<Arc<dyn
/// Clock>>`), so `StoreBuilder` and `PgStoreBuilder` offer the same setters, with the same
/// documentation, as inherent methods.
macro_rules! shared_setters {
    ($settings:ident) => {
        /// Sets [`Settings::retention`](crate::Settings::retention): how long a completed
        /// record replays. Defaults to 24 hours.
        pub fn retention(&mut self, retention: std::time::Duration) -> &mut Self {
            self.$settings.retention = retention;
            self
        }

        /// Sets [`Settings::lease`](crate::Settings::lease): how long a claim holds the key
        /// before another caller may take it over; `heartbeat` extends it. Defaults to 10
        /// seconds.
        pub fn lease(&mut self, lease: std::time::Duration) -> &mut Self {
            self.$settings.lease = lease;
            self
        }

        /// Sets [`Settings::max_key_len`](crate::Settings::max_key_len): the longest key
        /// accepted, in bytes, at most 255. Defaults to 255.
        pub fn max_key_len(&mut self, bytes: usize) -> &mut Self {
            self.$settings.max_key_len = bytes;
            self
        }

        /// Sets [`Settings::max_response_bytes`](crate::Settings::max_response_bytes): the
        /// largest response or recovery point accepted. Defaults to 1 MiB.
        pub fn max_response_bytes(&mut self, bytes: usize) -> &mut Self {
            self.$settings.max_response_bytes = bytes;
            self
        }

        /// The most records the store holds (any state, expired ones included until swept).
        /// A claim of a new key beyond it first deletes expired records, then follows
        /// [`when_full`](Self::when_full), failing with
        /// [`Error::QuotaExceeded`](crate::Error::QuotaExceeded) by default. Defaults to no
        /// limit.
        ///
        /// On PostgreSQL the limit applies to the table, or to each scope with
        /// `per_scope_quotas`; the first store connecting with a quota turns usage counting on
        /// for its schema (a trigger keeps sharded per-scope counters in `idempotency_usage`,
        /// and every writer of the schema maintains them from then on), and the check is made
        /// before the claim, not under a lock, so instances claiming new keys at the same
        /// moment can pass the limit by up to the number of such claims in flight.
        pub fn max_records(&mut self, records: u64) -> &mut Self {
            self.$settings.max_records = Some(records);
            self
        }

        /// The most bytes of stored keys and records (not counting the backend's own overhead:
        /// roughly half again on top for redb). Checked when a new key is claimed, as
        /// [`max_records`](Self::max_records) is; completions of keys already claimed are never
        /// refused, so the store can pass the limit by up to the number of in-flight claims
        /// times `max_response_bytes`. Defaults to no limit.
        pub fn max_bytes(&mut self, bytes: u64) -> &mut Self {
            self.$settings.max_bytes = Some(bytes);
            self
        }

        /// What a claim of a new key does when a quota is reached. Defaults to
        /// [`WhenFull::Refuse`](crate::WhenFull::Refuse).
        pub fn when_full(&mut self, policy: $crate::api::settings::WhenFull) -> &mut Self {
            self.$settings.when_full = policy;
            self
        }

        /// Whether `tracing` events (feature `tracing`) may show keys. Keys can be personal
        /// data, so by default events say `<hidden>` instead. Defaults to false.
        pub fn trace_keys(&mut self, show: bool) -> &mut Self {
            self.$settings.trace_keys = show;
            self
        }

        /// The time source for leases and expiry, for example a
        /// [`ManualClock`](crate::ManualClock) in tests. Defaults to the system clock
        /// ([`SystemClock`](crate::SystemClock)) for the redb `Store`, and to the database
        /// server's clock for `PgStore`: leave it unset there in production, so that instances
        /// with skewed clocks still agree on when leases lapse.
        pub fn clock(&mut self, clock: impl $crate::api::clock::Clock) -> &mut Self {
            self.clock = Some(std::sync::Arc::new(clock));
            self
        }
    };
}
pub(crate) use shared_setters;

/// An [`Error::InvalidConfig`] with `reason`.
pub(crate) fn invalid_config<T>(reason: &str) -> Result<T> {
    Err(Error::InvalidConfig {
        reason: reason.to_owned(),
    })
}

/// What a claim of a new key does when the store is at its `max_records` or `max_bytes`
/// quota (after deleting expired records, which is always done first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum WhenFull {
    /// Refuse the claim with [`Error::QuotaExceeded`]: fail closed. The default.
    #[default]
    Refuse,
    /// Delete the oldest completed records to make room. Their keys then run afresh if
    /// retried, so opt in only where that is acceptable. In-progress records are never evicted.
    EvictOldestCompleted,
}
