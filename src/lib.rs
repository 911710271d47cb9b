//! A durable, embedded idempotency-key store on [redb].
//!
//! ```sh
//! cargo add idempotency-store                        # the store
//! cargo add idempotency-store --features http,tower  # with the HTTP mapping and the tower layer
//! ```
//!
//! A client retries `POST /payments` after a timeout; the service must charge once and give
//! every retry the first answer. [`IdempotencyStore::claim`] decides, atomically and durably, which
//! attempt runs the operation; [`IdempotencyStore::complete`] stores its response; later attempts get
//! that response back to replay.
//!
//! ```
//! use idempotency_store::{IdempotencyStore, Claim, Fingerprint, Key, Response, Store};
//!
//! // In memory for this example; `Store::open("idempotency.redb")` for a durable file.
//! let store = Store::builder().open_in_memory()?;
//!
//! let key = Key::new("8e03978e-40d5-43e8-bc93-6894a57f9324")?;
//! let request = Fingerprint::of(["POST", "/payments", r#"{"amount":4999}"#]);
//!
//! match store.claim(&key, request)? {
//!     Claim::Acquired(lease) => {
//!         // Run the side effect once, then store what the client should see.
//!         store.complete(&lease, Response::new(201, r#"{"id":"pay_1"}"#))?;
//!     }
//!     Claim::Completed(replay) => println!("replay {}", replay.response.status),
//!     Claim::InProgress { .. } => println!("409: try again shortly"),
//!     Claim::Mismatch { .. } => println!("422: key reused for another request"),
//! }
//!
//! // The retry after a lost answer replays instead of charging again.
//! let Claim::Completed(replay) = store.claim(&key, request)? else { panic!("not replayed") };
//! assert_eq!(replay.response.body, br#"{"id":"pay_1"}"#);
//! # Ok::<(), idempotency_store::Error>(())
//! ```
//!
//! # Where to start
//!
//! The examples, in the repository's `examples/` (`cargo run --example NAME` from a checkout
//! needs no feature flags):
//!
//! - `quickstart`: a lost answer, its retry and a reused key, without HTTP.
//! - `payments`: the same story over real HTTP, with duplicates racing and a restart.
//! - `payments_server`: that payments server on its own, on a file, for `curl`.
//! - `axum_payments`: the same server on axum with the tower layer, and `GET /metrics`.
//! - `actix_payments`: the same server on actix-web with the actix middleware.
//! - `http_one_line`: the tower layer and the synchronous `http::handle`, each in one call.
//! - `edge_client`: an offline-first device that sends each payment exactly once through the
//!   client outbox ([`client::Outbox`](client/struct.Outbox.html), feature `client`).
//! - `loadtest`: throughput of this store against SQLite (and `PgStore` with `--features
//!   postgres` and `IDEMPOTENCY_PG_URL` set).
//!
//! The main items, and the feature each needs:
//!
//! | item | what for | feature |
//! |---|---|---|
//! | [`Store::open`], [`Store::builder`] ([`StoreBuilder`]) | open a store file (or one in memory) | none |
//! | [`IdempotencyStore::execute`] | claim, run a closure, store its response or release the key | none |
//! | [`IdempotencyStore::claim`], [`Claim`], [`IdempotencyStore::complete`], [`IdempotencyStore::release`] | the same flow step by step | none |
//! | [`Store::complete_with_effects`], [`StoreBuilder::effect_table`] | your own rows committed with the response | none |
//! | [`IdempotencyStore`] | the calls shared by `Store` and `PgStore`, operator calls included ([`admin`]) | none |
//! | [`IdempotencyStore::metrics`], [`metrics::Metrics`] | counters and latencies since the open | none (`metrics` publishes them through the `metrics` facade) |
//! | [`StoreBuilder::trace_keys`] | show keys in `tracing` events | `tracing` (the events) |
//! | [`http`](http/index.html): `http::handle`, `http::decide`, `http::Problem` | the HTTP mapping, the whole flow in one call | `http` |
//! | [`http::tower::IdempotencyLayer`](http/tower/struct.IdempotencyLayer.html) | the same flow as a tower layer (axum, hyper) | `tower` |
//! | [`http::actix::Idempotency`](http/actix/struct.Idempotency.html) | the same flow as an actix-web 4 middleware | `actix` |
//! | [`pg::PgStore`](pg/struct.PgStore.html), [`pg::PgStoreBuilder`](pg/struct.PgStoreBuilder.html), [`pg::FailoverSafety`](pg/struct.FailoverSafety.html) | the same store on PostgreSQL, for many instances; whether a failover can lose its acknowledgements | `postgres` |
//! | [`client::Outbox`](client/struct.Outbox.html), [`client::RetryPolicy`](client/struct.RetryPolicy.html) | outbound keys that survive a crash, and sends that retry with them | `client` (`ureq` for a ready-made sender) |
//! | the binary `idempotency-store` | look inside a store, release a stuck key | `cli` |
//!
//! # Guarantees
//!
//! - **One winner.** For a key, exactly one claim acquires it until that attempt settles or
//!   its lease lapses; claims are serialised by redb's single writer.
//! - **Durable acknowledgements.** When a write call returns `Ok`, its write has been synced
//!   to disk and survives a process kill or power loss. Under
//!   [`Recovery::QuickRepair`] the first open after a crash is also instant.
//! - **Fencing.** Every lease carries a token unique for the life of the file; `complete`,
//!   `release`, `heartbeat` and `checkpoint` from an attempt that was taken over fail with
//!   [`Error::LeaseLost`] and change nothing.
//! - **Expiry.** A record expires `retention` after completion (in-progress records:
//!   `retention` after the first claim, or at the lease's end if later). An expired record
//!   never replays, even before a sweep deletes it. One exception, after a crash only: if the
//!   clock at reopen is behind a time that only reads had seen since the last merge, a record
//!   those reads saw expire is live again until the clock passes its expiry
//!   ([`IdempotencyStore::now`]).
//! - **Never stuck.** A crashed holder's record is taken over once its lease lapses.
//!
//! # Time
//!
//! All times come from the [`Clock`] given to the builder ([`SystemClock`] by default) in
//! wall-clock milliseconds, so leases and expiry survive restarts. The store never lets time go
//! backwards: it uses the highest time it has seen, persisted in the file (see
//! [`IdempotencyStore::now`] for what a crash may forget). A clock stepping back makes time stand still
//! until the clock catches up; it delays expiry but never shortens a lease.
//!
//! # Crate features
//!
//! - `http`: the module `idempotency_store::http`, mapping to the `http` 1.x types: the
//!   `Idempotency-Key` header (sf-string or bare), request fingerprints, replays with
//!   `Idempotent-Replayed: true`, and the IETF draft's 400/409/422 as `application/problem+json`.
//!   It also has the whole flow in one call, `http::handle` (sync): key, scope, fingerprint
//!   policy (raw bytes, canonical JSON, unordered query, selected headers, your function),
//!   bounded wait, replay, 409 with a measured `Retry-After`, 413/422/503, completion or
//!   release, and a heartbeat for slow handlers.
//! - `tower` (implies `http`): `http::tower::IdempotencyLayer`, the same flow as a tower
//!   layer for axum or any hyper service, with every store call that can block on tokio's
//!   blocking pool
//!   (adds `tokio`, `tower`, `http-body`, `http-body-util` and `bytes`).
//! - `actix` (implies `http`): `http::actix::Idempotency`, the same flow as an actix-web 4
//!   middleware; the handler and the settling call run on a task of their own, so a client
//!   that hangs up cancels nothing (adds `actix-web` without its default features, and
//!   `tokio`).
//! - `cli`: the operator binary `idempotency-store` (it brings `postgres` along, since it also
//!   works on PostgreSQL tables, and `client`, since it shows the outbox's intents).
//! - `client`: the module `idempotency_store::client`, outbound idempotency keys that survive
//!   the caller's crash: [`client::Outbox`](client/struct.Outbox.html) keeps each outbound
//!   operation's key (UUID v4) in the store before the first send, and its retry helper sends
//!   with that key under a `RetryPolicy` (backoff, `Retry-After`, bounded attempts and time)
//!   (adds `uuid` and `httpdate`).
//! - `ureq` (implies `client`): `client::ureq::sender`, a ready-made send closure on the
//!   `ureq` 3 HTTP client (adds `ureq` without its default features: no TLS stack; enable
//!   ureq's `rustls` or `native-tls` feature in your own `Cargo.toml` for HTTPS).
//! - `postgres`: the module `idempotency_store::pg` with `PgStore`, the same API
//!   ([`IdempotencyStore`]) on a PostgreSQL table shared by many service instances (sync
//!   `postgres` client, `r2d2` connection pool).
//! - `metrics`: the counters of [`IdempotencyStore::metrics`] also go through the `metrics`
//!   facade to the recorder the application installed; without it nothing is recorded there.
//! - `tracing`: spans and events through `tracing` (keys hidden unless
//!   [`StoreBuilder::trace_keys`] is on).
//!
//! On docs.rs every feature is built; each item that needs one is marked with it.
//!
//! # Layout
//!
//! One file: a small header, then a write-ahead log used as two halves (each write batch
//! appends one checksummed entry and syncs it; when a half is full, a background merge
//! commits everything logged durably into the database and the log goes on in the other
//! half), then a redb database. Its tables (store format 5): the records in claim order,
//! each under a sequence number with its stored key beside it; a key index
//! (`(key hash, sequence number)`) that finds a key's record; an expiry index
//! (`(expires_at, key hash)`); and metadata (format version, token counter, clock high-water
//! mark, usage counters, log position). An open of a file from an older release (format 3 or
//! 4, records under their key's hash) moves its records into these tables (a read-only open
//! only in memory). The file is not a plain redb file; open it with this crate.
//! `docs/design.md` in the repository has the details.
//!
//! [redb]: https://docs.rs/redb
#![cfg_attr(docsrs, feature(doc_cfg))]
#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![cfg_attr(
    not(test),
    deny(clippy::unwrap_used, clippy::expect_used, clippy::panic)
)]

