//! `PgStore` across Patroni's failovers: three Patroni nodes with etcd and HAProxy on this
//! machine (`.ci/patroni-setup`; `synchronous_mode: true`, `synchronous_mode_strict: false`),
//! 32 threads claiming and completing (`failover_load`), reached through HAProxy (which sends
//! connections to the node whose REST API answers 200 on `/primary`) and through a three-host
//! URL with `target_session_attrs=read-write`:
//!
//! - the leader killed (SIGKILL to its Patroni and its postmaster, as when its machine fails):
//!   Patroni promotes the synchronous standby once the leader key's `ttl` runs out;
//! - a planned switchover (`patronictl switchover --force`).
//!
//! Afterwards every acknowledged claim is still held or completed and every acknowledged
//! completion replays: 0 lost, 0 run twice. The time writes were unavailable is printed.
//!
//! With `synchronous_mode_strict` off, Patroni promotes with `synchronous_standby_names`
//! empty and names a standby only once one streams from the new primary: the store, which
//! reads its failover safety again on each new connection and periodically, must report the new
//! primary as not failover-safe in that window (`metrics()` and `stats()`), and as safe again
//! once it has a synchronous standby. A second store with `require_failover_safe(true)` has
//! its claims refused (not applied) in that window, and served after it. The store's "safe
//! again" is awaited from the moment the new leader has a synchronous standby (read by the
//! test on its own connections), which after a leader's death may take Patroni a `pg_rewind` and
//! a replication slot: if Patroni names none within two minutes the test fails with the
//! members and their logs (`.ci/patroni-setup status`).
//!
//! It starts and deletes a cluster of its own, so it runs only where `.ci/run` says so:
//! `IDEMPOTENCY_PG_PATRONI` names the set-up script. Skipped with a printed reason without it
//! (failed under `CI=true`).
#![cfg(feature = "postgres")]

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use idempotency_store::{Claim, IdempotencyStore, Key, pg::PgStore};

use crate::failover_load::{self, Load, builder, check, fingerprint};

/// Load before the fault.
const WARM_UP: Duration = Duration::from_secs(3);
/// The longest the test waits for writes to be served again.
const RECOVERY_LIMIT: Duration = Duration::from_secs(60);
/// The longest the test waits, from the fault, for Patroni to name a synchronous standby on the
/// new leader: one streaming from it, which after a leader's death may first need `pg_rewind`.
const SERVER_SYNC_LIMIT: Duration = Duration::from_secs(120);
/// The longest the test waits, after that, for the store to report the new primary safe.
const SAFE_AGAIN_LIMIT: Duration = Duration::from_secs(30);
/// The stores' check period here. Shorter than the default (2 s): through HAProxy the store
/// reaches the new leader only once its `/primary` check passes, which leaves a few seconds
/// of the window, and the test must see them whatever the phase of the period.
const CHECK_PERIOD: Duration = Duration::from_millis(500);
/// Load after the store reports the new primary safe: longer than the check period and a
/// probe's interval, so that the `require_failover_safe` store has checked again too.
const COOL_DOWN: Duration = Duration::from_secs(2);

fn script() -> Option<PathBuf> {
    failover_load::script("IDEMPOTENCY_PG_PATRONI", ".ci/patroni-setup")
}

/// The set-up script's output, trimmed.
fn run(script: &PathBuf, args: &[&str]) -> String {
    failover_load::run(script, args).trim().to_owned()
}

/// The Patroni cluster; deleted with the value.
struct Cluster {
    script: PathBuf,
    haproxy: u16,
    nodes: String,
}

impl Cluster {
    fn up(script: PathBuf) -> Cluster {
        let out = run(&script, &["up"]);
        let field = |name: &str| -> String {
            out.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name))
                .unwrap_or_else(|| panic!("no {name} in {out:?}"))
                .to_owned()
        };
        Cluster {
            haproxy: field("HAPROXY_PORT=").parse().expect("a port"),
            nodes: field("PG_PORTS="),
            script,
        }
    }

    fn run(&self, args: &[&str]) -> String {
        run(&self.script, args)
    }

    fn haproxy_url(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=idem password=idem dbname=idem connect_timeout=2",
            self.haproxy
        )
    }

    fn multi_host_url(&self) -> String {
        let hosts = vec!["127.0.0.1"; self.nodes.split(',').count()].join(",");
        format!(
            "host={hosts} port={} user=idem password=idem dbname=idem \
             target_session_attrs=read-write connect_timeout=2",
            self.nodes
        )
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(&self.script).arg("down").status();
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    KillLeader,
    Switchover,
}

