//! The model: records in milliseconds of the store's time, and what each call does to them.

use std::collections::HashMap;

use idempotency_store::{Fingerprint, Key, RecordState, RecordView, Replay, Response, Timestamp};

use super::{LEASE_MS, RETENTION_MS, Ties, fingerprint, key, ts};

#[derive(Debug, Clone)]
pub struct MRec {
    fp: usize,
    created_at: u64,
    expires_at: u64,
    attempt: u32,
    state: MState,
}

#[derive(Debug, Clone)]
pub enum MState {
    /// `holder` names the test's lease (its index in the caller's lease list), standing in for
    /// the fencing token.
    InProgress {
        holder: usize,
        lease_until: u64,
        checkpoint: Option<Vec<u8>>,
    },
    Completed {
        completed_at: u64,
        response: Response,
    },
}

/// A claim outcome without the fencing token.
#[derive(Debug, Clone, PartialEq)]
pub enum Shape {
    Acquired {
        key: Key,
        attempt: u32,
        lease_until: Timestamp,
        checkpoint: Option<Vec<u8>>,
    },
    InProgress {
        lease_until: Timestamp,
        attempt: u32,
    },
    Completed(ReplayShape),
    Mismatch(Fingerprint),
}

/// Every field of a [`Replay`] (which is `#[non_exhaustive]`, so the model cannot build one).
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayShape {
    pub response: Response,
    pub created_at: Timestamp,
    pub completed_at: Timestamp,
    pub expires_at: Timestamp,
    pub attempt: u32,
}

impl From<Replay> for ReplayShape {
    fn from(r: Replay) -> Self {
        ReplayShape {
            response: r.response,
            created_at: r.created_at,
            completed_at: r.completed_at,
            expires_at: r.expires_at,
            attempt: r.attempt,
        }
    }
}

/// Every field of a [`RecordView`] (`#[non_exhaustive]`, so the model cannot build one).
#[derive(Debug, Clone, PartialEq)]
pub struct ViewShape {
    pub fingerprint: Fingerprint,
    pub created_at: Timestamp,
    pub expires_at: Timestamp,
    pub attempt: u32,
    pub state: RecordState,
}

