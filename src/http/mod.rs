//! The HTTP mapping (feature `http`): the `Idempotency-Key` header, request fingerprints,
//! replays and the IETF draft's error answers, on the [`http`](https://docs.rs/http) 1.x types.
//!
//! One request through a handler:
//!
//! ```
//! use idempotency_store::http::{self as idem, Decision, Problem};
//! use idempotency_store::{Response, Store};
//!
//! fn handle(store: &Store, request: &http::Request<Vec<u8>>) -> http::Response<Vec<u8>> {
//!     // 400 for a missing or malformed key, before the store is touched.
//!     let key = match idem::key_from_headers(request.headers(), None) {
//!         Ok(key) => key,
//!         Err(err) => return err.problem().to_http(),
//!     };
//!     let claim = match store.claim(&key, idem::fingerprint(request)) {
//!         Ok(claim) => claim,
//!         Err(err) => return Problem::from_error(&err).to_http(),
//!     };
//!     let lease = match idem::decide(claim, store.now()) {
//!         Ok(Decision::Run(lease)) => lease,
//!         Ok(Decision::Respond(answer)) => return answer, // replay, 409 or 422
//!         _ => return Problem::internal().to_http(), // a stored response http rejects
//!     };
//!     // Run the side effect once, then store the answer every retry gets.
//!     let response = Response::new(201, r#"{"id":"pay_1"}"#)
//!         .with_header("content-type", "application/json");
//!     let Ok(answer) = idem::to_http(response.clone()) else {
//!         return Problem::internal().to_http();
//!     };
//!     match store.complete(&lease, response) {
//!         Ok(()) => answer,
//!         Err(err) => Problem::from_error(&err).to_http(),
//!     }
//! }
//!
//! let store = Store::builder().open_in_memory()?;
//! let request = http::Request::post("/payments")
//!     .header("Idempotency-Key", "\"8e03978e-40d5-43e8-bc93-6894a57f9324\"")
//!     .body(br#"{"amount":4999}"#.to_vec())?;
//! assert_eq!(handle(&store, &request).status(), 201);
//! let retry = handle(&store, &request);
//! assert_eq!(retry.status(), 201);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Answers
//!
//! Every error answer is an RFC 9457 problem (`Content-Type: application/problem+json`) with
//! the members `type`, `title`, `status` and `detail`; the `type` URIs are in
//! [`problem_type`].
//!
//! | case | status | extra header | built by |
//! |---|---|---|---|
//! | no `Idempotency-Key` header | 400 | | [`KeyError::problem`], [`Problem::missing_key`] |
//! | malformed or invalid key | 400 | | [`KeyError::problem`], [`Problem::invalid_key`] |
//! | key reused with another request | 422 | | [`decide`], [`Problem::mismatch`] |
//! | first request still in flight | 409 | `Retry-After` | [`decide`], [`Problem::in_progress`] |
//! | store full ([`Error::QuotaExceeded`]) | 503 | `Retry-After` | [`Problem::from_error`] |
//! | store unreachable ([`Error::Storage`]), or the tower layer overloaded | 503 | `Retry-After: 1` | [`Problem::from_error`], [`Problem::unavailable`], [`Problem::overloaded`] |
//! | handler's answer too large to store, or unreadable | 500, stored and replayed | | [`handle`], the tower layer |
//! | completed earlier | stored status | `Idempotent-Replayed: true` | [`decide`], [`replay`] |
//!
//! 400, 409 and 422 are the IETF draft's (`draft-ietf-httpapi-idempotency-key-header`);
//! `Idempotent-Replayed` is the header Stripe sends on replays.
//!
//! # Problem types
//!
//! The `type` of each problem links to its heading here (the constants of [`problem_type`]).
//!
//! ## Missing key
//!
//! 400 ([`problem_type::MISSING_KEY`]): the request has no `Idempotency-Key` header, and the
//! operation requires one. Send a new key (for example a UUID) with each new request.
//!
//! ## Invalid key
//!
//! 400 ([`problem_type::INVALID_KEY`]): the `Idempotency-Key` header is malformed, or the key
//! is not acceptable (empty, too long, not printable ASCII); the `detail` says why. A key is 1
//! to 255 printable ASCII characters (or the store's `max_key_len`), sent as a quoted string
//! (`"..."`) or bare.
//!
//! ## Key reused
//!
//! 422 ([`problem_type::KEY_REUSED`]): the key was already used for a different request
//! (method, path or body). Use a new key for a new request; retry with the original request
//! to get its answer.
//!
//! ## In progress
//!
//! 409 ([`problem_type::IN_PROGRESS`]), with `Retry-After`: the first request with this key
//! is still being processed (or another attempt took it over while this one ran). Retry with
//! the same key after `Retry-After` seconds to get its answer.
//!
//! ## Store full
//!
//! 503 ([`problem_type::STORE_FULL`]), with `Retry-After`: the store holds as many records or
//! bytes as its quota allows and refuses new keys for now; keys already stored still replay.
//! Retry later with the same key.
//!
//! ## Internal
//!
//! 500 ([`problem_type::INTERNAL`]): the server failed; the request may or may not have been
//! applied. Retry with the same key to get its outcome.
//!
//! ## Too large
//!
//! 413 ([`problem_type::TOO_LARGE`]): the body of an idempotent request is over the limit
//! ([`HandleOptions::max_body`], 1 MiB by default).
//!
//! ## Invalid body
//!
//! 400 ([`problem_type::INVALID_BODY`]): the body of an idempotent request could not be read
//! to the end (the tower layer); send it again.
//!
//! ## Unavailable
//!
//! 503 ([`problem_type::UNAVAILABLE`]), with `Retry-After: 1`: the server could not reach its
//! store (the call was made once more first if its outcome was unknown), or the tower layer
//! is overloaded and did not take the request. Retry with the same key to get the outcome.
//!
//! ## Response not stored
//!
//! 500 ([`problem_type::NOT_STORED`]), stored under the key and replayed to every retry: the
//! request was carried out, but its answer could not be stored (larger than the store's
//! `max_response_bytes`, or its body failed while it was read). It is not carried out again
//! for this key; the server's operator can tell its outcome.
//!
//! # Conversion failures
//!
//! [`Response`] holds any status and any header bytes, `http` does not: converting to
//! `http` fails with the small [`InvalidResponse`] error, not with an [`Error`]. A stored
//! response that `http` rejects is not damage (the record passed its checksum; the application
//! stored it that way), so [`Error::Corrupted`], which sends an operator to the backups, would
//! be the wrong answer. Convert a response with [`to_http`] *before* storing it, and a replay
//! can never fail this way.

