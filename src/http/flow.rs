//! The steps of one covered request, shared by the sync [`handle`](super::handle) and the
//! async adapters (the tower layer, the actix middleware): each store call is its own step so
//! that an adapter can run it on the blocking pool, or await it where the store offers an
//! `AsyncStore` (the claim and the settling call have async twins here, which share every
//! decision with the blocking ones).

use std::time::{Duration, Instant};

use ::http::{HeaderMap, HeaderValue, Method, StatusCode};

use super::options::{BoxError, HandleOptions, NotFinal, Takeover};
use super::prefer::PREFERENCE_APPLIED;
use super::view::RequestView;
use super::{
    IDEMPOTENCY_KEY, KeyError, Problem, from_http, key_from_headers, problem_type, replay, to_http,
};
use crate::api::clock::Clock;
use crate::api::clock::SystemClock;
use crate::api::clock::Timestamp;
use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
#[cfg(any(feature = "tower", feature = "actix"))]
use crate::api::nonblocking::{AsyncStore, Blocking};
use crate::api::outcome::{Claim, ClaimId, Lease};
use crate::api::response::Response;
use crate::api::store::IdempotencyStore;
use crate::api::store::once_more;
use crate::error::Error;

type Answer = ::http::Response<Vec<u8>>;

/// What the request needs after its headers were read.
pub(crate) enum Screen {
    /// Not covered (method, or no key where none is required): straight to the handler.
    Pass,
    /// Covered: read the body, then make a [`Ticket`].
    Covered,
}

/// A covered request, ready to claim.
pub(crate) struct Ticket {
    pub(crate) key: Key,
    pub(crate) fingerprint: Fingerprint,
    previous: Option<Fingerprint>,
    pub(crate) route: String,
    /// This request's claim id: its claim, retried after an error whose outcome is unknown,
    /// gets its own lease back instead of "in progress" for a whole lease.
    id: ClaimId,
}

/// After the claim: run the handler, or send this answer.
pub(crate) enum Decided {
    Run(Lease),
    Answer(Answer),
}

pub(crate) fn screen(options: &HandleOptions, method: &Method, headers: &HeaderMap) -> Screen {
    if !options.covers(method) || (!options.key_required && !headers.contains_key(IDEMPOTENCY_KEY))
    {
        Screen::Pass
    } else {
        Screen::Covered
    }
}

/// 413 for a body over the limit.
pub(crate) fn too_large(options: &HandleOptions, max: usize) -> Answer {
    options.answer(&Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        problem_type::TOO_LARGE,
        "Request body too large",
        format!("The body of an idempotent request may have at most {max} bytes."),
    ))
}

/// Adds what every answer to a covered request carries: the request's `Idempotency-Key` as
/// sent (see [`HandleOptions::echo_key`]) and the `Preference-Applied` of its wait.
/// `key` is the request's `Idempotency-Key` header, if it has one (only that header is
/// needed, so an adapter need not keep the request's whole header map).
pub(crate) fn finish<B>(
    options: &HandleOptions,
    key: Option<&HeaderValue>,
    applied: Option<HeaderValue>,
    mut answer: ::http::Response<B>,
) -> ::http::Response<B> {
    let headers = answer.headers_mut();
    if options.echo_key
        && let Some(key) = key
    {
        headers.insert(IDEMPOTENCY_KEY, key.clone());
    }
    if let Some(applied) = applied {
        headers.insert(PREFERENCE_APPLIED, applied);
    }
    answer
}

/// The key (400 if it is missing or malformed, 500 for a bad scope) and the fingerprints.
pub(crate) fn ticket(
    options: &HandleOptions,
    request: &RequestView<'_>,
) -> Result<Ticket, Box<Answer>> {
    if request.body.len() > options.max_body {
        return Err(Box::new(too_large(options, options.max_body)));
    }
    let scope = options.scope.as_ref().and_then(|scope| scope(request));
    let key = key_from_headers(request.headers, scope.as_deref()).map_err(|err| {
        if let KeyError::InvalidScope { .. } = err {
            options.report(&err);
        }
        Box::new(options.answer(&err.problem()))
    })?;
    Ok(Ticket {
        key,
        fingerprint: options.fingerprint.fingerprint(request),
        previous: options
            .previous_fingerprint
            .as_ref()
            .map(|policy| policy.fingerprint(request)),
        route: format!("{} {}", request.method, request.uri.path()),
        id: ClaimId::random(),
    })
}

