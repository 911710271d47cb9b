//! The backend-neutral contract: keys, fingerprints, time, responses, outcomes and the
//! [`IdempotencyStore`](crate::IdempotencyStore) trait. Depends on `error` only.

pub(crate) mod backend;
pub(crate) mod clock;
pub(crate) mod fingerprint;
pub(crate) mod key;
pub(crate) mod outcome;
