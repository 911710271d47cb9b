//! The options of [`handle`](super::handle) and of the layers (tower and actix), with their
//! defaults.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ::http::{Extensions, Method, StatusCode};

use super::Problem;
use super::policy::FingerprintPolicy;
use super::retry_after::Durations;
use super::view::RequestView;
use crate::api::outcome::Lease;
use crate::api::response::Response;

/// A boxed error of a completion hook or of a response body.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Marks a handler's response as not final: the client gets it, nothing is stored, and the key
/// is released so that the retry runs afresh. Insert it into the response's extensions
/// (`response.extensions_mut().insert(NotFinal)`) or use [`not_final`]. Use it for answers that
/// changed nothing, for example a validation error the client will fix, or a dependency that
/// was unreachable before any side effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NotFinal;

/// `response`, marked with [`NotFinal`]: given to the client, not stored, the key released.
#[must_use]
pub fn not_final<B>(mut response: ::http::Response<B>) -> ::http::Response<B> {
    response.extensions_mut().insert(NotFinal);
    response
}

/// Which handler answers are final (stored and replayed) and which release the key.
///
/// A response marked with [`NotFinal`] always releases the key; the rule decides for the others.
#[derive(Clone, Default)]
pub enum Finality {
    /// Every answer the handler returned is the answer, errors included (the IETF draft's
    /// and Stripe's rule). The default.
    #[default]
    Everything,
    /// 5xx answers release the key (the handler failed, the retry runs again); everything else
    /// is final. For handlers whose 5xx answers never follow a side effect.
    ReleaseServerErrors,
    /// Your rule: `true` releases.
    Custom(Arc<dyn Fn(StatusCode) -> bool + Send + Sync>),
}

impl Finality {
    pub(crate) fn releases(&self, status: StatusCode) -> bool {
        match self {
            Finality::Everything => false,
            Finality::ReleaseServerErrors => status.is_server_error(),
            Finality::Custom(f) => f(status),
        }
    }
}

impl fmt::Debug for Finality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Finality::Everything => f.write_str("Everything"),
            Finality::ReleaseServerErrors => f.write_str("ReleaseServerErrors"),
            Finality::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

/// Stores a final answer in place of [`IdempotencyStore::complete`](crate::IdempotencyStore::complete),
/// for example with [`Store::complete_with`](crate::Store::complete_with) to write the
/// application's own rows in the same transaction. It gets the lease, the response to store
/// and the handler's response extensions (where the handler can leave what the hook writes).
///
/// Return what `complete_with` returns: `Err` for a store error (mapped as by
/// [`Problem::from_error`](super::Problem::from_error)); `Ok(Err(_))` when your own write
/// failed and nothing was stored: the key is then released and the client gets a 500.
pub type CompleteHook = Arc<
    dyn Fn(&Lease, Response, &Extensions) -> crate::error::Result<Result<(), BoxError>>
        + Send
        + Sync,
>;

/// What a request does when it takes over a key whose earlier attempt died before it
/// settled (its process crashed, or its lease lapsed): the claim then says
/// [`LeaseWatch::attempt`](super::LeaseWatch::attempt) > 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Takeover {
    /// Run the handler again, with `attempt > 1` and the last checkpoint in its
    /// [`LeaseWatch`](super::LeaseWatch), so that it can look up what the dead attempt did
    /// (for example ask the card network about the payment id it checkpointed). The default.
    #[default]
    Rerun,
    /// Never run the handler a second time for a key: store and replay a 500 whose problem
    /// type is [`OUTCOME_UNKNOWN`](super::problem_type::OUTCOME_UNKNOWN), for handlers that
    /// cannot reconcile an attempt that may have half happened.
    AnswerUnknown,
}

/// Renders the layer's own error answers; see [`HandleOptions::render_problem`].
type RenderFn = Arc<dyn Fn(&Problem) -> ::http::Response<Vec<u8>> + Send + Sync>;

