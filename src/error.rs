//! The one error type of the crate.

use std::error::Error as StdError;
use std::sync::Arc;

/// A boxed cause, kept opaque so that redb's error types are not part of this crate's API.
pub(crate) type Cause = Arc<dyn StdError + Send + Sync + 'static>;

/// Everything that can go wrong in a store call.
///
/// Expected outcomes of a claim (in progress, already completed, fingerprint mismatch) are not
/// errors: they are variants of [`Claim`](crate::Claim). An `Error` means the call did not do
/// what was asked. Each variant's documentation says what the caller should do.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The idempotency key or scope is not acceptable. Answer the client with 400 and do not
    /// touch the store.
    #[error("invalid idempotency key: {reason}")]
    InvalidKey {
        /// What is wrong with the key, in words a client developer can act on.
        reason: String,
    },

    /// The response (body plus headers) or checkpoint is larger than the store accepts. The
    /// record is unchanged and the lease is still held: store a smaller response or release.
    #[error("response of {size} bytes exceeds the limit of {limit} bytes")]
    ResponseTooLarge {
        /// Size of the rejected response in bytes.
        size: usize,
        /// The configured `max_response_bytes`.
        limit: usize,
    },

    /// The lease is no longer valid: the key was taken over by a later attempt, released, or
    /// expired (whether or not a sweep has deleted it yet). Nothing was written. Do not report
    /// success to the client for this attempt; a retry will see the newer attempt's outcome.
    #[error("lease lost: the key was taken over, released or expired; nothing was written")]
    LeaseLost,

    /// The store is full: a new key was refused because the store holds `max` records (or
    /// bytes) already. Nothing was written. Answer 503 and retry later: room comes back as
    /// records expire and are swept, or, if enabled, by evicting the oldest completed records.
    /// Claims of keys already stored, and completions, are never refused for quota.
    #[error(
        "quota exceeded: {used} of {max} allowed by {limit}; new keys are refused until records expire"
    )]
    QuotaExceeded {
        /// Which limit: `max_records` or `max_bytes`.
        limit: &'static str,
        /// What the store holds now.
        used: u64,
        /// The configured limit.
        max: u64,
    },

    /// A builder setting is out of range, or (PostgreSQL) the server is not one the store can
    /// run on as configured: read-only, or not failover-safe with
    /// `PgStoreBuilder::require_failover_safe`. Fix the configuration, as `reason` says.
    #[error("invalid configuration: {reason}")]
    InvalidConfig {
        /// Which setting and why.
        reason: String,
    },

    /// The file is already open, in this process or another one. One file serves one `Store`;
    /// share that `Store` (it is `Send + Sync`) instead of opening the file twice.
    #[error("the store file is already open in this or another process")]
    AlreadyOpen,

    /// The file is not an idempotency store: it is empty, is another redb database or holds
    /// other tables, was written by a newer, incompatible version of this crate, or its
    /// creation was cut short; or it is missing and `create_if_missing(false)` is set. Check
    /// the path.
    #[error("not an idempotency store: {reason}")]
    NotAStore {
        /// What was found instead.
        reason: String,
    },

    /// Stored data failed validation: a damaged file or a record this version cannot decode.
    /// The affected key cannot be served; restore from a backup or remove the record with the
    /// operator tools.
    #[error("corrupted store: {reason}")]
    Corrupted {
        /// What failed to validate.
        reason: String,
    },

    /// The storage engine or the operating system failed (I/O error, disk full, damaged file).
    /// A write call that fails this way may or may not have become durable: look the key up
    /// before retrying. A failure that may have lost data poisons the store: later writes
    /// fail with [`Error::Poisoned`] until it is reopened. After a full disk refused a log
    /// write, the next write call commits durably and goes on once space is freed; after redb
    /// itself met an I/O error (a full disk included), it refuses writes until the store is
    /// reopened.
    #[error("storage failure while {context}")]
    Storage {
        /// What the store was doing.
        context: &'static str,
        /// The underlying failure.
        #[source]
        source: Cause,
    },

    /// The store refuses writes: an earlier write or sync of its file failed in a way that may
    /// have lost data, or a panic interrupted its write path. Reads still answer from what is
    /// durable. Reopen the store (drop it and open the file again): the open replays the log
    /// from the last durable state, and writes work again if the disk has recovered.
    ///
    /// A full disk (`ENOSPC`, `EDQUOT`) refused before anything was written is not such a
    /// failure: it stays [`Error::Storage`] (see there for what follows it).
    #[error(
        "the store refuses writes until it is reopened: an earlier write or sync may have lost \
         data ({cause}); reads still work; reopen the store to recover from its durable state"
    )]
    Poisoned {
        /// The failure that poisoned the store.
        #[source]
        cause: Cause,
    },

    /// A store call was made from inside a `complete_with` or `complete_with_effects` effect,
    /// which runs while the store's writer is held: it would wait for itself forever. Nothing
    /// was done. Do the call before or after, or write through what the effect receives.
    #[error(
        "store call from inside a complete_with or complete_with_effects effect (the writer \
         is held by this thread); call it before or after the completion"
    )]
    Reentrant,

    /// The store was opened read-only
    /// ([`StoreBuilder::open_read_only`](crate::StoreBuilder::open_read_only)) and this call
    /// would write (a claim that would take a key, a completion, a release, a heartbeat, a
    /// checkpoint, a sweep, a forced release). Nothing was written, and the file never is by
    /// a read-only store. Open the file with [`StoreBuilder::open`](crate::StoreBuilder::open)
    /// to make changes (stop the service that holds it first).
    #[error(
        "the store is open read-only, for inspection: this call would write, and nothing was \
         written; open it with StoreBuilder::open to make changes"
    )]
    ReadOnly,

    /// An effect of [`Store::complete_with_effects`](crate::Store::complete_with_effects)
    /// named a table the store was not opened with (or with other key or value types), or the
    /// log holds rows of such a table. Nothing of the effect was written. Register the table
    /// with [`StoreBuilder::effect_table`](crate::StoreBuilder::effect_table), with the types it
    /// was written with.
    #[error("effect table `{table}`: {reason}")]
    EffectTable {
        /// The table's name.
        table: String,
        /// What is wrong, and what to do.
        reason: String,
    },
}

