//! The main run: every cell of every system and workload, the table and the targets.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::Instant;

use idempotency_store::client::Outbox;
use idempotency_store::{IdempotencyStore, Recovery};
use serde_json::Value;

use crate::args::Args;
use crate::cell::{COMMIT_PAGES, Work, fdatasync_rate, run_cell};
use crate::log_bound::LogBound;
use crate::outbox::OutboxSys;
#[cfg(feature = "postgres")]
use crate::pg::PgProbe;
use crate::pg::{citus_url, open_citus, open_pg, pg_url};
use crate::sqlite::SqliteSys;
use crate::store::{StoreSys, open_store, prefill_store};
use crate::systems::{CELL, ReplaySet, System};
use crate::tools::{Lat, Out, Report, body, filesystem_of, fresh_dir, lat_json, num, obj, opt};
use crate::{BODY_LEN, MIXED_HALF, Res};

/// The systems every run measures, plus `postgres` when it can.
pub(crate) fn systems() -> Vec<&'static str> {
    let mut systems = vec!["store", "store-nogc", "sqlite-full", "log-bound", "outbox"];
    if pg_url().is_some() {
        systems.extend(["postgres", "postgres-tls", "pg-probe"]);
    }
    if citus_url().is_some() {
        systems.push("postgres-citus");
    }
    systems
}

pub(crate) struct Runner<'a> {
    pub(crate) args: &'a Args,
    pub(crate) out: &'a Out,
    pub(crate) base: PathBuf,
    pub(crate) set: Arc<ReplaySet>,
    /// (workload, system, threads) → figure
    pub(crate) pairs: Vec<(String, usize, f64, Option<Lat>)>,
    pub(crate) replay: Vec<(String, usize, f64)>,
    pub(crate) mixed: Vec<(String, f64, f64, Option<Lat>)>,
    pub(crate) payments: Vec<(String, usize, f64, Option<Lat>)>,
}

/// The systems that run the payments workload.
pub(crate) const PAYMENT_SYSTEMS: [&str; 3] = ["store", "store-txn", "sqlite-full"];

