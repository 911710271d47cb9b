//! The example programs as a newcomer meets them: `--help` prints the usage and exits 0, a bad
//! option's error names the option, the payments servers answer 405 with the `Allow`
//! header (RFC 9110 §15.5.6), and all serve `GET /metrics` in the Prometheus text format
//! after a replay, a conflict and a mismatch (each server a child process, since a process
//! has one global metrics recorder), and the async servers (axum, actix) settle the payments
//! in flight when SIGTERM stops them.
//!
//! The servers' option parsing is checked in this process (their files are compiled in);
//! the built binaries are run too when `cargo test` has built them (it builds the examples
//! before it runs any test, unless given `--test NAME`): a binary that is missing, or older
//! than its example's main source file, is skipped with a printed reason.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use redb::ReadableTable;

use crate::servers::SERVERS;
use crate::{actix_payments, axum_payments, client, payments_server};

/// The options every payments server documents in `--help`.
const SERVER_OPTIONS: [&str; 5] = ["--db", "--listen", "--wait-ms", "--lease-ms", "--delay-ms"];

fn clap_error(result: Result<(), Box<dyn std::error::Error + Send + Sync>>) -> clap::Error {
    let err = result.expect_err("parsing must stop");
    *err.downcast::<clap::Error>().expect("a clap error")
}

fn args(list: &[&str]) -> std::vec::IntoIter<String> {
    list.iter()
        .map(|s| (*s).to_owned())
        .collect::<Vec<_>>()
        .into_iter()
}

#[test]
fn server_options_have_help_and_errors_name_the_option() {
    for (name, run, threads) in SERVERS {
        let help = clap_error(run(args(&["--help"])));
        assert_eq!(help.kind(), clap::error::ErrorKind::DisplayHelp, "{name}");
        assert_eq!(help.exit_code(), 0, "{name} --help");
        let text = help.render().to_string();
        for option in SERVER_OPTIONS {
            assert!(
                text.contains(option),
                "{name} --help lacks {option}:\n{text}"
            );
        }
        assert_eq!(text.contains("--threads"), threads, "{name}:\n{text}");
        assert!(text.contains("Exit codes"), "{name}:\n{text}");

        let bad = clap_error(run(args(&["--wait-ms", "abc"])));
        assert_eq!(bad.exit_code(), 2);
        let message = bad.render().to_string();
        assert!(
            message.contains("invalid value 'abc' for '--wait-ms <MS>'"),
            "{name}: {message}"
        );
    }
}

#[test]
fn a_store_that_cannot_be_opened_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let db = dir.path().join("no-such-dir").join("payments.redb");
    let db = db.to_str().expect("utf-8 path");
    for (name, run, _) in SERVERS {
        let err = run(args(&["--db", db, "--listen", "127.0.0.1:0"])).expect_err("no directory");
        let text = err.to_string();
        assert!(
            text.starts_with(&format!("cannot open the store file {db}: ")),
            "{name}: {text}"
        );
        assert!(text.contains("No such file or directory"), "{name}: {text}");
    }
}

#[test]
fn an_address_that_cannot_be_bound_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    for (name, run, _) in SERVERS {
        let db = dir.path().join(format!("{name}.redb"));
        let db = db.to_str().expect("utf-8");
        let err = run(args(&["--db", db, "--listen", &addr])).expect_err("address in use");
        assert!(
            err.to_string()
                .starts_with(&format!("cannot listen on {addr}: ")),
            "{name}: {err}"
        );
    }
}

/// Sends `request` to `addr` and returns the response head (status line and headers).
fn head(addr: std::net::SocketAddr, request: &str) -> Vec<String> {
    let mut stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    stream.write_all(request.as_bytes()).expect("send");
    let mut reply = Vec::new();
    let _ = stream.read_to_end(&mut reply);
    let reply = String::from_utf8_lossy(&reply).into_owned();
    let head = reply.split("\r\n\r\n").next().unwrap_or_default();
    head.lines().map(str::to_owned).collect()
}

/// The `Allow` values of a response head.
fn allow(head: &[String]) -> Vec<String> {
    head.iter()
        .filter_map(|line| line.split_once(':'))
        .filter(|(name, _)| name.eq_ignore_ascii_case("allow"))
        .map(|(_, value)| value.trim().to_owned())
        .collect()
}

