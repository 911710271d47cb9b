//! One app, two frameworks: the same payments route behind the tower layer (axum) and
//! behind the actix-web middleware, each served over real TCP on a thread of its own, so that
//! one test body checks both.

pub mod actix;
pub mod tower;

/// Each case (a function of the invoking module taking an `&Adapter`) as a test of its own per
/// framework: `tower_layer::CASE` and `actix_middleware::CASE`.
macro_rules! for_each_adapter {
    ($($case:ident),* $(,)?) => {
        mod tower_layer {
            $(#[test] fn $case() { super::$case(&$crate::adapters::TOWER) })*
        }
        mod actix_middleware {
            $(#[test] fn $case() { super::$case(&$crate::adapters::ACTIX) })*
        }
    };
}

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use idempotency_store::http::HandleOptions;
use idempotency_store::{IdempotencyStore, Store};
use parking_lot::Mutex;

/// What `POST /payments` does, whichever framework serves it: counts its runs, takes
/// `delay` (on the timer), and answers 201 with `charged, run N` (or `size` bytes).
#[derive(Debug, Default)]
pub struct Handler {
    pub delay: Duration,
    pub size: Option<usize>,
    runs: AtomicUsize,
    finished: AtomicUsize,
    finished_at: Mutex<Option<Instant>>,
}

impl Handler {
    pub fn new(delay: Duration) -> Arc<Handler> {
        Arc::new(Handler {
            delay,
            ..Handler::default()
        })
    }

    /// A handler whose answer is `size` bytes.
    pub fn sized(size: usize) -> Arc<Handler> {
        Arc::new(Handler {
            size: Some(size),
            ..Handler::default()
        })
    }

    /// How many runs started.
    pub fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }

    /// How many runs got to their end (a run cancelled half way does not).
    pub fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }

    /// When the last run got to its end.
    pub fn finished_at(&self) -> Option<Instant> {
        *self.finished_at.lock()
    }

    /// One run: the body of the answer.
    pub async fn run(&self) -> Vec<u8> {
        let run = self.runs.fetch_add(1, Ordering::SeqCst) + 1;
        tokio::time::sleep(self.delay).await;
        self.finished.fetch_add(1, Ordering::SeqCst);
        *self.finished_at.lock() = Some(Instant::now());
        match self.size {
            Some(size) => vec![b'x'; size],
            None => format!("charged, run {run}").into_bytes(),
        }
    }
}

/// Starts a server for `POST /payments` running `handler` behind the framework's idempotency
/// middleware over `store` with `options`.
pub type Start = fn(Arc<dyn IdempotencyStore>, HandleOptions, Arc<Handler>) -> Server;

/// A framework's adapter.
pub struct Adapter {
    pub name: &'static str,
    pub start: Start,
}

pub const TOWER: Adapter = Adapter {
    name: "tower layer (axum)",
    start: tower::start,
};

pub const ACTIX: Adapter = Adapter {
    name: "actix-web middleware",
    start: actix::start,
};

/// The payment every test posts unless it needs another.
pub const BODY: &str = r#"{"amount": 4999, "currency": "usd"}"#;

/// Starts `adapter`'s server for `handler` over `store`.
pub fn start(
    adapter: &Adapter,
    store: impl IdempotencyStore + 'static,
    options: HandleOptions,
    handler: &Arc<Handler>,
) -> Server {
    (adapter.start)(Arc::new(store), options, Arc::clone(handler))
}

/// An empty store in memory.
pub fn memory_store() -> Store {
    Store::builder().open_in_memory().expect("store")
}

/// A running server; stopped when dropped.
pub struct Server {
    pub addr: SocketAddr,
    stop: Option<Box<dyn FnOnce() + Send>>,
    thread: Option<JoinHandle<()>>,
}

impl Server {
    pub fn new(addr: SocketAddr, stop: Box<dyn FnOnce() + Send>, thread: JoinHandle<()>) -> Server {
        Server {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            stop();
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