mod api;
#[cfg(feature = "client")]
#[cfg_attr(docsrs, doc(cfg(feature = "client")))]
pub mod client;
mod engine;
mod error;
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod pg;
mod store;

pub use crate::api::clock::{Clock, ManualClock, SystemClock, Timestamp};
pub use crate::api::fingerprint::Fingerprint;
pub use crate::api::key::Key;
pub use crate::api::outcome::{Claim, ClaimId, Lease, RecordState, RecordView, Replay};
pub use crate::api::response::Response;
pub use crate::api::settings::{Settings, WhenFull};
pub use crate::api::store::IdempotencyStore;
pub use crate::api::store::execute;
pub use crate::engine::effects::{EffectValue, Effects};
pub use crate::error::{Error, Result};
pub use crate::store::Store;
pub use crate::store::builder::{Recovery, StoreBuilder};
pub use crate::store::sweep::Sweeper;

/// What the operator calls of [`IdempotencyStore`] answer: the walk over every record, its
/// items, the counts by state, the invariant check and a forced release. For tools (the
/// `idempotency-store` CLI is built on them); a service's request path never needs them.
pub mod admin {
    pub use crate::api::outcome::ForceRelease;
    pub use crate::api::records::Records;
    pub use crate::api::report::{FailoverStatus, Stats, StoredRecord, VerifyReport};
}

