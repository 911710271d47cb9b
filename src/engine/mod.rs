//! The storage engine under the redb [`Store`](crate::Store): file layout, write-ahead log,
//! overlay, flush thread, group commit, tables, record codec, metadata and the write
//! operations, behind [`Engine`](handle::Engine). Crate-private; depends on `api` and `error`,
//! never on `store`.

pub(crate) mod apply;
pub(crate) mod batch;
pub(crate) mod bytes;
pub(crate) mod codec;
pub(crate) mod commit;
pub(crate) mod config;
pub(crate) mod contain;
pub(crate) mod cow;
pub(crate) mod effects;
pub(crate) mod flush;
pub(crate) mod format;
pub(crate) mod generation;
pub(crate) mod handle;
pub(crate) mod kept;
pub(crate) mod layout;
pub(crate) mod log_handle;
pub(crate) mod meta;
pub(crate) mod open;
pub(crate) mod ops;
pub(crate) mod overlay;
pub(crate) mod poison;
pub(crate) mod redo;
pub(crate) mod scan;
pub(crate) mod snapshot;
pub(crate) mod stats;
pub(crate) mod sweep;
pub(crate) mod tables;
pub(crate) mod wal;
