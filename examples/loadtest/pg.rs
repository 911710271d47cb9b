//! PostgreSQL: `PgStore` cells and the seed schema's statements (the probe of BENCHMARKS.md).

use idempotency_store::IdempotencyStore;

use crate::Res;
use crate::systems::{Client, Fresh, System, fresh_for};
use crate::tools::{body, err, fingerprint_of};

/// The PostgreSQL URL, if this build has the backend and the environment names a server.
pub(crate) fn pg_url() -> Option<String> {
    if cfg!(feature = "postgres") {
        std::env::var("IDEMPOTENCY_PG_URL").ok()
    } else {
        None
    }
}

/// `IDEMPOTENCY_PG_URL` with `sslmode` set, in whichever of the two formats it is written.
pub(crate) fn pg_url_with(sslmode: &str) -> Res<String> {
    let url = pg_url().ok_or("IDEMPOTENCY_PG_URL is not set")?;
    Ok(if url.starts_with("postgres") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}sslmode={sslmode}")
    } else {
        format!("{url} sslmode={sslmode}")
    })
}

/// Connections per pool: more than the most threads of any cell.
pub(crate) const PG_POOL: u32 = 70;

#[cfg(feature = "postgres")]
pub(crate) fn open_pg(cell: u64, tls: bool) -> Res<Box<dyn IdempotencyStore>> {
    let url = pg_url_with(if tls { "require" } else { "disable" })?;
    let store = idempotency_store::pg::PgStore::builder()
        .pool_size(PG_POOL)
        .schema(fresh_schema(cell))
        .connect(&url)
        .map_err(|e| err("connecting to PostgreSQL", e))?;
    Ok(Box::new(store))
}

/// A `PgStore` on a fresh schema whose leases and expiry follow `clock`, for `--sweep`.
#[cfg(feature = "postgres")]
pub(crate) fn open_pg_with_clock(
    clock: idempotency_store::ManualClock,
    retention: std::time::Duration,
) -> Res<Box<dyn IdempotencyStore>> {
    let url = pg_url_with("disable")?;
    let store = idempotency_store::pg::PgStore::builder()
        .pool_size(PG_POOL)
        .schema(fresh_schema(0))
        .clock(clock)
        .retention(retention)
        .connect(&url)
        .map_err(|e| err("connecting to PostgreSQL", e))?;
    Ok(Box::new(store))
}

#[cfg(not(feature = "postgres"))]
pub(crate) fn open_pg_with_clock(
    _clock: idempotency_store::ManualClock,
    _retention: std::time::Duration,
) -> Res<Box<dyn IdempotencyStore>> {
    Err("this build has no PostgreSQL backend: use --features postgres".into())
}

/// The Citus coordinator's URL (`IDEMPOTENCY_PG_CITUS_URL`), for the `postgres-citus` cells:
/// `PgStore` in the distributed mode, measured in the same run as `postgres` on one server.
pub(crate) fn citus_url() -> Option<String> {
    if cfg!(feature = "postgres") {
        std::env::var("IDEMPOTENCY_PG_CITUS_URL").ok()
    } else {
        None
    }
}

/// A distributed `PgStore` on the Citus coordinator, on a fresh schema.
#[cfg(feature = "postgres")]
pub(crate) fn open_citus(cell: u64) -> Res<Box<dyn IdempotencyStore>> {
    let url = citus_url().ok_or("IDEMPOTENCY_PG_CITUS_URL is not set")?;
    let store = idempotency_store::pg::PgStore::builder()
        .pool_size(PG_POOL)
        .schema(fresh_schema(cell))
        .distributed(true)
        .connect(&url)
        .map_err(|e| err("connecting to the Citus coordinator", e))?;
    Ok(Box::new(store))
}

#[cfg(not(feature = "postgres"))]
pub(crate) fn open_citus(_cell: u64) -> Res<Box<dyn IdempotencyStore>> {
    Err("this build has no PostgreSQL backend: use --features postgres".into())
}

/// A schema that no earlier run used. The keys are the same in every run (`fresh_for`), and
/// the schemas are left behind, so a run whose process id an earlier one had would otherwise
/// find that run's records and fail with "fresh key … not acquired".
#[cfg(feature = "postgres")]
fn fresh_schema(cell: u64) -> String {
    let millis = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("loadtest_{}_{millis}_{cell}", std::process::id())
}

