//! Opening an engine: the file (or a custom backend), its header and log region, then redb on
//! the part after the log.

use std::path::Path;
use std::sync::Arc;

use crate::engine::contain::contain;
use crate::engine::handle::{Config, Engine};
use crate::engine::layout::{self, Storage, Tail};
use crate::engine::poison::{Guarded, Poison};
use crate::engine::wal::{self, LogFile, LogHandle};
use crate::error::{Error, Result};

/// Opens (or creates) the store file at `path`.
pub(crate) fn open_file(path: &Path, config: Config) -> Result<Engine> {
    contain("opening the store", || {
        let storage = open_storage_file(path)?;
        let log_writer = wal::open_log_writer(path, false)?;
        open(storage, log_writer, config)
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
    let region = layout::open(&storage, config.log_size)?;
    let tail = Tail {
        inner: Arc::clone(&storage),
        start: region.redb_start(),
    };
    let mut builder = redb::Builder::new();
    builder.set_cache_size(config.cache_size);
    let db = builder.create_with_backend(tail).map_err(redb_open_error)?;
    let log_file = LogFile {
        storage,
        region,
        log_writer,
        poison,
    };
    Engine::init(db, log_file, config)
}

fn open_storage_file(path: &Path) -> Result<Storage> {
    // A new file is laid out by `layout::open`; an existing one cut to nothing must not silently
    // come back empty (every retry would run again).
    if std::fs::metadata(path).is_ok_and(|m| m.len() == 0) {
        return Err(Error::NotAStore {
            reason: format!(
                "{} is empty (0 bytes); if it is a new file, delete it and the store will \
                 create it",
                path.display()
            ),
        });
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|err| Error::storage("opening the store file", err))?;
    Ok(Arc::new(redb::backends::FileBackend::new(file)?))
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
