//! The stored record and its versioned encoding.
//!
//! A record is one format-version byte followed by the postcard encoding of [`Record`]. The
//! version byte lets a later release migrate or refuse old records instead of misreading them;
//! decoding never panics and never accepts trailing bytes.

use serde::{Deserialize, Serialize};

use crate::clock::Timestamp;
use crate::error::{Error, Result};
use crate::fingerprint::Fingerprint;

/// The record encoding this version writes and reads.
pub(crate) const FORMAT_VERSION: u8 = 1;

/// A response to store and replay: status, headers and body, byte for byte.
///
/// Header names are kept as given (no case folding) and in order, duplicates included.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Response {
    /// The HTTP status code (or any application status).
    pub status: u16,
    /// Header names and raw values, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body bytes.
    pub body: Vec<u8>,
}

impl Response {
    /// A response with a status and body and no headers.
    #[must_use]
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Response {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// Adds a header, keeping earlier ones.
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The size counted against `max_response_bytes`: the body plus every header name and
    /// value.
    #[must_use]
    pub fn size(&self) -> usize {
        self.headers
            .iter()
            .map(|(n, v)| n.len() + v.len())
            .fold(self.body.len(), usize::saturating_add)
    }
}

/// One key's record. Times are milliseconds since the Unix epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Record {
    pub fingerprint: Fingerprint,
    pub created_at: u64,
    /// When the record stops counting; mirrored by exactly one entry in the expiry index.
    pub expires_at: u64,
    /// 1 for the first claim, +1 per takeover.
    pub attempt: u32,
    pub state: State,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) enum State {
    InProgress {
        /// The fencing token of the current lease.
        token: u64,
        lease_until: u64,
        checkpoint: Option<Vec<u8>>,
    },
    Completed {
        completed_at: u64,
        response: Response,
    },
}

impl Record {
    pub(crate) fn is_expired(&self, now: Timestamp) -> bool {
        now.as_millis() >= self.expires_at
    }

    pub(crate) fn encode(&self) -> Result<Vec<u8>> {
        let mut out = vec![FORMAT_VERSION];
        postcard::to_io(self, &mut out).map_err(|e| Error::storage("encoding a record", e))?;
        Ok(out)
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Self> {
        let Some((&version, body)) = bytes.split_first() else {
            return Err(Error::corrupted("empty record"));
        };
        if version != FORMAT_VERSION {
            return Err(Error::corrupted(format!(
                "record format version {version} is not supported (this build reads \
                 version {FORMAT_VERSION})"
            )));
        }
        let (record, rest): (Record, _) = postcard::take_from_bytes(body)
            .map_err(|e| Error::corrupted(format!("record does not decode: {e}")))?;
        if !rest.is_empty() {
            return Err(Error::corrupted(format!(
                "record has {} trailing bytes",
                rest.len()
            )));
        }
        Ok(record)
    }
}

/// Decodes arbitrary bytes as a record and, when they decode, checks that re-encoding gives
/// the same bytes. The fuzz target and its corpus replay call this; it must never panic.
#[doc(hidden)]
pub fn fuzz_decode_record(data: &[u8]) {
    if let Ok(record) = Record::decode(data) {
        // postcard is canonical except for varint padding, so compare decoded values, not bytes.
        let again = record.encode().and_then(|bytes| Record::decode(&bytes));
        assert_eq!(again.ok().as_ref(), Some(&record));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Record {
        Record {
            fingerprint: Fingerprint::of(["a"]),
            created_at: 1,
            expires_at: 2,
            attempt: 1,
            state: State::Completed {
                completed_at: 1,
                response: Response::new(201, "ok").with_header("x", "y"),
            },
        }
    }

    #[test]
    fn round_trips() -> Result<()> {
        let rec = sample();
        assert_eq!(Record::decode(&rec.encode()?)?, rec);
        Ok(())
    }

    #[test]
    fn rejects_unknown_version_truncation_and_trailing_bytes() -> Result<()> {
        let bytes = sample().encode()?;
        let mut other = bytes.clone();
        other[0] = 2;
        assert!(matches!(
            Record::decode(&other),
            Err(Error::Corrupted { .. })
        ));
        assert!(Record::decode(&bytes[..bytes.len() - 1]).is_err());
        let mut long = bytes.clone();
        long.push(0);
        assert!(Record::decode(&long).is_err());
        assert!(Record::decode(&[]).is_err());
        Ok(())
    }
}
