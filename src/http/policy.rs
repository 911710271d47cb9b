//! Fingerprint policies: what makes two requests with one key "the same request".

use std::fmt;
use std::sync::Arc;

use ::http::HeaderName;

use super::canonical_json::canonical;
use super::view::RequestView;
use crate::api::fingerprint::Fingerprint;

/// The fingerprint version of the structured policies (canonical JSON, unordered query,
/// selected headers). Version 1 is [`Fingerprint::of`], the raw-bytes policy.
pub const STRUCTURED_VERSION: u8 = 2;
const STRUCTURED_CONTEXT: &str = "idempotency-store 2026 http fingerprint policy v2";

/// How [`handle`](super::handle) and the layers (tower and actix) fingerprint a request.
///
/// | policy | compares | fingerprint version |
/// |---|---|---|
/// | [`raw`](FingerprintPolicy::raw) (default) | method, path and query as sent, body bytes: [`fingerprint`](super::fingerprint) | 1 |
/// | [`canonical_json`](FingerprintPolicy::canonical_json) | the body as canonical JSON: members sorted by name, whitespace ignored, numbers as written (`1.0` ≠ `1`), strings by their text (`"\u0041"` = `"A"`); a body that is not JSON is compared as bytes | 2 |
/// | [`unordered_query`](FingerprintPolicy::unordered_query) | query parameters in any order (each `name=value` as sent; repeats kept) | 2 |
/// | [`unordered_form`](FingerprintPolicy::unordered_form) | an `application/x-www-form-urlencoded` body's parameters in any order, decoded (`a=b+c` = `a=b%20c`); repeats of one name keep their order (`expand[]=a&expand[]=b` ≠ `expand[]=b&expand[]=a`); other bodies as bytes | 2 |
/// | [`header`](FingerprintPolicy::header) | also the values of the named headers (absent ≠ empty) | 2 |
/// | [`custom`](FingerprintPolicy::custom) | what your function returns | yours |
///
/// The structured options combine: `FingerprintPolicy::raw().canonical_json().unordered_query()
/// .header(CONTENT_TYPE)`. The method and path always count.
///
/// # Changing the policy of a running service
///
/// The store compares fingerprints (version and digest) for equality, so records stored under
/// the old policy would answer 422 to retries under the new one. Set the old policy as
/// [`HandleOptions::previous_fingerprint`](super::HandleOptions::previous_fingerprint) for
/// one retention period: on a mismatch, the request is fingerprinted again under the old
/// policy, and if that matches the stored record the claim is made with it (a replay, or the
/// run of a takeover). Without it, a 422 whose stored fingerprint has another version than
/// the new policy's says so in its detail ("the server changed how it compares requests"),
/// so it is not mistaken for a client reusing a key.
#[derive(Clone)]
pub struct FingerprintPolicy {
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    Structured {
        json: bool,
        unordered_query: bool,
        headers: Vec<HeaderName>,
        form: bool,
    },
    Custom(CustomFn),
}

type CustomFn = Arc<dyn Fn(&RequestView<'_>) -> Fingerprint + Send + Sync>;

impl Default for FingerprintPolicy {
    fn default() -> Self {
        FingerprintPolicy::raw()
    }
}

impl fmt::Debug for FingerprintPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.kind {
            Kind::Structured {
                json,
                unordered_query,
                headers,
                form,
            } => f
                .debug_struct("FingerprintPolicy")
                .field("canonical_json", json)
                .field("unordered_query", unordered_query)
                .field("unordered_form", form)
                .field("headers", headers)
                .finish(),
            Kind::Custom(_) => f.write_str("FingerprintPolicy(custom)"),
        }
    }
}

impl FingerprintPolicy {
    /// Method, request target and body bytes as sent (version 1, the default).
    #[must_use]
    pub fn raw() -> Self {
        FingerprintPolicy {
            kind: Kind::Structured {
                json: false,
                unordered_query: false,
                headers: Vec::new(),
                form: false,
            },
        }
    }

    /// Compares the body as canonical JSON (see the table above).
    #[must_use]
    pub fn canonical_json(self) -> Self {
        self.structured(|json, _, _| *json = true)
    }

    /// Compares query parameters regardless of their order.
    #[must_use]
    pub fn unordered_query(self) -> Self {
        self.structured(|_, query, _| *query = true)
    }

    /// Compares an `application/x-www-form-urlencoded` body (Stripe's convention) by its
    /// decoded parameters, in any order (see the table above).
    #[must_use]
    pub fn unordered_form(mut self) -> Self {
        self = self.structured(|_, _, _| {});
        if let Kind::Structured { form, .. } = &mut self.kind {
            *form = true;
        }
        self
    }

    /// Also compares the values of header `name` (for example `content-type`).
    #[must_use]
    pub fn header(self, name: HeaderName) -> Self {
        self.structured(|_, _, headers| headers.push(name))
    }

