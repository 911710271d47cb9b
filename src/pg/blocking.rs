//! The sync `postgres` client on a tokio runtime's threads.
//!
//! The client drives its connection with a runtime of its own, entered with `block_on`, which
//! panics on a thread that already runs a tokio runtime ("Cannot start a runtime from within a
//! runtime"). Tokio offers no way to tell its blocking pool (where `block_on` is fine) from its
//! workers, so whenever a runtime is current, the work runs on a short-lived scoped thread of
//! its own, and the caller's thread waits for it.

/// Runs `work` on this thread, or, if a tokio runtime is current here, on a scoped thread.
pub(crate) fn off_runtime<T: Send>(work: impl FnOnce() -> T + Send) -> T {
    if tokio::runtime::Handle::try_current().is_err() {
        return work();
    }
    std::thread::scope(|scope| match scope.spawn(work).join() {
        Ok(value) => value,
        // A panic in `work` (the caller's closure, say) goes on in the caller's thread.
        Err(payload) => std::panic::resume_unwind(payload),
    })
}
