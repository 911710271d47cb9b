//! What only the actix middleware has (the behaviour it shares with the tower layer is in
//! `tests/http/http_adapters.rs`): a `NotFinal` in actix's own response extensions releases the
//! key, and an error the inner service returns instead of a response is the answer, stored and
//! replayed.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use actix_web::{App, HttpResponse, test, web};
use idempotency_store::Store;
use idempotency_store::http::actix::Idempotency;
use idempotency_store::http::{HandleOptions, NotFinal};

fn post(key: &str) -> actix_web::test::TestRequest {
    test::TestRequest::post()
        .uri("/payments")
        .insert_header(("idempotency-key", format!("\"{key}\"")))
        .set_payload(r#"{"amount": 4999}"#)
}

fn middleware() -> Idempotency {
    Idempotency::new(
        Store::builder().open_in_memory().expect("store"),
        HandleOptions::new(),
    )
}

#[test]
fn a_release_in_actix_extensions_lets_the_retry_run() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    actix_web::rt::System::new().block_on(async move {
        let handler = move || {
            counted.fetch_add(1, Ordering::SeqCst);
            async {
                let mut response = HttpResponse::BadRequest().body("fix the card number");
                response.extensions_mut().insert(NotFinal);
                response
            }
        };
        let app = App::new()
            .wrap(middleware())
            .route("/payments", web::post().to(handler));
        let app = test::init_service(app).await;
        for _ in 0..2 {
            let answer = test::call_service(&app, post("declined").to_request()).await;
            assert_eq!(answer.status(), 400);
            assert!(!answer.headers().contains_key("idempotent-replayed"));
        }
    });
    assert_eq!(runs.load(Ordering::SeqCst), 2, "released: the retry runs");
}

#[test]
fn an_inner_error_is_the_stored_answer() {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    actix_web::rt::System::new().block_on(async move {
        // The middleware outside (wrapped last), a service returning an error inside it.
        let app = App::new()
            .route("/payments", web::post().to(HttpResponse::Created))
            .wrap_fn(move |_, _| {
                counted.fetch_add(1, Ordering::SeqCst);
                async {
                    Err::<actix_web::dev::ServiceResponse, _>(
                        actix_web::error::ErrorServiceUnavailable("the ledger is down"),
                    )
                }
            })
            .wrap(middleware());
        let app = test::init_service(app).await;
        let first = test::try_call_service(&app, post("erring").to_request()).await;
        let first = first.expect_err("the inner error comes back as an error");
        let first = first.error_response();
        assert_eq!(first.status(), 503);
        let body = actix_web::body::to_bytes(first.into_body())
            .await
            .expect("body");
        assert_eq!(&body[..], b"the ledger is down");
        let again = test::call_service(&app, post("erring").to_request()).await;
        assert_eq!(again.status(), 503);
        let replayed = again.headers().get("idempotent-replayed");
        assert_eq!(replayed.map(|v| v.as_bytes()), Some(&b"true"[..]));
        assert_eq!(&test::read_body(again).await[..], b"the ledger is down");
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
