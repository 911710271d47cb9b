//! `PgStore` across a failover: a primary and a streaming standby on this machine
//! (`.ci/pg-failover-setup`: Debian's `pg_createcluster`, `pg_basebackup -R -X stream -C -S`),
//! 32 threads claiming and completing through a libpq multi-host string with
//! `target_session_attrs=read-write`, the primary crashed (`pg_ctlcluster … stop -m
//! immediate`) and the standby promoted. Then every acknowledged claim must still be held (or
//! completed) on the new primary and every acknowledged completion must replay: a re-claim
//! that acquires such a key would run its operation twice.
//!
//! - Synchronous replication (`synchronous_standby_names = '*'`), with the role's default
//!   `synchronous_commit = local` (the store's statements raise it): the connect-time report is
//!   failover-safe, 0 acknowledged claims or completions lost, 0 double runs. Before the
//!   failover: a standby connected alone is refused (the error names
//!   `target_session_attrs=read-write`), and a commit whose wait for a standby is cancelled
//!   (`pg_cancel_backend`; the standby names then match no standby) is outcome unknown. After
//!   it: the promoted server, alone, is not failover-safe, and a store with
//!   `require_failover_safe(true)` refuses writes there (not applied) and serves reads.
//! - Asynchronous replication, the standby's WAL receiver stopped for the last second before
//!   the crash and killed after it (what it had not written is lost, as when the primary's
//!   machine fails): the connect-time report (and, with feature `tracing`, its warning) says "not
//!   failover-safe", `require_failover_safe(true)` refuses, and the same check finds
//!   acknowledged writes lost (a negative control of the check).
//!
//! It creates and drops clusters, so it runs only where `.ci/run` says so:
//! `IDEMPOTENCY_PG_FAILOVER` names the set-up script. Skipped with a printed reason without it
//! (failed under `CI=true`). The two cases share the clusters' ports, so they run one at a time.
#![cfg(feature = "postgres")]

use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_store::{
    Claim, ClaimId, Error, IdempotencyStore, Key, pg::FailoverSafety, pg::PgStore,
};

use crate::failover_load::{self, Figures, Load, builder, check, fingerprint, run};
/// Load before the crash.
const WARM_UP: Duration = Duration::from_secs(3);
/// Load after the first success on the promoted server.
const COOL_DOWN: Duration = Duration::from_secs(2);
/// The longest the test waits for the promoted server to serve.
const RECOVERY_LIMIT: Duration = Duration::from_secs(60);

/// One case at a time: both use the same clusters.
static SERIAL: Mutex<()> = Mutex::new(());

fn script() -> Option<PathBuf> {
    failover_load::script("IDEMPOTENCY_PG_FAILOVER", ".ci/pg-failover-setup")
}

/// The primary and the standby; dropped with the value.
struct Clusters {
    script: PathBuf,
    primary: u16,
    standby: u16,
}

impl Clusters {
    fn up(script: PathBuf, mode: &str) -> Clusters {
        let out = run(&script, &["up", mode]);
        let port = |name: &str| -> u16 {
            out.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name))
                .and_then(|p| p.parse().ok())
                .unwrap_or_else(|| panic!("no {name} in {out:?}"))
        };
        Clusters {
            primary: port("PRIMARY_PORT="),
            standby: port("STANDBY_PORT="),
            script,
        }
    }

    fn run(&self, args: &[&str]) {
        run(&self.script, args);
    }

    /// Both servers, the writable one chosen by the client, as after a failover.
    fn url(&self) -> String {
        format!(
            "host=127.0.0.1,127.0.0.1 port={},{} user=idem password=idem dbname=idem \
             target_session_attrs=read-write connect_timeout=2",
            self.primary, self.standby
        )
    }

    fn one(&self, port: u16) -> String {
        format!("host=127.0.0.1 port={port} user=idem password=idem dbname=idem")
    }
}

impl Drop for Clusters {
    fn drop(&mut self) {
        let _ = Command::new(&self.script).arg("down").status();
    }
}

/// Connects with `tracing` events captured (feature `tracing`); returns them with the store.
fn connect_traced(
    builder: &idempotency_store::pg::PgStoreBuilder,
    url: &str,
) -> (Result<PgStore, Error>, Vec<String>) {
    #[cfg(feature = "tracing")]
    {
        let capture = capture::Capture::default();
        let subscriber = tracing_subscriber::layer::SubscriberExt::with(
            tracing_subscriber::registry(),
            capture.clone(),
        );
        let store = tracing::subscriber::with_default(subscriber, || builder.connect(url));
        let events = capture.0.lock().unwrap().clone();
        (store, events)
    }
    #[cfg(not(feature = "tracing"))]
    (builder.connect(url), Vec::new())
}

