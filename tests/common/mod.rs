//! Helpers shared by several test binaries (each includes this folder with `#[path]`).

// Each including binary uses a different part of this module.
#![allow(dead_code)]

pub mod disk;
pub mod faulty;
#[cfg(feature = "postgres")]
pub mod pg;

/// Expands each named test into one on the embedded redb store (`redb_backend::NAME`) and one
/// on PostgreSQL (`postgres_backend::NAME`), calling the test function `NAME` of the invoking
/// module with the backend's argument. `redb: ARG` is what a redb test passes;
/// `postgres(FIXTURE = FRESH): ARG` binds `FIXTURE` to `FRESH("NAME")` and passes `ARG`, the
/// test passing without running when `FRESH` gives `None` (no `IDEMPOTENCY_PG_URL`: it prints
/// why).
// Not every binary that includes this module runs tests on both backends.
#[allow(unused_macros)]
macro_rules! on_both_backends {
    (
        redb: $redb:expr,
        postgres($fixture:ident = $fresh:path): $pg:expr;
        $($name:ident),* $(,)?
    ) => {
        /// Every test on the embedded redb store.
        mod redb_backend {
            $(
                #[test]
                fn $name() -> idempotency_store::Result<()> {
                    super::$name($redb)
                }
            )*
        }

        /// Every test on PostgreSQL, each on a fixture of its own.
        #[cfg(feature = "postgres")]
        mod postgres_backend {
            $(
                #[test]
                fn $name() -> idempotency_store::Result<()> {
                    let Some($fixture) = $fresh(stringify!($name)) else {
                        return Ok(());
                    };
                    super::$name($pg)
                }
            )*
        }
    };
}

/// The size of a long loop (kills, power cuts, records written): `full` with
/// `IDEMPOTENCY_TEST_SCALE=full` (CI runs these tests that way, as does the soak command in
/// CONTRIBUTING.md), `quick` otherwise, so that `cargo test` stays a short loop for whoever is
/// changing the code.
pub fn scaled(quick: usize, full: usize) -> usize {
    if std::env::var("IDEMPOTENCY_TEST_SCALE").is_ok_and(|v| v == "full") {
        full
    } else {
        quick
    }
}

/// A small deterministic generator (xorshift64) for the crash tests' choices; the seed must
/// not be zero.
pub struct Rng(pub u64);

impl Rng {
    /// Seeded from the clock, for tests that print their seed so a failure can be replayed.
    pub fn from_clock() -> Rng {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::SystemTime::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Rng(nanos | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number below `n`; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
}
