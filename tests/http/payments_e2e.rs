//! End to end over real HTTP and real crashes, once per payments server
//! (`examples/payments_server.rs` on the sync `handle`, `examples/axum_payments.rs` on the
//! tower layer, `examples/actix_payments.rs` on the actix middleware): the server runs as a
//! child process (this test binary in child mode, with the examples compiled in), clients send
//! duplicates, retries, a reused key, bad bodies and keyless requests, and the parent kills the
//! server with SIGKILL while requests are in flight, restarts it on the same file, and retries
//! every request with its key.
//!
//! It checks that every key that ever got a 201 replays the same body, and that the ledger
//! (through `GET /ledger`, and read straight from the file afterwards) holds exactly one charge
//! per such key and nothing else. `PAYMENTS_E2E_KILLS=20 cargo test --test payments_e2e --
//! --nocapture` runs more kills.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use idempotency_store::IdempotencyStore;
use idempotency_store::http::problem_type;
use idempotency_store::redb::{self, ReadableTable};

use crate::servers::SERVERS;
use crate::{client, payments_server};

use client::{Client, Reply};
use payments_server::server::LEDGER;

const CHILD_DB: &str = "PAYMENTS_E2E_CHILD_DB";
const CHILD_SERVER: &str = "PAYMENTS_E2E_CHILD_SERVER";

/// Short leases, so that a key whose holder was killed is taken over within a second.
const LEASE_MS: &str = "1000";
const LOAD_THREADS: usize = 8;

// ---------------------------------------------------------------- the child process

/// Not a test on its own: the parent runs this binary with `CHILD_SERVER` (a name in
/// `SERVERS`) and `CHILD_DB` set, and this function then runs that server until it is
/// killed. Without them it returns at once.
#[test]
fn payments_server_child() {
    let (Ok(name), Ok(db)) = (std::env::var(CHILD_SERVER), std::env::var(CHILD_DB)) else {
        return;
    };
    let (_, run, threads) = SERVERS
        .into_iter()
        .find(|(server, _, _)| *server == name)
        .expect("a server of SERVERS");
    let mut args = vec![
        "--db",
        &db,
        "--listen",
        "127.0.0.1:0",
        "--wait-ms",
        "0",
        "--lease-ms",
        LEASE_MS,
        "--delay-ms",
        "20",
    ];
    if threads {
        args.extend(["--threads", "8"]);
    }
    run(args
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>()
        .into_iter())
    .expect(&name);
}

/// A payments server child, killed with SIGKILL when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    fn start(name: &str, db: &Path) -> Server {
        let mut child = Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "payments_e2e::payments_server_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_SERVER, name)
            .env(CHILD_DB, db)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the server");
        // Read its stdout in a thread, so that a server that never comes up fails the test
        // instead of hanging it, and keep draining it so the child never blocks on the pipe.
        let out = BufReader::new(child.stdout.take().expect("stdout"));
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                // libtest may have printed "test payments_server_child ... " on the same line.
                if let Some((_, addr)) = line.split_once("listening on http://") {
                    let _ = tx.send(addr.trim().to_owned());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the server did not start listening within 60 s")
            .parse()
            .expect("address");
        Server { child, addr }
    }

    fn client(&self) -> Client {
        Client::new(self.addr)
    }

    /// SIGKILL (what `Child::kill` sends on Unix): no shutdown code runs.
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

// ---------------------------------------------------------------- what the clients saw

/// Every key sent with a valid body: its body and the first 201 body it got.
#[derive(Default)]
struct Seen {
    keys: Mutex<BTreeMap<String, KeyLog>>,
    statuses: Mutex<BTreeMap<String, u64>>,
}

#[derive(Clone)]
struct KeyLog {
    body: String,
    first_201: Option<String>,
}

