//! Many threads on one store: racing claims, group commit under load, a batch whose commit
//! fails, and `claim_wait`.

use std::io;
use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Condvar, Mutex};
use std::thread::{self, ThreadId};
use std::time::{Duration, Instant};

use idempotency_store::{
    Claim, Error, Fingerprint, IdempotencyStore, Key, ManualClock, RecordState, Response, Result,
    Store, Timestamp,
};
use redb::backends::FileBackend;
use redb::{BackendError, StorageBackend};

const T0: u64 = 1_700_000_000_000;

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", body])
}

/// A file-backed store whose time stands still (so no lease lapses during a test).
fn open(path: &Path, max_batch: usize) -> Result<Store> {
    Store::builder()
        .clock(ManualClock::new(Timestamp::from_millis(T0)))
        .lease(Duration::from_secs(60))
        .max_batch(max_batch)
        .open(path)
}

fn key(prefix: &str, i: usize) -> Key {
    Key::new(&format!("{prefix}-{i:05}")).expect("valid key")
}

/// Joins a scoped thread, turning a panic into a test failure with a clear message.
fn join<T>(handle: thread::ScopedJoinHandle<'_, T>) -> T {
    match handle.join() {
        Ok(value) => value,
        Err(panic) => std::panic::resume_unwind(panic),
    }
}

// ---------------------------------------------------------------------------------------------
// Reads while overlay generations move into redb
// ---------------------------------------------------------------------------------------------

