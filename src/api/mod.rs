//! The backend-neutral contract: keys, fingerprints, time, responses, outcomes, reports,
//! shared settings, the pure record rules and the [`IdempotencyStore`](crate::IdempotencyStore)
//! trait. Depends on `error` only; every backend depends on it.

pub(crate) mod backend;
pub(crate) mod backoff;
pub(crate) mod clock;
pub(crate) mod fingerprint;
pub(crate) mod heartbeat;
pub(crate) mod key;
pub(crate) mod metrics;
pub(crate) mod nonblocking;
pub(crate) mod outcome;
pub(crate) mod publish;
pub(crate) mod random;
pub(crate) mod record;
pub(crate) mod records;
pub(crate) mod report;
pub(crate) mod response;
pub(crate) mod series;
pub(crate) mod settings;
pub(crate) mod store;
pub(crate) mod trace;
