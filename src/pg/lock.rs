//! The time, the commit's durability and the key's advisory locks, as the statements of `sql`
//! and `quota` spell them.

/// The columns that make the transaction's commit failover-safe whatever the role's or the
/// session's defaults: `synchronous_commit` raised to at least `on` (kept at `remote_apply`),
/// so that with synchronous standbys the commit waits for one; and `client_min_messages`
/// lowered to `warning` if it is `error`, so that the WARNING of a cancelled wait for a standby
/// reaches the client (see `sync_wait`). `set_config(…, true)` lasts until the end of the
/// transaction, which an autocommit statement is, and commit reads it before it is undone;
/// nothing outlives the transaction (PgBouncer's transaction pooling stays safe). Being
/// volatile, the calls run even though no statement reads their columns. Each runs only when
/// the setting falls short, which with the usual defaults it does not: reading a setting is
/// cheaper than setting it, which also leaves the transaction a change to undo at its end.
macro_rules! durable {
    () => {
        concat!(
            raise_synchronous_commit!(),
            " AS durable, ",
            lower_client_min_messages!(),
            " AS warnings"
        )
    };
}

/// The first call of [`durable!`].
macro_rules! raise_synchronous_commit {
    () => {
        "CASE WHEN current_setting('synchronous_commit') NOT IN ('on', 'remote_apply') \
         THEN set_config('synchronous_commit', 'on', true) END"
    };
}

/// The second call of [`durable!`].
macro_rules! lower_client_min_messages {
    () => {
        "CASE WHEN current_setting('client_min_messages') = 'error' \
         THEN set_config('client_min_messages', 'warning', true) END"
    };
}

/// [`CLOCK`], for `concat!`.
macro_rules! clock {
    () => {
        "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    };
}

/// The first CTE of a statement, `c`, up to its `now` column: the injected clock's (`$1`) or
/// the server's.
macro_rules! now_cte {
    () => {
        concat!(
            "WITH c AS MATERIALIZED (SELECT COALESCE($1::bigint, ",
            clock!(),
            ") AS now"
        )
    };
}

/// The current time inside a statement: the injected clock's (`$1`) or the server's.
pub(super) const NOW: &str = concat!(now_cte!(), ")");

/// [`NOW`] for a statement that writes: with the commit's durability ([`DURABLE`]), set in
/// the same CTE so that it costs no round trip. (Reads go without: a read commits nothing, and
/// the two calls would slow its round trip; BENCHMARKS.md, "Figures behind the defaults".)
pub(super) const WRITE_NOW: &str = concat!(now_cte!(), ", ", durable!(), ")");

/// [`NOW`] for a sweep's statement: its commit does not wait for the log's flush
/// (`synchronous_commit` off for its own transaction). What it deletes has expired, so a crash
/// that loses the deletion loses nothing a caller relies on: the records are expired still
/// and the next sweep deletes them. A later durable commit flushes the log up to itself, this
/// deletion included, so a claim that took a swept key over never outlives the deletion it
/// followed. Waiting for the flush made the sweep's commits and the claims' share one disk
/// queue (BENCHMARKS.md, "Sweep, space, recovery").
pub(super) const SWEEP_NOW: &str = concat!(
    now_cte!(),
    ", set_config('synchronous_commit', 'off', true) AS lazy)"
);

/// [`durable!`], for statements built at run time.
pub(super) const DURABLE: &str = durable!();

/// [`durable!`]'s two calls as a list of arguments (no column names).
pub(super) const DURABLE_CALLS: &str = concat!(
    raise_synchronous_commit!(),
    ", ",
    lower_client_min_messages!()
);

/// The server's clock in milliseconds, as every statement reads it.
pub(super) const CLOCK: &str = clock!();

/// The class of the advisory locks that serialise the claims of one key (the two-`int4` form,
/// whose space is apart from single-`bigint` advisory locks): "idem" in ASCII.
pub(super) const CLAIM_LOCK_CLASS: i32 = 0x6964_656d;

/// The second half of a key's advisory lock: the hash of the schema, the scope and the key.
/// Advisory locks are shared by the whole database, so the schema is part of the hash: without
/// it, a claim in one schema held up a claim of the same key in another, and a sweep skipped
/// a record whose key another schema was claiming (issue 59). `schema` is the bare name (a
/// lowercase identifier, so it is safe as a literal); `scope` and `key` are SQL expressions of
/// type `text`.
pub(super) fn key_hash(schema: &str, scope: &str, key: &str) -> String {
    format!("hashtext('{schema}' || chr(1) || {scope} || chr(1) || {key})")
}

/// The key's advisory lock (the two-`int4` form, class [`CLAIM_LOCK_CLASS`]), held to the end
/// of the transaction: every claim of the key and every deletion of its record takes it, so
/// that a claim reads the time and draws its token only once nothing else can acquire the key
/// or delete its record. `scope` and `key` are SQL expressions (cast to `text` here).
pub(super) fn key_lock(schema: &str, scope: &str, key: &str) -> String {
    format!(
        "pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, {})",
        key_hash(schema, &format!("{scope}::text"), &format!("{key}::text"))
    )
}

/// The same lock if it is free, for a sweep, which skips a key that a claim holds.
pub(super) fn try_key_lock(schema: &str, scope: &str, key: &str) -> String {
    format!(
        "pg_try_advisory_xact_lock({CLAIM_LOCK_CLASS}, {})",
        key_hash(schema, &format!("{scope}::text"), &format!("{key}::text"))
    )
}

/// The start of a statement that must read the time after taking a lock: `w` runs `lock`, and
/// only then does `c` read the time (`$1`, or the server's clock).
pub(super) fn after_lock(lock: &str) -> String {
    format!(
        "WITH w AS MATERIALIZED (SELECT {lock} AS n), c AS MATERIALIZED (SELECT \
         COALESCE($1::bigint, {CLOCK}) AS now, \
         {DURABLE} FROM w)"
    )
}
