//! Operator tools: walking every record, reading a record whatever its expiry, and releasing a
//! stuck key without its lease. The `idempotency-store` CLI is built on these.

use std::marker::PhantomData;

use crate::api::key::Key;
use crate::api::outcome::ForceRelease;
use crate::api::outcome::RecordView;
use crate::api::record::Record;
use crate::api::report::StoredRecord;
use crate::engine::contain::contain;
use crate::engine::ops::ForceReleaseKey;
use crate::engine::tables::{self, RECORDS};
use crate::error::{Error, Result};
use crate::store::Store;

/// An iterator over every record of a store, in storage order, from one read snapshot. Created
/// by [`Store::records`].
///
/// Each item is one record, or the error that record met: a damaged record yields
/// [`Error::Corrupted`] naming its key and the walk goes on; a storage failure yields its error
/// and ends the walk.
pub struct Records<'store> {
    range: Option<redb::Range<'static, &'static [u8], &'static [u8]>>,
    _store: PhantomData<&'store Store>,
}

impl std::fmt::Debug for Records<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("finished", &self.range.is_none())
            .finish_non_exhaustive()
    }
}

impl Iterator for Records<'_> {
    type Item = Result<StoredRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        let range = self.range.as_mut()?;
        let step = contain("listing records", || match range.next() {
            None => Ok(None),
            Some(Ok((key, value))) => Ok(Some(stored_record(key.value(), value.value()))),
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

impl Store {
    /// Walks every record of the store, expired ones included, in storage order, from one read
    /// snapshot (writers go on meanwhile and are not seen). For operator tools such as a listing
    /// or an export; a service has no use for it.
    ///
    /// ```
    /// use idempotency_store::{Claim, Fingerprint, Key, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let Claim::Acquired(_lease) = store.claim(&Key::new("k")?, Fingerprint::of(["r"]))? else {
    ///     unreachable!()
    /// };
    /// let keys = store.records()?.map(|r| r.map(|r| r.key.to_string())).collect::<Result<Vec<_>, _>>()?;
    /// assert_eq!(keys, ["k"]);
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Storage`] or [`Error::Corrupted`] if the records table cannot be opened. Errors
    /// met during the walk are items of the iterator (see [`Records`]).
    pub fn records(&self) -> Result<Records<'_>> {
        let range = contain("listing records", || {
            let (txn, _) = self.engine.snapshot()?;
            let table = txn.open_table(RECORDS)?;
            Ok(table.range::<&[u8]>(..)?)
        })?;
        Ok(Records {
            range: Some(range),
            _store: PhantomData,
        })
    }

    /// The key's record, expired or not: like [`lookup`](Store::lookup), but an expired record
    /// that no sweep has deleted yet is returned too (compare its `expires_at` with
    /// [`now`](Store::now)). For operator tools.
    ///
    /// # Errors
    /// [`Error::Corrupted`] if the record does not decode; [`Error::Storage`].
    pub fn inspect(&self, key: &Key) -> Result<Option<RecordView>> {
        Ok(self.read(key)?.map(Record::into_view))
    }

    /// Deletes the key's **in-progress** record without holding its lease, so that the next
    /// claim runs the operation afresh. For an operator un-sticking a key, never for a service's
    /// normal flow (use [`release`](Store::release) with the lease there).
    ///
    /// **Danger: this bypasses fencing.** If the attempt holding the key is still alive (or its
    /// side effect already happened downstream), a retry after this call runs the operation a
    /// second time: the payment is charged twice. Check downstream first. The old holder's
    /// later `complete`, `release`, `heartbeat` or `checkpoint` then fails with
    /// [`Error::LeaseLost`] (its token no longer matches any record), but its side effect is not
    /// undone.
    ///
    /// Completed records are never deleted (the response keeps replaying), and an expired record
    /// is left to the sweeps. The record, its expiry-index entry and the usage counters change
    /// in one durable write transaction, so [`verify`](Store::verify) stays clean; callers
    /// waiting in [`claim_wait`](Store::claim_wait) in this process are woken.
    ///
    /// ```
    /// use idempotency_store::{Claim, Error, Fingerprint, ForceRelease, Key, Store};
    ///
    /// let store = Store::builder().open_in_memory()?;
    /// let key = Key::new("stuck")?;
    /// let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["r"]))? else { unreachable!() };
    /// assert!(matches!(store.force_release(&key)?, ForceRelease::Released { attempt: 1, .. }));
    /// assert!(matches!(store.release(&lease), Err(Error::LeaseLost)));
    /// assert!(store.verify()?.is_clean());
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::Corrupted`] if the record does not decode (nothing is changed);
    /// [`Error::Storage`] if the transaction fails (the outcome of a failed commit is unknown:
    /// inspect the key).
    pub fn force_release(&self, key: &Key) -> Result<ForceRelease> {
        let outcome = self.engine.write(ForceReleaseKey { key: key.clone() })?;
        self.waiters.wake(key);
        Ok(outcome)
    }
}

/// Decodes one stored entry; a damaged one becomes an error naming its key.
fn stored_record(key: &[u8], value: &[u8]) -> Result<StoredRecord> {
    let Some(key) = tables::stored_key(key) else {
        return Err(Error::corrupted(format!(
            "a record is filed under a key ({:?}) whose hash prefix does not match it",
            String::from_utf8_lossy(key)
        )));
    };
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
