//! Entry points for the fuzz targets and their corpus replay in `cargo test`, behind the
//! internal feature `__test-hooks`: not part of the API, and absent from every other build.

use std::sync::Arc;

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::store::IdempotencyStore;
use crate::engine::contain::contained_panics;
use crate::engine::layout::{MIN_LOG_LEN, Storage, Tail};
use crate::engine::wal;
use crate::store::builder::StoreBuilder;

/// Fuzzing entry point: `data` read as log entries (see `wal::forge_entries`) in the log of a
/// new in-memory store, which is then reopened and used. It must never panic.
pub fn fuzz_log_replay(data: &[u8]) {
    let storage: Storage = Arc::new(redb::backends::InMemoryBackend::new());
    let backend = || Tail {
        inner: Arc::clone(&storage),
        start: 0,
    };
    let mut builder = StoreBuilder::new();
    builder.log_size(MIN_LOG_LEN);
    // A new store merges its log when it opens and when it closes: its log is empty and the
    // next entry is number 1.
    if builder.open_with_backend(backend()).is_err() {
        return;
    }
    wal::forge_entries(&storage, data);
    let contained = contained_panics();
    if let Ok(store) = builder.open_with_backend(backend()) {
        let _ = store.verify();
        let _ = store.stats();
        let _ = store.sweep_all();
        if let Ok(key) = Key::new("fuzz") {
            let _ = store.claim(&key, Fingerprint::of(["fuzz"]));
        }
    }
    // redb's pages are intact here (only the log is arbitrary), so any panic was ours.
    assert_eq!(contained_panics(), contained, "a panic was contained");
}
