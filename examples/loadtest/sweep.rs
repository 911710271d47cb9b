//! `--sweep`: claim latency while `sweep_all` deletes a million expired records.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Key, ManualClock, Store, Timestamp};
use serde_json::Value;

use crate::Res;
use crate::args::Args;
use crate::run::{machine_json, verdict};
use crate::store::prefill_store;
use crate::tools::{
    Lat, Out, Report, err, filesystem_of, fingerprint_of, fresh_dir, key_name, lat_json, num, obj,
    opt, percentiles,
};

/// Fresh-key claims from this thread until `stop` says so (or `max` passes); latencies in ns.
pub(crate) fn claim_loop(
    store: &dyn IdempotencyStore,
    stream: u64,
    stop: &dyn Fn(Instant) -> bool,
) -> Res<(Vec<u64>, Duration)> {
    let mut lat = Vec::new();
    let mut i = 0;
    let started = Instant::now();
    loop {
        let t0 = Instant::now();
        if stop(t0) {
            return Ok((lat, started.elapsed()));
        }
        i += 1;
        let name = key_name(stream, i);
        let key = Key::new(&name).map_err(|e| err("key", e))?;
        match store.claim(&key, fingerprint_of(&name)) {
            Ok(Claim::Acquired(_lease)) => {}
            Ok(other) => return Err(format!("fresh key not acquired: {other:?}")),
            Err(e) => return Err(err("claim", e)),
        }
        lat.push(t0.elapsed().as_nanos() as u64);
    }
}

/// `sweep_all` with another batch size: `sweep(batch)` until a batch comes back short.
pub(crate) fn sweep_in(store: &Store, batch: usize) -> idempotency_store::Result<u64> {
    let mut total = 0;
    loop {
        let n = store.sweep(batch)?;
        total += n as u64;
        if n < batch {
            return Ok(total);
        }
    }
}

/// Fills `store` with `--records` completed records (the clock running 1 ms per 32 with
/// `--sweep-spread`), then moves `clock` past their retention; returns the prefill's time.
pub(crate) fn prefill_expired(
    store: &dyn IdempotencyStore,
    clock: &ManualClock,
    retention: Duration,
    args: &Args,
    out: &Out,
) -> Res<Duration> {
    let n = args.records;
    let name = |i| {
        if args.sweep_spread && i % 32 == 0 {
            clock.advance(Duration::from_millis(1));
        }
        key_name(1, i)
    };
    let prefill = prefill_store(store, n, args.prefill_threads, &name, out)?;
    out.line(format!(
        "prefilled {n} completed records in {:.1} s ({:.0} pairs/s, {} threads)",
        prefill.as_secs_f64(),
        n as f64 / prefill.as_secs_f64(),
        args.prefill_threads
    ));
    clock.advance(retention + Duration::from_secs(1));
    Ok(prefill)
}

/// The background sweeper's first round, started as docs/operations.md starts it: the records
/// it deleted once `metrics()` shows the round finished.
fn first_round(store: &Arc<Store>) -> idempotency_store::Result<u64> {
    let sweeper = store.start_sweeper(Duration::from_secs(60), 1024);
    let ran = || store.metrics().engine.and_then(|e| e.sweeper_last_run);
    while ran().is_none() && sweeper.last_error().is_none() {
        thread::sleep(Duration::from_millis(5));
    }
    sweeper.stop()
}

/// The store file's length in bytes (0 if it cannot be read).
fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

