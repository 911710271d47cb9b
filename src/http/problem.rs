//! The catalogue of problem answers (RFC 9457) and their stable `type` URIs.

use ::http::HeaderValue;
use ::http::StatusCode;
use ::http::header::{CONTENT_TYPE, RETRY_AFTER};

use crate::api::clock::Timestamp;
use crate::api::response::Response;
use crate::error::Error;

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
    /// 413: the body of an idempotent request is over the limit ([`handle`](crate::http::handle)'s
    /// `max_body`).
    pub const TOO_LARGE: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#too-large";

    /// 400: the body of an idempotent request could not be read (the layers: tower, actix).
    pub const INVALID_BODY: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#invalid-body";
    /// 503: the store could not be reached, or a layer (tower, actix) is overloaded; retry with the
    /// same key to get the outcome.
    pub const UNAVAILABLE: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#unavailable";
    /// 500, stored and replayed: the request was carried out but its response could not be
    /// stored (larger than `max_response_bytes`, or unreadable); it is not carried out again
    /// for the key.
    pub const NOT_STORED: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#response-not-stored";
    /// 500, stored and replayed: an earlier attempt died before it settled and the server does
    /// not run the request again ([`Takeover::AnswerUnknown`](crate::http::Takeover::AnswerUnknown)).
    pub const OUTCOME_UNKNOWN: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#outcome-unknown";
    /// 410, stored and replayed: the request was carried out and its answer streamed to the
    /// first client, but the answer was larger than the store keeps (the layers: tower,
    /// actix). Not carried out again for the key; must not be sent again under a new key.
    pub const COMPLETED_NOT_STORED: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#completed-not-stored";

    #[cfg(test)]
    pub(super) const ALL: [&str; 12] = [
        COMPLETED_NOT_STORED,
        OUTCOME_UNKNOWN,
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

/// The short, stable `code` of each problem of [`problem_type`]: the member `code` of its
/// problem+json body and [`Problem::code`], for a client or an application's
/// [`render_problem`](crate::http::HandleOptions::render_problem) to match on instead of the
/// `type` URI. Each is the fragment of its type's URI (the heading of its explanation), so a
/// code and its type never disagree.
///
/// ```
/// use idempotency_store::http::{Problem, problem_code};
///
/// let problem = Problem::mismatch();
/// let answer = match problem.code.as_deref() {
///     Some(problem_code::KEY_REUSED) => "use a new key",
///     _ => "something else",
/// };
/// assert_eq!(answer, "use a new key");
/// ```
pub mod problem_code {
    /// 400, [`problem_type::MISSING_KEY`](super::problem_type::MISSING_KEY).
    pub const MISSING_KEY: &str = "missing-key";
    /// 400, [`problem_type::INVALID_KEY`](super::problem_type::INVALID_KEY).
    pub const INVALID_KEY: &str = "invalid-key";
    /// 422, [`problem_type::KEY_REUSED`](super::problem_type::KEY_REUSED).
    pub const KEY_REUSED: &str = "key-reused";
    /// 409, [`problem_type::IN_PROGRESS`](super::problem_type::IN_PROGRESS).
    pub const IN_PROGRESS: &str = "in-progress";
    /// 503, [`problem_type::STORE_FULL`](super::problem_type::STORE_FULL).
    pub const STORE_FULL: &str = "store-full";
    /// 500, [`problem_type::INTERNAL`](super::problem_type::INTERNAL).
    pub const INTERNAL: &str = "internal";
    /// 413, [`problem_type::TOO_LARGE`](super::problem_type::TOO_LARGE).
    pub const TOO_LARGE: &str = "too-large";
    /// 400, [`problem_type::INVALID_BODY`](super::problem_type::INVALID_BODY).
    pub const INVALID_BODY: &str = "invalid-body";
    /// 503, [`problem_type::UNAVAILABLE`](super::problem_type::UNAVAILABLE).
    pub const UNAVAILABLE: &str = "unavailable";
    /// 500, stored, [`problem_type::NOT_STORED`](super::problem_type::NOT_STORED).
    pub const NOT_STORED: &str = "response-not-stored";
    /// 500, stored, [`problem_type::OUTCOME_UNKNOWN`](super::problem_type::OUTCOME_UNKNOWN).
    pub const OUTCOME_UNKNOWN: &str = "outcome-unknown";
    /// 410, stored, [`problem_type::COMPLETED_NOT_STORED`](super::problem_type::COMPLETED_NOT_STORED).
    pub const COMPLETED_NOT_STORED: &str = "completed-not-stored";

    /// Where every type URI of this crate's problems starts; the code is the rest.
    pub(super) const TYPE_PREFIX: &str =
        "https://docs.rs/idempotency-store/latest/idempotency_store/http/#";

    /// The code of a problem `type`: its fragment, for this crate's types; `None` for others.
    pub(super) fn of_type(problem_type: &str) -> Option<String> {
        problem_type
            .strip_prefix(TYPE_PREFIX)
            .filter(|code| !code.is_empty())
            .map(str::to_owned)
    }

    #[cfg(test)]
    pub(super) const ALL: [&str; 12] = [
        COMPLETED_NOT_STORED,
        OUTCOME_UNKNOWN,
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
    /// The `code` member: a short, stable name of the type to match on ([`problem_code`]).
    /// [`Problem::new`] sets it for the types of [`problem_type`]; `None` (no member) for
    /// other types unless set with [`with_code`](Problem::with_code).
    pub code: Option<String>,
}

impl Problem {
    /// A problem of your own (for example a 400 for a body that fails validation). Its
    /// [`code`](Problem::code) is that of `problem_type` if it is one of [`problem_type`]'s,
    /// else none.
    #[must_use]
    pub fn new(
        status: StatusCode,
        problem_type: impl Into<String>,
        title: impl Into<String>,
        detail: impl Into<String>,
    ) -> Self {
        let problem_type = problem_type.into();
        Problem {
            status,
            code: problem_code::of_type(&problem_type),
            problem_type,
            title: title.into(),
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Sets the `code` member (for a problem type of your own, say `"card-declined"`).
    #[must_use]
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
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

    /// 503: a layer (tower, actix) is overloaded (no slot for the claim came free in time); the
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

    /// 500, stored in place of an answer that cannot be kept (`why` completes "The request
    /// was carried out, but …").
    pub(crate) fn not_stored(why: &str) -> Self {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            problem_type::NOT_STORED,
            "Response not stored",
            format!(
                "The request was carried out, but {why}, so it cannot be replayed. The request \
                 will not be carried out again for this key; ask the server's operator for its \
                 outcome."
            ),
        )
    }

    /// 410, stored in place of an answer the layers streamed to the first client but could
    /// not keep: the handler answered `status`, with more than `limit` bytes. Not a 5xx, which
    /// clients and people read as "try again" (often under a new key, which would carry the
    /// request out twice), nor a 409 or 429, which retrying clients retry: the request is
    /// done, and only its answer is gone.
    #[cfg_attr(not(any(feature = "tower", feature = "actix")), allow(dead_code))]
    pub(crate) fn completed_not_stored(status: StatusCode, limit: usize) -> Self {
        Problem::new(
            StatusCode::GONE,
            problem_type::COMPLETED_NOT_STORED,
            "Completed, answer not stored",
            format!(
                "The request with this Idempotency-Key was carried out (the server answered {}), \
                 and its answer was sent to the client that made it, but it was larger than the \
                 {limit} bytes this server stores, so it cannot be replayed. Do not send the \
                 request again, under this key or a new one; ask the server's operator for its \
                 outcome.",
                status.as_u16()
            ),
        )
    }

    /// 500, stored: attempt `died` of this request died before it settled, and the server
    /// does not run it again ([`Takeover::AnswerUnknown`](crate::http::Takeover::AnswerUnknown)).
    pub(crate) fn outcome_unknown(died: u32) -> Self {
        Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            problem_type::OUTCOME_UNKNOWN,
            "Outcome unknown",
            format!(
                "Attempt {died} of this request was interrupted before it finished, and it may \
                 have been partly carried out. It will not be carried out again for this key; \
                 ask the server's operator for its outcome."
            ),
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

    /// The JSON body: `{"type", "title", "status", "detail", "code"}`, in that order, `code`
    /// only if set (an extension member, RFC 9457 §3.2).
    #[must_use]
    pub fn to_json(&self) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Body<'a> {
            #[serde(rename = "type")]
            problem_type: &'a str,
            title: &'a str,
            status: u16,
            detail: &'a str,
            #[serde(skip_serializing_if = "Option::is_none")]
            code: Option<&'a str>,
        }
        let body = Body {
            problem_type: &self.problem_type,
            title: &self.title,
            status: self.status.as_u16(),
            detail: &self.detail,
            code: self.code.as_deref(),
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
    use super::*;
    use crate::http::testing::{assert_problem, json, retry_after};
    use crate::http::to_http;

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
    fn every_problem_type_has_its_fragment_as_its_code() {
        assert_eq!(problem_code::ALL.len(), problem_type::ALL.len());
        for (problem_type, code) in problem_type::ALL.into_iter().zip(problem_code::ALL) {
            assert_eq!(problem_type.rsplit_once('#').map(|(_, f)| f), Some(code));
            assert_eq!(problem_code::of_type(problem_type).as_deref(), Some(code));
            let problem = Problem::new(StatusCode::BAD_REQUEST, problem_type, "t", "d");
            assert_eq!(problem.code.as_deref(), Some(code));
            assert_eq!(json(&problem.to_json())["code"], code);
        }
        // Every constructor's problem carries its type's code.
        let at = Timestamp::from_millis;
        for (problem, code) in [
            (Problem::missing_key(), problem_code::MISSING_KEY),
            (Problem::invalid_key("empty"), problem_code::INVALID_KEY),
            (Problem::mismatch(), problem_code::KEY_REUSED),
            (
                Problem::in_progress(at(2), at(1)),
                problem_code::IN_PROGRESS,
            ),
            (Problem::quota_exceeded(1), problem_code::STORE_FULL),
            (Problem::overloaded(), problem_code::UNAVAILABLE),
            (Problem::unavailable(), problem_code::UNAVAILABLE),
            (Problem::internal(), problem_code::INTERNAL),
            (Problem::not_stored("why"), problem_code::NOT_STORED),
            (Problem::outcome_unknown(1), problem_code::OUTCOME_UNKNOWN),
            (
                Problem::completed_not_stored(::http::StatusCode::CREATED, 1),
                problem_code::COMPLETED_NOT_STORED,
            ),
            (
                Problem::from_error(&Error::LeaseLost),
                problem_code::IN_PROGRESS,
            ),
        ] {
            assert_eq!(problem.code.as_deref(), Some(code), "{problem:?}");
            assert_problem(
                &problem.to_http(),
                problem.status.as_u16(),
                &problem.problem_type,
            );
        }
        // The substitute spelled below this layer carries it too.
        let stored = Response::not_stored(2, 1);
        assert_eq!(json(&stored.body)["code"], problem_code::NOT_STORED);
        let why = crate::api::response::too_large(2, 1);
        assert_eq!(stored.body, Problem::not_stored(&why).to_json());
    }

    #[test]
    fn a_problem_of_ones_own_has_no_code_unless_given_one() {
        let declined = Problem::new(
            StatusCode::PAYMENT_REQUIRED,
            "https://example.com/declined",
            "Card declined",
            "The card was declined.",
        );
        assert_eq!(declined.code, None);
        assert!(json(&declined.to_json()).get("code").is_none());
        let declined = declined.with_code("card-declined");
        assert_eq!(json(&declined.to_json())["code"], "card-declined");
        // A type of this crate's page without a fragment names no problem.
        let bare = Problem::new(StatusCode::BAD_REQUEST, problem_code::TYPE_PREFIX, "t", "d");
        assert_eq!(bare.code, None);
    }

    #[test]
    fn the_layers_answers_say_no_store_unless_rendered_otherwise() {
        use ::http::header::CACHE_CONTROL;
        let options = crate::http::HandleOptions::new();
        let answer = options.answer(&Problem::mismatch());
        assert_problem(&answer, 422, problem_type::KEY_REUSED);
        assert_eq!(answer.headers()[CACHE_CONTROL], "no-store");
        // The application's rendering: its own Cache-Control is kept, else no-store is added.
        let render = |cache: Option<&'static str>| {
            crate::http::HandleOptions::new().render_problem(move |problem| {
                let mut answer = ::http::Response::new(problem.code.clone().unwrap_or_default());
                *answer.status_mut() = problem.status;
                if let Some(cache) = cache {
                    answer
                        .headers_mut()
                        .insert(CACHE_CONTROL, cache.parse().expect("value"));
                }
                answer.map(String::into_bytes)
            })
        };
        let busy = Problem::in_progress(Timestamp::from_millis(3000), Timestamp::from_millis(0));
        let own = render(Some("private")).answer(&busy);
        assert_eq!(own.headers()[CACHE_CONTROL], "private");
        let bare = render(None).answer(&busy);
        assert_eq!(bare.headers()[CACHE_CONTROL], "no-store");
        assert_eq!(retry_after(&bare), Some("3"));
        assert_eq!(bare.body(), b"in-progress");
        // `to_http` alone, which an application may store as its own final answer, is as it
        // was.
        assert!(
            !Problem::mismatch()
                .to_http()
                .headers()
                .contains_key(CACHE_CONTROL)
        );
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
}
