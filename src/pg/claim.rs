//! A claim: insert a new key, else decide on the record as the redb store does, else take an
//! expired or lapsed record over; started over when a race changes the record between them.

use std::time::Instant;

use ::postgres::GenericClient;
use ::postgres::types::ToSql;

use super::calls::replicated;
use super::rows::{attempt_col, col, millis_col, pg, record_from, token_col};
use super::sql::Sql;
use super::{PgStore, quota};
use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, ClaimId, Lease};
use crate::api::record::{Verdict, verdict};
use crate::error::{Error, Result};

/// How often one claim starts over after losing a race before it reports an error.
const CLAIM_ROUNDS: usize = 64;

/// A claim's parameters, as the statements take them.
struct ClaimArgs<'a> {
    key: &'a Key,
    scope: &'a str,
    name: &'a str,
    digest: &'a [u8],
    version: i16,
    fingerprint: Fingerprint,
    id: Option<ClaimId>,
    /// `id` as the column stores it (the bits of the `u64`).
    claim_id: Option<i64>,
}

impl PgStore {
    /// A claim, with the caller's claim id if any.
    pub(super) fn claim_as(
        &self,
        key: &Key,
        fingerprint: Fingerprint,
        id: Option<ClaimId>,
    ) -> Result<Claim> {
        self.check_key(key)?;
        let args = ClaimArgs {
            key,
            scope: key.scope().unwrap_or(""),
            name: key.key(),
            digest: fingerprint.digest(),
            version: i16::from(fingerprint.version()),
            fingerprint,
            id,
            claim_id: id.map(|id| i64::from_ne_bytes(id.get().to_ne_bytes())),
        };
        self.with_write_conn(|client, st| {
            if let (Some(limits), Some(quota)) = (&self.limits, &st.quota) {
                let key_parts = (args.scope, args.name);
                quota::make_room(client, quota, limits, &|| self.now_param(), key_parts)?;
            }
            if self.settings.clock.is_none() {
                // The statements lock the key, then read the server's clock and draw the token.
                let claim = self.claim_rounds(client, st, &args)?;
                return Ok(claim);
            }
            // An injected clock is read here, not in SQL: lock the key first, in a transaction,
            // so that the time is read after the claim has the key to itself.
            let mut txn = client.transaction().map_err(|e| pg("claiming a key", e))?;
            st.lock
                .query(&mut txn, &[&args.scope, &args.name])
                .map_err(|e| pg("claiming a key", e))?;
            let claim = self.claim_rounds(&mut txn, st, &args)?;
            txn.commit().map_err(|e| pg("claiming a key", e))?;
            Ok(match self.injected_now() {
                Some(now) => claim.unless_lapsed(Timestamp::from_millis(now)),
                None => claim,
            })
        })
    }

    /// The claim's statements, started over when the record changes between them: insert a
    /// new key, else read the record and decide, else take an expired or lapsed record over.
    fn claim_rounds(
        &self,
        client: &mut impl GenericClient,
        st: &Sql,
        args: &ClaimArgs<'_>,
    ) -> Result<Claim> {
        let key = args.key;
        for _ in 0..CLAIM_ROUNDS {
            let now = self.now_param();
            let claim_params: [&(dyn ToSql + Sync); 8] = [
                &now,
                &args.scope,
                &args.name,
                &args.digest,
                &args.version,
                &self.lease_ms,
                &self.retention_ms,
                &args.claim_id,
            ];
            // A new key: the insert wins or loses atomically on the primary key.
            let sent = Instant::now();
            if let Some(row) = st
                .insert
                .query_opt(client, &claim_params)
                .map_err(|e| pg("claiming a key", e))?
            {
                let lease = Lease::new(
                    key.clone(),
                    token_col(&row, 0)?,
                    1,
                    Timestamp::from_millis(millis_col(&row, 1)?),
                    None,
                );
                return Ok(self.unless_lapsed(lease, sent));
            }
            // The key exists: decide as the redb store does, on a fresh snapshot.
            let row = st
                .select
                .query_one(client, &[&now, &args.scope, &args.name])
                .map_err(|e| pg("reading a record", e))?;
            let db_now = Timestamp::from_millis(millis_col(&row, 0)?);
            let Some(record) = record_from(&row, 1)? else {
                continue; // released or swept since the insert: start over
            };
            if let Verdict::Answer(answer) =
                verdict(key, Some(record), args.fingerprint, args.id, db_now)
            {
                if matches!(answer, Claim::Acquired(_)) {
                    // Its own lease, got back by the claim id after an unknown outcome.
                    replicated(client)?;
                }
                return Ok(answer);
            }
            // Expired or lapsed: take it over if it still is, re-checked on the latest row.
            let sent = Instant::now();
            if let Some(row) = st
                .takeover
                .query_opt(client, &claim_params)
                .map_err(|e| pg("taking a key over", e))?
            {
                let lease = Lease::new(
                    key.clone(),
                    token_col(&row, 0)?,
                    attempt_col(&row, 1)?,
                    Timestamp::from_millis(millis_col(&row, 2)?),
                    col(&row, 3)?,
                );
                return Ok(self.unless_lapsed(lease, sent));
            }
        }
        Err(Error::storage(
            "claiming a key",
            std::io::Error::other("the record kept changing under concurrent claims; try again"),
        ))
    }

    /// A lease won by a statement sent at `sent`, unless it may have lapsed before reaching
    /// the caller. With the server's clock the lease began after `sent`, so it has lapsed for
    /// sure only once a whole lease has passed since; counting from `sent` errs on the safe
    /// side. (With an injected clock the caller checks that clock after the commit.)
    fn unless_lapsed(&self, lease: Lease, sent: Instant) -> Claim {
        if self.settings.clock.is_some() || sent.elapsed() < self.settings.shared.lease() {
            return Claim::Acquired(lease);
        }
        Claim::InProgress {
            lease_until: lease.lease_until,
            attempt: lease.attempt,
        }
    }
}
