//! The HTTP mapping (feature `http`): the `Idempotency-Key` header, request fingerprints,
//! replays and the IETF draft's error answers, on the [`http`](https://docs.rs/http) 1.x types.
//!
//! One request through a handler:
//!
//! ```
//! use idempotency_store::http::{self as idem, Decision, Problem};
//! use idempotency_store::{IdempotencyStore, Response, Store};
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
//!     let now = match store.now() {
//!         Ok(now) => now,
//!         Err(err) => return Problem::from_error(&err).to_http(),
//!     };
//!     let lease = match idem::decide(claim, now) {
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
//! the members `type`, `title`, `status`, `detail` and `code`; the `type` URIs are in
//! [`problem_type`], and `code` is a short, stable name of the type to match on
//! ([`problem_code`], [`Problem::code`]; `in-progress` for a 409, and so on: each heading of
//! "Problem types" below gives its code). The answers the flow makes itself (the problems,
//! fresh or stored, not the handler's answers or their replays) carry
//! `Cache-Control: no-store`, so that no shared cache keeps a 409 or a 503.
//!
//! | case | status | extra header | built by |
//! |---|---|---|---|
//! | no `Idempotency-Key` header | 400 | | [`KeyError::problem`], [`Problem::missing_key`] |
//! | malformed or invalid key | 400 | | [`KeyError::problem`], [`Problem::invalid_key`] |
//! | key reused with another request | 422 | | [`decide`], [`Problem::mismatch`] |
//! | first request still in flight | 409 | `Retry-After` | [`decide`], [`Problem::in_progress`] |
//! | store full ([`Error::QuotaExceeded`]) | 503 | `Retry-After` | [`Problem::from_error`] |
//! | store unreachable ([`Error::Storage`]), or a layer (tower, actix) overloaded | 503 | `Retry-After: 1` | [`Problem::from_error`], [`Problem::unavailable`], [`Problem::overloaded`] |
//! | handler's answer too large to store ([`handle`]), or its body failing ([`handle`], the layers: tower, actix) | 500, stored and replayed | | [`handle`], the layers |
//! | handler's answer streamed to its client whole, too large to store | 410, stored and replayed | | the layers (tower, actix) |
//! | completed earlier | stored status | `Idempotent-Replayed: true` | [`decide`], [`replay`] |
//!
//! 400, 409 and 422 are the IETF draft's (`draft-ietf-httpapi-idempotency-key-header`);
//! `Idempotent-Replayed` is the header Stripe sends on replays.
//!
//! # Problem types
//!
//! The `type` of each problem links to its heading here (the constants of [`problem_type`]);
//! its `code` is the heading's anchor (the constants of [`problem_code`]).
//!
//! ## Missing key
//!
//! 400 ([`problem_type::MISSING_KEY`], code `missing-key`): the request has no `Idempotency-Key`
//! header, and the operation requires one. Send a new key (for example a UUID) with each new
//! request.
//!
//! ## Invalid key
//!
//! 400 ([`problem_type::INVALID_KEY`], code `invalid-key`): the `Idempotency-Key` header is
//! malformed, or the key is not acceptable (empty, too long, not printable ASCII); the `detail`
//! says why. A key is 1 to 255 printable ASCII characters (or the store's `max_key_len`), sent as a
//! quoted string (`"..."`) or bare.
//!
//! ## Key reused
//!
//! 422 ([`problem_type::KEY_REUSED`], code `key-reused`): the key was already used for a different
//! request (method, path or body). Use a new key for a new request; retry with the original request
//! to get its answer.
//!
//! ## In progress
//!
//! 409 ([`problem_type::IN_PROGRESS`], code `in-progress`), with `Retry-After`: the first request
//! with this key is still being processed (or another attempt took it over while this one ran).
//! Retry with the same key after `Retry-After` seconds to get its answer.
//!
//! ## Store full
//!
//! 503 ([`problem_type::STORE_FULL`], code `store-full`), with `Retry-After`: the store holds as
//! many records or bytes as its quota allows and refuses new keys for now; keys already stored
//! still replay. Retry later with the same key.
//!
//! ## Internal
//!
//! 500 ([`problem_type::INTERNAL`], code `internal`): the server failed; the request may or may not
//! have been applied. Retry with the same key to get its outcome.
//!
//! ## Too large
//!
//! 413 ([`problem_type::TOO_LARGE`], code `too-large`): the body of an idempotent request is over
//! the limit ([`HandleOptions::max_body`], 1 MiB by default).
//!
//! ## Invalid body
//!
//! 400 ([`problem_type::INVALID_BODY`], code `invalid-body`): the body of an idempotent request
//! could not be read to the end (the layers: tower, actix); send it again.
//!
//! ## Unavailable
//!
//! 503 ([`problem_type::UNAVAILABLE`], code `unavailable`), with `Retry-After: 1`: the server could
//! not reach its store (the call was made once more first if its outcome was unknown), or a layer
//! (tower, actix) is overloaded and did not take the request. Retry with the same key to get the
//! outcome.
//!
//! ## Response not stored
//!
//! 500 ([`problem_type::NOT_STORED`], code `response-not-stored`), stored under the key and
//! replayed to every retry: the request was carried out, but its answer could not be stored
//! (larger than the store's `max_response_bytes` behind [`handle`], or its body failed while
//! it was read or streamed). It is not carried out again for this key; the server's operator
//! can tell its outcome. (The layers stream an answer too large to store to its client and
//! store [Completed, not stored](#completed-not-stored) instead.)
//!
//! ## Completed, not stored
//!
//! 410 ([`problem_type::COMPLETED_NOT_STORED`], code `completed-not-stored`), stored under the
//! key and replayed to every retry (the layers: tower, actix): the request was carried out
//! and its answer was streamed to the client that made it, but the answer was larger than the
//! store's `max_response_bytes`, so it cannot be replayed; the `detail` names the status the
//! handler answered. Do not send the request again, under this key or a new one: it was done.
//! Gone, not a 5xx, because a 5xx reads as "try again" and a retry under a new key would
//! carry the request out a second time; nor 409 or 429, which retrying clients repeat.
//!
//! ## Outcome unknown
//!
//! 500 ([`problem_type::OUTCOME_UNKNOWN`], code `outcome-unknown`), stored under the key and
//! replayed to every retry, only with [`Takeover::AnswerUnknown`]: an earlier attempt of this
//! request died before it settled (its server crashed, or its lease lapsed), and the handler cannot
//! reconcile an attempt that may have half happened, so it is not run again for this key. The
//! server's operator can tell its outcome.
//!
//! # Conversion failures
//!
//! [`Response`] holds any status and any header bytes, `http` does not: converting to
//! `http` fails with the small [`InvalidResponse`] error, not with an [`Error`]. A stored
//! response that `http` rejects is not damage (the record passed its checksum; the application
//! stored it that way), so [`Error::Corrupted`], which sends an operator to the backups, would
//! be the wrong answer. Convert a response with [`to_http`] *before* storing it, and a replay
//! can never fail this way.
//!
//! [`Error`]: crate::error::Error
//! [`Error::Corrupted`]: crate::error::Error::Corrupted
//! [`Error::QuotaExceeded`]: crate::error::Error::QuotaExceeded
//! [`Error::Storage`]: crate::error::Error::Storage
//! [`Response`]: crate::api::response::Response