/// One reading of the store's failover report after the fault.
#[derive(Debug)]
struct Seen {
    at: Duration,
    /// `metrics()` (the last check) or `stats()` (a check by the call).
    source: &'static str,
    safe: bool,
    detail: String,
}

/// What the `require_failover_safe` store's probe claims met after the fault.
#[derive(Debug, Default)]
struct Strict {
    /// Refused while its store found the primary not failover-safe.
    refused: Vec<Duration>,
    /// Acquired.
    acquired: Vec<Duration>,
    /// Each answered claim (acquired or refused): when it started and ended, and whether it
    /// was refused.
    answered: Vec<(Duration, Duration, bool)>,
    /// Other errors (the failover itself).
    failed: usize,
}

/// Reads `store`'s report from `fault` until `stop`: `metrics()` every 100 ms, `stats()` (a
/// check of its own) every fifth time.
fn observe(
    store: Arc<PgStore>,
    fault: Instant,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Vec<Seen>> {
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut round = 0u64;
        while !stop.load(Ordering::Relaxed) {
            round += 1;
            if let Some(status) = store.metrics().failover {
                seen.push(Seen {
                    at: fault.elapsed(),
                    source: "metrics",
                    safe: status.safe,
                    detail: status.detail,
                });
            }
            if round.is_multiple_of(5)
                && let Ok(stats) = store.stats()
            {
                let status = stats
                    .failover
                    .expect("PgStore's stats report failover safety");
                seen.push(Seen {
                    at: fault.elapsed(),
                    source: "stats",
                    safe: status.safe,
                    detail: status.detail,
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        seen
    })
}

/// Claims a fresh key through `strict` every 20 ms from `fault` until `stop`, as a client
/// would: the window can be shorter than a second through HAProxy, which reaches the new leader
/// only once its `/primary` check passes, so the probes must be as frequent as the load's.
fn probe(
    strict: PgStore,
    fault: Instant,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<Strict> {
    std::thread::spawn(move || {
        let mut probes = Strict::default();
        let mut round = 0u64;
        while !stop.load(Ordering::Relaxed) {
            round += 1;
            let name = format!("strict-{}-{round}", fault.elapsed().as_nanos());
            let key = Key::new(&name).unwrap();
            let start = fault.elapsed();
            match strict.claim(&key, fingerprint(&name)) {
                Ok(Claim::Acquired(_)) => {
                    probes.acquired.push(fault.elapsed());
                    probes.answered.push((start, fault.elapsed(), false));
                }
                Ok(other) => panic!("{name}: a fresh key answered {other:?}"),
                Err(err) if err.to_string().contains("require_failover_safe") => {
                    assert!(!err.outcome_unknown(), "a refusal does nothing: {err}");
                    probes.refused.push(fault.elapsed());
                    probes.answered.push((start, fault.elapsed(), true));
                }
                Err(_) => probes.failed += 1,
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        probes
    })
}

/// The writable node after the fault, read on the test's own connections.
#[derive(Clone, Copy, Debug)]
struct Reading {
    /// When, from the fault.
    at: Duration,
    /// The node's port: which member answered.
    port: i32,
    /// Whether `synchronous_standby_names` was empty.
    empty: bool,
    /// Whether a standby streamed from it with `sync_state` `sync` or `quorum`.
    streaming: bool,
}

type Readings = Arc<Mutex<Vec<Reading>>>;

/// One reading: the setting, whether a synchronous standby streams, and the node's port.
const SERVER_QUERY: &str = "SELECT current_setting('synchronous_standby_names'), \
     EXISTS (SELECT 1 FROM pg_stat_replication \
             WHERE state = 'streaming' AND sync_state IN ('sync', 'quorum')), \
     inet_server_port()";

/// The port of the writable node `url` reaches now.
fn leader_port(url: &str) -> i32 {
    let mut client = postgres::Client::connect(url, postgres::NoTls).expect("the leader");
    client
        .query_one("SELECT inet_server_port()", &[])
        .expect("its port")
        .get(0)
}

/// Polls the writable node's `synchronous_standby_names` and its streaming standbys (a new
/// connection each time, by the multi-host URL) from `fault` until `stop`, into `readings`: the
/// window as the server had it.
fn watch_server(
    url: String,
    fault: Instant,
    stop: Arc<AtomicBool>,
    readings: Readings,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            if let Ok(mut client) = postgres::Client::connect(&url, postgres::NoTls)
                && let Ok(row) = client.query_one(SERVER_QUERY, &[])
            {
                let names: String = row.get(0);
                readings.lock().unwrap().push(Reading {
                    at: fault.elapsed(),
                    empty: names.trim().is_empty(),
                    streaming: row.get(1),
                    port: row.get(2),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// Waits until the new leader (any node but `old_leader`) has a synchronous standby: the end
/// of the window as Patroni makes it, which the store's report can follow only afterwards.
/// Readings from the old leader do not count: it serves writes, with its standby, until the
/// fault lands, and the watcher's last reading stays one of those while no node accepts
/// connections. A name alone is not the end either: a new leader can carry one for a second or
/// two before Patroni finds that no standby streams from it and empties the setting, so the
/// standby must be streaming too. False if that took longer than `limit`.
fn await_server_safe(readings: &Readings, old_leader: i32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        let last = readings.lock().unwrap().last().copied();
        if last.is_some_and(|r| r.port != old_leader && !r.empty && r.streaming) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// From the first reading where `unsafe_` holds to the first after it where it does not.
fn window<T>(readings: &[T], at: impl Fn(&T) -> Duration, unsafe_: impl Fn(&T) -> bool) -> String {
    let Some(first) = readings.iter().position(&unsafe_) else {
        return "none".to_owned();
    };
    match readings[first..].iter().find(|r| !unsafe_(r)) {
        Some(end) => format!(
            "{}-{} ms after the fault ({} ms)",
            at(&readings[first]).as_millis(),
            at(end).as_millis(),
            (at(end) - at(&readings[first])).as_millis()
        ),
        None => format!("from {} ms, not over", at(&readings[first]).as_millis()),
    }
}

/// The strict store's claims that had to be refused: answered claims that started at least a
/// check period after the server's first reading without a synchronous standby (by then the
/// store reads it again on its next call) and ended by the last such reading of that run.
fn due_refusals(server: &[Reading], probes: &Strict) -> Vec<(Duration, Duration, bool)> {
    let Some(first) = server.iter().position(|r| r.empty) else {
        return Vec::new();
    };
    let last = server[first..]
        .iter()
        .take_while(|r| r.empty)
        .last()
        .map_or(server[first].at, |r| r.at);
    let opened = server[first].at + CHECK_PERIOD;
    probes
        .answered
        .iter()
        .copied()
        .filter(|&(start, end, _)| start >= opened && end <= last)
        .collect()
}

/// Load through `url`, the fault, the check: 0 lost, 0 run twice, and the non-strict window
/// reported. Leaves the cluster with three members and a synchronous standby. Returns whether
/// the strict store answered a claim inside the server's window (see `due_refusals`), which
/// must then have been refused.
fn case(cluster: &Cluster, url: &str, via: &str, fault: Fault) -> bool {
    let mut load_builder = builder();
    load_builder.failover_check_period(CHECK_PERIOD);
    let store = load_builder.connect(url).expect("connect");
    let status = store
        .metrics()
        .failover
        .expect("PgStore reports failover safety");
    assert!(
        status.safe,
        "a leader with a synchronous standby: {status:?}"
    );
    let mut strict_builder = builder();
    strict_builder
        .pool_size(1)
        .require_failover_safe(true)
        .failover_check_period(CHECK_PERIOD);
    let strict = strict_builder.connect(url).expect("connect, failover-safe");

    let run = format!("{via}-{fault:?}");
    let load = Load::start(store, &run);
    std::thread::sleep(WARM_UP);
    let old_leader = leader_port(&cluster.multi_host_url());
    let stop = Arc::new(AtomicBool::new(false));
    let at = Instant::now();
    let observer = observe(load.store.clone(), at, stop.clone());
    let prober = probe(strict, at, stop.clone());
    let readings = Readings::default();
    let server = watch_server(cluster.multi_host_url(), at, stop.clone(), readings.clone());
    let killed = match fault {
        Fault::KillLeader => Some(cluster.run(&["kill-leader"])),
        Fault::Switchover => {
            cluster.run(&["switchover"]);
            None
        }
    };
    let served = load.await_write_after(at, RECOVERY_LIMIT);
    let server_safe =
        served.is_some() && await_server_safe(&readings, old_leader, SERVER_SYNC_LIMIT);
    let status = if server_safe {
        String::new()
    } else {
        cluster.run(&["status"])
    };
    // Until the store's own report (no I/O: what its calls checked) is safe again.
    let deadline = Instant::now() + SAFE_AGAIN_LIMIT;
    while served.is_some() && Instant::now() < deadline {
        let safe = load.store.metrics().failover.is_some_and(|s| s.safe);
        let unsafe_seen = load
            .store
            .metrics()
            .failover
            .is_some_and(|s| s.unsafe_checks > 0);
        if safe && unsafe_seen {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(COOL_DOWN);
    stop.store(true, Ordering::Relaxed);
    let seen = observer.join().expect("observer");
    let probes = prober.join().expect("prober");
    server.join().expect("server watch");
    let server = std::mem::take(&mut *readings.lock().unwrap());
    let (ledger, mut figures) = load.finish(at);
    check(url, &ledger, &mut figures);
    eprintln!("patroni {run}: {figures:?}");

    let first_unsafe = seen.iter().position(|s| !s.safe);
    let safe_again =
        first_unsafe.and_then(|i| seen[i..].iter().position(|s| s.safe).map(|j| i + j));
    eprintln!(
        "patroni {run}: synchronous_standby_names empty on the leader {}; reported not \
         failover-safe by the store {}; the require_failover_safe store: {} claims refused, {} \
         acquired after the first refusal, {} other errors",
        window(&server, |r| r.at, |r| r.empty),
        window(&seen, |s| s.at, |s| !s.safe),
        probes.refused.len(),
        probes
            .acquired
            .iter()
            .filter(|t| probes.refused.first().is_some_and(|r| *t > r))
            .count(),
        probes.failed,
    );

    assert!(
        served.is_some(),
        "no write served within {RECOVERY_LIMIT:?}: {figures:?}"
    );
    assert!(
        server_safe,
        "Patroni named no synchronous standby on a new leader within {SERVER_SYNC_LIMIT:?} of \
         the fault (the cluster's doing, not the store's); the last reading {:?}:\n{status}",
        server.last()
    );
    assert!(figures.claims_acked > 1000, "{figures:?}");
    assert_eq!(figures.lost_claims, 0, "{figures:?}");
    assert_eq!(figures.lost_completions, 0, "{figures:?}");
    assert_eq!(figures.double_runs, 0, "{figures:?}");

    // The non-strict window, seen while it lasted, and its end.
    let Some(first_unsafe) = first_unsafe else {
        panic!("the new primary was never reported not failover-safe: {seen:#?}");
    };
    assert!(
        seen[first_unsafe].detail.starts_with("not failover-safe"),
        "{:?}",
        seen[first_unsafe]
    );
    assert!(
        safe_again.is_some(),
        "never reported safe again after {:?}: {:#?}",
        seen[first_unsafe],
        &seen[first_unsafe..]
    );
    let last = seen.last().expect("readings");
    assert!(last.safe, "the last reading: {last:?}");
    assert!(
        seen.iter().any(|s| s.source == "stats" && !s.safe),
        "stats() never reported the window: {seen:#?}"
    );
    // A call can span the whole window (one through HAProxy waited 4 s on the old leader
    // while the window lasted 2 s): what must have been refused is what was answered in it.
    let due = due_refusals(&server, &probes);
    assert!(
        due.iter().all(|&(_, _, refused)| refused),
        "require_failover_safe let a write through while the server had no synchronous \
         standby: {due:?}; {probes:?}"
    );
    let first_refusal = probes.refused.first().copied();
    assert!(
        due.is_empty() || first_refusal.is_some(),
        "require_failover_safe refused no write in the window: {probes:?}"
    );
    assert!(
        first_refusal.is_none() || probes.acquired.iter().any(|t| Some(*t) > first_refusal),
        "require_failover_safe still refuses once safe again: {probes:?}"
    );

    if let Some(node) = killed {
        cluster.run(&["start", &node]);
    }
    cluster.run(&["await-sync"]);
    !due.is_empty()
}

#[test]
fn patroni_failovers_lose_nothing_and_report_the_window() {
    let Some(script) = script() else { return };
    let cluster = Cluster::up(script);
    let haproxy = cluster.haproxy_url();
    let multi = cluster.multi_host_url();
    let tested = [
        case(&cluster, &haproxy, "haproxy", Fault::KillLeader),
        case(&cluster, &multi, "multi-host", Fault::Switchover),
        case(&cluster, &multi, "multi-host", Fault::KillLeader),
        case(&cluster, &haproxy, "haproxy", Fault::Switchover),
    ];
    // The windows after a killed leader last seconds: the strict store's refusal is tested
    // in most cases, and must be in some.
    assert!(
        tested.iter().filter(|&&t| t).count() >= 2,
        "the strict store answered a claim inside the window in {tested:?} only"
    );
}
