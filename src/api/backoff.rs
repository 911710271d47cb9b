//! Pauses that double up to a limit, for the loops that wait and try again: claim waits, the
//! sweeper after a failed round, the client's retries.

use std::time::Duration;

use exponential_backoff::Backoff;

/// `first`, then twice as long each time, up to `last` (at least `first`), for as many pauses
/// as a loop asks: no jitter (a caller that wants it scales the pause itself).
pub(crate) fn doubling(first: Duration, last: Duration) -> impl Iterator<Item = Duration> {
    let mut backoff = Backoff::new(u32::MAX, first, last.max(first));
    backoff.set_jitter(0.0);
    // The crate's last "attempt" has no pause (`None`); from then on, `last` each time.
    let pauses = backoff.into_iter().map_while(|pause| pause);
    pauses.chain(std::iter::repeat(last.max(first)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pauses_double_from_the_first_up_to_the_last() {
        let ms = Duration::from_millis;
        let pauses: Vec<_> = doubling(ms(10), ms(250)).take(8).collect();
        assert_eq!(
            pauses,
            [
                ms(10),
                ms(20),
                ms(40),
                ms(80),
                ms(160),
                ms(250),
                ms(250),
                ms(250)
            ]
        );
        assert_eq!(doubling(ms(10), ms(10)).nth(40), Some(ms(10)));
        assert_eq!(
            doubling(ms(300), ms(250)).next(),
            Some(ms(300)),
            "at least the first"
        );
        assert_eq!(
            doubling(Duration::ZERO, Duration::ZERO).nth(3),
            Some(Duration::ZERO)
        );
        let far = doubling(ms(1), Duration::MAX).nth(100);
        assert_eq!(far, Some(ms(1) * u32::MAX), "saturates, never overflows");
    }
}