/// Shorthand for results of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn storage(
        context: &'static str,
        source: impl StdError + Send + Sync + 'static,
    ) -> Self {
        Error::Storage {
            context,
            source: Arc::new(source),
        }
    }

    /// Whether the failed call may nevertheless have taken effect: a storage failure after
    /// the write was sent (the connection was lost before its answer, a sync failed, a Citus
    /// coordinator lost the worker that was committing it), as opposed to one known to have
    /// done nothing (no connection could be had, or PostgreSQL answered the statement with an
    /// `ERROR` and rolled it back) and to every other error (nothing was written).
    ///
    /// After such an error, settle the outcome by retrying the same call: `complete`,
    /// `complete_with` or `release` with the same lease (a retry that finds its own completion
    /// answers `Ok`, and [`Error::LeaseLost`] only if another attempt settled the key), or the
    /// claim with the same [`ClaimId`](crate::ClaimId)
    /// ([`IdempotencyStore::claim_with_id`](crate::IdempotencyStore::claim_with_id)).
    #[must_use]
    pub fn outcome_unknown(&self) -> bool {
        match self {
            Error::Storage { source, .. } => source.downcast_ref::<NotApplied>().is_none(),
            _ => false,
        }
    }

    /// A storage error whose outcome is unknown, for tests outside the crate (wrappers that
    /// inject faults): internal, see Cargo.toml's `__test-hooks`.
    #[cfg(feature = "__test-hooks")]
    #[doc(hidden)]
    pub fn storage_for_tests(context: &'static str) -> Self {
        Error::storage(context, std::io::Error::other("injected by a test"))
    }

    /// A storage failure known to have done nothing: refused before anything was sent, or
    /// rolled back by the server.
    #[cfg_attr(not(feature = "postgres"), expect(dead_code))]
    pub(crate) fn not_applied(
        context: &'static str,
        source: impl StdError + Send + Sync + 'static,
    ) -> Self {
        Error::Storage {
            context,
            source: Arc::new(NotApplied(Box::new(source))),
        }
    }

    pub(crate) fn corrupted(reason: impl Into<String>) -> Self {
        Error::Corrupted {
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid_key(reason: impl Into<String>) -> Self {
        Error::InvalidKey {
            reason: reason.into(),
        }
    }
}

/// The cause of a storage failure that did nothing (see [`Error::outcome_unknown`]); shows
/// as its inner cause.
#[derive(Debug)]
pub(crate) struct NotApplied(Box<dyn StdError + Send + Sync + 'static>);

impl std::fmt::Display for NotApplied {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl StdError for NotApplied {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0.source()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_is_send_sync_static() {
        fn check<T: Send + Sync + 'static + StdError>() {}
        check::<Error>();
    }

    #[test]
    fn storage_error_exposes_its_cause() {
        let err = Error::storage("committing", std::io::Error::other("disk on fire"));
        assert_eq!(err.to_string(), "storage failure while committing");
        let cause = err.source().map(ToString::to_string);
        assert_eq!(cause.as_deref(), Some("disk on fire"));
    }
}
