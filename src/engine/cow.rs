//! A read-only file seen through a copy-on-write layer in memory, for read-only opens.
//!
//! Opening a store writes: redb marks its header while a database is open, repairs after a
//! crash, and the store replays its log in a redb transaction. A read-only open must not change
//! the file it looks at (after an incident, looking must not change the evidence), yet should
//! see exactly what a writable open would. So the normal open runs unchanged on [`CowFile`]:
//! the file is opened read-only (`O_RDONLY` on Unix, so any write to it would fail), every
//! write and resize lands in pages held in memory, and reads merge those pages over the file.
//! Syncs do nothing: nothing is to reach the disk.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::ops::Bound;

use parking_lot::Mutex;
use redb::{BackendError, StorageBackend};

/// The unit of the copy: redb's page size.
const PAGE: u64 = 4096;

/// A read-only file under an in-memory layer of written pages.
#[derive(Debug)]
pub(crate) struct CowFile {
    file: File,
    layer: Mutex<Layer>,
}

#[derive(Debug)]
struct Layer {
    /// Written pages, by page number, each `PAGE` bytes.
    pages: BTreeMap<u64, Box<[u8]>>,
    /// The length the storage has now.
    len: u64,
    /// From here on, bytes not in `pages` read as zeros: the file's length, or less once the
    /// storage was cut shorter (bytes past a cut and regrown must not come back).
    zeros_from: u64,
}

impl CowFile {
    /// Wraps `file`, opened for reading only.
    pub(crate) fn new(file: File) -> io::Result<CowFile> {
        let len = file.metadata()?.len();
        Ok(CowFile {
            file,
            layer: Mutex::new(Layer {
                pages: BTreeMap::new(),
                len,
                zeros_from: len,
            }),
        })
    }

    /// Fills `out` from the file at `offset`, with zeros from `zeros_from` on.
    fn read_file(&self, offset: u64, out: &mut [u8], zeros_from: u64) -> io::Result<()> {
        let from_file = usize::try_from(zeros_from.saturating_sub(offset))
            .unwrap_or(usize::MAX)
            .min(out.len());
        let (head, tail) = out.split_at_mut(from_file);
        read_at(&self.file, offset, head)?;
        tail.fill(0);
        Ok(())
    }

    /// Page `index` as the storage holds it now: from the layer, or else from the file.
    fn load(&self, layer: &Layer, index: u64) -> io::Result<Box<[u8]>> {
        if let Some(page) = layer.pages.get(&index) {
            return Ok(page.clone());
        }
        let mut page = vec![0u8; PAGE as usize].into_boxed_slice();
        self.read_file(index * PAGE, &mut page, layer.zeros_from)?;
        Ok(page)
    }
}

/// The part of page `index` that the byte range `[offset, end)` covers, as offsets in the page
/// and in the range.
fn span(index: u64, offset: u64, end: u64) -> (usize, usize, usize) {
    let start = (index * PAGE).max(offset);
    // The last page of the address space ends past u64::MAX.
    let stop = (index + 1).saturating_mul(PAGE).min(end);
    let in_page = (start - index * PAGE) as usize;
    let in_range = (start - offset) as usize;
    (in_page, in_range, (stop - start) as usize)
}

impl StorageBackend for CowFile {
    fn len(&self) -> Result<u64, io::Error> {
        Ok(self.layer.lock().len)
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), io::Error> {
        let layer = self.layer.lock();
        let end = offset
            .checked_add(out.len() as u64)
            .filter(|&end| end <= layer.len)
            .ok_or_else(|| io::Error::from(io::ErrorKind::UnexpectedEof))?;
        if out.is_empty() {
            return Ok(());
        }
        // Runs of pages the layer does not hold are read from the file in one call each.
        let mut at = offset;
        for (&index, page) in layer.pages.range(offset / PAGE..=(end - 1) / PAGE) {
            let page_start = index * PAGE;
            if page_start > at {
                let (from, to) = ((at - offset) as usize, (page_start - offset) as usize);
                self.read_file(at, &mut out[from..to], layer.zeros_from)?;
            }
            let (in_page, in_range, n) = span(index, offset, end);
            out[in_range..in_range + n].copy_from_slice(&page[in_page..in_page + n]);
            at = page_start.saturating_add(PAGE);
        }
        if at < end {
            let from = (at - offset) as usize;
            self.read_file(at, &mut out[from..], layer.zeros_from)?;
        }
        Ok(())
    }

