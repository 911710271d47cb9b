//! The storage engine under the redb [`Store`](crate::Store): file layout, write-ahead log,
//! overlay, flush thread, group commit, tables, record codec and the write operations.
//! Crate-private; depends on `api` and `error`, never on `store`.

pub(crate) mod codec;
pub(crate) mod commit;
pub(crate) mod flush;
pub(crate) mod layout;
pub(crate) mod ops;
pub(crate) mod overlay;
pub(crate) mod tables;
pub(crate) mod wal;
