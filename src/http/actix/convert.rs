//! actix-web 4 speaks `http` 0.2, the flow `http` 1: requests' heads and responses crossed
//! between the two. Both versions accept the same bytes for methods, targets, header names and
//! values, so nothing valid is lost on the way.

use actix_web::HttpResponse;
use actix_web::body::BoxBody;
use actix_web::http::header as actix_header;

use crate::http::options::NotFinal;

/// The method in `http` 1.
pub(super) fn method(method: &actix_web::http::Method) -> ::http::Method {
    ::http::Method::from_bytes(method.as_str().as_bytes()).unwrap_or_default()
}

/// The request target in `http` 1 (the empty `/` if it could not be parsed, which a target
/// that actix accepted cannot be).
pub(super) fn uri(uri: &actix_web::http::Uri) -> ::http::Uri {
    uri.to_string().parse().unwrap_or_default()
}

/// The headers in `http` 1.
pub(super) fn headers(from: &actix_header::HeaderMap) -> ::http::HeaderMap {
    let mut headers = ::http::HeaderMap::with_capacity(from.len());
    for (name, value) in from {
        let name = ::http::HeaderName::from_bytes(name.as_str().as_bytes());
        let value = ::http::HeaderValue::from_bytes(value.as_bytes());
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.append(name, value);
        }
    }
    headers
}

/// The `http` 1 extensions of a response made by [`super::respond`], kept in actix's
/// response for the settling call.
pub(super) struct Carried(pub(super) ::http::Extensions);

/// The handler's response head, with `body`, in `http` 1: with the extensions it carries
/// (see [`super::respond`]), and a [`NotFinal`] inserted into actix's own extensions.
pub(super) fn answer<T>(head: &mut HttpResponse<()>, body: T) -> ::http::Response<T> {
    let mut answer = ::http::Response::new(body);
    *answer.status_mut() = ::http::StatusCode::from_u16(head.status().as_u16()).unwrap_or_default();
    *answer.headers_mut() = headers(head.headers());
    let mut extensions = head.extensions_mut();
    if let Some(Carried(carried)) = extensions.remove::<Carried>() {
        *answer.extensions_mut() = carried;
    }
    if extensions.contains::<NotFinal>() {
        answer.extensions_mut().insert(NotFinal);
    }
    answer
}

/// An answer of the flow as actix's response (its `http` extensions dropped).
pub(super) fn response(answer: ::http::Response<Vec<u8>>) -> HttpResponse<BoxBody> {
    response_with(answer.map(BoxBody::new))
}

/// An `http` 1 response as actix's, and its `http` extensions.
pub(super) fn response_with(answer: ::http::Response<BoxBody>) -> HttpResponse<BoxBody> {
    let (mut parts, body) = answer.into_parts();
    let carried = std::mem::take(&mut parts.extensions);
    let status = actix_web::http::StatusCode::from_u16(parts.status.as_u16())
        .unwrap_or(actix_web::http::StatusCode::INTERNAL_SERVER_ERROR);
    let mut response = HttpResponse::with_body(status, body);
    if !carried.is_empty() {
        response.extensions_mut().insert(Carried(carried));
    }
    let headers = response.headers_mut();
    for (name, value) in &parts.headers {
        let name = actix_header::HeaderName::from_bytes(name.as_str().as_bytes());
        let value = actix_header::HeaderValue::from_bytes(value.as_bytes());
        if let (Ok(name), Ok(value)) = (name, value) {
            headers.append(name, value);
        }
    }
    response
}
