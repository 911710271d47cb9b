//! The `Idempotency-Key` request header: reading it, and the RFC 8941 sf-string it holds.

use ::http::{HeaderMap, HeaderName};

use super::problem::Problem;
use crate::api::key::Key;
use crate::error::Error;

/// The request header that carries the key: `Idempotency-Key`.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Why a request has no usable idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The request has no `Idempotency-Key` header. 400 where a key is required.
    #[error("the request has no Idempotency-Key header")]
    Missing,
    /// The header is malformed (a broken sf-string, several fields) or the key breaks the rules
    /// of [`Key::new`]. 400.
    #[error("invalid Idempotency-Key header: {reason}")]
    Invalid {
        /// What is wrong, in words a client developer can act on.
        reason: String,
    },
    /// The scope the server passed is not a valid scope: a server bug, not the client's. 500.
    #[error("invalid idempotency key scope: {reason}")]
    InvalidScope {
        /// What is wrong with the scope.
        reason: String,
    },
}

impl KeyError {
    /// The answer for this error: 400 for [`Missing`](KeyError::Missing) and
    /// [`Invalid`](KeyError::Invalid), 500 for [`InvalidScope`](KeyError::InvalidScope)
    /// (without the server's details).
    #[must_use]
    pub fn problem(&self) -> Problem {
        match self {
            KeyError::Missing => Problem::missing_key(),
            KeyError::Invalid { reason } => Problem::invalid_key(reason),
            KeyError::InvalidScope { .. } => Problem::internal(),
        }
    }
}

/// Reads the request's idempotency key from its `Idempotency-Key` header, within `scope` if
/// given (for example the tenant or API client from authentication, so that two clients
/// cannot see each other's records through the same key).
///
/// The value is parsed by [`parse_key`]. Exactly one `Idempotency-Key` field is accepted.
///
/// # Errors
/// [`KeyError::Missing`] without the header; [`KeyError::Invalid`] if there are several, the
/// value is malformed or the key is not a valid [`Key`]; [`KeyError::InvalidScope`] if
/// `scope` is not a valid scope (see [`Key::scoped`]).
pub fn key_from_headers(headers: &HeaderMap, scope: Option<&str>) -> Result<Key, KeyError> {
    if let Some(scope) = scope {
        Key::new(scope).map_err(|e| KeyError::InvalidScope {
            reason: reason_of(e),
        })?;
    }
    let mut fields = headers.get_all(IDEMPOTENCY_KEY).iter();
    let value = fields.next().ok_or(KeyError::Missing)?;
    if fields.next().is_some() {
        return Err(invalid(
            "the request has more than one Idempotency-Key field",
        ));
    }
    let key = parse_key(value.as_bytes())?;
    let built = match scope {
        Some(scope) => Key::scoped(scope, &key),
        None => Key::new(&key),
    };
    built.map_err(|e| KeyError::Invalid {
        reason: reason_of(e),
    })
}

/// Parses an `Idempotency-Key` field value into the key text.
///
/// Two forms, after trimming surrounding spaces and tabs:
/// - **sf-string** (the IETF draft's form, RFC 8941 §3.3.3): `"8e03…"`. Inside the quotes,
///   printable ASCII except `"` and `\`, which are written `\"` and `\\`; any other escape, a
///   missing closing quote or anything after the string is an error. RFC 8941 parameters after
///   the string (`"abc"; v=1`) are accepted and ignored: none are defined, and RFC 8941 asks
///   fields to tolerate unknown ones.
/// - **bare**: a value that does not start with `"` is the key verbatim (`8e03…`, the form most
///   clients send, Stripe's included), even if it holds spaces, `;` or `"` later on.
///
/// Either way the result still has to pass [`Key::new`] (1 to 255 bytes of printable ASCII),
/// which [`key_from_headers`] checks.
///
/// # Errors
/// [`KeyError::Invalid`] if the value is a malformed sf-string or holds a byte outside
/// printable ASCII.
pub fn parse_key(value: &[u8]) -> Result<String, KeyError> {
    let value = value.trim_ascii_start().trim_ascii_end();
    if let Some(pos) = value.iter().position(|b| !(0x20..=0x7e).contains(b)) {
        return Err(invalid(format!(
            "the value has a byte outside printable ASCII at position {pos}"
        )));
    }
    let Some(quoted) = value.strip_prefix(b"\"") else {
        // Printable ASCII, checked above, so this is valid UTF-8.
        return Ok(String::from_utf8_lossy(value).into_owned());
    };
    let (key, rest) = sf_string(quoted)?;
    skip_parameters(rest)?;
    Ok(key)
}

