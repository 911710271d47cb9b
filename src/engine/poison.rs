//! Poisoning: after a write or sync of the store's file that may have lost data, the store
//! refuses every write until it is reopened.
//!
//! A failed `fsync` does not leave the data waiting to be retried: the kernel may already
//! have dropped the dirty pages it could not write, marked them clean, and a later `fsync`
//! then succeeds over the hole (PostgreSQL's "fsyncgate", 2018). A merge after such a
//! failure would record as durable a state the disk does not hold. So every write and sync of
//! the file, redb's (through [`Guarded`]) and the log's own, reports its failure here, and
//! the store checks [`Poison::check`] before each write. Only a full disk that refused a write
//! (`ENOSPC`, `EDQUOT`) is not poison: nothing was handed to the kernel that could be lost,
//! and the batch that met it failed as a whole. A failed sync is poison whatever its error,
//! since the writes it was to make durable were already handed over.

use std::ops::Bound;
use std::sync::{Arc, OnceLock};

use redb::{BackendError, StorageBackend};

use crate::engine::layout::Storage;
use crate::error::{Cause, Error, Result};

/// The first failure that may have lost data, once there has been one.
#[derive(Debug, Default)]
pub(crate) struct Poison(OnceLock<Cause>);

/// What a failed I/O call was doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Io {
    /// A write or a resize: only its own data is at stake.
    Write,
    /// A sync, or a write that syncs itself (`O_DSYNC`): earlier writes may be lost too.
    Sync,
}

impl Poison {
    /// `Err(Error::Poisoned)` once the store is poisoned.
    pub(crate) fn check(&self) -> Result<()> {
        match self.0.get() {
            Some(cause) => Err(Error::Poisoned {
                cause: Arc::clone(cause),
            }),
            None => Ok(()),
        }
    }

    /// Poisons the store with `cause`, unless it already is (the first cause is kept).
    pub(crate) fn set(&self, cause: Cause) {
        // A second failure adds nothing the reopen does not already fix.
        let _ = self.0.set(cause);
    }

    /// Records a failed I/O call of the store's file, poisoning the store if it may have
    /// lost data.
    pub(crate) fn io_failed(&self, during: Io, what: &str, err: &std::io::Error) {
        if loses_data(during, err) {
            self.set(Arc::new(std::io::Error::new(
                err.kind(),
                format!("{what} failed: {err}"),
            )));
        }
    }
}

/// Whether a failed call may have lost data: any failed sync, and any failed write but one
/// refused for want of space.
pub(crate) fn loses_data(during: Io, err: &std::io::Error) -> bool {
    use std::io::ErrorKind::{QuotaExceeded, StorageFull};
    during == Io::Sync || !matches!(err.kind(), StorageFull | QuotaExceeded)
}

/// The store's storage as everyone writes it, redb and the log alike: every failure of a
/// write, resize or sync is reported to the store's [`Poison`].
#[derive(Debug)]
pub(crate) struct Guarded {
    pub inner: Storage,
    pub poison: Arc<Poison>,
}

impl Guarded {
    /// Runs a write, resize or sync of the file, unless the store is poisoned: then nothing
    /// more reaches the file. redb's own close writes and syncs its allocator state, and
    /// that sync would make durable a commit whose earlier pages the failed sync dropped.
    fn guard<T>(
        &self,
        during: Io,
        what: &str,
        call: impl FnOnce() -> std::io::Result<T>,
    ) -> std::io::Result<T> {
        self.poison.check().map_err(std::io::Error::other)?;
        let result = call();
        if let Err(err) = &result {
            self.poison.io_failed(during, what, err);
        }
        result
    }
}

impl StorageBackend for Guarded {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.guard(Io::Write, "resizing the store file", || {
            self.inner.set_len(len)
        })
    }

    fn sync_data(&self) -> std::io::Result<()> {
        self.guard(Io::Sync, "syncing the store file", || {
            self.inner.sync_data()
        })
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.guard(Io::Write, "writing the store file", || {
            self.inner.write(offset, data)
        })
    }

    fn close(&self) -> std::io::Result<()> {
        self.inner.close()
    }

    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }

    fn lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_range(start, end)
    }

    fn lock_shared_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.lock_shared_range(start, end)
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        self.inner.unlock_range(start, end)
    }

    fn query_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.inner.query_lock_range(start, end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::ErrorKind;

    #[test]
    fn only_a_write_refused_for_space_is_not_poison() {
        let full = std::io::Error::from(ErrorKind::StorageFull);
        let quota = std::io::Error::from(ErrorKind::QuotaExceeded);
        let eio = std::io::Error::other("EIO");
        assert!(!loses_data(Io::Write, &full));
        assert!(!loses_data(Io::Write, &quota));
        assert!(loses_data(Io::Write, &eio));
        assert!(
            loses_data(Io::Sync, &full),
            "a failed sync may have dropped pages"
        );
        assert!(loses_data(Io::Sync, &eio));
        let poison = Poison::default();
        poison.io_failed(Io::Write, "writing", &full);
        assert!(poison.check().is_ok());
        poison.io_failed(Io::Sync, "syncing", &eio);
        poison.io_failed(Io::Write, "writing", &eio);
        let err = poison.check().expect_err("poisoned");
        assert!(
            err.to_string().contains("syncing failed"),
            "first cause kept: {err}"
        );
    }
}
