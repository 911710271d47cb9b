//! The sync example server (`examples/payments_service/server.rs`, on hyper) against
//! adversarial clients over real TCP on 127.0.0.1: silent and trickling connections neither
//! hold a thread nor delay a normal request, and are cut off; chunked bodies are read and the
//! next request on the connection is served; conflicting or malformed lengths are refused,
//! never served; HEAD answers carry no body; the 16 KiB body cap, the body timeout and the
//! write timeout hold; a stop closes the store; a client that hangs up mid-request leaves a
//! charge that runs to its end once, and its retry gets the stored answer.
//!
//! The clients write raw bytes over `std::net::TcpStream`, since a well-behaved HTTP client
//! cannot send what these tests need to send.

use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::client::Client;
use crate::payments_server::{self, server};

/// A server whose handler answers `METHOD PATH BODY` and counts its calls.
fn echo_server(threads: usize, limits: server::Limits) -> (server::Running, Arc<AtomicUsize>) {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let handler: server::Handler = Arc::new(move |request: http::Request<Vec<u8>>| {
        counted.fetch_add(1, Ordering::SeqCst);
        let body = String::from_utf8_lossy(request.body());
        let text = format!("{} {} {body}", request.method(), request.uri().path());
        http::Response::new(text.into_bytes())
    });
    let running =
        server::serve_with_limits("127.0.0.1:0", threads, handler, limits).expect("server");
    (running, calls)
}

/// The payments service on a store file in `dir`, with `threads` handler threads.
fn payments(dir: &std::path::Path, threads: usize) -> server::Running {
    let store = server::store_builder()
        .open(dir.join("payments.redb"))
        .expect("store");
    let options = server::Options {
        wait: Duration::ZERO,
        charge_delay: Duration::ZERO,
        threads,
    };
    let payments = server::Payments::open(store, options).expect("payments");
    server::start(payments, "127.0.0.1:0").expect("start")
}

fn connect(addr: SocketAddr) -> BufReader<TcpStream> {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    BufReader::new(stream)
}

fn send(conn: &mut BufReader<TcpStream>, bytes: &[u8]) {
    conn.get_mut().write_all(bytes).expect("write");
}

/// One answer's head lines (lower-cased) and body; a HEAD answer's body is not read, since
/// it has none whatever its `content-length` says.
fn read_answer(conn: &mut BufReader<TcpStream>, to_head: bool) -> (Vec<String>, String) {
    let mut head = Vec::new();
    loop {
        let mut line = String::new();
        conn.read_line(&mut line).expect("read a head line");
        assert!(!line.is_empty(), "the connection closed inside an answer");
        let line = line.trim_end().to_ascii_lowercase();
        if line.is_empty() {
            break;
        }
        head.push(line);
    }
    if to_head {
        return (head, String::new());
    }
    let length: usize = header(&head, "content-length")
        .expect("content-length")
        .parse()
        .expect("a number");
    let mut body = vec![0; length];
    conn.read_exact(&mut body).expect("body");
    (head, String::from_utf8(body).expect("utf-8"))
}

/// The value of header `name` (lower-case) in `head`.
fn header<'a>(head: &'a [String], name: &str) -> Option<&'a str> {
    head.iter()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(": "))
}

/// True when the server has closed the connection (EOF or reset, with nothing more sent).
fn closed(conn: &mut BufReader<TcpStream>) -> bool {
    let mut byte = [0u8; 1];
    match conn.read(&mut byte) {
        Ok(0) => true,
        Ok(_) => false,
        Err(err) => err.kind() == ErrorKind::ConnectionReset,
    }
}

// ---------------------------------------------------------------- slow and silent clients

/// A header that never ends: a trickler sends one byte of it per round.
const TRICKLE: &[u8] = b"POST /payments HTTP/1.1\r\nHost: x\r\nX-Slow: \
    aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";

/// How long each trickler waited, from `started` (taken before the first connect, so that a
/// thread that starts late on a busy machine does not shorten the figure), to find its
/// connection closed.
fn trickle(
    conns: Vec<TcpStream>,
    started: Instant,
    every: Duration,
    give_up: Duration,
) -> Vec<Option<Duration>> {
    let mut cut = vec![None; conns.len()];
    for conn in &conns {
        conn.set_nonblocking(true).expect("nonblocking");
    }
    for round in 0.. {
        if started.elapsed() > give_up || cut.iter().all(Option::is_some) {
            break;
        }
        for (conn, cut) in conns.iter().zip(&mut cut) {
            if cut.is_some() {
                continue;
            }
            let mut reader = conn;
            let mut buf = [0u8; 256];
            let gone = match reader.read(&mut buf) {
                Ok(_) => true,
                Err(err) => err.kind() != ErrorKind::WouldBlock,
            };
            let byte = &TRICKLE[round % TRICKLE.len()..][..1];
            let mut writer = conn;
            if gone || writer.write(byte).is_err() {
                *cut = Some(started.elapsed());
            }
        }
        std::thread::sleep(every);
    }
    cut
}

