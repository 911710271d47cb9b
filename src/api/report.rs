//! What the maintenance calls report, the same for every backend: `verify`, `stats` and the
//! operator's record listing.

use crate::api::key::Key;
use crate::api::outcome::RecordView;

/// What [`IdempotencyStore::verify`](crate::IdempotencyStore::verify) found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyReport {
    /// Records walked.
    pub records: u64,
    /// Expiry-index entries walked.
    pub expiry_entries: u64,
    /// One line per problem; empty when the store is consistent.
    pub problems: Vec<String>,
}

impl VerifyReport {
    /// True when no problem was found.
    #[must_use]
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Counts from [`IdempotencyStore::stats`](crate::IdempotencyStore::stats).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Unexpired records held by an attempt (including lapsed leases not yet taken over).
    pub in_progress: u64,
    /// Of those, the ones whose lease has lapsed: stuck until a retry takes them over.
    pub stuck: u64,
    /// Unexpired completed records.
    pub completed: u64,
    /// Expired records waiting for a sweep.
    pub expired: u64,
    /// Size of the store file in bytes (`None` in memory).
    pub file_bytes: Option<u64>,
    /// Whether what the store acknowledges survives a failover of its database server,
    /// checked by this call (PostgreSQL); `None` on the redb store, which has no failover.
    pub failover: Option<FailoverStatus>,
}

/// Whether the commits a store acknowledges survive a failover of its database server, as
/// its last check found: in [`Stats::failover`] (checked by that call) and in
/// [`Metrics::failover`](crate::api::metrics::Metrics::failover) (the last check, no I/O).
/// A `PgStore` checks when it connects, on each new pooled connection's first use (so after
/// every reconnect, and after a failover on the new primary), and then at most once per
/// `PgStoreBuilder::failover_check_period` (2 s by default) on a call's own connection. So a primary running without a synchronous standby (Patroni's promotion
/// window with `synchronous_mode_strict` off) shows here while it lasts, and safe again once
/// it has one.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct FailoverStatus {
    /// The last check found commits waiting for a synchronous standby.
    pub safe: bool,
    /// The last check's one-line report, starting with `failover-safe` or `not failover-safe`
    /// and naming the settings it read.
    pub detail: String,
    /// When the last check ran (this machine's clock).
    pub checked_at: std::time::SystemTime,
    /// Checks since the store connected, the one at connect included.
    pub checks: u64,
    /// Of those, the ones that found the server not failover-safe.
    pub unsafe_checks: u64,
}

/// One record with its key, as [`IdempotencyStore::records`](crate::IdempotencyStore::records)
/// yields it on every backend.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredRecord {
    /// The record's key (with its scope).
    pub key: Key,
    /// The record, expired or not: compare [`RecordView::expires_at`] with
    /// [`IdempotencyStore::now`](crate::IdempotencyStore::now).
    pub record: RecordView,
}