/// Claims without waiting, with the ticket's claim id, once more after an error whose
/// outcome is unknown; a record stored under the previous policy is claimed with the previous
/// fingerprint. Blocks.
pub(crate) fn claim_now<S: IdempotencyStore + ?Sized>(
    store: &S,
    ticket: &Ticket,
) -> crate::error::Result<Claim> {
    let attempt =
        |fingerprint| once_more(|| store.claim_with_id(&ticket.key, fingerprint, ticket.id));
    with_previous(ticket, attempt)
}

/// The sync flow's claim: [`claim_now`], then, for a key in flight, `claim_wait` up to
/// `wait`, which holds the calling thread while it waits. Blocks.
pub(crate) fn claim<S: IdempotencyStore + ?Sized>(
    store: &S,
    ticket: &Ticket,
    wait: Duration,
) -> crate::error::Result<Claim> {
    let claim = claim_now(store, ticket)?;
    if wait.is_zero() || !matches!(claim, Claim::InProgress { .. }) {
        return Ok(claim);
    }
    with_previous(ticket, |fingerprint| {
        once_more(|| store.claim_wait(&ticket.key, fingerprint, wait))
    })
}

/// [`claim_now`] through the store's [`AsyncStore`]: awaited, holding no thread.
#[cfg(any(feature = "tower", feature = "actix"))]
pub(crate) async fn claim_now_async(
    store: &dyn AsyncStore,
    ticket: &Ticket,
    blocking: &Blocking,
) -> crate::error::Result<Claim> {
    let attempt = |fingerprint| {
        once_more_async(move || store.claim_with_id(&ticket.key, fingerprint, ticket.id, blocking))
    };
    let claim = attempt(ticket.fingerprint).await?;
    match ticket.previous_to_try(&claim) {
        Some(previous) => attempt(previous).await,
        None => Ok(claim),
    }
}

/// Awaits `call()`, and once more if it failed with its outcome unknown: the async twin of
/// `once_more`.
#[cfg(any(feature = "tower", feature = "actix"))]
async fn once_more_async<T, F>(mut call: impl FnMut() -> F) -> crate::error::Result<T>
where
    F: Future<Output = crate::error::Result<T>>,
{
    match call().await {
        Err(err) if Error::outcome_unknown(&err) => call().await,
        other => other,
    }
}

/// `attempt` with the ticket's fingerprint, and again with the previous policy's if the
/// record was stored under that one.
fn with_previous(
    ticket: &Ticket,
    attempt: impl Fn(Fingerprint) -> crate::error::Result<Claim>,
) -> crate::error::Result<Claim> {
    let claim = attempt(ticket.fingerprint)?;
    match ticket.previous_to_try(&claim) {
        Some(previous) => attempt(previous),
        None => Ok(claim),
    }
}

impl Ticket {
    /// The previous policy's fingerprint, if `claim` found the record stored under it.
    fn previous_to_try(&self, claim: &Claim) -> Option<Fingerprint> {
        match claim {
            Claim::Mismatch { stored } if Some(*stored) == self.previous => Some(*stored),
            _ => None,
        }
    }
}

/// The replay answer, if the store can give it from memory without blocking
/// ([`IdempotencyStore::cached_replay`]).
#[cfg_attr(not(any(feature = "tower", feature = "actix")), allow(dead_code))]
pub(crate) fn cached_replay<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    ticket: &Ticket,
) -> Option<Answer> {
    let replay = store.cached_replay(&ticket.key, ticket.fingerprint)?;
    match decide(store, options, ticket, Ok(Claim::Completed(replay)), None) {
        Decided::Answer(answer) => Some(answer),
        Decided::Run(_) => None,
    }
}

/// Whether [`decide`] writes for `claim`: a takeover under [`Takeover::AnswerUnknown`]
/// stores its answer. (Otherwise it only asks the store's time.)
#[cfg(any(feature = "tower", feature = "actix"))]
pub(crate) fn decide_writes(options: &HandleOptions, claim: &crate::error::Result<Claim>) -> bool {
    matches!(claim, Ok(Claim::Acquired(lease)) if answers_unknown(options, lease))
}

