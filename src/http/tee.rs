//! The tee of the async layers (the tower layer, the actix middleware): the handler's answer
//! goes to the client as it is produced, frame by frame, while a copy of at most what the
//! store keeps (`max_response_bytes`) is recorded on the side and settled once the body ends.
//!
//! The task that holds the key drives the handler's body whether or not the client is still
//! there, so a client that hangs up mid-stream cancels nothing: the body runs to its end and
//! the copy is stored for the retry. Between that task and the client's body is a channel of
//! [`FRAMES`] frames, and the copy stops growing at the limit, so memory stays bounded
//! whatever the answer's size. docs/http.md, "Answer shapes", has what each kind of answer
//! gives the first client, a duplicate and a retry.

use std::future::poll_fn;
use std::task::{Context, Poll};
use std::time::Instant;

use ::http::HeaderMap;
use ::http::response::Parts;
use bytes::Bytes;
use tokio::sync::mpsc;

use super::flow::{self, Ticket};
use super::options::{HandleOptions, NotFinal};
use super::runner::Runner;
use crate::api::outcome::Lease;

/// The frames in flight between the task that drives the handler's body and the client's
/// body: a slow client holds the handler back after this many, rather than the layer
/// buffering the answer.
pub(crate) const FRAMES: usize = 4;

/// One piece of the handler's body on its way to the client.
pub(crate) enum Piece {
    Data(Bytes),
    #[cfg_attr(not(feature = "tower"), allow(dead_code))] // actix sends no trailers
    Trailers(HeaderMap),
    /// The body ended and its key is settled: the client's body ends cleanly.
    End,
}

/// The body's stream was cut before its end: the handler's body failed, or its task was
/// stopped (a drain at shutdown). The client's body ends with this error, so the server cuts
/// the connection instead of ending the answer as if it were whole.
#[derive(Debug, thiserror::Error)]
#[error("the answer's stream was cut before its end")]
pub(crate) struct Cut;

/// The client's end of the tee.
pub(crate) struct Outlet {
    pieces: mpsc::Receiver<Piece>,
    done: bool,
    /// The body's length, where the handler's body tells it: the client gets it as
    /// `Content-Length`, as it would without the tee.
    exact: Option<u64>,
}

impl Outlet {
    /// The next data or trailers; `None` after [`Piece::End`]; [`Cut`] if the sender went
    /// away without it.
    pub(crate) fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Piece, Cut>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let piece = std::task::ready!(self.pieces.poll_recv(cx));
        Poll::Ready(match piece {
            Some(Piece::End) => {
                self.done = true;
                None
            }
            Some(piece) => Some(Ok(piece)),
            None => {
                self.done = true;
                Some(Err(Cut))
            }
        })
    }

    /// Whether the body has ended.
    #[cfg_attr(not(feature = "tower"), allow(dead_code))] // the tower layer's `is_end_stream`
    pub(crate) fn is_done(&self) -> bool {
        self.done
    }

    /// The body's length, if the handler's body told it.
    pub(crate) fn exact(&self) -> Option<u64> {
        self.exact
    }
}

/// The handler's end of the tee; it forgets the client once the client is gone.
pub(crate) struct Inlet {
    pieces: Option<mpsc::Sender<Piece>>,
    /// Bytes of the body not yet sent, where its length is known: the last one is held back
    /// until the key is settled, because a server that knows the length ends the answer with
    /// its last byte, and the client must not see the end before a retry can get the replay.
    left: Option<u64>,
    held: Option<Bytes>,
}

impl Inlet {
    async fn send(&mut self, piece: Piece) {
        let piece = match (piece, self.left) {
            (Piece::Data(mut data), Some(left)) => {
                let len = u64::try_from(data.len()).unwrap_or(u64::MAX);
                self.left = Some(left.saturating_sub(len));
                if len >= left && !data.is_empty() {
                    self.held = Some(data.split_off(data.len() - 1));
                    self.left = None;
                }
                Piece::Data(data)
            }
            (piece, _) => piece,
        };
        if let Some(pieces) = &self.pieces
            && pieces.send(piece).await.is_err()
        {
            // The client hung up: the body is still driven to its end, without it.
            self.pieces = None;
        }
    }

    /// Ends the client's body, once the key is settled: the byte held back, then the end.
    async fn end(mut self) {
        if let Some(last) = self.held.take() {
            self.send(Piece::Data(last)).await;
        }
        self.send(Piece::End).await;
    }
}

/// A tee's two ends, for a body of `exact` bytes if its length is known.
pub(crate) fn channel(exact: Option<u64>) -> (Inlet, Outlet) {
    let (sender, pieces) = mpsc::channel(FRAMES);
    (
        Inlet {
            pieces: Some(sender),
            left: exact,
            held: None,
        },
        Outlet {
            pieces,
            done: false,
            exact,
        },
    )
}

/// A handler's body as the tee reads it.
pub(crate) trait Source {
    /// The body's error.
    type Error: std::error::Error + 'static;

    /// The next data or trailers (never [`Piece::End`]); `None` at the end.
    fn poll_piece(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Piece, Self::Error>>>;
}

/// The copy of the answer, up to what the store keeps.
pub(crate) struct Recording {
    /// The room for the body: the store's limit less the stored head.
    room: usize,
    copy: Option<Vec<u8>>,
}

impl Recording {
    /// The recording of an answer with `headers` in a store that keeps `limit` bytes (the
    /// body and every header name and value, as `Response::size` counts them).
    pub(crate) fn new(limit: usize, headers: &HeaderMap) -> Recording {
        let head = headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len())
            .fold(0, usize::saturating_add);
        Recording {
            room: limit.saturating_sub(head),
            copy: Some(Vec::new()),
        }
    }

