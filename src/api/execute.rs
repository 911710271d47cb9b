//! `execute`: claim, run the caller's operation, store its answer or release the key, with
//! every store call whose outcome is unknown retried once.

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::{Claim, ClaimId, Lease, Outcome};
use crate::api::response::Response;
use crate::api::store::IdempotencyStore;
use crate::error::{Error, Result};

/// [`IdempotencyStore::execute`] for any store, a trait object (`&dyn IdempotencyStore`)
/// included: the one implementation of `execute`. The claim carries a fresh claim id and
/// every store call whose outcome is unknown is retried once (the same claim id, the same
/// lease), so a lost answer neither blocks the key nor runs the operation twice.
///
/// ```
/// use idempotency_store::{Fingerprint, IdempotencyStore, Key, Outcome, Response, Store};
///
/// let store: Box<dyn IdempotencyStore> = Box::new(Store::builder().open_in_memory()?);
/// let key = Key::new("sms-8")?;
/// let send = |_: &mut _| Ok::<_, ()>(Response::new(200, "sent"));
/// let outcome = idempotency_store::execute(&*store, &key, Fingerprint::of(["hi"]), send)?;
/// assert!(matches!(outcome, Outcome::Executed(_)));
/// # Ok::<(), idempotency_store::Error>(())
/// ```
///
/// # Errors
/// As for [`IdempotencyStore::execute`].
pub fn execute<S, E, F>(
    store: &S,
    key: &Key,
    fingerprint: Fingerprint,
    operation: F,
) -> Result<Outcome<E>>
where
    S: IdempotencyStore + ?Sized,
    F: FnOnce(&mut Lease) -> Result<Response, E>,
{
    let id = ClaimId::random();
    let mut lease = match once_more(|| store.claim_with_id(key, fingerprint, id))? {
        Claim::Acquired(lease) => lease,
        Claim::Completed(replay) => return Ok(Outcome::Replayed(replay)),
        Claim::InProgress {
            lease_until,
            attempt,
        } => {
            return Ok(Outcome::InProgress {
                lease_until,
                attempt,
            });
        }
        Claim::Mismatch { stored } => return Ok(Outcome::Mismatch { stored }),
    };
    // A live operation keeps its key, however long it runs: only a dead one's lease lapses.
    let now = store.now().unwrap_or_else(|_| {
        use crate::api::clock::Clock;
        crate::api::clock::SystemClock.now()
    });
    let period = crate::api::heartbeat::period(&lease, now);
    let twin = lease.twin();
    let extend = |twin: &mut Lease| store.heartbeat(twin);
    let done =
        crate::api::heartbeat::run_beating(&extend, twin, period, &|| {}, || operation(&mut lease));
    match done {
        Ok(response) => store_answer(store, &lease, response).map(Outcome::Executed),
        Err(err) => match once_more(|| store.release(&lease)) {
            Ok(()) | Err(Error::LeaseLost) => Ok(Outcome::Failed(err)),
            Err(other) => Err(other),
        },
    }
}

/// Completes the lease with `response`, or, if the store cannot keep a response that large,
/// with [`Response::not_stored`]: the operation ran, so a retry must replay, not run it again.
/// Returns what was stored.
fn store_answer<S: IdempotencyStore + ?Sized>(
    store: &S,
    lease: &Lease,
    response: Response,
) -> Result<Response> {
    match once_more(|| store.complete(lease, response.clone())) {
        Ok(()) => Ok(response),
        Err(err @ Error::ResponseTooLarge { size, limit }) => {
            crate::api::trace::answer_not_stored(&err);
            let substitute = Response::not_stored(size, limit);
            once_more(|| store.complete(lease, substitute.clone()))?;
            Ok(substitute)
        }
        Err(err) => Err(err),
    }
}

/// Runs `call`, and once more if it failed with its outcome unknown: the retry of a claim
/// with the same claim id, or of a settling call with the same lease, settles what the first
/// one did.
pub(crate) fn once_more<T>(mut call: impl FnMut() -> Result<T>) -> Result<T> {
    match call() {
        Err(err) if err.outcome_unknown() => call(),
        other => other,
    }
}
