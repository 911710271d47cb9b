//! Opening an engine: the file (or a custom backend), its header and log region, then redb on
//! the part after the log.

use std::path::Path;
use std::sync::Arc;

use redb::StorageBackend;

use crate::engine::config::Config;
use crate::engine::contain::contain;
use crate::engine::cow::CowFile;
use crate::engine::handle::Engine;
use crate::engine::layout::{self, Storage, Tail};
use crate::engine::log_handle::{self, LogHandle};
use crate::engine::poison::{Guarded, Poison};
use crate::engine::wal::LogFile;
use crate::error::{Error, Result};

/// Opens (or creates) the store file at `path`.
pub(crate) fn open_file(path: &Path, config: Config) -> Result<Engine> {
    contain("opening the store", || {
        let (storage, id) = open_storage_file(path, config.create_if_missing)?;
        let log_writer = log_handle::open_log_writer(path, config.portable_log_sync)?;
        if let Some(log) = &log_writer {
            check_same_file(path, id, file_id(log.file())?)?;
        }
        open(storage, log_writer, config)
    })
}

/// Opens the store file at `path` read-only: the file is opened for reading only and seen
/// through a copy-on-write layer in memory ([`CowFile`]), so the open (redb's repair after a
/// crash, the log's replay) runs as always but never writes a byte to the file.
pub(crate) fn open_read_only(path: &Path, config: Config) -> Result<Engine> {
    contain("opening the store", || {
        let opening = |err| Error::storage("opening the store file", err);
        let file = std::fs::File::open(path).map_err(|err| match err.kind() {
            std::io::ErrorKind::NotFound => Error::NotAStore {
                reason: format!(
                    "there is no store file at {} (a read-only open never creates one)",
                    path.display()
                ),
            },
            _ => opening(err),
        })?;
        let storage = CowFile::new(file).map_err(opening)?;
        // An empty file would be laid out as a new store, in memory.
        if storage.len().map_err(opening)? == 0 {
            return Err(empty_file(path));
        }
        open(Arc::new(storage), None, config)
    })
}

/// Opens a store on a custom redb storage backend.
pub(crate) fn open_backend(storage: Storage, config: Config) -> Result<Engine> {
    contain("opening the store", || open(storage, None, config))
}

/// Reads or writes the store's header, then opens redb on the part after the log.
fn open(storage: Storage, log_writer: Option<LogHandle>, config: Config) -> Result<Engine> {
    let poison = Arc::new(Poison::default());
    let storage: Storage = Arc::new(Guarded {
        inner: storage,
        poison: Arc::clone(&poison),
    });
    let (region, new) = layout::open(&storage, config.log_size)?;
    let tail = Tail {
        inner: Arc::clone(&storage),
        start: region.redb_start(),
    };
    let mut builder = redb::Builder::new();
    builder.set_cache_size(config.cache_size);
    let db = builder.create_with_backend(tail).map_err(redb_open_error)?;
    if new {
        layout::seal(&storage, region)?;
    }
    let log_file = LogFile {
        storage,
        region,
        log_writer,
        poison,
    };
    Engine::init(db, log_file, config)
}

/// A file's identity: device and inode (`None` where the platform has no such notion).
type FileId = Option<(u64, u64)>;

/// Opens (or creates) the store file for redb; returns it and its identity.
fn open_storage_file(path: &Path, create: bool) -> Result<(Storage, FileId)> {
    let existed = path
        .try_exists()
        .map_err(|err| Error::storage("opening the store file", err))?;
    if !existed && !create {
        return Err(Error::NotAStore {
            reason: format!(
                "there is no store file at {}, and create_if_missing is off: check the path \
                 for a typo, or turn create_if_missing on to create a new store there",
                path.display()
            ),
        });
    }
    // A new file is laid out by `layout::open`; an existing one cut to nothing must not silently
    // come back empty (every retry would run again).
    if std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
        return Err(empty_file(path));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .truncate(false)
        .open(path)
        .map_err(|err| Error::storage("opening the store file", err))?;
    if !existed {
        sync_parent(path)?;
    }
    let id = file_id(&file)?;
    Ok((Arc::new(redb::backends::FileBackend::new(file)?), id))
}

fn empty_file(path: &Path) -> Error {
    Error::NotAStore {
        reason: format!(
            "{} is empty (0 bytes): if its creation was cut short, no call ever used it; \
             delete it and the store will create it again. Otherwise it was truncated: \
             restore it from a backup",
            path.display()
        ),
    }
}

/// Makes a new file's name durable: strict POSIX may otherwise lose the directory entry in a
/// power loss, and the next open would create an empty store (every retry would run again).
#[cfg(unix)]
fn sync_parent(path: &Path) -> Result<()> {
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    std::fs::File::open(parent)
        .and_then(|dir| dir.sync_all())
        .map_err(|err| Error::storage("syncing the store file's directory", err))
}

/// Elsewhere a directory cannot be opened to sync it; the file system's own metadata
/// journaling is relied upon.
#[cfg(not(unix))]
fn sync_parent(_path: &Path) -> Result<()> {
    Ok(())
}

#[cfg(unix)]
fn file_id(file: &std::fs::File) -> Result<FileId> {
    use std::os::unix::fs::MetadataExt;
    let meta = file
        .metadata()
        .map_err(|err| Error::storage("reading the store file's metadata", err))?;
    Ok(Some((meta.dev(), meta.ino())))
}

#[cfg(not(unix))]
fn file_id(_file: &std::fs::File) -> Result<FileId> {
    Ok(None)
}

/// The store opens its path twice (redb's handle, the log's); both must be the same file, or
/// the log would be written into another file than the database it belongs to (the path
/// replaced between the two opens).
fn check_same_file(path: &Path, redb: FileId, log: FileId) -> Result<()> {
    match (redb, log) {
        (Some(a), Some(b)) if a != b => Err(Error::storage(
            "opening the store file",
            std::io::Error::other(format!(
                "{} was replaced while it was being opened (the database's and the log's \
                 handles are on different files); open it again",
                path.display()
            )),
        )),
        _ => Ok(()),
    }
}

fn redb_open_error(err: redb::DatabaseError) -> Error {
    match err {
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::InvalidData =>
        {
            Error::NotAStore {
                reason: io.to_string(),
            }
        }
        redb::DatabaseError::Storage(redb::StorageError::Io(io))
            if io.kind() == std::io::ErrorKind::UnexpectedEof =>
        {
            Error::corrupted(format!("the file is truncated ({io})"))
        }
        other => other.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn two_handles_must_be_on_one_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::write(&a, b"a").expect("write");
        std::fs::write(&b, b"b").expect("write");
        let id = |p: &Path| file_id(&std::fs::File::open(p).expect("open")).expect("id");
        assert!(check_same_file(&a, id(&a), id(&a)).is_ok());
        let err = check_same_file(&a, id(&a), id(&b)).expect_err("different files");
        let cause = std::error::Error::source(&err).map(ToString::to_string);
        assert!(cause.unwrap_or_default().contains("was replaced"), "{err}");
        // The same file through a hard link is the same file.
        let link = dir.path().join("link");
        std::fs::hard_link(&a, &link).expect("link");
        assert!(check_same_file(&a, id(&a), id(&link)).is_ok());
    }
}
