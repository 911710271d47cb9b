//! The write calls that share group-commit batches, each a type with its own result.
//!
//! Every operation reads and validates before it mutates anything, so an operation that
//! fails for its own reasons (a lost lease, a corrupted record) leaves the shared transaction
//! untouched and the rest of its batch can still commit. A storage error, by contrast, may
//! leave the transaction half-written and fails the whole batch (see `Fail`).

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, ClaimId, ForceRelease, Lease};
use crate::api::record::{Attempt, Record, State, Verdict, verdict};
use crate::api::response::Response;
use crate::engine::batch::{Access, Ctx, Fail, Tables};
use crate::engine::effects::{EffectScope, Effects, Ran};
use crate::error::Error;

/// One write call: applied to any kind of batch, it yields its own result type.
pub(crate) trait Write: Send + 'static {
    /// What the caller gets back once the batch is durable.
    type Output: Send + 'static;

    /// Applies the call to a batch's tables.
    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<Self::Output, Fail>;

    /// The bytes of response or checkpoint it carries, which bound a batch's memory.
    fn payload(&self) -> usize {
        0
    }
}

/// A claim (`IdempotencyStore::claim`) when a write is needed: a fresh lease or a takeover
/// (or, if the record changed since the read path looked, whatever the claim now answers).
pub(crate) struct ClaimKey {
    pub key: Key,
    pub fingerprint: Fingerprint,
    pub id: Option<ClaimId>,
    /// The recovery point a fresh record starts with (`Store::claim_seeded`); a takeover
    /// keeps the record's own.
    pub seed: Option<Vec<u8>>,
    /// The claim's read found the key in neither the overlay nor redb, with a read snapshot
    /// at this counter (`snapshot::Snapshots::epoch`): a batch whose snapshot has the same
    /// counter finds redb unchanged under the overlay and need not look there again.
    pub absent_at: Option<u64>,
}

/// `IdempotencyStore::complete`.
pub(crate) struct Complete {
    pub key: Key,
    pub token: u64,
    pub response: Response,
    /// An earlier completion of this lease failed with its outcome unknown: finding that
    /// completion already stored is success.
    pub retry: bool,
    /// The lease's own retention ([`Lease::keep_for`]), else the store's.
    pub retention_ms: Option<u64>,
}

/// A caller's effect: runs on the batch leader's thread, once, with the batch's tables.
pub(crate) type Effect<T, E> = Box<dyn FnOnce(&mut Effects<'_>) -> Result<T, E> + Send>;

/// `Store::complete_with_effects`: the effect's rows and the completion, in one batch.
pub(crate) struct CompleteEffects<T, E> {
    pub complete: Complete,
    pub effect: Effect<T, E>,
}

/// `IdempotencyStore::release`.
pub(crate) struct Release {
    pub key: Key,
    pub token: u64,
    /// An earlier settling call of this lease failed with its outcome unknown: finding the
    /// record gone is success.
    pub retry: bool,
}

/// `Store::heartbeat`; yields the new end of the lease.
pub(crate) struct Heartbeat {
    pub key: Key,
    pub token: u64,
}

/// `Store::checkpoint`: the holder's recovery point.
pub(crate) struct Checkpoint {
    pub key: Key,
    pub token: u64,
    pub data: Vec<u8>,
}

/// `Store::force_release`: an operator deleting an in-progress record without its lease.
pub(crate) struct ForceReleaseKey {
    pub key: Key,
}

impl Write for ClaimKey {
    type Output = Claim;

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<Claim, Fail> {
        let ClaimKey {
            key,
            fingerprint,
            id,
            seed,
            absent_at,
        } = self;
        let existing = tables.get_unless_absent(&key, absent_at)?;
        let old_expires_at = existing.as_ref().map(|r| r.expires_at);
        let attempt = match verdict(&key, existing, fingerprint, id, ctx.now) {
            Verdict::Answer(answer) => return Ok(answer),
            Verdict::Fresh => {
                if old_expires_at.is_none() {
                    A::make_room(tables, ctx.now)?;
                }
                Attempt {
                    checkpoint: seed,
                    ..Attempt::first(ctx.now)
                }
            }
            Verdict::Takeover(old) => old.takeover(),
        };
        let token = ctx.next_token;
        // Only a damaged counter gets here: 2^64 claims would take millennia.
        ctx.next_token = token.checked_add(1).ok_or_else(|| {
            Fail::Op(Error::corrupted(
                "the fencing-token counter is exhausted (damaged metadata)",
            ))
        })?;
        let lease_until = ctx.now.plus(ctx.lease_ms).as_millis();
        let (number, checkpoint) = (attempt.number, attempt.checkpoint.clone());
        let record = Record::claimed(
            fingerprint,
            attempt,
            id,
            token,
            lease_until,
            ctx.retention_ms,
        );
        tables.put(&key, old_expires_at, &record)?;
        Ok(Claim::Acquired(Lease::new(
            key,
            token,
            number,
            Timestamp::from_millis(lease_until),
            checkpoint,
        )))
    }
}

impl Write for Complete {
    type Output = ();

    fn payload(&self) -> usize {
        self.response.size()
    }

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<(), Fail> {
        let Some(held) = self.held_or_settled(tables, ctx.now)? else {
            return Ok(());
        };
        let old_expires_at = held.expires_at;
        let retention_ms = self.retention_ms.unwrap_or(ctx.retention_ms);
        let record = held.completed(self.token, self.response, ctx.now, retention_ms);
        tables.put(&self.key, Some(old_expires_at), &record)
    }
}

impl<T: Send + 'static, E: Send + 'static> Write for CompleteEffects<T, E> {
    type Output = Ran<T, E>;

    fn payload(&self) -> usize {
        self.complete.payload()
    }

    /// The effect runs only while the lease holds. Its rows are applied after the completion,
    /// which is the step that can fail on its own: once rows are in the batch, only a failure
    /// of the whole batch can follow, so no row commits without its response.
    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<Ran<T, E>, Fail> {
        let CompleteEffects { complete, effect } = self;
        tables.held(&complete.key, complete.token, ctx.now)?;
        let (ran, rows) = {
            let mut effects = Effects::new(tables.access.registry(), &*tables);
            let ran = {
                let _inside = EffectScope::enter();
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| effect(&mut effects)))
            };
            (ran, effects.finish())
        };
        match ran {
            Ok(Ok(output)) => {
                let rows = rows.map_err(Fail::Op)?;
                complete.apply(tables, ctx)?;
                for row in rows {
                    tables.set_effect(row)?;
                }
                Ok(Ok(Ok(output)))
            }
            Ok(Err(err)) => Ok(Ok(Err(err))),
            Err(panic) => Ok(Err(panic)),
        }
    }
}

