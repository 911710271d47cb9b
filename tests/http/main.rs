//! The HTTP mapping, the tower layer and the actix middleware, the example servers and a real
//! retrying SDK: one test binary, a module per former test file.

// Several modules compile the same example sources (`#[path]`), each for its own test.
#![allow(clippy::duplicate_mod)]

#[path = "../common/mod.rs"]
mod common;

mod actix_drain;
mod actix_middleware;
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
mod streamed;
mod sync_server;
