//! The record codec: a [`Record`]'s versioned, checksummed encoding.
//!
//! A record is one format-version byte, the postcard encoding of [`Record`], and an 8-byte
//! checksum over the stored key, the version byte and the encoding. The version byte lets a
//! later release migrate or refuse old records instead of misreading them. The checksum is
//! ours because redb verifies its page checksums only when it repairs after a crash: a bit
//! flipped on disk must surface as `Error::Corrupted`, never as a wrong replay, and binding the
//! key means a record cannot be served under another key. Decoding never panics and never
//! accepts trailing bytes.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use crate::api::fingerprint::Fingerprint;
use crate::api::record::{Record, State};
use crate::api::response::Response;
use crate::error::{Error, Result};

/// The record encoding this version writes. 3: an in-progress record keeps its holder's claim
/// id and a completed one the token that completed it (2 kept neither, and is still read);
/// 2: times after `created_at` are stored as offsets from it (1 stored them whole, 5 more
/// bytes per record).
pub(crate) const FORMAT_VERSION: u8 = 3;

/// More than a record's bytes besides its byte strings: the version byte, the fingerprint,
/// the times and counters as varints, the byte strings' lengths and the checksum.
const FIXED_LEN: usize = 128;

/// The oldest record encoding this version still reads.
const OLDEST_READ: u8 = 2;

impl Record {
    pub(crate) fn encode(&self, key: &[u8]) -> Result<Vec<u8>> {
        let after = |t: u64| {
            t.checked_sub(self.created_at).ok_or_else(|| {
                Error::storage(
                    "encoding a record",
                    std::io::Error::other("internal error: a record time before its creation"),
                )
            })
        };
        let state = match &self.state {
            State::InProgress {
                token,
                lease_until,
                checkpoint,
                claim_id,
            } => WireState::InProgress {
                token: *token,
                lease_for: after(*lease_until)?,
                checkpoint: Cow::Borrowed(checkpoint),
                claim_id: *claim_id,
            },
            State::Completed {
                completed_at,
                response,
                token,
            } => WireState::Completed {
                completed_after: after(*completed_at)?,
                response: Cow::Borrowed(response),
                token: *token,
            },
        };
        let wire = Wire {
            fingerprint: self.fingerprint,
            created_at: self.created_at,
            expires_after: after(self.expires_at)?,
            attempt: self.attempt,
            state,
            _borrowed: std::marker::PhantomData,
        };
        // Sized once: grown from empty, the buffer was copied several times per record.
        let mut out = Vec::with_capacity(FIXED_LEN + self.state.payload_len());
        out.push(FORMAT_VERSION);
        let mut out =
            postcard::to_extend(&wire, out).map_err(|e| Error::storage("encoding a record", e))?;
        let sum = checksum(key, &out);
        out.extend_from_slice(&sum);
        Ok(out)
    }

    pub(crate) fn decode(key: &[u8], bytes: &[u8]) -> Result<Self> {
        let Some((versioned, sum)) = bytes.split_last_chunk::<CHECKSUM_LEN>() else {
            return Err(Error::corrupted("record shorter than its checksum"));
        };
        if checksum(key, versioned) != *sum {
            return Err(Error::corrupted(
                "record checksum mismatch (damaged on disk)",
            ));
        }
        let Some((&version, body)) = versioned.split_first() else {
            return Err(Error::corrupted("empty record"));
        };
        match version {
            FORMAT_VERSION => whole::<Wire<'_>>(body)?.into_record(),
            OLDEST_READ => whole::<Wire<'_, WireStateV2<'_>>>(body)?
                .upgraded()
                .into_record(),
            _ => Err(Error::corrupted(format!(
                "record format version {version} is not supported (this build reads \
                 versions {OLDEST_READ} to {FORMAT_VERSION})"
            ))),
        }
    }
}

/// Decodes `body` as one `T`, with nothing left over.
fn whole<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T> {
    let (wire, rest): (T, _) = postcard::take_from_bytes(body)
        .map_err(|e| Error::corrupted(format!("record does not decode: {e}")))?;
    if !rest.is_empty() {
        return Err(Error::corrupted(format!(
            "record has {} trailing bytes",
            rest.len()
        )));
    }
    Ok(wire)
}

