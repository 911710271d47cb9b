//! axum with `IdempotencyLayer`.

use std::sync::Arc;

use axum::http::{StatusCode, header};
use idempotency_store::IdempotencyStore;
use idempotency_store::http::HandleOptions;
use idempotency_store::http::tower::IdempotencyLayer;

use super::{Handler, Server};

pub fn start(
    store: Arc<dyn IdempotencyStore>,
    options: HandleOptions,
    handler: Arc<Handler>,
) -> Server {
    serve(move || {
        let create = move || {
            let handler = Arc::clone(&handler);
            async move {
                let body = handler.run().await;
                (
                    StatusCode::CREATED,
                    [(header::CONTENT_TYPE, "text/plain")],
                    body,
                )
            }
        };
        axum::Router::new()
            .route("/payments", axum::routing::post(create))
            .layer(IdempotencyLayer::shared(store, options))
    })
}

/// Serves the router `app` builds (on the server's runtime) on a port of its own, from a
/// runtime with two workers on a thread of its own.
pub fn serve(app: impl FnOnce() -> axum::Router + Send + 'static) -> Server {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    listener.set_nonblocking(true).expect("nonblocking");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
            let app = app();
            tokio::select! {
                served = axum::serve(listener, app) => served.expect("serve"),
                _ = stopped => {}
            }
        });
    });
    Server::new(
        addr,
        Box::new(move || {
            let _ = stop.send(());
        }),
        thread,
    )
}