#[cfg(feature = "actix")]
#[cfg_attr(docsrs, doc(cfg(feature = "actix")))]
pub mod actix;
#[cfg(any(feature = "tower", feature = "actix"))]
mod admission;
mod canonical_json;
#[cfg(any(feature = "tower", feature = "actix"))]
mod drain;
mod flow;
mod handle;
mod heartbeat;
mod key;
mod options;
mod policy;
mod prefer;
mod problem;
mod response;
mod retry_after;
#[cfg(any(feature = "tower", feature = "actix"))]
mod runner;
#[cfg(any(feature = "tower", feature = "actix"))]
mod tee;
#[cfg(test)]
mod testing;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod tower;
mod view;

pub use self::handle::handle;
pub use self::heartbeat::LeaseWatch;
pub use self::key::{IDEMPOTENCY_KEY, KeyError, key_from_headers, parse_key};
pub use self::options::{
    BoxError, CompleteHook, DEFAULT_MAX_BODY, Finality, HandleOptions, NotFinal, Takeover,
    not_final,
};
pub use self::policy::{FingerprintPolicy, STRUCTURED_VERSION};
pub use self::problem::{Problem, QUOTA_RETRY_AFTER_SECS, problem_code, problem_type};
pub use self::response::{
    Decision, IDEMPOTENT_REPLAYED, InvalidResponse, decide, fingerprint, from_http, replay, to_http,
};
pub use self::view::RequestView;