type ScopeFn = Arc<dyn Fn(&RequestView<'_>) -> Option<String> + Send + Sync>;
type ErrorFn = Arc<dyn Fn(&(dyn std::error::Error + 'static)) + Send + Sync>;

/// How [`handle`](super::handle), the tower layer and the actix middleware treat requests.
/// Built with chained calls from [`HandleOptions::new`]; cheap to clone (a layer clones it per
/// request).
///
/// | option | default |
/// |---|---|
/// | [`methods`](HandleOptions::methods) covered (others pass through untouched) | `POST`, `PATCH` |
/// | [`key_required`](HandleOptions::key_required) | `true`: 400 without a key (`false`: pass through) |
/// | [`scope`](HandleOptions::scope) | none (keys are global) |
/// | [`fingerprint`](HandleOptions::fingerprint) | [`FingerprintPolicy::raw`] |
/// | [`previous_fingerprint`](HandleOptions::previous_fingerprint) | none |
/// | [`wait`](HandleOptions::wait) for the attempt in flight | 500 ms, then 409 |
/// | [`max_wait`](HandleOptions::max_wait): the cap on a client's `Prefer: wait=N` | 10 s |
/// | [`takeover`](HandleOptions::takeover) of a crashed attempt | [`Takeover::Rerun`] |
/// | [`echo_key`](HandleOptions::echo_key) | `true`: every answer repeats the request's `Idempotency-Key` |
/// | [`render_problem`](HandleOptions::render_problem) | problem+json ([`Problem::to_http`]) |
/// | [`finality`](HandleOptions::finality) | [`Finality::Everything`] |
/// | [`max_body`](HandleOptions::max_body) | 1 MiB, 413 beyond |
/// | [`expected_duration`](HandleOptions::expected_duration) for `Retry-After` | none: measured per route |
/// | [`heartbeat`](HandleOptions::heartbeat) | on, every third of the lease |
/// | [`ttl`](HandleOptions::ttl): how long a completed answer replays | the store's `retention` |
/// | [`complete_with`](HandleOptions::complete_with) | [`IdempotencyStore::complete`](crate::IdempotencyStore::complete) |
/// | [`on_error`](HandleOptions::on_error): the errors behind a 500, for logging | none |
#[derive(Clone)]
pub struct HandleOptions {
    pub(crate) methods: Vec<Method>,
    pub(crate) key_required: bool,
    pub(crate) scope: Option<ScopeFn>,
    pub(crate) fingerprint: FingerprintPolicy,
    pub(crate) previous_fingerprint: Option<FingerprintPolicy>,
    pub(crate) wait: Duration,
    pub(crate) max_wait: Duration,
    pub(crate) takeover: Takeover,
    pub(crate) echo_key: bool,
    pub(crate) render: Option<RenderFn>,
    pub(crate) finality: Finality,
    pub(crate) max_body: usize,
    pub(crate) durations: Arc<Durations>,
    pub(crate) heartbeat: bool,
    pub(crate) ttl: Option<Duration>,
    pub(crate) complete: Option<CompleteHook>,
    pub(crate) on_error: Option<ErrorFn>,
}

/// The default [`HandleOptions::max_body`]: 1 MiB.
pub const DEFAULT_MAX_BODY: usize = 1 << 20;

/// The default [`HandleOptions::wait`]: half the shortest client timeout in common use (1 s),
/// so that a waiting retry is answered (the replay, or 409) before its client gives up on it,
/// while a retry that comes in shortly before the first attempt finishes gets the answer
/// instead of a 409.
pub(crate) const DEFAULT_WAIT: Duration = Duration::from_millis(500);

/// The default [`HandleOptions::max_wait`]: a client may ask to wait up to 10 s.
pub(crate) const DEFAULT_MAX_WAIT: Duration = Duration::from_secs(10);

impl Default for HandleOptions {
    fn default() -> Self {
        HandleOptions {
            methods: vec![Method::POST, Method::PATCH],
            key_required: true,
            scope: None,
            fingerprint: FingerprintPolicy::raw(),
            previous_fingerprint: None,
            wait: DEFAULT_WAIT,
            max_wait: DEFAULT_MAX_WAIT,
            takeover: Takeover::Rerun,
            echo_key: true,
            render: None,
            finality: Finality::Everything,
            max_body: DEFAULT_MAX_BODY,
            durations: Arc::new(Durations::default()),
            heartbeat: true,
            ttl: None,
            complete: None,
            on_error: None,
        }
    }
}

impl fmt::Debug for HandleOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HandleOptions")
            .field("methods", &self.methods)
            .field("key_required", &self.key_required)
            .field("scope", &self.scope.is_some())
            .field("fingerprint", &self.fingerprint)
            .field("previous_fingerprint", &self.previous_fingerprint)
            .field("wait", &self.wait)
            .field("max_wait", &self.max_wait)
            .field("takeover", &self.takeover)
            .field("echo_key", &self.echo_key)
            .field("render_problem", &self.render.is_some())
            .field("finality", &self.finality)
            .field("max_body", &self.max_body)
            .field("heartbeat", &self.heartbeat)
            .field("ttl", &self.ttl)
            .field("complete_with", &self.complete.is_some())
            .finish_non_exhaustive()
    }
}

impl HandleOptions {
    /// The defaults (see the table above).
    #[must_use]
    pub fn new() -> Self {
        HandleOptions::default()
    }

    /// How long this route's completed answers replay (default: the store's
    /// [`retention`](crate::Settings::retention)): a payment's retry window may be a day and a
    /// webhook's delivery window a week, on one store. Keys stay one namespace: the same key
    /// on two routes with a different request is still a 422, whatever each route's TTL. The
    /// TTL counts from the completion, as the store's retention does; it applies to what the
    /// layer stores for the route (the handler's answer, or the substitute stored in its
    /// place), while a record in progress or released expires as the store's setting says.
    /// At least 1 ms (see [`Lease::keep_for`], which the layer calls on each lease it runs).
    #[must_use]
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// The methods that need a key; requests with other methods pass through to the handler
    /// without touching the store.
    #[must_use]
    pub fn methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// `true` (default): a covered request without `Idempotency-Key` gets 400. `false`: it
    /// passes through to the handler, unprotected.
    #[must_use]
    pub fn key_required(mut self, required: bool) -> Self {
        self.key_required = required;
        self
    }

    /// The scope of the request's key (the IETF draft's composite key), for example the
    /// authenticated client, so that two clients never share records. `None` leaves the key
    /// unscoped. A scope that is not a valid [`Key`](crate::Key) gets a 500 (a server bug).
    #[must_use]
    pub fn scope(
        mut self,
        scope: impl Fn(&RequestView<'_>) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.scope = Some(Arc::new(scope));
        self
    }

    /// How requests are compared; see [`FingerprintPolicy`].
    #[must_use]
    pub fn fingerprint(mut self, policy: FingerprintPolicy) -> Self {
        self.fingerprint = policy;
        self
    }

    /// The policy used before the current one: records stored under it keep replaying (see
    /// [`FingerprintPolicy`], "Changing the policy of a running service").
    #[must_use]
    pub fn previous_fingerprint(mut self, policy: FingerprintPolicy) -> Self {
        self.previous_fingerprint = Some(policy);
        self
    }

    /// How long a duplicate waits for the attempt in flight before it gets 409, when the
    /// client did not say (default 500 ms, half the shortest client timeout in common use, 1 s,
    /// so that the waiting retry is answered before its client gives up on it; zero: 409 at
    /// once). It gets the answer as soon as the attempt settles. The layers (tower, actix) wait
    /// without a thread; the sync [`handle`](super::handle) holds its thread meanwhile (with
    /// `claim_wait`).
    #[must_use]
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The longest wait a client may ask for with `Prefer: wait=N` (RFC 7240; default
    /// 10 s). A client's preference, shorter or longer than
    /// [`wait`](HandleOptions::wait), replaces it up to this cap, and the answer says what
    /// was applied in `Preference-Applied: wait=N`.
    #[must_use]
    pub fn max_wait(mut self, cap: Duration) -> Self {
        self.max_wait = cap;
        self
    }

    /// What to do when a request takes over the key of an attempt that died before it
    /// settled; see [`Takeover`].
    #[must_use]
    pub fn takeover(mut self, takeover: Takeover) -> Self {
        self.takeover = takeover;
        self
    }

    /// `true` (default): every answer to a covered request that carried an `Idempotency-Key`
    /// repeats it as sent, as clients such as Stripe's SDKs read it back.
    #[must_use]
    pub fn echo_key(mut self, on: bool) -> Self {
        self.echo_key = on;
        self
    }

    /// Renders the layer's own error answers (400, 409, 413, 422, 500, 503, and the 500 stored
    /// in place of an answer that cannot be kept) in the application's format instead of
    /// problem+json. The function gets the [`Problem`] (status, type, title, detail,
    /// `retry_after`, and its [`code`](Problem::code) to match on) and returns the whole
    /// answer; the layer adds `Retry-After` and `Cache-Control: no-store` if the function did
    /// not, and `Idempotency-Key` (see [`echo_key`](HandleOptions::echo_key)).
    #[must_use]
    pub fn render_problem(
        mut self,
        render: impl Fn(&Problem) -> ::http::Response<Vec<u8>> + Send + Sync + 'static,
    ) -> Self {
        self.render = Some(Arc::new(render));
        self
    }

    /// Which answers are final; see [`Finality`].
    #[must_use]
    pub fn finality(mut self, finality: Finality) -> Self {
        self.finality = finality;
        self
    }

    /// The largest body a covered request may have; larger ones get 413 before the store is
    /// touched. The layers (tower, actix) buffer at most this much.
    #[must_use]
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// How long a run usually takes, for the 409's `Retry-After` until this process has
    /// measured the route itself (see [`handle`](super::handle), "Retry-After").
    #[must_use]
    pub fn expected_duration(mut self, duration: Duration) -> Self {
        self.durations = Arc::new(Durations::with_prior(duration));
        self
    }

    /// `true` (default): while a handler runs, its lease is extended every third of the lease,
    /// so a slow handler is not taken over while it is alive (see [`handle`](super::handle),
    /// "Heartbeat").
    #[must_use]
    pub fn heartbeat(mut self, on: bool) -> Self {
        self.heartbeat = on;
        self
    }

    /// Stores final answers with `hook` instead of `complete`; see [`CompleteHook`].
    #[must_use]
    pub fn complete_with(
        mut self,
        hook: impl Fn(&Lease, Response, &Extensions) -> crate::error::Result<Result<(), BoxError>>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.complete = Some(Arc::new(hook));
        self
    }

    /// Called with every error that turned into a 500 or a 409 after a lost lease (a store
    /// error, a failed completion hook, a stored response `http` cannot send), for logging.
    #[must_use]
    pub fn on_error(
        mut self,
        log: impl Fn(&(dyn std::error::Error + 'static)) + Send + Sync + 'static,
    ) -> Self {
        self.on_error = Some(Arc::new(log));
        self
    }

    /// `problem` as an answer: the application's rendering, or problem+json. Either way
    /// `Cache-Control: no-store`, unless the rendering set its own: a shared cache must not
    /// keep a 409 or a 503 that holds for this moment only (nor a 4xx that a fixed request
    /// would not get).
    pub(crate) fn answer(&self, problem: &Problem) -> ::http::Response<Vec<u8>> {
        let mut answer = match &self.render {
            Some(render) => render(problem),
            None => problem.to_http(),
        };
        let headers = answer.headers_mut();
        if let Some(seconds) = problem.retry_after {
            headers
                .entry(::http::header::RETRY_AFTER)
                .or_insert_with(|| ::http::HeaderValue::from(seconds));
        }
        headers
            .entry(::http::header::CACHE_CONTROL)
            .or_insert_with(|| ::http::HeaderValue::from_static("no-store"));
        answer
    }

    pub(crate) fn covers(&self, method: &Method) -> bool {
        self.methods.contains(method)
    }

    pub(crate) fn report(&self, err: &(dyn std::error::Error + 'static)) {
        if let Some(log) = &self.on_error {
            log(err);
        }
    }
}
