//! What only PostgreSQL has: migrations, routines without prepared statements, session
//! settings, the server's clock, the key lock, connections the server dropped, bad credentials.

use std::time::Duration;

use idempotency_store::{Claim, Clock, Error, IdempotencyStore, Key, Lease, Response, Result};

use super::pg;
use super::{LEASE, Settings, T0, acquire, fp};

/// Migrations are applied once, recorded, and refused when the schema is newer or foreign.
#[cfg(feature = "postgres")]
#[test]
fn postgres_migrations_are_idempotent_and_versioned() -> Result<()> {
    let Some(db) = pg::Db::fresh("migrations") else {
        return Ok(());
    };
    let (first, _) = db.open(&Settings::default())?;
    let lease = acquire(&first, &Key::new("k")?, fp("a"));
    // A second instance on the same schema migrates nothing and sees the record.
    let (second, _) = db.open(&Settings::default())?;
    assert!(matches!(
        second.claim(&Key::new("k")?, fp("a"))?,
        Claim::InProgress { .. }
    ));
    second.complete(&lease, Response::new(200, "by the other instance"))?;
    assert_eq!(
        db.query_i64("SELECT count(*) FROM {schema}.idempotency_schema_migrations")?,
        8
    );
    // A schema migrated by a newer version is refused.
    db.execute("INSERT INTO {schema}.idempotency_schema_migrations VALUES (99, 'future')")?;
    assert!(matches!(
        db.open(&Settings::default()),
        Err(Error::NotAStore { .. })
    ));
    // So is a schema holding a table of the same name that this crate did not create.
    let Some(foreign) = pg::Db::fresh("foreign") else {
        return Ok(());
    };
    foreign.execute("CREATE SCHEMA {schema}; CREATE TABLE {schema}.idempotency_keys (x int)")?;
    assert!(matches!(
        foreign.open(&Settings::default()),
        Err(Error::NotAStore { .. })
    ));
    Ok(())
}

/// Without prepared statements (behind a transaction pooler) the statements of a request's
/// path run as routines (PL/pgSQL procedures whose plans the server keeps), created once per
/// schema by a store that migrates; a store that does not migrate calls the routines it finds
/// and sends the statements themselves for the rest, with the same answers.
#[cfg(feature = "postgres")]
#[test]
fn postgres_without_prepared_statements_runs_routines() -> Result<()> {
    let Some(db) = pg::Db::fresh("routines") else {
        return Ok(());
    };
    if crate::common::pg::distributed() {
        // The routines are not distributed functions: the distributed mode refuses them.
        let refused = db.open_unprepared(true);
        assert!(
            matches!(&refused, Err(Error::InvalidConfig { reason }) if reason.contains("prepare_statements(false)")),
            "{refused:?}"
        );
        return Ok(());
    }
    let routines = "SELECT count(*) FROM pg_proc WHERE pronamespace = '{schema}'::regnamespace \
                    AND proname LIKE 'idempotency\\_q\\_%'";
    let first = db.open_unprepared(true)?;
    assert_eq!(db.query_i64(routines)?, 8);
    let key = Key::new("k")?;
    let lease = acquire(&first, &key, fp("a"));
    first.complete(&lease, Response::new(201, "charged"))?;
    assert!(
        matches!(first.claim(&key, fp("a"))?, Claim::Completed(r) if r.response == Response::new(201, "charged"))
    );
    assert!(matches!(
        first.claim(&key, fp("b"))?,
        Claim::Mismatch { .. }
    ));
    // A second store of this build finds them all and creates nothing.
    drop(db.open_unprepared(true)?);
    assert_eq!(db.query_i64(routines)?, 8);
    // The store calls them: a routine that fails fails the store's call.
    db.execute(
        "DO $$ DECLARE f regprocedure; BEGIN \
             SELECT p.oid::regprocedure INTO f FROM pg_proc AS p \
             WHERE p.pronamespace = '{schema}'::regnamespace \
             AND p.proname LIKE 'idempotency\\_q\\_insert\\_%'; \
             EXECUTE format('ALTER ROUTINE %s RENAME TO sabotaged', f); \
         END $$",
    )?;
    let without_insert = db.open_unprepared(false)?;
    let fresh = Key::new("fresh")?;
    let lease = acquire(&without_insert, &fresh, fp("a"));
    without_insert.complete(&lease, Response::new(200, "sent as a statement"))?;
    assert!(matches!(
        without_insert.claim(&fresh, fp("a"))?,
        Claim::Completed(r) if r.response == Response::new(200, "sent as a statement")
    ));
    assert!(first.claim(&Key::new("other")?, fp("a")).is_err());
    Ok(())
}