#[cfg(feature = "actix")]
#[cfg_attr(docsrs, doc(cfg(feature = "actix")))]
pub mod actix;
#[cfg(any(feature = "tower", feature = "actix"))]
mod admission;
mod canonical_json;
mod flow;
mod handle;
mod heartbeat;
mod options;
mod policy;
mod retry_after;
#[cfg(feature = "actix")]
mod runner;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod tower;
mod view;

pub use self::handle::handle;
pub use self::heartbeat::LeaseWatch;
pub use self::options::{
    BoxError, CompleteHook, DEFAULT_MAX_BODY, Finality, HandleOptions, Release, release,
};
pub use self::policy::{FingerprintPolicy, STRUCTURED_VERSION};
pub use self::view::RequestView;

use ::http::header::{CONTENT_TYPE, RETRY_AFTER};
use ::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, Lease};
use crate::api::response::Response;
use crate::error::Error;

/// The request header that carries the key: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The response header that marks a replay: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// How long [`Problem::from_error`] tells a client to wait when the store is full, in seconds.
/// Room comes back as records expire and are swept, which takes a while, so a minute rather
/// than a hot retry loop.
pub const QUOTA_RETRY_AFTER_SECS: u64 = 60;

/// The `type` URIs of the problems this module builds. Stable: clients may match on them.
pub mod problem_type {
    /// 400: the request has no `Idempotency-Key` header.
    pub const MISSING_KEY: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#missing-key";
    /// 400: the `Idempotency-Key` header is malformed or the key is not acceptable.
    pub const INVALID_KEY: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#invalid-key";
    /// 422: the key was already used for a different request.
    pub const KEY_REUSED: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#key-reused";
    /// 409: the first request with this key is still being processed.
    pub const IN_PROGRESS: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#in-progress";
    /// 503: the store is full; new keys are refused for now.
    pub const STORE_FULL: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#store-full";
    /// 500: the server failed; the request may or may not have been applied.
    pub const INTERNAL: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#internal";
    /// 413: the body of an idempotent request is over the limit ([`handle`](super::handle)'s
    /// `max_body`).
    pub const TOO_LARGE: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#too-large";

    /// 400: the body of an idempotent request could not be read (the tower layer).
    pub const INVALID_BODY: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#invalid-body";
    /// 503: the store could not be reached, or the tower layer is overloaded; retry with the
    /// same key to get the outcome.
    pub const UNAVAILABLE: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#unavailable";
    /// 500, stored and replayed: the request was carried out but its response could not be
    /// stored (larger than `max_response_bytes`, or unreadable); it is not carried out again
    /// for the key.
    pub const NOT_STORED: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#response-not-stored";

    #[cfg(test)]
    pub(super) const ALL: [&str; 10] = [
        UNAVAILABLE,
        NOT_STORED,
        INVALID_BODY,
        MISSING_KEY,
        INVALID_KEY,
        KEY_REUSED,
        IN_PROGRESS,
        STORE_FULL,
        INTERNAL,
        TOO_LARGE,
    ];
}

// ---------------------------------------------------------------- responses

/// A [`Response`] that `http` cannot represent: a status outside `100..=999`, or a header
/// name or value it rejects. See the module docs, "Conversion failures", for why this is not
/// an [`Error`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the response cannot be sent over HTTP: {reason}")]
pub struct InvalidResponse {
    reason: String,
}

impl InvalidResponse {
    /// What `http` rejected.
    #[must_use]
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// Converts a stored (or about to be stored) response into an `http` response: status,
/// headers in order (names lowercased, as `http` keeps them) and body.
///
/// # Errors
/// [`InvalidResponse`] if the status is not a valid HTTP status code or a header name or value
/// is not valid in HTTP (for example a control character in a value).
pub fn to_http(response: Response) -> Result<::http::Response<Vec<u8>>, InvalidResponse> {
    let status = StatusCode::from_u16(response.status).map_err(|_| InvalidResponse {
        reason: format!("status {} is not an HTTP status code", response.status),
    })?;
    let mut headers = HeaderMap::with_capacity(response.headers.len());
    for (name, value) in response.headers {
        let header_name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| InvalidResponse {
            reason: format!("{name:?} is not a valid header name"),
        })?;
        let header_value = HeaderValue::from_bytes(&value).map_err(|_| InvalidResponse {
            reason: format!("the value of header {name:?} is not a valid header value"),
        })?;
        headers.append(header_name, header_value);
    }
    let mut out = ::http::Response::new(response.body);
    *out.status_mut() = status;
    *out.headers_mut() = headers;
    Ok(out)
}

/// Converts an `http` response into a [`Response`] to store. Header names come out in
/// lowercase; the values of a repeated name stay together and in order. Never fails: every
/// `http` response fits.
#[must_use]
pub fn from_http(response: ::http::Response<Vec<u8>>) -> Response {
    let (parts, body) = response.into_parts();
    let headers = parts
        .headers
        .iter()
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    Response {
        status: parts.status.as_u16(),
        headers,
        body,
    }
}

