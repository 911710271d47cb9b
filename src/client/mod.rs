//! Outbound idempotency keys that survive the caller's crash (feature `client`): the client
//! half of the pattern, for devices that *call* payment and order APIs.
//!
//! A client must send the same idempotency key with every attempt of one logical operation,
//! retries included; a fresh key per retry is the classic mistake that charges twice. If the
//! device crashes or reboots between sending a charge and hearing the answer, it must retry
//! with the *same* key after the restart, so the key has to be on disk before the first send.
//! The [`Outbox`] keeps each operation as an *intent* in the store's file, next to its
//! server-side records, at the store's group-commit speed:
//!
//! 1. [`Outbox::begin`]`(operation_id, fingerprint)` mints a key (UUID v4) and stores it
//!    durably before it returns; every later call (same process or after a restart) returns
//!    the same key and the sends so far, or [`Claim::Completed`](crate::Claim::Completed) with the stored answer, so a
//!    finished operation is never sent again. Another fingerprint under the same operation id
//!    is [`Claim::Mismatch`](crate::Claim::Mismatch).
//! 2. [`Outbox::send`] sends with a closure you give it (any HTTP client), retrying with the
//!    same key under a [`RetryPolicy`] (backoff with full jitter, `Retry-After`, bounded
//!    attempts and time) and records every send before and after it goes out; on a final
//!    answer it [`finish`](Outbox::finish)es the intent. [`Outbox::pending`] lists the
//!    unfinished intents, oldest first, for a device to resume at boot.
//!
//! ```
//! use std::sync::Arc;
//! use idempotency_store::client::Outbox;
//! use idempotency_store::{Claim, Fingerprint, Response, Store};
//!
//! let store = Arc::new(Store::builder().open_in_memory()?);
//! let outbox = Outbox::new(Arc::clone(&store));
//! let fp = Fingerprint::of(["POST /payments", r#"{"amount":4999}"#]);
//! let Claim::Acquired(intent) = outbox.begin("sale-1001", fp)? else { unreachable!() };
//! let key = intent.key().to_owned(); // on disk already: send it as `Idempotency-Key`
//! // ... the device reboots here; at boot:
//! assert_eq!(outbox.pending()?[0].key, key);
//! let Claim::Acquired(resumed) = outbox.begin("sale-1001", fp)? else { unreachable!() };
//! assert_eq!(resumed.key(), key); // the same key, never a fresh one
//! outbox.finish(&resumed, Response::new(201, r#"{"id":"pay_1"}"#))?;
//! assert!(matches!(outbox.begin("sale-1001", fp)?, Claim::Completed(r) if r.response.status == 201));
//! assert!(outbox.pending()?.is_empty());
//! # Ok::<(), idempotency_store::Error>(())
//! ```
//!
//! # What it guarantees, and what it cannot
//!
//! - Once `begin` returned a key, every attempt of that operation carries that key, across
//!   crashes and power loss (the store's default durability), until the intent is finished
//!   or expires. A finished intent is never sent again while it is kept.
//! - Intents are records of the store under the scope [`SCOPE`]: they expire `retention`
//!   after `begin` (the store's setting, 24 h by default) and the store's sweeps delete them.
//! - The key protects only as long as the *server* keeps it. A server that forgets keys
//!   earlier than [`RetryPolicy::key_lifetime`] (23 h by default, for a server that keeps
//!   them 24 h) can run a late retry again; `send` never sends past that lifetime and
//!   answers [`Delivery::NeedsReconciliation`] instead: ask the server what became of the
//!   operation before you begin it anew.
//! - An answer lost in flight is retried with the same key, so the server replays it; a
//!   server that does not implement idempotency keys gains nothing from them.

mod intent;
mod outbox;
mod retry;
#[cfg(feature = "ureq")]
#[cfg_attr(docsrs, doc(cfg(feature = "ureq")))]
pub mod ureq;

pub use self::intent::{Attempt, Intent, Pending, Sent};
pub use self::outbox::{Outbox, SCOPE};
pub use self::retry::{Delivery, Failure, RetryPolicy};
