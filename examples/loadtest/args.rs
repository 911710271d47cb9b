//! The command line: modes, options and their checks.

use std::path::PathBuf;

use clap::{ArgGroup, Parser};
use idempotency_store::Recovery;

use crate::Res;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Main,
    Sweep,
    Space,
    Recovery,
    /// Internal: the child of `--recovery`, which fills a store and aborts.
    RecoveryChild,
}

pub(crate) struct Args {
    pub(crate) mode: Mode,
    pub(crate) seconds: f64,
    pub(crate) threads: Vec<usize>,
    pub(crate) dir: Option<PathBuf>,
    pub(crate) json_only: bool,
    pub(crate) only: Vec<String>,
    pub(crate) records: u64,
    pub(crate) replay_keys: usize,
    pub(crate) prefill_threads: usize,
    /// `--sweep` with this: the sweeper loops `sweep(N)` instead of calling `sweep_all()`.
    pub(crate) sweep_batch: Option<usize>,
    /// `--sweep-spread`: the prefill's clock runs (see the flag).
    pub(crate) sweep_spread: bool,
    /// `--sweeper`: the background sweeper sweeps (see the flag).
    pub(crate) sweeper: bool,
    /// `--sweep-refill`: as many new records are written after the sweep (see the flag).
    pub(crate) sweep_refill: bool,
    /// `--recovery-child` only: the store file and its durability.
    pub(crate) child: Option<(PathBuf, Recovery)>,
    /// `--log-size`: the store's log in bytes (`StoreBuilder::log_size`); `None`, its default.
    pub(crate) log_size: Option<u64>,
    /// `--recorder`: a Prometheus recorder receives the `metrics` facade's values, as in a
    /// service that exports them (with the `metrics` feature; without it nothing is sent).
    pub(crate) recorder: bool,
}

/// The command line (`--help` lists it).
#[derive(Parser)]
#[command(
    name = "loadtest",
    about = "Durable pairs, replays, mixed load and payments for this store against SQLite and \
             the disk's fdatasync rate; or --sweep, --space, --recovery"
)]
#[command(group(ArgGroup::new("mode").args(["sweep", "space", "recovery", "recovery_child"])))]
pub(crate) struct Cli {
    /// Seconds of measurement per cell.
    #[arg(long, default_value = "3", value_parser = positive_seconds)]
    pub(crate) seconds: f64,
    /// Thread counts, one cell each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64", value_parser = positive_count)]
    pub(crate) threads: Vec<usize>,
    /// Directory for the cells' databases (default: a temporary directory).
    #[arg(long)]
    pub(crate) dir: Option<PathBuf>,
    /// Print only the `JSON: ` line.
    #[arg(long)]
    pub(crate) json_only: bool,
    /// Systems and workloads to run (comma-separated; see the example's docs).
    #[arg(long, value_name = "NAME[,NAME..]", value_delimiter = ',', value_parser = trimmed)]
    pub(crate) only: Vec<String>,
    /// Records for --sweep, --space and --recovery.
    #[arg(long, default_value = "1000000", value_parser = number::<u64>)]
    pub(crate) records: u64,
    /// Keys the replay workload reads.
    #[arg(long, default_value = "10000", value_parser = at_least_one)]
    pub(crate) replay_keys: usize,
    /// Threads that prefill --space and --sweep stores.
    #[arg(long, default_value = "64", value_parser = at_least_one)]
    pub(crate) prefill_threads: usize,
    /// With --sweep: loop `sweep(N)` instead of calling `sweep_all()`.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub(crate) sweep_batch: Option<usize>,
    /// With --sweep: the prefill's clock moves 1 ms every 32 records, as a real one would at
    /// 32,000 pairs/s, so that expiries spread over time instead of all falling in one
    /// millisecond (which makes the sweep's order the key hashes').
    #[arg(long)]
    pub(crate) sweep_spread: bool,
    /// With --sweep: the background sweeper started as docs/operations.md starts it (every
    /// 60 s, batches of 1024) sweeps, instead of `sweep_all()`; its first round is measured.
    #[arg(long)]
    pub(crate) sweeper: bool,
    /// With --sweep: then writes `--records` new records and reports the file's length again,
    /// to show whether the space the sweep freed is used again.
    #[arg(long)]
    pub(crate) sweep_refill: bool,
    /// The store's log size in MiB, for the store cells, --space and --sweep (default: the
    /// store's).
    #[arg(long, value_name = "MIB", value_parser = number::<u64>)]
    pub(crate) log_size: Option<u64>,
    /// Send the `metrics` facade's values to a Prometheus recorder, as a service would.
    #[arg(long)]
    pub(crate) recorder: bool,
    /// Claim p99 while a sweep deletes `--records` expired records.
    #[arg(long)]
    pub(crate) sweep: bool,
    /// Peak RSS and file size with `--records` records.
    #[arg(long)]
    pub(crate) space: bool,
    /// The first open after a crash, for each durability.
    #[arg(long)]
    pub(crate) recovery: bool,
    /// Internal: the child of --recovery (store file, then `quick-repair` or `immediate`).
    #[arg(long, num_args = 2, value_names = ["PATH", "DURABILITY"], hide = true)]
    pub(crate) recovery_child: Option<Vec<String>>,
}

/// A number, `_` separators allowed (`1_000_000`).
pub(crate) fn number<T: std::str::FromStr>(s: &str) -> Res<T> {
    s.trim()
        .replace('_', "")
        .parse()
        .map_err(|_| format!("not a number: {s:?}"))
}

pub(crate) fn positive_seconds(s: &str) -> Res<f64> {
    let seconds: f64 = number(s)?;
    if seconds.is_finite() && seconds > 0.0 {
        Ok(seconds)
    } else {
        Err("--seconds must be positive".into())
    }
}

pub(crate) fn positive_count(s: &str) -> Res<usize> {
    match number(s)? {
        0 => Err("--threads needs positive counts".into()),
        n => Ok(n),
    }
}

/// A count below 1 is taken as 1.
pub(crate) fn at_least_one(s: &str) -> Res<usize> {
    number::<usize>(s).map(|n| n.max(1))
}

pub(crate) fn trimmed(s: &str) -> Res<String> {
    Ok(s.trim().to_owned())
}

pub(crate) fn parse_args() -> Args {
    let cli = Cli::parse();
    let child = cli.recovery_child.map(|values| {
        let path = PathBuf::from(values.first().cloned().unwrap_or_default());
        let durability = match values.get(1).map(String::as_str) {
            Some("quick-repair") => Recovery::QuickRepair,
            _ => Recovery::FullRepair,
        };
        (path, durability)
    });
    let mode = if child.is_some() {
        Mode::RecoveryChild
    } else if cli.sweep {
        Mode::Sweep
    } else if cli.space {
        Mode::Space
    } else if cli.recovery {
        Mode::Recovery
    } else {
        Mode::Main
    };
    Args {
        mode,
        seconds: cli.seconds,
        threads: cli.threads,
        dir: cli.dir,
        json_only: cli.json_only,
        only: cli.only,
        records: cli.records,
        replay_keys: cli.replay_keys,
        prefill_threads: cli.prefill_threads,
        sweep_batch: cli.sweep_batch,
        sweep_spread: cli.sweep_spread,
        sweeper: cli.sweeper,
        sweep_refill: cli.sweep_refill,
        child,
        log_size: cli.log_size.map(|mib| mib << 20),
        recorder: cli.recorder,
    }
}
