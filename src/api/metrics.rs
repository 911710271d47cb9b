//! What a store has done since it was opened: lock-free counters kept at the call sites, and the
//! snapshot [`Metrics`] that `IdempotencyStore::metrics` returns on both backends. Both count
//! the same calls under the same names, so dashboards work on either.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant, SystemTime};

use crate::api::outcome::Claim;
use crate::api::publish;
use crate::api::series::{CallSeries, ERROR_KINDS, Series};
use crate::api::trace;
use crate::error::{Error, Result};

/// Upper bounds of the latency buckets, in microseconds: powers of two from 1 µs to about
/// 16.8 s, then one open bucket for anything slower.
pub const LATENCY_BUCKETS_US: [u64; 25] = {
    let mut bounds = [0u64; 25];
    let mut i = 0;
    while i < 25 {
        bounds[i] = 1 << i;
        i += 1;
    }
    bounds
};

/// A snapshot of a store's counters since it was opened. Cheap: it reads atomics and walks no
/// table (for counts by state use `stats()`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Metrics {
    /// The backend: `"redb"` or `"postgres"`.
    pub backend: &'static str,
    /// Claims by outcome.
    pub claims: ClaimCounts,
    /// Completions that stored a response.
    pub completes: u64,
    /// Releases that deleted a record.
    pub releases: u64,
    /// Heartbeats that extended a lease.
    pub heartbeats: u64,
    /// Settling calls (complete, release, heartbeat, checkpoint) refused with
    /// [`Error::LeaseLost`]: the worker was too slow for its lease, or was taken over.
    pub lease_lost: u64,
    /// Claims refused with [`Error::QuotaExceeded`].
    pub quota_refusals: u64,
    /// Times a `claim_wait` caller blocked, waiting for another attempt to settle or lapse.
    pub waits: u64,
    /// `claim_wait` calls that gave up waiting and returned the in-progress answer.
    pub wait_timeouts: u64,
    /// Expired records deleted by sweeps.
    pub swept: u64,
    /// Errors returned by the store's calls, by kind.
    pub errors: ErrorCounts,
    /// How long claims took (every outcome, errors included).
    pub claim_latency: Latency,
    /// How long completions took (every outcome, errors included).
    pub complete_latency: Latency,
    /// The redb store's engine: batches, log, merges, overlay, sweeper. `None` on PostgreSQL.
    pub engine: Option<EngineMetrics>,
    /// PostgreSQL: whether acknowledged commits survive a failover of the server, as last
    /// checked (no I/O here). `None` on the redb store.
    pub failover: Option<crate::api::report::FailoverStatus>,
}

/// Claims by outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClaimCounts {
    /// Acquired a key with no live record (attempt 1).
    pub acquired: u64,
    /// Acquired by taking over a lapsed lease (attempt 2 or later).
    pub taken_over: u64,
    /// Answered [`Claim::InProgress`].
    pub in_progress: u64,
    /// Answered [`Claim::Completed`]: a replay.
    pub replayed: u64,
    /// Answered [`Claim::Mismatch`]: the key was reused for another request.
    pub mismatch: u64,
}

/// Errors by kind (the variant of [`Error`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ErrorCounts {
    /// [`Error::InvalidKey`].
    pub invalid_key: u64,
    /// [`Error::ResponseTooLarge`].
    pub response_too_large: u64,
    /// [`Error::LeaseLost`].
    pub lease_lost: u64,
    /// [`Error::QuotaExceeded`].
    pub quota_exceeded: u64,
    /// [`Error::Corrupted`].
    pub corrupted: u64,
    /// [`Error::Storage`].
    pub storage: u64,
    /// Any other kind.
    pub other: u64,
}

/// A latency histogram with fixed log-scale buckets ([`LATENCY_BUCKETS_US`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Latency {
    /// Calls counted.
    pub count: u64,
    /// Their total time, in microseconds.
    pub sum_us: u64,
    /// Calls per bucket: `buckets[i]` counts calls of at most `LATENCY_BUCKETS_US[i]` µs (and
    /// more than the bound before); the last entry counts the slower ones.
    pub buckets: Vec<u64>,
}

