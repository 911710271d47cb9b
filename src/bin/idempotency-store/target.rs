//! Opening the store a PATH names: a file (read-only for a look, writable for a change) or a
//! PostgreSQL table, and the errors of doing so.

use std::io;
use std::path::Path;
use std::time::Duration;

use idempotency_store::pg::{FailoverSafety, PgStore};
use idempotency_store::{Error, IdempotencyStore, Store};

use crate::output::{EXIT_FAILED, Fail, Format, describe, fail, warn};

/// Where a command works: PATH, and the PostgreSQL schema (`--schema`) if PATH is a
/// connection string.
#[derive(Clone, Copy)]
pub(crate) struct Source<'a> {
    pub(crate) path: &'a Path,
    schema: &'a str,
}

/// A store opened for a look, whichever backend PATH names. The commands work on it through
/// [`IdempotencyStore`] alone; what only one backend has is read when it is opened.
pub(crate) struct Opened {
    pub(crate) store: Box<dyn IdempotencyStore>,
    /// The PostgreSQL server's failover safety when the store connected; `None` for a file.
    pub(crate) failover: Option<FailoverSafety>,
}

impl Opened {
    /// What the size in `Stats::file_bytes` is called, in tables and in JSON.
    pub(crate) fn size_names(&self) -> (&'static str, &'static str) {
        match self.failover {
            None => ("file size", "file_bytes"),
            Some(_) => ("table size", "table_bytes"),
        }
    }
}

impl<'a> Source<'a> {
    pub(crate) fn new(path: &'a Path, schema: &'a str) -> Source<'a> {
        Source { path, schema }
    }

    /// Opens the store for a look: a file read-only, never changed. A command that writes
    /// then calls [`Source::change`].
    pub(crate) fn open(self) -> Result<Opened, Fail> {
        self.try_open()?.map_err(|e| store_fail(self.path, &e))
    }

    /// Like [`Source::open`], with the store's own error kept for the caller to judge; fails
    /// at once only if a file is missing (or a PostgreSQL store cannot be reached).
    pub(crate) fn try_open(self) -> Result<Result<Opened, Error>, Fail> {
        let path = self.path;
        if let Some(conninfo) = connection_string(path) {
            let store = pg_store(conninfo, self.schema).map_err(|e| store_fail(path, &e))?;
            return Ok(Ok(Opened {
                failover: Some(store.failover_safety_at_connect().clone()),
                store: Box::new(store),
            }));
        }
        check_exists(path)?;
        Ok(Store::builder().open_read_only(path).map(|store| Opened {
            store: Box::new(store),
            failover: None,
        }))
    }

    /// Runs `change` on the store opened for writing, once a read-only look found nothing to
    /// refuse (that look must be dropped first: its shared lock would keep a file from
    /// opening). A file is closed afterwards with its last merge; that merge failing loses
    /// nothing (the log holds every change, and the next open replays it), so it is only a
    /// warning.
    pub(crate) fn change<T>(
        self,
        format: Format,
        change: impl FnOnce(&dyn IdempotencyStore) -> Result<T, Fail>,
    ) -> Result<T, Fail> {
        let path = self.path;
        if let Some(conninfo) = connection_string(path) {
            let store = pg_store(conninfo, self.schema).map_err(|e| store_fail(path, &e))?;
            return change(&store);
        }
        let store = Store::builder()
            .create_if_missing(false)
            // The application's effect rows in the log: kept for its next open.
            .keep_unregistered_effects(true)
            .open(path)
            .map_err(|e| store_fail(path, &e))?;
        let changed = change(&store)?;
        if let Err(err) = store.close() {
            warn(
                format,
                &format!(
                    "{}: closing the file: {} (the changes are in its log; the next open replays \
                 them)",
                    path.display(),
                    describe(&err)
                ),
            );
        }
        Ok(changed)
    }
}

/// Fails unless `path` is an existing regular file: `Store::open` would create it.
pub(crate) fn check_exists(path: &Path) -> Result<(), Fail> {
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
pub(crate) fn connection_string(path: &Path) -> Option<&str> {
    let text = path.to_str()?;
    let url = text.starts_with("postgres://") || text.starts_with("postgresql://");
    let pairs = text
        .split_once('=')
        .is_some_and(|(key, _)| PG_KEYWORDS.contains(&key.trim()));
    (url || pairs).then_some(text)
}

/// The PostgreSQL store at `conninfo`, checked but never created or migrated: the CLI must
/// not change a schema that older instances may still run on.
fn pg_store(conninfo: &str, schema: &str) -> Result<PgStore, Error> {
    PgStore::builder()
        .schema(schema)
        .migrate(false)
        .pool_size(1)
        .connection_timeout(Duration::from_secs(10))
        .connect(conninfo)
}

/// `path` for messages: a connection string without its password.
pub(crate) fn shown_path(path: &Path) -> String {
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

pub(crate) fn store_fail(path: &Path, err: &Error) -> Fail {
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
pub(crate) fn error_kind(err: &Error) -> &'static str {
    match err {
        Error::AlreadyOpen => "already-open",
        Error::NotAStore { .. } => "not-a-store",
        Error::Corrupted { .. } => "corrupted",
        Error::InvalidKey { .. } => "invalid-key",
        _ => "storage",
    }
}