/// Whether `lease` is a takeover that must answer "outcome unknown" instead of running.
fn answers_unknown(options: &HandleOptions, lease: &Lease) -> bool {
    lease.attempt() > 1 && options.takeover == Takeover::AnswerUnknown
}

/// Maps the claim to the handler's run, a replay, 409 or 422; `held_for` is how long the
/// holder of a key in flight has run, where this process knows it. Blocks (for the store's
/// time on a 409, and to store the answer of a takeover that must not run again).
pub(crate) fn decide<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    ticket: &Ticket,
    claim: crate::error::Result<Claim>,
    held_for: Option<Duration>,
) -> Decided {
    let mut claim = match claim {
        Ok(claim) => claim,
        Err(err) => return Decided::Answer(failed(options, &err)),
    };
    if let (Claim::Acquired(lease), Some(ttl)) = (&mut claim, options.ttl) {
        lease.keep_for(ttl);
    }
    Decided::Answer(match claim {
        Claim::Acquired(lease) if answers_unknown(options, &lease) => {
            outcome_unknown(store, options, &lease)
        }
        Claim::Acquired(lease) => return Decided::Run(lease),
        Claim::Completed(stored) => replay(stored.response).unwrap_or_else(|err| {
            options.report(&err);
            options.answer(&Problem::internal())
        }),
        Claim::InProgress { lease_until, .. } => {
            let now = now(store);
            let seconds = options
                .durations
                .retry_after(&ticket.route, lease_until, now, held_for);
            options.answer(&Problem::in_progress(lease_until, now).with_retry_after(seconds))
        }
        Claim::Mismatch { stored } if stored.version() != ticket.fingerprint.version() => {
            let mut problem = Problem::mismatch();
            problem.detail = format!(
                "This Idempotency-Key was stored under fingerprint version {}, and the server \
                 now compares requests with version {}: the server changed how it compares \
                 requests. Use a new key for this request.",
                stored.version(),
                ticket.fingerprint.version()
            );
            options.answer(&problem)
        }
        Claim::Mismatch { .. } => options.answer(&Problem::mismatch()),
    })
}

/// Settles the key of an attempt that was stopped before it finished (a drain at
/// shutdown): released, so that the retry runs afresh, or under
/// [`Takeover::AnswerUnknown`] completed with the "outcome unknown" answer. Blocks.
#[cfg_attr(not(any(feature = "tower", feature = "actix")), allow(dead_code))] // the layers' drain
pub(crate) fn abandon<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    lease: &Lease,
) -> crate::error::Result<()> {
    if options.takeover == Takeover::AnswerUnknown {
        let stored = from_http(options.answer(&Problem::outcome_unknown(lease.attempt())));
        return once_more(|| store.complete(lease, stored.clone()));
    }
    once_more(|| store.release(lease))
}

/// A takeover under [`Takeover::AnswerUnknown`]: the earlier attempt may have half
/// happened, so this one stores and replays an "outcome unknown" 500 instead of running.
fn outcome_unknown<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    lease: &Lease,
) -> Answer {
    let problem = Problem::outcome_unknown(lease.attempt() - 1);
    store_answer(store, options, lease, &problem, &::http::Extensions::new())
}

/// The store's time, or the system's if the store cannot tell.
pub(crate) fn now<S: IdempotencyStore + ?Sized>(store: &S) -> Timestamp {
    store.now().unwrap_or_else(|_| SystemClock.now())
}

/// How often to heartbeat a fresh lease, or `None` when the options turn it off. Blocks.
pub(crate) fn heartbeat_period<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    lease: &Lease,
) -> Option<Duration> {
    options
        .heartbeat
        .then(|| crate::api::heartbeat::period(lease, now(store)))
}

/// Stores or releases what the handler returned and gives the client's answer. A settling
/// call whose outcome is unknown is made once more with the same lease. Blocks.
pub(crate) fn settle<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    ticket: &Ticket,
    lease: &Lease,
    response: Answer,
    started: Instant,
) -> Answer {
    Settling::new(options, ticket, response, started).finish(store, options, lease)
}

