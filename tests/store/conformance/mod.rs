//! One conformance suite for every backend: each test is written once, generic over a factory
//! that opens an [`IdempotencyStore`] driven by a [`ManualClock`], and runs against the redb
//! [`Store`] (in memory) and, with `--features postgres`, against [`PgStore`] (each test on a
//! fresh PostgreSQL schema, dropped afterwards). The model-based check runs the shared
//! reference model's step sequences (`tests/reference/`) against both as well.
//!
//! PostgreSQL tests read the server from `IDEMPOTENCY_PG_URL` (`.ci/run` starts a server and
//! sets it). Without it they print why and pass as skipped, except under `CI=true`, where a
//! missing server fails them.
//!
//! A module per family of operations holds its generic tests; this file runs them on both
//! backends and holds what they share.

mod claim;
mod contention;
mod execute;
mod limits;
mod maintenance;
#[cfg(feature = "postgres")]
mod pg;
#[cfg(feature = "postgres")]
mod pg_specific;
mod reference_model;
mod settle;

use claim::*;
use contention::*;
use execute::*;
use limits::*;
use maintenance::*;
use settle::*;

use std::time::Duration;

use idempotency_store::{
    Claim, Fingerprint, IdempotencyStore, Key, Lease, ManualClock, Result, Store, Timestamp,
};

const LEASE: Duration = Duration::from_secs(60);
const RETENTION: Duration = Duration::from_secs(24 * 3600);
const T0: u64 = 1_700_000_000_000;

/// The settings a test asks the factory for; lease and retention as above unless given.
#[derive(Debug, Clone, Copy)]
struct Settings {
    lease: Duration,
    retention: Duration,
    max_key_len: Option<usize>,
    max_response_bytes: Option<usize>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            lease: LEASE,
            retention: RETENTION,
            max_key_len: None,
            max_response_bytes: None,
        }
    }
}

/// Opens a store on fresh storage with a manual clock standing at `T0`.
type Factory<'a, S> = &'a dyn Fn(&Settings) -> Result<(S, ManualClock)>;

fn open_redb(settings: &Settings) -> Result<(Store, ManualClock)> {
    let clock = ManualClock::new(Timestamp::from_millis(T0));
    let mut builder = Store::builder();
    builder
        .lease(settings.lease)
        .retention(settings.retention)
        .clock(clock.clone());
    if let Some(len) = settings.max_key_len {
        builder.max_key_len(len);
    }
    if let Some(bytes) = settings.max_response_bytes {
        builder.max_response_bytes(bytes);
    }
    Ok((builder.open_in_memory()?, clock))
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", body])
}

fn acquire<S: IdempotencyStore>(store: &S, key: &Key, f: Fingerprint) -> Lease {
    match store.claim(key, f) {
        Ok(Claim::Acquired(lease)) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn at(ms: u64) -> Timestamp {
    Timestamp::from_millis(T0 + ms)
}

// ---------------------------------------------------------------------------------------------
// The two backends
// ---------------------------------------------------------------------------------------------

on_both_backends! {
    redb: &super::open_redb,
    postgres(db = super::pg::Db::fresh): &|settings| db.open(settings);
    fresh_key_is_acquired_with_attempt_one,
    live_lease_answers_in_progress_until_the_deadline,
    different_fingerprint_is_a_mismatch_in_every_state,
    completed_key_replays_byte_for_byte,
    lapsed_lease_is_taken_over_with_attempt_and_checkpoint,
    expired_record_is_claimed_afresh_by_any_request,
    in_progress_record_lives_until_created_plus_retention,
    a_lease_kept_for_its_own_retention_expires_by_it,
    a_lease_longer_than_retention_keeps_the_record,
    fencing_rejects_the_old_holder_and_changes_nothing,
    a_lapsed_lease_nobody_took_over_still_completes,
    a_settled_lease_cannot_settle_again,
    release_lets_a_retry_run_afresh,
    heartbeat_extends_the_lease_from_now,
    checkpoints_replace_each_other_and_survive_a_takeover,
    lookup_reports_the_record_view,
    scopes_are_isolated,
    max_key_len_is_enforced,
    oversized_response_is_rejected_and_the_lease_still_holds,
    sweep_deletes_only_expired_records_in_bounded_batches,
    sweep_takes_the_oldest_expiry_first,
    stats_count_records_by_state,
    execute_runs_once_and_releases_on_error,
    execute_works_through_a_trait_object,
    execute_reports_in_progress_without_running,
    concurrent_claims_have_exactly_one_winner,
    expired_keys_are_reclaimed_once_while_sweeps_run,
    tokens_increase_and_leases_follow_releases_under_contention,
}