pub(crate) fn sweep_run(args: &Args, out: &Out, base: PathBuf) -> Res<Value> {
    if args.only.iter().any(|name| name == "postgres") {
        return crate::sweep_pg::sweep_pg_run(args, out);
    }
    let fs = filesystem_of(&base);
    let n = args.records;
    out.line(format!(
        "sweep: {n} expired records, claim p99 without and during sweep_all; dir {} on {fs}",
        base.display()
    ));
    let dir = fresh_dir(&base, "sweep")?;
    let retention = Duration::from_secs(3600);
    let clock = ManualClock::new(Timestamp::from_millis(1_800_000_000_000));
    let mut builder = Store::builder();
    builder.clock(clock.clone()).retention(retention);
    if let Some(bytes) = args.log_size {
        builder.log_size(bytes);
    }
    let store = Arc::new(
        builder
            .open(dir.path().join("store.redb"))
            .map_err(|e| err("open", e))?,
    );
    let prefill = prefill_expired(&*store, &clock, retention, args, out)?;
    let file = dir.path().join("store.redb");
    let file_before = file_len(&file);

    let window = Duration::from_secs_f64(args.seconds);
    // Warm-up, then the baseline.
    let warm_end = Instant::now() + Duration::from_millis(300);
    claim_loop(&store, 2, &|t| t >= warm_end)?;
    let base_end = Instant::now() + window;
    let (base_lat, _) = claim_loop(&store, 3, &|t| t >= base_end)?;
    let base_n = base_lat.len();
    let baseline = percentiles(base_lat);

    let merges_before = store.metrics().engine.map_or(0, |e| e.merges);
    let done = AtomicBool::new(false);
    let (sweep_result, during) = thread::scope(|s| {
        let sweeper = s.spawn(|| {
            let t0 = Instant::now();
            let r = match args.sweep_batch {
                _ if args.sweeper => first_round(&store),
                None => store.sweep_all(),
                Some(batch) => sweep_in(&store, batch),
            };
            done.store(true, Ordering::SeqCst);
            (r, t0.elapsed())
        });
        // Measure while the sweep runs (at most 3 windows, so a stuck sweep cannot hang us).
        let cap = Instant::now() + window * 3;
        let during = claim_loop(&store, 4, &|t| done.load(Ordering::SeqCst) || t >= cap);
        let sweep = sweeper.join().map_err(|_| "sweeper panicked".to_owned());
        (sweep, during)
    });
    let (sweep_result, sweep_time) = sweep_result?;
    let swept = sweep_result.map_err(|e| err("sweep_all", e))?;
    let (during_lat, during_time) = during?;
    let during_n = during_lat.len();
    let during = percentiles(during_lat);
    let rate_ratio = (base_n as f64 / window.as_secs_f64()).gt(&0.0).then(|| {
        (during_n as f64 / during_time.as_secs_f64().max(1e-9))
            / (base_n as f64 / window.as_secs_f64())
    });
    let file_after = file_len(&file);
    let metrics = store.metrics();
    if let Some(e) = metrics.engine {
        out.line(format!(
            "engine: {} swept in {:.2} s ({:.2} s paced), {} calls shared a batch with a sweep, \
             {} merges during it (slowest of the run {:.0} ms), {} batches",
            metrics.swept,
            e.sweep_time.as_secs_f64(),
            e.sweep_paced.as_secs_f64(),
            e.sweep_shared_calls,
            e.merges - merges_before,
            e.max_merge.as_secs_f64() * 1e3,
            e.batches
        ));
    }
    let refill = if args.sweep_refill {
        let fresh = |i| key_name(5, i);
        prefill_store(&*store, n, args.prefill_threads, &fresh, out)?;
        Some(file_len(&file))
    } else {
        None
    };
    let p99_ratio = match (baseline, during) {
        (Some(a), Some(b)) if a.p99_us > 0.0 => Some(b.p99_us / a.p99_us),
        _ => None,
    };
    let pass = p99_ratio.is_some_and(|r| r <= 3.0);
    let show = |l: Option<Lat>| {
        l.map_or_else(
            || "-".into(),
            |l| {
                format!(
                    "p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs ({} claims)",
                    l.p50_us, l.p99_us, l.max_us, l.n
                )
            },
        )
    };
    out.line(format!(
        "claims without sweep:  {} ({:.0}/s)",
        show(baseline),
        base_n as f64 / window.as_secs_f64()
    ));
    out.line(format!(
        "claims during sweep:   {} ({:.0}/s over {:.2} s)",
        show(during),
        during_n as f64 / during_time.as_secs_f64().max(1e-9),
        during_time.as_secs_f64()
    ));
    out.line(format!(
        "{} deleted {swept} in {:.2} s ({:.0}/s)",
        args.sweep_batch
            .map_or_else(|| "sweep_all".to_owned(), |b| format!("sweep({b}) loop")),
        sweep_time.as_secs_f64(),
        swept as f64 / sweep_time.as_secs_f64().max(1e-9)
    ));
    out.line(format!(
        "target: p99 during sweep / p99 without <= 3.0: {} {}",
        p99_ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}")),
        verdict(p99_ratio, pass)
    ));
    out.line(format!(
        "target: claims/s during sweep / without >= 0.5: {} {}",
        rate_ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}")),
        verdict(rate_ratio, rate_ratio.is_some_and(|r| r >= 0.5))
    ));
    let mib = |b: u64| b as f64 / f64::from(1 << 20);
    out.line(format!(
        "file: {:.1} MiB before the sweep, {:.1} MiB after{}",
        mib(file_before),
        mib(file_after),
        refill.map_or_else(String::new, |b| format!(
            ", {:.1} MiB after {n} new records",
            mib(b)
        ))
    ));
    let mut j = obj();
    j.set("mode", Value::String("sweep".into()))
        .set("records", Value::from(n))
        .set("dir", Value::String(base.display().to_string()))
        .set("filesystem", Value::String(fs))
        .set("machine", machine_json())
        .set("prefill_s", num(prefill.as_secs_f64()))
        .set("prefill_threads", Value::from(args.prefill_threads as u64))
        .set("file_bytes", Value::from(file_before))
        .set("file_bytes_after_sweep", Value::from(file_after))
        .set(
            "file_bytes_after_refill",
            refill.map_or(Value::Null, Value::from),
        )
        .set("sweeper", Value::Bool(args.sweeper))
        .set("log_size", opt(args.log_size.map(|b| b as f64)))
        .set("rate_ratio", opt(rate_ratio))
        .set("claim_without_sweep", lat_json(baseline))
        .set("claim_during_sweep", lat_json(during))
        .set("during_window_s", num(during_time.as_secs_f64()))
        .set("swept", Value::from(swept))
        .set("sweep_s", num(sweep_time.as_secs_f64()))
        .set(
            "sweep_batch",
            args.sweep_batch
                .map_or(Value::String("sweep_all".into()), |b| Value::from(b as u64)),
        )
        .set("sweep_spread", Value::Bool(args.sweep_spread))
        .set("p99_ratio", opt(p99_ratio))
        .set("p99_ratio_max", num(3.0))
        .set("pass", p99_ratio.map_or(Value::Null, |_| Value::Bool(pass)));
    Ok(j)
}