/// The redb store's engine counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct EngineMetrics {
    /// Group-commit batches committed.
    pub batches: u64,
    /// Write calls in those batches (`batched_ops / batches` is the mean batch size).
    pub batched_ops: u64,
    /// The largest batch, in write calls.
    pub max_batch: u64,
    /// Entries appended to the write-ahead log.
    pub log_writes: u64,
    /// Merges: the log's changes committed durably into the database.
    pub merges: u64,
    /// How long the last merge took.
    pub last_merge: Duration,
    /// How long the slowest merge took.
    pub max_merge: Duration,
    /// Records logged but not yet merged (readers look there first).
    pub overlay_records: u64,
    /// Their size, in bytes.
    pub overlay_bytes: u64,
    /// The store file's size, in bytes (`None` in memory).
    pub file_bytes: Option<u64>,
    /// Time spent in sweep calls (every kind: `sweep`, `sweep_all`, the background sweeper),
    /// pacing included; the records they deleted are [`Metrics::swept`].
    pub sweep_time: Duration,
    /// Of that, the time sweeps waited for the flush thread to take the overlay into the
    /// database, so that deletions do not pile up faster than it writes them.
    pub sweep_paced: Duration,
    /// Write calls whose batch also carried a sweep's deletions: the claims (and other calls)
    /// a sweep may have delayed, each by the time its deletions took to apply.
    pub sweep_shared_calls: u64,
    /// When the background sweeper last finished a round (`None`: it never did).
    pub sweeper_last_run: Option<SystemTime>,
    /// The error of the background sweeper's last failed round, if one failed. A failed round
    /// does not stop the sweeper: it retries after a backoff. A later round that succeeds
    /// leaves this as it was; `sweeper_last_run` tells when one last did.
    pub sweeper_last_error: Option<String>,
}

/// The settling calls, for [`Meter::settled`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Call {
    Complete,
    Release,
    Heartbeat,
    Checkpoint,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::Complete => "complete",
            Call::Release => "release",
            Call::Heartbeat => "heartbeat",
            Call::Checkpoint => "checkpoint",
        }
    }
}

/// A histogram kept in atomics.
#[derive(Debug)]
struct Buckets {
    counts: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
}

impl Default for Buckets {
    fn default() -> Self {
        Buckets {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_us: AtomicU64::new(0),
        }
    }
}

impl Buckets {
    fn record(&self, elapsed: Duration) {
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        let index = LATENCY_BUCKETS_US.partition_point(|&bound| bound < us);
        if let Some(count) = self.counts.get(index) {
            count.fetch_add(1, Relaxed);
        }
        self.sum_us.fetch_add(us, Relaxed);
    }

    /// The histograms of `stripes`, added up.
    fn sum<'a>(stripes: impl Iterator<Item = &'a Buckets>) -> Latency {
        let mut buckets = vec![0u64; LATENCY_BUCKETS_US.len() + 1];
        let mut sum_us = 0u64;
        for stripe in stripes {
            for (total, count) in buckets.iter_mut().zip(&stripe.counts) {
                *total += count.load(Relaxed);
            }
            sum_us = sum_us.wrapping_add(stripe.sum_us.load(Relaxed));
        }
        Latency {
            count: buckets.iter().sum(),
            sum_us,
            buckets,
        }
    }
}

/// What one store counts of its calls, for [`IdempotencyStore::metrics`]: every update is one
/// relaxed atomic add (and, with feature `metrics`, the same count published through the
/// facade), on the calling thread's stripe. Each backend of this crate owns one and hands it
/// out through [`Backend::meter`]; the counting itself is done once for every backend, by
/// [`IdempotencyStore`]'s calls. It has no public constructor: a [`Backend`] outside this
/// crate wraps one of this crate's stores and hands out that store's meter.
///
/// [`IdempotencyStore`]: crate::IdempotencyStore
/// [`IdempotencyStore::metrics`]: crate::IdempotencyStore::metrics
/// [`Backend`]: crate::backend::Backend
/// [`Backend::meter`]: crate::backend::Backend::meter
#[derive(Debug)]
pub struct Meter {
    series: &'static CallSeries,
    show_keys: bool,
    /// The same counters several times over, each on cache lines of its own; a thread adds to
    /// one, a snapshot sums them. One set shared by all made every claim on one core take the
    /// lines from the other (BENCHMARKS.md, "Figures behind the defaults").
    stripes: Box<[Cells]>,
}

/// How many stripes: a few per core of a usual server, so that threads rarely share one.
const STRIPES: usize = 16;

/// The stripe this thread adds to: threads take stripes in turn as they first count.
fn stripe_index() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static MINE: usize = NEXT.fetch_add(1, Relaxed) % STRIPES;
    }
    MINE.with(|mine| *mine)
}

