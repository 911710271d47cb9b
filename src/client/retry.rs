//! The retry helper: sends an intent's request until the server gives a final answer, with
//! the same key every time, within bounds that never risk a second execution.

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use crate::api::backoff;
use crate::api::clock::Timestamp;
use crate::api::response::Response;
use crate::api::store::IdempotencyStore;
use crate::client::intent::{Intent, Sent};
use crate::client::outbox::Outbox;
use crate::error::Result;

/// Why a send got no answer; the closure of [`Outbox::send`] returns it.
#[derive(Debug)]
#[non_exhaustive]
pub enum Failure<E> {
    /// The request may have reached the server (a timeout, a connection lost mid-way).
    NoAnswer(E),
    /// Nothing was sent (connection refused, no route, a DNS failure).
    Refused(E),
}

/// What [`Outbox::send`] came to. Every variant but `Answered` leaves the intent open.
#[derive(Debug)]
#[non_exhaustive]
pub enum Delivery<E> {
    /// The server's final answer (any status but the retried ones and 422); the intent is
    /// finished with it.
    Answered(Response),
    /// 422: the server holds this key for a different request, so the caller changed the
    /// request between attempts (or reused the operation id): a bug to fix, not to retry.
    KeyReused(Response),
    /// The policy's attempts or time ran out; the last attempt's result. Send again later:
    /// the key is the same.
    GaveUp {
        /// The last attempt's answer or failure.
        last: std::result::Result<Response, Failure<E>>,
    },
    /// The next send would come later than [`key_lifetime`](RetryPolicy::key_lifetime) after
    /// the intent began: the server may have forgotten the key by then and would run the
    /// operation again. Reconcile instead (ask the server what became of the operation).
    NeedsReconciliation,
}

/// How [`Outbox::send`] retries. Defaults: 8 attempts per call, 2 minutes per call,
/// exponential backoff with full jitter from 250 ms up to 30 s, `Retry-After` honoured, 500
/// final, a key lifetime of 23 hours (for a server that keeps keys 24 hours).
#[derive(Clone)]
pub struct RetryPolicy {
    max_attempts: u32,
    max_elapsed: Duration,
    base: Duration,
    cap: Duration,
    retry_500: bool,
    key_lifetime: Duration,
    sleep: Arc<dyn Fn(Duration) + Send + Sync>,
}

impl std::fmt::Debug for RetryPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryPolicy")
            .field("max_attempts", &self.max_attempts)
            .field("max_elapsed", &self.max_elapsed)
            .field("base", &self.base)
            .field("cap", &self.cap)
            .field("retry_500", &self.retry_500)
            .field("key_lifetime", &self.key_lifetime)
            .finish_non_exhaustive()
    }
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 8,
            max_elapsed: Duration::from_secs(120),
            base: Duration::from_millis(250),
            cap: Duration::from_secs(30),
            retry_500: false,
            key_lifetime: Duration::from_secs(23 * 3600),
            sleep: Arc::new(std::thread::sleep),
        }
    }
}

impl RetryPolicy {
    /// The defaults (see above).
    #[must_use]
    pub fn new() -> Self {
        RetryPolicy::default()
    }

    /// At most this many sends per [`send`](Outbox::send) call (at least 1).
    #[must_use]
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// No send starts later than this after the call began (the store's clock).
    #[must_use]
    pub fn max_elapsed(mut self, elapsed: Duration) -> Self {
        self.max_elapsed = elapsed;
        self
    }

