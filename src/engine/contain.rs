//! redb's errors and panics, contained: every redb error becomes an [`Error`] a person can act
//! on, and a panic inside redb (it can panic on a damaged file) becomes `Error::Corrupted`
//! instead of unwinding into the caller.

use crate::error::{Error, Result};

thread_local! {
    /// Panics `contain` caught on this thread: fuzz targets that never damage redb's own
    /// pages check that none happened, since a contained panic of ours would otherwise pass
    /// for an error.
    static CONTAINED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many panics the store has caught and turned into errors on this thread. For the fuzz
/// targets, which must not meet any where redb's pages are intact.
#[cfg(feature = "__test-hooks")]
pub fn contained_panics() -> u64 {
    CONTAINED.with(std::cell::Cell::get)
}

/// Runs `f`, turning a panic inside the storage engine into [`Error::Corrupted`].
///
/// redb 4.6 panics on some damaged files (for example "Malformed allocator state" when it loads
/// a corrupted allocator snapshot at open) instead of returning an error. A damaged file must
/// never take the caller's thread down, so every entry into redb goes through here.
pub(crate) fn contain<T>(what: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    contain_then(what, f, |_| {})
}

/// Like [`contain`], and calls `on_panic` with the error a caught panic became: the write
/// path poisons the store then, since the panic may have cut a batch off halfway.
pub(crate) fn contain_then<T>(
    what: &'static str,
    f: impl FnOnce() -> Result<T>,
    on_panic: impl FnOnce(&Error),
) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        CONTAINED.with(|n| n.set(n.get() + 1));
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        let err = Error::corrupted(format!(
            "the storage engine failed while {what}, most likely on a damaged file ({message}); \
             reopen the store, and restore the file if this persists"
        ));
        on_panic(&err);
        Err(err)
    })
}

/// Maps redb's storage errors, keeping corruption distinct from I/O so the caller can tell a
/// damaged file from a failing disk.
pub(crate) fn from_storage(context: &'static str, err: redb::StorageError) -> Error {
    match err {
        redb::StorageError::Corrupted(reason) => Error::Corrupted { reason },
        other => Error::storage(context, other),
    }
}

macro_rules! impl_from_redb {
    ($($ty:ty => $context:literal),* $(,)?) => {$(
        impl From<$ty> for Error {
            fn from(err: $ty) -> Self {
                match redb::Error::from(err) {
                    redb::Error::Corrupted(reason) => Error::Corrupted { reason },
                    redb::Error::DatabaseAlreadyOpen => Error::AlreadyOpen,
                    other => Error::storage($context, other),
                }
            }
        }
    )*};
}

impl_from_redb! {
    redb::StorageError => "accessing the file",
    redb::TransactionError => "starting a transaction",
    redb::CommitError => "committing",
    redb::DatabaseError => "opening the file",
}

impl From<redb::TableError> for Error {
    fn from(err: redb::TableError) -> Self {
        match err {
            redb::TableError::Storage(e) => from_storage("opening a table", e),
            other @ (redb::TableError::TableTypeMismatch { .. }
            | redb::TableError::TableIsMultimap(_)
            | redb::TableError::TypeDefinitionChanged { .. }) => Error::NotAStore {
                reason: other.to_string(),
            },
            other => Error::storage("opening a table", other),
        }
    }
}