/// A record as encoded: the times after `created_at` as offsets from it, which take 1 to 4
/// bytes where a whole timestamp takes 6.
#[derive(Serialize, Deserialize)]
struct Wire<'a, S = WireState<'a>> {
    fingerprint: Fingerprint,
    created_at: u64,
    expires_after: u64,
    attempt: u32,
    state: S,
    #[serde(skip)]
    _borrowed: std::marker::PhantomData<&'a ()>,
}

#[derive(Serialize, Deserialize)]
enum WireState<'a> {
    InProgress {
        token: u64,
        lease_for: u64,
        #[serde(with = "wire_bytes::checkpoint")]
        checkpoint: Cow<'a, Option<Vec<u8>>>,
        claim_id: Option<u64>,
    },
    Completed {
        completed_after: u64,
        #[serde(with = "wire_bytes::response")]
        response: Cow<'a, Response>,
        token: Option<u64>,
    },
}

/// Format 2's state: no claim id, no completing token.
#[derive(Deserialize)]
enum WireStateV2<'a> {
    InProgress {
        token: u64,
        lease_for: u64,
        #[serde(with = "wire_bytes::checkpoint")]
        checkpoint: Cow<'a, Option<Vec<u8>>>,
    },
    Completed {
        completed_after: u64,
        #[serde(with = "wire_bytes::response")]
        response: Cow<'a, Response>,
    },
}

impl<'a> Wire<'a, WireStateV2<'a>> {
    fn upgraded(self) -> Wire<'a> {
        let state = match self.state {
            WireStateV2::InProgress {
                token,
                lease_for,
                checkpoint,
            } => WireState::InProgress {
                token,
                lease_for,
                checkpoint,
                claim_id: None,
            },
            WireStateV2::Completed {
                completed_after,
                response,
            } => WireState::Completed {
                completed_after,
                response,
                token: None,
            },
        };
        Wire {
            fingerprint: self.fingerprint,
            created_at: self.created_at,
            expires_after: self.expires_after,
            attempt: self.attempt,
            state,
            _borrowed: std::marker::PhantomData,
        }
    }
}

impl Wire<'_> {
    fn into_record(self) -> Result<Record> {
        let at = |offset: u64| {
            self.created_at
                .checked_add(offset)
                .ok_or_else(|| Error::corrupted("record time overflows"))
        };
        let state = match self.state {
            WireState::InProgress {
                token,
                lease_for,
                checkpoint,
                claim_id,
            } => State::InProgress {
                token,
                lease_until: at(lease_for)?,
                checkpoint: checkpoint.into_owned(),
                claim_id,
            },
            WireState::Completed {
                completed_after,
                response,
                token,
            } => State::Completed {
                completed_at: at(completed_after)?,
                response: response.into_owned(),
                token,
            },
        };
        Ok(Record {
            fingerprint: self.fingerprint,
            created_at: self.created_at,
            expires_at: at(self.expires_after)?,
            attempt: self.attempt,
            state,
        })
    }
}

/// A record's byte strings as serde bytes (see `engine::bytes`): the same encoding as the
/// derived [`Response`] and `Option<Vec<u8>>`, written in one copy each.
mod wire_bytes {
    /// `#[serde(with)]` for a checkpoint.
    pub(super) mod checkpoint {
        use std::borrow::Cow;

        use serde::{Deserializer, Serializer};

        use crate::engine::bytes::option;

        pub(crate) fn serialize<S: Serializer>(
            checkpoint: &Option<Vec<u8>>,
            serializer: S,
        ) -> Result<S::Ok, S::Error> {
            option::serialize(checkpoint, serializer)
        }

