//! The client half end to end, with real processes: `examples/edge_client.rs` queues payments
//! and sends them through `Outbox::begin`/`send`/`finish` to `examples/axum_payments.rs`,
//! which loses every third answer after the charge (`--drop-answers 3`) and is itself killed
//! with SIGKILL and restarted now and then. The client is SIGKILLed many times: at named
//! points (after `begin`, before a request goes out, after its answer arrived but before it is
//! recorded and finished) and at random moments, and restarted on the same file each time.
//!
//! At the end the server's ledger (read from its file) must hold exactly one charge per
//! operation, and every intent must be finished with the answer the server stored for its
//! key. The same run with `--fresh-key-per-retry` (the classic mistake: a new key per
//! attempt) must show double charges: the negative control that proves the check can fail.
//!
//! Apart from that soak, one client is SIGKILLed while its request is in flight (the server is
//! inside a 2.5 s charge) and restarted at once: it must get its answer within 1 s of the
//! charge finishing, with one charge (issue 39).
//!
//! Each test binary role runs in child mode: this binary with `EDGE_ROLE` set.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use idempotency_store::IdempotencyStore;
use idempotency_store::client::SCOPE;
use idempotency_store::redb::{self, ReadableTable};
use idempotency_store::{Key, RecordState, Response, Store};

#[allow(dead_code)] // its `main` is not used here
#[path = "../../examples/axum_payments.rs"]
mod axum_payments;

#[allow(dead_code)] // its `main` is not used here
#[path = "../../examples/edge_client.rs"]
mod edge_client;

// The sync server, for the control of the kill mid-request. It includes the service's files
// as `axum_payments` does: two copies of the same modules, each server using its own.
#[allow(dead_code, clippy::duplicate_mod)] // its `main` is not used here
#[path = "../../examples/payments_server.rs"]
mod payments_server;

#[allow(dead_code)]
#[path = "../../examples/payments_service/client.rs"]
mod http_client;

use axum_payments::server::LEDGER;

const ROLE: &str = "EDGE_ROLE";
const ARGS: &str = "EDGE_ARGS";
const PAYMENTS: u32 = 40;
/// Client runs with a kill scheduled, before the one that is let finish.
const KILLED_RUNS: usize = 24;

// ---------------------------------------------------------------- the child processes

/// Not a test on its own: with `EDGE_ROLE` set the parent runs this binary as the server or
/// the client. Without it, it returns at once.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let args: Vec<String> = std::env::var(ARGS)
        .unwrap_or_default()
        .split('\u{1f}')
        .map(str::to_owned)
        .collect();
    match role.as_str() {
        "server" => axum_payments::run(args.into_iter()).expect("axum_payments"),
        "sync-server" => payments_server::run(args.into_iter()).expect("payments_server"),
        "client" => {
            let parsed = <edge_client::Args as clap::Parser>::try_parse_from(
                std::iter::once("edge_client".to_owned()).chain(args),
            )
            .expect("edge_client args");
            if let Err(err) = edge_client::run(&parsed) {
                eprintln!("edge_client: {err}");
                std::process::exit(1);
            }
        }
        other => panic!("unknown role {other}"),
    }
}