/// The store keeps nothing on a server session between its transactions, so that a
/// transaction pooler may hand the session to another client (PgBouncer 1.21+ carries the
/// prepared statements): with a session default of `synchronous_commit = local`, claims,
/// completions and sweeps, prepared (the default) or not, leave it in force; each write raises
/// it (a sweep lowers it) for its own transaction only.
#[cfg(feature = "postgres")]
#[test]
fn postgres_sets_nothing_for_the_session() -> Result<()> {
    let Some(db) = pg::Db::fresh("session") else {
        return Ok(());
    };
    if std::env::var_os("IDEMPOTENCY_PG_POOLER").is_some() {
        // PgBouncer ignores the startup option (`ignore_startup_parameters`).
        eprintln!("skipped: IDEMPOTENCY_PG_POOLER is set, and this needs a direct server");
        return Ok(());
    }
    for prepare in [true, false] {
        if !prepare && crate::common::pg::distributed() {
            // Refused in the distributed mode (postgres_without_prepared_statements_runs_routines).
            continue;
        }
        let store = db.open_with("options", "-c synchronous_commit=local", prepare)?;
        for n in 0..3 {
            let key = Key::new(&format!("{prepare}-{n}"))?;
            let lease = acquire(&store, &key, fp("a"));
            store.complete(&lease, Response::new(201, "charged"))?;
            assert!(matches!(store.claim(&key, fp("a"))?, Claim::Completed(_)));
        }
        store.sweep(64)?;
        let session = store.read_with(|txn| {
            txn.query_one("SHOW synchronous_commit", &[])
                .map(|row| row.get::<_, String>(0))
        })?;
        assert_eq!(session.ok().as_deref(), Some("local"), "prepare: {prepare}");
    }
    Ok(())
}

/// A schema left at migration 2 by an older build (`idempotency_lock_key` in `LANGUAGE sql`)
/// is brought to the current version (the same function in PL/pgSQL, then in its cheaper
/// form), its records intact.
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_schema_at_migration_2_migrates() -> Result<()> {
    let Some(db) = pg::Db::fresh("migration_2") else {
        return Ok(());
    };
    let plpgsql = "SELECT count(*) FROM pg_proc AS p JOIN pg_language AS l ON l.oid = p.prolang \
         WHERE p.pronamespace = '{schema}'::regnamespace AND p.proname = 'idempotency_lock_key' \
         AND l.lanname = 'plpgsql'";
    let (first, _) = db.open(&Settings::default())?;
    let held = acquire(&first, &Key::new("held")?, fp("a"));
    drop(first);
    assert_eq!(db.query_i64(plpgsql)?, 1);
    // Back to what migration 2 left: its function, its index, and no record of the later
    // migrations.
    // (Index statements one by one: on Citus the table is distributed, see `migrations`.)
    db.execute("DROP INDEX {schema}.idempotency_keys_sweep_order")?;
    db.execute(
        "CREATE INDEX idempotency_keys_expires_at ON {schema}.idempotency_keys (expires_at)",
    )?;
    db.execute(
        "DELETE FROM {schema}.idempotency_schema_migrations WHERE version >= 3; \
         CREATE OR REPLACE FUNCTION {schema}.idempotency_lock_key(p_scope text, p_key text) \
         RETURNS bigint LANGUAGE sql VOLATILE AS $f$ \
             SELECT pg_advisory_xact_lock(1768187245, hashtext(p_scope || chr(1) || p_key)); \
             SELECT count(*) FROM (SELECT 1 FROM {schema}.idempotency_keys AS x \
                 WHERE x.scope = p_scope AND x.key = p_key FOR UPDATE) AS held; \
         $f$;",
    )?;
    assert_eq!(db.query_i64(plpgsql)?, 0);
    let (store, _) = db.open(&Settings::default())?;
    assert_eq!(db.query_i64(plpgsql)?, 1);
    // Migration 4's form: the advisory lock as an assignment, the row lock by `PERFORM`.
    let cheap = format!(
        "{plpgsql} AND p.prosrc LIKE '%done := pg_advisory_xact_lock%' \
         AND p.prosrc NOT LIKE '%count(*)%'"
    );
    assert_eq!(db.query_i64(&cheap)?, 1);
    assert_eq!(
        db.query_i64("SELECT max(version)::bigint FROM {schema}.idempotency_schema_migrations")?,
        8
    );
    // Migration 8: the sweep's index in place of the one on `expires_at` alone.
    let index = |name: &str| {
        db.query_i64(&format!(
            "SELECT (to_regclass('{{schema}}.{name}') IS NOT NULL)::int::bigint"
        ))
    };
    assert_eq!(index("idempotency_keys_sweep_order")?, 1);
    assert_eq!(index("idempotency_keys_expires_at")?, 0);
    // The record survived, and claims (which call the new function) work.
    assert!(matches!(
        store.claim(&Key::new("held")?, fp("a"))?,
        Claim::InProgress { .. }
    ));
    store.complete(&held, Response::new(200, "before the migration"))?;
    let fresh = acquire(&store, &Key::new("fresh")?, fp("b"));
    assert!(fresh.token() > held.token());
    store.complete(&fresh, Response::new(200, "after the migration"))?;
    Ok(())
}

