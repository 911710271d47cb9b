//! `idempotency-store`: the operator CLI for an idempotency-store file or PostgreSQL table.
//!
//! ```text
//! idempotency-store stats   PATH
//! idempotency-store get     PATH KEY [--scope S]
//! idempotency-store list    PATH [--state in-progress|completed|expired] [--stuck] [--limit N]
//! idempotency-store release PATH KEY [--scope S] [--yes]
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

use std::fmt::Write as _;
use std::io::{self, BufRead, BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use idempotency_store::{
    Error, ForceRelease, IdempotencyStore, Key, PgStore, RecordState, RecordView, SWEEP_BATCH,
    Stats, Store, Timestamp, VerifyReport,
};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};

const EXIT_PROBLEM: u8 = 1;
const EXIT_FAILED: u8 = 2;
/// `list` cuts keys and scopes longer than this (characters) unless `--full`.
const KEY_WIDTH: usize = 64;
/// The longest body, header value or checkpoint shown as text in `get` (characters).
const SHOW_TEXT: usize = 1000;

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
    /// List records in storage order, key order on PostgreSQL (all of them, expired ones
    /// included, unless filtered).
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
    /// a second charge). Check downstream first. Completed records are never released. Asks for
    /// confirmation on the terminal unless --yes; answering anything but y/yes releases
    /// nothing and exits 0.
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

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StateFilter {
    /// Held by an attempt (including stuck ones), not expired.
    InProgress,
    /// Response stored, not expired.
    Completed,
    /// Past its expiry, waiting for a sweep.
    Expired,
}

/// Why a command ends with a non-zero exit code (or ends early because stdout was closed).
struct Fail {
    code: u8,
    /// What kind of failure, for scripts (`kind` in the JSON error; docs/cli.md lists them).
    kind: &'static str,
    /// The one line printed to stderr after `error: `; `None` to end quietly.
    message: Option<String>,
}

fn fail(code: u8, kind: &'static str, message: impl Into<String>) -> Fail {
    Fail {
        code,
        kind,
        message: Some(one_line(&message.into())),
    }
}

/// Whether `--json` was given: errors and warnings are then JSON lines.
static JSON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();

fn json_output() -> bool {
    JSON.get().copied().unwrap_or(false)
}