/// (method, path, the one `Allow` value of its 405).
const NOT_ALLOWED: [(&str, &str, &str); 4] = [
    ("GET", "/payments", "POST"),
    ("DELETE", "/payments", "POST"),
    ("POST", "/ledger", "GET"),
    ("PUT", "/payments/pay_1", "GET"),
];

fn request(method: &str, path: &str) -> String {
    format!("{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
}

/// Every request of `NOT_ALLOWED` to `addr` gets 405 with its one `Allow` value; `label`
/// begins each failure's message.
fn assert_405s(addr: std::net::SocketAddr, label: &str) {
    for (method, path, allowed) in NOT_ALLOWED {
        let head = head(addr, &request(method, path));
        assert!(
            head[0].contains(" 405 "),
            "{label}{method} {path}: {head:?}"
        );
        assert_eq!(allow(&head), [allowed], "{label}{method} {path}: {head:?}");
    }
}

#[test]
fn every_server_answers_405_with_allow() {
    let dir = tempfile::tempdir().expect("tempdir");
    let open = |name: &str| {
        let store = payments_server::server::store_builder()
            .open(dir.path().join(name))
            .expect("store");
        let options = payments_server::server::Options {
            wait: Duration::ZERO,
            charge_delay: Duration::ZERO,
            threads: 2,
        };
        payments_server::server::Payments::open(store, options).expect("payments")
    };

    let running = payments_server::server::start(open("sync.redb"), "127.0.0.1:0").expect("start");
    assert_405s(running.addr(), "");

    let axum_payments = axum_payments::server::Payments::open(
        axum_payments::server::store_builder()
            .open(dir.path().join("axum.redb"))
            .expect("store"),
        axum_payments::server::Options {
            wait: Duration::ZERO,
            charge_delay: Duration::ZERO,
            threads: 1,
        },
    )
    .expect("payments");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (app, _drain) = axum_payments::app(Arc::new(axum_payments));
    runtime.spawn(async move { axum::serve(listener, app).await });
    assert_405s(addr, "axum ");

    let actix_payments = Arc::new(
        actix_payments::server::Payments::open(
            actix_payments::server::store_builder()
                .open(dir.path().join("actix.redb"))
                .expect("store"),
            actix_payments::server::Options {
                wait: Duration::ZERO,
                charge_delay: Duration::ZERO,
                threads: 1,
            },
        )
        .expect("payments"),
    );
    let idempotency = idempotency_store::http::actix::Idempotency::shared(
        actix_payments.store(),
        actix_payments.idempotency(),
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    // Serves until this test process ends.
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let routes = move || {
                let routes =
                    actix_payments::routes(Arc::clone(&actix_payments), idempotency.clone());
                actix_web::App::new().configure(routes)
            };
            let server = actix_web::HttpServer::new(routes)
                .workers(1)
                .disable_signals()
                .listen(listener)
                .expect("listen");
            server.run().await
        })
    });
    assert_405s(addr, "actix ");
}

/// A built example binary, if `cargo test` built it from the current source.
fn example(name: &str) -> Option<PathBuf> {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_idempotency-store"));
    let path = bin.parent()?.join("examples").join(name);
    let built = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
    let source = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/");
    let changed = std::fs::metadata(format!("{source}{name}.rs"))
        .and_then(|m| m.modified())
        .ok();
    match (built, changed) {
        (Some(built), Some(changed)) if built >= changed => Some(path),
        _ => {
            eprintln!("skipped {name}: not built from its current source (run `cargo test`)");
            None
        }
    }
}

#[test]
fn every_example_that_takes_options_answers_help_with_exit_0() {
    for name in [
        "payments_server",
        "axum_payments",
        "actix_payments",
        "loadtest",
        "http_bench",
    ] {
        let Some(path) = example(name) else { continue };
        for flag in ["--help", "-h"] {
            let output = Command::new(&path).arg(flag).output().expect("run");
            let stdout = String::from_utf8_lossy(&output.stdout);
            assert_eq!(output.status.code(), Some(0), "{name} {flag}: {stdout}");
            assert!(
                stdout.to_lowercase().contains("usage"),
                "{name} {flag}: {stdout}"
            );
        }
    }
    if let Some(path) = example("payments_server") {
        let output = Command::new(path)
            .args(["--wait-ms", "abc"])
            .output()
            .expect("run");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("invalid value 'abc' for '--wait-ms <MS>'"),
            "{stderr}"
        );
    }
}