    /// The backoff: attempt n waits a random time below `min(cap, base × 2^(n-1))` (full
    /// jitter), unless the server said `Retry-After`.
    #[must_use]
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.base = base;
        self.cap = cap.max(base);
        self
    }

    /// Whether a 500 is retried (default `false`: final). A server behind this crate's
    /// flow answers 500 only for a final error it stored, so retrying only replays it.
    #[must_use]
    pub fn retry_500(mut self, retry: bool) -> Self {
        self.retry_500 = retry;
        self
    }

    /// How long after [`Intent::begun_at`] a send may still go out: keep it below the
    /// server's retention (the time it keeps a key), with a margin for clock skew and for
    /// how long a send takes.
    #[must_use]
    pub fn key_lifetime(mut self, lifetime: Duration) -> Self {
        self.key_lifetime = lifetime;
        self
    }

    /// How to wait between attempts (default `std::thread::sleep`); tests pass one that
    /// advances a [`ManualClock`](crate::ManualClock).
    #[must_use]
    pub fn sleep(mut self, sleep: impl Fn(Duration) + Send + Sync + 'static) -> Self {
        self.sleep = Arc::new(sleep);
        self
    }

    /// The random backoff before attempt `n + 1`.
    fn jitter(&self, n: u32) -> Duration {
        // Past 32 doublings the factor saturates (a u32) and the ceiling stays where it is.
        let nth = n.saturating_sub(1).min(32) as usize;
        let ceiling = backoff::doubling(self.base, self.cap)
            .nth(nth)
            .unwrap_or(self.cap);
        ceiling.mul_f64(crate::api::random::fraction())
    }
}

/// What the answer's status means for the send loop.
enum Verdict {
    Final,
    KeyReused,
    Retry(Option<Duration>),
}

fn verdict(policy: &RetryPolicy, answer: &Response, now: Timestamp) -> Verdict {
    match answer.status {
        422 => Verdict::KeyReused,
        409 | 429 | 502..=504 => Verdict::Retry(retry_after(answer, now)),
        500 if policy.retry_500 => Verdict::Retry(retry_after(answer, now)),
        _ => Verdict::Final,
    }
}

