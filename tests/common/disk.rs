//! Fake disks for redb's `StorageBackend`, shared by the tests that inject storage faults.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use idempotency_store::redb;

/// An in-memory disk whose syncs fail with `EIO` once `failing` is set.
#[derive(Debug, Default)]
pub struct FailingSyncs {
    inner: redb::backends::InMemoryBackend,
    pub failing: Arc<AtomicBool>,
}

impl redb::StorageBackend for FailingSyncs {
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> std::io::Result<()> {
        if self.failing.load(Ordering::SeqCst) {
            return Err(std::io::Error::from_raw_os_error(5));
        }
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        self.inner.write(offset, data)
    }
}