/// The answer for a replay: the stored status, headers and body, plus
/// `Idempotent-Replayed: true` (replacing any stored header of that name).
///
/// # Errors
/// [`InvalidResponse`], as for [`to_http`].
pub fn replay(stored: Response) -> Result<::http::Response<Vec<u8>>, InvalidResponse> {
    let mut out = to_http(stored)?;
    out.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    Ok(out)
}

/// What to do after a claim.
#[must_use = "either run the operation or send the answer"]
#[derive(Debug)]
#[non_exhaustive]
pub enum Decision {
    /// The caller holds the key: run the operation, then complete or release the lease.
    Run(Lease),
    /// Send this answer: a replay, a 409 (in progress) or a 422 (key reused).
    Respond(::http::Response<Vec<u8>>),
}

/// Maps a claim to the IETF draft's answers: [`Claim::Acquired`] → [`Decision::Run`];
/// [`Claim::Completed`] → the [`replay`]; [`Claim::InProgress`] → 409 with `Retry-After`
/// counted from `now` (pass [`Store::now`](crate::Store::now)); [`Claim::Mismatch`] → 422.
///
/// # Errors
/// [`InvalidResponse`] if the stored response of a replay cannot be sent over HTTP (answer
/// with [`Problem::internal`]).
pub fn decide(claim: Claim, now: Timestamp) -> Result<Decision, InvalidResponse> {
    Ok(match claim {
        Claim::Acquired(lease) => Decision::Run(lease),
        Claim::Completed(stored) => Decision::Respond(replay(stored.response)?),
        Claim::InProgress { lease_until, .. } => {
            Decision::Respond(Problem::in_progress(lease_until, now).to_http())
        }
        Claim::Mismatch { .. } => Decision::Respond(Problem::mismatch().to_http()),
    })
}

/// The request's fingerprint: method, request target (path and query; never the host, so
/// that absolute-form and origin-form requests match) and body, as
/// `Fingerprint::of([method, path_and_query, body])`.
///
/// Headers are not part of it. If one changes the meaning of a request (a `Content-Type`, an
/// API version), build the fingerprint yourself with [`Fingerprint::of`] and add it. The body
/// is hashed as sent: the same JSON with other whitespace is another request (a 422).
#[must_use]
pub fn fingerprint<B: AsRef<[u8]>>(request: &::http::Request<B>) -> Fingerprint {
    let uri = request.uri();
    let target = uri
        .path_and_query()
        .map_or_else(|| uri.path(), ::http::uri::PathAndQuery::as_str);
    Fingerprint::of([
        request.method().as_str().as_bytes(),
        target.as_bytes(),
        request.body().as_ref(),
    ])
}

// ---------------------------------------------------------------- the key header

/// Why a request has no usable idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The request has no `Idempotency-Key` header. 400 where a key is required.
    #[error("the request has no Idempotency-Key header")]
    Missing,
    /// The header is malformed (a broken sf-string, several fields) or the key breaks the rules
    /// of [`Key::new`]. 400.
    #[error("invalid Idempotency-Key header: {reason}")]
    Invalid {
        /// What is wrong, in words a client developer can act on.
        reason: String,
    },
    /// The scope the server passed is not a valid scope: a server bug, not the client's. 500.
    #[error("invalid idempotency key scope: {reason}")]
    InvalidScope {
        /// What is wrong with the scope.
        reason: String,
    },
}

impl KeyError {
    /// The answer for this error: 400 for [`Missing`](KeyError::Missing) and
    /// [`Invalid`](KeyError::Invalid), 500 for [`InvalidScope`](KeyError::InvalidScope)
    /// (without the server's details).
    #[must_use]
    pub fn problem(&self) -> Problem {
        match self {
            KeyError::Missing => Problem::missing_key(),
            KeyError::Invalid { reason } => Problem::invalid_key(reason),
            KeyError::InvalidScope { .. } => Problem::internal(),
        }
    }
}

/// Reads the request's idempotency key from its `Idempotency-Key` header, within `scope` if
/// given (for example the tenant or API client from authentication, so that two clients
/// cannot see each other's records through the same key).
///
/// The value is parsed by [`parse_key`]. Exactly one `Idempotency-Key` field is accepted.
///
/// # Errors
/// [`KeyError::Missing`] without the header; [`KeyError::Invalid`] if there are several, the
/// value is malformed or the key is not a valid [`Key`]; [`KeyError::InvalidScope`] if
/// `scope` is not a valid scope (see [`Key::scoped`]).
pub fn key_from_headers(headers: &HeaderMap, scope: Option<&str>) -> Result<Key, KeyError> {
    if let Some(scope) = scope {
        Key::new(scope).map_err(|e| KeyError::InvalidScope {
            reason: reason_of(e),
        })?;
    }
    let mut fields = headers.get_all(IDEMPOTENCY_KEY).iter();
    let value = fields.next().ok_or(KeyError::Missing)?;
    if fields.next().is_some() {
        return Err(invalid(
            "the request has more than one Idempotency-Key field",
        ));
    }
    let key = parse_key(value.as_bytes())?;
    let built = match scope {
        Some(scope) => Key::scoped(scope, &key),
        None => Key::new(&key),
    };
    built.map_err(|e| KeyError::Invalid {
        reason: reason_of(e),
    })
}