impl From<RecordView> for ViewShape {
    fn from(v: RecordView) -> Self {
        ViewShape {
            fingerprint: v.fingerprint,
            created_at: v.created_at,
            expires_at: v.expires_at,
            attempt: v.attempt,
            state: v.state,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLost;

#[derive(Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub(super) in_progress: u64,
    pub(super) stuck: u64,
    pub(super) completed: u64,
    pub(super) expired: u64,
    pub(super) records: u64,
}

/// The model of one store (or of the keys one caller owns). Lease and retention are the
/// sequential runs' ([`LEASE_MS`], [`RETENTION_MS`]) unless set with [`Model::with_times`].
#[derive(Debug, Clone)]
pub struct Model {
    records: HashMap<usize, MRec>,
    lease_ms: u64,
    retention_ms: u64,
}

impl Default for Model {
    fn default() -> Self {
        Model::with_times(LEASE_MS, RETENTION_MS)
    }
}

impl Model {
    /// An empty model with this lease and retention.
    pub fn with_times(lease_ms: u64, retention_ms: u64) -> Model {
        Model {
            records: HashMap::new(),
            lease_ms,
            retention_ms,
        }
    }

    fn live(&self, k: usize, now: u64) -> Option<&MRec> {
        self.records.get(&k).filter(|r| now < r.expires_at)
    }

    pub fn claim(&mut self, k: usize, fp: usize, now: u64, holder: usize) -> Shape {
        let (created_at, attempt, checkpoint) = match self.live(k, now).cloned() {
            None => (now, 1, None),
            Some(r) if r.fp != fp => return Shape::Mismatch(fingerprint(r.fp)),
            Some(r) => match r.state {
                MState::InProgress { lease_until, .. } if now < lease_until => {
                    return Shape::InProgress {
                        lease_until: ts(lease_until),
                        attempt: r.attempt,
                    };
                }
                MState::InProgress { checkpoint, .. } => (r.created_at, r.attempt + 1, checkpoint),
                MState::Completed {
                    completed_at,
                    response,
                } => {
                    return Shape::Completed(ReplayShape {
                        response,
                        created_at: ts(r.created_at),
                        completed_at: ts(completed_at),
                        expires_at: ts(r.expires_at),
                        attempt: r.attempt,
                    });
                }
            },
        };
        let lease_until = now + self.lease_ms;
        self.records.insert(
            k,
            MRec {
                fp,
                created_at,
                expires_at: (created_at + self.retention_ms).max(lease_until),
                attempt,
                state: MState::InProgress {
                    holder,
                    lease_until,
                    checkpoint: checkpoint.clone(),
                },
            },
        );
        Shape::Acquired {
            key: key(k),
            attempt,
            lease_until: ts(lease_until),
            checkpoint,
        }
    }

    fn held(&mut self, k: usize, holder: usize, now: u64) -> Result<&mut MRec, LeaseLost> {
        match self.records.get_mut(&k) {
            Some(r)
                if now < r.expires_at
                    && matches!(r.state, MState::InProgress { holder: h, .. } if h == holder) =>
            {
                Ok(r)
            }
            _ => Err(LeaseLost),
        }
    }

    pub fn complete(
        &mut self,
        k: usize,
        holder: usize,
        now: u64,
        response: Response,
    ) -> Result<(), LeaseLost> {
        let retention_ms = self.retention_ms;
        let r = self.held(k, holder, now)?;
        r.expires_at = now + retention_ms;
        r.state = MState::Completed {
            completed_at: now,
            response,
        };
        Ok(())
    }

    pub fn release(&mut self, k: usize, holder: usize, now: u64) -> Result<(), LeaseLost> {
        self.held(k, holder, now)?;
        self.records.remove(&k);
        Ok(())
    }

    pub fn heartbeat(&mut self, k: usize, holder: usize, now: u64) -> Result<u64, LeaseLost> {
        let until = now + self.lease_ms;
        let r = self.held(k, holder, now)?;
        if let MState::InProgress { lease_until, .. } = &mut r.state {
            *lease_until = until;
        }
        r.expires_at = r.expires_at.max(until);
        Ok(until)
    }

    pub fn checkpoint(
        &mut self,
        k: usize,
        holder: usize,
        now: u64,
        data: Vec<u8>,
    ) -> Result<(), LeaseLost> {
        let r = self.held(k, holder, now)?;
        if let MState::InProgress { checkpoint, .. } = &mut r.state {
            *checkpoint = Some(data);
        }
        Ok(())
    }

    pub fn view(&self, k: usize, now: u64) -> Option<ViewShape> {
        let r = self.live(k, now)?;
        Some(ViewShape {
            fingerprint: fingerprint(r.fp),
            created_at: ts(r.created_at),
            expires_at: ts(r.expires_at),
            attempt: r.attempt,
            state: match &r.state {
                MState::InProgress {
                    lease_until,
                    checkpoint,
                    ..
                } => RecordState::InProgress {
                    lease_until: ts(*lease_until),
                    checkpoint: checkpoint.clone(),
                },
                MState::Completed {
                    completed_at,
                    response,
                } => RecordState::Completed {
                    completed_at: ts(*completed_at),
                    response: response.clone(),
                },
            },
        })
    }

    /// The times at which key `k`'s answers change by themselves (its lease deadline and its
    /// expiry), for a checker choosing an operation's time.
    pub fn deadlines(&self, k: usize) -> Vec<u64> {
        match self.records.get(&k) {
            Some(MRec {
                expires_at,
                state: MState::InProgress { lease_until, .. },
                ..
            }) => vec![*lease_until, *expires_at],
            Some(r) => vec![r.expires_at],
            None => Vec::new(),
        }
    }

    /// The expired records as `(expires_at, tie order, key index)`, a sweep's order.
    fn expired(&self, now: u64, ties: Ties) -> Vec<(u64, Vec<u8>, usize)> {
        self.records
            .iter()
            .filter(|(_, r)| now >= r.expires_at)
            .map(|(&k, r)| (r.expires_at, ties.order(k), k))
            .collect()
    }

    pub(super) fn counts(&self, now: u64) -> Counts {
        let mut c = Counts::default();
        for r in self.records.values() {
            c.records += 1;
            if now >= r.expires_at {
                c.expired += 1;
                continue;
            }
            match r.state {
                MState::InProgress { lease_until, .. } => {
                    c.in_progress += 1;
                    c.stuck += u64::from(now >= lease_until);
                }
                MState::Completed { .. } => c.completed += 1,
            }
        }
        c
    }
}

/// Sweeps the models as `sweep(limit)` sweeps a backend that orders ties by `ties`: the
/// `limit` oldest expired records across all of them. Returns how many went.
pub fn sweep_models(
    models: &mut [&mut Model],
    owner: impl Fn(usize) -> usize,
    now: u64,
    limit: usize,
    ties: Ties,
) -> usize {
    let mut expired: Vec<_> = models.iter().flat_map(|m| m.expired(now, ties)).collect();
    expired.sort();
    expired.truncate(limit);
    for (_, _, k) in &expired {
        models[owner(*k)].records.remove(k);
    }
    expired.len()
}
