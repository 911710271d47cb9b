//! `--sweep --only postgres`: claim latency on `PgStore` while `sweep_all` deletes expired
//! records, as `--sweep` measures the redb store (issue 58's PostgreSQL part), with
//! `--sweep-spread` as there.

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use idempotency_store::{IdempotencyStore, ManualClock, Timestamp};
use serde_json::Value;

use crate::Res;
use crate::args::Args;
use crate::run::{machine_json, verdict};
use crate::sweep::{claim_loop, prefill_expired};
use crate::tools::{Lat, Out, Report, err, lat_json, num, obj, opt, percentiles};

/// Prefills a fresh schema with `--records` completed records under an injected clock, moves
/// the clock past their retention, then measures fresh-key claims from one thread without a
/// sweep and while `sweep_all` runs (at most three windows of it).
pub(crate) fn sweep_pg_run(args: &Args, out: &Out) -> Res<Value> {
    let n = args.records;
    out.line(format!(
        "sweep on PostgreSQL: {n} expired records, claim p99 without and during sweep_all"
    ));
    let retention = Duration::from_secs(3600);
    let clock = ManualClock::new(Timestamp::from_millis(1_800_000_000_000));
    let store = crate::pg::open_pg_with_clock(clock.clone(), retention)?;
    let store: &dyn IdempotencyStore = &*store;
    let prefill = prefill_expired(store, &clock, retention, args, out)?;
    let window = Duration::from_secs_f64(args.seconds);
    let warm_end = Instant::now() + Duration::from_millis(300);
    claim_loop(store, 2, &|t| t >= warm_end)?;
    let base_end = Instant::now() + window;
    let (base_lat, _) = claim_loop(store, 3, &|t| t >= base_end)?;
    let base_rate = base_lat.len() as f64 / window.as_secs_f64();
    let baseline = percentiles(base_lat);
    let done = AtomicBool::new(false);
    let (joined, during) = thread::scope(|s| {
        let sweeper = s.spawn(|| {
            let t0 = Instant::now();
            let r = store.sweep_all();
            done.store(true, Ordering::SeqCst);
            (r, t0.elapsed())
        });
        let cap = Instant::now() + window * 3;
        let during = claim_loop(store, 4, &|t| done.load(Ordering::SeqCst) || t >= cap);
        let joined = sweeper.join().map_err(|_| "sweeper panicked".to_owned());
        (joined, during)
    });
    let (swept, sweep_time) = joined?;
    let swept = swept.map_err(|e| err("sweep_all", e))?;
    let (during_lat, during_time) = during?;
    let during_rate = during_lat.len() as f64 / during_time.as_secs_f64().max(1e-9);
    let during = percentiles(during_lat);
    let rate_ratio = (base_rate > 0.0).then(|| during_rate / base_rate);
    let p99_ratio = match (baseline, during) {
        (Some(a), Some(b)) if a.p99_us > 0.0 => Some(b.p99_us / a.p99_us),
        _ => None,
    };
    let show = |l: Option<Lat>| {
        l.map_or_else(
            || "-".into(),
            |l| {
                format!(
                    "p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs",
                    l.p50_us, l.p99_us, l.max_us
                )
            },
        )
    };
    out.line(format!(
        "claims without sweep:  {} ({base_rate:.0}/s)",
        show(baseline)
    ));
    out.line(format!(
        "claims during sweep:   {} ({during_rate:.0}/s over {:.2} s)",
        show(during),
        during_time.as_secs_f64()
    ));
    out.line(format!(
        "sweep_all deleted {swept} in {:.2} s ({:.0}/s)",
        sweep_time.as_secs_f64(),
        swept as f64 / sweep_time.as_secs_f64().max(1e-9)
    ));
    out.line(format!(
        "target: p99 during sweep / p99 without <= 3.0: {} {}",
        p99_ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}")),
        verdict(p99_ratio, p99_ratio.is_some_and(|r| r <= 3.0))
    ));
    out.line(format!(
        "claims/s during sweep / without: {}",
        rate_ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}"))
    ));
    let mut j = obj();
    j.set("mode", Value::String("sweep-postgres".into()))
        .set("records", Value::from(n))
        .set("machine", machine_json())
        .set("prefill_s", num(prefill.as_secs_f64()))
        .set("claim_without_sweep", lat_json(baseline))
        .set("claim_during_sweep", lat_json(during))
        .set("during_window_s", num(during_time.as_secs_f64()))
        .set("swept", Value::from(swept))
        .set("sweep_s", num(sweep_time.as_secs_f64()))
        .set("p99_ratio", opt(p99_ratio))
        .set("rate_ratio", opt(rate_ratio));
    Ok(j)
}
