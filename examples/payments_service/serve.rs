//! Serving the payments service over hyper.
//!
//! hyper reads and writes HTTP/1.1 (framing, keep-alive, pipelining, HEAD, `Expect`), so this
//! file has no HTTP parser of its own. Connections are tasks on a one-thread tokio runtime: a
//! slow or silent client costs a socket and a small task, never a thread. The handler is
//! synchronous and runs on the runtime's blocking pool (`threads` of them), and only once its
//! whole request is in.

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::thread::JoinHandle;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::{Body, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use idempotency_store::http::Problem;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

use super::{BoxError, MAX_BODY, Payments, problem};

/// The largest request head (request line and header fields) read; a larger one gets 431.
const MAX_HEAD: usize = 16 * 1024;

/// How long a stopping server lets its connections finish the request each is on.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// The pause after a failed accept (out of file descriptors, say), so that the accept loop
/// does not spin while the cause lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The front end's limits. A client holds a connection slot for at most `head` + `body` while
/// its request arrives and `write` while an answer waits for it to read, so slow or silent
/// clients cannot keep the slots, and never a handler thread.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a request head may take, from the connection's opening or its previous
    /// answer: a client trickling its head, and an idle kept-alive connection, are closed
    /// then.
    pub head: Duration,
    /// How long a body may take once its head is in; a late one gets 408 and the connection
    /// is closed.
    pub body: Duration,
    /// How long an answer may wait for the client to take any of its bytes; then the
    /// connection is closed.
    pub write: Duration,
    /// Connections served at once; more wait in the listen backlog until one closes.
    pub connections: usize,
}

impl Default for Limits {
    /// `payments_server`'s limits, stated in its `--help` ([`limits_help`]) and the README.
    fn default() -> Limits {
        Limits {
            head: Duration::from_secs(5),
            body: Duration::from_secs(10),
            write: Duration::from_secs(10),
            connections: 512,
        }
    }
}

/// The body cap and [`Limits::default`] in words, for `payments_server --help`.
pub fn limits_help() -> String {
    let limits = Limits::default();
    format!(
        "Limits: a request body may have at most {} KiB (a larger one gets 413). A request \
         head must arrive within {} s of its connection's opening or previous answer (an idle \
         connection is closed then), and its body within {} s after its head (else 408). A \
         client that takes no bytes of an answer for {} s is disconnected. At most {} \
         connections are served at once; more wait to be accepted.",
        MAX_BODY / 1024,
        limits.head.as_secs(),
        limits.body.as_secs(),
        limits.write.as_secs(),
        limits.connections,
    )
}

/// A running server; dropping it stops it.
pub struct Running {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    server: Option<JoinHandle<()>>,
}

/// Listens on `listen` (`127.0.0.1:0` picks a free port) and serves with `options.threads`
/// handler threads and the default [`Limits`].
pub fn start(payments: Payments, listen: &str) -> Result<Running, BoxError> {
    let threads = payments.options.threads;
    let payments = Arc::new(payments);
    serve_with(
        listen,
        threads,
        Arc::new(move |request| payments.handle(request)),
    )
}

/// A request handler for [`serve_with`].
pub type Handler = Arc<dyn Fn(http::Request<Vec<u8>>) -> http::Response<Vec<u8>> + Send + Sync>;

/// Serves `handler` on `listen` with `threads` handler threads and the default [`Limits`]
/// (also used by tests/http/http_flow.rs).
pub fn serve_with(listen: &str, threads: usize, handler: Handler) -> Result<Running, BoxError> {
    serve_with_limits(listen, threads, handler, Limits::default())
}

/// Serves `handler` on `listen` with `threads` handler threads and `limits`.
///
/// A connection stays open after an answer unless the request asked for `Connection: close`,
/// was HTTP/1.0, was malformed or refused (400, 408, 413, 431: the rest of it is not read),
/// or the server is stopping.
pub fn serve_with_limits(
    listen: &str,
    threads: usize,
    handler: Handler,
    limits: Limits,
) -> Result<Running, BoxError> {
    let listener = std::net::TcpListener::bind(listen)
        .map_err(|err| format!("cannot listen on {listen}: {err}"))?;
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .max_blocking_threads(threads.max(1))
        .thread_name("payments-handler")
        .build()?;
    let listener = {
        let _context = runtime.enter();
        tokio::net::TcpListener::from_std(listener)?
    };
    let (stop, stopping) = watch::channel(false);
    let server = std::thread::Builder::new()
        .name("payments-http".into())
        .spawn(move || {
            runtime.block_on(accept(listener, handler, limits, stopping));
            // Dropping the runtime waits for the handlers still running: once `Running` has
            // stopped, nothing holds the store, and its file can be opened again.
            drop(runtime);
        })?;
    Ok(Running {
        addr,
        stop,
        server: Some(server),
    })
}