/// What the handler returned, on its way to the store: the settling call, then the answer
/// ([`answer`](Settling::answer)), with a [`FollowUp`] call in the rare cases that need one.
pub(crate) enum Settling {
    /// Not final: the key is released, and the client gets the handler's answer.
    Release(Answer),
    /// Final: `stored` is completed, and the client gets `parts` and `body` with the
    /// handler's `extensions`.
    Complete {
        parts: ::http::response::Parts,
        body: Vec<u8>,
        extensions: ::http::Extensions,
    },
}

/// A settling call's result; a completion hook's own error inside.
pub(crate) type Settled = crate::error::Result<Result<(), BoxError>>;

/// A settling call that did not store the handler's answer and needs one more store call.
pub(crate) enum FollowUp {
    /// The completion hook failed and stored nothing: release the key so that the retry runs
    /// afresh.
    Release,
    /// The answer is too large to store (`why`): store the substitute in its place.
    Substitute {
        why: String,
        extensions: ::http::Extensions,
    },
}

impl Settling {
    /// Records the run's duration and decides what to store.
    pub(crate) fn new(
        options: &HandleOptions,
        ticket: &Ticket,
        response: Answer,
        started: Instant,
    ) -> Settling {
        options.durations.record(&ticket.route, started.elapsed());
        let releases = response.extensions().get::<NotFinal>().is_some()
            || options.finality.releases(response.status());
        if releases {
            return Settling::Release(response);
        }
        let (mut parts, body) = response.into_parts();
        let extensions = std::mem::take(&mut parts.extensions);
        Settling::Complete {
            parts,
            body,
            extensions,
        }
    }

    /// The settling call, the answer and any follow-up. Blocks.
    pub(crate) fn finish<S: IdempotencyStore + ?Sized>(
        self,
        store: &S,
        options: &HandleOptions,
        lease: &Lease,
    ) -> Answer {
        let settled = self.call(store, options, lease);
        self.answer(options, settled)
            .unwrap_or_else(|follow_up| follow_up.run(store, options, lease))
    }

    /// The settling call, once more after an error whose outcome is unknown. Blocks.
    fn call<S: IdempotencyStore + ?Sized>(
        &self,
        store: &S,
        options: &HandleOptions,
        lease: &Lease,
    ) -> Settled {
        match self {
            Settling::Release(_) => once_more(|| store.release(lease)).map(Ok),
            Settling::Complete {
                parts,
                body,
                extensions,
            } => {
                let stored = || super::response::stored_copy(parts, body);
                complete(store, options, lease, stored, extensions)
            }
        }
    }

    /// The settling call through the store's [`AsyncStore`], awaited; `None` if it must block
    /// (a completion through the options' hook, which is the application's sync code).
    #[cfg(any(feature = "tower", feature = "actix"))]
    pub(crate) fn call_async<'a>(
        &'a self,
        store: &'a dyn AsyncStore,
        options: &HandleOptions,
        lease: &'a Lease,
        blocking: &'a Blocking,
    ) -> Option<impl Future<Output = Settled> + Send + 'a> {
        if matches!(self, Settling::Complete { .. }) && options.complete.is_some() {
            return None;
        }
        Some(async move {
            match self {
                Settling::Release(_) => once_more_async(|| store.release(lease, blocking)).await,
                Settling::Complete { parts, body, .. } => {
                    // A copy for each attempt, not one kept beside the answer and cloned.
                    let stored = || super::response::stored_copy(parts, body);
                    once_more_async(|| store.complete(lease, stored(), blocking)).await
                }
            }
            .map(Ok)
        })
    }

    /// The client's answer after the settling call, or the follow-up call it needs first.
    pub(crate) fn answer(
        self,
        options: &HandleOptions,
        settled: Settled,
    ) -> Result<Answer, FollowUp> {
        let (mut parts, body, extensions) = match self {
            Settling::Release(answer) => {
                match settled {
                    Ok(Ok(())) | Err(Error::LeaseLost) => {}
                    Ok(Err(err)) => options.report(&*err),
                    Err(err) => options.report(&err),
                }
                return Ok(answer);
            }
            Settling::Complete {
                parts,
                body,
                extensions,
                ..
            } => (parts, body, extensions),
        };
        match settled {
            Ok(Ok(())) => {
                parts.extensions = extensions;
                Ok(::http::Response::from_parts(parts, body))
            }
            Ok(Err(err)) => {
                options.report(&*err);
                Err(FollowUp::Release)
            }
            Err(err @ Error::ResponseTooLarge { size, limit }) => {
                options.report(&err);
                let why = crate::api::response::too_large(size, limit);
                Err(FollowUp::Substitute { why, extensions })
            }
            Err(err) => Ok(failed(options, &err)),
        }
    }
}

