//! A batch whose commit fails: every caller of the batch gets the error and nothing of it
//! stays behind.

use std::io;
use std::ops::Bound;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use idempotency_store::{
    Claim, Error, IdempotencyStore, ManualClock, RecordState, Result, Store, Timestamp,
};
use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};

use super::{T0, fp, join, key, key_response};

/// The longest a stalled commit is held (a safety net: the test releases it well before).
const STALL_LIMIT: Duration = Duration::from_secs(10);

/// Switches shared by the test and its [`FaultyBackend`].
#[derive(Debug, Default)]
struct Faults {
    /// While set, `write`, `set_len` and `sync_data` fail (except on the exempt thread).
    fail: AtomicBool,
    exempt: Mutex<Option<ThreadId>>,
    /// Injected failures so far.
    injected: AtomicU64,
    stall: Mutex<Stall>,
    stall_changed: Condvar,
}

#[derive(Debug, Default)]
struct Stall {
    /// The next `sync_data` blocks until released.
    armed: bool,
    /// A `sync_data` is blocked now.
    holding: bool,
}

impl Faults {
    fn check(&self, what: &str) -> io::Result<()> {
        let exempt = *self.exempt.lock().expect("lock") == Some(thread::current().id());
        if self.fail.load(Ordering::SeqCst) && !exempt {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(io::Error::other(format!("injected failure in {what}")));
        }
        Ok(())
    }

    fn stall_if_armed(&self) {
        let mut stall = self.stall.lock().expect("lock");
        if !stall.armed {
            return;
        }
        stall.armed = false;
        stall.holding = true;
        self.stall_changed.notify_all();
        // Bounded, so that a failing test cannot hang on a stalled commit.
        let deadline = Instant::now() + STALL_LIMIT;
        while stall.holding && Instant::now() < deadline {
            stall = self
                .stall_changed
                .wait_timeout(stall, STALL_LIMIT)
                .expect("lock")
                .0;
        }
    }

    /// Waits until a `sync_data` is stalled; false if `gave_up()` says to stop waiting first.
    fn wait_until_stalled(&self, gave_up: impl Fn() -> bool) -> bool {
        let mut stall = self.stall.lock().expect("lock");
        let deadline = Instant::now() + STALL_LIMIT;
        while !stall.holding {
            if gave_up() || Instant::now() >= deadline {
                return false;
            }
            stall = self
                .stall_changed
                .wait_timeout(stall, Duration::from_millis(10))
                .expect("lock")
                .0;
        }
        true
    }

    fn release_stall(&self) {
        self.stall.lock().expect("lock").holding = false;
        self.stall_changed.notify_all();
    }
}

/// redb's file backend with injectable write/sync failures and one injectable stall.
#[derive(Debug)]
struct FaultyBackend {
    inner: FileBackend,
    faults: Arc<Faults>,
}

impl StorageBackend for FaultyBackend {
    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> io::Result<()> {
        self.inner.read(offset, out)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.faults.check("set_len")?;
        self.inner.set_len(len)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.faults.check("sync_data")?;
        self.faults.stall_if_armed();
        self.inner.sync_data()
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.faults.check("write")?;
        self.inner.write(offset, data)
    }

    fn close(&self) -> io::Result<()> {
        self.inner.close()
    }

    fn try_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<bool, BackendError> {
        self.inner.try_lock_range(start, end)
    }

    fn try_lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<bool, BackendError> {
        self.inner.try_lock_shared_range(start, end)
    }

    fn lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<(), BackendError> {
        self.inner.lock_range(start, end)
    }

    fn lock_shared_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<(), BackendError> {
        self.inner.lock_shared_range(start, end)
    }

    fn unlock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<(), BackendError> {
        self.inner.unlock_range(start, end)
    }

    fn query_lock_range(
        &self,
        start: Bound<u64>,
        end: Bound<u64>,
    ) -> std::result::Result<bool, BackendError> {
        self.inner.query_lock_range(start, end)
    }
}