/// One stripe of the counters.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Cells {
    acquired: AtomicU64,
    taken_over: AtomicU64,
    in_progress: AtomicU64,
    replayed: AtomicU64,
    mismatch: AtomicU64,
    completes: AtomicU64,
    releases: AtomicU64,
    heartbeats: AtomicU64,
    lease_lost: AtomicU64,
    quota_refusals: AtomicU64,
    waits: AtomicU64,
    wait_timeouts: AtomicU64,
    swept: AtomicU64,
    errors: [AtomicU64; ERROR_KINDS],
    claim_latency: Buckets,
    complete_latency: Buckets,
}

impl Meter {
    /// Zeroed counters for the backend whose calls `series` names; `show_keys`: whether its
    /// `tracing` events may show keys.
    pub(crate) fn new(series: &'static CallSeries, show_keys: bool) -> Meter {
        Meter {
            series,
            show_keys,
            stripes: (0..STRIPES).map(|_| Cells::default()).collect(),
        }
    }

    /// The calling thread's stripe.
    fn cells(&self) -> &Cells {
        // The index is below STRIPES, the stripes' count.
        &self.stripes[stripe_index()]
    }

    /// Adds one to `counter`, and to the published counter `series`.
    fn bump(counter: &AtomicU64, series: &Series) {
        counter.fetch_add(1, Relaxed);
        publish::count(series, 1);
    }

    /// Counts a claim's outcome and time.
    pub(crate) fn claimed(&self, result: &Result<Claim>, started: Instant) {
        let elapsed = started.elapsed();
        let cells = self.cells();
        cells.claim_latency.record(elapsed);
        let series = self.series;
        publish::time(&series.claim_seconds, elapsed);
        let (counter, published) = match result {
            Ok(Claim::Acquired(lease)) if lease.attempt > 1 => {
                trace::taken_over(series.backend, &lease.key, lease.attempt, self.show_keys);
                (&cells.taken_over, &series.taken_over)
            }
            Ok(Claim::Acquired(_)) => (&cells.acquired, &series.acquired),
            Ok(Claim::InProgress { .. }) => (&cells.in_progress, &series.in_progress),
            Ok(Claim::Completed(_)) => (&cells.replayed, &series.replayed),
            Ok(Claim::Mismatch { .. }) => (&cells.mismatch, &series.mismatch),
            Err(err) => {
                if matches!(err, Error::QuotaExceeded { .. }) {
                    trace::quota_refused(series.backend);
                    Self::bump(&cells.quota_refusals, &series.quota_refusals);
                }
                return self.failed(err);
            }
        };
        Self::bump(counter, published);
    }

    /// Counts a settling call's outcome (and a completion's time).
    pub(crate) fn settled<T>(&self, call: Call, result: &Result<T>, started: Instant) {
        let (series, cells) = (self.series, self.cells());
        let done = match call {
            Call::Complete => {
                let elapsed = started.elapsed();
                cells.complete_latency.record(elapsed);
                publish::time(&series.complete_seconds, elapsed);
                Some((&cells.completes, &series.completes))
            }
            Call::Release => Some((&cells.releases, &series.releases)),
            Call::Heartbeat => Some((&cells.heartbeats, &series.heartbeats)),
            Call::Checkpoint => None,
        };
        match (result, done) {
            (Ok(_), Some((counter, published))) => Self::bump(counter, published),
            (Ok(_), None) => {}
            (Err(err), _) => {
                if matches!(err, Error::LeaseLost) {
                    trace::lease_lost(series.backend, call.name());
                    Self::bump(&cells.lease_lost, &series.lease_lost);
                }
                self.failed(err);
            }
        }
    }

    /// Counts an error by kind.
    pub(crate) fn failed(&self, err: &Error) {
        let kind = match err {
            Error::InvalidKey { .. } => 0,
            Error::ResponseTooLarge { .. } => 1,
            Error::LeaseLost => 2,
            Error::QuotaExceeded { .. } => 3,
            Error::Corrupted { .. } => 4,
            Error::Storage { .. } => 5,
            _ => 6,
        };
        if let (Some(counter), Some(published)) =
            (self.cells().errors.get(kind), self.series.errors.get(kind))
        {
            Self::bump(counter, published);
        }
    }

    /// Counts records deleted by a sweep.
    pub(crate) fn swept(&self, records: u64) {
        self.cells().swept.fetch_add(records, Relaxed);
        publish::count(&self.series.swept, records);
    }