// ---------------------------------------------------------------- GET /metrics, in children

const CHILD_SERVER: &str = "EXAMPLES_CHILD_SERVER";
const CHILD_DB: &str = "EXAMPLES_CHILD_DB";

/// Not a test on its own: the parent runs this binary with `CHILD_SERVER` (a name in
/// `SERVERS`) and `CHILD_DB` set, and this function then serves until it is killed, with a
/// charge slow enough for a duplicate to arrive while it runs. Without them it returns at once.
#[test]
fn example_server_child() {
    let (Ok(name), Ok(db)) = (std::env::var(CHILD_SERVER), std::env::var(CHILD_DB)) else {
        return;
    };
    let (_, run, _) = SERVERS
        .into_iter()
        .find(|(server, _, _)| *server == name)
        .expect("a server of SERVERS");
    let options = [
        "--db",
        &db,
        "--listen",
        "127.0.0.1:0",
        "--wait-ms",
        "0",
        "--delay-ms",
        "1000",
    ];
    run(args(&options)).expect("serve");
}

/// An example server in a child process, killed when dropped.
struct ChildServer {
    child: Child,
    addr: std::net::SocketAddr,
    /// The lines it prints after `listening on`.
    lines: std::sync::mpsc::Receiver<String>,
}

impl ChildServer {
    fn start(name: &str, db: &std::path::Path) -> ChildServer {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "examples::example_server_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_SERVER, name)
            .env(CHILD_DB, db)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the server");
        // Read in a thread, so that a server that never comes up fails the test instead of
        // hanging it, and go on draining so the child never blocks on the pipe.
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let addr = loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("{name} did not start listening within 60 s"));
            // libtest may have printed "test example_server_child ... " on the same line.
            if let Some((_, addr)) = line.split_once("listening on http://") {
                break addr.trim().parse().expect("address");
            }
        };
        ChildServer {
            child,
            addr,
            lines: rx,
        }
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of the one sample of `name` whose labels include every one of `labels` (as
/// `key="value"`) in a Prometheus text page.
fn sample(page: &str, name: &str, labels: &[&str]) -> Option<f64> {
    let mut found = page.lines().filter_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (metric, rest) = series.split_once('{')?;
        let wanted = metric == name && labels.iter().all(|label| rest.contains(label));
        wanted.then(|| value.parse::<f64>().ok()).flatten()
    });
    let value = found.next();
    assert!(
        found.next().is_none(),
        "{name} {labels:?} twice in:\n{page}"
    );
    value
}

#[test]
fn every_server_serves_metrics_after_a_replay_a_conflict_and_a_mismatch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let body = r#"{"amount": 4999, "currency": "usd", "customerId": "cus_123"}"#;
    let other = r#"{"amount": 1, "currency": "usd", "customerId": "cus_123"}"#;
    let servers: Vec<ChildServer> = SERVERS
        .iter()
        .map(|(name, _, _)| ChildServer::start(name, &dir.path().join(format!("{name}.redb"))))
        .collect();
    for ((name, _, _), server) in SERVERS.iter().zip(&servers) {
        let http = client::Client::new(server.addr);
        let post = |body: &str| http.post("/payments", Some("order-1"), body).expect("post");
        let (first, duplicate) = std::thread::scope(|s| {
            let first = s.spawn(|| post(body));
            // The first holds the key for its one-second charge.
            std::thread::sleep(Duration::from_millis(300));
            let duplicate = post(body);
            (first.join().expect("first"), duplicate)
        });
        assert_eq!((first.status, duplicate.status), (201, 409), "{name}");
        let replay = post(body);
        assert_eq!(replay.status, 201, "{name}");
        assert!(replay.replayed(), "{name}: {replay:?}");
        assert_eq!(post(other).status, 422, "{name}");

        let page = http.get("/metrics").expect("GET /metrics");
        assert_eq!(page.status, 200, "{name}");
        assert_eq!(
            page.header("content-type"),
            Some("text/plain; version=0.0.4"),
            "{name}"
        );
        for outcome in ["acquired", "in_progress", "replayed", "mismatch"] {
            let label = format!("outcome=\"{outcome}\"");
            let value = sample(
                &page.body,
                "idempotency_claims_total",
                &["backend=\"redb\"", &label],
            );
            assert_eq!(value, Some(1.0), "{name} {outcome}:\n{}", page.body);
        }
        let completes = sample(&page.body, "idempotency_completes_total", &[]);
        assert_eq!(completes, Some(1.0), "{name}:\n{}", page.body);
        // The four claims' latencies, as a histogram (bucket counts sum across instances).
        let timed = sample(&page.body, "idempotency_claim_seconds_count", &[]);
        assert_eq!(timed, Some(4.0), "{name}:\n{}", page.body);
        let all = sample(
            &page.body,
            "idempotency_claim_seconds_bucket",
            &["le=\"+Inf\""],
        );
        assert_eq!(all, Some(4.0), "{name}:\n{}", page.body);
        let overlay = sample(&page.body, "idempotency_overlay_records", &[]);
        assert!(
            overlay.is_some(),
            "{name}: the gauges are set:\n{}",
            page.body
        );

        let refused = http
            .send("POST", "/metrics", &[], b"")
            .expect("POST /metrics");
        assert_eq!(refused.status, 405, "{name}");
        let allow = refused.header("allow").unwrap_or_default();
        assert!(
            allow.split(',').any(|m| m.trim() == "GET"),
            "{name}: {allow}"
        );
        assert!(!allow.contains("POST"), "{name}: {allow}");
    }
}

