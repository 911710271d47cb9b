//! Random numbers: claim ids and the client's backoff jitter, from the operating system's
//! generator.

use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// 64 random bits from the operating system (`getrandom`). Should it refuse (it does not on
/// supported platforms once booted), the bits come from the standard library's randomly keyed
/// hasher, whose keys came from the same source earlier and differ from call to call: callers
/// cannot return an error, and must not panic.
pub(crate) fn u64() -> u64 {
    getrandom::u64().unwrap_or_else(|_| {
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
        hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
        hasher.finish()
    })
}

/// A fraction in `[0, 1)`, from [`u64`]'s top 53 bits: every such fraction is exact in an f64.
#[cfg(feature = "client")]
pub(crate) fn fraction() -> f64 {
    (u64() >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    #[test]
    fn numbers_differ_and_fractions_stay_below_one() {
        assert_ne!(super::u64(), super::u64());
        #[cfg(feature = "client")]
        assert!(
            (0..1000)
                .map(|_| super::fraction())
                .all(|f| (0.0..1.0).contains(&f))
        );
    }
}