    /// Counts a `claim_wait` caller blocking (`false`), or giving up at its timeout (`true`).
    pub(crate) fn waited(&self, timed_out: bool) {
        if timed_out {
            Self::bump(&self.cells().wait_timeouts, &self.series.wait_timeouts);
        } else {
            Self::bump(&self.cells().waits, &self.series.waits);
        }
    }

    /// The name of the backend these counters belong to (`redb`, `postgres`).
    pub(crate) fn backend(&self) -> &'static str {
        self.series.backend
    }

    /// The counters now: every stripe's, summed.
    pub(crate) fn snapshot(&self) -> Metrics {
        let sum = |field: fn(&Cells) -> &AtomicU64| -> u64 {
            self.stripes.iter().map(|c| field(c).load(Relaxed)).sum()
        };
        let e = |i: usize| -> u64 {
            self.stripes
                .iter()
                .filter_map(|c| c.errors.get(i))
                .map(|c| c.load(Relaxed))
                .sum()
        };
        Metrics {
            backend: self.series.backend,
            claims: ClaimCounts {
                acquired: sum(|c| &c.acquired),
                taken_over: sum(|c| &c.taken_over),
                in_progress: sum(|c| &c.in_progress),
                replayed: sum(|c| &c.replayed),
                mismatch: sum(|c| &c.mismatch),
            },
            completes: sum(|c| &c.completes),
            releases: sum(|c| &c.releases),
            heartbeats: sum(|c| &c.heartbeats),
            lease_lost: sum(|c| &c.lease_lost),
            quota_refusals: sum(|c| &c.quota_refusals),
            waits: sum(|c| &c.waits),
            wait_timeouts: sum(|c| &c.wait_timeouts),
            swept: sum(|c| &c.swept),
            errors: ErrorCounts {
                invalid_key: e(0),
                response_too_large: e(1),
                lease_lost: e(2),
                quota_exceeded: e(3),
                corrupted: e(4),
                storage: e(5),
                other: e(6),
            },
            claim_latency: Buckets::sum(self.stripes.iter().map(|c| &c.claim_latency)),
            complete_latency: Buckets::sum(self.stripes.iter().map(|c| &c.complete_latency)),
            engine: None,
            failover: None,
        }
    }
}

#[cfg(all(test, feature = "metrics"))]
mod tests {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    use super::*;
    use crate::api::series::REDB;

    #[test]
    fn each_error_is_counted_and_published_under_its_kind() {
        let errors = [
            Error::invalid_key("empty"),
            Error::ResponseTooLarge { size: 2, limit: 1 },
            Error::LeaseLost,
            Error::QuotaExceeded {
                limit: "max_records",
                used: 1,
                max: 1,
            },
            Error::corrupted("bad page"),
            Error::storage("reading", std::io::Error::other("disk")),
            Error::Reentrant,
        ];
        let counters = Meter::new(&REDB, false);
        let recorder = DebuggingRecorder::new();
        metrics::with_local_recorder(&recorder, || {
            for (times, err) in (1..).zip(&errors) {
                for _ in 0..times {
                    counters.failed(err);
                }
            }
        });
        let counted = counters.snapshot().errors;
        let fields = [
            counted.invalid_key,
            counted.response_too_large,
            counted.lease_lost,
            counted.quota_exceeded,
            counted.corrupted,
            counted.storage,
            counted.other,
        ];
        assert_eq!(fields, [1, 2, 3, 4, 5, 6, 7]);
        let mut published: Vec<(String, u64)> = recorder
            .snapshotter()
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let key = key.key();
                assert_eq!(key.name(), "idempotency_errors_total");
                let kind = key
                    .labels()
                    .find(|l| l.key() == "kind")
                    .map(|l| l.value().to_owned());
                let DebugValue::Counter(count) = value else {
                    panic!("{key:?} is not a counter")
                };
                (kind.unwrap_or_default(), count)
            })
            .collect();
        published.sort_by_key(|&(_, count)| count);
        let kinds: Vec<(&str, u64)> = published.iter().map(|(k, n)| (k.as_str(), *n)).collect();
        assert_eq!(
            kinds,
            [
                ("invalid_key", 1),
                ("response_too_large", 2),
                ("lease_lost", 3),
                ("quota_exceeded", 4),
                ("corrupted", 5),
                ("storage", 6),
                ("other", 7),
            ]
        );
    }
}