/// Without an injected clock, time is the database server's.
#[cfg(feature = "postgres")]
#[test]
fn postgres_uses_the_server_clock_by_default() -> Result<()> {
    let Some(db) = pg::Db::fresh("server_clock") else {
        return Ok(());
    };
    let store = db.open_with_server_clock()?;
    let before = store.now()?;
    let Claim::Acquired(lease) = store.claim(&Key::new("k")?, fp("a"))? else {
        panic!("not acquired");
    };
    let after = store.now()?;
    let started = lease.lease_until().as_millis() - LEASE.as_millis() as u64;
    assert!(
        (before.as_millis()..=after.as_millis()).contains(&started),
        "claimed at {started}, outside [{before:?}, {after:?}]"
    );
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    assert!(
        started.abs_diff(wall) < 60_000,
        "server time {started}, local {wall}"
    );
    Ok(())
}

/// A claim of `k` (fingerprint "b") started while a transaction of the test's own deleted the
/// key's record (under the key's lock if `key_lock`) and has not committed: checks that the
/// claim waits, commits once `released_at` gave the release's time, and returns the lease the
/// claim then got, with that time.
#[cfg(feature = "postgres")]
fn claim_behind_a_deletion(
    db: &pg::Db,
    store: &idempotency_store::pg::PgStore,
    key_lock: bool,
    released_at: impl FnOnce() -> Result<u64>,
) -> Result<(Lease, u64)> {
    let mut client = db.client()?;
    let mut txn = client.transaction().map_err(pg::fixture)?;
    if key_lock {
        txn.execute(&db.key_lock()?, &[&"", &"k"])
            .map_err(pg::fixture)?;
    }
    txn.execute(
        db.sql("DELETE FROM {schema}.idempotency_keys WHERE key = 'k'")
            .as_str(),
        &[],
    )
    .map_err(pg::fixture)?;
    std::thread::scope(|s| {
        let claimer = s.spawn(|| store.claim(&Key::new("k")?, fp("b")));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !claimer.is_finished(),
            "the claim did not wait for the release in flight"
        );
        let released_at = released_at()?;
        txn.commit().map_err(pg::fixture)?;
        match claimer.join().expect("claimer panicked")? {
            Claim::Acquired(lease) => Ok((lease, released_at)),
            other => panic!("expected Acquired, got {other:?}"),
        }
    })
}

/// A claim that waits behind a release in flight (its transaction deleted the record but has
/// not committed) takes its token and time after the release, not when the claim started: its
/// lease is live when it returns and begins no earlier than the release.
#[cfg(feature = "postgres")]
#[test]
fn postgres_claim_behind_a_release_in_flight_is_stamped_after_it() -> Result<()> {
    let Some(db) = pg::Db::fresh("release_in_flight") else {
        return Ok(());
    };
    let (store, clock) = db.open(&Settings::default())?;
    let first = acquire(&store, &Key::new("k")?, fp("a"));
    let (lease, released_at) = claim_behind_a_deletion(&db, &store, false, || {
        clock.advance(2 * LEASE);
        Ok(clock.now().as_millis())
    })?;
    let granted_at = lease.lease_until().as_millis() - LEASE.as_millis() as u64;
    assert!(
        granted_at >= released_at,
        "the lease began at {granted_at}, before the release at {released_at}"
    );
    assert!(
        lease.lease_until() > clock.now(),
        "granted a lease that had already lapsed ({:?})",
        lease.lease_until()
    );
    assert!(lease.token() > first.token(), "{lease:?} after {first:?}");
    Ok(())
}

