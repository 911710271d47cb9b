//! `idempotency-store`: the operator CLI for an idempotency-store file or PostgreSQL table.
//!
//! ```text
//! idempotency-store stats   PATH
//! idempotency-store get     PATH KEY [--scope S]
//! idempotency-store list    PATH [--state in-progress|completed|expired] [--stuck] [--limit N]
//! idempotency-store release PATH KEY [--scope S] [--yes] [--allow-new-key-may-charge-twice]
//! idempotency-store sweep   PATH
//! idempotency-store verify  PATH
//! idempotency-store export  PATH [--jsonl]
//! ```
//!
//! `--help` carries everything an installed binary needs (PATH forms, guarantees, exit codes,
//! error kinds: [`LONG_HELP`]); `docs/cli.md` adds examples. Tables for people by default;
//! `--json` prints JSON for scripts, errors included (`export` always prints JSON lines). Times
//! in JSON are milliseconds since the Unix epoch (`*_ms`); in tables, UTC. Byte strings
//! (response bodies, header values, checkpoints) are standard padded base64 in JSON
//! (`*_base64`); fingerprints are lowercase hex of the 32-byte digest plus the algorithm version.
//!
//! The file is never created: a missing path is an error. The inspection commands (`stats`,
//! `get`, `list`, `verify`, `export`) open it read-only and never change a byte of it, so they
//! work on a read-only copy too. `release` and `sweep` write, but only after a read-only look
//! found nothing to refuse, so a command that fails or is refused leaves the file as it was;
//! they keep the rows of the application's effect tables that the log may hold
//! (`StoreBuilder::keep_unregistered_effects`). The file must not be open in a running service
//! (which holds it): stop the service, or work on a copy.
//!
//! PATH may instead be a PostgreSQL connection string: a `postgres://` or `postgresql://` URL,
//! or `key=value` pairs (`host=… dbname=…`), TLS by its `sslmode` as `PgStore` reads it. Every
//! command then works on that database's `PgStore` table (in the schema given by `--schema`,
//! default `public`), with the same output and exit codes. The database is shared with the
//! running services, so nothing needs stopping; `list` and `export` walk the table in key
//! order. No command creates or migrates a schema (`PgStoreBuilder::migrate(false)`).
#![forbid(unsafe_code)]

mod format;
mod inspect;
mod maintain;
mod output;
mod records;
mod release;
mod target;