fn spawn(role: &str, args: &[String], env: &[(&str, String)]) -> Child {
    let mut command = Command::new(std::env::current_exe().expect("test binary"));
    command
        .args([
            "--exact",
            "edge_client_crash::child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE, role)
        .env(ARGS, args.join("\u{1f}"))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    for (name, value) in env {
        command.env(name, value);
    }
    command.spawn().expect("spawn a child")
}

/// The payments server on a fixed port (restarts keep the address the client knows).
struct Server {
    child: Child,
}

impl Server {
    fn start(db: &Path, port: u16, drop_answers: u32) -> Server {
        let args = [
            "--db".to_owned(),
            db.display().to_string(),
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
            "--lease-ms".to_owned(),
            "1000".to_owned(),
            "--drop-answers".to_owned(),
            drop_answers.to_string(),
        ];
        Server::start_with(&args)
    }

    /// The server with these options (`--db` and `--listen` among them).
    fn start_with(args: &[String]) -> Server {
        Server::start_as("server", args)
    }

    /// `role`'s server (`server`: `axum_payments`; `sync-server`: `payments_server`).
    fn start_as(role: &str, args: &[String]) -> Server {
        let mut child = spawn(role, args, &[]);
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if line.contains("listening on http://") {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the server did not start listening within 60 s");
        Server { child }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// How a client run ended.
#[derive(Debug, PartialEq)]
enum Ended {
    Delivered,
    Killed,
}

/// One client run; `kill` says how it ends early. A run that exits with an error fails the
/// test: nothing in this scenario excuses one.
fn client_run(device: &Path, port: u16, fresh_keys: bool, kill: Kill) -> Ended {
    let mut args = vec![
        "--db".to_owned(),
        device.display().to_string(),
        "--server".to_owned(),
        format!("http://127.0.0.1:{port}"),
        "--payments".to_owned(),
        PAYMENTS.to_string(),
        "--timeout-ms".to_owned(),
        "400".to_owned(),
        "--max-seconds".to_owned(),
        "90".to_owned(),
    ];
    if fresh_keys {
        args.push("--fresh-key-per-retry".to_owned());
    }
    let env = match kill {
        Kill::At(point, nth) => vec![("EDGE_CLIENT_CRASH_AT", format!("{point}:{nth}"))],
        Kill::After(_) | Kill::Never => Vec::new(),
    };
    let mut child = spawn("client", &args, &env);
    let out = BufReader::new(child.stdout.take().expect("stdout"));
    std::thread::spawn(move || out.lines().map_while(Result::ok).for_each(drop));
    let deadline = Instant::now() + Duration::from_secs(120);
    let killed_at = match kill {
        Kill::After(delay) => Some(Instant::now() + delay),
        _ => None,
    };
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            use std::os::unix::process::ExitStatusExt;
            if status.signal() == Some(9) {
                return Ended::Killed;
            }
            assert!(status.success(), "a client run failed: {status}");
            return Ended::Delivered;
        }
        let now = Instant::now();
        if killed_at.is_some_and(|at| now >= at) || now >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            assert!(now < deadline, "a client run did not end within 120 s");
            return Ended::Killed;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[derive(Clone, Copy, Debug)]
enum Kill {
    /// The client kills itself the Nth time it reaches the point.
    At(&'static str, u32),
    /// The parent kills it after this long.
    After(Duration),
    Never,
}

/// A cheap pseudo-random sequence (no dependency): the kill schedule need not be secret.
fn schedule(round: usize) -> Kill {
    let points = ["after-begin", "before-request", "after-request"];
    let mixed = (round as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 33;
    match round % 4 {
        3 => Kill::After(Duration::from_millis(30 + mixed % 600)),
        n => Kill::At(points[n], 1 + (mixed % 4) as u32),
    }
}

/// What the run left: per operation, the ledger's charges and the intent's final answer.
struct Outcome {
    charges: BTreeMap<String, Vec<String>>,
    finished: BTreeMap<String, Response>,
    stored: BTreeMap<String, Response>,
    client_kills: usize,
    server_restarts: usize,
}

fn run(fresh_keys: bool) -> Outcome {
    let dir = tempfile::tempdir().expect("temp dir");
    let (server_db, device): (PathBuf, PathBuf) = (
        dir.path().join("server.redb"),
        dir.path().join("device.redb"),
    );
    let port = free_port();
    let mut server = Server::start(&server_db, port, 3);
    let (mut client_kills, mut server_restarts) = (0, 0);
    for round in 0..KILLED_RUNS {
        if round % 5 == 4 {
            server.kill();
            server = Server::start(&server_db, port, 3);
            server_restarts += 1;
        }
        if client_run(&device, port, fresh_keys, schedule(round)) == Ended::Killed {
            client_kills += 1;
        }
    }
    assert_eq!(
        client_run(&device, port, fresh_keys, Kill::Never),
        Ended::Delivered
    );
    server.kill();
    Outcome {
        charges: charges(&server_db),
        finished: finished(&device),
        stored: stored(&server_db),
        client_kills,
        server_restarts,
    }
}

/// The ledger from the server's file: the idempotency keys charged, per customer (which the
/// client sets to the operation id).
fn charges(db: &Path) -> BTreeMap<String, Vec<String>> {
    let store = axum_payments::server::store_builder()
        .open(db)
        .expect("reopen the server's file");
    let rows = store
        .read_with(|txn| -> Result<Vec<(String, String)>, redb::Error> {
            let mut rows = Vec::new();
            for row in txn.open_table(LEDGER)?.iter()? {
                let (_, value) = row?;
                let (key, _, _, customer) = value.value();
                rows.push((customer.to_owned(), key.to_owned()));
            }
            Ok(rows)
        })
        .expect("read")
        .expect("ledger rows");
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (customer, key) in rows {
        out.entry(customer).or_default().push(key);
    }
    out
}

/// The server's stored answer for every completed key.
fn stored(db: &Path) -> BTreeMap<String, Response> {
    let store = axum_payments::server::store_builder()
        .open_read_only(db)
        .expect("open the server's file");
    completed(&store, None)
}

/// Every finished intent's answer, by operation id.
fn finished(db: &Path) -> BTreeMap<String, Response> {
    let store = Store::builder()
        .open_read_only(db)
        .expect("open the device's file");
    completed(&store, Some(SCOPE))
}

fn completed(store: &Store, scope: Option<&str>) -> BTreeMap<String, Response> {
    let mut out = BTreeMap::new();
    for record in store.records().expect("records") {
        let record = record.expect("record");
        if record.key.scope() != scope {
            continue;
        }
        if let RecordState::Completed { response, .. } = record.record.state {
            out.insert(record.key.key().to_owned(), response);
        }
    }
    out
}

#[test]
fn every_payment_is_charged_once_across_client_and_server_crashes() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let outcome = run(false);
    eprintln!(
        "edge_client_crash: {} client kills, {} server restarts, {} operations",
        outcome.client_kills,
        outcome.server_restarts,
        outcome.charges.len()
    );
    assert!(
        outcome.client_kills >= KILLED_RUNS / 2,
        "too few kills landed"
    );
    assert_eq!(outcome.charges.len(), PAYMENTS as usize);
    for n in 1..=PAYMENTS {
        let id = format!("sale-{n}");
        let keys = &outcome.charges[&id];
        assert_eq!(keys.len(), 1, "{id} charged {} times: {keys:?}", keys.len());
        let answer = outcome
            .finished
            .get(&id)
            .unwrap_or_else(|| panic!("{id} not finished"));
        let server = &outcome.stored[&keys[0]];
        assert_eq!(answer.status, 201, "{id}");
        assert_eq!(
            answer.body, server.body,
            "{id}: finished with another answer"
        );
        Key::new(&keys[0]).expect("the key is a valid key");
    }
}

/// The negative control: with a fresh key per attempt, lost answers charge twice.
#[test]
fn a_fresh_key_per_retry_charges_twice() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    let outcome = run(true);
    let doubles: Vec<_> = outcome
        .charges
        .iter()
        .filter(|(_, keys)| keys.len() > 1)
        .map(|(id, keys)| format!("{id}×{}", keys.len()))
        .collect();
    eprintln!("edge_client_crash (fresh keys): double charges {doubles:?}");
    assert!(
        !doubles.is_empty(),
        "no double charge: the check could not fail"
    );
}

// ---------------------------------------------------------------- killed mid-request

/// How long the charge takes on the server (`--delay-ms`): the client dies inside it.
const SLOW_CHARGE: Duration = Duration::from_millis(2500);

/// The client's stdout, line by line, with the moment each arrived.
fn timed_lines(child: &mut Child) -> std::sync::mpsc::Receiver<(Instant, String)> {
    let out = BufReader::new(child.stdout.take().expect("stdout"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines().map_while(Result::ok) {
            let _ = tx.send((Instant::now(), line));
        }
    });
    rx
}

/// The value of one counter series in a Prometheus text page (0 if absent).
fn counter(page: &str, series: &str) -> u64 {
    page.lines()
        .find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
        .unwrap_or(0)
}

/// Issue 39: the device is SIGKILLed while its payment's request is in flight (the server
/// holds the key and is inside a 2.5 s charge), and restarted at once on the same file. Its
/// outbox resends the payment with the same key; the payment must be answered (or replayed)
/// within 1 s of the charge finishing, not after a lease, and charged once. Before the fix,
/// the dropped connection cancelled the charge half way, and every resend got 409 for the
/// whole lease (60 s).
#[test]
fn a_client_killed_mid_request_gets_its_answer_within_1s_of_the_charge() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    killed_mid_request("server");
}

/// The same against the sync `payments_server` (`http::handle`, whose handler keeps its thread
/// whatever the connection does): the control that shows the scenario could pass before the
/// tower layer's fix.
#[test]
fn a_client_killed_mid_request_gets_its_answer_from_the_sync_server() {
    if std::env::var(ROLE).is_ok() {
        return;
    }
    killed_mid_request("sync-server");
}

/// Kills a client mid-request against `role`'s server (with its defaults besides the charge's
/// delay) and checks what its restart gets. The client's 5 s
/// timeout makes it send `Prefer: wait=4`: its resend waits on the server for the answer.
fn killed_mid_request(role: &str) {
    let dir = tempfile::tempdir().expect("temp dir");
    let (server_db, device) = (
        dir.path().join("server.redb"),
        dir.path().join("device.redb"),
    );
    let port = free_port();
    let _server = Server::start_as(
        role,
        &[
            "--db".to_owned(),
            server_db.display().to_string(),
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
            "--delay-ms".to_owned(),
            SLOW_CHARGE.as_millis().to_string(),
        ],
    );
    let http = http_client::Client::new(format!("127.0.0.1:{port}").parse().expect("address"))
        .with_timeout(Duration::from_secs(5));
    let args: Vec<String> = [
        "--db",
        &device.display().to_string(),
        "--server",
        &format!("http://127.0.0.1:{port}"),
        "--payments",
        "1",
        "--prefix",
        "killed",
        "--timeout-ms",
        "5000",
        "--max-seconds",
        "30",
    ]
    .map(str::to_owned)
    .to_vec();

    // The first run: killed once the server has taken the key (the charge is running).
    let mut first = spawn("client", &args, &[]);
    let first_lines = timed_lines(&mut first);
    let acquired = r#"idempotency_claims_total{backend="redb",outcome="acquired"}"#;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let page = http.get("/metrics").expect("GET /metrics").body;
        if counter(&page, acquired) >= 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the client's request did not reach the server within 30 s"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    first.kill().expect("SIGKILL the client");
    let status = first.wait().expect("wait");
    let killed_at = Instant::now();
    {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(9), "the client ended before the kill");
    }
    // Its stdout may still be on its way through the reader thread.
    let key = std::iter::from_fn(|| first_lines.recv_timeout(Duration::from_secs(5)).ok())
        .find_map(|(_, line)| Some(line.split_once(" key=")?.1.to_owned()))
        .expect("the first run printed its key");

    // The restart, at once, on the same device file.
    let mut second = spawn("client", &args, &[]);
    let second_lines = timed_lines(&mut second);
    let mut charged_at = None;
    let mut delivered = None;
    let deadline = killed_at + Duration::from_secs(15);
    while delivered.is_none() && Instant::now() < deadline {
        if charged_at.is_none() {
            let ledger = http.get("/ledger").expect("GET /ledger").json();
            if ledger["count"] != 0 {
                charged_at = Some(Instant::now());
            }
        }
        delivered = second_lines
            .try_iter()
            .find(|(_, line)| line.starts_with("delivered "));
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = second.kill();
    let exited = second.wait().expect("wait");
    let ledger = http.get("/ledger").expect("GET /ledger").json();
    let since = |at: Instant| at.duration_since(killed_at);
    eprintln!(
        "edge client killed mid-request ({role}): charge in the ledger {:?} after the kill, restarted \
         client answered {:?} after the kill ({:?}); ledger {ledger}",
        charged_at.map(since),
        delivered.as_ref().map(|(at, _)| since(*at)),
        delivered.as_ref().map(|(_, line)| line.as_str()),
    );
    let charged_at = charged_at.unwrap_or_else(|| {
        panic!("no charge within 15 s of the kill: the charge did not outlive the connection")
    });
    let (answered_at, line) = delivered.unwrap_or_else(|| {
        panic!("the restarted client got no final answer within 15 s of the kill ({exited})")
    });
    assert!(
        line.contains("status=201"),
        "the restarted client's answer: {line}"
    );
    assert_eq!(ledger["count"], 1, "charged more than once: {ledger}");
    assert_eq!(
        ledger["charges"][0]["idempotencyKey"], key,
        "the charge is not the client's key: {ledger}"
    );
    assert!(
        line.contains(ledger["charges"][0]["id"].as_str().expect("an id")),
        "the client got another charge's answer: {line} / {ledger}"
    );
    let late = answered_at.saturating_duration_since(charged_at);
    eprintln!("edge client killed mid-request ({role}): answered {late:?} after the charge");
    assert!(
        late <= Duration::from_secs(1),
        "the restarted client got its answer {late:?} after the charge (at most 1 s)"
    );
}