/// The same with the server's clock, where the claim of a new key is one statement that takes
/// the key's lock and only then reads the time: a deletion made as the table's comment says
/// (under the key's lock) holds the claim back until it commits, so the lease begins no
/// earlier than the release's commit, by the server's clock.
#[cfg(feature = "postgres")]
#[test]
fn postgres_claim_behind_a_release_in_flight_is_stamped_after_it_on_the_server_clock() -> Result<()>
{
    let Some(db) = pg::Db::fresh("release_in_flight_server") else {
        return Ok(());
    };
    let store = db.open_with_server_clock()?;
    let first = acquire(&store, &Key::new("k")?, fp("a"));
    let (lease, released_at) =
        claim_behind_a_deletion(&db, &store, true, || Ok(store.now()?.as_millis()))?;
    let granted_at = lease.lease_until().as_millis() - LEASE.as_millis() as u64;
    assert!(
        granted_at >= released_at,
        "the lease began at {granted_at}, before the release at {released_at}"
    );
    assert!(lease.token() > first.token(), "{lease:?} after {first:?}");
    Ok(())
}

/// Every claim and every deletion takes the key's lock: while another transaction holds it, a
/// claim of a new key and a release wait for it, and a sweep leaves that key's expired record
/// alone (and deletes it once the lock is free); keys whose lock is free are not held up.
#[cfg(feature = "postgres")]
#[test]
fn postgres_claims_and_deletions_take_the_key_lock() -> Result<()> {
    let Some(db) = pg::Db::fresh("key_lock") else {
        return Ok(());
    };
    let (store, clock) = db.open(&Settings::default())?;
    let held = acquire(&store, &Key::new("held")?, fp("a"));
    let expired = acquire(&store, &Key::new("expired")?, fp("a"));
    let other = acquire(&store, &Key::new("other")?, fp("a"));
    drop((expired, other));
    clock.advance(Duration::from_secs(25 * 3600));
    let held = {
        // Its record expired too: take it over so that there is a live lease to release.
        let lease = acquire(&store, &Key::new("held")?, fp("a"));
        assert!(lease.token() > held.token());
        lease
    };
    let key_lock = db.key_lock()?;
    let mut client = db.client()?;
    let mut txn = client.transaction().map_err(pg::fixture)?;
    for key in ["new", "held", "expired"] {
        txn.execute(&key_lock, &[&"", &key]).map_err(pg::fixture)?;
    }
    std::thread::scope(|s| -> Result<()> {
        let claimer = s.spawn(|| store.claim(&Key::new("new")?, fp("b")));
        let releaser = s.spawn(|| store.release(&held));
        // A sweep does not wait: it deletes `other` and skips `expired`.
        assert_eq!(store.sweep(10)?, 1);
        assert_eq!(store.sweep(10)?, 0);
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !claimer.is_finished(),
            "the claim did not wait for the key lock"
        );
        assert!(
            !releaser.is_finished(),
            "the release did not wait for the key lock"
        );
        assert!(
            store.lookup(&Key::new("held")?)?.is_some(),
            "released under the lock"
        );
        txn.commit().map_err(pg::fixture)?;
        assert!(matches!(
            claimer.join().expect("claimer panicked")?,
            Claim::Acquired(_)
        ));
        releaser.join().expect("releaser panicked")?;
        Ok(())
    })?;
    assert!(store.lookup(&Key::new("held")?)?.is_none());
    assert_eq!(
        store.sweep(10)?,
        1,
        "the expired record, once its lock was free"
    );
    Ok(())
}

