//! actix-web with the `Idempotency` middleware.

use std::net::TcpListener;
use std::sync::Arc;

use actix_web::{App, HttpResponse, HttpServer, web};
use idempotency_store::IdempotencyStore;
use idempotency_store::http::HandleOptions;
use idempotency_store::http::actix::Idempotency;

use super::{Handler, Server};

pub fn start(
    store: Arc<dyn IdempotencyStore>,
    options: HandleOptions,
    handler: Arc<Handler>,
) -> Server {
    serve(move |listener| {
        // One middleware for both workers: they share its admission.
        let idempotency = Idempotency::shared(store, options);
        HttpServer::new(move || {
            let handler = Arc::clone(&handler);
            App::new().wrap(idempotency.clone()).route(
                "/payments",
                web::post().to(move || {
                    let handler = Arc::clone(&handler);
                    async move {
                        let body = handler.run().await;
                        HttpResponse::Created()
                            .content_type("text/plain")
                            .body(body)
                    }
                }),
            )
        })
        .workers(2)
        .disable_signals()
        .listen(listener)
        .expect("listen")
        .run()
    })
}

/// Runs the server `server` builds on the listener it is given (a port of its own), in an
/// actix system on a thread of its own.
pub fn serve(
    server: impl FnOnce(TcpListener) -> actix_web::dev::Server + Send + 'static,
) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (handle_tx, handle_rx) = std::sync::mpsc::channel();
    let thread = std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let server = server(listener);
            handle_tx.send(server.handle()).expect("handle");
            server.await.expect("serve");
        });
    });
    let handle = handle_rx.recv().expect("the server started");
    Server::new(
        addr,
        Box::new(move || {
            // The stop command is sent when `stop` is called; the thread ends with the server.
            drop(handle.stop(false));
        }),
        thread,
    )
}
