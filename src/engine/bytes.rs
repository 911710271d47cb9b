//! Byte strings in the log and in records, written as serde bytes rather than as sequences of
//! `u8`.
//!
//! postcard writes both the same way (a varint length, then the bytes), so the formats on
//! disk do not change, but serde hands a sequence to the serializer one element at a time. As
//! bytes, each is one length and one copy, in both directions: fewer instructions for an
//! in-memory claim and completion (BENCHMARKS.md, "Figures behind the defaults").

use std::fmt;

use serde::de::{SeqAccess, Visitor};
use serde::{Deserializer, Serializer};

/// `#[serde(with = "bytes")]` for a `Vec<u8>`.
pub(crate) fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_bytes(bytes)
}

/// `#[serde(with = "bytes")]` for a `Vec<u8>`.
pub(crate) fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
    deserializer.deserialize_bytes(ByteVec)
}

/// `#[serde(with = "bytes::option")]` for an `Option<Vec<u8>>`.
pub(crate) mod option {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Bytes(#[serde(with = "super")] Vec<u8>);

    pub(crate) fn serialize<S: Serializer>(
        bytes: &Option<Vec<u8>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match bytes {
            Some(bytes) => serializer.serialize_some(&Borrowed(bytes)),
            None => serializer.serialize_none(),
        }
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Vec<u8>>, D::Error> {
        Ok(Option::<Bytes>::deserialize(deserializer)?.map(|Bytes(bytes)| bytes))
    }

    struct Borrowed<'a>(&'a [u8]);

    impl Serialize for Borrowed<'_> {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.serialize_bytes(self.0)
        }
    }
}

/// Accepts bytes in any form a deserializer offers them, and a sequence of `u8` too.
struct ByteVec;

impl<'de> Visitor<'de> for ByteVec {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Vec<u8>, E> {
        Ok(bytes.to_vec())
    }

    fn visit_byte_buf<E: serde::de::Error>(self, bytes: Vec<u8>) -> Result<Vec<u8>, E> {
        Ok(bytes)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
        // The hint comes from the input: capped, so that a damaged length cannot reserve
        // gigabytes before the bytes run out.
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
        while let Some(byte) = seq.next_element()? {
            out.push(byte);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use serde::{Deserialize, Serialize};

    /// The shape the log and records had before: derived, byte by byte.
    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Before {
        a: Vec<u8>,
        b: Option<Vec<u8>>,
        n: u64,
    }

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct After {
        #[serde(with = "super")]
        a: Vec<u8>,
        #[serde(with = "super::option")]
        b: Option<Vec<u8>>,
        n: u64,
    }

    #[test]
    fn postcard_writes_and_reads_the_same_bytes_as_before() {
        let long: Vec<u8> = (0..=255).cycle().take(1000).collect();
        for (a, b) in [
            (vec![], None),
            (vec![0], Some(vec![])),
            (long.clone(), Some(long.clone())),
            (b"key".to_vec(), Some(vec![255; 130])),
        ] {
            let before = Before {
                a: a.clone(),
                b: b.clone(),
                n: 300,
            };
            let after = After { a, b, n: 300 };
            let old = postcard::to_stdvec(&before).expect("encode");
            let new = postcard::to_stdvec(&after).expect("encode");
            assert_eq!(old, new);
            assert_eq!(postcard::from_bytes::<After>(&old).expect("decode"), after);
            assert_eq!(
                postcard::from_bytes::<Before>(&new).expect("decode"),
                before
            );
        }
    }

    #[test]
    fn a_damaged_length_is_an_error_not_an_allocation() {
        let mut bytes = postcard::to_stdvec(&After {
            a: vec![1, 2, 3],
            b: None,
            n: 1,
        })
        .expect("encode");
        bytes[0] = 0xff; // a length varint that runs past the input
        assert!(postcard::from_bytes::<After>(&bytes).is_err());
    }
}
