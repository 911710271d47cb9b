//! The file layout: our header, the write-ahead log region, then redb's database.
//!
//! ```text
//! 0          4 KiB                      4 KiB + log_len
//! | header   | write-ahead log (zeroed) | redb file ...
//! ```
//!
//! One file keeps the promise that a store is one file to copy, back up or delete: the log
//! cannot be lost or mixed up with another store's. redb sees only the part after the log,
//! through [`Tail`], and never knows the rest exists. The log region is written with zeros
//! when the file is created, so that log writes overwrite allocated blocks and an `fdatasync`
//! need not commit file-system metadata.

use std::ops::Bound;
use std::sync::Arc;

use redb::{BackendError, StorageBackend};

/// What redb's `StorageBackend` methods return on an I/O failure (with `std`).
type BackendIoError = std::io::Error;

use crate::error::{Error, Result};

/// The header's first bytes.
const MAGIC: &[u8; 18] = b"idempotency-store\n";
/// The layout this build writes and reads (independent of the record format).
const LAYOUT_VERSION: u32 = 1;
pub(crate) const HEADER_LEN: u64 = 4096;
/// The default log region of a new file. Each half holds about 3,000 claim+complete pairs
/// between merges. A bigger log makes merges rarer and buys throughput with many threads, but
/// keeps more pages that non-durable commits freed waiting for the next merge, in the file and
/// in memory. 4 MiB rather than 1: with 1 MiB, the claims' own merges during a mass expiry
/// each synced what the sweep had written since the last, and claim p99 during the sweep was
/// 3 to 7 times its value without (BENCHMARKS.md, "Figures behind the defaults").
pub(crate) const DEFAULT_LOG_LEN: u64 = 4 << 20;
/// The log sizes a header may name (`StoreBuilder::log_size` checks the same bounds).
pub(crate) const MIN_LOG_LEN: u64 = 16 << 10;
pub(crate) const MAX_LOG_LEN: u64 = 1 << 40;
/// redb's own magic number, to name a plain redb file when we meet one.
const REDB_MAGIC: &[u8; 9] = b"redb\x1A\x0A\xA9\x0D\x0A";

/// A storage backend shared by the log (which writes the front of it) and redb (the tail).
pub(crate) type Storage = Arc<dyn StorageBackend>;

/// Where the log lives in a store's storage.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Region {
    pub log_len: u64,
}

impl Region {
    pub(crate) fn log_start(self) -> u64 {
        HEADER_LEN
    }

    pub(crate) fn redb_start(self) -> u64 {
        HEADER_LEN + self.log_len
    }
}

/// Reads the header of `storage`, or lays out a new store with a log of `log_len` bytes if
/// the storage is empty. `Ok((region, true))`: a new store, whose header [`seal`] writes once
/// redb's own header is durable.
pub(crate) fn open(storage: &Storage, log_len: u64) -> Result<(Region, bool)> {
    let len = storage.len().map_err(io("reading the file length"))?;
    if len == 0 {
        return create(storage, Region { log_len }).map(|region| (region, true));
    }
    let mut header = [0u8; 38];
    if len < header.len() as u64 {
        return Err(not_ours(storage, len));
    }
    storage
        .read(0, &mut header)
        .map_err(io("reading the header"))?;
    if header.iter().all(|&b| b == 0) && len >= HEADER_LEN {
        return Err(half_created());
    }
    if &header[..18] != MAGIC {
        return Err(not_ours(storage, len));
    }
    let version = u32::from_le_bytes(field(&header, 18));
    let log_len = u64::from_le_bytes(field(&header, 22));
    if header[30..38] != checksum(&header[..30]) {
        return Err(Error::corrupted("the file header fails its checksum"));
    }
    if version != LAYOUT_VERSION {
        return Err(Error::NotAStore {
            reason: format!(
                "file layout version {version} is not supported (this build reads version \
                 {LAYOUT_VERSION})"
            ),
        });
    }
    if !(MIN_LOG_LEN..=MAX_LOG_LEN).contains(&log_len) || !log_len.is_multiple_of(4096) {
        return Err(Error::corrupted(format!(
            "the header's log size {log_len} is out of range"
        )));
    }
    let region = Region { log_len };
    if len < region.redb_start() {
        return Err(Error::corrupted(format!(
            "the file is truncated: {len} bytes, but its log alone ends at {}",
            HEADER_LEN.saturating_add(log_len)
        )));
    }
    Ok((region, false))
}