    /// Your own function of the request. Give its fingerprints a version of your own
    /// ([`Fingerprint::from_raw`]) if they must never equal the built-in policies'.
    #[must_use]
    pub fn custom(f: impl Fn(&RequestView<'_>) -> Fingerprint + Send + Sync + 'static) -> Self {
        FingerprintPolicy {
            kind: Kind::Custom(Arc::new(f)),
        }
    }

    fn structured(
        mut self,
        change: impl FnOnce(&mut bool, &mut bool, &mut Vec<HeaderName>),
    ) -> Self {
        if let Kind::Custom(_) = self.kind {
            self = FingerprintPolicy::raw();
        }
        if let Kind::Structured {
            json,
            unordered_query,
            headers,
            ..
        } = &mut self.kind
        {
            change(json, unordered_query, headers);
        }
        self
    }

    /// The request's fingerprint under this policy.
    #[must_use]
    pub fn fingerprint(&self, request: &RequestView<'_>) -> Fingerprint {
        match &self.kind {
            Kind::Custom(f) => f(request),
            Kind::Structured {
                json: false,
                unordered_query: false,
                headers,
                form: false,
            } if headers.is_empty() => Fingerprint::of([
                request.method.as_str().as_bytes(),
                request.target().as_bytes(),
                request.body,
            ]),
            Kind::Structured {
                json,
                unordered_query,
                headers,
                form,
            } => structured(request, *json, *unordered_query, *form, headers),
        }
    }
}

/// Version 2: a descriptor of the policy, method, path, query, body and headers, so that two
/// structured policies never agree on a digest by accident.
fn structured(
    request: &RequestView<'_>,
    json: bool,
    unordered_query: bool,
    form: bool,
    headers: &[HeaderName],
) -> Fingerprint {
    let mut descriptor = format!("json={json};unordered_query={unordered_query};headers=");
    for name in headers {
        descriptor.push_str(name.as_str());
        descriptor.push(',');
    }
    // Only when set, so that the digests of the policies that came before it do not change.
    if form {
        descriptor.push_str(";form=true");
    }
    let query = request.uri.query().unwrap_or_default();
    let query = if unordered_query {
        let mut pairs: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
        pairs.sort_unstable();
        pairs.join("&")
    } else {
        query.to_owned()
    };
    // A body that is not JSON (or form) is hashed as sent, marked so it cannot collide with
    // the canonical text.
    let form_body = (form && is_form(request)).then(|| unordered_form(request.body));
    let json_body = json.then(|| canonical(request.body)).flatten();
    let (body_kind, body): (&[u8], &[u8]) = match (&form_body, &json_body) {
        (Some(pairs), _) => (b"form", pairs),
        (None, Some(canonical)) => (b"json", canonical),
        (None, None) => (b"bytes", request.body),
    };
    let mut parts: Vec<&[u8]> = vec![
        descriptor.as_bytes(),
        request.method.as_str().as_bytes(),
        request.uri.path().as_bytes(),
        query.as_bytes(),
        body_kind,
        body,
    ];
    let mut values = Vec::new();
    for name in headers {
        let all: Vec<&[u8]> = request
            .headers
            .get_all(name)
            .iter()
            .map(|v| v.as_bytes())
            .collect();
        values.push((all.len() as u64).to_le_bytes());
        parts.push(b"header");
        parts.extend(all);
    }
    // The counts go last so that `parts` holds only borrows of live values.
    parts.extend(values.iter().map(|v| &v[..]));
    Fingerprint::derive(STRUCTURED_VERSION, STRUCTURED_CONTEXT, parts)
}

/// Whether the request says its body is `application/x-www-form-urlencoded`.
fn is_form(request: &RequestView<'_>) -> bool {
    request
        .headers
        .get(::http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|mime| {
            mime.trim()
                .eq_ignore_ascii_case("application/x-www-form-urlencoded")
        })
}

/// The decoded parameters sorted by name (a stable sort: the values of one name keep their
/// order), each as its length-prefixed name and value, so that no separator inside a value
/// can make two different forms agree.
fn unordered_form(body: &[u8]) -> Vec<u8> {
    let mut pairs: Vec<_> = form_urlencoded::parse(body).collect();
    pairs.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = Vec::with_capacity(body.len() + 16 * pairs.len());
    for (name, value) in &pairs {
        for part in [name, value] {
            out.extend_from_slice(&(part.len() as u64).to_le_bytes());
            out.extend_from_slice(part.as_bytes());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn form(body: &str) -> Fingerprint {
        let request = ::http::Request::post("/v1/charges")
            .header("content-type", "application/x-www-form-urlencoded")
            .body(body.as_bytes().to_vec())
            .unwrap();
        FingerprintPolicy::raw()
            .unordered_form()
            .fingerprint(&RequestView::of(&request))
    }

    #[test]
    fn form_parameters_compare_in_any_order_and_decoded() {
        let first = form("amount=2000&currency=usd&metadata[order]=7");
        assert_eq!(first, form("metadata[order]=7&currency=usd&amount=2000"));
        assert_eq!(form("note=a+b"), form("note=a%20b"));
        assert_ne!(first, form("amount=2001&currency=usd&metadata[order]=7"));
        assert_ne!(form("expand[]=a&expand[]=b"), form("expand[]=b&expand[]=a"));
        assert_ne!(form("a=b&c=d"), form("a=b%26c%3Dd"));
    }

    #[test]
    fn the_form_option_leaves_other_policies_and_bodies_alone() {
        let request = ::http::Request::post("/x")
            .body(b"b=1&a=2".to_vec())
            .unwrap();
        let view = RequestView::of(&request);
        let plain = FingerprintPolicy::raw()
            .unordered_query()
            .fingerprint(&view);
        let with_form = FingerprintPolicy::raw()
            .unordered_query()
            .unordered_form()
            .fingerprint(&view);
        // Not a form body (no content type): compared as bytes, under its own descriptor.
        assert_ne!(plain, with_form);
        let swapped = ::http::Request::post("/x")
            .body(b"a=2&b=1".to_vec())
            .unwrap();
        let swapped = FingerprintPolicy::raw()
            .unordered_query()
            .unordered_form()
            .fingerprint(&RequestView::of(&swapped));
        assert_ne!(with_form, swapped);
    }
}
