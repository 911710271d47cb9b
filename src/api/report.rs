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
