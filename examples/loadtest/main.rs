//! Load test: durable claim+complete pairs, replays and a mixed load, for this store against
//! SQLite (WAL, `synchronous=FULL`) and the raw `fdatasync` rate of the disk, in one process.
//! Built with `--features postgres` and run with `IDEMPOTENCY_PG_URL` set, it also measures
//! `PgStore` (one pooled connection per thread, a fresh schema per cell) as system `postgres`
//! (`sslmode=disable`) and `postgres-tls` (`sslmode=require`), and as `pg-probe` the seed
//! schema's plain statements on the same server (pairs only: per pair an autocommit
//! `INSERT … ON CONFLICT DO NOTHING RETURNING` and an `UPDATE`, both prepared, one connection
//! per thread, no TLS), the floor `PgStore`'s fencing and fingerprints are measured against.
//! With `IDEMPOTENCY_PG_CITUS_URL` set (a Citus coordinator) it also measures `PgStore` in the
//! distributed mode (`PgStoreBuilder::distributed`) there, as system `postgres-citus`.
//!
//! ```text
//! cargo run --release --example loadtest -- [--seconds S] [--threads 1,4,16,64] [--dir PATH]
//!     [--json-only] [--only NAME[,NAME..]] [--replay-keys N] [--recorder] [--log-size MIB]
//! cargo run --release --example loadtest -- --sweep [--records N] [--seconds S] [--dir PATH]
//!     [--sweep-batch N] [--sweep-spread] [--sweeper] [--sweep-refill] [--only postgres]
//! cargo run --release --example loadtest -- --space [--records N] [--dir PATH] [--log-size MIB]
//! cargo run --release --example loadtest -- --recovery [--records N] [--dir PATH]
//! ```
//!
//! `--log-size` opens the store cells' and `--space`'s stores with a log of that many MiB
//! (`StoreBuilder::log_size`) instead of the store's default.
//!
//! `--recovery` runs a child that fills a store and aborts (no clean close), then times the
//! first open after that crash, for each `Recovery`.
//!
//! `outbox` is the client's (`idempotency_store::client`): a pair is `Outbox::begin` of a fresh
//! operation (its key durable before it returns) and `Outbox::finish`, on a store of its own.
//!
//! `--only` filters by system (`store`, `store-nogc`, `store-txn`, `sqlite-full`, `postgres`,
//! `postgres-tls`, `pg-probe`, `postgres-citus`, `store-quickrepair`, `outbox`, `fdatasync`) and by workload (`pairs`,
//! `replay`, `mixed`, `payments`); a cell runs if its system is named (or no system is) and its
//! workload is named (or no workload is).
//!
//! `payments` is the exactly-once path: a fresh claim, then one ledger row written with the
//! stored response. `store` writes the row with `Store::complete_with_effects` (it shares the
//! group-commit batch), `store-txn` with `Store::complete_with` (a redb commit of its own, the
//! slow path), `sqlite-full` in its natural form: the claim in one commit, then the ledger
//! insert and the response update in one transaction.
//! Every run prints a table, then one line starting `JSON: ` with every figure.
//!
//! Each cell gets a fresh database in a fresh temporary directory under `--dir`, runs a short
//! warm-up, then counts the operations that complete inside a measurement window of `S`
//! seconds. Keys are random UUID-shaped strings (36 bytes), so inserts land all over the
//! B-tree, as client-generated keys do.

mod args;
mod cell;
mod log_bound;
mod outbox;
mod pg;
mod recovery;
mod run;
mod space;
mod sqlite;
mod store;
mod sweep;
mod sweep_pg;
mod systems;
mod tools;

use std::process::ExitCode;
use std::time::Duration;

use idempotency_store::redb::TableDefinition;
use serde_json::Value;

use crate::args::{Mode, parse_args};
use crate::recovery::{recovery_child, recovery_run};
use crate::run::main_run;
use crate::space::space_run;
use crate::sweep::sweep_run;
use crate::tools::{Out, Report, bench_dir};

pub(crate) type Res<T> = Result<T, String>;

pub(crate) const BODY_LEN: usize = 200;
pub(crate) const MIXED_HALF: usize = 16;
pub(crate) const SQLITE_DB: &str = "sqlite-full.db";
/// The payments workload's ledger: idempotency key → (amount, customer).
pub(crate) const LEDGER: TableDefinition<&str, (u64, &str)> = TableDefinition::new("ledger");
pub(crate) const AMOUNT: u64 = 4999;
pub(crate) const CUSTOMER: &str = "cus_123";

fn main() -> ExitCode {
    // A usage error exits 2 with clap's message; --help prints to stdout and exits 0.
    let args = parse_args();
    let out = Out {
        quiet: args.json_only,
    };
    let recorder = if args.recorder {
        // Configured as the example servers' `install_prometheus` does: histograms with the
        // store's bucket bounds.
        let seconds: Vec<f64> = idempotency_store::metrics::LATENCY_BUCKETS_US
            .iter()
            .map(|&us| Duration::from_micros(us).as_secs_f64())
            .collect();
        let installed = metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                &seconds,
            )
            .and_then(|builder| builder.install_recorder());
        match installed {
            Ok(handle) => {
                // As a deployment would (the exporter's own listener does this every 5 s):
                // without upkeep, histogram samples pile up for the whole run.
                let upkeep = handle.clone();
                std::thread::spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_secs(5));
                        upkeep.run_upkeep();
                    }
                });
                Some(handle)
            }
            Err(e) => {
                eprintln!("installing the Prometheus recorder: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let result = bench_dir(&args).and_then(|base| match args.mode {
        Mode::Main => main_run(&args, &out, base),
        Mode::Sweep => sweep_run(&args, &out, base),
        Mode::Space => space_run(&args, &out, base),
        Mode::Recovery => recovery_run(&args, &out, base),
        Mode::RecoveryChild => recovery_child(&args, &out),
    });
    let result = result.map(|mut j| {
        j.set("metrics_feature", Value::Bool(cfg!(feature = "metrics")))
            .set("tracing_feature", Value::Bool(cfg!(feature = "tracing")));
        if let Some(handle) = &recorder {
            // Proof that the values reached the recorder: its rendered sample lines.
            let samples = handle
                .render()
                .lines()
                .filter(|l| !l.starts_with('#'))
                .count();
            j.set("recorder_samples", Value::from(samples as u64));
        }
        j
    });
    match result {
        Ok(j) => {
            println!("JSON: {j}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("loadtest failed: {e}");
            ExitCode::FAILURE
        }
    }
}