        pub(crate) fn deserialize<'de, 'a, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Cow<'a, Option<Vec<u8>>>, D::Error> {
            option::deserialize(deserializer).map(Cow::Owned)
        }
    }

    /// `#[serde(with)]` for a response: the fields of the derived `Response`, in order.
    pub(super) mod response {
        use std::borrow::Cow;

        use serde::ser::SerializeSeq;
        use serde::{Deserialize, Deserializer, Serialize, Serializer};

        use crate::api::response::Response;

        #[derive(Serialize)]
        struct Borrowed<'a> {
            status: u16,
            headers: Headers<'a>,
            #[serde(with = "crate::engine::bytes")]
            body: &'a [u8],
        }

        struct Headers<'a>(&'a [(String, Vec<u8>)]);

        impl Serialize for Headers<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                let mut seq = serializer.serialize_seq(Some(self.0.len()))?;
                for (name, value) in self.0 {
                    seq.serialize_element(&(name, Value(value)))?;
                }
                seq.end()
            }
        }

        struct Value<'a>(&'a [u8]);

        impl Serialize for Value<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_bytes(self.0)
            }
        }

        #[derive(Deserialize)]
        struct Owned {
            status: u16,
            headers: Vec<Header>,
            #[serde(with = "crate::engine::bytes")]
            body: Vec<u8>,
        }

        #[derive(Deserialize)]
        struct Header(String, #[serde(with = "crate::engine::bytes")] Vec<u8>);

        pub(crate) fn serialize<S: Serializer>(
            response: &Response,
            serializer: S,
        ) -> Result<S::Ok, S::Error> {
            Borrowed {
                status: response.status,
                headers: Headers(&response.headers),
                body: &response.body,
            }
            .serialize(serializer)
        }

        pub(crate) fn deserialize<'de, 'a, D: Deserializer<'de>>(
            deserializer: D,
        ) -> Result<Cow<'a, Response>, D::Error> {
            let Owned {
                status,
                headers,
                body,
            } = Owned::deserialize(deserializer)?;
            let headers = headers
                .into_iter()
                .map(|Header(name, value)| (name, value))
                .collect();
            Ok(Cow::Owned(Response {
                status,
                headers,
                body,
            }))
        }
    }
}

impl State {
    /// The bytes of the byte strings the state holds, headers counted with room for their
    /// lengths.
    fn payload_len(&self) -> usize {
        match self {
            State::InProgress { checkpoint, .. } => checkpoint.as_ref().map_or(0, Vec::len),
            State::Completed { response, .. } => {
                let headers: usize = response
                    .headers
                    .iter()
                    .map(|(name, value)| name.len() + value.len() + 8)
                    .sum();
                response.body.len() + headers
            }
        }
    }
}

const CHECKSUM_LEN: usize = 8;

fn checksum(key: &[u8], versioned: &[u8]) -> [u8; CHECKSUM_LEN] {
    let mut hasher = blake3::Hasher::new();
    hasher.update(&(key.len() as u64).to_le_bytes());
    hasher.update(key);
    hasher.update(versioned);
    let mut sum = [0; CHECKSUM_LEN];
    hasher.finalize_xof().fill(&mut sum);
    sum
}

