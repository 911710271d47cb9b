//! Idempotency keys: validation and the stored byte form.

use std::fmt;

use crate::error::{Error, Result};

/// The longest key or scope accepted, in bytes (Stripe's limit, and what the IETF draft's
/// examples fit in). A store may be configured to accept less.
pub(crate) const MAX_KEY_LEN: usize = 255;

/// A validated idempotency key, optionally within a scope.
///
/// A key is 1 to 255 bytes of printable ASCII (`0x20..=0x7E`, the IETF draft's sf-string
/// range), checked before the store is touched. A scope (a tenant, an API client) follows the
/// same rules and is part of the stored key, so the same key under two scopes names two
/// independent records.
///
/// ```
/// use idempotency_store::Key;
///
/// let a = Key::scoped("tenant-a", "order-42")?;
/// let b = Key::scoped("tenant-b", "order-42")?;
/// assert_ne!(a, b);
/// assert!(Key::new("").is_err());
/// # Ok::<(), idempotency_store::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Key {
    /// `[scope length][scope][key]`: the length prefix keeps `("ab", "c")` and `("a", "bc")`
    /// apart, and an unscoped key is scope length 0.
    stored: Vec<u8>,
}

impl Key {
    /// An unscoped key.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if `key` is empty, longer than 255 bytes, or holds a
    /// byte outside printable ASCII.
    pub fn new(key: &str) -> Result<Self> {
        check("key", key)?;
        Ok(Self::build("", key))
    }

    /// A key within `scope`.
    ///
    /// # Errors
    /// [`Error::InvalidKey`] if the key or the scope breaks the rules of [`Key::new`].
    pub fn scoped(scope: &str, key: &str) -> Result<Self> {
        check("scope", scope)?;
        check("key", key)?;
        Ok(Self::build(scope, key))
    }

    fn build(scope: &str, key: &str) -> Self {
        let mut stored = Vec::with_capacity(1 + scope.len() + key.len());
        // check() bounds both lengths by MAX_KEY_LEN, which fits in a byte.
        stored.push(u8::try_from(scope.len()).unwrap_or(u8::MAX));
        stored.extend_from_slice(scope.as_bytes());
        stored.extend_from_slice(key.as_bytes());
        Key { stored }
    }

    /// Rebuilds a key from its stored form, validating it as if it were new.
    pub(crate) fn from_stored(bytes: &[u8]) -> Result<Self> {
        let (&scope_len, rest) = bytes
            .split_first()
            .ok_or_else(|| Error::corrupted("empty stored key"))?;
        let (scope, key) = rest
            .split_at_checked(usize::from(scope_len))
            .ok_or_else(|| Error::corrupted("stored key shorter than its scope"))?;
        let (scope, key) = (text(scope)?, text(key)?);
        let rebuilt = if scope.is_empty() {
            Key::new(key)
        } else {
            Key::scoped(scope, key)
        };
        rebuilt.map_err(|e| Error::corrupted(format!("stored key is invalid: {e}")))
    }

    /// The client's key, without the scope.
    #[must_use]
    pub fn key(&self) -> &str {
        let (scope_len, rest) = self.split();
        // Built only from &str, so both halves are valid UTF-8 at these boundaries.
        std::str::from_utf8(rest.get(scope_len..).unwrap_or_default()).unwrap_or_default()
    }

    /// The scope, or `None` for an unscoped key.
    #[must_use]
    pub fn scope(&self) -> Option<&str> {
        let (scope_len, rest) = self.split();
        let scope = std::str::from_utf8(rest.get(..scope_len).unwrap_or_default()).ok()?;
        (!scope.is_empty()).then_some(scope)
    }

    fn split(&self) -> (usize, &[u8]) {
        match self.stored.split_first() {
            Some((&len, rest)) => (usize::from(len), rest),
            None => (0, &[]),
        }
    }

