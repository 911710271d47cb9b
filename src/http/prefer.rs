//! `Prefer: wait=N` (RFC 7240, section 4.3): how long a client is willing to wait for an
//! answer, which bounds how long a duplicate waits for the attempt in flight.

use std::time::Duration;

use ::http::{HeaderMap, HeaderName, HeaderValue};

use super::options::HandleOptions;

/// The request header `Prefer`.
const PREFER: HeaderName = HeaderName::from_static("prefer");
/// The response header `Preference-Applied`.
pub(crate) const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");

/// How long a duplicate of this request may wait, and the `Preference-Applied` value when
/// the client asked for a bound.
pub(crate) struct Wait {
    pub(crate) bound: Duration,
    pub(crate) applied: Option<HeaderValue>,
}

/// The client's `wait` preference, capped by [`HandleOptions::max_wait`]; the options'
/// [`wait`](HandleOptions::wait) when the client says nothing.
pub(crate) fn wait(options: &HandleOptions, headers: &HeaderMap) -> Wait {
    match preferred_wait(headers) {
        Some(seconds) => {
            let bound = Duration::from_secs(seconds).min(options.max_wait);
            let applied = HeaderValue::from_str(&format!("wait={}", bound.as_secs())).ok();
            Wait { bound, applied }
        }
        None => Wait {
            bound: options.wait,
            applied: None,
        },
    }
}

/// The first `wait` preference of the request's `Prefer` headers, in seconds. Preferences are
/// comma-separated, each a name with an optional `=value` and `;`-parameters; names are
/// case-insensitive; a value that is not a whole number of seconds is ignored (RFC 7240: a
/// preference that cannot be understood is ignored).
fn preferred_wait(headers: &HeaderMap) -> Option<u64> {
    headers
        .get_all(PREFER)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .find_map(|preference| {
            let head = preference.split(';').next()?;
            let (name, value) = head.split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("wait") {
                return None;
            }
            value.trim().trim_matches('"').parse().ok()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefer(values: &[&str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in values {
            headers.append(PREFER, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn the_wait_preference_is_found_among_others() {
        assert_eq!(preferred_wait(&prefer(&["wait=5"])), Some(5));
        assert_eq!(
            preferred_wait(&prefer(&["respond-async, Wait = 7"])),
            Some(7)
        );
        assert_eq!(
            preferred_wait(&prefer(&["return=minimal", "wait=\"3\"; x=1"])),
            Some(3)
        );
        assert_eq!(preferred_wait(&prefer(&["wait=soon", "wait=2"])), Some(2));
        assert_eq!(preferred_wait(&prefer(&["respond-async"])), None);
        assert_eq!(preferred_wait(&HeaderMap::new()), None);
    }

    #[test]
    fn the_client_bound_is_capped_and_applied() {
        let options = HandleOptions::new()
            .wait(Duration::from_millis(500))
            .max_wait(Duration::from_secs(10));
        let plain = wait(&options, &HeaderMap::new());
        assert_eq!(plain.bound, Duration::from_millis(500));
        assert!(plain.applied.is_none());
        let short = wait(&options, &prefer(&["wait=0"]));
        assert_eq!(short.bound, Duration::ZERO);
        assert_eq!(short.applied.unwrap(), "wait=0");
        let long = wait(&options, &prefer(&["wait=3600"]));
        assert_eq!(long.bound, Duration::from_secs(10));
        assert_eq!(long.applied.unwrap(), "wait=10");
    }
}
