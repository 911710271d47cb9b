//! One redb read snapshot, shared by the reads under the overlay until redb's part of the
//! store changes.
//!
//! A record is read from the overlay, then from redb. Beginning a read transaction and opening the
//! records table for each read cost allocations and a lock inside redb (BENCHMARKS.md, "Figures
//! behind the defaults"), three times per fresh request (the claim's read, and the claim's and the
//! completion's batches). Yet what redb holds under the overlay changes only at two kinds of
//! moments, both under the writer lock: the overlay drops a generation that redb has taken (the
//! flush thread's commits add nothing the overlay does not still hold until then), and a batch or
//! merge commits to redb directly. Both are bracketed by [`Snapshots::change`], which moves a
//! counter to odd and back to even, like a seqlock's, and drops the shared snapshot. The flush
//! thread's commits only drop the shared snapshot once they are done ([`Snapshots::release`]): no
//! read needs more, but a snapshot kept across commits would keep redb from reusing the pages they
//! free (see `flush::write`). Bracketing them as changes made every read during one (a merge's sync
//! takes milliseconds) begin a snapshot of its own and then read again: at 64 threads, about one of
//! each per claim.
//!
//! A read takes the shared snapshot (or begins one), checks the overlay, reads the snapshot,
//! and keeps the answer only if the counter has not moved since the snapshot was taken: a
//! generation dropped before the overlay was checked, or a commit made meanwhile, moved it.
//! Otherwise it reads again as reads did before, with a snapshot begun after the overlay check.
//! A batch holds the writer lock, under which nothing changes, so its snapshot needs no check.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use redb::{Database, ReadTransaction, ReadableDatabase};

use crate::engine::tables::RecordsRead;
use crate::error::Result;

/// redb's tables as of one commit.
pub(crate) struct Snapshot {
    pub txn: ReadTransaction,
    pub records: RecordsRead,
    /// The counter when the snapshot was begun; odd if a change was under way.
    epoch: u64,
}

/// The shared snapshot and the counter of changes (see the module's docs).
#[derive(Default)]
pub(crate) struct Snapshots {
    epoch: AtomicU64,
    shared: Mutex<Option<Arc<Snapshot>>>,
}

impl Snapshots {
    /// The shared snapshot if nothing changed since it was begun; else one begun now, shared
    /// if nothing changed meanwhile either.
    pub(crate) fn get(&self, db: &Database) -> Result<Arc<Snapshot>> {
        let epoch = self.epoch.load(Ordering::SeqCst);
        let settled = epoch.is_multiple_of(2);
        if settled
            && let Some(snapshot) = &*self.shared.lock()
            && snapshot.epoch == epoch
        {
            return Ok(Arc::clone(snapshot));
        }
        let txn = db.begin_read()?;
        let records = RecordsRead::open(&txn)?;
        let snapshot = Arc::new(Snapshot {
            txn,
            records,
            epoch,
        });
        if settled {
            let mut shared = self.shared.lock();
            if self.epoch.load(Ordering::SeqCst) == epoch {
                *shared = Some(Arc::clone(&snapshot));
            }
        }
        Ok(snapshot)
    }

    /// The counter `snapshot` was begun at: a read that found a key absent from redb hands it
    /// to the key's claim, whose batch skips redb if its own snapshot has the same (see
    /// `ops::ClaimKey::absent_at`).
    pub(crate) fn epoch(snapshot: &Snapshot) -> u64 {
        snapshot.epoch
    }

    /// Whether redb's part of the store is still what `snapshot` shows: no change began since
    /// it was begun, and none was under way then.
    pub(crate) fn current(&self, snapshot: &Snapshot) -> bool {
        snapshot.epoch.is_multiple_of(2) && self.epoch.load(Ordering::SeqCst) == snapshot.epoch
    }

    /// Drops the shared snapshot without marking a change, after a commit that changed nothing
    /// a read can see: reads begun before it stay current, and the next one begins a new
    /// snapshot, so that redb can reuse the pages the commit freed.
    pub(crate) fn release(&self) {
        let old = self.shared.lock().take();
        drop(old);
    }

    /// Runs `change` (a commit to redb, or dropping an overlay generation redb holds) with the
    /// counter odd, and drops the shared snapshot, so that no read keeps an answer from before
    /// it. The counter is even again afterwards, also if `change` panics.
    pub(crate) fn change<T>(&self, change: impl FnOnce() -> T) -> T {
        struct Settle<'a>(&'a AtomicU64);
        impl Drop for Settle<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        self.epoch.fetch_add(1, Ordering::SeqCst);
        let _settle = Settle(&self.epoch);
        // Outside the lock: the last holder of the old snapshot may be a read that ends it.
        let old = self.shared.lock().take();
        drop(old);
        change()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::tables::RecordsMut;
    use redb::backends::InMemoryBackend;

    /// A database in memory with empty records tables.
    pub(crate) fn db() -> Database {
        let db = Database::builder()
            .create_with_backend(InMemoryBackend::new())
            .expect("db");
        let txn = db.begin_write().expect("write");
        RecordsMut::open(&txn).expect("tables");
        txn.commit().expect("commit");
        db
    }

    #[test]
    fn a_snapshot_is_shared_until_a_change() {
        let (db, snapshots) = (db(), Snapshots::default());
        let first = snapshots.get(&db).expect("snapshot");
        let again = snapshots.get(&db).expect("snapshot");
        assert!(Arc::ptr_eq(&first, &again));
        assert!(snapshots.current(&first));
        snapshots.change(|| ());
        assert!(!snapshots.current(&first));
        let after = snapshots.get(&db).expect("snapshot");
        assert!(!Arc::ptr_eq(&first, &after));
        assert!(snapshots.current(&after));
    }

    #[test]
    fn a_release_ends_the_sharing_but_keeps_reads_current() {
        let (db, snapshots) = (db(), Snapshots::default());
        let first = snapshots.get(&db).expect("snapshot");
        snapshots.release();
        assert!(snapshots.current(&first), "a release is not a change");
        let after = snapshots.get(&db).expect("snapshot");
        assert!(!Arc::ptr_eq(&first, &after));
        assert!(Arc::ptr_eq(&after, &snapshots.get(&db).expect("snapshot")));
    }

    #[test]
    fn a_snapshot_begun_during_a_change_is_neither_current_nor_shared() {
        let (db, snapshots) = (db(), Snapshots::default());
        snapshots.change(|| {
            let during = snapshots.get(&db).expect("snapshot");
            assert!(!snapshots.current(&during));
            assert!(snapshots.shared.lock().is_none());
        });
        let after = snapshots.get(&db).expect("snapshot");
        assert!(snapshots.current(&after));
    }

    #[test]
    fn a_change_that_panics_still_settles_the_counter() {
        let (db, snapshots) = (db(), Snapshots::default());
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            snapshots.change(|| panic!("injected"));
        }));
        assert!(caught.is_err());
        let after = snapshots.get(&db).expect("snapshot");
        assert!(snapshots.current(&after));
    }

    #[test]
    fn a_read_sees_a_commit_made_after_its_snapshot_was_shared() {
        let (db, snapshots) = (db(), Snapshots::default());
        let before = snapshots.get(&db).expect("snapshot");
        snapshots.change(|| {
            let txn = db.begin_write().expect("write");
            RecordsMut::open(&txn)
                .expect("tables")
                .put(b"k", b"v")
                .expect("put");
            txn.commit().expect("commit");
        });
        assert!(!snapshots.current(&before));
        let after = snapshots.get(&db).expect("snapshot");
        assert!(after.records.get(b"k").expect("get").is_some());
    }
}