impl Seen {
    fn sent(&self, key: &str, body: &str) {
        let mut keys = self.keys.lock().expect("lock");
        let log = keys.entry(key.to_owned()).or_insert_with(|| KeyLog {
            body: body.to_owned(),
            first_201: None,
        });
        assert_eq!(log.body, body, "{key}: one body per key in this test");
    }

    /// Records an answer (or its absence) and checks a 201 against the key's first one.
    fn answered(&self, key: &str, reply: &std::io::Result<Reply>) {
        let label = match reply {
            Ok(r) if r.status == 201 && r.replayed() => "201 replayed".to_owned(),
            Ok(r) => r.status.to_string(),
            Err(_) => "no answer".to_owned(),
        };
        self.tally(label);
        let Ok(reply) = reply else { return };
        if reply.status != 201 {
            return;
        }
        let mut keys = self.keys.lock().expect("lock");
        let log = keys.get_mut(key).expect("sent first");
        match &log.first_201 {
            None => log.first_201 = Some(reply.body.clone()),
            Some(first) => assert_eq!(&reply.body, first, "{key}: a 201 replays the first body"),
        }
    }

    fn post(&self, http: &Client, key: &str, body: &str) -> std::io::Result<Reply> {
        self.sent(key, body);
        let reply = http.post("/payments", Some(key), body);
        self.answered(key, &reply);
        reply
    }

    /// Counts one answer under `label`.
    fn tally(&self, label: String) {
        *self
            .statuses
            .lock()
            .expect("lock")
            .entry(label)
            .or_default() += 1;
    }

    fn count(&self, label: &str) -> u64 {
        self.statuses
            .lock()
            .expect("lock")
            .get(label)
            .copied()
            .unwrap_or(0)
    }
}