impl Runner<'_> {
    /// Whether `--only` keeps the cell: names of systems and of workloads are filters of their
    /// own kind, and a cell must pass both (`--only store,pairs` = the store's pair cells).
    pub(crate) fn wants(&self, system: &str, workload: &str) -> bool {
        wanted(&self.args.only, system, workload)
    }

    /// A fresh system in a fresh directory, its replay set completed beforehand if asked.
    pub(crate) fn with_system<T>(
        &self,
        system: &str,
        prefill: bool,
        f: impl FnOnce(&dyn System) -> Res<T>,
    ) -> Res<T> {
        let dir = fresh_dir(&self.base, system)?;
        let cell = CELL.fetch_add(1, Ordering::Relaxed);
        match system {
            #[cfg(feature = "postgres")]
            "pg-probe" => f(&PgProbe::create(cell)?),
            "postgres" | "postgres-tls" | "postgres-citus" => {
                let store = if system == "postgres-citus" {
                    open_citus(cell)?
                } else {
                    open_pg(cell, system == "postgres-tls")?
                };
                let sys = StoreSys {
                    store: Arc::from(store),
                    redb: None,
                    slow_effects: false,
                    set: Arc::clone(&self.set),
                    cell,
                    body: body(),
                };
                if prefill {
                    let set = Arc::clone(&self.set);
                    prefill_store(
                        sys.store.as_ref(),
                        set.names.len() as u64,
                        32,
                        &|i| set.names[i as usize].clone(),
                        &Out { quiet: true },
                    )?;
                }
                f(&sys)
            }
            "log-bound" => f(&LogBound::create(dir.path())?),
            "outbox" => {
                let store = Arc::new(open_store(
                    dir.path(),
                    false,
                    Recovery::FullRepair,
                    self.args.log_size,
                )?);
                f(&OutboxSys {
                    outbox: Outbox::new(store),
                    cell,
                    body: body(),
                })
            }
            "sqlite-full" => {
                let sys = SqliteSys::create(dir.path(), Arc::clone(&self.set), cell)?;
                if prefill {
                    sys.prefill()?;
                }
                f(&sys)
            }
            _ => {
                let durability = if system == "store-quickrepair" {
                    Recovery::QuickRepair
                } else {
                    Recovery::FullRepair
                };
                let nogc = system == "store-nogc";
                if prefill {
                    // Complete the replay set with group commit, then reopen with the system's
                    // own settings (replays never reach the committer anyway).
                    let store = open_store(dir.path(), false, durability, self.args.log_size)?;
                    let set = Arc::clone(&self.set);
                    prefill_store(
                        &store,
                        set.names.len() as u64,
                        32,
                        &|i| set.names[i as usize].clone(),
                        &Out { quiet: true },
                    )?;
                    drop(store);
                }
                let store = Arc::new(open_store(
                    dir.path(),
                    nogc,
                    durability,
                    self.args.log_size,
                )?);
                let sys = StoreSys {
                    store: Arc::clone(&store) as Arc<dyn IdempotencyStore>,
                    redb: Some(store),
                    slow_effects: system == "store-txn",
                    set: Arc::clone(&self.set),
                    cell,
                    body: body(),
                };
                f(&sys)
            }
        }
    }

    pub(crate) fn run(&mut self) -> Res<()> {
        let secs = self.args.seconds;
        let threads = self.args.threads.clone();
        for &t in &threads {
            for system in systems() {
                if !self.wants(system, "pairs") {
                    continue;
                }
                self.out.note(format!("pairs  {system:<12} {t:>3} threads"));
                let r = self.with_system(system, false, |sys| {
                    run_cell(sys, &[(Work::Pairs, t)], secs)
                })?;
                if let Some((rate, lat)) = r.pairs {
                    self.pairs.push((system.to_owned(), t, rate, lat));
                }
            }
            for system in PAYMENT_SYSTEMS {
                if !self.wants(system, "payments") {
                    continue;
                }
                self.out
                    .note(format!("payments {system:<10} {t:>3} threads"));
                let r = self.with_system(system, false, |sys| {
                    run_cell(sys, &[(Work::Payments, t)], secs)
                })?;
                if let Some((rate, lat)) = r.pairs {
                    self.payments.push((system.to_owned(), t, rate, lat));
                }
            }
            if t == 1 && self.wants("store-quickrepair", "pairs") {
                self.out.note("pairs  store-quickrepair   1 thread");
                let r = self.with_system("store-quickrepair", false, |sys| {
                    run_cell(sys, &[(Work::Pairs, 1)], secs)
                })?;
                if let Some((rate, lat)) = r.pairs {
                    self.pairs.push(("store-quickrepair".into(), 1, rate, lat));
                }
            }
        }
        for system in systems() {
            let want_replay = self.wants(system, "replay");
            let want_mixed = self.wants(system, "mixed");
            if !want_replay && !want_mixed {
                continue;
            }
            // One prefilled database per system serves its replay and mixed cells.
            self.out.note(format!(
                "replay {system:<12} prefilling {}",
                self.set.names.len()
            ));
            let (replay, mixed) = self.with_system(system, true, |sys| {
                let mut replay = Vec::new();
                if want_replay {
                    for &t in &threads {
                        self.out.note(format!("replay {system:<12} {t:>3} threads"));
                        let r = run_cell(sys, &[(Work::Replay, t)], secs)?;
                        replay.push((t, r.replay.unwrap_or(0.0)));
                    }
                }
                let mut mixed = None;
                if want_mixed {
                    self.out.note(format!(
                        "mixed  {system:<12} {MIXED_HALF} replay + {MIXED_HALF} pair threads"
                    ));
                    let r = run_cell(
                        sys,
                        &[(Work::Replay, MIXED_HALF), (Work::Pairs, MIXED_HALF)],
                        secs,
                    )?;
                    let (p, lat) = r.pairs.unwrap_or((0.0, None));
                    mixed = Some((r.replay.unwrap_or(0.0), p, lat));
                }
                Ok((replay, mixed))
            })?;
            for (t, rate) in replay {
                self.replay.push((system.to_owned(), t, rate));
            }
            if let Some((r, p, lat)) = mixed {
                self.mixed.push((system.to_owned(), r, p, lat));
            }
        }
        Ok(())
    }

    pub(crate) fn pairs_at(&self, system: &str, t: usize) -> Option<f64> {
        self.pairs
            .iter()
            .find(|(s, n, _, _)| s == system && *n == t)
            .map(|p| p.2)
    }

    pub(crate) fn payments_at(&self, system: &str, t: usize) -> Option<f64> {
        self.payments
            .iter()
            .find(|(s, n, _, _)| s == system && *n == t)
            .map(|p| p.2)
    }

    pub(crate) fn replay_at(&self, system: &str, t: usize) -> Option<f64> {
        self.replay
            .iter()
            .find(|(s, n, _)| s == system && *n == t)
            .map(|p| p.2)
    }
}

