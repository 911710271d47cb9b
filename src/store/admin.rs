//! The redb side of the operator calls of [`IdempotencyStore`](crate::IdempotencyStore):
//! walking every record, reading a record whatever its expiry, and releasing a stuck key
//! without its lease. The `idempotency-store` CLI is built on these.

use std::marker::PhantomData;

use crate::api::key::Key;
use crate::api::outcome::ForceRelease;
use crate::api::record::Record;
use crate::api::records::Records;
use crate::api::report::StoredRecord;
use crate::engine::contain::contain;
use crate::engine::ops::ForceReleaseKey;
use crate::engine::tables::{self, Entry, RECORDS};
use crate::error::{Error, Result};
use crate::store::Store;

/// The redb walk behind [`IdempotencyStore::records`](crate::IdempotencyStore::records): every
/// record in storage order (by number: merge by merge, the order in which records first reached
/// redb), from one read snapshot (writers go on meanwhile and are not seen).
struct Walk<'store> {
    range: Option<redb::Range<'static, u64, Entry>>,
    _store: PhantomData<&'store Store>,
}

impl Iterator for Walk<'_> {
    type Item = Result<StoredRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        let range = self.range.as_mut()?;
        let step = contain("listing records", || match range.next() {
            None => Ok(None),
            Some(Ok((number, entry))) => {
                let (key, value) = tables::split(number.value(), entry.value())?;
                Ok(Some(stored_record(key, value)))
            }
            Some(Err(err)) => Err(err.into()),
        });
        match step {
            Ok(Some(item)) => Some(item),
            Ok(None) => {
                self.range = None;
                None
            }
            Err(err) => {
                self.range = None;
                Some(Err(err))
            }
        }
    }
}

/// Every record of `store`, expired ones included, from one read snapshot.
pub(super) fn records(store: &Store) -> Result<Records<'_>> {
    let range = contain("listing records", || {
        let (txn, _) = store.engine.snapshot()?;
        let table = txn.open_table(RECORDS)?;
        Ok(table.range::<u64>(..)?)
    })?;
    Ok(Records::new(Walk {
        range: Some(range),
        _store: PhantomData,
    }))
}

/// Deletes the key's in-progress record without its lease, in one durable write, and wakes
/// this process's waiters on the key.
pub(super) fn force_release(store: &Store, key: &Key) -> Result<ForceRelease> {
    let outcome = store.engine.write(ForceReleaseKey { key: key.clone() })?;
    store.waiters.wake(key);
    Ok(outcome)
}

/// Decodes one stored entry; a damaged one becomes an error naming its key.
fn stored_record(key: &[u8], value: &[u8]) -> Result<StoredRecord> {
    let name = |bytes: &[u8]| match Key::from_stored(bytes) {
        Ok(key) => format!("{:?}", key.to_string()),
        Err(_) => format!("{:?}", String::from_utf8_lossy(bytes)),
    };
    let damaged = |err: Error| match err {
        Error::Corrupted { reason } => Error::corrupted(format!("record {}: {reason}", name(key))),
        other => other,
    };
    let parsed = Key::from_stored(key).map_err(damaged)?;
    let record = Record::decode(key, value).map_err(damaged)?;
    Ok(StoredRecord {
        key: parsed,
        record: record.into_view(),
    })
}
