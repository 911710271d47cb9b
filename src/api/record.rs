//! A key's record as both backends keep it, and the pure rules over it: how a claim is
//! answered, how each call changes the record, when it expires, and what a caller sees.
//! Times are milliseconds since the Unix epoch.

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, ClaimId, Lease, RecordState, RecordView, Replay};
use crate::api::response::Response;

/// One key's record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    pub fingerprint: Fingerprint,
    pub created_at: u64,
    /// When the record stops counting; in the redb store mirrored by exactly one entry in the
    /// expiry index.
    pub expires_at: u64,
    /// 1 for the first claim, +1 per takeover.
    pub attempt: u32,
    pub state: State,
}

/// Where a record is in its life: held by an attempt, or settled with a response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    InProgress {
        /// The fencing token of the current lease.
        token: u64,
        lease_until: u64,
        /// The holder's recovery point (`Store::checkpoint`).
        checkpoint: Option<Vec<u8>>,
        /// The claim id the holder claimed with, if any: a claim with the same id gets the
        /// lease back (`claim_with_id`).
        claim_id: Option<u64>,
    },
    Completed {
        completed_at: u64,
        response: Response,
        /// The token of the lease that completed it (`None` in records written before the
        /// token was kept): a retried completion of that lease finds its own.
        token: Option<u64>,
    },
}

/// How a claim is answered; the read path, the write path and both backends decide alike.
pub(crate) enum Verdict {
    /// Nothing to write: replay, mismatch or in progress.
    Answer(Claim),
    /// No live record: a fresh attempt 1.
    Fresh,
    /// A lapsed lease with the same fingerprint: the next attempt takes it over.
    Takeover(Record),
}

/// The answer to a claim of `key` with `id` whose record is `record` (`None`: no record) at
/// `now`. A live lease won with the same claim id is handed back: that caller's earlier claim
/// acquired, and only its answer was lost.
pub(crate) fn verdict(
    key: &Key,
    record: Option<Record>,
    fingerprint: Fingerprint,
    id: Option<ClaimId>,
    now: Timestamp,
) -> Verdict {
    let Some(record) = record.filter(|r| !r.is_expired(now)) else {
        return Verdict::Fresh;
    };
    if record.fingerprint != fingerprint {
        return Verdict::Answer(Claim::Mismatch {
            stored: record.fingerprint,
        });
    }
    match record.state {
        State::InProgress {
            token,
            lease_until,
            checkpoint,
            claim_id: Some(held_by),
        } if now.as_millis() < lease_until && id.map(ClaimId::get) == Some(held_by) => {
            Verdict::Answer(Claim::Acquired(Lease::new(
                key.clone(),
                token,
                record.attempt,
                Timestamp::from_millis(lease_until),
                checkpoint,
            )))
        }
        State::InProgress { lease_until, .. } if now.as_millis() < lease_until => {
            Verdict::Answer(Claim::InProgress {
                lease_until: Timestamp::from_millis(lease_until),
                attempt: record.attempt,
            })
        }
        State::InProgress { .. } => Verdict::Takeover(record),
        State::Completed {
            completed_at,
            response,
            ..
        } => Verdict::Answer(Claim::Completed(Replay {
            response,
            created_at: Timestamp::from_millis(record.created_at),
            completed_at: Timestamp::from_millis(completed_at),
            expires_at: Timestamp::from_millis(record.expires_at),
            attempt: record.attempt,
        })),
    }
}

/// Who holds a record being claimed: the attempt's number, when the key was first claimed,
/// and the recovery point it starts from.
pub(crate) struct Attempt {
    pub created_at: u64,
    pub number: u32,
    pub checkpoint: Option<Vec<u8>>,
}

impl Attempt {
    /// Attempt 1 of a key claimed at `now`.
    pub(crate) fn first(now: Timestamp) -> Attempt {
        Attempt {
            created_at: now.as_millis(),
            number: 1,
            checkpoint: None,
        }
    }
}

impl Record {
    /// A record at `now` ends its life: it no longer replays or blocks, and a sweep deletes it.
    pub(crate) fn is_expired(&self, now: Timestamp) -> bool {
        now.as_millis() >= self.expires_at
    }

    /// The record a claim with `id` writes for `attempt`: held by `token` until
    /// `lease_until`, kept until `retention_ms` after the first claim or the lease's end,
    /// whichever is later.
    pub(crate) fn claimed(
        fingerprint: Fingerprint,
        attempt: Attempt,
        id: Option<ClaimId>,
        token: u64,
        lease_until: u64,
        retention_ms: u64,
    ) -> Record {
        Record {
            fingerprint,
            created_at: attempt.created_at,
            expires_at: attempt
                .created_at
                .saturating_add(retention_ms)
                .max(lease_until),
            attempt: attempt.number,
            state: State::InProgress {
                token,
                lease_until,
                checkpoint: attempt.checkpoint,
                claim_id: id.map(ClaimId::get),
            },
        }
    }

    /// The attempt that takes this record over: the next number, the same first-claim time
    /// and the last recovery point.
    pub(crate) fn takeover(self) -> Attempt {
        Attempt {
            created_at: self.created_at,
            number: self.attempt.saturating_add(1),
            checkpoint: match self.state {
                State::InProgress { checkpoint, .. } => checkpoint,
                State::Completed { .. } => None,
            },
        }
    }

    /// This record completed at `now` by the lease `token` with `response`: it replays until
    /// `now + retention_ms`.
    pub(crate) fn completed(
        self,
        token: u64,
        response: Response,
        now: Timestamp,
        retention_ms: u64,
    ) -> Record {
        Record {
            expires_at: now.plus(retention_ms).as_millis(),
            state: State::Completed {
                completed_at: now.as_millis(),
                response,
                token: Some(token),
            },
            ..self
        }
    }

    /// This record with its lease extended to `until`; an in-progress record never expires
    /// under a live lease.
    pub(crate) fn extended(mut self, until: u64) -> Record {
        if let State::InProgress { lease_until, .. } = &mut self.state {
            *lease_until = until;
        }
        self.expires_at = self.expires_at.max(until);
        self
    }

    /// What a caller sees of the record.
    pub(crate) fn into_view(self) -> RecordView {
        let state = match self.state {
            State::InProgress {
                lease_until,
                checkpoint,
                ..
            } => RecordState::InProgress {
                lease_until: Timestamp::from_millis(lease_until),
                checkpoint,
            },
            State::Completed {
                completed_at,
                response,
                ..
            } => RecordState::Completed {
                completed_at: Timestamp::from_millis(completed_at),
                response,
            },
        };
        RecordView {
            fingerprint: self.fingerprint,
            created_at: Timestamp::from_millis(self.created_at),
            expires_at: Timestamp::from_millis(self.expires_at),
            attempt: self.attempt,
            state,
        }
    }

    /// Whether the lease `token` completed this record with exactly `response`: a retried
    /// completion of that lease that finds it has nothing left to do.
    pub(crate) fn completed_by(&self, token: u64, response: &Response) -> bool {
        matches!(&self.state, State::Completed { token: Some(t), response: r, .. }
            if *t == token && r == response)
    }
}