fn body(amount: u64, customer: &str) -> String {
    format!(r#"{{"amount": {amount}, "currency": "usd", "customerId": "{customer}"}}"#)
}

fn problem_type_of(reply: &Reply) -> String {
    reply.json()["type"].as_str().unwrap_or_default().to_owned()
}

// ---------------------------------------------------------------- the test

#[test]
fn payments_server_charges_every_key_once_across_sigkills_and_restarts() {
    every_key_charges_once_across_sigkills_and_restarts("payments_server");
}

#[test]
fn axum_payments_charges_every_key_once_across_sigkills_and_restarts() {
    every_key_charges_once_across_sigkills_and_restarts("axum_payments");
}

#[test]
fn actix_payments_charges_every_key_once_across_sigkills_and_restarts() {
    every_key_charges_once_across_sigkills_and_restarts("actix_payments");
}

fn every_key_charges_once_across_sigkills_and_restarts(name: &str) {
    if std::env::var_os(CHILD_DB).is_some() {
        return;
    }
    let kills: usize = std::env::var("PAYMENTS_E2E_KILLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let started = Instant::now();
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("payments.redb");
    let seen = Seen::default();
    let mut server = Server::start(name, &db);

    rejections_store_nothing(&server.client(), &seen);
    reused_key_is_422(&server.client(), &seen);
    concurrent_duplicates_charge_once(&server.client(), &seen);

    // Load, SIGKILL while requests are in flight, restart on the same file.
    let mut rng = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    let mut in_flight = 0;
    for cycle in 0..kills {
        let http = server.client();
        std::thread::scope(|s| {
            let loaders: Vec<_> = (0..LOAD_THREADS)
                .map(|t| {
                    let seen = &seen;
                    // Threads 2j and 2j+1 send the same keys at about the same time.
                    s.spawn(move || load(&http, seen, &format!("c{cycle}-p{}", t / 2)))
                })
                .collect();
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            std::thread::sleep(Duration::from_millis(150 + rng % 250));
            server.kill();
            for loader in loaders {
                in_flight += usize::from(loader.join().expect("loader"));
            }
        });
        server = Server::start(name, &db);
    }

    // Retry every request with its key until it has its answer.
    let http = server.client();
    let keys = seen.keys.lock().expect("lock").clone();
    let (mut lost_then_replayed, mut charged_on_retry) = (0, 0);
    for (key, log) in &keys {
        let reply = retry_until_answered(&http, &seen, key, &log.body);
        assert_eq!(reply.status, 201, "{key}: {reply:?}");
        match (&log.first_201, reply.replayed()) {
            (Some(_), replayed) => assert!(replayed, "{key}: had a 201, must replay"),
            (None, true) => lost_then_replayed += 1,
            (None, false) => charged_on_retry += 1,
        }
    }
    let keys = seen.keys.lock().expect("lock").clone();
    assert!(keys.values().all(|log| log.first_201.is_some()));

    // The ledger, as the server reports it: one charge per key, the one its 201 named.
    let ledger = http.get("/ledger").expect("GET /ledger").json();
    let rows = ledger["charges"].as_array().expect("charges").clone();
    assert_eq!(ledger["count"].as_u64(), Some(keys.len() as u64));
    let mut by_key = BTreeMap::new();
    for row in &rows {
        let key = row["idempotencyKey"].as_str().expect("key").to_owned();
        let mut charge = row.clone();
        charge
            .as_object_mut()
            .expect("object")
            .remove("idempotencyKey");
        assert!(
            by_key.insert(key.clone(), charge).is_none(),
            "{key} charged twice"
        );
    }
    for (key, log) in &keys {
        let first: serde_json::Value =
            serde_json::from_str(log.first_201.as_deref().expect("201")).expect("json");
        assert_eq!(
            by_key.get(key),
            Some(&first),
            "{key}: the ledger row is the 201's charge"
        );
        let id = first["id"].as_str().expect("id");
        let shown = http
            .get(&format!("/payments/{id}"))
            .expect("GET /payments/{id}");
        assert_eq!((shown.status, shown.json()), (200, first.clone()));
    }
    drop(server);

    // The ledger, read from the file after the last SIGKILL (the store replays its log first).
    let store = payments_server::server::store_builder()
        .open(&db)
        .expect("reopen");
    let report = store.verify().expect("verify");
    assert!(report.is_clean(), "{report:?}");
    let file_keys = store
        .read_with(|txn| -> Result<Vec<String>, redb::Error> {
            let mut keys = Vec::new();
            for row in txn.open_table(LEDGER)?.iter()? {
                let (_, value) = row?;
                keys.push(value.value().0.to_owned());
            }
            Ok(keys)
        })
        .expect("read")
        .expect("ledger rows");
    drop(store);
    let unique: BTreeSet<_> = file_keys.iter().cloned().collect();
    assert_eq!(
        file_keys.len(),
        unique.len(),
        "a key charged twice in the file"
    );
    assert_eq!(unique, keys.keys().cloned().collect::<BTreeSet<_>>());

    println!(
        "payments e2e ({name}): {kills} SIGKILLs with {in_flight} requests in flight; {} keys charged once \
         each ({} ledger rows in the file); answers: {} x 201 charged, {} x 201 replayed, \
         {} x 409, {} x 422, {} x 400, {} without an answer; after the kills {lost_then_replayed} \
         lost answers replayed and {charged_on_retry} keys charged on retry; {:.1} s",
        keys.len(),
        file_keys.len(),
        seen.count("201"),
        seen.count("201 replayed"),
        seen.count("409"),
        seen.count("422"),
        seen.count("400"),
        seen.count("no answer"),
        started.elapsed().as_secs_f64(),
    );
}

/// A missing key, a malformed key, bad JSON and bad fields: 400, and nothing stored, so the
/// same key with a fixed body is charged.
fn rejections_store_nothing(http: &Client, seen: &Seen) {
    let missing = http
        .post("/payments", None, &body(100, "cus_1"))
        .expect("post");
    assert_eq!(missing.status, 400);
    assert_eq!(
        missing.header("content-type"),
        Some("application/problem+json")
    );
    assert_eq!(problem_type_of(&missing), problem_type::MISSING_KEY);
    seen.tally("400".into());

    let malformed = http
        .send(
            "POST",
            "/payments",
            &[("Idempotency-Key", "\"unterminated")],
            b"{}",
        )
        .expect("post");
    assert_eq!(malformed.status, 400);
    assert_eq!(problem_type_of(&malformed), problem_type::INVALID_KEY);
    seen.tally("400".into());

    let key = "e2e-fixed-body";
    for bad in [
        "{\"amount\": 100,",
        r#"{"amount": 0, "currency": "usd", "customerId": "cus_1"}"#,
        r#"{"amount": 100, "currency": "USD", "customerId": "cus_1"}"#,
        r#"{"amount": 100, "currency": "usd"}"#,
    ] {
        let reply = http.post("/payments", Some(key), bad).expect("post");
        assert_eq!(reply.status, 400, "{bad}: {reply:?}");
        assert_eq!(
            reply.header("content-type"),
            Some("application/problem+json")
        );
        seen.tally("400".into());
    }
    let fixed = seen.post(http, key, &body(100, "cus_1")).expect("post");
    assert_eq!((fixed.status, fixed.replayed()), (201, false));
}

/// The same key with another amount: 422, and the original still replays.
fn reused_key_is_422(http: &Client, seen: &Seen) {
    let key = "e2e-reused";
    let first = seen.post(http, key, &body(4999, "cus_2")).expect("post");
    assert_eq!(first.status, 201);
    let other = http
        .post("/payments", Some(key), &body(5000, "cus_2"))
        .expect("post");
    assert_eq!(other.status, 422);
    assert_eq!(problem_type_of(&other), problem_type::KEY_REUSED);
    seen.tally("422".into());
    let again = seen.post(http, key, &body(4999, "cus_2")).expect("post");
    assert!(again.replayed() && again.body == first.body);
}

/// Eight simultaneous requests with one key: one charge; the others get 409 with
/// `Retry-After` (the server runs with `--wait-ms 0`) or the replay.
fn concurrent_duplicates_charge_once(http: &Client, seen: &Seen) {
    let (key, body) = ("e2e-duplicates", body(1250, "cus_3"));
    let replies: Vec<Reply> = std::thread::scope(|s| {
        let sends: Vec<_> = (0..8)
            .map(|_| s.spawn(|| seen.post(http, key, &body)))
            .collect();
        sends
            .into_iter()
            .map(|t| t.join().expect("thread").expect("post"))
            .collect()
    });
    let charged = replies
        .iter()
        .filter(|r| r.status == 201 && !r.replayed())
        .count();
    assert_eq!(charged, 1, "{replies:?}");
    for reply in replies.iter().filter(|r| r.status == 409) {
        assert_eq!(
            reply.header("retry-after"),
            Some("1"),
            "lease of {LEASE_MS} ms"
        );
        assert_eq!(problem_type_of(reply), problem_type::IN_PROGRESS);
    }
    assert!(replies.iter().all(|r| r.status == 201 || r.status == 409));
    let last = retry_until_answered(http, seen, key, &body);
    assert!(last.replayed());
}

/// Sends new keys until the server dies; returns whether the last request was cut off by
/// the kill (sent, but the connection died before the answer) rather than refused.
fn load(http: &Client, seen: &Seen, prefix: &str) -> bool {
    for i in 0u64.. {
        let key = format!("{prefix}-{i}");
        if let Err(err) = seen.post(http, &key, &body(100 + i, "cus_load")) {
            return err.kind() != std::io::ErrorKind::ConnectionRefused;
        }
    }
    unreachable!()
}

/// Posts until the answer is neither a 409 nor missing (a killed holder's lease must lapse
/// first).
fn retry_until_answered(http: &Client, seen: &Seen, key: &str, body: &str) -> Reply {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match seen.post(http, key, body) {
            Ok(reply) if reply.status != 409 => return reply,
            other => {
                assert!(Instant::now() < deadline, "{key}: still {other:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}
