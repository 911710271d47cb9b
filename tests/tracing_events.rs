//! Feature `tracing`: a takeover and a lost lease show up as events, inside the call's span,
//! and keys stay out of events unless the store was built with `trace_keys(true)`.
#![cfg(feature = "tracing")]

use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idempotency_store::IdempotencyStore;
use idempotency_store::{Claim, Error, Fingerprint, Key, ManualClock, Store, Timestamp};
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;

/// Every event as `LEVEL span: field=value ...`.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<String>>>);

struct Fields(String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        let _ = write!(self.0, " {}={:?}", field.name(), value);
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let span = ctx.event_span(event).map(|s| s.name()).unwrap_or("-");
        let mut fields = Fields(format!("{} {span}:", event.metadata().level()));
        event.record(&mut fields);
        self.0.lock().unwrap().push(fields.0);
    }
}

fn takeover_and_lost_lease(show_keys: bool) -> Vec<String> {
    let capture = Capture::default();
    let subscriber = tracing_subscriber::registry().with(capture.clone());
    tracing::subscriber::with_default(subscriber, || {
        let clock = ManualClock::new(Timestamp::from_millis(1_700_000_000_000));
        let store = Store::builder()
            .lease(Duration::from_secs(60))
            .clock(clock.clone())
            .trace_keys(show_keys)
            .open_in_memory()
            .expect("open");
        let key = Key::new("customer-jane@example.com").expect("key");
        let fp = Fingerprint::of(["a"]);
        let Ok(Claim::Acquired(old)) = store.claim(&key, fp) else {
            panic!("acquire")
        };
        clock.advance(Duration::from_secs(61));
        let Ok(Claim::Acquired(new)) = store.claim(&key, fp) else {
            panic!("take over")
        };
        assert_eq!(new.attempt(), 2);
        assert!(matches!(store.release(&old), Err(Error::LeaseLost)));
    });
    capture.0.lock().unwrap().clone()
}

#[test]
fn a_takeover_and_a_lost_lease_are_traced_without_keys() {
    let events = takeover_and_lost_lease(false);
    let takeover: Vec<_> = events.iter().filter(|e| e.contains("took over")).collect();
    assert_eq!(takeover.len(), 1, "{events:#?}");
    assert!(takeover[0].starts_with("DEBUG claim:"), "{takeover:?}");
    assert!(takeover[0].contains("attempt=2") && takeover[0].contains("key=<hidden>"));
    let lost: Vec<_> = events.iter().filter(|e| e.contains("lease lost")).collect();
    assert_eq!(lost.len(), 1, "{events:#?}");
    assert!(lost[0].starts_with("WARN release:") && lost[0].contains("call=\"release\""));
    assert!(
        events.iter().all(|e| !e.contains("jane")),
        "no key bytes without trace_keys: {events:#?}"
    );
    assert!(
        events.iter().any(|e| e.contains("batch leader")),
        "{events:#?}"
    );
    assert!(
        events.iter().any(|e| e.contains("recovery at open")),
        "{events:#?}"
    );
}

#[test]
fn keys_appear_only_when_opted_in() {
    let events = takeover_and_lost_lease(true);
    let takeover = events
        .iter()
        .find(|e| e.contains("took over"))
        .expect("takeover event");
    assert!(takeover.contains("customer-jane@example.com"), "{takeover}");
}