    fn set_len(&self, len: u64) -> Result<(), io::Error> {
        let mut layer = self.layer.lock();
        if len < layer.len {
            drop(layer.pages.split_off(&len.div_ceil(PAGE)));
            if let Some(page) = layer.pages.get_mut(&(len / PAGE)) {
                page[(len % PAGE) as usize..].fill(0);
            }
            layer.zeros_from = layer.zeros_from.min(len);
        }
        layer.len = len;
        Ok(())
    }

    fn sync_data(&self) -> Result<(), io::Error> {
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), io::Error> {
        if data.is_empty() {
            return Ok(());
        }
        let end = offset
            .checked_add(data.len() as u64)
            .ok_or_else(|| io::Error::from(io::ErrorKind::InvalidInput))?;
        let mut layer = self.layer.lock();
        for index in offset / PAGE..=(end - 1) / PAGE {
            let mut page = self.load(&layer, index)?;
            let (in_page, in_range, n) = span(index, offset, end);
            page[in_page..in_page + n].copy_from_slice(&data[in_range..in_range + n]);
            layer.pages.insert(index, page);
        }
        layer.len = layer.len.max(end);
        Ok(())
    }

    // redb asks for exclusive ranges first; refusing them makes it ask for the whole storage,
    // which is taken as a shared lock of the file: other read-only opens may share it, while a
    // writer's exclusive lock (redb's file backend also takes the whole-file lock, on Linux)
    // and this one exclude each other, so a read-only open never sees a file being written.
    fn try_lock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<bool, BackendError> {
        self.try_lock_shared_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> Result<bool, BackendError> {
        if (start, end) != (Bound::Unbounded, Bound::Unbounded) {
            return Err(BackendError::Unsupported);
        }
        match self.file.try_lock_shared() {
            Ok(()) => Ok(true),
            Err(std::fs::TryLockError::WouldBlock) => Ok(false),
            Err(std::fs::TryLockError::Error(err)) => Err(BackendError::Io(err)),
        }
    }

    fn unlock_range(&self, start: Bound<u64>, end: Bound<u64>) -> Result<(), BackendError> {
        if (start, end) != (Bound::Unbounded, Bound::Unbounded) {
            return Err(BackendError::Unsupported);
        }
        self.file.unlock().map_err(BackendError::Io)
    }
}

#[cfg(unix)]
fn read_at(file: &File, offset: u64, out: &mut [u8]) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(out, offset)
}

/// Elsewhere by seeking: every call runs under the layer's lock, so no two seek at once.
#[cfg(not(unix))]
fn read_at(file: &File, offset: u64, out: &mut [u8]) -> io::Result<()> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = file;
    file.seek(SeekFrom::Start(offset))?;
    file.read_exact(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of `len` bytes, each its offset modulo 251, opened read-only.
    fn cow(len: usize) -> (tempfile::TempDir, CowFile, Vec<u8>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).expect("write");
        let file = File::open(&path).expect("open");
        (dir, CowFile::new(file).expect("cow"), bytes)
    }

    fn read(cow: &CowFile, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        cow.read(offset, &mut out).expect("read");
        out
    }

    #[test]
    fn writes_stay_in_memory_and_merge_into_reads() {
        let (dir, cow, mut expected) = cow(3 * PAGE as usize + 100);
        cow.write(4000, &[7u8; 200])
            .expect("write across a page boundary");
        expected[4000..4200].fill(7);
        cow.write(10, b"abc").expect("write");
        expected[10..13].copy_from_slice(b"abc");
        assert_eq!(read(&cow, 0, expected.len()), expected);
        assert_eq!(read(&cow, 3990, 300), expected[3990..4290]);
        // The file itself is untouched.
        let on_disk = std::fs::read(dir.path().join("f")).expect("read");
        assert_eq!(on_disk.len(), expected.len());
        assert_ne!(on_disk[4000..4200], expected[4000..4200]);
    }

    #[test]
    fn growing_reads_zeros_and_a_cut_never_brings_old_bytes_back() {
        let (_dir, cow, bytes) = cow(2 * PAGE as usize);
        cow.set_len(3 * PAGE).expect("grow");
        assert_eq!(read(&cow, 2 * PAGE, PAGE as usize), vec![0; PAGE as usize]);
        cow.set_len(100).expect("cut");
        assert!(cow.read(0, &mut [0u8; 101]).is_err(), "read past the end");
        cow.set_len(2 * PAGE).expect("regrow");
        let back = read(&cow, 0, 2 * PAGE as usize);
        assert_eq!(back[..100], bytes[..100]);
        assert!(back[100..].iter().all(|&b| b == 0));
        cow.write(5 * PAGE, b"x").expect("write past the end");
        assert_eq!(cow.len().expect("len"), 5 * PAGE + 1);
        assert_eq!(read(&cow, 5 * PAGE - 1, 2), [0, b'x']);
    }
}