#[test]
fn slow_and_silent_clients_neither_delay_a_normal_request_nor_stay_connected() {
    let dir = tempfile::tempdir().expect("tempdir");
    // Fewer handler threads than bad clients: a connection must not hold one.
    let running = payments(dir.path(), 4);
    let addr = running.addr();
    let limit = server::Limits::default().head;

    let silent: Vec<TcpStream> = (0..70)
        .map(|_| TcpStream::connect(addr).expect("connect"))
        .collect();
    let connecting = Instant::now();
    let tricklers: Vec<TcpStream> = (0..70)
        .map(|_| TcpStream::connect(addr).expect("connect"))
        .collect();
    let trickling = std::thread::spawn(move || {
        trickle(tricklers, connecting, Duration::from_millis(150), limit * 3)
    });
    std::thread::sleep(Duration::from_millis(500));

    let http = Client::new(addr).with_timeout(Duration::from_secs(5));
    let mut slowest = Duration::ZERO;
    for n in 0..3 {
        let started = Instant::now();
        let ledger = http.get("/ledger").expect("GET /ledger");
        let took = started.elapsed();
        assert_eq!(ledger.status, 200, "{ledger:?}");
        assert_eq!(ledger.json()["count"], n, "{ledger:?}");
        slowest = slowest.max(took);

        let started = Instant::now();
        let body = r#"{"amount": 100, "currency": "usd", "customerId": "cus_1"}"#;
        let charged = http
            .post("/payments", Some(&format!("loris-{n}")), body)
            .expect("POST");
        slowest = slowest.max(started.elapsed());
        assert_eq!(charged.status, 201, "{charged:?}");
        std::thread::sleep(Duration::from_millis(400));
    }
    eprintln!("slowest normal request among 140 bad connections: {slowest:?}");
    assert!(
        slowest < Duration::from_secs(1),
        "a normal request took {slowest:?} among 70 silent and 70 trickling connections"
    );

    // The head limit runs from the connection's opening, whatever arrives meanwhile.
    let cut = trickling.join().expect("trickler thread");
    for (n, cut) in cut.iter().enumerate() {
        let cut = cut.unwrap_or_else(|| panic!("trickler {n} was never cut off"));
        assert!(
            cut >= limit - Duration::from_millis(500) && cut < limit + Duration::from_secs(3),
            "trickler {n} was cut off after {cut:?} (the head limit is {limit:?})"
        );
    }
    for (n, conn) in silent.into_iter().enumerate() {
        conn.set_read_timeout(Some(Duration::from_secs(3)))
            .expect("timeout");
        assert!(
            closed(&mut BufReader::new(conn)),
            "silent connection {n} is still open past the head limit"
        );
    }
}

// ---------------------------------------------------------------- framing

