//! PostgreSQL-only tests of `PgStore`: async callers, separate processes, TLS, failover, Citus. One
//! test binary, a module per former test file. `tests/pg_faults.rs` stays a binary of its own:
//! it restarts and stops the server, which would fail the tests here running beside it.

#[path = "../common/mod.rs"]
mod common;

mod failover_load;
mod pg_citus;
mod pg_failover;
mod pg_multiprocess;
mod pg_patroni;
mod pg_sweep;
mod pg_tls;
mod pg_tokio;