/// Parses the rest of an sf-string after its opening quote; returns the text and what follows
/// the closing quote.
fn sf_string(input: &[u8]) -> Result<(String, &[u8]), KeyError> {
    let mut out = String::with_capacity(input.len());
    let mut bytes = input.iter().enumerate();
    while let Some((i, &b)) = bytes.next() {
        match b {
            b'"' => return Ok((out, &input[i + 1..])),
            b'\\' => match bytes.next() {
                Some((_, &c @ (b'"' | b'\\'))) => out.push(char::from(c)),
                Some((_, &c)) => {
                    return Err(invalid(format!(
                        "the quoted key has the escape \\{} (only \\\" and \\\\ are allowed)",
                        char::from(c)
                    )));
                }
                None => return Err(invalid("the quoted key ends in a lone backslash")),
            },
            // Callers pass printable ASCII only.
            _ => out.push(char::from(b)),
        }
    }
    Err(invalid("the quoted key has no closing quote"))
}

/// Checks RFC 8941 parameters (`;key=value` after the item) and ignores them.
fn skip_parameters(mut rest: &[u8]) -> Result<(), KeyError> {
    let bad = |what: &str| invalid(format!("after the quoted key: {what}"));
    let is_key_start = |b: &u8| b.is_ascii_lowercase() || *b == b'*';
    let is_key_char = |b: &u8| {
        b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-' | b'.' | b'*')
    };
    // A bare item: integer, decimal, token, byte sequence or boolean. Checked loosely (the
    // value is ignored), but never past a delimiter.
    let is_value_char = |b: &u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/?=".contains(b);
    loop {
        rest = rest.trim_ascii_end();
        let Some(after) = rest.strip_prefix(b";") else {
            return if rest.is_empty() {
                Ok(())
            } else {
                Err(bad("unexpected characters (quote the whole key)"))
            };
        };
        let after = after.trim_ascii_start();
        if !after.first().is_some_and(is_key_start) {
            return Err(bad("a parameter must start with a lowercase letter or '*'"));
        }
        let key_len = after.iter().take_while(|b| is_key_char(b)).count();
        rest = &after[key_len..];
        if let Some(value) = rest.strip_prefix(b"=") {
            rest = if let Some(quoted) = value.strip_prefix(b"\"") {
                sf_string(quoted)?.1
            } else {
                let len = value.iter().take_while(|b| is_value_char(b)).count();
                if len == 0 {
                    return Err(bad("a parameter has an empty value"));
                }
                &value[len..]
            };
        }
    }
}

fn invalid(reason: impl Into<String>) -> KeyError {
    KeyError::Invalid {
        reason: reason.into(),
    }
}

