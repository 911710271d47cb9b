//! [`Records`]: the walk over every record of a store, one item type for every backend.

use crate::api::report::StoredRecord;
use crate::error::Result;

/// An iterator over every record of a store, expired ones included, as
/// [`IdempotencyStore::records`](crate::IdempotencyStore::records) returns it.
///
/// Each item is one record with its key, or the error that record met: a damaged record yields
/// [`Error::Corrupted`](crate::Error::Corrupted) naming its key and the walk goes on; a storage
/// failure yields its error and ends the walk. The order and the consistency of the walk are
/// the backend's: the redb `Store` walks one read snapshot in storage order; `PgStore` reads
/// pages in key order (scope, then key), so records written during the walk may or may not be
/// seen, but none is seen twice.
pub struct Records<'store> {
    walk: Box<dyn Iterator<Item = Result<StoredRecord>> + 'store>,
}

impl<'store> Records<'store> {
    /// The walk a backend hands out.
    pub(crate) fn new(walk: impl Iterator<Item = Result<StoredRecord>> + 'store) -> Self {
        Records {
            walk: Box::new(walk),
        }
    }
}

impl Iterator for Records<'_> {
    type Item = Result<StoredRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        self.walk.next()
    }
}

impl std::fmt::Debug for Records<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records").finish_non_exhaustive()
    }
}
