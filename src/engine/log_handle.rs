//! The log's own handle on the store file: writes that are durable when they return
//! (`O_DSYNC` on Linux, a `sync_data` after each write elsewhere).

use crate::engine::poison::Io;
use crate::error::Result;

/// A second handle on the store file whose writes are durable when they return, for the log.
///
/// An `fdatasync` of the file would also write out every page that redb's commits without a
/// sync left in the page cache, which the log does not need: those pages only matter after
/// the next merge, whose durable commit syncs them (until then the log holds their
/// changes, and redb never overwrites the pages of its last durable commit). Linux syncs just
/// the written range for an `O_DSYNC` write, including the disk's cache flush (BENCHMARKS.md,
/// "Figures behind the defaults", has what that saved).
#[derive(Debug)]
pub(crate) struct LogHandle {
    file: std::fs::File,
    /// Opened with `O_DSYNC`: a write is durable when it returns. Otherwise each write is
    /// followed by `sync_data`.
    dsync: bool,
}

impl LogHandle {
    /// The handle, for checking that it is on the store's file.
    pub(crate) fn file(&self) -> &std::fs::File {
        &self.file
    }

    /// Writes `data` at `offset` and makes it durable; on failure, says whether the write
    /// itself or its sync failed. `injected`: a failure to fake (tests).
    pub(crate) fn write_durably(
        &self,
        data: &[u8],
        offset: u64,
        injected: Option<Io>,
    ) -> Result<(), (Io, std::io::Error)> {
        let eio = || std::io::Error::from_raw_os_error(5);
        if injected == Some(Io::Write) {
            return Err((Io::Write, eio()));
        }
        // With O_DSYNC the write is its own sync: a failure may have lost earlier writes too.
        let write_fails_as = if self.dsync { Io::Sync } else { Io::Write };
        write_at(&self.file, data, offset).map_err(|err| (write_fails_as, err))?;
        if !self.dsync {
            self.file.sync_data().map_err(|err| (Io::Sync, err))?;
        }
        match injected {
            Some(Io::Sync) => Err((Io::Sync, eio())),
            _ => Ok(()),
        }
    }
}

/// Opens the log's handle on `path`: with `O_DSYNC` on Linux, where an `O_DSYNC` write is a
/// full barrier (the range and the disk's cache flush), unless `portable`; elsewhere, and with
/// `portable`, a plain handle whose writes are each followed by `sync_data` (which is
/// `F_FULLFSYNC` on Apple platforms, where `O_DSYNC`, like `fsync`, leaves the data in the
/// drive's cache).
#[cfg(unix)]
pub(crate) fn open_log_writer(path: &std::path::Path, portable: bool) -> Result<Option<LogHandle>> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true);
    let dsync = cfg!(target_os = "linux") && !portable;
    #[cfg(target_os = "linux")]
    if dsync {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_DSYNC);
    }
    options
        .open(path)
        .map(|file| Some(LogHandle { file, dsync }))
        .map_err(|err| crate::error::Error::storage("opening the store file for the log", err))
}

/// Elsewhere the log writes through redb's backend and syncs the file.
#[cfg(not(unix))]
pub(crate) fn open_log_writer(
    _path: &std::path::Path,
    _portable: bool,
) -> Result<Option<LogHandle>> {
    Ok(None)
}

#[cfg(unix)]
fn write_at(file: &std::fs::File, data: &[u8], offset: u64) -> std::io::Result<()> {
    use std::os::unix::fs::FileExt;
    file.write_all_at(data, offset)
}

#[cfg(not(unix))]
fn write_at(_file: &std::fs::File, _data: &[u8], _offset: u64) -> std::io::Result<()> {
    Err(std::io::Error::other("no log handle on this platform"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn o_dsync_only_on_linux_and_never_on_the_portable_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("log");
        std::fs::write(&path, [0u8; 4096]).expect("file");
        let log = |portable| {
            open_log_writer(&path, portable)
                .expect("open")
                .expect("a log handle on unix")
        };
        assert_eq!(log(false).dsync, cfg!(target_os = "linux"));
        let portable = log(true);
        assert!(!portable.dsync);
        portable
            .write_durably(b"entry", 100, None)
            .expect("write and sync_data");
        let mut read = vec![0u8; 5];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(&path).expect("open"),
            &mut read,
            100,
        )
        .expect("read");
        assert_eq!(read, b"entry");
    }
}