/// `force_release` waits for the key's lock with a snapshot taken before the wait; when a claim
/// replaced the record meanwhile, it releases the new in-progress record rather than call it
/// completed.
#[cfg(feature = "postgres")]
#[test]
fn postgres_force_release_behind_a_replaced_record_releases_the_new_one() -> Result<()> {
    let Some(db) = pg::Db::fresh("force_release_replaced") else {
        return Ok(());
    };
    let (store, clock) = db.open(&Settings::default())?;
    let key = Key::new("k")?;
    let _old = acquire(&store, &key, fp("a"));
    let now = clock.now().as_millis() as i64;
    let mut client = db.client()?;
    let mut txn = client.transaction().map_err(pg::fixture)?;
    txn.execute(&db.key_lock()?, &[&"", &"k"])
        .map_err(pg::fixture)?;
    std::thread::scope(|s| -> Result<()> {
        let releaser = s.spawn(|| store.force_release(&key));
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !releaser.is_finished(),
            "force_release did not wait for the key lock"
        );
        // What a release and a new claim (attempt 3, to tell it apart) would leave.
        txn.batch_execute(&db.sql(&format!(
            "DELETE FROM {{schema}}.idempotency_keys WHERE key = 'k'; \
             INSERT INTO {{schema}}.idempotency_keys (scope, key, fingerprint, \
                 fingerprint_version, state, token, attempt, lease_until, created_at, expires_at) \
             VALUES ('', 'k', '\\x{}'::bytea, 1, 'in_progress', 1000000, 3, {}, {now}, {})",
            "00".repeat(32),
            now + 60_000,
            now + 86_400_000
        )))
        .map_err(pg::fixture)?;
        txn.commit().map_err(pg::fixture)?;
        let released = releaser.join().expect("releaser panicked")?;
        assert!(
            matches!(
                released,
                idempotency_store::admin::ForceRelease::Released { attempt: 3, .. }
            ),
            "{released:?}"
        );
        Ok(())
    })?;
    assert!(store.lookup(&key)?.is_none());
    Ok(())
}

/// A sweep larger than one statement's share of locks runs in several statements and deletes
/// exactly its limit, oldest first.
#[cfg(feature = "postgres")]
#[test]
fn postgres_a_large_sweep_deletes_exactly_its_limit() -> Result<()> {
    let Some(db) = pg::Db::fresh("large_sweep") else {
        return Ok(());
    };
    let (store, clock) = db.open(&Settings::default())?;
    for i in 0..1_200 {
        let lease = acquire(&store, &Key::new(&format!("k{i:04}"))?, fp("a"));
        store.complete(&lease, Response::new(200, "done"))?;
        clock.advance(Duration::from_millis(1));
    }
    clock.advance(Duration::from_secs(25 * 3600));
    assert_eq!(store.sweep(1_100)?, 1_100);
    assert!(store.lookup(&Key::new("k1099")?)?.is_none());
    assert_eq!(
        db.query_i64("SELECT count(*) FROM {schema}.idempotency_keys WHERE key >= 'k1100'")?,
        100
    );
    assert_eq!(store.sweep(1_100)?, 100);
    Ok(())
}

/// A pooled connection that the server dropped fails at most one call, then is replaced.
#[cfg(feature = "postgres")]
#[test]
fn postgres_replaces_a_connection_the_server_dropped() -> Result<()> {
    let Some(db) = pg::Db::fresh("dropped") else {
        return Ok(());
    };
    if std::env::var_os("IDEMPOTENCY_PG_POOLER").is_some() {
        // Through a pooler, the server drops the pooler's connection, not the store's.
        eprintln!("skipped: IDEMPOTENCY_PG_POOLER is set, and this needs a direct server");
        return Ok(());
    }
    let name = format!("conformance_dropped_{}", std::process::id());
    let store = db.open_named(&name)?;
    let key = Key::new("k")?;
    let lease = acquire(&store, &key, fp("a"));
    db.execute(&format!(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = '{name}'"
    ))?;
    let mut failures = 0;
    let outcome = loop {
        match store.complete(&lease, Response::new(200, "after the drop")) {
            Err(Error::Storage { .. }) if failures == 0 => failures += 1,
            other => break other,
        }
    };
    outcome?;
    assert!(matches!(store.claim(&key, fp("a"))?, Claim::Completed(_)));
    println!("calls failed by the dropped connection: {failures}");
    Ok(())
}

/// A wrong password or an unparsable URL fails `connect` at once, with the reason.
#[cfg(feature = "postgres")]
#[test]
fn postgres_connect_fails_fast_on_bad_credentials() {
    let Some(url) = pg::url() else { return };
    assert!(matches!(
        idempotency_store::pg::PgStore::connect("postgresql://[::1"),
        Err(Error::InvalidConfig { .. })
    ));
    if url.starts_with("postgres") {
        return; // a URL-style address cannot simply be overridden below
    }
    let started = std::time::Instant::now();
    let wrong = idempotency_store::pg::PgStore::connect(&format!("{url} password=wrong-{}", T0));
    match wrong {
        Err(err @ Error::Storage { .. }) => {
            let mut chain = Vec::new();
            let mut cause = std::error::Error::source(&err);
            while let Some(c) = cause {
                chain.push(c.to_string());
                cause = c.source();
            }
            assert!(
                chain
                    .iter()
                    .any(|c| c.contains("password authentication failed")),
                "{chain:?}"
            );
        }
        other => panic!("expected a storage error, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}