#[cfg(feature = "tracing")]
mod capture {
    use std::fmt::Write as _;
    use std::sync::{Arc, Mutex};

    use tracing::field::{Field, Visit};
    use tracing::{Event, Subscriber};
    use tracing_subscriber::layer::{Context, Layer};

    /// Every event as `LEVEL field=value ...`.
    #[derive(Clone, Default)]
    pub struct Capture(pub Arc<Mutex<Vec<String>>>);

    struct Fields(String);

    impl Visit for Fields {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            let _ = write!(self.0, " {}={:?}", field.name(), value);
        }
    }

    impl<S: Subscriber> Layer<S> for Capture {
        fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
            let mut fields = Fields(event.metadata().level().to_string());
            event.record(&mut fields);
            self.0.lock().unwrap().push(fields.0);
        }
    }
}

fn admin(url: &str) -> postgres::Client {
    postgres::Client::connect(url, postgres::NoTls).expect("connect as idem")
}

/// Runs the load, crashes the primary (with the standby a second behind if `lag`), promotes
/// the standby, and checks every acknowledgement on the promoted server.
fn failover(clusters: &Clusters, store: PgStore, lag: bool) -> Figures {
    let load = Load::start(store, if lag { "async" } else { "sync" });
    std::thread::sleep(WARM_UP);
    if lag {
        // The standby falls behind for the last second before the crash.
        clusters.run(&["lag"]);
        std::thread::sleep(Duration::from_secs(1));
    }
    clusters.run(&["crash"]);
    if lag {
        // What the stopped receiver had not written (the socket's buffers hold much of that
        // second) is lost, as when the primary's machine fails; the standby restarts.
        clusters.run(&["cut"]);
    }
    clusters.run(&["promote"]);
    let promoted = Instant::now();
    load.await_write_after(promoted, RECOVERY_LIMIT);
    std::thread::sleep(COOL_DOWN);
    let (ledger, mut figures) = load.finish(promoted);
    check(&clusters.url(), &ledger, &mut figures);
    figures
}

