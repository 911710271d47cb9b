//! The time and the key's advisory locks, as the statements of `sql` and `quota` spell them.

/// The current time inside a statement: the injected clock's (`$1`) or the server's.
pub(super) const NOW: &str = "WITH c AS MATERIALIZED (SELECT COALESCE($1::bigint, \
                   floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now)";

/// The class of the advisory locks that serialise the claims of one key (the two-`int4` form,
/// whose space is apart from single-`bigint` advisory locks): "idem" in ASCII.
pub(super) const CLAIM_LOCK_CLASS: i32 = 0x6964_656d;

/// The key's advisory lock (the two-`int4` form, class [`CLAIM_LOCK_CLASS`]), held to the end
/// of the transaction: every claim of the key and every deletion of its record takes it, so
/// that a claim reads the time and draws its token only once nothing else can acquire the key
/// or delete its record. `scope` and `key` are SQL expressions.
pub(super) fn key_lock(scope: &str, key: &str) -> String {
    format!(
        "pg_advisory_xact_lock({CLAIM_LOCK_CLASS}, hashtext({scope}::text || chr(1) || {key}::text))"
    )
}

/// The same lock if it is free, for a sweep, which skips a key that a claim holds.
pub(super) fn try_key_lock(scope: &str, key: &str) -> String {
    format!(
        "pg_try_advisory_xact_lock({CLAIM_LOCK_CLASS}, \
         hashtext({scope}::text || chr(1) || {key}::text))"
    )
}

/// The start of a statement that must read the time after taking a lock: `w` runs `lock`, and
/// only then does `c` read the time (`$1`, or the server's clock).
pub(super) fn after_lock(lock: &str) -> String {
    format!(
        "WITH w AS MATERIALIZED (SELECT {lock} AS n), c AS MATERIALIZED (SELECT \
         COALESCE($1::bigint, floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint) AS now \
         FROM w)"
    )
}