impl Running {
    /// The address the server listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Serves until the process ends.
    pub fn wait(mut self) {
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

impl Drop for Running {
    /// Stops accepting, closes idle connections at once, lets each busy one finish its
    /// request (for up to [`STOP_GRACE`]), and returns once the last handler has returned, so
    /// that the store they share is closed.
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

/// Resolves once the server is stopping (or its [`Running`] is gone).
async fn stopped(mut stopping: watch::Receiver<bool>) {
    let _ = stopping.wait_for(|stop| *stop).await;
}

/// Accepts connections, at most `limits.connections` at a time, until the server stops; then
/// lets them finish.
async fn accept(
    listener: tokio::net::TcpListener,
    handler: Handler,
    limits: Limits,
    stopping: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.connections.max(1)));
    let mut connections = JoinSet::new();
    loop {
        let next = async {
            // The slot is taken before the accept: past the limit, clients wait in the
            // backlog instead of being accepted and starved.
            let slot = Arc::clone(&slots).acquire_owned().await;
            (slot, listener.accept().await)
        };
        let (slot, accepted) = tokio::select! {
            () = stopped(stopping.clone()) => break,
            next = next => next,
        };
        match (slot, accepted) {
            (Ok(slot), Ok((stream, _))) => {
                let (handler, stopping) = (Arc::clone(&handler), stopping.clone());
                connections.spawn(async move {
                    serve(stream, handler, limits, stopping).await;
                    drop(slot);
                });
            }
            (_, Err(err)) => {
                eprintln!("payments: accepting a connection failed: {err}");
                tokio::time::sleep(ACCEPT_BACKOFF).await;
            }
            // The semaphore is never closed.
            (Err(_), Ok(_)) => {}
        }
        while connections.try_join_next().is_some() {}
    }
    drop(listener);
    let finished = async { while connections.join_next().await.is_some() {} };
    // Past the grace, the connections left are dropped with the set (their handlers, on the
    // blocking pool, still run to the end).
    let _ = tokio::time::timeout(STOP_GRACE, finished).await;
}

/// Serves one connection until the client or hyper closes it, or the server stops.
async fn serve(
    stream: tokio::net::TcpStream,
    handler: Handler,
    limits: Limits,
    stopping: watch::Receiver<bool>,
) {
    // A pipelining client must not wait for Nagle's algorithm to release its second answer.
    let _ = stream.set_nodelay(true);
    let io = TokioIo::new(WriteDeadline::new(stream, limits.write));
    let service = hyper::service::service_fn(move |request| {
        answer(request, Arc::clone(&handler), limits.body)
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.head)
        .max_header_size(MAX_HEAD);
    let connection = http.serve_connection(io, service);
    tokio::pin!(connection);
    // A connection's errors (a timeout, a reset, a malformed request hyper has answered) are
    // the client's: logging them would let any client fill the log.
    tokio::select! {
        _ = connection.as_mut() => return,
        () = stopped(stopping) => connection.as_mut().graceful_shutdown(),
    }
    // Closes at once if idle, else after the answer to the request in progress.
    let _ = connection.await;
}

/// Reads the whole body (within `body_limit`), then runs the handler on the blocking pool.
async fn answer(
    request: http::Request<Incoming>,
    handler: Handler,
    body_limit: Duration,
) -> Result<http::Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let version = parts.version;
    let mut answer = match read_body(body, body_limit).await {
        Ok(body) => {
            let request = http::Request::from_parts(parts, body);
            tokio::task::spawn_blocking(move || handler(request))
                .await
                .unwrap_or_else(|panicked| {
                    eprintln!("payments: a handler panicked: {panicked}");
                    Problem::internal().to_http()
                })
        }
        // The rest of the body is not read, so the connection cannot carry another request.
        Err(refused) => closing(refused.to_http()),
    };
    if version == http::Version::HTTP_10 {
        // HTTP/1.0 connections are not kept alive: an HTTP/1.0 answer saying so has hyper
        // close the connection after it, even if the client asked for keep-alive.
        *answer.version_mut() = http::Version::HTTP_10;
        answer = closing(answer);
    }
    Ok(answer.map(|body| Full::new(Bytes::from(body))))
}

/// The body, at most [`MAX_BODY`] bytes and within `limit`, or the problem to answer.
async fn read_body(body: Incoming, limit: Duration) -> Result<Vec<u8>, Problem> {
    let too_large = || {
        let detail = format!("the body is larger than {MAX_BODY} bytes");
        let status = StatusCode::PAYLOAD_TOO_LARGE;
        problem(status, "too-large", "Body too large", &detail)
    };
    // A declared length over the cap is refused before a byte of the body is read.
    if body.size_hint().lower() > MAX_BODY as u64 {
        return Err(too_large());
    }
    match tokio::time::timeout(limit, Limited::new(body, MAX_BODY).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes().to_vec()),
        Ok(Err(err)) if err.is::<LengthLimitError>() => Err(too_large()),
        // A malformed chunk, or the client went away.
        Ok(Err(err)) => Err(problem(
            StatusCode::BAD_REQUEST,
            "bad-request",
            "Bad request",
            &format!("the body could not be read: {err}"),
        )),
        Err(_) => Err(problem(
            StatusCode::REQUEST_TIMEOUT,
            "timeout",
            "Request timeout",
            &format!("the body did not arrive within {} s", limit.as_secs()),
        )),
    }
}

/// `answer` with `Connection: close`, which hyper honours by closing after it.
fn closing(mut answer: http::Response<Vec<u8>>) -> http::Response<Vec<u8>> {
    answer.headers_mut().insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("close"),
    );
    answer
}

/// A connection's socket whose writes fail once they have made no progress for `limit`, so
/// that a client that does not read its answers cannot keep its connection slot.
struct WriteDeadline {
    stream: tokio::net::TcpStream,
    limit: Duration,
    /// Set while a write waits for the client; any progress clears it.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl WriteDeadline {
    fn new(stream: tokio::net::TcpStream, limit: Duration) -> WriteDeadline {
        WriteDeadline {
            stream,
            limit,
            stalled: None,
        }
    }

    /// `polled` (a write, flush or shutdown), or a timeout once it has been pending for
    /// `limit`.
    fn check<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took no bytes of its answer",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteDeadline {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteDeadline {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.check(cx, polled)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.check(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_flush(cx);
        this.check(cx, polled)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.stream).poll_shutdown(cx);
        this.check(cx, polled)
    }
}