/// Parses an `Idempotency-Key` field value into the key text.
///
/// Two forms, after trimming surrounding spaces and tabs:
/// - **sf-string** (the IETF draft's form, RFC 8941 §3.3.3): `"8e03…"`. Inside the quotes,
///   printable ASCII except `"` and `\`, which are written `\"` and `\\`; any other escape, a
///   missing closing quote or anything after the string is an error. RFC 8941 parameters after
///   the string (`"abc"; v=1`) are accepted and ignored: none are defined, and RFC 8941 asks
///   fields to tolerate unknown ones.
/// - **bare**: a value that does not start with `"` is the key verbatim (`8e03…`, the form most
///   clients send, Stripe's included), even if it holds spaces, `;` or `"` later on.
///
/// Either way the result still has to pass [`Key::new`] (1 to 255 bytes of printable ASCII),
/// which [`key_from_headers`] checks.
///
/// # Errors
/// [`KeyError::Invalid`] if the value is a malformed sf-string or holds a byte outside
/// printable ASCII.
pub fn parse_key(value: &[u8]) -> Result<String, KeyError> {
    let value = value.trim_ascii_start().trim_ascii_end();
    if let Some(pos) = value.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        return Err(invalid(format!(
            "the value has a byte outside printable ASCII at position {pos}"
        )));
    }
    let Some(quoted) = value.strip_prefix(b"\"") else {
        // Printable ASCII, checked above, so this is valid UTF-8.
        return Ok(String::from_utf8_lossy(value).into_owned());
    };
    let (key, rest) = sf_string(quoted)?;
    skip_parameters(rest)?;
    Ok(key)
}

/// Parses the rest of an sf-string after its opening quote; returns the text and what follows
/// the closing quote.
fn sf_string(input: &[u8]) -> Result<(String, &[u8]), KeyError> {
    let mut out = String::with_capacity(input.len());
    let mut bytes = input.iter().enumerate();
    while let Some((i, &b)) = bytes.next() {
        match b {
            b'"' => return Ok((out, &input[i + 1..])),
            b'\\' => match bytes.next() {
                Some((_, &c @ (b'"' | b'\\'))) => out.push(char::from(c)),
                Some((_, &c)) => {
                    return Err(invalid(format!(
                        "the quoted key has the escape \\{} (only \\\" and \\\\ are allowed)",
                        char::from(c)
                    )));
                }
                None => return Err(invalid("the quoted key ends in a lone backslash")),
            },
            // Callers pass printable ASCII only.
            _ => out.push(char::from(b)),
        }
    }
    Err(invalid("the quoted key has no closing quote"))
}

/// Checks RFC 8941 parameters (`;key=value` after the item) and ignores them.
fn skip_parameters(mut rest: &[u8]) -> Result<(), KeyError> {
    let bad = |what: &str| invalid(format!("after the quoted key: {what}"));
    let is_key_start = |b: &u8| b.is_ascii_lowercase() || *b == b'*';
    let is_key_char = |b: &u8| {
        b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'.' | b'*')
    };
    // A bare item: integer, decimal, token, byte sequence or boolean. Checked loosely (the
    // value is ignored), but never past a delimiter.
    let is_value_char = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/?=".contains(b);
    loop {
        rest = rest.trim_ascii_end();
        let Some(after) = rest.strip_prefix(b";") else {
            return if rest.is_empty() {
                Ok(())
            } else {
                Err(bad("unexpected characters (quote the whole key)"))
            };
        };
        let after = after.trim_ascii_start();
        if !after.first().is_some_and(is_key_start) {
            return Err(bad("a parameter must start with a lowercase letter or '*'"));
        }
        let key_len = after.iter().take_while(|b| is_key_char(b)).count();
        rest = &after[key_len..];
        if let Some(value) = rest.strip_prefix(b"=") {
            rest = if let Some(quoted) = value.strip_prefix(b"\"") {
                sf_string(quoted)?.1
            } else {
                let len = value.iter().take_while(|b| is_value_char(b)).count();
                if len == 0 {
                    return Err(bad("a parameter has an empty value"));
                }
                &value[len..]
            };
        }
    }
}

fn invalid(reason: impl Into<String>) -> KeyError {
    KeyError::Invalid {
        reason: reason.into(),
    }
}

fn reason_of(err: Error) -> String {
    match err {
        Error::InvalidKey { reason } => reason,
        other => other.to_string(),
    }
}

// ---------------------------------------------------------------- problems

/// An RFC 9457 problem: the `application/problem+json` answer of the IETF draft.
///
/// ```
/// use idempotency_store::http::Problem;
///
/// let answer = Problem::missing_key().to_http();
/// assert_eq!(answer.status(), 400);
/// assert_eq!(answer.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Problem {
    /// The HTTP status (also the `status` member).
    pub status: StatusCode,
    /// The `type` member: a URI naming the kind of problem (see [`problem_type`]).
    pub problem_type: String,
    /// The `title` member: a short summary that is the same for every occurrence of the type.
    pub title: String,
    /// The `detail` member: this occurrence, in words a client developer can act on.
    pub detail: String,
    /// Seconds for a `Retry-After` header, if the client should retry later.
    pub retry_after: Option<u64>,
}

impl Problem {
    /// A problem of your own (for example a 400 for a body that fails validation).
    #[must_use]
    pub fn new(
        status: StatusCode,
        problem_type: impl Into<String>,
        title: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        Problem {
            status,
            problem_type: problem_type.into(),
            title: title.into(),
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Adds a `Retry-After` of `seconds`.
    #[must_use]
    pub fn with_retry_after(mut self, seconds: u64) -> Self {
        self.retry_after = Some(seconds);
        self
    }

    /// 400: the request has no `Idempotency-Key` header.
    #[must_use]
    pub fn missing_key() -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            problem_type::MISSING_KEY,
            "Idempotency-Key header missing",
            "This operation is idempotent and requires an Idempotency-Key header, for example \
             Idempotency-Key: \"8e03978e-40d5-43e8-bc93-6894a57f9324\" (a new UUID per request).",
        )
    }