/// An error line on stderr: `error: …`, or `{"error": …, "kind": …}` under `--json`.
fn print_error(kind: &str, message: &str) {
    let line = if json_output() {
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

type Outcome = Result<ExitCode, Fail>;

fn main() -> ExitCode {
    // The library turns a panic inside redb on a damaged file into an error; keep the default
    // hook from printing it (and a backtrace hint) on the way.
    std::panic::set_hook(Box::new(|_| {}));
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => return usage_error(&err),
    };
    let _ = JSON.set(cli.json);
    let result = std::panic::catch_unwind(|| run(&cli)).unwrap_or_else(|payload| {
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
                print_error(kind, &message);
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
        let _ = JSON.set(true);
        let text = err.render().to_string();
        let first = text.lines().next().unwrap_or_default();
        print_error("usage", first.strip_prefix("error: ").unwrap_or(first));
    } else {
        let _ = err.print();
    }
    code
}

fn run(cli: &Cli) -> Outcome {
    let _ = SCHEMA.set(cli.schema.clone());
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let code = match &cli.command {
        Command::Stats { path } => stats(&mut out, cli.json, path),
        Command::Get { path, key, scope } => get(&mut out, cli.json, path, key, scope.as_deref()),
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
            list(&mut out, cli.json, path, filter, *full)
        }
        Command::Release {
            path,
            key,
            scope,
            yes,
        } => release(&mut out, cli.json, path, key, scope.as_deref(), *yes),
        Command::Sweep { path } => sweep(&mut out, cli.json, path),
        Command::Verify { path } => verify(&mut out, cli.json, path),
        Command::Export { path, jsonl: _ } => export(&mut out, path),
    };
    // Whatever was printed before a failure still goes out.
    let flushed = out.flush();
    let code = code?;
    flushed?;
    Ok(code)
}

// ----- commands -------------------------------------------------------------------------------

fn stats(out: &mut dyn Write, as_json: bool, path: &Path) -> Outcome {
    let store = open(path)?;
    let s: Stats = store.stats().map_err(|e| store_fail(path, &e))?;
    let total = s.in_progress + s.completed + s.expired;
    let (size_name, size_field) = store.size_names();
    if as_json {
        let mut value = json!({
            "records": total,
            "in_progress": s.in_progress,
            "stuck": s.stuck,
            "completed": s.completed,
            "expired": s.expired,
        });
        if let Value::Object(map) = &mut value {
            map.insert(size_field.into(), json!(s.file_bytes));
            if let Target::Pg(pg) = &store {
                let failover = pg.failover_safety_at_connect();
                map.insert("failover_safe".into(), json!(failover.is_failover_safe()));
                map.insert("replication".into(), json!(failover.to_string()));
            }
        }
        writeln!(out, "{value}")?;
    } else {
        let stuck = if s.stuck > 0 {
            format!(
                "({} stuck: lease lapsed, waiting for a retry or `release`)",
                s.stuck
            )
        } else {
            String::new()
        };
        let row = |name: &str, count: u64, note: &str| {
            vec![name.to_owned(), count.to_string(), note.to_owned()]
        };
        let rows = [
            row("in progress", s.in_progress, &stuck),
            row("completed", s.completed, ""),
            row("expired", s.expired, "(deleted by the next sweep)"),
            row("total", total, ""),
        ];
        table(out, &["STATE", "RECORDS", ""], &rows)?;
        if let Some(bytes) = s.file_bytes {
            writeln!(out, "\n{size_name}: {} ({bytes} bytes)", human_bytes(bytes))?;
        }
        if let Target::Pg(pg) = &store {
            writeln!(out, "replication: {}", pg.failover_safety_at_connect())?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn get(out: &mut dyn Write, as_json: bool, path: &Path, key: &str, scope: Option<&str>) -> Outcome {
    let key = make_key(key, scope)?;
    let store = open(path)?;
    let now = store.now().map_err(|e| store_fail(path, &e))?;
    let Some(record) = store.inspect(&key).map_err(|e| store_fail(path, &e))? else {
        return Err(fail(
            EXIT_PROBLEM,
            "no-record",
            format!(
                "no record for key {}{}",
                shown(&key),
                quote_hint(&store, &key, "get")
            ),
        ));
    };
    if as_json {
        writeln!(out, "{}", record_json(&key, &record, now, true))?;
        return Ok(ExitCode::SUCCESS);
    }
    let when = |t: Timestamp| format!("{} ({})", utc(t), relative(t, now));
    let mut rows: Vec<[String; 2]> = vec![
        ["key".into(), key.key().into()],
        ["scope".into(), key.scope().unwrap_or("-").into()],
        ["state".into(), label(&record, now).into()],
        ["attempt".into(), record.attempt.to_string()],
        [
            "fingerprint".into(),
            format!(
                "v{} {}",
                record.fingerprint.version(),
                hex(record.fingerprint.digest())
            ),
        ],
        ["created".into(), when(record.created_at)],
    ];
    match &record.state {
        RecordState::InProgress {
            lease_until,
            checkpoint,
        } => {
            let lease = if *lease_until > now {
                format!(
                    "{} (live for {} more)",
                    utc(*lease_until),
                    span(*lease_until, now)
                )
            } else {
                format!(
                    "{} (lapsed {} ago)",
                    utc(*lease_until),
                    span(now, *lease_until)
                )
            };
            rows.push(["lease until".into(), lease]);
            rows.push(["expires".into(), when(record.expires_at)]);
            rows.push([
                "checkpoint".into(),
                checkpoint
                    .as_deref()
                    .map_or_else(|| "-".into(), shown_bytes),
            ]);
        }
        RecordState::Completed {
            completed_at,
            response,
        } => {
            rows.push(["completed".into(), when(*completed_at)]);
            rows.push(["expires".into(), when(record.expires_at)]);
            rows.push(["status".into(), response.status.to_string()]);
            for (name, value) in &response.headers {
                rows.push([
                    "header".into(),
                    format!(
                        "{name}: {}",
                        printable(value).unwrap_or_else(|| shown_bytes(value))
                    ),
                ]);
            }
            rows.push(["body".into(), shown_bytes(&response.body)]);
        }
        // A state a later library version adds: shown by name only.
        _ => rows.push(["state".into(), format!("{:?}", record.state)]),
    }
    for [name, value] in rows {
        writeln!(out, "{name:<12} {value}")?;
    }
    Ok(ExitCode::SUCCESS)
}

/// Which records `list` shows.
struct Filter {
    state: Option<StateFilter>,
    stuck: bool,
    limit: Option<usize>,
}

fn list(out: &mut dyn Write, as_json: bool, path: &Path, filter: Filter, full: bool) -> Outcome {
    let Filter {
        state,
        stuck,
        limit,
    } = filter;
    if stuck && matches!(state, Some(StateFilter::Completed | StateFilter::Expired)) {
        return Err(fail(
            EXIT_FAILED,
            "usage",
            "--stuck selects in-progress records; it cannot be combined with that --state",
        ));
    }
    let store = open(path)?;
    let now = store.now().map_err(|e| store_fail(path, &e))?;
    let limit = limit.unwrap_or(usize::MAX);
    let mut shown = Vec::new();
    let mut more = false;
    let mut damaged = 0u64;
    for item in store.records().map_err(|e| store_fail(path, &e))? {
        let entry = match item {
            Ok(entry) => entry,
            Err(err) => {
                damaged += 1;
                warn(&format!("skipped: {}", describe(&err)));
                continue;
            }
        };
        let r = &entry.record;
        let expired = r.expires_at <= now;
        let keep = match state {
            None => true,
            Some(StateFilter::Expired) => expired,
            Some(StateFilter::InProgress) => !expired && lease(r).is_some(),
            Some(StateFilter::Completed) => !expired && lease(r).is_none(),
        } && (!stuck || r.is_stuck(now));
        if !keep {
            continue;
        }
        if shown.len() == limit {
            more = true;
            break;
        }
        shown.push(entry);
    }
    if as_json {
        let rows: Vec<Value> = shown
            .iter()
            .map(|e| record_json(&e.key, &e.record, now, false))
            .collect();
        writeln!(out, "{}", Value::Array(rows))?;
    } else if shown.is_empty() {
        writeln!(out, "no matching records")?;
    } else {
        let width = if full { usize::MAX } else { KEY_WIDTH };
        let mut cut = false;
        let mut fit = |text: &str| {
            let (text, was_cut) = truncate(text, width);
            cut |= was_cut;
            text
        };
        let rows: Vec<Vec<String>> = shown
            .iter()
            .map(|e| {
                let r = &e.record;
                let (until, status) = match &r.state {
                    RecordState::InProgress { lease_until, .. } => (utc(*lease_until), "-".into()),
                    RecordState::Completed {
                        completed_at,
                        response,
                    } => (utc(*completed_at), response.status.to_string()),
                    _ => ("-".into(), "-".into()),
                };
                vec![
                    fit(e.key.key()),
                    fit(e.key.scope().unwrap_or("-")),
                    label(r, now).to_owned(),
                    r.attempt.to_string(),
                    utc(r.created_at),
                    until,
                    utc(r.expires_at),
                    status,
                ]
            })
            .collect();
        table(
            out,
            &[
                "KEY",
                "SCOPE",
                "STATE",
                "ATTEMPT",
                "CREATED (UTC)",
                "LEASE UNTIL / COMPLETED",
                "EXPIRES",
                "STATUS",
            ],
            &rows,
        )?;
        if cut {
            warn(&format!(
                "keys or scopes longer than {KEY_WIDTH} characters are cut short (…); \
                 `--full` shows them whole, `get` shows one record"
            ));
        }
    }
    if more {
        warn(&format!(
            "showing the first {limit} matching records; more match (raise --limit)"
        ));
    }
    damaged_outcome(damaged)
}

fn release(
    out: &mut dyn Write,
    as_json: bool,
    path: &Path,
    key: &str,
    scope: Option<&str>,
    yes: bool,
) -> Outcome {
    let key = make_key(key, scope)?;
    // Decided on a read-only look: a refusal, or a "no" at the prompt, leaves a file as it was.
    let looked = open(path)?;
    let now = looked.now().map_err(|e| store_fail(path, &e))?;
    let (record, lease_until) = releasable(&looked, path, &key, now)?;
    if !yes && !confirmed(&key, &record, lease_until, now)? {
        // The operator's decision, not a failure.
        if as_json {
            let value = json!({ "released": false, "key": key.key(), "scope": key.scope() });
            writeln!(out, "{value}")?;
        } else {
            writeln!(out, "nothing released")?;
        }
        return Ok(ExitCode::SUCCESS);
    }
    let store = looked.for_writing(path)?;
    let released = store
        .force_release(&key)
        .map_err(|e| store_fail(path, &e))?;
    store.finish(path);
    match released {
        ForceRelease::Released {
            attempt,
            lease_until,
        } => {
            if as_json {
                let value = json!({
                    "released": true,
                    "key": key.key(),
                    "scope": key.scope(),
                    "attempt": attempt,
                    "lease_until_ms": lease_until.as_millis(),
                    "lease_was_live": lease_until > now,
                });
                writeln!(out, "{value}")?;
            } else {
                writeln!(
                    out,
                    "released key {} (attempt {attempt}); the next claim runs the operation afresh",
                    shown(&key)
                )?;
            }
            Ok(ExitCode::SUCCESS)
        }
        ForceRelease::Completed => Err(fail(
            EXIT_FAILED,
            "refused",
            format!(
                "key {} completed meanwhile; nothing was changed",
                shown(&key)
            ),
        )),
        _ => Err(fail(
            EXIT_FAILED,
            "refused",
            format!("key {} is gone meanwhile; nothing was changed", shown(&key)),
        )),
    }
}

/// The key's record and its lease deadline, if `release` may delete it: it exists, has not
/// expired and is in progress.
fn releasable(
    store: &Target,
    path: &Path,
    key: &Key,
    now: Timestamp,
) -> Result<(RecordView, Timestamp), Fail> {
    let record = store.inspect(key).map_err(|e| store_fail(path, &e))?;
    let Some(record) = record.filter(|r| r.expires_at > now) else {
        return Err(fail(
            EXIT_FAILED,
            "no-record",
            format!(
                "no record for key {} (nothing to release){}",
                shown(key),
                quote_hint(store, key, "release")
            ),
        ));
    };
    let Some(lease_until) = lease(&record) else {
        return Err(fail(
            EXIT_FAILED,
            "refused",
            format!(
                "refusing to release key {}: it is completed and replays its response; \
                 release only un-sticks in-progress keys",
                shown(key)
            ),
        ));
    };
    Ok((record, lease_until))
}

/// Asks on the terminal whether to release the key; refuses without a terminal.
fn confirmed(
    key: &Key,
    record: &RecordView,
    lease_until: Timestamp,
    now: Timestamp,
) -> Result<bool, Fail> {
    if !io::stdin().is_terminal() {
        return Err(fail(
            EXIT_FAILED,
            "refused",
            format!(
                "refusing to release key {} without confirmation: stdin is not a terminal; \
                 check downstream, then pass --yes",
                shown(key)
            ),
        ));
    }
    let holder = if lease_until > now {
        format!(
            "its lease is LIVE for {} more: attempt {} may still be running",
            span(lease_until, now),
            record.attempt
        )
    } else {
        format!(
            "its lease lapsed {} ago (attempt {})",
            span(now, lease_until),
            record.attempt
        )
    };
    let mut err = io::stderr().lock();
    write!(
        err,
        "Key {} is in progress; {holder}.\nReleasing deletes the record without the lease: \
         the next retry runs the operation AGAIN.\nIf the operation (or its side effect) \
         may have happened, it will happen twice. Check downstream first.\n\
         Release key {}? [y/N] ",
        shown(key),
        shown(key)
    )?;
    err.flush()?;
    let mut answer = String::new();
    io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

fn sweep(out: &mut dyn Write, as_json: bool, path: &Path) -> Outcome {
    // A file that does not open read-only is left as it was.
    let store = open(path)?.for_writing(path)?;
    let mut total = 0u64;
    // The bar appears only once a second batch is needed (long work), on a terminal.
    let mut bar: Option<ProgressBar> = None;
    let result = loop {
        match store.sweep(SWEEP_BATCH) {
            Ok(n) => {
                total += n as u64;
                if n < SWEEP_BATCH {
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
    if let Err(err) = result {
        return Err(fail(
            EXIT_FAILED,
            error_kind(&err),
            format!(
                "{}: {} (after deleting {total} expired records)",
                shown_path(path),
                describe(&err)
            ),
        ));
    }
    store.finish(path);
    if as_json {
        writeln!(out, "{}", json!({ "swept": total }))?;
    } else {
        writeln!(out, "deleted {total} expired record{}", plural(total))?;
    }
    Ok(ExitCode::SUCCESS)
}

fn verify(out: &mut dyn Write, as_json: bool, path: &Path) -> Outcome {
    // A file that does not open as a store, or a walk that meets damage, is a problem with the
    // store (exit 1); one that cannot be looked at (already open, I/O) is not (exit 2), and
    // neither is a PostgreSQL schema that is missing or at another migration.
    let walked = match connection_string(path) {
        Some(conninfo) => pg_store(conninfo)
            .map_err(|e| store_fail(path, &e))?
            .verify(),
        None => {
            check_exists(path)?;
            Store::builder()
                .open_read_only(path)
                .and_then(|store| store.verify())
        }
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
    if as_json {
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

fn export(out: &mut dyn Write, path: &Path) -> Outcome {
    let store = open(path)?;
    let now = store.now().map_err(|e| store_fail(path, &e))?;
    let mut damaged = 0u64;
    for item in store.records().map_err(|e| store_fail(path, &e))? {
        match item {
            Ok(entry) => writeln!(out, "{}", record_json(&entry.key, &entry.record, now, true))?,
            Err(err) => {
                damaged += 1;
                warn(&format!("not exported: {}", describe(&err)));
            }
        }
    }
    damaged_outcome(damaged)
}

// ----- opening and errors ---------------------------------------------------------------------

/// Fails unless `path` is an existing regular file: `Store::open` would create it.
fn check_exists(path: &Path) -> Result<(), Fail> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_dir() => Err(fail(
            EXIT_FAILED,
            "not-a-file",
            format!("{}: is a directory, not a store file", path.display()),
        )),
        Ok(_) => Ok(()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Err(fail(
            EXIT_FAILED,
            "no-file",
            format!("{}: no such file", path.display()),
        )),
        Err(err) => Err(fail(
            EXIT_FAILED,
            "storage",
            format!("{}: {err}", path.display()),
        )),
    }
}

/// The PostgreSQL schema (`--schema`), for stores opened from a URL.
static SCHEMA: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// An opened store: a file, or a table on a PostgreSQL server.
enum Target {
    File(Box<Store>),
    Pg(Box<PgStore>),
}

/// One record with its key, as `list` and `export` walk them.
struct Entry {
    key: Key,
    record: RecordView,
}

type Walk<'a> = Box<dyn Iterator<Item = Result<Entry, Error>> + 'a>;

impl std::ops::Deref for Target {
    type Target = dyn IdempotencyStore;

    fn deref(&self) -> &Self::Target {
        match self {
            Target::File(store) => &**store,
            Target::Pg(store) => &**store,
        }
    }
}

impl Target {
    /// The store for a command that writes, once a read-only look at it found nothing to
    /// refuse: a file is opened again, writable; a PostgreSQL store is the same.
    fn for_writing(self, path: &Path) -> Result<Target, Fail> {
        match self {
            Target::File(looked) => {
                // The look's shared lock must go before the writable open can lock the file.
                drop(looked);
                Store::builder()
                    .create_if_missing(false)
                    // The application's effect rows in the log: kept for its next open.
                    .keep_unregistered_effects(true)
                    .open(path)
                    .map(|store| Target::File(Box::new(store)))
                    .map_err(|e| store_fail(path, &e))
            }
            pg @ Target::Pg(_) => Ok(pg),
        }
    }

    /// Closes a file after a write with its last merge. That merge failing loses nothing (the
    /// log holds every change, and the next open replays it), so it is only a warning.
    fn finish(self, path: &Path) {
        if let Target::File(store) = self
            && let Err(err) = store.close()
        {
            warn(&format!(
                "{}: closing the file: {} (the changes are in its log; the next open replays \
                 them)",
                path.display(),
                describe(&err)
            ));
        }
    }

    /// What the size in `Stats::file_bytes` is called, in tables and in JSON.
    fn size_names(&self) -> (&'static str, &'static str) {
        match self {
            Target::File(_) => ("file size", "file_bytes"),
            Target::Pg(_) => ("table size", "table_bytes"),
        }
    }

    fn now(&self) -> Result<Timestamp, Error> {
        match self {
            Target::File(store) => Ok(Store::now(store)),
            Target::Pg(store) => store.now(),
        }
    }

    fn inspect(&self, key: &Key) -> Result<Option<RecordView>, Error> {
        match self {
            Target::File(store) => store.inspect(key),
            Target::Pg(store) => store.inspect(key),
        }
    }

    fn force_release(&self, key: &Key) -> Result<ForceRelease, Error> {
        match self {
            Target::File(store) => store.force_release(key),
            Target::Pg(store) => store.force_release(key),
        }
    }

    fn records(&self) -> Result<Walk<'_>, Error> {
        Ok(match self {
            Target::File(store) => Box::new(store.records()?.map(|item| {
                item.map(|e| Entry {
                    key: e.key,
                    record: e.record,
                })
            })),
            Target::Pg(store) => Box::new(
                store
                    .records()?
                    .map(|item| item.map(|(key, record)| Entry { key, record })),
            ),
        })
    }
}

/// libpq's connection keywords (those the `postgres` client reads, and `sslrootcert`): a
/// PATH that starts with one of them and `=` is a key=value connection string.
const PG_KEYWORDS: [&str; 19] = [
    "host",
    "hostaddr",
    "port",
    "dbname",
    "user",
    "password",
    "options",
    "application_name",
    "sslmode",
    "sslrootcert",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "channel_binding",
    "load_balance_hosts",
];

/// `path` as a PostgreSQL connection string, if it is one: a `postgres://` or
/// `postgresql://` URL, or key=value pairs (`host=… dbname=…`).
fn connection_string(path: &Path) -> Option<&str> {
    let text = path.to_str()?;
    let url = text.starts_with("postgres://") || text.starts_with("postgresql://");
    let pairs = text
        .split_once('=')
        .is_some_and(|(key, _)| PG_KEYWORDS.contains(&key.trim()));
    (url || pairs).then_some(text)
}

/// The PostgreSQL store at `conninfo`, checked but never created or migrated: the CLI must
/// not change a schema that older instances may still run on.
fn pg_store(conninfo: &str) -> Result<PgStore, Error> {
    let schema = SCHEMA.get().map_or("public", String::as_str);
    PgStore::builder()
        .schema(schema)
        .migrate(false)
        .pool_size(1)
        .connection_timeout(Duration::from_secs(10))
        .connect(conninfo)
}

/// Opens the store for a look: a file read-only, never changed. A command that writes then
/// asks [`Target::for_writing`].
fn open(path: &Path) -> Result<Target, Fail> {
    if let Some(conninfo) = connection_string(path) {
        return pg_store(conninfo)
            .map(|store| Target::Pg(Box::new(store)))
            .map_err(|e| store_fail(path, &e));
    }
    check_exists(path)?;
    Store::builder()
        .open_read_only(path)
        .map(|store| Target::File(Box::new(store)))
        .map_err(|e| store_fail(path, &e))
}

/// `path` for messages: a connection string without its password.
fn shown_path(path: &Path) -> String {
    let Some(conninfo) = connection_string(path) else {
        return path.display().to_string();
    };
    let Some((scheme, rest)) = conninfo.split_once("://") else {
        return pairs_without_password(conninfo);
    };
    let (authority, tail) = rest.split_once('/').map_or((rest, ""), |(a, t)| (a, t));
    let authority = match authority.rsplit_once('@') {
        Some((user, host)) => {
            let user = user.split_once(':').map_or(user, |(name, _)| name);
            format!("{user}@{host}")
        }
        None => authority.to_owned(),
    };
    let tail = tail.split_once('?').map_or(tail, |(t, _)| t);
    format!("{scheme}://{authority}/{tail}")
}

/// key=value pairs without the `password` pair (a value may be quoted: `'a b'`, `'it\'s'`).
fn pairs_without_password(conninfo: &str) -> String {
    let mut shown = Vec::new();
    let mut rest = conninfo.trim_start();
    while let Some((key, after)) = rest.split_once('=') {
        let (value, tail) = pair_value(after.trim_start());
        if key.trim() != "password" {
            shown.push(format!("{}={value}", key.trim()));
        }
        rest = tail.trim_start();
    }
    shown.join(" ")
}

/// The value that starts `text` (quoted, or up to the next whitespace), as written, and what
/// follows it.
fn pair_value(text: &str) -> (&str, &str) {
    let Some(quoted) = text.strip_prefix('\'') else {
        return text.split_at(text.find(char::is_whitespace).unwrap_or(text.len()));
    };
    let mut escaped = false;
    for (i, c) in quoted.char_indices() {
        match c {
            '\\' if !escaped => escaped = true,
            '\'' if !escaped => return text.split_at(i + 2),
            _ => escaped = false,
        }
    }
    (text, "")
}

fn store_fail(path: &Path, err: &Error) -> Fail {
    let message = match err {
        Error::AlreadyOpen => format!(
            "{}: the store file is already open in another process (is the service running?); \
             stop it, or run this on a copy of the file",
            path.display()
        ),
        Error::NotAStore { .. } if connection_string(path).is_some() => format!(
            "{}: {}; idempotency-store never creates or migrates a schema",
            shown_path(path),
            describe(err)
        ),
        other => format!("{}: {}", shown_path(path), describe(other)),
    };
    fail(EXIT_FAILED, error_kind(err), message)
}

/// The `kind` of a library error in a JSON error line.
fn error_kind(err: &Error) -> &'static str {
    match err {
        Error::AlreadyOpen => "already-open",
        Error::NotAStore { .. } => "not-a-store",
        Error::Corrupted { .. } => "corrupted",
        Error::InvalidKey { .. } => "invalid-key",
        _ => "storage",
    }
}

/// For a key that was not found and is wrapped in quotes: a hint that the quotes are part of
/// it. An `Idempotency-Key` header carries the key as a quoted string, and the HTTP mapping
/// stores it without the quotes; copied from the header, the quotes come along.
fn quote_hint(store: &Target, key: &Key, command: &str) -> String {
    let text = key.key();
    let inner = ['"', '\''].iter().find_map(|&q| {
        text.strip_prefix(q)
            .and_then(|rest| rest.strip_suffix(q))
            .filter(|inner| !inner.is_empty())
    });
    let Some(inner) = inner else {
        return String::new();
    };
    let bare = match key.scope() {
        Some(scope) => Key::scoped(scope, inner),
        None => Key::new(inner),
    };
    let found = bare
        .ok()
        .and_then(|bare| store.inspect(&bare).ok())
        .is_some_and(|record| record.is_some());
    let scope = key
        .scope()
        .map(|scope| format!(" --scope {scope}"))
        .unwrap_or_default();
    format!(
        "; the quotes are part of the key you gave: an Idempotency-Key header quotes its key, \
         and the store keeps it without the quotes ({}: {command} PATH {inner}{scope})",
        if found {
            "there is a record without them"
        } else {
            "try without them"
        }
    )
}

/// The error and its causes on one line.
fn describe(err: &Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    one_line(&text)
}

fn one_line(text: &str) -> String {
    text.split(['\n', '\r'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}

/// A warning line on stderr: `warning: …`, or `{"warning": …}` under `--json`.
fn warn(message: &str) {
    let message = one_line(message);
    let line = if json_output() {
        json!({ "warning": message }).to_string()
    } else {
        format!("warning: {message}")
    };
    let _ = writeln!(io::stderr(), "{line}");
}

fn damaged_outcome(damaged: u64) -> Outcome {
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

fn make_key(key: &str, scope: Option<&str>) -> Result<Key, Fail> {
    match scope {
        Some(scope) => Key::scoped(scope, key),
        None => Key::new(key),
    }
    .map_err(|e| fail(EXIT_FAILED, "invalid-key", describe(&e)))
}

// ----- records --------------------------------------------------------------------------------

/// The lease deadline of an in-progress record.
fn lease(record: &RecordView) -> Option<Timestamp> {
    match record.state {
        RecordState::InProgress { lease_until, .. } => Some(lease_until),
        _ => None,
    }
}

fn label(record: &RecordView, now: Timestamp) -> &'static str {
    if record.expires_at <= now {
        "expired"
    } else if record.is_stuck(now) {
        "stuck"
    } else if lease(record).is_some() {
        "in-progress"
    } else {
        "completed"
    }
}

/// A record as JSON; `full` adds the checkpoint and the whole response (export, get).
fn record_json(key: &Key, record: &RecordView, now: Timestamp, full: bool) -> Value {
    let (state, lease_until, completed_at, status) = match &record.state {
        RecordState::InProgress { lease_until, .. } => {
            ("in-progress", Some(lease_until.as_millis()), None, None)
        }
        RecordState::Completed {
            completed_at,
            response,
        } => (
            "completed",
            None,
            Some(completed_at.as_millis()),
            Some(response.status),
        ),
        _ => ("unknown", None, None, None),
    };
    let mut value = json!({
        "key": key.key(),
        "scope": key.scope(),
        "state": state,
        "stuck": record.is_stuck(now),
        "expired": record.expires_at <= now,
        "attempt": record.attempt,
        "fingerprint": hex(record.fingerprint.digest()),
        "fingerprint_version": record.fingerprint.version(),
        "created_at_ms": record.created_at.as_millis(),
        "expires_at_ms": record.expires_at.as_millis(),
        "lease_until_ms": lease_until,
        "completed_at_ms": completed_at,
        "status": status,
    });
    if full && let Value::Object(map) = &mut value {
        let (checkpoint, response) = match &record.state {
            RecordState::InProgress { checkpoint, .. } => {
                (checkpoint.as_deref().map(base64), Value::Null)
            }
            RecordState::Completed { response, .. } => {
                let headers: Vec<Value> = response
                    .headers
                    .iter()
                    .map(|(name, value)| json!({ "name": name, "value_base64": base64(value) }))
                    .collect();
                let response = json!({
                    "status": response.status,
                    "headers": headers,
                    "body_base64": base64(&response.body),
                });
                (None, response)
            }
            _ => (None, Value::Null),
        };
        map.insert("checkpoint_base64".into(), json!(checkpoint));
        map.insert("response".into(), response);
    }
    value
}

/// `text` cut to `width` characters, its last one `…`, and whether it was cut.
fn truncate(text: &str, width: usize) -> (String, bool) {
    if text.chars().count() <= width {
        return (text.to_owned(), false);
    }
    let mut cut: String = text.chars().take(width.saturating_sub(1)).collect();
    cut.push('…');
    (cut, true)
}

fn shown(key: &Key) -> String {
    match key.scope() {
        Some(scope) => format!("{:?} (scope {scope:?})", key.key()),
        None => format!("{:?}", key.key()),
    }
}

// ----- formatting -----------------------------------------------------------------------------

fn table(out: &mut dyn Write, header: &[&str], rows: &[Vec<String>]) -> io::Result<()> {
    let cell = |row: &[String], i: usize| row.get(i).map_or(0, |c| c.chars().count());
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| cell(r, i))
                .chain([header.get(i).map_or(0, |h| h.len())])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// A timestamp as UTC, to the second: `2026-05-01T12:00:05Z`.
fn utc(t: Timestamp) -> String {
    let secs = t.as_millis() / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn relative(t: Timestamp, now: Timestamp) -> String {
    if t > now {
        format!("in {}", span(t, now))
    } else {
        format!("{} ago", span(now, t))
    }
}

/// `later - earlier`, coarsely: `59s`, `4m05s`, `3h02m`, `2d01h`.
fn span(later: Timestamp, earlier: Timestamp) -> String {
    let s = later.saturating_duration_since(earlier).as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{:02}m", s / 3600, s / 60 % 60),
        _ => format!("{}d{:02}h", s / 86_400, s / 3600 % 24),
    }
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS.get(unit).copied().unwrap_or("TiB"))
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// Printable text (control characters escaped), or `None` for bytes that are not UTF-8.
fn printable(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut shown = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == SHOW_TEXT {
            shown.push('…');
            break;
        }
        if c.is_control() {
            shown.extend(c.escape_default());
        } else {
            shown.push(c);
        }
    }
    Some(shown)
}

/// `17 bytes: {"id":"pay_1"}`, or a pointer to `--json` for binary data.
fn shown_bytes(bytes: &[u8]) -> String {
    let n = bytes.len();
    match printable(bytes) {
        Some(text) if !text.is_empty() => format!("{n} byte{}: {text}", plural(n as u64)),
        Some(_) => "0 bytes".to_owned(),
        None => format!("{n} bytes of binary data (`--json` shows them in base64)"),
    }
}

fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Standard base64 (RFC 4648 §4) with padding.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let byte = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (byte(0) << 16) | (byte(1) << 8) | byte(2);
        for i in 0..4 {
            if i <= chunk.len() {
                let sextet = (n >> (18 - 6 * i)) & 63;
                out.push(char::from(ALPHABET[sextet as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}
