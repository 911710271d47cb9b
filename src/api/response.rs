//! The response a completed operation stores and every replay returns.

use serde::{Deserialize, Serialize};

/// A response to store and replay: status, headers and body, byte for byte.
///
/// Header names are kept as given (no case folding) and in order, duplicates included.
///
/// Deliberately not `#[non_exhaustive]`: it is plain data that callers build with a literal as
/// often as with [`new`](Response::new), and its fields are part of the stored record format,
/// so a new field would need a new record format (and a major version) in any case.
#[derive(Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Response {
    /// The HTTP status code (or any application status).
    pub status: u16,
    /// Header names and raw values, in order.
    pub headers: Vec<(String, Vec<u8>)>,
    /// The body bytes.
    pub body: Vec<u8>,
}

/// Readable in logs: header values and the body as text where they are UTF-8, as escaped
/// bytes (`b"\xff..."`) where they are not; a long body is cut after 1 KiB.
impl std::fmt::Debug for Response {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<_> = self
            .headers
            .iter()
            .map(|(name, value)| (name, Bytes(value)))
            .collect();
        f.debug_struct("Response")
            .field("status", &self.status)
            .field("headers", &headers)
            .field("body", &Bytes(&self.body))
            .finish()
    }
}

/// Bytes shown as a string where they are UTF-8, else escaped, at most [`Bytes::SHOWN`].
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    const SHOWN: usize = 1024;
}

impl std::fmt::Debug for Bytes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown = &self.0[..self.0.len().min(Bytes::SHOWN)];
        match std::str::from_utf8(shown) {
            Ok(text) => write!(f, "{text:?}")?,
            Err(_) => write!(f, "b\"{}\"", shown.escape_ascii())?,
        }
        if shown.len() < self.0.len() {
            write!(f, " (+{} bytes)", self.0.len() - shown.len())?;
        }
        Ok(())
    }
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

    /// What is stored instead of a response larger than the store keeps
    /// (`max_response_bytes`) once the operation has run: a 500
    /// `application/problem+json` (with `Cache-Control: no-store` and the `code`
    /// `response-not-stored`) that says so, replayed to every retry, so that the
    /// operation is never run again for the key. [`IdempotencyStore::execute`](crate::IdempotencyStore::execute) and
    /// the HTTP flow store it; `size` and `limit` are those of
    /// [`Error::ResponseTooLarge`](crate::Error::ResponseTooLarge).
    #[must_use]
    pub fn not_stored(size: usize, limit: usize) -> Response {
        Response::not_stored_because(&too_large(size, limit))
    }

    /// [`not_stored`](Response::not_stored) for another reason (`why` completes "The request
    /// was carried out, but …").
    pub(crate) fn not_stored_because(why: &str) -> Response {
        // `why` is always this crate's own text, without quotes or backslashes: no escaping.
        let body = format!(
            "{{\"type\":\"{NOT_STORED_TYPE}\",\"title\":\"Response not stored\",\"status\":500,\
             \"detail\":\"The request was carried out, but {why}, so it cannot be replayed. The \
             request will not be carried out again for this key; ask the server's operator for \
             its outcome.\",\"code\":\"response-not-stored\"}}"
        );
        // A layer's own answer: no shared cache keeps it (the HTTP flow's problems say the
        // same).
        Response::new(500, body)
            .with_header("content-type", "application/problem+json")
            .with_header("cache-control", "no-store")
    }
}

/// Why a response of `size` bytes was not stored, for [`Response::not_stored_because`].
pub(crate) fn too_large(size: usize, limit: usize) -> String {
    format!("its response of {size} bytes is larger than the {limit} bytes this server stores")
}

/// The `type` of [`Response::not_stored`]'s problem.
pub(crate) const NOT_STORED_TYPE: &str =
    "https://docs.rs/idempotency-store/latest/idempotency_store/http/#response-not-stored";

#[cfg(test)]
mod tests {
    use super::Response;

    #[test]
    fn debug_shows_text_as_text_and_other_bytes_escaped() {
        let response = Response::new(201, r#"{"id":"pay_1"}"#)
            .with_header("content-type", "application/json")
            .with_header("x-raw", vec![0xff, b'a']);
        let shown = format!("{response:?}");
        assert!(shown.contains(r#"body: "{\"id\":\"pay_1\"}""#), "{shown}");
        assert!(
            shown.contains(r#"("content-type", "application/json")"#),
            "{shown}"
        );
        assert!(shown.contains(r#"("x-raw", b"\xffa")"#), "{shown}");
        let long = format!("{:?}", Response::new(200, vec![b'x'; 1500]));
        assert!(long.ends_with("(+476 bytes) }"), "{long}");
    }
}
