//! Request fingerprints: what makes a retry "the same request".

use std::fmt;

/// The current fingerprint algorithm: blake3 in key-derivation mode over length-prefixed parts.
const VERSION: u8 = 1;
const CONTEXT: &str = "idempotency-store 2026 request fingerprint v1";

/// A 32-byte blake3 digest of a request, plus the version of the algorithm that made it.
///
/// Built from parts (for example method, path and body), each prefixed by its length, so
/// `["ab", "c"]` and `["a", "bc"]` differ. Two fingerprints are equal only if both the version
/// and the digest are equal; a record stored under another version therefore reports a
/// mismatch instead of being replayed to a request it may not match.
///
/// ```
/// use idempotency_store::Fingerprint;
///
/// let a = Fingerprint::of(["POST", "/payments", r#"{"amount":10}"#]);
/// assert_eq!(a, Fingerprint::of(["POST", "/payments", r#"{"amount":10}"#]));
/// assert_ne!(Fingerprint::of(["ab", "c"]), Fingerprint::of(["a", "bc"]));
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Fingerprint {
    version: u8,
    digest: [u8; 32],
}

impl Fingerprint {
    /// Hashes the parts of a request in order.
    #[must_use]
    pub fn of<I>(parts: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<[u8]>,
    {
        Fingerprint::derive(VERSION, CONTEXT, parts)
    }

    /// The algorithm of [`of`](Fingerprint::of) under another version and blake3 context, for
    /// fingerprint policies that must never compare equal to version 1 (see
    /// `http::FingerprintPolicy`).
    #[cfg_attr(not(feature = "http"), allow(dead_code))]
    pub(crate) fn derive<I>(version: u8, context: &str, parts: I) -> Self
    where
        I: IntoIterator,
        I::Item: AsRef<[u8]>,
    {
        let mut hasher = blake3::Hasher::new_derive_key(context);
        for part in parts {
            let part = part.as_ref();
            hasher.update(&(part.len() as u64).to_le_bytes());
            hasher.update(part);
        }
        Fingerprint {
            version,
            digest: *hasher.finalize().as_bytes(),
        }
    }

    /// Rebuilds a fingerprint from its parts, as stored elsewhere (for example by the
    /// PostgreSQL backend or an export).
    #[must_use]
    pub const fn from_raw(version: u8, digest: [u8; 32]) -> Self {
        Fingerprint { version, digest }
    }

    /// The algorithm version: 1 for [`of`](Fingerprint::of); the HTTP layer's structured
    /// policies (canonical JSON, unordered query, selected headers) use 2.
    #[must_use]
    pub const fn version(&self) -> u8 {
        self.version
    }

    /// The 32-byte digest.
    #[must_use]
    pub const fn digest(&self) -> &[u8; 32] {
        &self.digest
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint(v{}:", self.version)?;
        for b in self.digest.iter().take(8) {
            write!(f, "{b:02x}")?;
        }
        f.write_str("…)")
    }
}
