//! The write calls that share group-commit batches, each a type with its own result.
//!
//! Every operation reads and validates before it mutates anything, so an operation that
//! fails for its own reasons (a lost lease, a corrupted record) leaves the shared transaction
//! untouched and the rest of its batch can still commit. A storage error, by contrast, may
//! leave the transaction half-written and fails the whole batch (see `Fail`).

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, ForceRelease, Lease};
use crate::api::record::{Attempt, Record, State, Verdict, verdict};
use crate::api::response::Response;
use crate::engine::batch::{Access, Ctx, Fail, Tables};
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

/// `Store::claim` when a write is needed: a fresh lease or a takeover (or, if the record
/// changed since the read path looked, whatever the claim now answers).
pub(crate) struct ClaimKey {
    pub key: Key,
    pub fingerprint: Fingerprint,
}

/// `Store::complete`.
pub(crate) struct Complete {
    pub key: Key,
    pub token: u64,
    pub response: Response,
}

/// `Store::release`.
pub(crate) struct Release {
    pub key: Key,
    pub token: u64,
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
        let ClaimKey { key, fingerprint } = self;
        let existing = tables.get(&key)?;
        let old_expires_at = existing.as_ref().map(|r| r.expires_at);
        let attempt = match verdict(existing, fingerprint, ctx.now) {
            Verdict::Answer(answer) => return Ok(answer),
            Verdict::Fresh => {
                if old_expires_at.is_none() {
                    A::make_room(tables, ctx.now)?;
                }
                Attempt::first(ctx.now)
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
        let record = Record::claimed(fingerprint, attempt, token, lease_until, ctx.retention_ms);
        tables.put(&key, old_expires_at, &record)?;
        Ok(Claim::Acquired(Lease {
            key,
            token,
            attempt: number,
            lease_until: Timestamp::from_millis(lease_until),
            checkpoint,
        }))
    }
}

impl Write for Complete {
    type Output = ();

    fn payload(&self) -> usize {
        self.response.size()
    }

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<(), Fail> {
        let held = tables.held(&self.key, self.token, ctx.now)?;
        let old_expires_at = held.expires_at;
        let record = held.completed(self.response, ctx.now, ctx.retention_ms);
        tables.put(&self.key, Some(old_expires_at), &record)
    }
}

impl Write for Release {
    type Output = ();

    fn apply<A: Access>(self, tables: &mut Tables<A>, ctx: &mut Ctx) -> Result<(), Fail> {
        let record = tables.held(&self.key, self.token, ctx.now)?;
        tables.delete(self.key.as_stored(), record.expires_at)
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
