//! Opening the store a PATH names: a file (read-only for a look, writable for a change) or a
//! PostgreSQL table, and the errors of doing so.

use std::io;
use std::path::Path;
use std::time::Duration;

use idempotency_store::{
    Error, ForceRelease, IdempotencyStore, Key, PgStore, RecordView, Store, Timestamp,
};

use crate::output::{EXIT_FAILED, Fail, Format, describe, fail, warn};

/// Where a command works: PATH, and the PostgreSQL schema (`--schema`) if PATH is a
/// connection string.
#[derive(Clone, Copy)]
pub(crate) struct Source<'a> {
    pub(crate) path: &'a Path,
    schema: &'a str,
}

impl<'a> Source<'a> {
    pub(crate) fn new(path: &'a Path, schema: &'a str) -> Source<'a> {
        Source { path, schema }
    }

    /// Opens the store for a look: a file read-only, never changed. A command that writes
    /// then asks [`Target::for_writing`].
    pub(crate) fn open(self) -> Result<Target, Fail> {
        let path = self.path;
        if let Some(conninfo) = connection_string(path) {
            return pg_store(conninfo, self.schema)
                .map(|store| Target::Pg(Box::new(store)))
                .map_err(|e| store_fail(path, &e));
        }
        check_exists(path)?;
        Store::builder()
            .open_read_only(path)
            .map(|store| Target::File(Box::new(store)))
            .map_err(|e| store_fail(path, &e))
    }

    /// The PostgreSQL store, if PATH is a connection string.
    pub(crate) fn pg(self) -> Option<Result<PgStore, Error>> {
        connection_string(self.path).map(|conninfo| pg_store(conninfo, self.schema))
    }
}

/// An opened store: a file, or a table on a PostgreSQL server.
pub(crate) enum Target {
    File(Box<Store>),
    Pg(Box<PgStore>),
}

/// One record with its key, as `list` and `export` walk them.
pub(crate) struct Entry {
    pub(crate) key: Key,
    pub(crate) record: RecordView,
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
    pub(crate) fn for_writing(self, path: &Path) -> Result<Target, Fail> {
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
    pub(crate) fn finish(self, format: Format, path: &Path) {
        if let Target::File(store) = self
            && let Err(err) = store.close()
        {
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
    }

    /// What the size in `Stats::file_bytes` is called, in tables and in JSON.
    pub(crate) fn size_names(&self) -> (&'static str, &'static str) {
        match self {
            Target::File(_) => ("file size", "file_bytes"),
            Target::Pg(_) => ("table size", "table_bytes"),
        }
    }

    pub(crate) fn now(&self) -> Result<Timestamp, Error> {
        match self {
            Target::File(store) => Ok(Store::now(store)),
            Target::Pg(store) => store.now(),
        }
    }

    pub(crate) fn inspect(&self, key: &Key) -> Result<Option<RecordView>, Error> {
        match self {
            Target::File(store) => store.inspect(key),
            Target::Pg(store) => store.inspect(key),
        }
    }

    pub(crate) fn force_release(&self, key: &Key) -> Result<ForceRelease, Error> {
        match self {
            Target::File(store) => store.force_release(key),
            Target::Pg(store) => store.force_release(key),
        }
    }

    pub(crate) fn records(&self) -> Result<Walk<'_>, Error> {
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
