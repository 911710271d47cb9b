//! Assertions on answers shared by the unit tests of the `http` files.

use ::http::header::{CONTENT_TYPE, RETRY_AFTER};

/// The body of a problem answer as JSON.
pub(super) fn json(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).expect("problem body is JSON")
}

/// Status, content type, the four members, and the `code` of the type for this crate's own
/// types, for any problem answer.
pub(super) fn assert_problem(answer: &::http::Response<Vec<u8>>, status: u16, problem_type: &str) {
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
    if let Some((_, fragment)) = problem_type.rsplit_once("/idempotency_store/http/#") {
        assert_eq!(body["code"], fragment, "code");
    }
}

/// The `Retry-After` header of an answer, if it has one.
pub(super) fn retry_after(answer: &::http::Response<Vec<u8>>) -> Option<&str> {
    answer
        .headers()
        .get(RETRY_AFTER)
        .map(|v| v.to_str().expect("ascii"))
}
