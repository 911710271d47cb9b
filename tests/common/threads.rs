//! The test thread count of the binaries that include this file (`#[path]`): `http`,
//! `store`, `durability` and `observability`.

/// Four tests at once at least. libtest runs as many as the machine has cores, but most of
/// these tests wait rather than compute (slow handlers, leases running out, child processes,
/// PostgreSQL): on 2 cores the HTTP suite took 70 s with 2 at once and 31 s with 4.
/// `RUST_TEST_THREADS` or `--test-threads`, when given, win. Not in the `postgres` binary:
/// its cluster tests (a failover, a Patroni switchover, a Citus worker restart) each load
/// the whole machine, and side by side on 2 cores they missed their bounds.
#[ctor::ctor(unsafe)]
fn at_least_four_tests_at_once() {
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    if cores < 4 && std::env::var_os("RUST_TEST_THREADS").is_none() {
        // SAFETY: this runs before main, while the process has a single thread.
        unsafe { std::env::set_var("RUST_TEST_THREADS", "4") };
    }
}
