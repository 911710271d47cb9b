//! In-memory storage that survives a reopen.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{Checks, Outcome, Step, run_sequential};

/// A redb `StorageBackend` over a shared byte vector: clones share the bytes, so a store
/// dropped and reopened on a clone sees everything the first one wrote. `sync_data` is free.
#[derive(Debug, Clone, Default)]
pub struct MemDisk(Arc<Mutex<Vec<u8>>>);

impl MemDisk {
    fn bytes(&self) -> MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn span(offset: u64, len: usize) -> std::io::Result<std::ops::Range<usize>> {
    let start = usize::try_from(offset).map_err(std::io::Error::other)?;
    let end = start
        .checked_add(len)
        .ok_or_else(|| std::io::Error::other("offset overflow"))?;
    Ok(start..end)
}

impl redb::StorageBackend for MemDisk {
    fn len(&self) -> std::io::Result<u64> {
        Ok(self.bytes().len() as u64)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> std::io::Result<()> {
        let bytes = self.bytes();
        let data = bytes
            .get(span(offset, out.len())?)
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        out.copy_from_slice(data);
        Ok(())
    }

    fn set_len(&self, len: u64) -> std::io::Result<()> {
        let len = usize::try_from(len).map_err(std::io::Error::other)?;
        self.bytes().resize(len, 0);
        Ok(())
    }

    fn sync_data(&self) -> std::io::Result<()> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let range = span(offset, data.len())?;
        let mut bytes = self.bytes();
        if bytes.len() < range.end {
            bytes.resize(range.end, 0);
        }
        bytes[range].copy_from_slice(data);
        Ok(())
    }
}

/// [`run_sequential`] on a fresh [`MemDisk`].
pub fn run_in_memory(steps: &[Step]) -> Outcome {
    let disk = MemDisk::default();
    run_sequential(steps, Checks::EveryStep, &|settings| {
        settings.open_with_backend(disk.clone())
    })
}