pub(crate) const WORKLOADS: [&str; 4] = ["pairs", "replay", "mixed", "payments"];

pub(crate) fn wanted(only: &[String], system: &str, workload: &str) -> bool {
    if matches!(system, "log-bound" | "pg-probe" | "outbox") && workload != "pairs" {
        return false;
    }
    // store-txn runs payments only, and payments run on PAYMENT_SYSTEMS only.
    let payments = workload == "payments";
    if (system == "store-txn" && !payments) || (payments && !PAYMENT_SYSTEMS.contains(&system)) {
        return false;
    }
    let (workloads, systems): (Vec<&String>, Vec<&String>) =
        only.iter().partition(|o| WORKLOADS.contains(&o.as_str()));
    (systems.is_empty() || systems.iter().any(|s| *s == system))
        && (workloads.is_empty() || workloads.iter().any(|w| *w == workload))
}

pub(crate) struct Target {
    pub(crate) name: &'static str,
    pub(crate) value: Option<f64>,
    pub(crate) min: f64,
}

pub(crate) fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

pub(crate) fn fmt_rate(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

pub(crate) fn verdict(value: Option<f64>, pass: bool) -> &'static str {
    match (value, pass) {
        (None, _) => "n/a",
        (Some(_), true) => "PASS",
        (Some(_), false) => "FAIL",
    }
}

pub(crate) fn machine_json() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let cpus = thread::available_parallelism().map_or(0, |n| n.get() as u64);
    let mut j = obj();
    j.set("cpus", Value::from(cpus))
        .set("cpu", Value::String(cpu))
        .set("kernel", Value::String(kernel))
        .set("loadavg", Value::String(load));
    j
}