/// SIGTERM while two payments are in flight (each charge takes 1 s; one client waits for its
/// answer, the other has hung up): the async servers drain their layer before they exit, so
/// both keys are completed with one ledger row each and none is left in progress, and the
/// client still waiting gets its answer.
#[test]
fn the_async_servers_settle_the_payments_in_flight_on_sigterm() {
    let dir = tempfile::tempdir().expect("tempdir");
    let body = r#"{"amount": 4999, "currency": "usd", "customerId": "cus_123"}"#;
    for name in ["axum_payments", "actix_payments"] {
        let db = dir.path().join(format!("{name}.redb"));
        let mut server = ChildServer::start(name, &db);
        let addr = server.addr;
        let waiting = std::thread::spawn(move || {
            let http = client::Client::new(addr).with_timeout(Duration::from_secs(30));
            http.post("/payments", Some("waiting"), body)
        });
        let mut gone = TcpStream::connect(addr).expect("connect");
        let head = format!(
            "POST /payments HTTP/1.1\r\nHost: {addr}\r\nIdempotency-Key: \"gone\"\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        gone.write_all(head.as_bytes()).expect("send");
        // Both charges are under way (they take 1 s); one client hangs up.
        std::thread::sleep(Duration::from_millis(500));
        drop(gone);
        let pid = libc::pid_t::try_from(server.child.id()).expect("pid");
        // SAFETY: a signal to the child this test started and has not reaped.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0, "{name}: kill");
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = server.child.try_wait().expect("wait") {
                break status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name} still runs 30 s after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(status.success(), "{name}: {status}");
        let reply = waiting.join().expect("client").expect("answer");
        assert_eq!(reply.status, 201, "{name}: {reply:?}");
        let printed: Vec<String> = server.lines.try_iter().collect();
        let drained = printed
            .iter()
            .find(|line| line.contains("drained: "))
            .unwrap_or_else(|| panic!("{name} printed no drain report: {printed:?}"));
        assert!(
            drained.ends_with(" 0 left in progress"),
            "{name}: {drained}"
        );
        if name == "actix_payments" {
            // It drains before the server stops: both were in flight.
            assert!(
                drained.contains("drained: 2 in flight, 2 finished"),
                "{drained}"
            );
        }

        let store = actix_payments::server::store_builder()
            .open(&db)
            .expect("reopen");
        for key in ["waiting", "gone"] {
            let key = idempotency_store::Key::new(key).expect("key");
            let state = store.lookup(&key).expect("lookup").map(|r| r.state);
            assert!(
                matches!(
                    state,
                    Some(idempotency_store::RecordState::Completed { .. })
                ),
                "{name} {key}: {state:?}"
            );
        }
        let mut charged = store
            .read_with(|txn| -> Result<Vec<String>, redb::Error> {
                let mut keys = Vec::new();
                for row in txn.open_table(actix_payments::server::LEDGER)?.iter()? {
                    keys.push(row?.1.value().0.to_owned());
                }
                Ok(keys)
            })
            .expect("read")
            .expect("ledger rows");
        charged.sort();
        assert_eq!(charged, ["gone", "waiting"], "{name}");
    }
}
