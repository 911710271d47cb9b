//! The outbox: intents kept as records of the store, under their own scope.

use std::sync::Arc;

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, ClaimId, RecordState, RecordView};
use crate::api::response::Response;
use crate::api::store::IdempotencyStore;
use crate::client::intent::{Intent, Pending, Sent, State};
use crate::error::{Error, Result};
use crate::store::Store;

/// The scope under which intents are stored ([`Key::scoped`]): an operation id is a key in
/// it, so intents and the server-side records of the same file never meet.
pub const SCOPE: &str = "idempotency-client";

/// Outbound idempotency keys that survive the caller's crash; see the [module
/// docs](super).
#[derive(Debug, Clone)]
pub struct Outbox {
    store: Arc<Store>,
}

impl Outbox {
    /// An outbox on `store`, which may also hold the device's server-side records. Intents
    /// live `retention` (the store's setting) from [`begin`](Outbox::begin), like records, and
    /// its sweeps delete them.
    #[must_use]
    pub fn new(store: Arc<Store>) -> Outbox {
        Outbox { store }
    }

    /// The store behind the outbox.
    #[must_use]
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// Begins the operation `operation_id` (the caller's own id of it: an order number, a
    /// queue entry) or finds it begun. The first call mints a key (UUID v4) and stores it
    /// durably before it returns; every later call, in this process or after a restart,
    /// returns the same key and the sends so far ([`Claim::Acquired`] with the [`Intent`]), or
    /// [`Claim::Completed`] with the stored answer once the operation is finished.
    /// `fingerprint` is the request's: the same id with another fingerprint is
    /// [`Claim::Mismatch`]. [`Claim::InProgress`] means that a claim made without the outbox
    /// holds the intent's record (only the outbox claims keys of the scope [`SCOPE`]): an
    /// operator's `force_release` of it, or its lapse, ends that.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if `operation_id` is not a valid key; the store's errors.
    pub fn begin(&self, operation_id: &str, fingerprint: Fingerprint) -> Result<Claim<Intent>> {
        self.begin_as(operation_id, fingerprint, None)
    }

    /// [`begin`](Outbox::begin), with the caller's own key for a new intent (an intent
    /// already begun keeps its key).
    ///
    /// # Errors
    /// As for [`begin`](Outbox::begin); [`Error::InvalidKey`] if `key` is not 1 to 255
    /// printable ASCII characters.
    pub fn begin_with_key(
        &self,
        operation_id: &str,
        fingerprint: Fingerprint,
        key: &str,
    ) -> Result<Claim<Intent>> {
        Key::new(key)?;
        self.begin_as(operation_id, fingerprint, Some(key))
    }

    fn begin_as(
        &self,
        operation_id: &str,
        fingerprint: Fingerprint,
        key: Option<&str>,
    ) -> Result<Claim<Intent>> {
        let record = Key::scoped(SCOPE, operation_id)?;
        let minted = key.map_or_else(|| uuid::Uuid::new_v4().to_string(), str::to_owned);
        let seed = State::new(minted, self.store.now()?);
        let claim =
            self.store
                .claim_seeded(&record, fingerprint, claim_id(&record), seed.encode()?)?;
        match claim {
            Claim::Acquired(mut lease) => {
                let state = match lease.checkpoint() {
                    Some(bytes) => State::decode(bytes)?,
                    // A record of this scope that some other code claimed without a state:
                    // no key was handed out for it, so this one is the first.
                    None => {
                        self.store.checkpoint(&mut lease, seed.encode()?)?;
                        seed
                    }
                };
                Ok(Claim::Acquired(Intent {
                    operation_id: operation_id.to_owned(),
                    fingerprint,
                    state,
                    lease,
                }))
            }
            Claim::Completed(replay) => Ok(Claim::Completed(replay)),
            Claim::Mismatch { stored } => Ok(Claim::Mismatch { stored }),
            Claim::InProgress {
                lease_until,
                attempt,
            } => Ok(Claim::InProgress {
                lease_until,
                attempt,
            }),
        }
    }

    /// Records, durably, that a send of the intent is about to go out; returns its number
    /// (1 for the first, counting across restarts). Call it before each send and
    /// [`record`](Outbox::record) after; [`send`](Outbox::send) does both.
    ///
    /// # Errors
    /// The store's errors; [`Error::LeaseLost`] only if the intent was finished meanwhile.
    pub fn start(&self, intent: &mut Intent) -> Result<u32> {
        let number = intent.state.start(self.store.now()?);
        self.save(intent)?;
        Ok(number)
    }