pub(crate) fn main_run(args: &Args, out: &Out, base: PathBuf) -> Res<Value> {
    let fs = filesystem_of(&base);
    out.line(format!(
        "loadtest: {} s per cell, threads {:?}, bench dir {} on {fs}",
        args.seconds,
        args.threads,
        base.display()
    ));
    let wants_fsync = args.only.is_empty() || args.only.iter().any(|o| o == "fdatasync");
    if let Some(bad) = args.only.iter().find(|o| {
        !(WORKLOADS.contains(&o.as_str())
            || systems().contains(&o.as_str())
            || *o == "postgres"
            || *o == "store-quickrepair"
            || *o == "store-txn"
            || *o == "fdatasync")
    }) {
        return Err(format!("--only {bad:?}: not a system or workload name"));
    }
    let fsync_dir = fresh_dir(&base, "fdatasync")?;
    let fsync_before = if wants_fsync {
        out.note("fdatasync loop");
        Some(fdatasync_rate(fsync_dir.path(), args.seconds, 0)?)
    } else {
        None
    };
    let fsync_pages = if wants_fsync {
        out.note(format!(
            "fdatasync loop, {COMMIT_PAGES} scattered pages per sync"
        ));
        Some(fdatasync_rate(
            fsync_dir.path(),
            args.seconds,
            COMMIT_PAGES,
        )?)
    } else {
        None
    };

    let mut runner = Runner {
        args,
        out,
        base: base.clone(),
        set: Arc::new(ReplaySet::new(args.replay_keys)?),
        pairs: Vec::new(),
        replay: Vec::new(),
        mixed: Vec::new(),
        payments: Vec::new(),
    };
    let started = Instant::now();
    runner.run()?;

    let fsync_after = if wants_fsync {
        out.note("fdatasync loop (again)");
        Some(fdatasync_rate(fsync_dir.path(), args.seconds, 0)?)
    } else {
        None
    };
    // The mean of the loop before and after the cells, to even out drifting load.
    let fsync = match (fsync_before, fsync_after) {
        (Some((a, _)), Some((b, _))) => Some((a + b) / 2.0),
        _ => None,
    };

    // ---- tables
    let threads = &args.threads;
    let header = |title: &str, width: usize| {
        let mut h = format!("{title:<20}");
        for t in threads {
            let _ = write!(h, "{:>width$}", format!("{t} thr"));
        }
        h
    };
    out.line("");
    out.line("pairs/s (fresh key: claim + complete, 200 B body, each durable)");
    out.line(header("system", 11));
    for system in systems().iter().chain(&["store-quickrepair"]) {
        if !runner.pairs.iter().any(|p| p.0 == *system) {
            continue;
        }
        let mut row = format!("{system:<20}");
        for &t in threads {
            let _ = write!(row, "{:>11}", fmt_rate(runner.pairs_at(system, t)));
        }
        out.line(row);
    }
    if let Some(rate) = fsync {
        out.line(format!(
            "{:<20}{:>11}   (raw pwrite+fdatasync/s, 1 thread; pair bound = {:.0}/s)",
            "fdatasync",
            format!("{rate:.0}"),
            rate / 2.0
        ));
    }
    if let Some((rate, _)) = fsync_pages {
        out.line(format!(
            "{:<20}{:>11}   (info: {COMMIT_PAGES} x 4 KiB scattered + header, then fdatasync; \
             the shape of a one-op commit; pair bound = {:.0}/s)",
            "fdatasync-commit",
            format!("{rate:.0}"),
            rate / 2.0
        ));
    }
    out.line("");
    out.line("pair latency p50 / p99 (µs)");
    out.line(header("system", 16));
    for system in systems().iter().chain(&["store-quickrepair"]) {
        if !runner.pairs.iter().any(|p| p.0 == *system) {
            continue;
        }
        let mut row = format!("{system:<20}");
        for &t in threads {
            let cell = runner
                .pairs
                .iter()
                .find(|p| p.0 == *system && p.1 == t)
                .and_then(|p| p.3)
                .map_or_else(
                    || "-".to_owned(),
                    |l| format!("{:.0}/{:.0}", l.p50_us, l.p99_us),
                );
            let _ = write!(row, "{cell:>16}");
        }
        out.line(row);
    }
    if !runner.replay.is_empty() {
        out.line("");
        out.line(format!(
            "replays/s (claim of a completed key, matching fingerprint; {} keys)",
            args.replay_keys
        ));
        out.line(header("system", 11));
        for system in systems() {
            if !runner.replay.iter().any(|p| p.0 == system) {
                continue;
            }
            let mut row = format!("{system:<20}");
            for &t in threads {
                let _ = write!(row, "{:>11}", fmt_rate(runner.replay_at(system, t)));
            }
            out.line(row);
        }
    }
    if !runner.mixed.is_empty() {
        out.line("");
        out.line(format!(
            "mixed: {MIXED_HALF} replay threads + {MIXED_HALF} fresh-pair threads"
        ));
        out.line(format!(
            "{:<20}{:>12}{:>12}{:>16}{:>14}",
            "system", "replays/s", "pairs/s", "replay-only@16", "mixed/only"
        ));
        for (system, r, p, _) in &runner.mixed {
            let only = runner.replay_at(system, MIXED_HALF);
            out.line(format!(
                "{system:<20}{r:>12.0}{p:>12.0}{:>16}{:>14}",
                fmt_rate(only),
                ratio(Some(*r), only).map_or_else(|| "-".into(), |x| format!("{x:.2}"))
            ));
        }
    }

    if !runner.payments.is_empty() {
        out.line("");
        out.line(
            "payments/s (fresh key: claim, then one ledger row + the response, atomically; each durable)",
        );
        out.line(header("system", 11));
        for system in PAYMENT_SYSTEMS {
            if !runner.payments.iter().any(|p| p.0 == system) {
                continue;
            }
            let mut row = format!("{system:<20}");
            for &t in threads {
                let _ = write!(row, "{:>11}", fmt_rate(runner.payments_at(system, t)));
            }
            out.line(row);
        }
    }

    // ---- targets
    let max_t = threads.iter().copied().max().unwrap_or(1);
    let store_mixed = runner.mixed.iter().find(|m| m.0 == "store").map(|m| m.1);
    let targets = [
        Target {
            name: "pairs_1t_store_over_sqlite",
            value: ratio(
                runner.pairs_at("store", 1),
                runner.pairs_at("sqlite-full", 1),
            ),
            min: 1.0,
        },
        Target {
            name: "pairs_1t_store_over_fdatasync_half",
            value: ratio(runner.pairs_at("store", 1), fsync.map(|f| f / 2.0)),
            min: 0.5,
        },
        Target {
            name: "pairs_64t_store_over_sqlite",
            value: ratio(
                runner.pairs_at("store", 64),
                runner.pairs_at("sqlite-full", 64),
            ),
            min: 10.0,
        },
        Target {
            name: "pairs_store_64t_over_1t",
            value: ratio(runner.pairs_at("store", 64), runner.pairs_at("store", 1)),
            min: 8.0,
        },
        Target {
            name: "replay_1t_store_over_sqlite",
            value: ratio(
                runner.replay_at("store", 1),
                runner.replay_at("sqlite-full", 1),
            ),
            min: 1.5,
        },
        Target {
            name: "mixed_replay_over_replay_only_16t",
            value: ratio(store_mixed, runner.replay_at("store", MIXED_HALF)),
            min: 0.8,
        },
        Target {
            name: "outbox_1t_begin_finish_over_store_pairs",
            value: ratio(runner.pairs_at("outbox", 1), runner.pairs_at("store", 1)),
            min: 0.8,
        },
        Target {
            name: "outbox_64t_begin_finish_over_store_pairs",
            value: ratio(runner.pairs_at("outbox", 64), runner.pairs_at("store", 64)),
            min: 0.8,
        },
        Target {
            name: "payments_64t_store_over_store_pairs",
            value: ratio(
                runner.payments_at("store", 64),
                runner.pairs_at("store", 64),
            ),
            min: 0.7,
        },
        Target {
            name: "payments_64t_store_over_sqlite",
            value: ratio(
                runner.payments_at("store", 64),
                runner.payments_at("sqlite-full", 64),
            ),
            min: 4.0,
        },
        Target {
            name: "payments_1t_store_over_sqlite",
            value: ratio(
                runner.payments_at("store", 1),
                runner.payments_at("sqlite-full", 1),
            ),
            min: 1.0,
        },
    ];
    out.line("");
    out.line("targets");
    for t in &targets {
        let pass = t.value.is_some_and(|v| v >= t.min);
        out.line(format!(
            "  {:<50} {:>8}  (>= {:<4})  {}",
            t.name,
            t.value.map_or_else(|| "-".into(), |v| format!("{v:.2}")),
            t.min,
            verdict(t.value, pass)
        ));
    }
    // Informative ratios (no target).
    let extra = [
        (
            "pairs_store_over_nogc_max_threads",
            ratio(
                runner.pairs_at("store", max_t),
                runner.pairs_at("store-nogc", max_t),
            ),
        ),
        (
            "pairs_1t_quickrepair_over_store",
            ratio(
                runner.pairs_at("store-quickrepair", 1),
                runner.pairs_at("store", 1),
            ),
        ),
        (
            "pairs_1t_store_over_commit_shaped_fdatasync_half",
            ratio(runner.pairs_at("store", 1), fsync_pages.map(|f| f.0 / 2.0)),
        ),
        // The floor's own ratios: what the 64-thread targets would read if the store cost
        // nothing beyond queueing, one log append and a shared sync per batch.
        (
            "pairs_64t_log_bound_over_sqlite",
            ratio(
                runner.pairs_at("log-bound", 64),
                runner.pairs_at("sqlite-full", 64),
            ),
        ),
        (
            "pairs_log_bound_64t_over_store_1t",
            ratio(
                runner.pairs_at("log-bound", 64),
                runner.pairs_at("store", 1),
            ),
        ),
        (
            "pairs_64t_store_over_log_bound",
            ratio(
                runner.pairs_at("store", 64),
                runner.pairs_at("log-bound", 64),
            ),
        ),
        (
            "pairs_1t_sqlite_over_fdatasync_half",
            ratio(runner.pairs_at("sqlite-full", 1), fsync.map(|f| f / 2.0)),
        ),
        // What sharing the batch buys over a commit of its own per payment.
        (
            "payments_64t_store_over_store_txn",
            ratio(
                runner.payments_at("store", 64),
                runner.payments_at("store-txn", 64),
            ),
        ),
    ];
    for (name, v) in &extra {
        out.line(format!(
            "  {:<50} {:>8}  (info)",
            name,
            v.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
        ));
    }
    out.line(format!(
        "cells took {:.0} s",
        started.elapsed().as_secs_f64()
    ));

    // ---- JSON
    let mut j = obj();
    j.set("mode", Value::String("loadtest".into()))
        .set("seconds_per_cell", num(args.seconds))
        .set(
            "threads",
            Value::Array(threads.iter().map(|&t| Value::from(t as u64)).collect()),
        )
        .set("replay_keys", Value::from(args.replay_keys as u64))
        .set("log_size", opt(args.log_size.map(|b| b as f64)))
        .set("body_bytes", Value::from(BODY_LEN as u64))
        .set("dir", Value::String(base.display().to_string()))
        .set("filesystem", Value::String(fs))
        .set("machine", machine_json());
    let mut fj = obj();
    fj.set("per_s", opt(fsync))
        .set("before_per_s", opt(fsync_before.map(|f| f.0)))
        .set("after_per_s", opt(fsync_after.map(|f| f.0)))
        .set("latency", lat_json(fsync_before.and_then(|f| f.1)))
        .set("pair_bound_per_s", opt(fsync.map(|f| f / 2.0)));
    j.set("fdatasync", fj);
    let mut cj = obj();
    cj.set("pages", Value::from(COMMIT_PAGES))
        .set("per_s", opt(fsync_pages.map(|f| f.0)))
        .set("latency", lat_json(fsync_pages.and_then(|f| f.1)))
        .set("pair_bound_per_s", opt(fsync_pages.map(|f| f.0 / 2.0)));
    j.set("fdatasync_commit_shaped", cj);
    for (system, t, rate, lat) in &runner.pairs {
        let mut cell = obj();
        cell.set("per_s", num(*rate)).set("latency", lat_json(*lat));
        j.child("pairs").child(system).set(t.to_string(), cell);
    }
    for (system, t, rate, lat) in &runner.payments {
        let mut cell = obj();
        cell.set("per_s", num(*rate)).set("latency", lat_json(*lat));
        j.child("payments").child(system).set(t.to_string(), cell);
    }
    for (system, t, rate) in &runner.replay {
        j.child("replay")
            .child(system)
            .set(t.to_string(), num(*rate));
    }
    for (system, r, p, lat) in &runner.mixed {
        let mut cell = obj();
        cell.set("replay_per_s", num(*r))
            .set("pairs_per_s", num(*p))
            .set("pair_latency", lat_json(*lat))
            .set(
                "replay_over_replay_only_16",
                opt(ratio(Some(*r), runner.replay_at(system, MIXED_HALF))),
            );
        j.child("mixed").set(system.clone(), cell);
    }
    let mut tj = obj();
    for t in &targets {
        let mut cell = obj();
        cell.set("value", opt(t.value)).set("min", num(t.min)).set(
            "pass",
            t.value.map_or(Value::Null, |v| Value::Bool(v >= t.min)),
        );
        tj.set(t.name, cell);
    }
    j.set("targets", tj);
    let mut ej = obj();
    for (name, v) in extra {
        ej.set(name, opt(v));
    }
    j.set("ratios", ej);
    Ok(j)
}
