//! Converting between stored [`Response`]s and `http` responses, and the answer to a claim.

use ::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};

use super::problem::Problem;
use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::outcome::{Claim, Lease};
use crate::api::response::Response;

/// The response header that marks a replay: `Idempotent-Replayed: true`.
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A [`Response`] that `http` cannot represent: a status outside `100..=999`, or a header
/// name or value it rejects. See the module docs, "Conversion failures", for why this is not
/// an [`Error`](crate::error::Error).
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
    Response {
        body,
        ..stored_head(&parts)
    }
}

/// The stored form of a response whose parts and body the caller keeps (the flow answers
/// the client with them): no copy of the parts first.
pub(crate) fn stored_copy(parts: &::http::response::Parts, body: &[u8]) -> Response {
    Response {
        body: body.to_vec(),
        ..stored_head(parts)
    }
}

/// The stored status and headers of `parts`, with an empty body.
fn stored_head(parts: &::http::response::Parts) -> Response {
    let headers = parts
        .headers
        .iter()
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    Response {
        status: parts.status.as_u16(),
        headers,
        body: Vec::new(),
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
/// counted from `now` (pass [`IdempotencyStore::now`](crate::IdempotencyStore::now)); [`Claim::Mismatch`] → 422.
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ::http::Request;

    use super::*;
    use crate::api::key::Key;
    use crate::http::problem_type;
    use crate::http::testing::{assert_problem, retry_after};
    use crate::{IdempotencyStore, ManualClock, Store};

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

        let Ok(Decision::Run(lease)) = decide(store.claim(&key, fp)?, store.now()?) else {
            panic!("a fresh key runs");
        };
        clock.advance(Duration::from_millis(400));
        let Ok(Decision::Respond(busy)) = decide(store.claim(&key, fp)?, store.now()?) else {
            panic!("in progress");
        };
        assert_problem(&busy, 409, problem_type::IN_PROGRESS);
        assert_eq!(retry_after(&busy), Some("3")); // 2.1 s left, rounded up

        store.complete(&lease, sample())?;
        let Ok(Decision::Respond(replayed)) = decide(store.claim(&key, fp)?, store.now()?) else {
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
        let Ok(Decision::Respond(reused)) = decide(store.claim(&key, other)?, store.now()?) else {
            panic!("mismatch");
        };
        assert_problem(&reused, 422, problem_type::KEY_REUSED);

        // A stored response http cannot send is an error, not a silent 500.
        let bad_key = Key::new("bad")?;
        let Claim::Acquired(lease) = store.claim(&bad_key, fp)? else {
            panic!("fresh");
        };
        store.complete(&lease, Response::new(7, ""))?;
        assert!(decide(store.claim(&bad_key, fp)?, store.now()?).is_err());
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