/// What a backend implements ([`backend::Backend`]): each store operation once, uncounted;
/// every `Backend` is an [`IdempotencyStore`], whose calls count and trace it. For wrapping one
/// of this crate's stores (a fault injector in a test, a delegating store); a service never
/// needs it.
pub mod backend {
    pub use crate::api::backend::{Backend, Swept};
    pub use crate::api::metrics::Meter;
}

/// A backend's calls as futures, for async adapters ([`IdempotencyStore::nonblocking`]): the
/// tower layer and the actix middleware await them instead of holding a blocking-pool thread.
/// A service calling the store itself never needs them.
pub mod nonblocking {
    pub use crate::api::nonblocking::{AsyncStore, Blocking, StoreFuture};
}

/// What a store has done since it was opened, as [`IdempotencyStore::metrics`] returns it:
/// the same counters and latency histograms on every backend, so that dashboards work on
/// either (with the `metrics` feature they also go to the application's `metrics` recorder).
pub mod metrics {
    pub use crate::api::metrics::{
        ClaimCounts, EngineMetrics, ErrorCounts, LATENCY_BUCKETS_US, Latency, Metrics,
    };
    pub use crate::api::report::FailoverStatus;
}

/// The redb this crate stores in, for the caller's own tables ([`Store::complete_with_effects`],
/// [`StoreBuilder::effect_table`], [`Store::complete_with`], [`Store::read_with`]). Supported: redb
/// `>= 4.6, < 5` (the requirement `redb = "4.6"`; the test suite runs on 4.6.0, the newest 4.x
/// release), so an application on any of those versions shares one copy with this crate.
pub use redb;

/// The README's code blocks, compiled and run as doc tests by `cargo test --all-features`, so
/// that every example a user copies from it builds as written.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The code blocks of `docs/store.md`, compiled and run as doc tests like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/store.md")]
pub struct StoreGuide;

/// The code blocks of `docs/http.md`, compiled and run as doc tests like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/http.md")]
pub struct HttpGuide;

/// The code blocks of `docs/client.md`, compiled and run as doc tests like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/client.md")]
pub struct ClientGuide;

/// The code blocks of `docs/operations.md`, compiled and run as doc tests like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/operations.md")]
pub struct OperationsGuide;

// Entry points of the fuzz targets and hooks of the test suite: internal, see Cargo.toml.
#[cfg(feature = "__test-hooks")]
#[doc(hidden)]
pub use crate::{
    api::key::fuzz_key, engine::codec::fuzz_decode_record, engine::contain::contained_panics,
    store::hooks::fuzz_log_replay,
};