/// Waits until a backend of the store's role waits for a synchronous standby, and cancels it.
fn cancel_sync_wait(url: &str) {
    let mut admin = admin(url);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let row = admin
            .query_one(
                "SELECT count(pg_cancel_backend(pid)) FROM pg_stat_activity \
                 WHERE wait_event = 'SyncRep' AND usename = current_user",
                &[],
            )
            .expect("cancel");
        if row.get::<_, i64>(0) > 0 {
            return;
        }
        if Instant::now() > deadline {
            let activity: Vec<String> = admin
                .query(
                    "SELECT coalesce(state, '') || ' ' || coalesce(wait_event, '') || ' ' || \
                     left(query, 60) FROM pg_stat_activity WHERE usename = current_user",
                    &[],
                )
                .expect("activity")
                .iter()
                .map(|r| r.get(0))
                .collect();
            panic!(
                "no commit waited for a synchronous standby: the store's commits do not wait \
                 ({activity:#?})"
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn synchronous_replication_loses_nothing_across_a_failover() {
    let Some(script) = script() else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let clusters = Clusters::up(script, "sync");
    let primary = clusters.one(clusters.primary);
    // A role default that would acknowledge commits before the standby has them.
    admin(&primary)
        .batch_execute("ALTER ROLE CURRENT_USER SET synchronous_commit = 'local'")
        .expect("weaken the role's default");

    let mut strict = builder();
    strict.require_failover_safe(true);
    let (store, events) = connect_traced(&strict, &clusters.url());
    let store = store.expect("a failover-safe server is accepted");
    let report: FailoverSafety = store.failover_safety_at_connect().clone();
    eprintln!("sync: {report}");
    assert!(report.is_failover_safe(), "{report}");
    assert_eq!(report.synchronous_standby_names, "*");
    assert_eq!(
        report.synchronous_commit, "on",
        "the role's `local` is raised"
    );
    // The set-up script grants pg_monitor, which shows the standbys' `sync_state`.
    assert!(
        report
            .synchronous_standbys
            .as_ref()
            .is_some_and(|s| s.len() == 1),
        "{report}"
    );
    assert!(report.to_string().starts_with("failover-safe"), "{report}");
    assert!(
        !events.iter().any(|e| e.contains("not failover-safe")),
        "{events:?}"
    );
    assert_eq!(store.failover_safety().expect("read again"), report);

    // The standby alone is read-only: refused, naming the fix.
    let err = builder()
        .connect(&clusters.one(clusters.standby))
        .expect_err("a standby must be refused");
    assert!(
        matches!(&err, Error::InvalidConfig { reason } if reason.contains("target_session_attrs=read-write")),
        "{err}"
    );

    // A cancelled wait for the standby: committed here only, so outcome unknown, not success;
    // and so is the retry that gets the lease back by its claim id, until the standby has it.
    clusters.run(&["sync-names", "no_such_standby"]);
    let probe = Arc::new(builder().connect(&clusters.url()).expect("connect"));
    let id = ClaimId::random();
    let claim_in_thread = || {
        let probe = probe.clone();
        std::thread::spawn(move || {
            let key = Key::new("cancelled-wait").unwrap();
            probe.claim_with_id(&key, fingerprint("cancelled-wait"), id)
        })
    };
    for attempt in ["the claim", "its retry"] {
        let claimer = claim_in_thread();
        cancel_sync_wait(&primary);
        match claimer.join().expect("claimer") {
            Err(err) => assert!(err.outcome_unknown(), "{attempt}: {err}"),
            Ok(claim) => panic!("{attempt}, committed on this server only, answered {claim:?}"),
        }
    }
    clusters.run(&["sync-names", "*"]);
    let again = claim_in_thread().join().expect("claimer");
    assert!(
        matches!(again, Ok(Claim::Acquired(_))),
        "the lease back once replicated: {again:?}"
    );
    drop(probe);

    // The load's store does not require failover safety: the promoted server stands alone (no
    // standby of its own), and `store`, which requires it, refuses to write there (below).
    let load = builder().connect(&clusters.url()).expect("connect");
    let figures = failover(&clusters, load, false);
    eprintln!("sync failover: {figures:?}");
    assert!(figures.claims_acked > 1000, "{figures:?}");
    assert_eq!(figures.lost_claims, 0, "{figures:?}");
    assert_eq!(figures.lost_completions, 0, "{figures:?}");
    assert_eq!(figures.double_runs, 0, "{figures:?}");
    assert!(figures.first_write_after_fault.is_some(), "{figures:?}");

    // On the promoted server, without a synchronous standby, the store that requires failover
    // safety finds it not safe on its first new connection: writes refused, nothing done,
    // reads served, and its report says so.
    let key = Key::new("after-promotion").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let refusal = loop {
        match store.claim(&key, fingerprint("after-promotion")) {
            Err(err) if err.to_string().contains("require_failover_safe") => break err,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            other => panic!("a write on the promoted server, alone, answered {other:?}"),
        }
    };
    assert!(!refusal.outcome_unknown(), "{refusal}");
    assert!(
        refusal.to_string().contains("not failover-safe"),
        "{refusal}"
    );
    assert_eq!(store.lookup(&key).expect("reads are served"), None);
    let status = store
        .metrics()
        .failover
        .expect("a PgStore reports failover safety");
    assert!(!status.safe, "{status:?}");
    assert!(status.unsafe_checks >= 1, "{status:?}");
    let stats = store.stats().expect("stats are served");
    assert!(
        stats
            .failover
            .is_some_and(|s| !s.safe && s.detail.starts_with("not failover-safe"))
    );
}

#[test]
fn asynchronous_replication_is_reported_not_failover_safe() {
    let Some(script) = script() else { return };
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let clusters = Clusters::up(script, "async");

    let mut strict = builder();
    strict.require_failover_safe(true);
    let refused = strict
        .connect(&clusters.url())
        .expect_err("require_failover_safe refuses");
    assert!(
        matches!(&refused, Error::InvalidConfig { reason } if reason.contains("not failover-safe")),
        "{refused}"
    );

    let (store, events) = connect_traced(&builder(), &clusters.url());
    let store = store.expect("served, with a warning");
    let report = store.failover_safety_at_connect().clone();
    eprintln!("async: {report}");
    assert!(!report.is_failover_safe(), "{report}");
    assert!(
        report.to_string().starts_with("not failover-safe"),
        "{report}"
    );
    #[cfg(feature = "tracing")]
    assert!(
        events
            .iter()
            .any(|e| e.starts_with("WARN") && e.contains("not failover-safe")),
        "no warning among {events:?}"
    );
    let _ = events;

    // The standby falls behind for the last second before the crash.
    let figures = failover(&clusters, store, true);
    eprintln!("async failover (standby 1 s behind): {figures:?}");
    // The check finds what asynchronous replication loses (a negative control).
    assert!(
        figures.lost_claims + figures.lost_completions > 0,
        "{figures:?}"
    );
}
