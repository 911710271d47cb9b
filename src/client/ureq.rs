//! Sending an intent with `ureq` (feature `ureq`): a ready-made closure for
//! [`Outbox::send`](super::Outbox::send).

use crate::api::response::Response;
use crate::client::retry::Failure;

/// A closure for [`Outbox::send`](super::Outbox::send) that sends `body` to `url` with
/// `method` through `agent`, with the header `Idempotency-Key` set to the intent's key (as a
/// structured-field string, as the IETF draft asks) and `headers`. Every status comes back
/// as an answer (the agent must not turn statuses into errors: build it with
/// `http_status_as_error(false)`); a refused connection or an unknown host is
/// [`Failure::Refused`], anything else that brings no answer (a timeout, a connection
/// lost) [`Failure::NoAnswer`].
///
/// ```no_run
/// use std::sync::Arc;
/// use std::time::Duration;
/// use idempotency_store::client::{self, Outbox, RetryPolicy};
/// use idempotency_store::{Claim, Fingerprint, Store};
///
/// let agent: ureq::Agent = ureq::Agent::config_builder()
///     .timeout_global(Some(Duration::from_secs(5)))
///     .http_status_as_error(false)
///     .build()
///     .into();
/// let outbox = Outbox::new(Arc::new(Store::open("device.redb")?));
/// let body = br#"{"amount":4999,"currency":"usd","customerId":"kiosk-7"}"#;
/// if let Claim::Acquired(mut intent) = outbox.begin("sale-1001", Fingerprint::of([&body[..]]))? {
///     let call = client::ureq::sender(&agent, "POST", "http://127.0.0.1:8080/payments", body, &[]);
///     let delivery = outbox.send(&mut intent, &RetryPolicy::new(), call)?;
///     println!("{delivery:?}");
/// }
/// # Ok::<(), idempotency_store::Error>(())
/// ```
pub fn sender<'a>(
    agent: &'a ::ureq::Agent,
    method: &'a str,
    url: &'a str,
    body: &'a [u8],
    headers: &'a [(&'a str, &'a str)],
) -> impl FnMut(&str, u32) -> Result<Response, Failure<::ureq::Error>> + 'a {
    move |key, _attempt| {
        let mut request = ::http::Request::builder()
            .method(method)
            .uri(url)
            .header("idempotency-key", format!("\"{key}\""));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(body)
            .map_err(|e| Failure::Refused(::ureq::Error::Http(e)))?;
        let mut answer = agent.run(request).map_err(failure)?;
        let status = answer.status().as_u16();
        let headers = answer
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect();
        let body = answer.body_mut().read_to_vec().map_err(Failure::NoAnswer)?;
        Ok(Response {
            status,
            headers,
            body,
        })
    }
}

/// Whether the request can have left: only a connection that was never made is `Refused`.
fn failure(err: ::ureq::Error) -> Failure<::ureq::Error> {
    let refused = match &err {
        ::ureq::Error::ConnectionFailed | ::ureq::Error::HostNotFound => true,
        ::ureq::Error::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::AddrNotAvailable
        ),
        _ => false,
    };
    if refused {
        Failure::Refused(err)
    } else {
        Failure::NoAnswer(err)
    }
}
