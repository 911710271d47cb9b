//! `PgStore` over TLS, against the CI server that `.ci/run` gives a fresh self-signed
//! certificate for 127.0.0.1/localhost: `sslmode=require` and `verify-full` (trusting that
//! certificate) connect and encrypt, `disable` stays plain TCP, and `verify-full` trusting an
//! unrelated certificate fails with an error that says what was checked.
//!
//! Needs `IDEMPOTENCY_PG_URL`, `IDEMPOTENCY_PG_TLS_CA` (the server's certificate) and
//! `IDEMPOTENCY_PG_TLS_WRONG_CA` (another one); skipped with a printed reason without them,
//! failed under `CI=true`.
#![cfg(feature = "postgres")]

use idempotency_store::{Claim, Error, Fingerprint, IdempotencyStore, Key, Response, pg::PgStore};

struct Server {
    url: String,
    ca: String,
    wrong_ca: String,
}

fn server() -> Option<Server> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    match (
        var("IDEMPOTENCY_PG_URL"),
        var("IDEMPOTENCY_PG_TLS_CA"),
        var("IDEMPOTENCY_PG_TLS_WRONG_CA"),
    ) {
        (Some(url), Some(ca), Some(wrong_ca)) => Some(Server { url, ca, wrong_ca }),
        _ if std::env::var("CI").is_ok_and(|v| v == "true") => panic!(
            "CI=true but IDEMPOTENCY_PG_URL, IDEMPOTENCY_PG_TLS_CA or IDEMPOTENCY_PG_TLS_WRONG_CA \
             is not set: .ci/run configures the server's TLS and exports them"
        ),
        _ => {
            eprintln!(
                "skipped: IDEMPOTENCY_PG_URL, IDEMPOTENCY_PG_TLS_CA and \
                 IDEMPOTENCY_PG_TLS_WRONG_CA must be set; see .ci/run"
            );
            None
        }
    }
}

/// `url` with extra connection options, in whichever of the two formats it is written.
fn with_options(url: &str, options: &[(&str, &str)]) -> String {
    let mut url = url.to_owned();
    for (key, value) in options {
        if url.starts_with("postgres") {
            let sep = if url.contains('?') { '&' } else { '?' };
            url = format!("{url}{sep}{key}={value}");
        } else {
            url = format!("{url} {key}='{value}'");
        }
    }
    url
}

/// Whether the pooled connections named `application_name` are encrypted (asked over a plain
/// connection of the test's own).
fn encrypted(url: &str, application_name: &str) -> Vec<bool> {
    let mut admin = postgres::Client::connect(url, postgres::NoTls).expect("admin connection");
    admin
        .query(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) \
             WHERE a.application_name = $1",
            &[&application_name],
        )
        .expect("pg_stat_ssl")
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// Connects with `options`, runs a claim and a completion, and reports whether the pooled
/// connection is encrypted.
fn round_trip(
    server: &Server,
    test: &str,
    options: &[(&str, &str)],
) -> idempotency_store::Result<bool> {
    let name = format!("tls_{test}_{}", std::process::id());
    let mut all = vec![("application_name", name.as_str())];
    all.extend_from_slice(options);
    let store = PgStore::builder()
        .schema(name.as_str())
        .pool_size(1)
        .connect(&with_options(&server.url, &all))?;
    let key = Key::new("tls-key")?;
    let Claim::Acquired(lease) = store.claim(&key, Fingerprint::of(["tls"]))? else {
        panic!("not acquired");
    };
    store.complete(&lease, Response::new(200, "over tls"))?;
    assert!(matches!(
        store.claim(&key, Fingerprint::of(["tls"]))?,
        Claim::Completed(r) if r.response.body == b"over tls"
    ));
    let states = encrypted(&server.url, &name);
    assert_eq!(states.len(), 1, "one pooled connection: {states:?}");
    drop(store);
    let mut admin = postgres::Client::connect(&server.url, postgres::NoTls).expect("admin");
    admin
        .batch_execute(&format!("DROP SCHEMA IF EXISTS \"{name}\" CASCADE"))
        .expect("drop schema");
    Ok(states[0])
}

#[test]
fn require_encrypts() -> idempotency_store::Result<()> {
    let Some(server) = server() else {
        return Ok(());
    };
    assert!(round_trip(&server, "require", &[("sslmode", "require")])?);
    Ok(())
}

#[test]
fn verify_full_with_the_servers_ca_encrypts() -> idempotency_store::Result<()> {
    let Some(server) = server() else {
        return Ok(());
    };
    let options = [
        ("sslmode", "verify-full"),
        ("sslrootcert", server.ca.as_str()),
    ];
    assert!(round_trip(&server, "verify_full", &options)?);
    Ok(())
}

#[test]
fn verify_ca_with_the_servers_ca_encrypts() -> idempotency_store::Result<()> {
    let Some(server) = server() else {
        return Ok(());
    };
    let options = [
        ("sslmode", "verify-ca"),
        ("sslrootcert", server.ca.as_str()),
    ];
    assert!(round_trip(&server, "verify_ca", &options)?);
    Ok(())
}

#[test]
fn disable_stays_plain_tcp() -> idempotency_store::Result<()> {
    let Some(server) = server() else {
        return Ok(());
    };
    assert!(!round_trip(&server, "disable", &[("sslmode", "disable")])?);
    Ok(())
}

#[test]
fn verify_full_with_a_wrong_ca_fails_and_says_why() {
    let Some(server) = server() else { return };
    let url = with_options(
        &server.url,
        &[
            ("sslmode", "verify-full"),
            ("sslrootcert", &server.wrong_ca),
        ],
    );
    let err = PgStore::connect(&url).expect_err("connected although the CA is wrong");
    let mut chain = vec![err.to_string()];
    let mut cause = std::error::Error::source(&err);
    while let Some(c) = cause {
        chain.push(c.to_string());
        cause = c.source();
    }
    let text = chain.join(": ");
    println!("verify-full with a wrong CA: {text}");
    assert!(matches!(err, Error::Storage { .. }), "{err:?}");
    assert!(
        text.contains("sslmode=verify-full")
            && text.contains("must be signed by a certificate in sslrootcert"),
        "{text}"
    );
    // rustls's words for a chain that does not verify.
    assert!(text.contains("invalid peer certificate"), "{text}");
}
