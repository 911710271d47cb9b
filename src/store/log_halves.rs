//! How a store on a file moves between its log's halves: with the flush thread idle, a batch
//! leaves a nearly full half before its entry would not fit (`engine::handle::SWITCH_EARLY`),
//! so that switch does not wait for the thread.

use crate::api::fingerprint::Fingerprint;
use crate::api::key::Key;
use crate::api::outcome::Claim;
use crate::api::store::IdempotencyStore;
use crate::error::Result;
use crate::store::Store;

#[test]
fn with_the_flush_thread_idle_the_log_leaves_a_half_before_it_is_full() -> Result<()> {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = Store::builder()
        .log_size(16 << 10)
        .open(dir.path().join("store.redb"))?;
    let mut switches = 0;
    for i in 0..400 {
        let (start, pos, end) = store.engine.log_at();
        let claim = store.claim(&Key::new(&format!("key-{i}"))?, Fingerprint::of(["r"]))?;
        assert!(matches!(claim, Claim::Acquired(_)), "key-{i}: {claim:?}");
        // Waits for the flush thread to finish what it was given, and collects its report.
        store.stats()?;
        let (new_start, new_pos, _) = store.engine.log_at();
        if new_start != start {
            switches += 1;
            let entry = new_pos - new_start;
            assert!(
                end - pos >= entry,
                "switch {switches}: the half had {} bytes left and the {entry}-byte entry went to \
                 the other half: the batch switched because its entry did not fit, not early",
                end - pos
            );
            assert!(
                (pos - start) * 8 >= (end - start) * 7,
                "switch {switches}: the half was only {pos}/{end} full"
            );
        }
    }
    assert!(switches >= 3, "only {switches} switches in 400 claims");
    Ok(())
}