    /// Records, durably, what the last send came to.
    ///
    /// # Errors
    /// As for [`start`](Outbox::start).
    pub fn record(&self, intent: &mut Intent, sent: Sent) -> Result<()> {
        intent.state.record(sent);
        self.save(intent)
    }

    /// Finishes the intent with the server's final `answer`, durably: from then on
    /// [`begin`](Outbox::begin) returns [`Claim::Completed`] with it, and the intent is no
    /// longer [`pending`](Outbox::pending).
    ///
    /// # Errors
    /// [`Error::ResponseTooLarge`] if `answer` is larger than the store's
    /// `max_response_bytes` (nothing written); the store's errors.
    pub fn finish(&self, intent: &Intent, answer: Response) -> Result<()> {
        match self.store.complete(&intent.lease, answer.clone()) {
            Err(Error::LeaseLost) => match self.refresh(intent)? {
                Some(lease) => self.store.complete(&lease, answer),
                None => Ok(()),
            },
            other => other,
        }
    }

    /// Every unfinished, unexpired intent, oldest first: what a device resumes at boot (begin
    /// each again, then send). Walks every record of the store.
    ///
    /// # Errors
    /// The store's errors, and [`Error::Corrupted`] for a record that does not decode.
    pub fn pending(&self) -> Result<Vec<Pending>> {
        let now = self.store.now()?;
        let mut out = Vec::new();
        for stored in self.store.records()? {
            let stored = stored?;
            if stored.record.expires_at <= now {
                continue;
            }
            if let Some(pending) = Outbox::intent_of(&stored.key, &stored.record)? {
                out.push(pending);
            }
        }
        out.sort_by(|a, b| (a.begun_at, &a.operation_id).cmp(&(b.begun_at, &b.operation_id)));
        Ok(out)
    }

    /// The unfinished intent that a stored record holds, if it is one (a record of the scope
    /// [`SCOPE`], in progress, with the outbox's state): for tools that walk a store's records,
    /// such as the operator CLI, which must not treat an intent as a stuck request. Expiry is
    /// not checked.
    ///
    /// # Errors
    /// [`Error::Corrupted`] for a record of the scope whose state does not decode.
    pub fn intent_of(key: &Key, record: &RecordView) -> Result<Option<Pending>> {
        if key.scope() != Some(SCOPE) {
            return Ok(None);
        }
        match &record.state {
            RecordState::InProgress {
                checkpoint: Some(bytes),
                ..
            } => Ok(Some(State::decode(bytes)?.pending(key.key().to_owned()))),
            _ => Ok(None),
        }
    }

    /// Stores the intent's state as its record's recovery point. A lease that lapsed and was
    /// taken over by another `begin` of the same operation is refreshed first.
    fn save(&self, intent: &mut Intent) -> Result<()> {
        let bytes = intent.state.encode()?;
        match self.store.checkpoint(&mut intent.lease, bytes.clone()) {
            Err(Error::LeaseLost) => {
                let lease = self.refresh(intent)?.ok_or(Error::LeaseLost)?;
                intent.lease = lease;
                self.store.checkpoint(&mut intent.lease, bytes)
            }
            other => other,
        }
    }

    /// The intent's current lease (recovered or taken over with the outbox's claim id), or
    /// `None` if it is finished.
    fn refresh(&self, intent: &Intent) -> Result<Option<crate::api::outcome::Lease>> {
        let record = Key::scoped(SCOPE, &intent.operation_id)?;
        let seed = intent.state.encode()?;
        let claim =
            self.store
                .claim_seeded(&record, intent.fingerprint, claim_id(&record), seed)?;
        match claim {
            Claim::Acquired(lease) => Ok(Some(lease)),
            Claim::Completed(_) => Ok(None),
            _ => Err(Error::LeaseLost),
        }
    }
}

/// The outbox's claim id for an intent: the same in every process, so that `begin` gets the
/// intent's lease back while it is live (instead of "in progress" after a restart) and takes
/// it over once it lapsed.
fn claim_id(record: &Key) -> ClaimId {
    let digest = blake3::hash(record.as_stored());
    let mut bits = [0u8; 8];
    bits.copy_from_slice(&digest.as_bytes()[..8]);
    ClaimId::new(u64::from_le_bytes(bits))
}
