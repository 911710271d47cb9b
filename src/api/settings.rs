//! The settings every backend shares, their defaults and their validation.

use std::time::Duration;

use crate::api::key::{Key, MAX_KEY_LEN};
use crate::error::{Error, Result};

/// The settings both backends share: what a record keeps and for how long, and the size limits
/// of keys and responses. [`StoreBuilder`](crate::StoreBuilder) and `PgStoreBuilder` (feature
/// `postgres`) each embed one, set it through their setters, and their stores return it from
/// `settings()`:
///
/// ```
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
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            retention: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(10),
            max_key_len: MAX_KEY_LEN,
            max_response_bytes: 1 << 20,
            trace_keys: false,
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

    /// The longest key (and scope) accepted, in bytes, at most [`MAX_KEY_LEN`]. Default: 255.
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