#[test]
fn a_failed_batch_commit_fails_every_caller_and_leaves_nothing_behind() -> Result<()> {
    const LOSERS: usize = 16;
    const ACKED: usize = 10;
    /// Keys held in progress before the failure, settled (or extended) in the failed batch.
    const PENDING: usize = 4;
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("faulty.redb");
    let faults = Arc::new(Faults::default());
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .expect("open the store file");
    let backend = FaultyBackend {
        inner: FileBackend::new(file).expect("file backend"),
        faults: Arc::clone(&faults),
    };
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let mut builder = Store::builder();
    builder.clock(clock.clone()).max_batch(64);
    let store = builder.open_with_backend(backend)?;
    let f = fp("faulty");

    // Acknowledged before the failure: these must survive it.
    for i in 0..ACKED {
        let Claim::Acquired(lease) = store.claim(&key("acked", i), f)? else {
            panic!("fresh key not acquired");
        };
        store.complete(&lease, key_response(i))?;
    }
    let mut pending = Vec::new();
    for i in 0..PENDING {
        let Claim::Acquired(lease) = store.claim(&key("pending", i), f)? else {
            panic!("fresh key not acquired");
        };
        pending.push(lease);
    }
    let pending_before = (0..PENDING)
        .map(|i| store.lookup(&key("pending", i)))
        .collect::<Result<Vec<_>>>()?;
    // The failed batch's heartbeat would move the pending lease's deadline.
    clock.advance(Duration::from_secs(1));

    let barrier = Barrier::new(LOSERS + PENDING);
    let (holder, results) = thread::scope(|s| {
        // 1. A lone claim becomes the group-commit leader and stalls inside its commit's sync,
        //    holding the leadership. Its thread is exempt from the failures to come.
        faults.stall.lock().expect("lock").armed = true;
        let holder = s.spawn(|| {
            *faults.exempt.lock().expect("lock") = Some(thread::current().id());
            store.claim(&key("holder", 0), f)
        });
        if !faults.wait_until_stalled(|| holder.is_finished()) {
            let stalled = faults.stall.lock().expect("lock").holding;
            let finished = holder.is_finished();
            let result = finished.then(|| join(holder));
            panic!(
                "the lone claim's commit did not stall in sync_data (stalled now: {stalled}, \
                 claim finished: {finished}, result: {result:?})"
            );
        }
        // 2. Twenty callers queue behind it and will share the next batch: sixteen claims of
        //    fresh keys, two completions, a release and a heartbeat of the pending keys.
        let mut losers: Vec<_> = (0..LOSERS)
            .map(|i| {
                let (store, barrier) = (&store, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    store.claim(&key("lost", i), f).map(drop)
                })
            })
            .collect();
        for (i, mut lease) in pending.into_iter().enumerate() {
            let (store, barrier) = (&store, &barrier);
            losers.push(s.spawn(move || {
                barrier.wait();
                match i {
                    0 | 1 => store.complete(&lease, key_response(i)),
                    2 => store.release(&lease),
                    _ => store.heartbeat(&mut lease).map(drop),
                }
            }));
        }
        thread::sleep(Duration::from_millis(300));
        // 3. The disk starts failing; the stalled commit finishes; the next batch (the twenty
        //    queued calls, within max_batch) fails in its commit.
        faults.fail.store(true, Ordering::SeqCst);
        faults.release_stall();
        let results: Vec<Result<()>> = losers.into_iter().map(join).collect();
        (join(holder), results)
    });
    assert!(
        matches!(holder, Ok(Claim::Acquired(_))),
        "the commit before the failure succeeds: {holder:?}"
    );
    assert!(
        faults.injected.load(Ordering::SeqCst) > 0,
        "no failure was injected"
    );
    for (i, result) in results.iter().enumerate() {
        assert!(
            matches!(result, Err(Error::Storage { .. })),
            "caller {i} of the failed batch got {result:?}"
        );
    }
    println!(
        "{} callers of a failed batch all got Error::Storage ({} injected I/O failures)",
        results.len(),
        faults.injected.load(Ordering::SeqCst)
    );

    // The failed batch never reached the tables: its keys are invisible in this process too.
    for i in 0..LOSERS {
        assert_eq!(store.lookup(&key("lost", i))?, None, "lost-{i} visible");
    }
    // An I/O error that is not a full disk may have lost data (a failed sync may have dropped
    // pages): the store is poisoned and refuses writes even once the disk is healthy again,
    // until it is reopened.
    faults.fail.store(false, Ordering::SeqCst);
    let refused = store.claim(&key("after", 0), f);
    assert!(
        matches!(refused, Err(Error::Poisoned { .. })),
        "a write after the failure, before a reopen: {refused:?}"
    );
    drop(store);

    // Reopen the same file on a plain backend: writes work again, nothing of the failed batch
    // is there, and everything acknowledged is.
    let store = builder.open(&path)?;
    let after = store.claim(&key("after", 0), f);
    assert!(
        matches!(after, Ok(Claim::Acquired(_))),
        "a write once the store is reopened: {after:?}"
    );
    for i in 0..LOSERS {
        assert_eq!(
            store.lookup(&key("lost", i))?,
            None,
            "key lost-{i} of the failed batch is visible"
        );
    }
    for i in 0..ACKED {
        match store.lookup(&key("acked", i))?.map(|v| v.state) {
            Some(RecordState::Completed { response, .. }) => {
                assert_eq!(response, key_response(i));
            }
            other => panic!("acknowledged key acked-{i} lost: {other:?}"),
        }
    }
    assert!(
        matches!(
            store.lookup(&key("holder", 0))?.map(|v| v.state),
            Some(RecordState::InProgress { .. })
        ),
        "the acknowledged claim before the failure is in progress"
    );
    for (i, before) in pending_before.iter().enumerate() {
        assert_eq!(
            &store.lookup(&key("pending", i))?,
            before,
            "pending-{i} was changed by the failed batch"
        );
    }
    let report = store.verify()?;
    assert!(report.is_clean(), "{:?}", report.problems);
    // The acknowledged keys, the pending ones, the holder's and the claim after the failure.
    assert_eq!(report.records, (ACKED + PENDING + 2) as u64);
    assert!(
        store.lookup(&key("after", 0))?.is_some(),
        "the claim after the failure is lost"
    );
    // The failed batch's keys are free again.
    for i in 0..LOSERS {
        assert!(matches!(
            store.claim(&key("lost", i), f)?,
            Claim::Acquired(lease) if lease.attempt() == 1
        ));
    }
    Ok(())
}