/// The answer's `Retry-After`, as a delay from `now`: delta-seconds or an HTTP-date (RFC
/// 9110 §10.2.3). `None` if absent or malformed.
pub(crate) fn retry_after(answer: &Response, now: Timestamp) -> Option<Duration> {
    let (_, value) = answer
        .headers
        .iter()
        .find(|(name, _)| name.eq_ignore_ascii_case("retry-after"))?;
    let text = std::str::from_utf8(value).ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return Some(Duration::from_secs(text.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    let now = UNIX_EPOCH + Duration::from_millis(now.as_millis());
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

impl Outbox {
    /// Sends the intent's request with `call(key, attempt)` until the server gives a final
    /// answer, then [`finish`](Outbox::finish)es the intent with it. Every attempt uses the
    /// intent's key and is recorded before it goes out and after ([`start`](Outbox::start),
    /// [`record`](Outbox::record)). Retried with the same key: network failures
    /// ([`Failure`]), 409, 429, 502, 503, 504 (and 500 if the policy says so), after
    /// `Retry-After` when the server gives one, else after the policy's backoff. Any other
    /// answer is final; 422 is [`Delivery::KeyReused`].
    ///
    /// It never sends later than the policy's [`key_lifetime`](RetryPolicy::key_lifetime)
    /// after the intent began ([`Delivery::NeedsReconciliation`]), and gives up after the
    /// policy's attempts or time ([`Delivery::GaveUp`]): both leave the intent open.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use idempotency_store::client::{Delivery, Failure, Outbox, RetryPolicy};
    /// use idempotency_store::{Claim, Fingerprint, Response, Store};
    ///
    /// let outbox = Outbox::new(Arc::new(Store::builder().open_in_memory()?));
    /// let Claim::Acquired(mut intent) = outbox.begin("order-42", Fingerprint::of(["4999"]))? else {
    ///     return Ok(()); // finished before: nothing to send
    /// };
    /// let policy = RetryPolicy::new().backoff(std::time::Duration::ZERO, std::time::Duration::ZERO);
    /// let mut sends = 0;
    /// let delivery = outbox.send(&mut intent, &policy, |key, attempt| {
    ///     sends += 1;
    ///     // POST with the header `Idempotency-Key: "{key}"`; here the first send times out.
    ///     if attempt == 1 { Err(Failure::NoAnswer("timed out")) } else { Ok(Response::new(201, "paid")) }
    /// })?;
    /// assert!(matches!(delivery, Delivery::Answered(r) if r.status == 201));
    /// assert_eq!(sends, 2);
    /// assert!(matches!(outbox.begin("order-42", Fingerprint::of(["4999"]))?, Claim::Completed(_)));
    /// # Ok::<(), idempotency_store::Error>(())
    /// ```
    ///
    /// # Errors
    /// The store's errors (recording or finishing failed; the intent stays open).
    pub fn send<E>(
        &self,
        intent: &mut Intent,
        policy: &RetryPolicy,
        mut call: impl FnMut(&str, u32) -> std::result::Result<Response, Failure<E>>,
    ) -> Result<Delivery<E>> {
        let started = self.store().now()?;
        let forget_at = intent.begun_at().plus(millis(policy.key_lifetime));
        let mut sent = 0;
        loop {
            if self.store().now()? >= forget_at {
                return Ok(Delivery::NeedsReconciliation);
            }
            let number = self.start(intent)?;
            sent += 1;
            let result = call(intent.key(), number);
            self.record(intent, sent_as(&result))?;
            let now = self.store().now()?;
            let (hint, last) = match result {
                Ok(answer) => match verdict(policy, &answer, now) {
                    Verdict::Final => {
                        self.finish(intent, answer.clone())?;
                        return Ok(Delivery::Answered(answer));
                    }
                    Verdict::KeyReused => return Ok(Delivery::KeyReused(answer)),
                    Verdict::Retry(hint) => (hint, Ok(answer)),
                },
                Err(failure) => (None, Err(failure)),
            };
            let pause = hint.unwrap_or_else(|| policy.jitter(number));
            let next = now.plus(millis(pause));
            if next >= forget_at {
                return Ok(Delivery::NeedsReconciliation);
            }
            let out_of_time =
                next.as_millis().saturating_sub(started.as_millis()) > millis(policy.max_elapsed);
            if sent >= policy.max_attempts || out_of_time {
                return Ok(Delivery::GaveUp { last });
            }
            (policy.sleep)(pause);
        }
    }
}

fn sent_as<E>(result: &std::result::Result<Response, Failure<E>>) -> Sent {
    match result {
        Ok(answer) => Sent::Answered(answer.status),
        Err(Failure::NoAnswer(_)) => Sent::NoAnswer,
        Err(Failure::Refused(_)) => Sent::Refused,
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(value: &str) -> Response {
        Response::new(503, "").with_header("Retry-After", value)
    }

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        // 2015-10-21T07:28:00Z
        let now = Timestamp::from_millis(1_445_412_480_000);
        assert_eq!(
            retry_after(&with("120"), now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(retry_after(&with(" 0 "), now), Some(Duration::ZERO));
        assert_eq!(
            retry_after(&with("Wed, 21 Oct 2015 07:28:30 GMT"), now),
            Some(Duration::from_secs(30))
        );
        // A date in the past: at once.
        assert_eq!(
            retry_after(&with("Wed, 21 Oct 2015 07:00:00 GMT"), now),
            Some(Duration::ZERO)
        );
        for bad in ["", "-1", "1.5", "soon", "Wed, 32 Oct 2015 07:28:00 GMT"] {
            assert_eq!(retry_after(&with(bad), now), None, "{bad:?}");
        }
        assert_eq!(retry_after(&Response::new(503, ""), now), None);
    }

    #[test]
    fn jitter_stays_below_the_doubling_ceiling() {
        let policy = RetryPolicy::new().backoff(Duration::from_millis(100), Duration::from_secs(1));
        for n in 1..40 {
            let ceiling =
                Duration::from_millis(100 * (1u64 << (n - 1).min(20))).min(Duration::from_secs(1));
            for _ in 0..20 {
                assert!(policy.jitter(n) <= ceiling, "attempt {n}");
            }
        }
    }
}
