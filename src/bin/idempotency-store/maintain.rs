//! The commands that maintain: `sweep` deletes expired records, `verify` checks invariants.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use idempotency_store::admin::VerifyReport;
use idempotency_store::{Error, IdempotencyStore};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use crate::format::plural;
use crate::output::{EXIT_FAILED, EXIT_PROBLEM, Fail, Format, Outcome, describe, fail, one_line};
use crate::target::{Source, connection_string, error_kind, shown_path, store_fail};

/// Expired records one `sweep` round deletes: the library's step on the redb store and its
/// `sweep_all` round on PostgreSQL, so that a claim of a running service waits for at most one
/// small step or statement.
const ROUND: usize = 64;

/// `sweep`: deletes every expired record (intents of the client's outbox included: they are
/// past their retention like any record).
pub(crate) fn sweep(out: &mut dyn Write, format: Format, source: Source) -> Outcome {
    let path = source.path;
    // A file that does not open read-only is left as it was.
    drop(source.open()?);
    let total = source.change(format, |store| sweep_rounds(store, path))?;
    if format.is_json() {
        writeln!(out, "{}", json!({ "swept": total }))?;
    } else {
        writeln!(out, "deleted {total} expired record{}", plural(total))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Deletes every expired record in rounds of [`ROUND`], with a progress bar once a second
/// round is needed (long work), on a terminal.
fn sweep_rounds(store: &dyn IdempotencyStore, path: &Path) -> Result<u64, Fail> {
    let mut total = 0u64;
    let mut bar: Option<ProgressBar> = None;
    let result = loop {
        match store.sweep(ROUND) {
            Ok(n) => {
                total += n as u64;
                if n < ROUND {
                    break Ok(());
                }
                let bar = bar.get_or_insert_with(|| {
                    let style = ProgressStyle::with_template(
                        "{spinner} sweeping expired records: {pos} deleted ({elapsed})",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_spinner());
                    let bar = ProgressBar::new_spinner().with_style(style);
                    bar.enable_steady_tick(Duration::from_millis(120));
                    bar
                });
                bar.set_position(total);
            }
            Err(err) => break Err(err),
        }
    };
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    match result {
        Ok(()) => Ok(total),
        Err(err) => Err(fail(
            EXIT_FAILED,
            error_kind(&err),
            format!(
                "{}: {} (after deleting {total} expired records)",
                shown_path(path),
                describe(&err)
            ),
        )),
    }
}

/// `verify`: every invariant of the store; exit 1 with the list if anything is wrong.
pub(crate) fn verify(out: &mut dyn Write, format: Format, source: Source) -> Outcome {
    let path = source.path;
    // A file that does not open as a store, or a walk that meets damage, is a problem with the
    // store (exit 1); one that cannot be looked at (already open, I/O) is not (exit 2), and
    // neither is a PostgreSQL schema that is missing or at another migration.
    let walked = if connection_string(path).is_some() {
        source.open()?.store.verify()
    } else {
        source.try_open()?.and_then(|opened| opened.store.verify())
    };
    let opened = walked.is_ok();
    let report = match walked {
        Ok(report) => report,
        Err(err @ (Error::Corrupted { .. } | Error::NotAStore { .. })) => {
            let mut report = VerifyReport::default();
            report.problems.push(describe(&err));
            report
        }
        Err(err) => return Err(store_fail(path, &err)),
    };
    if format.is_json() {
        let value = json!({
            "clean": report.is_clean(),
            "records": report.records,
            "expiry_entries": report.expiry_entries,
            "problems": report.problems,
        });
        writeln!(out, "{value}")?;
    } else if report.is_clean() {
        writeln!(
            out,
            "ok: {} record{}, {} expiry entr{}, no problems",
            report.records,
            plural(report.records),
            report.expiry_entries,
            if report.expiry_entries == 1 {
                "y"
            } else {
                "ies"
            }
        )?;
    } else {
        let n = report.problems.len();
        if opened {
            writeln!(
                out,
                "{n} problem{} ({} records, {} expiry entries walked):",
                plural(n as u64),
                report.records,
                report.expiry_entries
            )?;
        } else {
            writeln!(
                out,
                "{n} problem{} (the store cannot be walked):",
                plural(n as u64)
            )?;
        }
        for problem in &report.problems {
            writeln!(out, "  {}", one_line(problem))?;
        }
    }
    if report.is_clean() {
        Ok(ExitCode::SUCCESS)
    } else {
        let n = report.problems.len();
        Err(fail(
            EXIT_PROBLEM,
            "problems",
            format!(
                "{}: {n} problem{} found",
                shown_path(path),
                plural(n as u64)
            ),
        ))
    }
}