use std::io::{self, BufWriter, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::inspect::Filter;
use crate::output::{EXIT_FAILED, Fail, Format, Outcome, fail, print_error};
use crate::target::Source;

/// What `--help` says after the commands: all an installed binary's user needs.
const LONG_HELP: &str = "\
PATH is a store file, or a PostgreSQL connection string: a URL
(postgresql://user:password@host/db?sslmode=verify-full) or key=value pairs
(\"host=127.0.0.1 port=5432 user=idem dbname=idem\"), with --schema NAME if the store's
table is not in the schema `public`.

Looking never changes the store:
  stats, get, list, verify and export open a file read-only and change no byte of it (a
  file left by a crash is replayed in memory). release and sweep write, and only after a
  read-only look found nothing to refuse: a command that fails or is refused leaves the
  file byte for byte as it was (short of an I/O failure while it writes). Rows of the
  application's effect tables that a crash left in the log are left out by inspection,
  and kept by release and sweep for the application's next open. The file is never
  created, and cannot be opened while a service holds it: stop the service, or work on a
  copy.
  On PostgreSQL nothing needs stopping, and no command creates or migrates a schema: a
  missing schema, or one at another migration than this build's, is an error (exit 2,
  kind not-a-store). Use the CLI of the version the services run.

Intents of the client's outbox (records of the scope idempotency-client: a device's
outbound payments, resent with the same key until answered) are shown with their key and
state, never as stuck. release refuses one unless given --allow-new-key-may-charge-twice:
its operation would be begun again under a new key, and a payment that reached the server
would be charged twice.

Exit codes:
  0  done; also release answered \"no\" (nothing released), --help, --version
  1  done, but the answer is a problem: verify found problems (or the file is damaged or
     not a store), list or export skipped damaged records, get found no record
  2  could not do it: usage error, missing file, already open, not a store (or PostgreSQL
     schema missing or at another migration), storage failure, release refused

Errors are one line on stderr, `error: ...`. With --json, stdout is JSON and an error is one
JSON line on stderr, {\"error\": \"...\", \"kind\": \"...\"}, its kind one of: usage,
invalid-key, no-file, not-a-file, already-open, not-a-store, corrupted, storage, refused,
no-record, problems, damaged, output, internal.

Examples of every command's output: docs/cli.md in the source repository.";

#[derive(Parser)]
#[command(
    name = "idempotency-store",
    version,
    about = "Inspect and maintain an idempotency store: a store file or a PostgreSQL table",
    after_help = "Exit codes: 0 done; 1 done, but a problem found (verify, damaged records \
                  skipped, get: no record); 2 could not do it. --help says more (PATH forms, \
                  what never changes, error kinds).",
    after_long_help = LONG_HELP
)]
struct Cli {
    /// Print JSON for scripts instead of tables; errors and warnings become JSON lines on
    /// stderr.
    #[arg(long, global = true)]
    json: bool,
    /// With a PostgreSQL connection string as PATH: the schema holding the store's table.
    #[arg(long, global = true, default_value = "public")]
    schema: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Count records by state (a full scan) and show the store's size (the file's, or on
    /// PostgreSQL the table's).
    Stats {
        /// The store file, or a PostgreSQL connection string.
        path: PathBuf,
    },
    /// Show one key's record, expired or not, with its stored response.
    Get {
        /// The store file, or a PostgreSQL connection string.
        path: PathBuf,
        /// The idempotency key.
        key: String,
        /// The key's scope (tenant, client), if it was stored with one.
        #[arg(long)]
        scope: Option<String>,
    },
    /// List records oldest first, by creation time (all of them, expired ones included,
    /// unless filtered); intents of the client's outbox with their state and the key they
    /// sent.
    ///
    /// Keys and scopes longer than 64 characters are cut to 63 and `…` in the table; `--full`
    /// (or `get`, or `--json`) shows them whole.
    List {
        /// The store file, or a PostgreSQL connection string.
        path: PathBuf,
        /// Only records in this state (in-progress includes stuck ones; expired ones are listed
        /// only with `expired`).
        #[arg(long, value_enum)]
        state: Option<StateFilter>,
        /// Only in-progress records whose lease has lapsed.
        #[arg(long)]
        stuck: bool,
        /// At most this many records.
        #[arg(long, value_name = "N")]
        limit: Option<usize>,
        /// Show long keys and scopes whole instead of cutting them at 64 characters.
        #[arg(long)]
        full: bool,
    },
    /// Delete a key's in-progress record so that the next retry runs the operation afresh.
    ///
    /// DANGER: this bypasses the lease. If the attempt holding the key is still running, or its
    /// side effect already happened downstream, the retry runs the operation AGAIN (for example
    /// a second charge). Check downstream first. Completed records are never released, nor
    /// intents of the client's outbox (scope `idempotency-client`) without
    /// --allow-new-key-may-charge-twice. Asks for confirmation on the terminal unless --yes;
    /// answering anything but y/yes releases nothing and exits 0.
    Release {
        /// The store file, or a PostgreSQL connection string.
        path: PathBuf,
        /// The idempotency key.
        key: String,
        /// The key's scope, if it was stored with one.
        #[arg(long)]
        scope: Option<String>,
        /// Do not ask for confirmation (required when stdin is not a terminal).
        #[arg(long, short = 'y')]
        yes: bool,
        /// Release an outbound intent of the client's outbox too. Its operation is then begun
        /// again under a NEW key: if a send reached the server, it is carried out twice.
        #[arg(long)]
        allow_new_key_may_charge_twice: bool,
    },
    /// Delete every expired record and print how many were deleted.
    ///
    /// On a file it first looks read-only, so a file that cannot be swept is left as it was.
    Sweep {
        /// The store file, or a PostgreSQL connection string.
        path: PathBuf,
    },
    /// Check every invariant of the store; exit code 1 and a list if anything is wrong.
    Verify {
        /// The store file, or a PostgreSQL connection string.
        path: PathBuf,
    },
    /// Write every record (expired ones included) to stdout, one JSON object per line.
    ///
    /// Fields: key, scope (or null), state (in-progress | completed), stuck, expired, attempt,
    /// fingerprint (hex digest), fingerprint_version, created_at_ms, expires_at_ms,
    /// lease_until_ms, completed_at_ms, status, checkpoint_base64, and response (null while in
    /// progress) with status, headers [{name, value_base64}] and body_base64. Times are
    /// milliseconds since the Unix epoch; bytes are standard padded base64.
    Export {
        /// The store file, or a PostgreSQL connection string.
        path: PathBuf,
        /// JSON lines: the default, and the only format so far (accepted so that scripts can
        /// name it).
        #[arg(long)]
        jsonl: bool,
    },
}