    /// 400: the key is malformed or not acceptable; `reason` says why.
    #[must_use]
    pub fn invalid_key(reason: &str) -> Self {
        Problem::new(
            StatusCode::BAD_REQUEST,
            problem_type::INVALID_KEY,
            "Invalid Idempotency-Key",
            format!(
                "The Idempotency-Key header is not acceptable: {reason}. A key is 1 to 255 \
                 printable ASCII characters, sent as a quoted string (\"...\") or bare."
            ),
        )
    }

    /// 422: the key was already used for a different request (method, path or body).
    #[must_use]
    pub fn mismatch() -> Self {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            problem_type::KEY_REUSED,
            "Idempotency-Key reused",
            "This Idempotency-Key was already used for a different request (method, path or \
             body). Use a new key for a new request; retry with the original request to get \
             its answer.",
        )
    }

    /// 409: the first request with this key is still in flight. `Retry-After` is the time
    /// until its lease lapses, from `now`, in whole seconds rounded up and at least 1: by then
    /// it has completed (the retry gets the replay) or a retry may take it over.
    #[must_use]
    pub fn in_progress(lease_until: Timestamp, now: Timestamp) -> Self {
        let millis = lease_until.as_millis().saturating_sub(now.as_millis());
        Problem::new(
            StatusCode::CONFLICT,
            problem_type::IN_PROGRESS,
            "Request in progress",
            "A request with this Idempotency-Key is still being processed. Retry after the \
             time in Retry-After to get its answer.",
        )
        .with_retry_after(millis.div_ceil(1000).max(1))
    }

    /// 503: the store is full and refuses new keys for now (retry after `retry_after`
    /// seconds).
    #[must_use]
    pub fn quota_exceeded(retry_after: u64) -> Self {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            problem_type::STORE_FULL,
            "Too many pending requests",
            "The server cannot accept new idempotent requests right now. Retry later with the \
             same Idempotency-Key.",
        )
        .with_retry_after(retry_after)
    }

    /// 503: the tower layer is overloaded (no slot for the claim came free in time); the
    /// key was not touched.
    #[must_use]
    pub fn overloaded() -> Self {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            problem_type::UNAVAILABLE,
            "Service unavailable",
            "The server is overloaded and did not carry out the request. Retry after the time \
             in Retry-After with the same Idempotency-Key.",
        )
        .with_retry_after(1)
    }

    /// 503: the store could not be reached ([`Error::Storage`], made once more first if its
    /// outcome was unknown).
    #[must_use]
    pub fn unavailable() -> Self {
        Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            problem_type::UNAVAILABLE,
            "Service unavailable",
            "The server could not reach its store; the request may or may not have been \
             carried out. Retry after the time in Retry-After with the same Idempotency-Key to \
             get its outcome.",
        )
        .with_retry_after(1)
    }

    /// 500: the server failed. The detail says nothing about the server's internals.
    #[must_use]
    pub fn internal() -> Self {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            problem_type::INTERNAL,
            "Internal server error",
            "The server failed; the request may or may not have been applied. Retry with the \
             same Idempotency-Key to get its outcome.",
        )
    }

    /// The answer for a store error:
    ///
    /// | error | answer |
    /// |---|---|
    /// | [`Error::InvalidKey`] (e.g. longer than the store's `max_key_len`) | 400, [`invalid_key`](Problem::invalid_key) |
    /// | [`Error::QuotaExceeded`] | 503, `Retry-After:` [`QUOTA_RETRY_AFTER_SECS`] |
    /// | [`Error::LeaseLost`] (a retry took the key over) | 409, `Retry-After: 1` |
    /// | [`Error::Storage`] (the store could not be reached) | 503, `Retry-After: 1`, [`unavailable`](Problem::unavailable) |
    /// | anything else | 500, [`internal`](Problem::internal) (log the error yourself) |
    #[must_use]
    pub fn from_error(err: &Error) -> Self {
        match err {
            Error::InvalidKey { reason } => Problem::invalid_key(reason),
            Error::QuotaExceeded { .. } => Problem::quota_exceeded(QUOTA_RETRY_AFTER_SECS),
            Error::LeaseLost => Problem::new(
                StatusCode::CONFLICT,
                problem_type::IN_PROGRESS,
                "Request in progress",
                "Another attempt with this Idempotency-Key took over while this one ran. Retry \
                 to get its answer.",
            )
            .with_retry_after(1),
            Error::Storage { .. } => Problem::unavailable(),
            _ => Problem::internal(),
        }
    }

    /// The JSON body: `{"type", "title", "status", "detail"}`, in that order.
    #[must_use]
    pub fn to_json(&self) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Body<'a> {
            #[serde(rename = "type")]
            problem_type: &'a str,
            title: &'a str,
            status: u16,
            detail: &'a str,
        }
        let body = Body {
            problem_type: &self.problem_type,
            title: &self.title,
            status: self.status.as_u16(),
            detail: &self.detail,
        };
        // Serializing strings and a number cannot fail.
        serde_json::to_vec(&body).unwrap_or_default()
    }

    /// The answer: status, `Content-Type: application/problem+json`, `Retry-After` if set,
    /// and the JSON body.
    #[must_use]
    pub fn to_http(&self) -> ::http::Response<Vec<u8>> {
        let mut out = ::http::Response::new(self.to_json());
        *out.status_mut() = self.status;
        let headers = out.headers_mut();
        headers.insert(
            CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(seconds) = self.retry_after {
            headers.insert(RETRY_AFTER, HeaderValue::from(seconds));
        }
        out
    }

    /// The same answer as a [`Response`], to store as the final outcome of an operation (for
    /// example a declined payment, which every retry should see again).
    #[must_use]
    pub fn to_response(&self) -> Response {
        let mut out = Response::new(self.status.as_u16(), self.to_json())
            .with_header(CONTENT_TYPE.as_str(), "application/problem+json");
        if let Some(seconds) = self.retry_after {
            out = out.with_header(RETRY_AFTER.as_str(), seconds.to_string());
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ::http::Request;

    use super::*;
    use crate::{ManualClock, Store};

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for value in values {
            map.append(
                "Idempotency-Key",
                HeaderValue::from_bytes(value).expect("test header value"),
            );
        }
        map
    }

    fn key(value: &[u8]) -> Result<Key, KeyError> {
        key_from_headers(&headers(&[value]), None)
    }

    fn parsed(value: &[u8]) -> Option<String> {
        key(value).ok().map(|k| k.key().to_owned())
    }

    fn json(body: &[u8]) -> serde_json::Value {
        serde_json::from_slice(body).expect("problem body is JSON")
    }

    /// Status, content type, and the four members, for any problem answer.
    fn assert_problem(answer: &::http::Response<Vec<u8>>, status: u16, problem_type: &str) {
        assert_eq!(answer.status().as_u16(), status);
        assert_eq!(
            answer.headers()[CONTENT_TYPE],
            "application/problem+json",
            "content type"
        );
        let body = json(answer.body());
        assert_eq!(body["type"], problem_type);
        assert_eq!(body["status"], status);
        assert!(body["title"].as_str().is_some_and(|t| !t.is_empty()));
        assert!(body["detail"].as_str().is_some_and(|d| !d.is_empty()));
    }

    fn retry_after(answer: &::http::Response<Vec<u8>>) -> Option<&str> {
        answer
            .headers()
            .get(RETRY_AFTER)
            .map(|v| v.to_str().expect("ascii"))
    }

    // ------------------------------------------------------------ the key header

    #[test]
    fn sf_string_and_bare_forms_give_the_same_key() {
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(
            parsed(format!("\"{uuid}\"").as_bytes()).as_deref(),
            Some(uuid)
        );
        assert_eq!(parsed(uuid.as_bytes()).as_deref(), Some(uuid));
        assert_eq!(key(b"\"abc\"").ok(), Key::new("abc").ok());
    }

    #[test]
    fn sf_string_escapes() {
        assert_eq!(parsed(br#""a\"b""#).as_deref(), Some("a\"b"));
        assert_eq!(parsed(br#""a\\b""#).as_deref(), Some("a\\b"));
        assert_eq!(parsed(br#""\\\"""#).as_deref(), Some("\\\""));
        // Unescaped specials other than `"` and `\` are plain characters.
        assert_eq!(parsed(br#""a,b;c=d 'e'""#).as_deref(), Some("a,b;c=d 'e'"));
        for bad in [&br#""a\nb""#[..], br#""a\'b""#, br#""a\"#, br#""ab\""#] {
            assert!(
                matches!(key(bad), Err(KeyError::Invalid { .. })),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn malformed_sf_strings_are_invalid() {
        for bad in [
            &b"\"abc"[..],       // no closing quote
            b"\"",               // a lone quote
            b"\"\"",             // empty key
            b"\"abc\"def",       // junk after the string
            b"\"abc\" \"def\"",  // two strings
            b"\"abc\", \"def\"", // a list, as two fields merged by a proxy
            b"\"abc\";",         // parameter without a key
            b"\"abc\";X=1",      // parameter keys are lowercase
            b"\"abc\";a=",       // empty parameter value
            b"\"abc\";a=\"x",    // unterminated parameter string
            b"\"a\tb\"",         // a tab inside the string
            b"\"abc\" ;v=1",     // no space before a parameter
        ] {
            let err = key(bad);
            assert!(
                matches!(err, Err(KeyError::Invalid { .. })),
                "{:?} gave {err:?}",
                String::from_utf8_lossy(bad)
            );
            assert_eq!(
                err.map_err(|e| e.problem().status),
                Err(StatusCode::BAD_REQUEST)
            );
        }
    }

    #[test]
    fn parameters_and_surrounding_whitespace_are_ignored() {
        for ok in [
            &b"\"abc\";v=1"[..],
            b"\"abc\"; v=1;w",
            b"\"abc\";a=?1;b=tok/en:x;c=-1.5;d=:aGk=:;e=\"q\\\"s\"",
            b"  \"abc\"  ",
            b"\t\"abc\"\t",
            b" \"abc\";*x=1 ",
        ] {
            assert_eq!(
                parsed(ok).as_deref(),
                Some("abc"),
                "{:?}",
                String::from_utf8_lossy(ok)
            );
        }
        assert_eq!(parsed(b"  abc  ").as_deref(), Some("abc"));
    }

    #[test]
    fn bare_values_are_taken_verbatim() {
        assert_eq!(parsed(b"abc;v=1").as_deref(), Some("abc;v=1"));
        assert_eq!(parsed(b"a b\"c").as_deref(), Some("a b\"c"));
        assert_eq!(parsed(b"123").as_deref(), Some("123"));
    }

    #[test]
    fn bytes_outside_printable_ascii_and_bad_lengths_are_invalid() {
        for bad in [&b"caf\xc3\xa9"[..], b"\"caf\xc3\xa9\"", b"", b"   "] {
            assert!(matches!(key(bad), Err(KeyError::Invalid { .. })));
        }
        // `http` refuses DEL and other controls in a header value; other servers may not.
        for bad in [&b"a\x7fb"[..], b"\"a\x7fb\"", b"a\x01b", b"\"a\nb\""] {
            assert!(matches!(parse_key(bad), Err(KeyError::Invalid { .. })));
        }
        let long = "k".repeat(256);
        assert!(matches!(
            key(long.as_bytes()),
            Err(KeyError::Invalid { .. })
        ));
        assert!(key("k".repeat(255).as_bytes()).is_ok());
        let quoted_long = format!("\"{long}\"");
        let err = key(quoted_long.as_bytes()).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("255")));
    }

    #[test]
    fn missing_duplicate_and_case_insensitive_header() {
        assert_eq!(
            key_from_headers(&HeaderMap::new(), None),
            Err(KeyError::Missing)
        );
        let two = headers(&[b"\"a\"", b"\"a\""]);
        assert!(matches!(
            key_from_headers(&two, None),
            Err(KeyError::Invalid { reason }) if reason.contains("more than one")
        ));
        let request = Request::post("/p")
            .header("IDEMPOTENCY-KEY", "\"abc\"")
            .body(())
            .expect("request");
        assert_eq!(
            key_from_headers(request.headers(), None).ok(),
            Key::new("abc").ok()
        );
    }

    #[test]
    fn scope_is_applied_and_a_bad_scope_is_the_servers_fault() {
        let scoped = key_from_headers(&headers(&[b"\"abc\""]), Some("tenant-1"));
        assert_eq!(scoped.ok(), Key::scoped("tenant-1", "abc").ok());
        let err = key_from_headers(&headers(&[b"\"abc\""]), Some(""));
        assert!(matches!(err, Err(KeyError::InvalidScope { .. })));
        let problem = err.err().map(|e| e.problem());
        assert_eq!(problem, Some(Problem::internal()));
        // The scope is checked first, so a missing key with a bad scope is still the server's.
        let err = key_from_headers(&HeaderMap::new(), Some("bad\u{1}"));
        assert!(matches!(err, Err(KeyError::InvalidScope { .. })));
    }

    // ------------------------------------------------------------ problems

    #[test]
    fn missing_and_invalid_keys_answer_400() {
        let missing = KeyError::Missing.problem().to_http();
        assert_problem(&missing, 400, problem_type::MISSING_KEY);
        assert_eq!(retry_after(&missing), None);

        let invalid = key(b"\"abc").err().map(|e| e.problem().to_http());
        let invalid = invalid.expect("invalid");
        assert_problem(&invalid, 400, problem_type::INVALID_KEY);
        let detail = json(invalid.body())["detail"].to_string();
        assert!(detail.contains("no closing quote"), "{detail}");
    }

    #[test]
    fn mismatch_answers_422() {
        let answer = Problem::mismatch().to_http();
        assert_problem(&answer, 422, problem_type::KEY_REUSED);
        assert_eq!(retry_after(&answer), None);
    }

    #[test]
    fn in_progress_answers_409_with_retry_after_rounded_up() {
        let at = |ms| Timestamp::from_millis(ms);
        for (lease_until, now, seconds) in [
            (10_001, 10_000, "1"),
            (11_000, 10_000, "1"),
            (11_001, 10_000, "2"),
            (70_000, 10_000, "60"),
            (10_000, 10_000, "1"), // lapsed: never 0, which would invite a hot loop
            (5_000, 10_000, "1"),
        ] {
            let answer = Problem::in_progress(at(lease_until), at(now)).to_http();
            assert_problem(&answer, 409, problem_type::IN_PROGRESS);
            assert_eq!(retry_after(&answer), Some(seconds), "{lease_until} - {now}");
        }
    }

    #[test]
    fn the_substitute_answer_names_the_not_stored_problem() {
        // `Response::not_stored` lives below this layer and spells the URI itself.
        assert_eq!(
            problem_type::NOT_STORED,
            crate::api::response::NOT_STORED_TYPE
        );
        let body = Response::not_stored(2, 1).body;
        assert_eq!(json(&body)["type"], problem_type::NOT_STORED);
    }

    #[test]
    fn store_errors_map_to_400_503_409_and_500() {
        let invalid = Problem::from_error(&Error::invalid_key("too long")).to_http();
        assert_problem(&invalid, 400, problem_type::INVALID_KEY);

        let full = Error::QuotaExceeded {
            limit: "max_records",
            used: 10,
            max: 10,
        };
        let full = Problem::from_error(&full).to_http();
        assert_problem(&full, 503, problem_type::STORE_FULL);
        assert_eq!(
            retry_after(&full),
            Some(QUOTA_RETRY_AFTER_SECS.to_string().as_str())
        );
        let custom = Problem::quota_exceeded(7).to_http();
        assert_problem(&custom, 503, problem_type::STORE_FULL);
        assert_eq!(retry_after(&custom), Some("7"));

        let lost = Problem::from_error(&Error::LeaseLost).to_http();
        assert_problem(&lost, 409, problem_type::IN_PROGRESS);
        assert_eq!(retry_after(&lost), Some("1"));

        let disk = Error::storage("committing", std::io::Error::other("disk on fire"));
        let disk = Problem::from_error(&disk).to_http();
        assert_problem(&disk, 503, problem_type::UNAVAILABLE);
        assert_eq!(retry_after(&disk), Some("1"));
        assert!(!String::from_utf8_lossy(disk.body()).contains("disk on fire"));
        let damaged = Problem::from_error(&Error::corrupted("bad record")).to_http();
        assert_problem(&damaged, 500, problem_type::INTERNAL);
    }

    #[test]
    fn problem_types_are_stable_uris_and_distinct() {
        let prefix = "https://docs.rs/idempotency-store/latest/idempotency_store/http/#";
        let mut all = problem_type::ALL.to_vec();
        assert!(all.iter().all(|t| t.starts_with(prefix)));
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), problem_type::ALL.len());
    }

    #[test]
    fn problem_as_a_stored_response() {
        let problem = Problem::new(
            StatusCode::PAYMENT_REQUIRED,
            "https://example.com/declined",
            "Card declined",
            "The card was declined.",
        )
        .with_retry_after(3);
        let stored = problem.to_response();
        assert_eq!(stored.status, 402);
        let (stored, direct) = (to_http(stored).expect("valid"), problem.to_http());
        assert_eq!(stored.status(), direct.status());
        assert_eq!(stored.headers(), direct.headers());
        assert_eq!(stored.body(), direct.body());
    }

    // ------------------------------------------------------------ responses and replays

    fn sample() -> Response {
        Response::new(201, r#"{"id":"pay_1"}"#)
            .with_header("content-type", "application/json")
            .with_header("set-cookie", "a=1")
            .with_header("set-cookie", "b=2")
            .with_header("location", "/payments/pay_1")
    }

    #[test]
    fn responses_round_trip_through_http() {
        let answer = to_http(sample()).expect("valid");
        assert_eq!(answer.status(), 201);
        assert_eq!(answer.body(), br#"{"id":"pay_1"}"#);
        let cookies: Vec<_> = answer.headers().get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert_eq!(from_http(answer), sample());

        // Names come back lowercased; values as bytes, including obs-text.
        let mixed = Response::new(200, "").with_header("X-Thing", b"caf\xe9".to_vec());
        let back = from_http(to_http(mixed).expect("valid"));
        assert_eq!(back.headers, [("x-thing".to_owned(), b"caf\xe9".to_vec())]);
    }

    #[test]
    fn unsendable_responses_are_invalid_response_errors() {
        for (bad, what) in [
            (Response::new(42, ""), "status 42"),
            (Response::new(1000, ""), "status 1000"),
            (
                Response::new(200, "").with_header("bad name", "v"),
                "header name",
            ),
            (Response::new(200, "").with_header("", "v"), "header name"),
            (
                Response::new(200, "").with_header("x", "a\nb"),
                "header value",
            ),
        ] {
            let err = to_http(bad.clone()).expect_err("rejected");
            assert!(err.reason().contains(what), "{err}");
            assert_eq!(replay(bad).err(), Some(err));
        }
    }

    #[test]
    fn replay_adds_idempotent_replayed_true() {
        let answer = replay(sample()).expect("valid");
        assert_eq!(answer.status(), 201);
        assert_eq!(answer.body(), br#"{"id":"pay_1"}"#);
        assert_eq!(answer.headers()[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(answer.headers()["location"], "/payments/pay_1");
        assert_eq!(answer.headers().get_all("set-cookie").iter().count(), 2);
        // A stored header of that name is replaced, not duplicated.
        let stored = sample().with_header("Idempotent-Replayed", "false");
        let answer = replay(stored).expect("valid");
        let values: Vec<_> = answer
            .headers()
            .get_all(IDEMPOTENT_REPLAYED)
            .iter()
            .collect();
        assert_eq!(values, ["true"]);
    }

    #[test]
    fn decide_maps_every_claim() -> crate::error::Result<()> {
        let clock = ManualClock::new(Timestamp::from_millis(1_000_000));
        let store = Store::builder()
            .lease(Duration::from_millis(2_500))
            .clock(clock.clone())
            .open_in_memory()?;
        let key = Key::new("k")?;
        let request = Request::post("/payments")
            .body(b"{}".to_vec())
            .expect("request");
        let fp = fingerprint(&request);

        let Ok(Decision::Run(lease)) = decide(store.claim(&key, fp)?, store.now()) else {
            panic!("a fresh key runs");
        };
        clock.advance(Duration::from_millis(400));
        let Ok(Decision::Respond(busy)) = decide(store.claim(&key, fp)?, store.now()) else {
            panic!("in progress");
        };
        assert_problem(&busy, 409, problem_type::IN_PROGRESS);
        assert_eq!(retry_after(&busy), Some("3")); // 2.1 s left, rounded up

        store.complete(&lease, sample())?;
        let Ok(Decision::Respond(replayed)) = decide(store.claim(&key, fp)?, store.now()) else {
            panic!("completed");
        };
        assert_eq!(replayed.status(), 201);
        assert_eq!(replayed.headers()[IDEMPOTENT_REPLAYED], "true");
        assert_eq!(from_http(replayed).body, sample().body);

        let other = fingerprint(
            &Request::post("/payments")
                .body(b"{ }".to_vec())
                .expect("req"),
        );
        let Ok(Decision::Respond(reused)) = decide(store.claim(&key, other)?, store.now()) else {
            panic!("mismatch");
        };
        assert_problem(&reused, 422, problem_type::KEY_REUSED);

        // A stored response http cannot send is an error, not a silent 500.
        let bad_key = Key::new("bad")?;
        let Claim::Acquired(lease) = store.claim(&bad_key, fp)? else {
            panic!("fresh");
        };
        store.complete(&lease, Response::new(7, ""))?;
        assert!(decide(store.claim(&bad_key, fp)?, store.now()).is_err());
        Ok(())
    }

    #[test]
    fn fingerprint_covers_method_target_and_body_but_not_host_or_headers() {
        let fp = |method: &str, uri: &str, body: &str| {
            let request = Request::builder()
                .method(method)
                .uri(uri)
                .header("x-any", "thing")
                .body(body.as_bytes().to_vec())
                .expect("request");
            fingerprint(&request)
        };
        let base = fp("POST", "/payments?x=1", "{}");
        assert_eq!(base, Fingerprint::of(["POST", "/payments?x=1", "{}"]));
        assert_eq!(
            base,
            fp("POST", "https://api.example.com/payments?x=1", "{}")
        );
        let bare = Request::post("/payments?x=1").body("{}").expect("request");
        assert_eq!(base, fingerprint(&bare));
        assert_ne!(base, fp("PUT", "/payments?x=1", "{}"));
        assert_ne!(base, fp("POST", "/payments?x=2", "{}"));
        assert_ne!(base, fp("POST", "/payments", "{}"));
        assert_ne!(base, fp("POST", "/payments?x=1", "{ }"));
    }
}
