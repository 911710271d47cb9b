//! The HTTP mapping, the tower layer and the actix middleware, the example servers and a real
//! retrying SDK: one test binary, a module per former test file.

// Each example server compiles the shared payments_service files as its own modules, as it
// does as a program of its own; here all three are in one crate.
#![allow(clippy::duplicate_mod)]

#[path = "../common/mod.rs"]
mod common;
#[path = "../common/threads.rs"]
mod threads;

// What several modules drive, compiled once: the adapters of `tests/adapters/`, the example
// servers (their `main`s unused here) and their client.
#[allow(dead_code)]
#[path = "../../examples/actix_payments.rs"]
mod actix_payments;
#[macro_use]
#[path = "../adapters/mod.rs"]
mod adapters;
#[allow(dead_code)]
#[path = "../../examples/axum_payments.rs"]
mod axum_payments;
#[allow(dead_code)]
#[path = "../../examples/payments_service/client.rs"]
mod client;
#[allow(dead_code)]
#[path = "../../examples/payments_server.rs"]
mod payments_server;

mod actix_drain;
mod actix_middleware;
mod drain_support;
mod examples;
mod http_adapters;
mod http_flow;
mod keep_alive;
mod layer_exactly_once;
mod outlives_connection;
mod payments_e2e;
mod problem_answers;
mod problem_types;
mod real_sdk;
mod servers;
mod streamed;
mod sync_server;
