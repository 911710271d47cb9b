//! Names kept for source compatibility after issue 14's renames still compile and mean the
//! same thing.

use idempotency_store::{Settings, Store, StoreBuilder};

#[test]
#[allow(deprecated)]
fn builder_is_an_alias_of_store_builder() -> idempotency_store::Result<()> {
    let mut old: idempotency_store::Builder = Store::builder();
    let new: &mut StoreBuilder = old.max_batch(4);
    let store = new.open_in_memory()?;
    assert_eq!(store.settings(), &Settings::default());
    Ok(())
}
