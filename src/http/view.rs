//! What the options' closures see of a request: the same view in the sync form and the layers
//! (tower and actix).

use ::http::{Extensions, HeaderMap, Method, Uri};

/// A borrowed view of a request with its whole body, as given to the scope function, the
/// fingerprint policies and the release rule of [`HandleOptions`](super::HandleOptions).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RequestView<'a> {
    /// The method.
    pub method: &'a Method,
    /// The request target.
    pub uri: &'a Uri,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The extensions, for example the authenticated principal an earlier middleware added.
    pub extensions: &'a Extensions,
    /// The body, as received.
    pub body: &'a [u8],
}

impl<'a> RequestView<'a> {
    /// The view of an `http` request whose body is bytes.
    #[must_use]
    pub fn of<B: AsRef<[u8]>>(request: &'a ::http::Request<B>) -> Self {
        RequestView {
            method: request.method(),
            uri: request.uri(),
            headers: request.headers(),
            extensions: request.extensions(),
            body: request.body().as_ref(),
        }
    }

    /// The request target without the host: path and query, as sent.
    #[must_use]
    pub fn target(&self) -> &'a str {
        self.uri
            .path_and_query()
            .map_or_else(|| self.uri.path(), ::http::uri::PathAndQuery::as_str)
    }
}
