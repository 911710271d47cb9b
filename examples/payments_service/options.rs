//! The command-line options of both payments servers (`payments_server` adds `--threads`),
//! parsed with clap: `--help` prints them and exits 0, and a bad value names its option.

use std::path::PathBuf;
use std::time::Duration;

/// What `--help` adds after the options: the exit codes.
pub const AFTER_HELP: &str = "Exit codes: 0 after --help or --version; 2 for a bad option or \
value; 1 if the store file cannot be opened or the address cannot be bound (the message \
names the path or the address).";

/// The store file, the address, and how the service treats duplicates and crashed attempts.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeOptions {
    /// The store file, created if it does not exist; the ledger of charges lives in it too.
    #[arg(long, value_name = "PATH", default_value = "payments.redb")]
    pub db: PathBuf,
    /// The address to listen on; port 0 picks a free one. The server prints
    /// `listening on http://ADDR` once it serves.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    pub listen: String,
    /// How long a duplicate of a request still in flight waits for the first attempt's answer,
    /// in milliseconds (the library's default, 500); 0 answers it 409 at once.
    #[arg(long = "wait-ms", value_name = "MS", default_value_t = 500)]
    pub wait_ms: u64,
    /// How long an attempt holds its key, in milliseconds: the key of an attempt that crashed
    /// is blocked this long, then a retry takes it over (the library's default, 10000; a live
    /// attempt heartbeats and keeps it).
    #[arg(long = "lease-ms", value_name = "MS", default_value_t = 10_000)]
    pub lease_ms: u64,
    /// Simulated card-network latency of each charge, in milliseconds.
    #[arg(long = "delay-ms", value_name = "MS", default_value_t = 0)]
    pub delay_ms: u64,
}

impl ServeOptions {
    /// The store, with the ledger registered and the lease set, opened on `--db`; an error
    /// names the path.
    pub fn open_store(&self) -> Result<idempotency_store::Store, String> {
        let mut builder = super::server::store_builder();
        builder.lease(Duration::from_millis(self.lease_ms));
        builder.open(&self.db).map_err(|err| {
            format!(
                "cannot open the store file {}: {}",
                self.db.display(),
                with_causes(&err)
            )
        })
    }

    /// The service's options, with `threads` workers.
    pub fn service(&self, threads: usize) -> super::server::Options {
        super::server::Options {
            wait: Duration::from_millis(self.wait_ms),
            charge_delay: Duration::from_millis(self.delay_ms),
            threads,
        }
    }
}

/// An error and its causes on one line ("storage failure while opening the store file:
/// Permission denied (os error 13)").
pub fn with_causes(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
