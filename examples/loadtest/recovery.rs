//! `--recovery`: the first open after a crash, per durability setting.

use std::path::PathBuf;
use std::time::Instant;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Recovery, Store};
use serde_json::Value;

use crate::Res;
use crate::args::Args;
use crate::run::machine_json;
use crate::store::prefill_store;
use crate::tools::{Out, Report, err, file_bytes, fresh_dir, key_name, num, obj};

/// Fills a store with `--records` completed records, then aborts: no clean close, so the next
/// open finds the file as a crash leaves it.
pub(crate) fn recovery_child(args: &Args, out: &Out) -> Res<Value> {
    let (path, durability) = args.child.clone().ok_or("--recovery-child needs a path")?;
    let store = Store::builder()
        .recovery(durability)
        .open(&path)
        .map_err(|e| err("open", e))?;
    prefill_store(
        &store,
        args.records,
        args.prefill_threads,
        &|i| key_name(1, i),
        out,
    )?;
    std::process::abort();
}

pub(crate) fn recovery_run(args: &Args, out: &Out, base: PathBuf) -> Res<Value> {
    let n = args.records;
    out.line(format!(
        "recovery: first open after a crash (child aborted after {n} completed records), per durability"
    ));
    let exe = std::env::current_exe().map_err(|e| err("current exe", e))?;
    let mut j = obj();
    j.set("mode", Value::String("recovery".into()))
        .set("records", Value::from(n))
        .set("machine", machine_json());
    for (name, durability) in [
        ("immediate", Recovery::FullRepair),
        ("quick-repair", Recovery::QuickRepair),
    ] {
        let dir = fresh_dir(&base, name)?;
        let path = dir.path().join("store.redb");
        let status = std::process::Command::new(&exe)
            .arg("--recovery-child")
            .arg(&path)
            .arg(name)
            .args(["--records", &n.to_string(), "--json-only"])
            .status()
            .map_err(|e| err("spawn", e))?;
        if status.success() {
            return Err("the recovery child did not crash".into());
        }
        let open = || {
            let started = Instant::now();
            let store = Store::builder()
                .recovery(durability)
                .open(&path)
                .map_err(|e| err("reopen", e))?;
            let took = started.elapsed();
            let completed = store.stats().map_err(|e| err("stats", e))?.completed;
            Ok::<_, String>((took, completed))
        };
        let (after_crash, completed) = open()?;
        let (clean, _) = open()?;
        let mib = file_bytes(&path).1 as f64 / (1 << 20) as f64;
        out.line(format!(
            "{name:<13} first open after crash {:>9.1} ms, after a clean close {:>7.1} ms; \
             {completed} records survived; {mib:.0} MiB allocated",
            after_crash.as_secs_f64() * 1e3,
            clean.as_secs_f64() * 1e3,
        ));
        let mut r = obj();
        r.set("open_after_crash_ms", num(after_crash.as_secs_f64() * 1e3))
            .set("open_after_clean_close_ms", num(clean.as_secs_f64() * 1e3))
            .set("records_survived", Value::from(completed))
            .set("allocated_mib", num(mib));
        j.set(name, r);
    }
    Ok(j)
}
