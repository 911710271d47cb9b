//! `--space`: a million completed records: peak RSS and file size.

use std::path::PathBuf;

use idempotency_store::IdempotencyStore;
use idempotency_store::Store;
use serde_json::Value;

use crate::args::Args;
use crate::run::{machine_json, verdict};
use crate::store::prefill_store;
use crate::tools::{
    Out, Report, err, file_bytes, filesystem_of, fresh_dir, key_name, num, obj, opt, peak_rss_kib,
    proc_status_kib,
};
use crate::{BODY_LEN, Res};

pub(crate) fn space_run(args: &Args, out: &Out, base: PathBuf) -> Res<Value> {
    let fs = filesystem_of(&base);
    let n = args.records;
    out.line(format!(
        "space: {n} completed records with {BODY_LEN} B bodies; dir {} on {fs}",
        base.display()
    ));
    let dir = fresh_dir(&base, "space")?;
    let path = dir.path().join("store.redb");
    let mut builder = Store::builder();
    if let Some(bytes) = args.log_size {
        builder.log_size(bytes);
    }
    let store = builder.open(&path).map_err(|e| err("open", e))?;
    let took = prefill_store(&store, n, args.prefill_threads, &|i| key_name(1, i), out)?;
    let rss_open = peak_rss_kib();
    // Where the resident memory is right after the inserts (the peak is VmHWM).
    let mut now_rss = obj();
    for field in ["VmRSS", "RssAnon", "RssFile", "VmStk"] {
        now_rss.set(
            field,
            opt(proc_status_kib(field).map(|k| k as f64 / 1024.0)),
        );
    }
    let (file_open, alloc_open) = file_bytes(&path);
    let stats = store.stats().map_err(|e| err("stats", e))?;
    drop(store);
    let (file_closed, alloc_closed) = file_bytes(&path);
    let rss = peak_rss_kib();
    // key (36 B) + fingerprint digest (32 B) + body + headers (none) per record.
    let raw = n * (36 + 32 + BODY_LEN as u64);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let rss_mib = rss.map(|k| k as f64 / 1024.0);
    let ratio = file_open.max(file_closed) as f64 / raw as f64;
    let rss_pass = rss_mib.is_some_and(|r| r <= 64.0);
    let file_pass = ratio <= 2.0;
    out.line(format!(
        "inserted in {:.1} s ({:.0} pairs/s, {} threads); stats: {} completed",
        took.as_secs_f64(),
        n as f64 / took.as_secs_f64(),
        args.prefill_threads,
        stats.completed
    ));
    out.line(format!(
        "peak RSS (VmHWM): {} MiB  target <= 64 MiB: {}",
        rss_mib.map_or_else(|| "-".into(), |r| format!("{r:.1}")),
        verdict(rss_mib, rss_pass)
    ));
    out.line(format!(
        "file: {:.1} MiB open, {:.1} MiB after close; raw {:.1} MiB; ratio {ratio:.2} \
         (the larger)  target <= 2.0: {}",
        mib(file_open),
        mib(file_closed),
        mib(raw),
        verdict(Some(ratio), file_pass)
    ));
    out.line(format!(
        "allocated on disk (st_blocks, the file is sparse): {:.1} MiB open, {:.1} MiB after \
         close; allocated/raw {:.2}",
        mib(alloc_open),
        mib(alloc_closed),
        alloc_open.max(alloc_closed) as f64 / raw as f64
    ));
    let mut j = obj();
    j.set("mode", Value::String("space".into()))
        .set("records", Value::from(n))
        .set("log_size", opt(args.log_size.map(|b| b as f64)))
        .set("dir", Value::String(base.display().to_string()))
        .set("filesystem", Value::String(fs))
        .set("machine", machine_json())
        .set("insert_s", num(took.as_secs_f64()))
        .set("threads", Value::from(args.prefill_threads as u64))
        .set("completed", Value::from(stats.completed))
        .set("peak_rss_mib", opt(rss_mib))
        .set(
            "peak_rss_mib_while_open",
            opt(rss_open.map(|k| k as f64 / 1024.0)),
        )
        .set("file_bytes_open", Value::from(file_open))
        .set("file_bytes_closed", Value::from(file_closed))
        .set("allocated_bytes_open", Value::from(alloc_open))
        .set("allocated_bytes_closed", Value::from(alloc_closed))
        .set("closed_file_over_raw", num(file_closed as f64 / raw as f64))
        .set("mib_after_insert", now_rss)
        .set("raw_bytes", Value::from(raw))
        .set("file_over_raw", num(ratio))
        .set(
            "rss_pass",
            rss_mib.map_or(Value::Null, |_| Value::Bool(rss_pass)),
        )
        .set("file_pass", Value::Bool(file_pass));
    Ok(j)
}
