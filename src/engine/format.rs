//! The format check at open: whether a file is a store this build reads (writing a new
//! store's metadata, moving an older format's records), and where its log replay starts.

use redb::{MultimapTableHandle, ReadableTable, TableHandle, WriteTransaction};

use crate::engine::meta::{
    HASHED_FORMATS, KEPT_FORMAT, META, META_BYTES, META_FORMAT, META_LOG_SEQ, META_NEXT_TOKEN,
    META_RECORDS, STORE_FORMAT,
};
use crate::engine::tables::{self, EXPIRY};
use crate::error::{Error, Result};

/// Checks that `txn`'s file is a store of this format (writing the metadata of a new one),
/// opens the data tables, and returns the last log entry a merge covers.
pub(crate) fn check_tables(txn: &WriteTransaction) -> Result<u64> {
    let names: Vec<String> = txn
        .list_tables()?
        .map(|t| t.name().to_owned())
        .chain(txn.list_multimap_tables()?.map(|t| t.name().to_owned()))
        .collect();
    if !names.iter().any(|n| n == META.name()) && !names.is_empty() {
        return Err(Error::NotAStore {
            reason: format!(
                "the file holds the tables {names:?} but no idempotency-store metadata"
            ),
        });
    }
    let mut meta = txn.open_table(META)?;
    let stored =
        |m: &redb::Table<&str, u64>, k| -> Result<Option<u64>> { Ok(m.get(k)?.map(|v| v.value())) };
    let hashed = match stored(&meta, META_FORMAT)? {
        None => {
            meta.insert(META_FORMAT, STORE_FORMAT)?;
            meta.insert(META_NEXT_TOKEN, 1)?;
            false
        }
        Some(STORE_FORMAT | KEPT_FORMAT) => false,
        Some(v) if HASHED_FORMATS.contains(&v) => true,
        Some(v) => {
            return Err(Error::NotAStore {
                reason: format!(
                    "store format version {v} is not supported (this build reads versions 3 to \
                     {KEPT_FORMAT})"
                ),
            });
        }
    };
    // After the format check: another format's tables may have other key types. The open's
    // merge sets the version, in the transaction that moves the records.
    let moved = tables::create_or_migrate(txn, hashed)?;
    if hashed {
        crate::api::trace::migrated(moved.records, moved.dropped);
        for (counter, less) in [
            (META_RECORDS, moved.dropped),
            (META_BYTES, moved.dropped_bytes),
        ] {
            let now = stored(&meta, counter)?.unwrap_or(0);
            meta.insert(counter, now.saturating_sub(less))?;
        }
    }
    txn.open_table(EXPIRY)?;
    Ok(stored(&meta, META_LOG_SEQ)?.unwrap_or(0))
}