/// Reads share one redb snapshot until the writer drops an overlay generation that redb has
/// taken (`engine::snapshot`). A read that checked the overlay just after such a drop, with a
/// snapshot from before the flush, would find the key in neither: this test looks up keys the
/// moment they are completed, while 4 writers push 32,000 records through the overlay (about
/// 30 generations, and as many merges of the log) and 4 readers keep looking up the newest
/// acknowledged keys.
#[test]
fn lookups_never_miss_an_acknowledged_key_while_generations_move_into_redb() -> Result<()> {
    const WRITERS: usize = 4;
    const READERS: usize = 4;
    const PER_WRITER: usize = 8_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(&dir.path().join("generations.redb"), 128)?;
    let f = fp("generations");
    // Per writer, how many of its keys are acknowledged so far.
    let acked: Vec<AtomicU64> = (0..WRITERS).map(|_| AtomicU64::new(0)).collect();
    let done = AtomicBool::new(false);
    let lookups = AtomicU64::new(0);
    thread::scope(|s| -> Result<()> {
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (store, acked) = (&store, &acked[w]);
                s.spawn(move || -> Result<()> {
                    for i in 0..PER_WRITER {
                        let key = key(&format!("gen{w}"), i);
                        match store.claim(&key, f)? {
                            Claim::Acquired(lease) => store.complete(&lease, key_response(i))?,
                            other => panic!("fresh key gen{w}-{i} answered {other:?}"),
                        }
                        acked.store(i as u64 + 1, Ordering::SeqCst);
                    }
                    Ok(())
                })
            })
            .collect();
        let readers: Vec<_> = (0..READERS)
            .map(|r| {
                let (store, acked, done, lookups) = (&store, &acked, &done, &lookups);
                s.spawn(move || -> Result<()> {
                    let mut round = r;
                    while !done.load(Ordering::SeqCst) {
                        round += 1;
                        let w = round % WRITERS;
                        let newest = acked[w].load(Ordering::SeqCst) as usize;
                        // The newest few: most likely in the generation being dropped.
                        for i in newest.saturating_sub(1 + round % 8)..newest {
                            match store.lookup(&key(&format!("gen{w}"), i))?.map(|v| v.state) {
                                Some(RecordState::Completed { .. }) => {}
                                other => panic!("acknowledged key gen{w}-{i} read as {other:?}"),
                            }
                            lookups.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for handle in writers {
            join(handle)?;
        }
        done.store(true, Ordering::SeqCst);
        for handle in readers {
            join(handle)?;
        }
        Ok(())
    })?;
    // Each merge, like each flush, ends with the writer dropping what redb took.
    let merges = store.metrics().engine.map_or(0, |e| e.merges);
    assert!(
        merges >= 10,
        "only {merges} merges: the test did not exercise the drops"
    );
    assert!(
        lookups.load(Ordering::Relaxed) > 10_000,
        "too few lookups ran"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Racing claims
// ---------------------------------------------------------------------------------------------

#[test]
fn sixteen_threads_racing_on_each_key_yield_exactly_one_winner() -> Result<()> {
    const THREADS: usize = 16;
    const KEYS: usize = 1_000;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(&dir.path().join("race.redb"), 128)?;
    let f = fp("race");
    let winners: Vec<AtomicU32> = (0..KEYS).map(|_| AtomicU32::new(0)).collect();
    let (acquired, in_progress) = (AtomicU64::new(0), AtomicU64::new(0));
    let barrier = Barrier::new(THREADS);
    let started = Instant::now();
    thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..THREADS)
            .map(|_| {
                s.spawn(|| -> Result<()> {
                    for (k, winner) in winners.iter().enumerate() {
                        let key = key("race", k);
                        // All sixteen threads leave the barrier together and claim this key.
                        barrier.wait();
                        match store.claim(&key, f)? {
                            Claim::Acquired(lease) => {
                                assert_eq!(lease.attempt(), 1);
                                winner.fetch_add(1, Ordering::Relaxed);
                                acquired.fetch_add(1, Ordering::Relaxed);
                            }
                            Claim::InProgress { attempt: 1, .. } => {
                                in_progress.fetch_add(1, Ordering::Relaxed);
                            }
                            other => panic!("key {k}: unexpected {other:?}"),
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(join)
    })?;
    let (acquired, in_progress) = (acquired.into_inner(), in_progress.into_inner());
    println!(
        "{} claims on {KEYS} keys in {:?}: {acquired} acquired, {in_progress} in progress",
        THREADS * KEYS,
        started.elapsed()
    );
    for (k, winner) in winners.iter().enumerate() {
        let n = winner.load(Ordering::Relaxed);
        assert_eq!(n, 1, "key {k} was acquired {n} times");
    }
    assert_eq!(acquired, 1_000, "one Acquired per key");
    assert_eq!(in_progress, 15_000, "every other claim answered InProgress");
    assert_eq!(acquired + in_progress, 16_000);
    assert!(store.verify()?.is_clean());
    Ok(())
}

/// Measured at about 9 s in a debug build on a shared two-core machine, so the full 10,000
/// keys run in debug builds too.
const GROUP_COMMIT_KEYS: usize = 10_000;

fn key_response(k: usize) -> Response {
    Response::new(201, format!(r#"{{"id":"pay_{k}"}}"#)).with_header("x-key", k.to_string())
}

#[test]
fn sixty_four_threads_four_per_key_then_every_key_replays_its_winner() -> Result<()> {
    const GROUPS: usize = 16;
    const PER_KEY: usize = 4;
    let keys = GROUP_COMMIT_KEYS;
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(&dir.path().join("load.redb"), 128)?;
    let f = fp("load");
    let winners: Vec<AtomicU32> = (0..keys).map(|_| AtomicU32::new(0)).collect();
    let (in_progress, replayed) = (AtomicU64::new(0), AtomicU64::new(0));
    let barriers: Vec<Barrier> = (0..GROUPS).map(|_| Barrier::new(PER_KEY)).collect();
    let started = Instant::now();
    // Group g (4 threads) races on keys g, g + 16, g + 32, ...
    thread::scope(|s| -> Result<()> {
        let handles: Vec<_> = (0..GROUPS * PER_KEY)
            .map(|t| {
                let group = t / PER_KEY;
                let (store, winners, barrier) = (&store, &winners, &barriers[group]);
                let (in_progress, replayed) = (&in_progress, &replayed);
                s.spawn(move || -> Result<()> {
                    for k in (group..keys).step_by(GROUPS) {
                        let key = key("load", k);
                        barrier.wait();
                        match store.claim(&key, f)? {
                            Claim::Acquired(lease) => {
                                winners[k].fetch_add(1, Ordering::Relaxed);
                                store.complete(&lease, key_response(k))?;
                            }
                            Claim::InProgress { attempt: 1, .. } => {
                                in_progress.fetch_add(1, Ordering::Relaxed);
                            }
                            // A loser that ran after the winner completed sees the replay.
                            Claim::Completed(replay) => {
                                assert_eq!(replay.response, key_response(k), "key {k}");
                                replayed.fetch_add(1, Ordering::Relaxed);
                            }
                            other => panic!("key {k}: unexpected {other:?}"),
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        handles.into_iter().try_for_each(join)
    })?;
    let racing = started.elapsed();
    for (k, winner) in winners.iter().enumerate() {
        let n = winner.load(Ordering::Relaxed);
        assert_eq!(n, 1, "key {k} was acquired {n} times");
    }
    for k in 0..keys {
        match store.claim(&key("load", k), f)? {
            Claim::Completed(replay) => {
                assert_eq!(
                    replay.response,
                    key_response(k),
                    "key {k} replays its winner"
                );
                assert_eq!(replay.attempt, 1);
            }
            other => panic!("key {k}: expected a replay, got {other:?}"),
        }
    }
    let (in_progress, replayed) = (in_progress.into_inner(), replayed.into_inner());
    println!(
        "{} claims on {keys} keys by 64 threads in {racing:?}: {keys} acquired and completed, \
         {in_progress} in progress, {replayed} replayed; all {keys} replay their winner",
        keys * PER_KEY
    );
    assert_eq!(in_progress + replayed, (keys * (PER_KEY - 1)) as u64);
    let report = store.verify()?;
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.records, keys as u64);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// A batch whose commit fails
// ---------------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------------
// claim_wait
// ---------------------------------------------------------------------------------------------

/// A store, a key already held by the test, and the holder's lease. In memory: waking does not
/// depend on the storage, and no fsync queue on a shared disk blurs the timings.
fn held_key(name: &str) -> Result<(Store, Key, idempotency_store::Lease)> {
    let store = Store::builder()
        .clock(ManualClock::new(Timestamp::from_millis(T0)))
        .lease(Duration::from_secs(60))
        .open_in_memory()?;
    let key = Key::new(name)?;
    let Claim::Acquired(lease) = store.claim(&key, fp(name))? else {
        panic!("fresh key not acquired");
    };
    Ok((store, key, lease))
}

#[test]
fn claim_wait_returns_the_replay_right_after_the_holder_completes() -> Result<()> {
    let (store, key, lease) = held_key("wait-complete")?;
    let f = fp("wait-complete");
    let wakeups = store.wait_wakeups();
    let response = Response::new(201, "done");
    let (claim, returned, called, completed) = thread::scope(|s| -> Result<_> {
        let waiter = s.spawn(|| {
            let claim = store.claim_wait(&key, f, Duration::from_secs(10));
            (claim, Instant::now())
        });
        // Let the waiter block first.
        thread::sleep(Duration::from_millis(200));
        let called = Instant::now();
        store.complete(&lease, response.clone())?;
        let completed = Instant::now();
        let (claim, returned) = join(waiter);
        Ok((claim?, returned, called, completed))
    })?;
    let since_call = returned.duration_since(called);
    let since_return = returned.saturating_duration_since(completed);
    println!(
        "claim_wait returned {since_call:?} after complete() was called \
         ({since_return:?} after it returned; complete() itself took {:?})",
        completed.duration_since(called)
    );
    match claim {
        Claim::Completed(replay) => assert_eq!(replay.response, response),
        other => panic!("expected the replay, got {other:?}"),
    }
    assert!(
        since_call < Duration::from_millis(200),
        "the waiter took {since_call:?} to see the completion"
    );
    assert_eq!(
        store.wait_wakeups(),
        wakeups + 1,
        "the waiter was woken by the completion, not by polling"
    );
    Ok(())
}

#[test]
fn claim_wait_answers_in_progress_after_its_timeout() -> Result<()> {
    let (store, key, lease) = held_key("wait-timeout")?;
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    let claim = store.claim_wait(&key, fp("wait-timeout"), timeout)?;
    let waited = started.elapsed();
    println!("claim_wait with a {timeout:?} timeout returned after {waited:?}");
    match claim {
        Claim::InProgress {
            attempt,
            lease_until,
        } => {
            assert_eq!(attempt, 1);
            assert_eq!(lease_until, lease.lease_until());
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
    assert!(waited >= timeout, "returned early, after {waited:?}");
    assert!(
        waited < timeout + Duration::from_secs(2),
        "overslept: {waited:?}"
    );
    assert_eq!(store.wait_wakeups(), 0, "a timeout is not a wake-up");
    Ok(())
}

#[test]
fn claim_wait_is_not_woken_by_other_keys() -> Result<()> {
    const OTHERS: usize = 20;
    let (store, a, _held) = held_key("wait-a")?;
    let fa = fp("wait-a");
    let fb = fp("wait-b");
    let timeout = Duration::from_secs(2);
    let before = store.wait_wakeups();
    let (claim_a, a_returned, others_done) = thread::scope(|s| -> Result<_> {
        let waiter = s.spawn(|| {
            let claim = store.claim_wait(&a, fa, timeout);
            (claim, Instant::now())
        });
        thread::sleep(Duration::from_millis(100));
        // Settle many other keys while A waits: nobody waits on them, so no wake-up at all.
        for i in 0..OTHERS {
            let b = key("wait-b", i);
            let Claim::Acquired(lease) = store.claim(&b, fb)? else {
                panic!("fresh key not acquired");
            };
            if i % 2 == 0 {
                store.complete(&lease, key_response(i))?;
            } else {
                store.release(&lease)?;
            }
        }
        assert_eq!(
            store.wait_wakeups(),
            before,
            "settling other keys woke a waiter"
        );
        // Control: a waiter on another key is woken by that key's completion, once.
        let control = key("wait-b", OTHERS);
        let Claim::Acquired(lease) = store.claim(&control, fb)? else {
            panic!("fresh key not acquired");
        };
        let control_waiter = {
            let store = &store;
            s.spawn(move || store.claim_wait(&control, fb, timeout))
        };
        thread::sleep(Duration::from_millis(100));
        store.complete(&lease, key_response(OTHERS))?;
        let control_claim = join(control_waiter)?;
        assert!(
            matches!(control_claim, Claim::Completed(_)),
            "control waiter: {control_claim:?}"
        );
        let others_done = Instant::now();
        let (claim_a, a_returned) = join(waiter);
        Ok((claim_a?, a_returned, others_done))
    })?;
    assert!(
        others_done < a_returned,
        "the other keys settled only after A's waiter had timed out; the test proves nothing"
    );
    assert!(
        matches!(claim_a, Claim::InProgress { attempt: 1, .. }),
        "A's waiter got {claim_a:?}"
    );
    assert_eq!(
        store.wait_wakeups(),
        before + 1,
        "only the control waiter was woken, once"
    );
    Ok(())
}

#[test]
fn claim_wait_acquires_when_the_holder_releases() -> Result<()> {
    let (store, key, lease) = held_key("wait-release")?;
    let f = fp("wait-release");
    let wakeups = store.wait_wakeups();
    let (claim, since_release) = thread::scope(|s| -> Result<_> {
        let waiter = s.spawn(|| {
            let claim = store.claim_wait(&key, f, Duration::from_secs(10));
            (claim, Instant::now())
        });
        thread::sleep(Duration::from_millis(100));
        let called = Instant::now();
        store.release(&lease)?;
        let (claim, returned) = join(waiter);
        Ok((claim?, returned.duration_since(called)))
    })?;
    println!("claim_wait acquired {since_release:?} after release() was called");
    match claim {
        Claim::Acquired(new) => {
            assert_eq!(new.attempt(), 1, "a released key is claimed afresh");
            assert!(new.token() > lease.token());
        }
        other => panic!("expected Acquired, got {other:?}"),
    }
    assert!(
        since_release < Duration::from_millis(200),
        "took {since_release:?}"
    );
    assert_eq!(store.wait_wakeups(), wakeups + 1);
    Ok(())
}