#[cfg(not(feature = "postgres"))]
pub(crate) fn open_pg(_cell: u64, _tls: bool) -> Res<Box<dyn IdempotencyStore>> {
    Err("this build has no PostgreSQL backend: use --features postgres".into())
}

// --- the seed schema's statements on PostgreSQL (the probe of BENCHMARKS.md)

#[cfg(feature = "postgres")]
pub(crate) struct PgProbe {
    pub(crate) url: String,
    pub(crate) table: String,
    pub(crate) cell: u64,
    pub(crate) body: Vec<u8>,
}

#[cfg(feature = "postgres")]
impl PgProbe {
    pub(crate) fn create(cell: u64) -> Res<Self> {
        let url = pg_url_with("disable")?;
        let schema = format!("loadprobe_{}_{cell}", std::process::id());
        let table = format!("\"{schema}\".idempotency_keys");
        let mut client = postgres::Client::connect(&url, postgres::NoTls)
            .map_err(|e| err("connecting to PostgreSQL", e))?;
        client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE; CREATE SCHEMA \"{schema}\"; \
                 CREATE TABLE {table} (key text PRIMARY KEY, status text NOT NULL, \
                     request_hash bytea NOT NULL, response_status integer, response_body bytea, \
                     created_at timestamptz NOT NULL DEFAULT now(), \
                     expires_at timestamptz NOT NULL); \
                 CREATE INDEX ON {table} (expires_at);"
            ))
            .map_err(|e| err("creating the probe's table", e))?;
        Ok(PgProbe {
            url,
            table,
            cell,
            body: body(),
        })
    }
}

#[cfg(feature = "postgres")]
impl Drop for PgProbe {
    fn drop(&mut self) {
        if let Ok(mut client) = postgres::Client::connect(&self.url, postgres::NoTls) {
            let schema = self.table.trim_end_matches(".idempotency_keys");
            let _ = client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
        }
    }
}

#[cfg(feature = "postgres")]
pub(crate) struct PgProbeClient<'a> {
    pub(crate) probe: &'a PgProbe,
    pub(crate) client: postgres::Client,
    pub(crate) insert: postgres::Statement,
    pub(crate) update: postgres::Statement,
    pub(crate) fresh: Fresh,
}

#[cfg(feature = "postgres")]
impl System for PgProbe {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        let mut client = postgres::Client::connect(&self.url, postgres::NoTls)
            .map_err(|e| err("connecting to PostgreSQL", e))?;
        let insert = client
            .prepare(&format!(
                "INSERT INTO {} (key, status, request_hash, expires_at) \
                 VALUES ($1, 'in_progress', $2, now() + interval '1 day') \
                 ON CONFLICT (key) DO NOTHING RETURNING status",
                self.table
            ))
            .map_err(|e| err("prepare", e))?;
        let update = client
            .prepare(&format!(
                "UPDATE {} SET status = 'completed', response_status = $2, response_body = $3 \
                 WHERE key = $1 AND status = 'in_progress'",
                self.table
            ))
            .map_err(|e| err("prepare", e))?;
        Ok(Box::new(PgProbeClient {
            probe: self,
            client,
            insert,
            update,
            fresh: fresh_for(thread, self.cell),
        }))
    }
}

#[cfg(feature = "postgres")]
impl Client for PgProbeClient<'_> {
    fn pair(&mut self) -> Res<()> {
        let name = self.fresh.next();
        let hash = fingerprint_of(&name).digest().to_vec();
        let claimed = self
            .client
            .query_opt(&self.insert, &[&name, &hash])
            .map_err(|e| err("probe insert", e))?;
        if claimed.is_none() {
            return Err(format!("fresh key {name} not inserted"));
        }
        let updated = self
            .client
            .execute(&self.update, &[&name, &200i32, &self.probe.body])
            .map_err(|e| err("probe update", e))?;
        if updated != 1 {
            return Err(format!("fresh key {name} not updated"));
        }
        Ok(())
    }

    fn replay(&mut self) -> Res<()> {
        Err("pg-probe measures pairs only".into())
    }
}