/// A file laid out but never given its header: the header is written last, after redb's
/// own is durable, and a store is handed to its caller only after that.
fn half_created() -> Error {
    Error::NotAStore {
        reason: "the file has no store header: its creation was cut short (a crash or power \
                 loss while the store was being created), so no call ever used it; delete it \
                 and open the path again. If the file held a store before, its first page is \
                 damaged: restore it from a backup"
            .to_owned(),
    }
}

/// Lays out a new store: the log region, zeroed and synced. No header yet (see [`seal`]).
fn create(storage: &Storage, region: Region) -> Result<Region> {
    let write = |offset, data: &[u8]| storage.write(offset, data).map_err(io("creating the file"));
    storage
        .set_len(region.redb_start())
        .map_err(io("creating the file"))?;
    // Zeros written, not just a hole from set_len: see the module docs.
    let zeros = vec![0u8; 1 << 20];
    let mut offset = region.log_start();
    while offset < region.redb_start() {
        let n = (region.redb_start() - offset).min(zeros.len() as u64) as usize;
        write(offset, &zeros[..n])?;
        offset += n as u64;
    }
    storage.sync_data().map_err(io("creating the file"))?;
    Ok(region)
}

/// Writes a new store's header, once redb's part is created: a file cut short while being
/// created has none and is refused as such (`half_created`), rather than opening with a
/// half-zeroed log or failing in redb with a misleading "magic number mismatch".
pub(crate) fn seal(storage: &Storage, region: Region) -> Result<()> {
    let mut header = vec![0u8; HEADER_LEN as usize];
    header[..18].copy_from_slice(MAGIC);
    header[18..22].copy_from_slice(&LAYOUT_VERSION.to_le_bytes());
    header[22..30].copy_from_slice(&region.log_len.to_le_bytes());
    let sum = checksum(&header[..30]);
    header[30..38].copy_from_slice(&sum);
    // redb's creation synced its header; this sync makes sure of it before ours goes down.
    storage.sync_data().map_err(io("creating the file"))?;
    storage.write(0, &header).map_err(io("creating the file"))?;
    storage.sync_data().map_err(io("creating the file"))
}

fn not_ours(storage: &Storage, len: u64) -> Error {
    let mut start = [0u8; 9];
    let redb = len >= 9 && storage.read(0, &mut start).is_ok() && &start == REDB_MAGIC;
    Error::NotAStore {
        reason: if redb {
            "the file is a plain redb database, not an idempotency-store file (no store header)"
                .to_owned()
        } else {
            "not an idempotency-store file (magic number mismatch)".to_owned()
        },
    }
}

fn field<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

fn checksum(bytes: &[u8]) -> [u8; 8] {
    field(blake3::hash(bytes).as_bytes(), 0)
}

fn io(context: &'static str) -> impl Fn(BackendIoError) -> Error {
    move |err| Error::storage(context, err)
}

/// redb's view of the storage: everything from `start` on, at offset 0.
#[derive(Debug)]
pub(crate) struct Tail {
    pub inner: Storage,
    pub start: u64,
}

impl StorageBackend for Tail {
    fn len(&self) -> Result<u64, BackendIoError> {
        Ok(self.inner.len()?.saturating_sub(self.start))
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendIoError> {
        self.inner.read(offset + self.start, out)
    }

    fn set_len(&self, len: u64) -> Result<(), BackendIoError> {
        self.inner.set_len(len + self.start)
    }

    fn sync_data(&self) -> Result<(), BackendIoError> {
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendIoError> {
        self.inner.write(offset + self.start, data)
    }

    fn close(&self) -> Result<(), BackendIoError> {
        self.inner.close()
    }

    // Lock ranges are redb's lock-protocol addresses, not data offsets: passed through as is.
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