impl Write for Release {
    type Output = ();

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<(), Fail> {
        let record = match tables.held(&self.key, self.token, ctx.now) {
            Ok(record) => record,
            // Gone: this lease's release landed (or the record expired and was swept); the
            // key is free either way.
            Err(_) if self.retry && tables.get(&self.key)?.is_none() => return Ok(()),
            Err(lost) => return Err(lost),
        };
        tables.delete(self.key.as_stored(), record.expires_at)
    }
}

impl Complete {
    /// The completion of `lease` with `response`; `retry` as for [`Complete::retry`].
    pub(crate) fn of(lease: &Lease, response: Response, retry: bool) -> Complete {
        Complete {
            key: lease.key.clone(),
            token: lease.token,
            response,
            retry,
            retention_ms: lease.retention_ms,
        }
    }

    /// The record this completion may settle; `None` for a retry that finds its own
    /// completion stored (the earlier attempt of this very call landed, only its answer was
    /// lost): nothing left to do.
    pub(crate) fn held_or_settled<A: Access>(
        &self,
        tables: &Tables<A>,
        now: Timestamp,
    ) -> Result<Option<Record>, Fail> {
        match tables.held(&self.key, self.token, now) {
            Ok(held) => Ok(Some(held)),
            Err(lost) if self.retry => match tables.get(&self.key)? {
                Some(record) if record.completed_by(self.token, &self.response) => Ok(None),
                _ => Err(lost),
            },
            Err(lost) => Err(lost),
        }
    }
}

impl Write for Heartbeat {
    type Output = Timestamp;

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<Timestamp, Fail> {
        let record = tables.held(&self.key, self.token, ctx.now)?;
        let old_expires_at = record.expires_at;
        let new_until = ctx.now.plus(ctx.lease_ms).as_millis();
        tables.put(&self.key, Some(old_expires_at), &record.extended(new_until))?;
        Ok(Timestamp::from_millis(new_until))
    }
}

impl Write for Checkpoint {
    type Output = ();

    fn payload(&self) -> usize {
        self.data.len()
    }

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<(), Fail> {
        let mut record = tables.held(&self.key, self.token, ctx.now)?;
        if let State::InProgress { checkpoint, .. } = &mut record.state {
            *checkpoint = Some(self.data);
        }
        tables.put(&self.key, Some(record.expires_at), &record)
    }
}

impl Write for ForceReleaseKey {
    type Output = ForceRelease;

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<ForceRelease, Fail> {
        Ok(match tables.get(&self.key)? {
            Some(record) if record.is_expired(ctx.now) => ForceRelease::NotFound,
            None => ForceRelease::NotFound,
            Some(Record {
                state: State::Completed { .. },
                ..
            }) => ForceRelease::Completed,
            Some(Record {
                expires_at,
                attempt,
                state: State::InProgress { lease_until, .. },
                ..
            }) => {
                tables.delete(self.key.as_stored(), expires_at)?;
                ForceRelease::Released {
                    attempt,
                    lease_until: Timestamp::from_millis(lease_until),
                }
            }
        })
    }
}