/// The `--state` of `list`.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum StateFilter {
    /// Held by an attempt (including stuck ones), not expired.
    InProgress,
    /// Response stored, not expired.
    Completed,
    /// Past its expiry, waiting for a sweep.
    Expired,
}

fn main() -> ExitCode {
    // The library turns a panic inside redb on a damaged file into an error; keep the default
    // hook from printing it (and a backtrace hint) on the way.
    std::panic::set_hook(Box::new(|_| {}));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return usage_error(&err),
    };
    let format = if cli.json {
        Format::Json
    } else {
        Format::Table
    };
    let result = std::panic::catch_unwind(|| run(&cli, format)).unwrap_or_else(|payload| {
        let text = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(fail(
            EXIT_FAILED,
            "internal",
            format!("internal error: {text}"),
        ))
    });
    match result {
        Ok(code) => code,
        Err(Fail {
            code,
            kind,
            message,
        }) => {
            if let Some(message) = message {
                print_error(format, kind, &message);
            }
            ExitCode::from(code)
        }
    }
}

/// Prints clap's answer (usage error, or `--help`/`--version` on stdout, exit 0); a usage
/// error is a JSON line if `--json` is among the arguments.
fn usage_error(err: &clap::Error) -> ExitCode {
    let code = ExitCode::from(u8::try_from(err.exit_code()).unwrap_or(EXIT_FAILED));
    if err.use_stderr() && std::env::args_os().any(|arg| arg == "--json") {
        let text = err.render().to_string();
        let first = text.lines().next().unwrap_or_default();
        print_error(
            Format::Json,
            "usage",
            first.strip_prefix("error: ").unwrap_or(first),
        );
    } else {
        let _ = err.print();
    }
    code
}

fn run(cli: &Cli, format: Format) -> Outcome {
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let schema = cli.schema.as_str();
    let code = match &cli.command {
        Command::Stats { path } => inspect::stats(&mut out, format, Source::new(path, schema)),
        Command::Get { path, key, scope } => inspect::get(
            &mut out,
            format,
            Source::new(path, schema),
            key,
            scope.as_deref(),
        ),
        Command::List {
            path,
            state,
            stuck,
            limit,
            full,
        } => {
            let filter = Filter {
                state: *state,
                stuck: *stuck,
                limit: *limit,
            };
            inspect::list(&mut out, format, Source::new(path, schema), filter, *full)
        }
        Command::Release {
            path,
            key,
            scope,
            yes,
            allow_new_key_may_charge_twice,
        } => {
            let options = release::Options {
                yes: *yes,
                intents: *allow_new_key_may_charge_twice,
            };
            release::release(
                &mut out,
                format,
                Source::new(path, schema),
                key,
                scope.as_deref(),
                options,
            )
        }
        Command::Sweep { path } => maintain::sweep(&mut out, format, Source::new(path, schema)),
        Command::Verify { path } => maintain::verify(&mut out, format, Source::new(path, schema)),
        Command::Export { path, jsonl: _ } => {
            inspect::export(&mut out, format, Source::new(path, schema))
        }
    };
    // Whatever was printed before a failure still goes out.
    let flushed = out.flush();
    let code = code?;
    flushed?;
    Ok(code)
}
