//! The three example payments servers compiled into this binary, by name, for the modules that
//! run them as child processes (`examples`, `payments_e2e`).

use crate::{actix_payments, axum_payments, payments_server};

pub type Runner = fn(std::vec::IntoIter<String>) -> Result<(), payments_server::server::BoxError>;

/// The servers: (name, run, whether it takes `--threads`).
pub const SERVERS: [(&str, Runner, bool); 3] = [
    ("payments_server", |a| payments_server::run(a), true),
    ("axum_payments", |a| axum_payments::run(a), false),
    ("actix_payments", |a| actix_payments::run(a), false),
];
