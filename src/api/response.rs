//! The response a completed operation stores and every replay returns.

use serde::{Deserialize, Serialize};

/// A response to store and replay: status, headers and body, byte for byte.
///
/// Header names are kept as given (no case folding) and in order, duplicates included.
///
/// Deliberately not `#[non_exhaustive]`: it is plain data that callers build with a literal as
/// often as with [`new`](Response::new), and its fields are part of the stored record format,
/// so a new field would need a new record format (and a major version) in any case.
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