fn reason_of(err: Error) -> String {
    match err {
        Error::InvalidKey { reason } => reason,
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use ::http::{HeaderValue, Request, StatusCode};

    use super::*;
    use crate::http::problem_type;
    use crate::http::testing::{assert_problem, json, retry_after};

    fn headers(values: &[&[u8]]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for value in values {
            map.append(
                "Idempotency-Key",
                HeaderValue::from_bytes(value).expect("test header value"),
            );
        }
        map
    }

    fn key(value: &[u8]) -> Result<Key, KeyError> {
        key_from_headers(&headers(&[value]), None)
    }

    fn parsed(value: &[u8]) -> Option<String> {
        key(value).ok().map(|k| k.key().to_owned())
    }

    #[test]
    fn sf_string_and_bare_forms_give_the_same_key() {
        let uuid = "8e03978e-40d5-43e8-bc93-6894a57f9324";
        assert_eq!(
            parsed(format!("\"{uuid}\"").as_bytes()).as_deref(),
            Some(uuid)
        );
        assert_eq!(parsed(uuid.as_bytes()).as_deref(), Some(uuid));
        assert_eq!(key(b"\"abc\"").ok(), Key::new("abc").ok());
    }

    #[test]
    fn sf_string_escapes() {
        assert_eq!(parsed(br#""a\"b""#).as_deref(), Some("a\"b"));
        assert_eq!(parsed(br#""a\\b""#).as_deref(), Some("a\\b"));
        assert_eq!(parsed(br#""\\\"""#).as_deref(), Some("\\\""));
        // Unescaped specials other than `"` and `\` are plain characters.
        assert_eq!(parsed(br#""a,b;c=d 'e'""#).as_deref(), Some("a,b;c=d 'e'"));
        for bad in [&br#""a\nb""#[..], br#""a\'b""#, br#""a\"#, br#""ab\""#] {
            assert!(
                matches!(key(bad), Err(KeyError::Invalid { .. })),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }

    #[test]
    fn malformed_sf_strings_are_invalid() {
        for bad in [
            &b"\"abc"[..],       // no closing quote
            b"\"",               // a lone quote
            b"\"\"",             // empty key
            b"\"abc\"def",       // junk after the string
            b"\"abc\" \"def\"",  // two strings
            b"\"abc\", \"def\"", // a list, as two fields merged by a proxy
            b"\"abc\";",         // parameter without a key
            b"\"abc\";X=1",      // parameter keys are lowercase
            b"\"abc\";a=",       // empty parameter value
            b"\"abc\";a=\"x",    // unterminated parameter string
            b"\"a\tb\"",         // a tab inside the string
            b"\"abc\" ;v=1",     // no space before a parameter
        ] {
            let err = key(bad);
            assert!(
                matches!(err, Err(KeyError::Invalid { .. })),
                "{:?} gave {err:?}",
                String::from_utf8_lossy(bad)
            );
            assert_eq!(
                err.map_err(|e| e.problem().status),
                Err(StatusCode::BAD_REQUEST)
            );
        }
    }

    #[test]
    fn parameters_and_surrounding_whitespace_are_ignored() {
        for ok in [
            &b"\"abc\";v=1"[..],
            b"\"abc\"; v=1;w",
            b"\"abc\";a=?1;b=tok/en:x;c=-1.5;d=:aGk=:;e=\"q\\\"s\"",
            b"  \"abc\"  ",
            b"\t\"abc\"\t",
            b" \"abc\";*x=1 ",
        ] {
            assert_eq!(
                parsed(ok).as_deref(),
                Some("abc"),
                "{:?}",
                String::from_utf8_lossy(ok)
            );
        }
        assert_eq!(parsed(b"  abc  ").as_deref(), Some("abc"));
    }

    #[test]
    fn bare_values_are_taken_verbatim() {
        assert_eq!(parsed(b"abc;v=1").as_deref(), Some("abc;v=1"));
        assert_eq!(parsed(b"a b\"c").as_deref(), Some("a b\"c"));
        assert_eq!(parsed(b"123").as_deref(), Some("123"));
    }

    #[test]
    fn bytes_outside_printable_ascii_and_bad_lengths_are_invalid() {
        for bad in [&b"caf\xc3\xa9"[..], b"\"caf\xc3\xa9\"", b"", b"   "] {
            assert!(matches!(key(bad), Err(KeyError::Invalid { .. })));
        }
        // `http` refuses DEL and other controls in a header value; other servers may not.
        for bad in [&b"a\x7fb"[..], b"\"a\x7fb\"", b"a\x01b", b"\"a\nb\""] {
            assert!(matches!(parse_key(bad), Err(KeyError::Invalid { .. })));
        }
        let long = "k".repeat(256);
        assert!(matches!(
            key(long.as_bytes()),
            Err(KeyError::Invalid { .. })
        ));
        assert!(key("k".repeat(255).as_bytes()).is_ok());
        let quoted_long = format!("\"{long}\"");
        let err = key(quoted_long.as_bytes()).err().map(|e| e.to_string());
        assert!(err.is_some_and(|e| e.contains("255")));
    }

    #[test]
    fn missing_duplicate_and_case_insensitive_header() {
        assert_eq!(
            key_from_headers(&HeaderMap::new(), None),
            Err(KeyError::Missing)
        );
        let two = headers(&[b"\"a\"", b"\"a\""]);
        assert!(matches!(
            key_from_headers(&two, None),
            Err(KeyError::Invalid { reason }) if reason.contains("more than one")
        ));
        let request = Request::post("/p")
            .header("IDEMPOTENCY-KEY", "\"abc\"")
            .body(())
            .expect("request");
        assert_eq!(
            key_from_headers(request.headers(), None).ok(),
            Key::new("abc").ok()
        );
    }

    #[test]
    fn scope_is_applied_and_a_bad_scope_is_the_servers_fault() {
        let scoped = key_from_headers(&headers(&[b"\"abc\""]), Some("tenant-1"));
        assert_eq!(scoped.ok(), Key::scoped("tenant-1", "abc").ok());
        let err = key_from_headers(&headers(&[b"\"abc\""]), Some(""));
        assert!(matches!(err, Err(KeyError::InvalidScope { .. })));
        let problem = err.err().map(|e| e.problem());
        assert_eq!(problem, Some(Problem::internal()));
        // The scope is checked first, so a missing key with a bad scope is still the server's.
        let err = key_from_headers(&HeaderMap::new(), Some("bad\u{1}"));
        assert!(matches!(err, Err(KeyError::InvalidScope { .. })));
    }

    #[test]
    fn missing_and_invalid_keys_answer_400() {
        let missing = KeyError::Missing.problem().to_http();
        assert_problem(&missing, 400, problem_type::MISSING_KEY);
        assert_eq!(retry_after(&missing), None);

        let invalid = key(b"\"abc").err().map(|e| e.problem().to_http());
        let invalid = invalid.expect("invalid");
        assert_problem(&invalid, 400, problem_type::INVALID_KEY);
        let detail = json(invalid.body())["detail"].to_string();
        assert!(detail.contains("no closing quote"), "{detail}");
    }
}