    /// Checks the key and scope against a store's `max_key_len`.
    pub(crate) fn check_len(&self, max: usize) -> Result<()> {
        let longest = self.key().len().max(self.scope().map_or(0, str::len));
        if longest > max {
            return Err(Error::invalid_key(format!(
                "the key or scope is {longest} bytes long; this store accepts at most {max}"
            )));
        }
        Ok(())
    }

    /// The bytes under which the record is stored.
    pub(crate) fn as_stored(&self) -> &[u8] {
        &self.stored
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scope() {
            Some(scope) => write!(f, "Key({scope:?}/{:?})", self.key()),
            None => write!(f, "Key({:?})", self.key()),
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.scope() {
            Some(scope) => write!(f, "{scope}/{}", self.key()),
            None => f.write_str(self.key()),
        }
    }
}

fn text(bytes: &[u8]) -> Result<&str> {
    std::str::from_utf8(bytes).map_err(|_| Error::corrupted("stored key is not ASCII"))
}

fn check(what: &str, value: &str) -> Result<()> {
    if value.is_empty() {
        return Err(Error::invalid_key(format!("the {what} is empty")));
    }
    if value.len() > MAX_KEY_LEN {
        return Err(Error::invalid_key(format!(
            "the {what} is {} bytes long; the limit is {MAX_KEY_LEN}",
            value.len()
        )));
    }
    if let Some(pos) = value.bytes().position(|b| !(0x20..=0x7e).contains(&b)) {
        return Err(Error::invalid_key(format!(
            "the {what} has a byte outside printable ASCII at position {pos}"
        )));
    }
    Ok(())
}

/// Validates arbitrary bytes as a key and as a scoped key (split at the first byte's value)
/// and checks what a valid key promises: exactly the printable-ASCII 1..=255-byte strings are
/// accepted, the parts round-trip, and the stored form decodes to the same key. The fuzz
/// target and its corpus replay in `cargo test` call this; it must never panic.
#[cfg(feature = "__test-hooks")]
pub fn fuzz_key(data: &[u8]) {
    let valid = |s: &[u8]| {
        (1..=MAX_KEY_LEN).contains(&s.len()) && s.iter().all(|b| (0x20..=0x7e).contains(b))
    };
    let text = |s: &[u8]| String::from_utf8_lossy(s).into_owned();
    let (split, rest) = data
        .split_first()
        .map_or((0, data), |(&n, rest)| (usize::from(n), rest));
    let (scope, key) = rest.split_at(split.min(rest.len()));
    let (scope_text, key_text) = (text(scope), text(key));
    match Key::new(&key_text) {
        Ok(k) => {
            assert!(valid(key) && key_text.as_bytes() == key);
            assert_eq!((k.key(), k.scope()), (key_text.as_str(), None));
            assert_eq!(Key::from_stored(k.as_stored()).ok(), Some(k));
        }
        Err(_) => assert!(!valid(key_text.as_bytes())),
    }
    match Key::scoped(&scope_text, &key_text) {
        Ok(k) => {
            assert!(valid(scope) && valid(key));
            assert_eq!(
                (k.key(), k.scope()),
                (key_text.as_str(), Some(scope_text.as_str()))
            );
            assert_eq!(Key::from_stored(k.as_stored()).ok().as_ref(), Some(&k));
            assert_ne!(Key::new(&key_text).ok(), Some(k));
        }
        Err(_) => assert!(!valid(scope_text.as_bytes()) || !valid(key_text.as_bytes())),
    }
    let _ = Key::from_stored(data);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_form_round_trips() {
        for key in [Key::new("k").ok(), Key::scoped("s", "k").ok()]
            .into_iter()
            .flatten()
        {
            let back = Key::from_stored(key.as_stored()).ok();
            assert_eq!(back.as_ref(), Some(&key));
        }
    }

    #[test]
    fn scope_boundary_is_unambiguous() {
        assert_ne!(Key::scoped("ab", "c").ok(), Key::scoped("a", "bc").ok());
    }
}
