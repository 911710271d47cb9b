//! A commit whose wait for a synchronous standby was cancelled: PostgreSQL then keeps the
//! commit, which only this server holds, answers the statement with success and sends a
//! WARNING beside it. Such a success is reported as an outcome-unknown error instead.
//!
//! The `postgres` client hands notices to a callback, on the thread that drives the
//! connection: the thread making the call, which reads the server's messages in order, so the
//! WARNING (sent before the commit's `ReadyForQuery`) reaches the callback before the call
//! returns. A thread makes one call on one connection at a time, so a flag of the thread ties
//! the notice to the call in progress on that connection.

use std::cell::Cell;

use ::postgres::error::{DbError, Severity};

use crate::error::{Error, Result};

thread_local! {
    /// Set when the call in progress on this thread met a cancelled wait for a standby.
    static CANCELLED: Cell<bool> = const { Cell::new(false) };
}

/// The connections' notice callback.
pub(super) fn on_notice(notice: DbError) {
    if is_cancelled_wait(&notice) {
        CANCELLED.with(|flag| flag.set(true));
    }
}

/// PostgreSQL's WARNINGs when a commit stops waiting for a synchronous standby: "canceling
/// wait for synchronous replication due to user request" (the wait was cancelled; the commit
/// stands) and "canceling the wait for synchronous replication and terminating connection due
/// to administrator command" (then the connection ends too). They carry no SQLSTATE of their
/// own; the message is English unless the server's `lc_messages` says otherwise.
fn is_cancelled_wait(notice: &DbError) -> bool {
    notice.parsed_severity() == Some(Severity::Warning)
        && notice
            .message()
            .contains("wait for synchronous replication")
}

/// Runs one call, and turns its success into an outcome-unknown error if a commit of it
/// stopped waiting for a standby.
pub(super) fn watched<T>(call: impl FnOnce() -> Result<T>) -> Result<T> {
    CANCELLED.with(|flag| flag.set(false));
    let result = call();
    if CANCELLED.with(|flag| flag.replace(false)) && result.is_ok() {
        return Err(Error::storage(
            "waiting for a synchronous standby",
            std::io::Error::other(
                "the commit's wait for a synchronous standby was cancelled: it committed on this \
                 server only and may be lost if the server fails over; look the key up or retry \
                 the same call",
            ),
        ));
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_without_the_warning_keeps_its_answer() {
        assert_eq!(watched(|| Ok(7)).ok(), Some(7));
    }

    #[test]
    fn a_flag_left_by_an_earlier_call_is_cleared() {
        CANCELLED.with(|flag| flag.set(true));
        assert_eq!(watched(|| Ok(7)).ok(), Some(7));
    }

    #[test]
    fn the_warning_makes_a_success_outcome_unknown() {
        let result = watched(|| {
            CANCELLED.with(|flag| flag.set(true));
            Ok(7)
        });
        assert!(result.is_err_and(|e| e.outcome_unknown()));
        assert_eq!(watched(|| Ok(8)).ok(), Some(8));
    }
}