/// Decodes arbitrary bytes as a stored record, twice: as they are (the checksum must reject
/// them) and with a valid checksum appended, so that the postcard decoder itself meets the
/// arbitrary bytes. A record that decodes must survive re-encoding. The fuzz target and its
/// corpus replay in `cargo test` call this; it must never panic.
#[cfg(feature = "__test-hooks")]
pub fn fuzz_decode_record(data: &[u8]) {
    const KEY: &[u8] = b"\x00fuzz";
    let _ = Record::decode(KEY, data);
    let mut sealed = data.to_vec();
    sealed.extend_from_slice(&checksum(KEY, data));
    if let Ok(record) = Record::decode(KEY, &sealed) {
        // postcard is canonical except for varint padding, so compare decoded values, not bytes.
        let again = record
            .encode(KEY)
            .and_then(|bytes| Record::decode(KEY, &bytes));
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
                token: Some(7),
            },
        }
    }

    const KEY: &[u8] = b"\x00k";

    fn reseal(versioned: &[u8]) -> Vec<u8> {
        let mut out = versioned.to_vec();
        out.extend_from_slice(&checksum(KEY, versioned));
        out
    }

    #[test]
    fn round_trips() -> Result<()> {
        let rec = sample();
        assert_eq!(Record::decode(KEY, &rec.encode(KEY)?)?, rec);
        Ok(())
    }

    #[test]
    fn any_flipped_bit_or_another_key_is_detected() -> Result<()> {
        let bytes = sample().encode(KEY)?;
        for i in 0..bytes.len() * 8 {
            let mut flipped = bytes.clone();
            flipped[i / 8] ^= 1 << (i % 8);
            assert!(matches!(
                Record::decode(KEY, &flipped),
                Err(Error::Corrupted { .. })
            ));
        }
        assert!(Record::decode(b"\x00other", &bytes).is_err());
        Ok(())
    }

    #[test]
    fn rejects_unknown_version_truncation_and_trailing_bytes() -> Result<()> {
        let bytes = sample().encode(KEY)?;
        let versioned = &bytes[..bytes.len() - CHECKSUM_LEN];
        let mut other = versioned.to_vec();
        other[0] = 9;
        let err = Record::decode(KEY, &reseal(&other))
            .err()
            .map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("format version 9")));
        assert!(Record::decode(KEY, &reseal(&versioned[..versioned.len() - 1])).is_err());
        let mut long = versioned.to_vec();
        long.push(0);
        assert!(Record::decode(KEY, &reseal(&long)).is_err());
        assert!(Record::decode(KEY, &[]).is_err());
        assert!(Record::decode(KEY, &reseal(&[])).is_err());
        Ok(())
    }

    /// Format 3's bytes, written with the derived encodings of `Response` and the checkpoint
    /// (a sequence of `u8` for each byte string), are what `encode` writes, byte for byte:
    /// the records of earlier builds and of this one are the same.
    #[test]
    fn writes_format_3_as_the_derived_encoding_did() -> Result<()> {
        let fp = Fingerprint::of(["a"]);
        let body: Vec<u8> = (0..=255).collect();
        let response = Response::new(201, body).with_header("x", vec![0xff; 200]);
        let completed = Record {
            state: State::Completed {
                completed_at: 1,
                response: response.clone(),
                token: Some(7),
            },
            ..sample()
        };
        let derived = postcard::to_extend(
            &(fp, 1u64, 1u64, 1u32, 1u32, 0u64, response, Some(7u64)),
            vec![FORMAT_VERSION],
        )
        .map_err(|e| Error::storage("encoding", e))?;
        assert_eq!(completed.encode(KEY)?, reseal(&derived));
        for checkpoint in [None, Some(vec![]), Some(vec![9; 300])] {
            let in_progress = Record {
                state: State::InProgress {
                    token: 3,
                    lease_until: 2,
                    checkpoint: checkpoint.clone(),
                    claim_id: Some(5),
                },
                ..sample()
            };
            let derived = postcard::to_extend(
                &(
                    fp,
                    1u64,
                    1u64,
                    1u32,
                    0u32,
                    3u64,
                    1u64,
                    checkpoint,
                    Some(5u64),
                ),
                vec![FORMAT_VERSION],
            )
            .map_err(|e| Error::storage("encoding", e))?;
            assert_eq!(in_progress.encode(KEY)?, reseal(&derived));
            assert_eq!(Record::decode(KEY, &reseal(&derived))?, in_progress);
        }
        Ok(())
    }

    /// Format 2 wrote no claim id and no completing token; its records still read, without
    /// them. The bytes are format 2's encoding of `sample()`, as that version wrote them.
    #[test]
    fn reads_format_2() -> Result<()> {
        let v2 = postcard::to_extend(
            &(
                Fingerprint::of(["a"]),
                1u64,
                1u64,
                1u32,
                1u32, // the `Completed` variant
                0u64,
                Response::new(201, "ok").with_header("x", "y"),
            ),
            vec![2u8],
        )
        .map_err(|e| Error::storage("encoding", e))?;
        let mut want = sample();
        if let State::Completed { token, .. } = &mut want.state {
            *token = None;
        }
        assert_eq!(Record::decode(KEY, &reseal(&v2))?, want);
        Ok(())
    }
}