#[test]
fn a_chunked_body_is_read_and_the_next_request_on_the_connection_is_served() {
    let (running, calls) = echo_server(2, server::Limits::default());
    let mut conn = connect(running.addr());
    // Pipelined in one write: the chunks must be read as the body, not as the next request.
    send(
        &mut conn,
        b"POST /first HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
          5\r\nhello\r\n6;note=ext\r\n world\r\n0\r\n\r\n\
          GET /second HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    let (head, body) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
    assert_eq!(body, "POST /first hello world");
    let (head, body) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
    assert_eq!(body, "GET /second ");
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // The payments service charges a chunked POST, and the ledger follows on the connection.
    let dir = tempfile::tempdir().expect("tempdir");
    let running = payments(dir.path(), 2);
    let mut conn = connect(running.addr());
    send(
        &mut conn,
        b"POST /payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: \"chunked-1\"\r\n\
          Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n\
          1b\r\n{\"amount\": 4999, \"currency\"\r\n\
          21\r\n: \"usd\", \"customerId\": \"cus_123\"}\r\n0\r\n\r\n",
    );
    let (head, body) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 201"), "{head:?} {body}");
    assert_eq!(
        body,
        r#"{"id":"pay_1","amount":4999,"currency":"usd","customerId":"cus_123"}"#
    );
    send(&mut conn, b"GET /ledger HTTP/1.1\r\nHost: x\r\n\r\n");
    let (head, body) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
    assert!(body.starts_with(r#"{"count":1,"#), "{body}");
}

/// A request smuggled behind a conflicting one: if it were ever served, the echo server would
/// answer `GET /smuggled`.
const SMUGGLED: &str = "GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n";

#[test]
fn conflicting_or_malformed_lengths_get_400_and_are_never_served() {
    let (running, calls) = echo_server(2, server::Limits::default());
    // RFC 9112 section 6.3: each is a request-smuggling precondition, refused with a bare 400
    // (hyper's) before any handler runs, and the connection is closed.
    let refused = [
        "Content-Length: 5\r\nContent-Length: 6\r\n",
        "Content-Length: 6\r\nContent-Length: 5\r\n",
        "Content-Length: +5\r\n",
        "Content-Length: -5\r\n",
        "Content-Length: 5, 6\r\n",
        "Content-Length: 0x5\r\n",
        "Transfer-Encoding: gzip\r\n",
        "Transfer-Encoding: chunked, gzip\r\n",
    ];
    for fields in refused {
        let mut conn = connect(running.addr());
        let request = format!("POST /x HTTP/1.1\r\nHost: x\r\n{fields}\r\nhello!{SMUGGLED}");
        send(&mut conn, request.as_bytes());
        let (head, _) = read_answer(&mut conn, false);
        assert!(head[0].starts_with("http/1.1 400"), "{fields:?}: {head:?}");
        assert!(closed(&mut conn), "{fields:?}: the connection stays open");
    }
    // Transfer-Encoding is HTTP/1.1's: an HTTP/1.0 request with it is refused as well.
    let mut conn = connect(running.addr());
    send(
        &mut conn,
        b"POST /x HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    );
    let (head, _) = read_answer(&mut conn, false);
    assert!(head[0].contains(" 400 "), "{head:?}");
    assert!(closed(&mut conn));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "a refused request was served"
    );

    // Content-Length and Transfer-Encoding together, in either order: hyper reads the body by
    // Transfer-Encoding alone, answers, and closes the connection (RFC 9112 section 6.3 item
    // 3 allows this instead of a 400), so the bytes a Content-Length reader would take for
    // the next request are never served.
    for fields in [
        "Content-Length: 40\r\nTransfer-Encoding: chunked\r\n",
        "Transfer-Encoding: chunked\r\nContent-Length: 40\r\n",
    ] {
        let mut conn = connect(running.addr());
        let request =
            format!("POST /x HTTP/1.1\r\nHost: x\r\n{fields}\r\n5\r\nhello\r\n0\r\n\r\n{SMUGGLED}");
        send(&mut conn, request.as_bytes());
        let (head, body) = read_answer(&mut conn, false);
        assert!(head[0].starts_with("http/1.1 200"), "{fields:?}: {head:?}");
        assert_eq!(
            body, "POST /x hello",
            "{fields:?}: framed by Transfer-Encoding"
        );
        assert_eq!(header(&head, "connection"), Some("close"), "{head:?}");
        assert!(
            closed(&mut conn),
            "{fields:?}: the smuggled request may follow"
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "only the two framed requests ran"
    );
}

#[test]
fn head_answers_carry_no_body_and_the_next_answer_is_intact() {
    let (running, calls) = echo_server(2, server::Limits::default());
    let mut conn = connect(running.addr());
    // Pipelined: a body after the HEAD answer would be read as the next answer's status line.
    send(
        &mut conn,
        b"HEAD /x HTTP/1.1\r\nHost: x\r\n\r\nGET /y HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    let (head, _) = read_answer(&mut conn, true);
    assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
    // The length the GET would have had (`HEAD /x `), and none of its bytes.
    assert_eq!(header(&head, "content-length"), Some("8"), "{head:?}");
    let (head, body) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
    assert_eq!(body, "GET /y ");
    assert_eq!(calls.load(Ordering::SeqCst), 2);

    // The payments service's answers to HEAD (a 405 with a problem body) have none either.
    let dir = tempfile::tempdir().expect("tempdir");
    let running = payments(dir.path(), 2);
    let mut conn = connect(running.addr());
    send(
        &mut conn,
        b"HEAD /ledger HTTP/1.1\r\nHost: x\r\n\r\nGET /ledger HTTP/1.1\r\nHost: x\r\n\r\n",
    );
    let (head, _) = read_answer(&mut conn, true);
    assert!(head[0].starts_with("http/1.1 405"), "{head:?}");
    let (head, body) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
    assert_eq!(body, r#"{"count":0,"charges":[]}"#);
}

// ---------------------------------------------------------------- limits

#[test]
fn bodies_over_16_kib_get_413_and_close_the_connection() {
    assert_eq!(server::MAX_BODY, 16 * 1024);
    let (running, calls) = echo_server(2, server::Limits::default());
    let at_cap = "b".repeat(server::MAX_BODY);
    let mut conn = connect(running.addr());
    let request = format!(
        "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{at_cap}",
        at_cap.len()
    );
    send(&mut conn, request.as_bytes());
    let (head, body) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 200"), "{head:?}");
    assert_eq!(body, format!("POST /x {at_cap}"));

    // Declared: refused before the body is sent.
    let mut conn = connect(running.addr());
    let request = format!(
        "POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
        server::MAX_BODY + 1
    );
    send(&mut conn, request.as_bytes());
    let (head, body) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 413"), "{head:?}");
    assert!(body.contains("larger than 16384 bytes"), "{body}");
    assert_eq!(header(&head, "connection"), Some("close"), "{head:?}");
    assert!(closed(&mut conn));

    // Chunked: refused once the chunks add up to more.
    let mut conn = connect(running.addr());
    let chunk = "c".repeat(8 * 1024 + 1);
    let request = format!(
        "POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
         {len:x}\r\n{chunk}\r\n{len:x}\r\n{chunk}\r\n0\r\n\r\n",
        len = chunk.len()
    );
    send(&mut conn, request.as_bytes());
    let (head, _) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 413"), "{head:?}");
    assert!(closed(&mut conn));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
}

#[test]
fn a_trickled_body_gets_408_once_the_body_limit_has_passed() {
    let limits = server::Limits {
        body: Duration::from_secs(1),
        ..server::Limits::default()
    };
    let (running, calls) = echo_server(2, limits);
    let mut conn = connect(running.addr());
    send(
        &mut conn,
        b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n",
    );
    let started = Instant::now();
    // One byte per 100 ms would take 10 s; the server answers after 1 s.
    conn.get_ref().set_nonblocking(true).expect("nonblocking");
    while conn.fill_buf().map_or(true, <[u8]>::is_empty) {
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no answer to a trickled body"
        );
        let _ = conn.get_mut().write(b"x");
        std::thread::sleep(Duration::from_millis(100));
    }
    conn.get_ref().set_nonblocking(false).expect("blocking");
    let took = started.elapsed();
    let (head, _) = read_answer(&mut conn, false);
    assert!(head[0].starts_with("http/1.1 408"), "{head:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(3),
        "answered after {took:?} (the body limit is 1 s)"
    );
    assert_eq!(header(&head, "connection"), Some("close"), "{head:?}");
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[test]
fn a_client_that_reads_no_answer_is_disconnected_and_frees_its_slot() {
    // One connection slot: a client that never reads would keep every other one out.
    let limits = server::Limits {
        write: Duration::from_secs(1),
        connections: 1,
        ..server::Limits::default()
    };
    const BIG: usize = 32 * 1024 * 1024; // more than the loopback socket buffers hold
    let handler: server::Handler = Arc::new(|request: http::Request<Vec<u8>>| {
        let size = if request.uri().path() == "/big" {
            BIG
        } else {
            2
        };
        http::Response::new(vec![b'z'; size])
    });
    let running = server::serve_with_limits("127.0.0.1:0", 2, handler, limits).expect("server");
    let mut stuck = connect(running.addr());
    send(&mut stuck, b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n");

    let started = Instant::now();
    let reply = Client::new(running.addr())
        .get("/small")
        .expect("GET /small");
    let waited = started.elapsed();
    assert_eq!((reply.status, reply.body.as_str()), (200, "zz"));
    assert!(
        waited >= Duration::from_millis(800) && waited < Duration::from_secs(5),
        "the second client waited {waited:?} (the write limit is 1 s)"
    );
    let mut received = Vec::new();
    let _ = stuck.read_to_end(&mut received);
    assert!(
        received.len() < BIG,
        "the stuck client got its whole answer"
    );
}

// ---------------------------------------------------------------- a client that hangs up

/// Issue 39: a client with a 1 s timeout on a 2.5 s charge hangs up mid-request. The sync
/// `handle` keeps its thread, so the charge runs to its end once and is stored; every retry
/// with the same key gets 409 while it runs, then the stored answer (never a second charge).
#[test]
fn a_client_that_hangs_up_mid_request_gets_the_stored_answer_on_retry() {
    const CHARGE: Duration = Duration::from_millis(2500);
    let dir = tempfile::tempdir().expect("tempdir");
    let store = server::store_builder()
        .open(dir.path().join("payments.redb"))
        .expect("store");
    let options = server::Options {
        wait: Duration::ZERO,
        charge_delay: CHARGE,
        threads: 2,
    };
    let payments = server::Payments::open(store, options).expect("payments");
    let running = server::start(payments, "127.0.0.1:0").expect("start");
    let http = Client::new(running.addr());
    let body = r#"{"amount": 4999, "currency": "usd", "customerId": "cus_hangup"}"#;

    let started = Instant::now();
    let first = http
        .with_timeout(Duration::from_secs(1))
        .post("/payments", Some("hangup-1"), body);
    let hung_up = started.elapsed();
    let err = first.expect_err("the 1 s client got an answer to a 2.5 s charge");
    assert!(
        matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{err}"
    );

    // Retry every 50 ms until the answer is final, and watch the ledger for the charge.
    let (mut in_progress, mut charged_at, mut answer) = (0, None, None);
    while started.elapsed() < Duration::from_secs(15) {
        if charged_at.is_none() {
            let ledger = http.get("/ledger").expect("ledger");
            if ledger.json()["count"] != 0 {
                charged_at = Some(started.elapsed());
            }
        }
        let reply = http
            .post("/payments", Some("hangup-1"), body)
            .expect("retry");
        if reply.status == 409 {
            in_progress += 1;
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        answer = Some((started.elapsed(), reply));
        break;
    }
    let (answered_at, reply) = answer.expect("no final answer within 15 s");
    let ledger = http.get("/ledger").expect("ledger").json();
    let charged_at = charged_at.unwrap_or(answered_at);
    eprintln!(
        "sync hang-up: client gave up at {hung_up:?}; {in_progress} retries got 409; charge in \
         the ledger by {charged_at:?}; the retry got {} (replayed: {}) at {answered_at:?}",
        reply.status,
        reply.replayed()
    );
    assert_eq!(reply.status, 201, "{reply:?}");
    assert!(
        reply.replayed(),
        "the retry's answer was not the stored one: {reply:?}"
    );
    assert_eq!(ledger["count"], 1, "charged more than once: {ledger}");
    assert_eq!(ledger["charges"][0]["id"], reply.json()["id"], "{ledger}");
    assert!(
        answered_at >= CHARGE,
        "answered before the charge could have run to its end: {answered_at:?}"
    );
    assert!(
        answered_at < charged_at + Duration::from_secs(1),
        "the retry got the stored answer {:?} after the charge",
        answered_at.saturating_sub(charged_at)
    );
}

// ---------------------------------------------------------------- stop, help

#[test]
fn a_stop_closes_idle_connections_and_the_store() {
    let dir = tempfile::tempdir().expect("tempdir");
    let running = payments(dir.path(), 2);
    let http = Client::new(running.addr());
    let body = r#"{"amount": 7, "currency": "usd", "customerId": "cus_7"}"#;
    assert_eq!(
        http.post("/payments", Some("stop-1"), body)
            .expect("POST")
            .status,
        201
    );
    let mut idle = connect(running.addr());
    send(&mut idle, b"GET /ledger HTTP/1.1\r\nHost: x\r\n\r\n");
    read_answer(&mut idle, false);

    let started = Instant::now();
    drop(running);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "stopping took {:?}",
        started.elapsed()
    );
    assert!(closed(&mut idle));
    // The file is free again, and holds the charge.
    let running = payments(dir.path(), 2);
    let ledger = Client::new(running.addr()).get("/ledger").expect("ledger");
    assert_eq!(ledger.json()["count"], 1, "{ledger:?}");
}

#[test]
fn help_states_the_body_cap_and_the_timeouts() {
    let err = payments_server::run(["--help".to_owned()].into_iter()).expect_err("help");
    let help = err
        .downcast::<clap::Error>()
        .expect("a clap error")
        .render()
        .to_string();
    // Wherever clap wraps the lines.
    let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
    for words in [
        "at most 16 KiB (a larger one gets 413)",
        "within 5 s of its connection's opening",
        "within 10 s after its head (else 408)",
        "At most 512 connections",
    ] {
        assert!(help.contains(words), "--help lacks {words:?}:\n{help}");
    }
}
