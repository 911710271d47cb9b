//! An intent: one logical outbound operation, its key and its sends, as the outbox keeps it.

use serde::{Deserialize, Serialize};

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::outcome::Lease;
use crate::error::{Error, Result};

/// What one send came to, as recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Sent {
    /// Recorded before the send, and nothing since: the process stopped while the request was
    /// out, so the server may or may not have it.
    Unknown,
    /// The server answered with this status.
    Answered(u16),
    /// Sent, but no answer came (a timeout, a connection lost): the server may have acted.
    NoAnswer,
    /// Refused before anything was sent (connection refused, no route): the server has
    /// nothing.
    Refused,
}

/// One send of an intent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Attempt {
    /// 1 for the first send of the intent, counting across restarts.
    pub number: u32,
    /// When it was recorded, before the request went out (the store's clock).
    pub at: Timestamp,
    /// What it came to.
    pub sent: Sent,
}

/// An unfinished outbound operation: send its request with [`key`](Intent::key) on every
/// attempt, then [`Outbox::finish`](super::Outbox::finish) it with the server's answer.
#[derive(Debug)]
pub struct Intent {
    pub(crate) operation_id: String,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) state: State,
    pub(crate) lease: Lease,
}

impl Intent {
    /// The idempotency key to send with every attempt of this operation, retries and
    /// restarts included.
    #[must_use]
    pub fn key(&self) -> &str {
        &self.state.key
    }

    /// The caller's id of the operation.
    #[must_use]
    pub fn operation_id(&self) -> &str {
        &self.operation_id
    }

    /// The sends so far, oldest first (across restarts).
    #[must_use]
    pub fn attempts(&self) -> Vec<Attempt> {
        self.state.attempts.iter().map(Wire::attempt).collect()
    }

    /// When the intent was begun (the store's clock): the server cannot have seen its key
    /// before then, so its retention is counted from here.
    #[must_use]
    pub fn begun_at(&self) -> Timestamp {
        Timestamp::from_millis(self.state.begun_at)
    }
}

/// An unfinished intent, as [`Outbox::pending`](super::Outbox::pending) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Pending {
    /// The caller's id of the operation: [`begin`](super::Outbox::begin) it again to resume.
    pub operation_id: String,
    /// Its idempotency key.
    pub key: String,
    /// When it was begun.
    pub begun_at: Timestamp,
    /// How many sends were recorded.
    pub attempts: u32,
    /// What the last send came to, if there was one.
    pub last: Option<Sent>,
}

/// The intent's durable state: the recovery point of its record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct State {
    pub key: String,
    pub begun_at: u64,
    pub attempts: Vec<Wire>,
}

/// An attempt as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Wire {
    number: u32,
    at: u64,
    sent: Sent,
}

impl Wire {
    fn attempt(&self) -> Attempt {
        Attempt {
            number: self.number,
            at: Timestamp::from_millis(self.at),
            sent: self.sent,
        }
    }
}

/// The encoding of [`State`] this version writes and reads.
const STATE_VERSION: u8 = 1;

impl State {
    pub(crate) fn new(key: String, now: Timestamp) -> State {
        State {
            key,
            begun_at: now.as_millis(),
            attempts: Vec::new(),
        }
    }

    /// Records a send about to go out; returns its number.
    pub(crate) fn start(&mut self, now: Timestamp) -> u32 {
        let number = self
            .attempts
            .last()
            .map_or(1, |a| a.number.saturating_add(1));
        self.attempts.push(Wire {
            number,
            at: now.as_millis(),
            sent: Sent::Unknown,
        });
        number
    }

    /// What the last send came to.
    pub(crate) fn record(&mut self, sent: Sent) {
        if let Some(last) = self.attempts.last_mut() {
            last.sent = sent;
        }
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        postcard::to_extend(self, vec![STATE_VERSION])
            .map_err(|e| Error::storage("encoding an intent", e))
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<State> {
        match bytes.split_first() {
            Some((&STATE_VERSION, body)) => postcard::from_bytes(body)
                .map_err(|e| Error::corrupted(format!("an intent does not decode: {e}"))),
            Some((version, _)) => Err(Error::corrupted(format!(
                "intent format version {version} is not supported (this build reads version \
                 {STATE_VERSION})"
            ))),
            None => Err(Error::corrupted("an empty intent")),
        }
    }

    pub(crate) fn pending(&self, operation_id: String) -> Pending {
        Pending {
            operation_id,
            key: self.key.clone(),
            begun_at: Timestamp::from_millis(self.begun_at),
            attempts: u32::try_from(self.attempts.len()).unwrap_or(u32::MAX),
            last: self.attempts.last().map(|a| a.sent),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_round_trips_and_refuses_other_versions() -> Result<()> {
        let mut state = State::new("k".into(), Timestamp::from_millis(5));
        assert_eq!(state.start(Timestamp::from_millis(6)), 1);
        state.record(Sent::Answered(503));
        assert_eq!(state.start(Timestamp::from_millis(7)), 2);
        let bytes = state.encode()?;
        assert_eq!(State::decode(&bytes)?, state);
        let mut other = bytes.clone();
        other[0] = 9;
        assert!(State::decode(&other).is_err());
        assert!(State::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(State::decode(&[]).is_err());
        Ok(())
    }
}
