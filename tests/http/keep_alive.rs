//! The sync example server's front end (hyper) keeps HTTP/1.1 connections alive, closes them
//! when asked to, and never lets idle connections keep a new one out or delay a stop.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::payments_server::server;

/// A server whose handler answers the number of requests it has handled so far.
fn counting_server(threads: usize) -> server::Running {
    let handled = Arc::new(AtomicUsize::new(0));
    let handler: server::Handler = Arc::new(move |_request| {
        let n = handled.fetch_add(1, Ordering::SeqCst) + 1;
        http::Response::new(n.to_string().into_bytes())
    });
    server::serve_with("127.0.0.1:0", threads, handler).expect("server")
}

fn connect(addr: SocketAddr) -> BufReader<TcpStream> {
    let stream = TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    BufReader::new(stream)
}

/// One response: its header lines (lower-cased) and its body.
fn read_response(reader: &mut BufReader<TcpStream>) -> (Vec<String>, String) {
    let mut head = Vec::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).expect("read a header line");
        assert!(!line.is_empty(), "the connection closed inside a response");
        let line = line.trim_end().to_ascii_lowercase();
        if line.is_empty() {
            break;
        }
        head.push(line);
    }
    let length: usize = head
        .iter()
        .find_map(|line| line.strip_prefix("content-length: "))
        .expect("content-length")
        .parse()
        .expect("a number");
    let mut body = vec![0; length];
    reader.read_exact(&mut body).expect("body");
    (head, String::from_utf8(body).expect("utf-8"))
}

fn send(reader: &mut BufReader<TcpStream>, requests: &str) {
    reader
        .get_mut()
        .write_all(requests.as_bytes())
        .expect("write");
}

/// True when the server has closed the connection (EOF before any byte).
fn closed(reader: &mut BufReader<TcpStream>) -> bool {
    let mut byte = [0u8; 1];
    matches!(reader.read(&mut byte), Ok(0))
}

const GET: &str = "GET /x HTTP/1.1\r\nHost: x\r\n\r\n";

#[test]
fn requests_share_one_connection_until_one_asks_to_close() {
    let running = counting_server(2);
    let mut conn = connect(running.addr());
    for n in 1..=3 {
        send(&mut conn, GET);
        let (head, body) = read_response(&mut conn);
        assert_eq!(body, n.to_string());
        assert!(!head.contains(&"connection: close".to_string()), "{head:?}");
    }
    send(
        &mut conn,
        "GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    let (head, body) = read_response(&mut conn);
    assert_eq!(body, "4");
    assert!(head.contains(&"connection: close".to_string()), "{head:?}");
    assert!(
        closed(&mut conn),
        "the server must close after Connection: close"
    );
}

#[test]
fn pipelined_requests_are_answered_in_order() {
    let running = counting_server(2);
    let mut conn = connect(running.addr());
    send(&mut conn, &GET.repeat(3));
    for n in 1..=3 {
        assert_eq!(read_response(&mut conn).1, n.to_string());
    }
}

#[test]
fn http_1_0_and_malformed_requests_close_the_connection() {
    let running = counting_server(2);
    let mut conn = connect(running.addr());
    send(&mut conn, "GET /x HTTP/1.0\r\n\r\n");
    let (head, _) = read_response(&mut conn);
    // hyper answers an HTTP/1.0 client in HTTP/1.0 (RFC 9110 section 2.5 allows it).
    assert!(head[0].starts_with("http/1.0 200"), "{head:?}");
    assert!(head.contains(&"connection: close".to_string()), "{head:?}");
    assert!(closed(&mut conn));

    let mut conn = connect(running.addr());
    send(&mut conn, "GET /x HTTP/1.1\r\nno colon here\r\n\r\n");
    let (head, _) = read_response(&mut conn);
    assert!(head[0].starts_with("http/1.1 400"), "{head:?}");
    assert!(closed(&mut conn));
}

#[test]
fn an_idle_connection_gives_its_worker_up_to_a_waiting_one() {
    // One handler thread: the idle connection holds none, and is closed after the 5 s head
    // limit (an idle kept-alive connection is waiting for its next head).
    let running = counting_server(1);
    let mut idle = connect(running.addr());
    send(&mut idle, GET);
    assert_eq!(read_response(&mut idle).1, "1");
    let started = Instant::now();
    let mut waiting = connect(running.addr());
    send(&mut waiting, GET);
    assert_eq!(read_response(&mut waiting).1, "2");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the waiting connection was answered after {:?} (the idle limit is 5 s)",
        started.elapsed()
    );
    assert!(
        closed(&mut idle),
        "the idle connection must have been closed"
    );
}

#[test]
fn an_idle_connection_neither_delays_a_stop_nor_survives_it() {
    let running = counting_server(4);
    let mut idle = connect(running.addr());
    send(&mut idle, GET);
    assert_eq!(read_response(&mut idle).1, "1");
    let started = Instant::now();
    drop(running);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "stopping took {:?} with an idle connection open",
        started.elapsed()
    );
    assert!(closed(&mut idle));
}
