//! How a command ends: exit codes, the one error line, warnings, in a table or JSON format.

use std::io::{self, Write};
use std::process::ExitCode;

use idempotency_store::Error;
use serde_json::json;

use crate::format::plural;

/// Done, but the answer is a problem (see `--help`, "Exit codes").
pub(crate) const EXIT_PROBLEM: u8 = 1;
/// Could not do it.
pub(crate) const EXIT_FAILED: u8 = 2;

/// How output is written: tables and text lines for people, or JSON for scripts (`--json`),
/// warnings and errors included.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Table,
    Json,
}

impl Format {
    pub(crate) fn is_json(self) -> bool {
        self == Format::Json
    }
}

/// Why a command ends with a non-zero exit code (or ends early because stdout was closed).
pub(crate) struct Fail {
    pub(crate) code: u8,
    /// What kind of failure, for scripts (`kind` in the JSON error; docs/cli.md lists them).
    pub(crate) kind: &'static str,
    /// The one line printed to stderr after `error: `; `None` to end quietly.
    pub(crate) message: Option<String>,
}

/// A failure with its exit code, kind and message.
pub(crate) fn fail(code: u8, kind: &'static str, message: impl Into<String>) -> Fail {
    Fail {
        code,
        kind,
        message: Some(one_line(&message.into())),
    }
}

/// An error line on stderr: `error: …`, or `{"error": …, "kind": …}` under `--json`.
pub(crate) fn print_error(format: Format, kind: &str, message: &str) {
    let line = if format.is_json() {
        json!({ "error": message, "kind": kind }).to_string()
    } else {
        format!("error: {message}")
    };
    let _ = writeln!(io::stderr(), "{line}");
}

impl From<io::Error> for Fail {
    fn from(err: io::Error) -> Self {
        if err.kind() == io::ErrorKind::BrokenPipe {
            // The reader went away (`| head`): stop quietly, like other Unix tools.
            Fail {
                code: 0,
                kind: "output",
                message: None,
            }
        } else {
            fail(EXIT_FAILED, "output", format!("writing the output: {err}"))
        }
    }
}

pub(crate) type Outcome = Result<ExitCode, Fail>;

/// The error and its causes on one line.
pub(crate) fn describe(err: &Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    one_line(&text)
}

/// `text` on one line: its lines trimmed, joined with `; `.
pub(crate) fn one_line(text: &str) -> String {
    text.split(['\n', '\r'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// A warning line on stderr: `warning: …`, or `{"warning": …}` under `--json`.
pub(crate) fn warn(format: Format, message: &str) {
    let message = one_line(message);
    let line = if format.is_json() {
        json!({ "warning": message }).to_string()
    } else {
        format!("warning: {message}")
    };
    let _ = writeln!(io::stderr(), "{line}");
}

/// Exit 1 with a count if records were skipped as damaged.
pub(crate) fn damaged_outcome(damaged: u64) -> Outcome {
    if damaged == 0 {
        return Ok(ExitCode::SUCCESS);
    }
    Err(fail(
        EXIT_PROBLEM,
        "damaged",
        format!(
            "{damaged} damaged record{} skipped; run `idempotency-store verify`",
            plural(damaged)
        ),
    ))
}
