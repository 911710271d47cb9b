//! [`handle`]: the whole idempotency flow around a synchronous handler, in one call.

use std::time::Instant;

use ::http::{Request, Response};

use super::flow::{self, Decided, Screen};
use super::heartbeat::LeaseWatch;
use super::options::HandleOptions;
use super::prefer;
use super::view::RequestView;
use crate::api::heartbeat;
use crate::api::outcome::Lease;
use crate::api::store::IdempotencyStore;

/// Runs `handler` at most once per idempotency key and answers every retry with its answer.
///
/// ```
/// use idempotency_store::http::{handle, HandleOptions};
/// use idempotency_store::Store;
///
/// let store = Store::builder().open_in_memory()?;
/// let options = HandleOptions::new();
/// let request = || http::Request::post("/payments")
///     .header("Idempotency-Key", "\"order-1\"")
///     .body(br#"{"amount":4999}"#.to_vec());
///
/// let charge = |_lease: Option<&mut _>, _request: &http::Request<Vec<u8>>| {
///     http::Response::builder().status(201).body(b"charged".to_vec()).unwrap_or_default()
/// };
/// assert_eq!(handle(&store, request()?, &options, charge).status(), 201);
/// let retry = handle(&store, request()?, &options, charge); // replayed, not charged again
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// # The flow
///
/// 1. A method not in [`methods`](HandleOptions::methods) (default `POST`, `PATCH`), or a
///    request without `Idempotency-Key` when the key is not
///    [required](HandleOptions::key_required), goes to the handler with `None` for the lease
///    and touches no store.
/// 2. A body over [`max_body`](HandleOptions::max_body): 413. A missing key (when required),
///    a malformed one, or one that is not 1 to 255 printable ASCII characters (a non-ASCII or
///    control character included): 400. All problems are `application/problem+json`.
/// 3. The key (within the [scope](HandleOptions::scope)) is claimed with the request's
///    [fingerprint](HandleOptions::fingerprint), waiting up to
///    [`wait`](HandleOptions::wait) for an attempt in flight. A completed key replays its
///    stored answer with `Idempotent-Replayed: true`; a key in flight gets 409 with
///    `Retry-After`; a key used for another request gets 422; a full store 503.
/// 4. Otherwise the handler runs with the lease, and the request carries a [`LeaseWatch`] in
///    its extensions. Its answer is then final or releases the key (see below).
///
/// # What is final
///
/// By default every answer the handler returns is final: stored and replayed to every retry,
/// errors included (the IETF draft's and Stripe's rule). A response marked with
/// [`NotFinal`](super::NotFinal) (see [`not_final`](super::not_final)), or one that the
/// [`finality`](HandleOptions::finality) rule releases, is sent to the client but not stored:
/// the key is released and the next retry runs the handler afresh.
///
/// # Retry-After
///
/// A 409's `Retry-After` is the expected duration of a run of the route (method and path):
/// the moving average of the durations this options value has measured for it (or the
/// [`expected_duration`](HandleOptions::expected_duration) given, or 1 s before either
/// exists), never more than the time left on the holder's lease, and at least 1 second. It
/// does not subtract how long the attempt in flight has already run, which may be on another
/// instance.
///
/// # Heartbeat
///
/// With [`heartbeat`](HandleOptions::heartbeat) on (the default), a thread extends the lease
/// every third of the lease while the handler runs, so a slow handler is never taken over
/// while it is alive; the thread stops when the handler returns or panics. If a heartbeat
/// finds the lease taken over (a pause longer than the lease, say), [`LeaseWatch::is_lost`]
/// turns `true`, the handler's answer is not stored (fencing), and the client gets 409 with
/// `Retry-After: 1`: the retry gets the answer of the attempt that took over.
///
/// # Waiting, and what a waiter holds
///
/// A duplicate that may [`wait`](HandleOptions::wait) for the attempt in flight waits in
/// `claim_wait` on the calling thread: with a server of N threads, N duplicates waiting on a
/// key leave none for other requests until they are answered (at most `wait` later). The
/// holder is never starved: its handler already has its thread, and its heartbeat runs on a
/// thread of its own. Keep `wait` short (the default is 500 ms; zero answers 409 at once) on
/// a server with a small pool; the layers (tower, actix) wait without a thread. A client may
/// ask for another bound with `Prefer: wait=N` (capped by [`max_wait`](HandleOptions::max_wait)).
///
/// # When the client goes away
///
/// The handler keeps its thread whatever the connection does: a client that times out or
/// hangs up does not stop it, its answer is stored, and the client's retry gets it (at once,
/// or after waiting for it up to the wait bound).
///
/// # An answer that cannot be stored
///
/// The handler ran, so its key must never run it again: an answer larger than the store's
/// `max_response_bytes` is replaced by a stored 500 problem
/// ([`problem_type::NOT_STORED`](super::problem_type::NOT_STORED),
/// [`Response::not_stored`](crate::Response::not_stored)) that the client gets and every
/// retry replays; a warning goes to `tracing` and the error to
/// [`on_error`](HandleOptions::on_error).
///
/// # Store errors
///
/// The claim carries a fresh [`ClaimId`](crate::ClaimId); a claim, completion or release
/// that fails with its outcome unknown is made once more (same claim id, same lease). A
/// storage error that remains is answered 503 with `Retry-After: 1`.
///
/// # Panics
///
/// A panic in the handler propagates out of `handle` after the heartbeat thread stopped. The
/// key is neither completed nor released: it stays in progress until its lease lapses, and
/// then a retry takes it over (attempt 2, with any checkpoint). Running a half-done payment
/// again at once is the wrong default.
///
/// # Errors
///
/// None are returned: a store error becomes its problem answer ([`Problem::from_error`](super::Problem::from_error),
/// after [`on_error`](HandleOptions::on_error)). If completing fails with a lost lease the
/// client gets 409; if a [`complete_with`](HandleOptions::complete_with) hook's own write
/// fails, the key is released and the client gets 500.
pub fn handle<S, B, H>(
    store: &S,
    mut request: Request<B>,
    options: &HandleOptions,
    handler: H,
) -> Response<Vec<u8>>
where
    S: IdempotencyStore + ?Sized,
    B: AsRef<[u8]>,
    H: FnOnce(Option<&mut Lease>, &Request<B>) -> Response<Vec<u8>>,
{
    if let Screen::Pass = flow::screen(options, request.method(), request.headers()) {
        return handler(None, &request);
    }
    let wait = prefer::wait(options, request.headers());
    let key = request.headers().get(super::IDEMPOTENCY_KEY).cloned();
    let finish = |answer| flow::finish(options, key.as_ref(), wait.applied.clone(), answer);
    let ticket = match flow::ticket(options, &RequestView::of(&request)) {
        Ok(ticket) => ticket,
        Err(answer) => return finish(*answer),
    };
    let claim = flow::claim(store, &ticket, wait.bound);
    let mut lease = match flow::decide(store, options, &ticket, claim, None) {
        Decided::Run(lease) => lease,
        Decided::Answer(answer) => return finish(answer),
    };
    let watch = LeaseWatch::new(&lease);
    request.extensions_mut().insert(watch.clone());
    let period = flow::heartbeat_period(store, options, &lease);
    let started = Instant::now();
    let response = match period {
        Some(period) => heartbeat::run_beating(
            &|twin| store.heartbeat(twin),
            lease.twin(),
            period,
            &|| watch.mark_lost(),
            || handler(Some(&mut lease), &request),
        ),
        None => handler(Some(&mut lease), &request),
    };
    let answer = flow::settle(store, options, &ticket, &lease, response, started);
    flow::finish(options, key.as_ref(), wait.applied, answer)
}