impl FollowUp {
    /// Makes the call and gives the client's answer. Blocks.
    pub(crate) fn run<S: IdempotencyStore + ?Sized>(
        self,
        store: &S,
        options: &HandleOptions,
        lease: &Lease,
    ) -> Answer {
        match self {
            FollowUp::Release => {
                // Nothing was stored: let the retry run afresh.
                if let Err(err) = once_more(|| store.release(lease)) {
                    options.report(&err);
                }
                options.answer(&Problem::internal())
            }
            FollowUp::Substitute { why, extensions } => {
                substitute(store, options, lease, &why, &extensions)
            }
        }
    }
}

/// Stores `response()` as the lease's final answer: through the options' hook if set, once
/// more after an error whose outcome is unknown (each attempt takes its own copy).
fn complete<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    lease: &Lease,
    response: impl Fn() -> Response,
    extensions: &::http::Extensions,
) -> Settled {
    once_more(|| match &options.complete {
        Some(hook) => hook(lease, response(), extensions),
        None => store.complete(lease, response()).map(Ok),
    })
}

/// The handler ran, but its answer cannot be stored (`why`): stores
/// [`Response::not_stored`]'s 500 in its place (through the hook, so that the hook's own
/// writes commit with it), so every retry replays that and the handler never runs again for
/// the key. Warns through `tracing`. Blocks.
pub(crate) fn substitute<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    lease: &Lease,
    why: &str,
    extensions: &::http::Extensions,
) -> Answer {
    crate::api::trace::answer_not_stored(&why);
    if options.render.is_none() {
        let substitute = Response::not_stored_because(why);
        return store_response(store, options, lease, substitute, extensions);
    }
    store_answer(store, options, lease, &Problem::not_stored(why), extensions)
}

/// The handler answered `status` and the layer streamed that answer to its client, but it was
/// larger than the store keeps (`limit` bytes): stores [`Problem::completed_not_stored`]'s 410
/// in its place (through the hook, as [`substitute`] does), so every retry replays that and
/// the handler never runs again for the key. Blocks.
#[cfg(any(feature = "tower", feature = "actix"))]
pub(crate) fn not_kept<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    lease: &Lease,
    status: StatusCode,
    limit: usize,
    extensions: &::http::Extensions,
) -> Answer {
    let problem = Problem::completed_not_stored(status, limit);
    store_answer(store, options, lease, &problem, extensions)
}

/// Stores `problem`, as the options render it, as the lease's final answer. Blocks.
fn store_answer<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    lease: &Lease,
    problem: &Problem,
    extensions: &::http::Extensions,
) -> Answer {
    let stored = from_http(options.answer(problem));
    store_response(store, options, lease, stored, extensions)
}

/// Stores `stored` as the lease's final answer and gives it to the client. Blocks.
fn store_response<S: IdempotencyStore + ?Sized>(
    store: &S,
    options: &HandleOptions,
    lease: &Lease,
    stored: Response,
    extensions: &::http::Extensions,
) -> Answer {
    match complete(store, options, lease, || stored.clone(), extensions) {
        Ok(Ok(())) => to_http(stored).unwrap_or_else(|_| options.answer(&Problem::internal())),
        Ok(Err(err)) => {
            options.report(&*err);
            options.answer(&Problem::internal())
        }
        Err(err) => failed(options, &err),
    }
}

/// The answer for a store error, reported first.
pub(crate) fn failed(options: &HandleOptions, err: &Error) -> Answer {
    options.report(err);
    options.answer(&Problem::from_error(err))
}