    /// Whether a body of `exact` bytes, if its length is known, fits: such a body is read
    /// whole before the client gets it, as before the tee (nothing to stream, and the client
    /// learns of a failed completion).
    pub(crate) fn fits(&self, exact: Option<u64>) -> bool {
        exact.is_some_and(|len| usize::try_from(len).is_ok_and(|len| len <= self.room))
    }

    fn record(&mut self, data: &[u8]) {
        if let Some(copy) = &mut self.copy {
            if copy.len().saturating_add(data.len()) > self.room {
                // Past the limit: the copy goes, the client's stream does not.
                self.copy = None;
            } else {
                copy.extend_from_slice(data);
            }
        }
    }
}

/// How the handler's body ended.
enum Ended {
    /// At its end, within the limit: the copy.
    Whole(Vec<u8>),
    /// At its end, past the limit.
    TooLarge,
    /// With an error.
    Failed,
}

/// How a teed body began.
pub(crate) enum Start<S> {
    /// With its first data or trailers: the client gets the head, and the body follows as it
    /// comes ([`run`]).
    Teed(Teeing<S>),
    /// It ended before its first byte: settled as an empty answer, read whole.
    Empty,
    /// It failed before its first byte: settled as a body that failed while it was read,
    /// and the client gets the stored answer, not a head and a cut.
    Failed,
}

/// A body that has yielded its first piece.
pub(crate) struct Teeing<S> {
    source: S,
    first: Piece,
}

/// Waits for the body's first piece before the client gets the head, so that a body that
/// fails at once is answered like one read whole.
pub(crate) async fn start<S: Source>(mut source: S, options: &HandleOptions) -> Start<S> {
    match poll_fn(|cx| source.poll_piece(cx)).await {
        None => Start::Empty,
        Some(Ok(first)) => Start::Teed(Teeing { source, first }),
        Some(Err(err)) => {
            options.report(&err);
            Start::Failed
        }
    }
}

/// Drives the handler's body to its end, to the client while it listens and into the
/// recording, then settles the key (see [`settle`]) and ends the client's body: cleanly, or
/// cut if the body failed. The client sees the end only once the key is settled, so that a
/// client that retries at once gets the replay.
pub(crate) async fn run<S: Source>(
    runner: &Runner,
    ticket: &Ticket,
    lease: Lease,
    parts: Parts,
    teeing: Teeing<S>,
    mut inlet: Inlet,
    started: Instant,
) {
    let limit = runner.store.settings().max_response_bytes();
    let mut recording = Recording::new(limit, &parts.headers);
    let Teeing { mut source, first } = teeing;
    let mut next = Some(first);
    let ended = loop {
        let piece = match next.take() {
            Some(piece) => piece,
            None => match poll_fn(|cx| source.poll_piece(cx)).await {
                None => break recording.copy.take().map_or(Ended::TooLarge, Ended::Whole),
                Some(Ok(piece)) => piece,
                Some(Err(err)) => {
                    runner.options.report(&err);
                    break Ended::Failed;
                }
            },
        };
        if let Piece::Data(data) = &piece {
            recording.record(data);
        }
        inlet.send(piece).await;
    };
    let whole = !matches!(ended, Ended::Failed);
    settle(runner, ticket, lease, parts, ended, started).await;
    if whole {
        inlet.end().await;
    }
}

/// Settles the key after a streamed answer; what the client got is already sent, so the
/// settling call's own answer (a store error's 503, say) is reported, not sent:
///
/// - the whole copy: stored as any answer (or the key released, for an answer that is not
///   final), and every retry replays it;
/// - past the limit: the key completed with [`Problem::completed_not_stored`]'s 410 (or
///   released, for an answer that is not final);
/// - a body that failed: the key completed with the "response not stored" 500, as for a body
///   that fails while it is read whole. The handler ran and may have done its work, so a
///   retry must not run it again unknowingly.
///
/// [`Problem::completed_not_stored`]: super::Problem::completed_not_stored
async fn settle(
    runner: &Runner,
    ticket: &Ticket,
    lease: Lease,
    parts: Parts,
    ended: Ended,
    started: Instant,
) {
    let options: &HandleOptions = &runner.options;
    let body = match ended {
        Ended::Whole(body) => body,
        Ended::TooLarge if releases(options, &parts) => Vec::new(),
        Ended::TooLarge => {
            options.durations.record(&ticket.route, started.elapsed());
            let (status, extensions) = (parts.status, parts.extensions);
            let limit = runner.store.settings().max_response_bytes();
            let _ = runner
                .blocking(move |store, options| {
                    flow::not_kept(store, options, &lease, status, limit, &extensions)
                })
                .await;
            return;
        }
        Ended::Failed => {
            let _ = runner
                .blocking(move |store, options| {
                    let why = "its response body failed while it was streamed";
                    flow::substitute(store, options, &lease, why, &parts.extensions)
                })
                .await;
            return;
        }
    };
    let response = ::http::Response::from_parts(parts, body);
    let _ = runner.settle(ticket, lease, response, started).await;
}

/// Whether an answer with `parts` releases the key instead of completing it (as
/// `Settling::new` decides).
fn releases(options: &HandleOptions, parts: &Parts) -> bool {
    parts.extensions.get::<NotFinal>().is_some() || options.finality.releases(parts.status)
}
