//! Load test: durable claim+complete pairs, replays and a mixed load, for this store against
//! SQLite (WAL, `synchronous=FULL`) and the raw `fdatasync` rate of the disk, in one process.
//! Built with `--features postgres` and run with `IDEMPOTENCY_PG_URL` set, it also measures
//! `PgStore` (one pooled connection per thread, a fresh schema per cell) as system `postgres`
//! (`sslmode=disable`) and `postgres-tls` (`sslmode=require`), and as `pg-probe` the seed
//! schema's plain statements on the same server (pairs only: per pair an autocommit
//! `INSERT … ON CONFLICT DO NOTHING RETURNING` and an `UPDATE`, both prepared, one connection
//! per thread, no TLS), the floor `PgStore`'s fencing and fingerprints are measured against.
//!
//! ```text
//! cargo run --release --example loadtest -- [--seconds S] [--threads 1,4,16,64] [--dir PATH]
//!     [--json-only] [--only NAME[,NAME..]] [--replay-keys N] [--recorder]
//! cargo run --release --example loadtest -- --sweep [--records N] [--seconds S] [--dir PATH]
//!     [--sweep-batch N]
//! cargo run --release --example loadtest -- --space [--records N] [--dir PATH]
//! cargo run --release --example loadtest -- --recovery [--records N] [--dir PATH]
//! ```
//!
//! `--recovery` runs a child that fills a store and aborts (no clean close), then times the
//! first open after that crash, for each `Durability`.
//!
//! `outbox` is the client's (`idempotency_store::client`): a pair is `Outbox::begin` of a fresh
//! operation (its key durable before it returns) and `Outbox::finish`, on a store of its own.
//!
//! `--only` filters by system (`store`, `store-nogc`, `store-txn`, `sqlite-full`, `postgres`,
//! `postgres-tls`, `pg-probe`, `store-quickrepair`, `outbox`, `fdatasync`) and by workload (`pairs`,
//! `replay`, `mixed`, `payments`); a cell runs if its system is named (or no system is) and its
//! workload is named (or no workload is).
//!
//! `payments` is the exactly-once path: a fresh claim, then one ledger row written with the
//! stored response. `store` writes the row with `Store::complete_with_effects` (it shares the
//! group-commit batch), `store-txn` with `Store::complete_with` (a redb commit of its own, the
//! slow path), `sqlite-full` in its natural form: the claim in one commit, then the ledger
//! insert and the response update in one transaction.
//! Every run prints a table, then one line starting `JSON: ` with every figure.
//!
//! Each cell gets a fresh database in a fresh temporary directory under `--dir`, runs a short
//! warm-up, then counts the operations that complete inside a measurement window of `S`
//! seconds. Keys are random UUID-shaped strings (36 bytes), so inserts land all over the
//! B-tree, as client-generated keys do.

use std::fmt::Write as _;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::{ArgGroup, Parser};
use idempotency_store::client::{Begun, Outbox};
use idempotency_store::redb::{self, TableDefinition};
use idempotency_store::{
    Claim, Durability, Fingerprint, IdempotencyStore, Key, ManualClock, Response, Store, Timestamp,
};
use rusqlite::{Connection, ErrorCode, OptionalExtension, TransactionBehavior, params};
use serde_json::{Map, Value};

type Res<T> = Result<T, String>;

const BODY_LEN: usize = 200;
const MIXED_HALF: usize = 16;
const SQLITE_DB: &str = "sqlite-full.db";
/// The payments workload's ledger: idempotency key → (amount, customer).
const LEDGER: TableDefinition<&str, (u64, &str)> = TableDefinition::new("ledger");
const AMOUNT: u64 = 4999;
const CUSTOMER: &str = "cus_123";

// ---------------------------------------------------------------------------------------------
// Arguments

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Main,
    Sweep,
    Space,
    Recovery,
    /// Internal: the child of `--recovery`, which fills a store and aborts.
    RecoveryChild,
}

struct Args {
    mode: Mode,
    seconds: f64,
    threads: Vec<usize>,
    dir: Option<PathBuf>,
    json_only: bool,
    only: Vec<String>,
    records: u64,
    replay_keys: usize,
    prefill_threads: usize,
    /// `--sweep` with this: the sweeper loops `sweep(N)` instead of calling `sweep_all()`.
    sweep_batch: Option<usize>,
    /// `--recovery-child` only: the store file and its durability.
    child: Option<(PathBuf, Durability)>,
    /// `--recorder`: a Prometheus recorder receives the `metrics` facade's values, as in a
    /// service that exports them (with the `metrics` feature; without it nothing is sent).
    recorder: bool,
}

/// The command line (`--help` lists it).
#[derive(Parser)]
#[command(
    name = "loadtest",
    about = "Durable pairs, replays, mixed load and payments for this store against SQLite and \
             the disk's fdatasync rate; or --sweep, --space, --recovery"
)]
#[command(group(ArgGroup::new("mode").args(["sweep", "space", "recovery", "recovery_child"])))]
struct Cli {
    /// Seconds of measurement per cell.
    #[arg(long, default_value = "3", value_parser = positive_seconds)]
    seconds: f64,
    /// Thread counts, one cell each (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64", value_parser = positive_count)]
    threads: Vec<usize>,
    /// Directory for the cells' databases (default: a temporary directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Print only the `JSON: ` line.
    #[arg(long)]
    json_only: bool,
    /// Systems and workloads to run (comma-separated; see the example's docs).
    #[arg(long, value_name = "NAME[,NAME..]", value_delimiter = ',', value_parser = trimmed)]
    only: Vec<String>,
    /// Records for --sweep, --space and --recovery.
    #[arg(long, default_value = "1000000", value_parser = number::<u64>)]
    records: u64,
    /// Keys the replay workload reads.
    #[arg(long, default_value = "10000", value_parser = at_least_one)]
    replay_keys: usize,
    /// Threads that prefill --space and --sweep stores.
    #[arg(long, default_value = "64", value_parser = at_least_one)]
    prefill_threads: usize,
    /// With --sweep: loop `sweep(N)` instead of calling `sweep_all()`.
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    sweep_batch: Option<usize>,
    /// Send the `metrics` facade's values to a Prometheus recorder, as a service would.
    #[arg(long)]
    recorder: bool,
    /// Claim p99 while a sweep deletes `--records` expired records.
    #[arg(long)]
    sweep: bool,
    /// Peak RSS and file size with `--records` records.
    #[arg(long)]
    space: bool,
    /// The first open after a crash, for each durability.
    #[arg(long)]
    recovery: bool,
    /// Internal: the child of --recovery (store file, then `quick-repair` or `immediate`).
    #[arg(long, num_args = 2, value_names = ["PATH", "DURABILITY"], hide = true)]
    recovery_child: Option<Vec<String>>,
}

/// A number, `_` separators allowed (`1_000_000`).
fn number<T: std::str::FromStr>(s: &str) -> Res<T> {
    s.trim()
        .replace('_', "")
        .parse()
        .map_err(|_| format!("not a number: {s:?}"))
}

fn positive_seconds(s: &str) -> Res<f64> {
    let seconds: f64 = number(s)?;
    if seconds.is_finite() && seconds > 0.0 {
        Ok(seconds)
    } else {
        Err("--seconds must be positive".into())
    }
}

fn positive_count(s: &str) -> Res<usize> {
    match number(s)? {
        0 => Err("--threads needs positive counts".into()),
        n => Ok(n),
    }
}

/// A count below 1 is taken as 1.
fn at_least_one(s: &str) -> Res<usize> {
    number::<usize>(s).map(|n| n.max(1))
}

fn trimmed(s: &str) -> Res<String> {
    Ok(s.trim().to_owned())
}

fn parse_args() -> Args {
    let cli = Cli::parse();
    let child = cli.recovery_child.map(|values| {
        let path = PathBuf::from(values.first().cloned().unwrap_or_default());
        let durability = match values.get(1).map(String::as_str) {
            Some("quick-repair") => Durability::QuickRepair,
            _ => Durability::Immediate,
        };
        (path, durability)
    });
    let mode = if child.is_some() {
        Mode::RecoveryChild
    } else if cli.sweep {
        Mode::Sweep
    } else if cli.space {
        Mode::Space
    } else if cli.recovery {
        Mode::Recovery
    } else {
        Mode::Main
    };
    Args {
        mode,
        seconds: cli.seconds,
        threads: cli.threads,
        dir: cli.dir,
        json_only: cli.json_only,
        only: cli.only,
        records: cli.records,
        replay_keys: cli.replay_keys,
        prefill_threads: cli.prefill_threads,
        sweep_batch: cli.sweep_batch,
        child,
        recorder: cli.recorder,
    }
}

// ---------------------------------------------------------------------------------------------
// Small tools: output, JSON, keys, random numbers, percentiles, the bench directory

/// Prints unless `--json-only`.
struct Out {
    quiet: bool,
}

impl Out {
    fn line(&self, s: impl AsRef<str>) {
        if !self.quiet {
            println!("{}", s.as_ref());
        }
    }

    /// Progress notes go to stderr so that stdout stays a clean report.
    fn note(&self, s: impl AsRef<str>) {
        if !self.quiet {
            eprintln!("  .. {}", s.as_ref());
        }
    }
}

/// Building the report on `serde_json` values: `set` chains fields onto an object, `child` is
/// the object under a key (created if missing).
trait Report {
    fn set(&mut self, key: impl Into<String>, value: Value) -> &mut Self;
    fn child(&mut self, key: &str) -> &mut Value;
}

impl Report for Value {
    fn set(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        if let Value::Object(fields) = self {
            fields.insert(key.into(), value);
        }
        self
    }

    fn child(&mut self, key: &str) -> &mut Value {
        let slot = &mut self[key];
        if slot.is_null() {
            *slot = obj();
        }
        slot
    }
}

/// An empty JSON object.
fn obj() -> Value {
    Value::Object(Map::new())
}

/// A measured figure, to 3 decimals; `null` if it is not finite.
fn num(n: f64) -> Value {
    if n.is_finite() {
        Value::from((n * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

/// An optional figure, `null` when absent.
fn opt(v: Option<f64>) -> Value {
    v.map_or(Value::Null, num)
}

/// splitmix64's finaliser: a bijection on u64, so distinct inputs give distinct outputs.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A UUID-shaped key (36 bytes) for record `index` of `stream`; unique per (stream, index) and
/// scattered over the key space like client-generated UUIDv4s.
fn key_name(stream: u64, index: u64) -> String {
    let hi = mix64((stream << 40) ^ index);
    let lo = mix64(hi ^ 0x5eed_5eed_5eed_5eed);
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        hi >> 32,
        (hi >> 16) & 0xffff,
        hi & 0xfff,
        (lo >> 48) | 0x8000,
        lo & 0xffff_ffff_ffff
    )
}

fn fingerprint_of(name: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", name])
}

/// xorshift64*: a cheap per-thread generator for picking replay keys.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(mix64(seed) | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((u128::from(r) * n as u128) >> 64) as usize
    }
}

fn body() -> Vec<u8> {
    (0..BODY_LEN).map(|i| b'a' + (i % 26) as u8).collect()
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Latency percentiles of a sample in nanoseconds, reported in microseconds.
#[derive(Clone, Copy, Default)]
struct Lat {
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    n: usize,
}

fn percentiles(mut ns: Vec<u64>) -> Option<Lat> {
    if ns.is_empty() {
        return None;
    }
    ns.sort_unstable();
    let at = |q: f64| {
        let i = ((ns.len() as f64 * q).ceil() as usize).clamp(1, ns.len()) - 1;
        ns[i] as f64 / 1000.0
    };
    Some(Lat {
        p50_us: at(0.50),
        p99_us: at(0.99),
        max_us: ns[ns.len() - 1] as f64 / 1000.0,
        n: ns.len(),
    })
}

fn lat_json(lat: Option<Lat>) -> Value {
    match lat {
        None => Value::Null,
        Some(l) => {
            let mut j = obj();
            j.set("p50_us", num(l.p50_us))
                .set("p99_us", num(l.p99_us))
                .set("max_us", num(l.max_us))
                .set("samples", Value::from(l.n as u64));
            j
        }
    }
}

/// The filesystem type holding `path`, from the longest matching mount point.
fn filesystem_of(path: &Path) -> String {
    let path = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    let mut best: Option<(usize, String, String)> = None;
    for line in mounts.lines() {
        let mut parts = line.split_whitespace();
        let (Some(dev), Some(mnt), Some(fs)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let mnt = mnt.replace("\\040", " ");
        if path.starts_with(&mnt) && best.as_ref().is_none_or(|(len, _, _)| mnt.len() >= *len) {
            best = Some((mnt.len(), fs.to_owned(), dev.to_owned()));
        }
    }
    best.map_or_else(|| "unknown".into(), |(_, fs, dev)| format!("{fs} ({dev})"))
}

/// `--dir`, or the system temp dir unless that is in memory (then `target/loadtest`).
fn bench_dir(args: &Args) -> Res<PathBuf> {
    let dir = match &args.dir {
        Some(dir) => dir.clone(),
        None => {
            let tmp = std::env::temp_dir();
            let fs = filesystem_of(&tmp);
            if fs.starts_with("tmpfs") || fs.starts_with("ramfs") {
                PathBuf::from("target").join("loadtest")
            } else {
                tmp
            }
        }
    };
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    Ok(dir.canonicalize().unwrap_or(dir))
}

fn fresh_dir(base: &Path, label: &str) -> Res<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("loadtest-{label}-"))
        .tempdir_in(base)
        .map_err(|e| format!("temp dir in {}: {e}", base.display()))
}

fn peak_rss_kib() -> Option<u64> {
    proc_status_kib("VmHWM")
}

/// A `kB` field of `/proc/self/status` (`VmHWM`, `VmRSS`, `RssAnon`, `RssFile`).
fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status
        .lines()
        .find(|l| l.split(':').next() == Some(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Length and allocated bytes (`st_blocks` × 512) of a file.
fn file_bytes(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or((0, 0), |m| (m.len(), m.blocks() * 512))
}

fn err(context: &str, e: impl std::fmt::Display) -> String {
    format!("{context}: {e}")
}

// ---------------------------------------------------------------------------------------------
// Systems under test

/// One thread's connection to a system.
trait Client {
    /// Claims a fresh key (it must be acquired) and completes it with a 200-byte body.
    fn pair(&mut self) -> Res<()>;
    /// Claims an existing completed key with its fingerprint (it must replay).
    fn replay(&mut self) -> Res<()>;
    /// Claims a fresh key and completes it with one ledger row written atomically with the
    /// response.
    fn payment(&mut self) -> Res<()> {
        Err("this system does not run the payments workload".into())
    }
}

/// A system shared by all threads of a cell.
trait System: Sync {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>>;
}

/// The keys completed before a replay run.
struct ReplaySet {
    names: Vec<String>,
    keys: Vec<Key>,
    fps: Vec<Fingerprint>,
}

/// Key stream of the replay set; pair threads use streams below it.
const REPLAY_STREAM: u64 = 1 << 20;

impl ReplaySet {
    fn new(n: usize) -> Res<Self> {
        let names: Vec<String> = (0..n as u64).map(|i| key_name(REPLAY_STREAM, i)).collect();
        let keys = names
            .iter()
            .map(|n| Key::new(n).map_err(|e| err("key", e)))
            .collect::<Res<_>>()?;
        let fps = names.iter().map(|n| fingerprint_of(n)).collect();
        Ok(ReplaySet { names, keys, fps })
    }
}

/// Pair keys: stream = cell id × 4096 + thread, index = a per-thread counter.
struct Fresh {
    stream: u64,
    next: u64,
}

impl Fresh {
    fn next(&mut self) -> String {
        self.next += 1;
        key_name(self.stream, self.next)
    }
}

static CELL: AtomicU64 = AtomicU64::new(1);

fn fresh_for(thread: usize, cell: u64) -> Fresh {
    Fresh {
        stream: (cell << 12) | thread as u64,
        next: 0,
    }
}

// --- this store

struct StoreSys {
    store: Arc<dyn IdempotencyStore>,
    /// The same store as a redb `Store`, for payments (`None` on PostgreSQL).
    redb: Option<Arc<Store>>,
    /// Payments through `complete_with` (a commit of its own) instead of the batch's effects.
    slow_effects: bool,
    set: Arc<ReplaySet>,
    cell: u64,
    body: Vec<u8>,
}

struct StoreClient<'a> {
    sys: &'a StoreSys,
    fresh: Fresh,
    rng: Rng,
}

impl System for StoreSys {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        Ok(Box::new(StoreClient {
            sys: self,
            fresh: fresh_for(thread, self.cell),
            rng: Rng::new(thread as u64 ^ (self.cell << 32)),
        }))
    }
}

impl Client for StoreClient<'_> {
    fn pair(&mut self) -> Res<()> {
        let name = self.fresh.next();
        let key = Key::new(&name).map_err(|e| err("key", e))?;
        let store = &self.sys.store;
        match store.claim(&key, fingerprint_of(&name)) {
            Ok(Claim::Acquired(lease)) => store
                .complete(&lease, Response::new(200, self.sys.body.clone()))
                .map_err(|e| err("complete", e)),
            Ok(other) => Err(format!("fresh key {name} not acquired: {other:?}")),
            Err(e) => Err(err("claim", e)),
        }
    }

    fn replay(&mut self) -> Res<()> {
        let set = &self.sys.set;
        let i = self.rng.below(set.keys.len());
        match self.sys.store.claim(&set.keys[i], set.fps[i]) {
            Ok(Claim::Completed(replay)) if replay.response.body.len() == BODY_LEN => Ok(()),
            Ok(other) => Err(format!("key {} did not replay: {other:?}", set.names[i])),
            Err(e) => Err(err("replay claim", e)),
        }
    }

    fn payment(&mut self) -> Res<()> {
        let store = self
            .sys
            .redb
            .as_ref()
            .ok_or("payments run on the redb store only")?;
        let name = self.fresh.next();
        let key = Key::new(&name).map_err(|e| err("key", e))?;
        let lease = match store.claim(&key, fingerprint_of(&name)) {
            Ok(Claim::Acquired(lease)) => lease,
            Ok(other) => return Err(format!("fresh key {name} not acquired: {other:?}")),
            Err(e) => return Err(err("claim", e)),
        };
        let response = Response::new(201, self.sys.body.clone());
        if self.sys.slow_effects {
            let written = store.complete_with(&lease, response, |txn| {
                txn.open_table(LEDGER)?
                    .insert(name.as_str(), (AMOUNT, CUSTOMER))?;
                Ok::<_, redb::Error>(())
            });
            return written
                .map_err(|e| err("complete_with", e))?
                .map_err(|e| err("ledger row", e));
        }
        store
            .complete_with_effects(&lease, response, move |fx| {
                fx.insert(LEDGER, name.as_str(), (AMOUNT, CUSTOMER))
            })
            .map_err(|e| err("complete_with_effects", e))?
            .map_err(|e| err("ledger row", e))
    }
}

fn open_store(dir: &Path, nogc: bool, durability: Durability) -> Res<Store> {
    let mut builder = Store::builder();
    builder.durability(durability).effect_table(LEDGER);
    if nogc {
        builder.max_batch(1);
    }
    builder
        .open(dir.join("store.redb"))
        .map_err(|e| err("opening the store", e))
}

/// Completes `n` records (claim + complete, 200-byte body) from `threads` threads so that group
/// commit makes the batches big. `name(i)` names record `i`.
fn prefill_store(
    store: &dyn IdempotencyStore,
    n: u64,
    threads: usize,
    name: &(dyn Fn(u64) -> String + Sync),
    out: &Out,
) -> Res<Duration> {
    let next = AtomicU64::new(0);
    let failed = Mutex::new(None::<String>);
    let body = body();
    let started = Instant::now();
    let step = (n / 10).max(1);
    thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n || failed.lock().is_ok_and(|f| f.is_some()) {
                        return;
                    }
                    let name = name(i);
                    let result = Key::new(&name).map_err(|e| err("key", e)).and_then(|key| {
                        match store.claim(&key, fingerprint_of(&name)) {
                            Ok(Claim::Acquired(lease)) => store
                                .complete(&lease, Response::new(200, body.clone()))
                                .map_err(|e| err("prefill complete", e)),
                            Ok(other) => Err(format!("prefill key not acquired: {other:?}")),
                            Err(e) => Err(err("prefill claim", e)),
                        }
                    });
                    if let Err(e) = result {
                        if let Ok(mut f) = failed.lock() {
                            f.get_or_insert(e);
                        }
                        return;
                    }
                    if (i + 1).is_multiple_of(step) {
                        out.note(format!(
                            "prefill {}/{n} after {:.1} s",
                            i + 1,
                            started.elapsed().as_secs_f64()
                        ));
                    }
                }
            });
        }
    });
    match failed.into_inner().ok().flatten() {
        Some(e) => Err(e),
        None => Ok(started.elapsed()),
    }
}

// --- SQLite, WAL, synchronous=FULL, one connection per thread

struct SqliteSys {
    path: PathBuf,
    set: Arc<ReplaySet>,
    cell: u64,
    body: Vec<u8>,
}

struct SqliteClient<'a> {
    sys: &'a SqliteSys,
    conn: Connection,
    fresh: Fresh,
    rng: Rng,
    thread: u64,
    tokens: u64,
}

const SQL_SCHEMA: &str = "
    CREATE TABLE IF NOT EXISTS idempotency_keys(
        key TEXT PRIMARY KEY,
        fingerprint BLOB NOT NULL,
        status TEXT NOT NULL,
        token INTEGER,
        lease_until INTEGER,
        response_status INTEGER,
        response_headers BLOB,
        response_body BLOB,
        created_at INTEGER NOT NULL,
        expires_at INTEGER NOT NULL);
    CREATE INDEX IF NOT EXISTS idempotency_keys_expires_at ON idempotency_keys(expires_at);
    CREATE TABLE IF NOT EXISTS ledger(
        key TEXT PRIMARY KEY,
        amount INTEGER NOT NULL,
        customer TEXT NOT NULL);";
const SQL_LEDGER: &str = "INSERT INTO ledger (key, amount, customer) VALUES (?1, ?2, ?3)";
const SQL_CLAIM: &str = "INSERT INTO idempotency_keys
    (key, fingerprint, status, token, lease_until, created_at, expires_at)
    VALUES (?1, ?2, 'in_progress', ?3, ?4, ?5, ?6)";
const SQL_COMPLETE: &str = "UPDATE idempotency_keys
    SET status = 'completed', token = NULL, lease_until = NULL, response_status = ?3,
        response_headers = ?4, response_body = ?5, expires_at = ?6
    WHERE key = ?1 AND token = ?2 AND status = 'in_progress'";
const SQL_GET: &str = "SELECT fingerprint, status, lease_until, response_status, response_headers,
    response_body, expires_at FROM idempotency_keys WHERE key = ?1";
const LEASE_MS: i64 = 60_000;
const RETENTION_MS: i64 = 24 * 3600 * 1000;

/// A stored row as the claim sees it.
struct Row {
    fingerprint: Vec<u8>,
    status: String,
    response_status: Option<i64>,
    response_body: Option<Vec<u8>>,
    expires_at: i64,
}

fn sqlite_connect(path: &Path) -> Res<Connection> {
    let conn = Connection::open(path).map_err(|e| err("sqlite open", e))?;
    conn.busy_timeout(Duration::from_secs(120))
        .map_err(|e| err("busy_timeout", e))?;
    conn.pragma_update(None, "journal_mode", "WAL")
        .map_err(|e| err("journal_mode", e))?;
    conn.pragma_update(None, "synchronous", "FULL")
        .map_err(|e| err("synchronous", e))?;
    conn.set_prepared_statement_cache_capacity(16);
    Ok(conn)
}

impl SqliteSys {
    fn create(dir: &Path, set: Arc<ReplaySet>, cell: u64) -> Res<Self> {
        let path = dir.join(SQLITE_DB);
        let conn = sqlite_connect(&path)?;
        conn.execute_batch(SQL_SCHEMA)
            .map_err(|e| err("sqlite schema", e))?;
        Ok(SqliteSys {
            path,
            set,
            cell,
            body: body(),
        })
    }

    /// Inserts the replay set as completed rows, in one transaction.
    fn prefill(&self) -> Res<()> {
        let mut conn = sqlite_connect(&self.path)?;
        let tx = conn.transaction().map_err(|e| err("sqlite begin", e))?;
        {
            let mut stmt = tx
                .prepare(
                    "INSERT INTO idempotency_keys (key, fingerprint, status, response_status,
                     response_headers, response_body, created_at, expires_at)
                     VALUES (?1, ?2, 'completed', 200, x'', ?3, ?4, ?5)",
                )
                .map_err(|e| err("sqlite prepare", e))?;
            let now = now_ms();
            for (name, fp) in self.set.names.iter().zip(&self.set.fps) {
                stmt.execute(params![
                    name,
                    &fp.digest()[..],
                    &self.body,
                    now,
                    now + RETENTION_MS
                ])
                .map_err(|e| err("sqlite prefill", e))?;
            }
        }
        tx.commit().map_err(|e| err("sqlite commit", e))
    }
}

impl System for SqliteSys {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        Ok(Box::new(SqliteClient {
            sys: self,
            conn: sqlite_connect(&self.path)?,
            fresh: fresh_for(thread, self.cell),
            rng: Rng::new(thread as u64 ^ (self.cell << 32)),
            thread: thread as u64,
            tokens: 0,
        }))
    }
}

impl SqliteClient<'_> {
    fn get(&self, key: &str) -> Res<Option<Row>> {
        let mut stmt = self
            .conn
            .prepare_cached(SQL_GET)
            .map_err(|e| err("prepare", e))?;
        stmt.query_row([key], |r| {
            Ok(Row {
                fingerprint: r.get(0)?,
                status: r.get(1)?,
                response_status: r.get(3)?,
                response_body: r.get(5)?,
                expires_at: r.get(6)?,
            })
        })
        .optional()
        .map_err(|e| err("select", e))
    }
}

impl SqliteClient<'_> {
    /// Claims a fresh key in a commit of its own; returns its name and token.
    fn claim_fresh(&mut self) -> Res<(String, i64)> {
        let name = self.fresh.next();
        let fp = fingerprint_of(&name);
        self.tokens += 1;
        let token = ((self.thread << 40) | self.tokens) as i64;
        let now = now_ms();
        let inserted = {
            let mut claim = self
                .conn
                .prepare_cached(SQL_CLAIM)
                .map_err(|e| err("prepare", e))?;
            claim.execute(params![
                name,
                &fp.digest()[..],
                token,
                now + LEASE_MS,
                now,
                now + RETENTION_MS
            ])
        };
        match inserted {
            Ok(1) => Ok((name, token)),
            Ok(n) => Err(format!("claim inserted {n} rows")),
            Err(rusqlite::Error::SqliteFailure(e, _))
                if e.code == ErrorCode::ConstraintViolation =>
            {
                // Taken: classify the stored row (never expected for a fresh key).
                let row = self.get(&name)?;
                Err(format!(
                    "fresh key {name} already taken (status {:?})",
                    row.map(|r| r.status)
                ))
            }
            Err(e) => Err(err("claim insert", e)),
        }
    }
}

/// Stores the response of `name`'s claim `token` in `conn` (autocommit or a transaction).
fn sqlite_complete(conn: &Connection, name: &str, token: i64, body: &[u8]) -> Res<()> {
    let mut complete = conn
        .prepare_cached(SQL_COMPLETE)
        .map_err(|e| err("prepare", e))?;
    match complete.execute(params![
        name,
        token,
        200,
        &b""[..],
        body,
        now_ms() + RETENTION_MS
    ]) {
        Ok(1) => Ok(()),
        Ok(n) => Err(format!("complete updated {n} rows (lease lost)")),
        Err(e) => Err(err("complete update", e)),
    }
}

impl Client for SqliteClient<'_> {
    fn pair(&mut self) -> Res<()> {
        let (name, token) = self.claim_fresh()?;
        sqlite_complete(&self.conn, &name, token, &self.sys.body)
    }

    /// The claim's commit, then the ledger row and the response in one transaction.
    fn payment(&mut self) -> Res<()> {
        let (name, token) = self.claim_fresh()?;
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|e| err("sqlite begin", e))?;
        tx.prepare_cached(SQL_LEDGER)
            .and_then(|mut insert| insert.execute(params![name, AMOUNT as i64, CUSTOMER]))
            .map_err(|e| err("ledger insert", e))?;
        sqlite_complete(&tx, &name, token, &self.sys.body)?;
        tx.commit().map_err(|e| err("sqlite commit", e))
    }

    fn replay(&mut self) -> Res<()> {
        let set = &self.sys.set;
        let i = self.rng.below(set.names.len());
        let row = self.get(&set.names[i])?;
        match row {
            Some(row)
                if row.fingerprint == set.fps[i].digest()[..]
                    && row.status == "completed"
                    && row.expires_at > now_ms()
                    && row.response_status == Some(200)
                    && row
                        .response_body
                        .as_ref()
                        .is_some_and(|b| b.len() == BODY_LEN) =>
            {
                Ok(())
            }
            _ => Err(format!("key {} did not replay", set.names[i])),
        }
    }
}

// --- the floor: group commit of a bare log, no store at all

/// What any store with this API shape must at least do per operation on this machine: queue
/// the caller, append a record to a preallocated log, share one `fdatasync` per batch, wake the
/// caller. Leader/follower with a slot per caller, like the store's committer, but no lookups,
/// no encoding, no B-tree: its pairs/s bound what a blocking, durable, group-committed `claim`
/// plus `complete` can reach here, whatever the store does.
struct LogBound {
    file: File,
    queue: parking_lot::Mutex<BoundQueue>,
}

#[derive(Default)]
struct BoundQueue {
    buf: Vec<u8>,
    waiting: Vec<Arc<BoundSlot>>,
    leader: bool,
    /// Where the next batch goes in the log, which wraps around like the store's.
    at: u64,
}

#[derive(Default)]
struct BoundSlot {
    /// 0 queued, 1 lead, 2 durable.
    state: parking_lot::Mutex<u8>,
    changed: parking_lot::Condvar,
}

impl BoundSlot {
    fn set(&self, state: u8) {
        *self.state.lock() = state;
        self.changed.notify_one();
    }

    fn wait(&self) -> u8 {
        let mut state = self.state.lock();
        while *state == 0 {
            self.changed.wait(&mut state);
        }
        *state
    }
}

/// The log's length: the store's default `log_size`.
const BOUND_LOG: u64 = 1 << 20;

impl LogBound {
    fn create(dir: &Path) -> Res<Self> {
        let file = File::create(dir.join("bound.log")).map_err(|e| err("create", e))?;
        file.write_all_at(&vec![0u8; BOUND_LOG as usize], 0)
            .map_err(|e| err("pwrite", e))?;
        file.sync_all().map_err(|e| err("fsync", e))?;
        Ok(LogBound {
            file,
            queue: parking_lot::Mutex::new(BoundQueue::default()),
        })
    }

    /// Returns once `record` is on disk.
    fn append(&self, record: &[u8]) -> Res<()> {
        let slot = Arc::new(BoundSlot::default());
        let lead = {
            let mut q = self.queue.lock();
            q.buf.extend_from_slice(record);
            q.waiting.push(Arc::clone(&slot));
            !std::mem::replace(&mut q.leader, true)
        };
        if !lead && slot.wait() == 2 {
            return Ok(());
        }
        let (buf, batch, at) = {
            let mut q = self.queue.lock();
            let buf = std::mem::take(&mut q.buf);
            let at = if q.at + buf.len() as u64 > BOUND_LOG {
                0
            } else {
                q.at
            };
            q.at = at + buf.len() as u64;
            (buf, std::mem::take(&mut q.waiting), at)
        };
        let written = self
            .file
            .write_all_at(&buf, at)
            .and_then(|()| self.file.sync_data());
        {
            let mut q = self.queue.lock();
            match q.waiting.first() {
                Some(next) => next.set(1),
                None => q.leader = false,
            }
        }
        for other in batch.iter().filter(|s| !Arc::ptr_eq(s, &slot)) {
            other.set(2);
        }
        written.map_err(|e| err("log-bound write", e))
    }
}

struct LogBoundClient<'a> {
    log: &'a LogBound,
    fresh: Fresh,
    body: Vec<u8>,
}

impl System for LogBound {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        Ok(Box::new(LogBoundClient {
            log: self,
            fresh: fresh_for(thread, CELL.fetch_add(1, Ordering::Relaxed)),
            body: body(),
        }))
    }
}

impl Client for LogBoundClient<'_> {
    /// Two durable appends, the sizes of a claim's and a completion's log entries.
    fn pair(&mut self) -> Res<()> {
        let name = self.fresh.next();
        let fp = fingerprint_of(&name);
        let mut claim = name.into_bytes();
        claim.extend_from_slice(fp.digest());
        self.log.append(&claim)?;
        claim.extend_from_slice(&self.body);
        self.log.append(&claim)
    }

    fn replay(&mut self) -> Res<()> {
        Err("log-bound measures pairs only".into())
    }
}

// --- the client's outbox: a pair is `begin` of a fresh operation and `finish`

struct OutboxSys {
    outbox: Outbox,
    cell: u64,
    body: Vec<u8>,
}

struct OutboxClient<'a> {
    sys: &'a OutboxSys,
    fresh: Fresh,
}

impl System for OutboxSys {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        Ok(Box::new(OutboxClient {
            sys: self,
            fresh: fresh_for(thread, self.cell),
        }))
    }
}

impl Client for OutboxClient<'_> {
    /// Begins a fresh operation (its key durable before `begin` returns) and finishes it.
    fn pair(&mut self) -> Res<()> {
        let name = self.fresh.next();
        match self.sys.outbox.begin(&name, fingerprint_of(&name)) {
            Ok(Begun::Open(intent)) => self
                .sys
                .outbox
                .finish(&intent, Response::new(200, self.sys.body.clone()))
                .map_err(|e| err("finish", e)),
            Ok(other) => Err(format!("fresh operation {name} not open: {other:?}")),
            Err(e) => Err(err("begin", e)),
        }
    }

    fn replay(&mut self) -> Res<()> {
        Err("outbox measures pairs only".into())
    }
}

// ---------------------------------------------------------------------------------------------
// Running a cell

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Work {
    Pairs,
    Replay,
    Payments,
}

/// What one kind of worker did inside the window.
#[derive(Default)]
struct Tally {
    ops: u64,
    latencies_ns: Vec<u64>,
}

struct CellResult {
    pairs: Option<(f64, Option<Lat>)>,
    replay: Option<f64>,
}

/// Runs `plan` (work kind, thread count) against `sys`: a warm-up, then a window of `secs`.
/// Counts operations completing inside the window; records pair latencies.
fn run_cell(sys: &dyn System, plan: &[(Work, usize)], secs: f64) -> Res<CellResult> {
    let total: usize = plan.iter().map(|(_, n)| n).sum();
    let warmup = Duration::from_secs_f64((secs / 6.0).clamp(0.2, 1.0));
    let window = Duration::from_secs_f64(secs);
    let ready = Barrier::new(total + 1);
    let go = Barrier::new(total + 1);
    let bounds: Mutex<Option<(Instant, Instant)>> = Mutex::new(None);
    let abort = AtomicBool::new(false);
    let results = thread::scope(|s| {
        let mut handles = Vec::new();
        let mut thread_id = 0;
        for &(work, n) in plan {
            for _ in 0..n {
                let (ready, go, bounds, abort) = (&ready, &go, &bounds, &abort);
                let id = thread_id;
                thread_id += 1;
                let handle = thread::Builder::new()
                    .stack_size(512 << 10)
                    .spawn_scoped(s, move || -> Res<(Work, Tally)> {
                        let client = sys.client(id);
                        ready.wait();
                        go.wait();
                        let mut client = client?;
                        let (start, end) = bounds
                            .lock()
                            .map_err(|_| "poisoned".to_owned())?
                            .ok_or("no window")?;
                        let mut tally = Tally::default();
                        loop {
                            let t0 = Instant::now();
                            if t0 >= end || abort.load(Ordering::Relaxed) {
                                return Ok((work, tally));
                            }
                            let result = match work {
                                Work::Pairs => client.pair(),
                                Work::Replay => client.replay(),
                                Work::Payments => client.payment(),
                            };
                            if let Err(e) = result {
                                abort.store(true, Ordering::Relaxed);
                                return Err(e);
                            }
                            let t1 = Instant::now();
                            if t1 >= start && t1 <= end {
                                tally.ops += 1;
                                if work != Work::Replay {
                                    tally.latencies_ns.push((t1 - t0).as_nanos() as u64);
                                }
                            }
                        }
                    })
                    .map_err(|e| err("spawning a thread", e));
                handles.push(handle);
            }
        }
        ready.wait();
        let now = Instant::now();
        if let Ok(mut b) = bounds.lock() {
            *b = Some((now + warmup, now + warmup + window));
        }
        go.wait();
        handles
            .into_iter()
            .map(|h| match h?.join() {
                Ok(r) => r,
                Err(_) => Err("a worker panicked".to_owned()),
            })
            .collect::<Vec<Res<(Work, Tally)>>>()
    });
    let mut pairs: Option<Tally> = None;
    let mut replay: Option<Tally> = None;
    for r in results {
        let (work, tally) = r?;
        // A cell runs one kind of write, so payments take the pairs' slot.
        let slot = match work {
            Work::Pairs | Work::Payments => &mut pairs,
            Work::Replay => &mut replay,
        };
        let acc = slot.get_or_insert_with(Tally::default);
        acc.ops += tally.ops;
        acc.latencies_ns.extend(tally.latencies_ns);
    }
    Ok(CellResult {
        pairs: pairs.map(|t| (t.ops as f64 / secs, percentiles(t.latencies_ns))),
        replay: replay.map(|t| t.ops as f64 / secs),
    })
}

/// Pages of 4 KiB that a one-operation commit of this store writes (measured with strace: 9
/// pages plus a 320-byte header at offset 0).
const COMMIT_PAGES: u64 = 9;

/// `pwrite`s then `fdatasync`, in a loop, on a fresh 1 MiB file: with `pages == 0`, 100 bytes at
/// offset 0 (the disk's bound on commits); otherwise a 320-byte header at 0 plus `pages` pages
/// at scattered offsets, the shape of one small redb commit.
fn fdatasync_rate(dir: &Path, secs: f64, pages: u64) -> Res<(f64, Option<Lat>)> {
    const SPAN: u64 = 256;
    let path = dir.join(format!("fdatasync-{pages}.bin"));
    let file = File::create(&path).map_err(|e| err("create", e))?;
    file.write_all_at(&vec![0u8; (SPAN * 4096) as usize], 0)
        .map_err(|e| err("pwrite", e))?;
    file.sync_all().map_err(|e| err("fsync", e))?;
    let small = [7u8; 100];
    let header = [7u8; 320];
    let page = [9u8; 4096];
    let mut rng = Rng::new(pages);
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut lat = Vec::new();
    let start = Instant::now();
    while Instant::now() < end {
        let t0 = Instant::now();
        if pages == 0 {
            file.write_all_at(&small, 0).map_err(|e| err("pwrite", e))?;
        } else {
            for _ in 0..pages {
                let at = 1 + rng.below(SPAN as usize - 1) as u64;
                file.write_all_at(&page, at * 4096)
                    .map_err(|e| err("pwrite", e))?;
            }
            file.write_all_at(&header, 0)
                .map_err(|e| err("pwrite", e))?;
        }
        file.sync_data().map_err(|e| err("fdatasync", e))?;
        lat.push(t0.elapsed().as_nanos() as u64);
    }
    let rate = lat.len() as f64 / start.elapsed().as_secs_f64();
    Ok((rate, percentiles(lat)))
}

// ---------------------------------------------------------------------------------------------
// The main run

/// The systems every run measures, plus `postgres` when it can.
fn systems() -> Vec<&'static str> {
    let mut systems = vec!["store", "store-nogc", "sqlite-full", "log-bound", "outbox"];
    if pg_url().is_some() {
        systems.extend(["postgres", "postgres-tls", "pg-probe"]);
    }
    systems
}

/// The PostgreSQL URL, if this build has the backend and the environment names a server.
fn pg_url() -> Option<String> {
    if cfg!(feature = "postgres") {
        std::env::var("IDEMPOTENCY_PG_URL").ok()
    } else {
        None
    }
}

/// `IDEMPOTENCY_PG_URL` with `sslmode` set, in whichever of the two formats it is written.
fn pg_url_with(sslmode: &str) -> Res<String> {
    let url = pg_url().ok_or("IDEMPOTENCY_PG_URL is not set")?;
    Ok(if url.starts_with("postgres") {
        let sep = if url.contains('?') { '&' } else { '?' };
        format!("{url}{sep}sslmode={sslmode}")
    } else {
        format!("{url} sslmode={sslmode}")
    })
}

/// Connections per pool: more than the most threads of any cell.
const PG_POOL: u32 = 70;

#[cfg(feature = "postgres")]
fn open_pg(cell: u64, tls: bool) -> Res<Box<dyn IdempotencyStore>> {
    let url = pg_url_with(if tls { "require" } else { "disable" })?;
    let store = idempotency_store::pg::PgStore::builder()
        .pool_size(PG_POOL)
        .schema(format!("loadtest_{}_{cell}", std::process::id()))
        .connect(&url)
        .map_err(|e| err("connecting to PostgreSQL", e))?;
    Ok(Box::new(store))
}

#[cfg(not(feature = "postgres"))]
fn open_pg(_cell: u64, _tls: bool) -> Res<Box<dyn IdempotencyStore>> {
    Err("this build has no PostgreSQL backend: use --features postgres".into())
}

// --- the seed schema's statements on PostgreSQL (the probe of BENCHMARKS.md)

#[cfg(feature = "postgres")]
struct PgProbe {
    url: String,
    table: String,
    cell: u64,
    body: Vec<u8>,
}

#[cfg(feature = "postgres")]
impl PgProbe {
    fn create(cell: u64) -> Res<Self> {
        let url = pg_url_with("disable")?;
        let schema = format!("loadprobe_{}_{cell}", std::process::id());
        let table = format!("\"{schema}\".idempotency_keys");
        let mut client = postgres::Client::connect(&url, postgres::NoTls)
            .map_err(|e| err("connecting to PostgreSQL", e))?;
        client
            .batch_execute(&format!(
                "DROP SCHEMA IF EXISTS \"{schema}\" CASCADE; CREATE SCHEMA \"{schema}\"; \
                 CREATE TABLE {table} (key text PRIMARY KEY, status text NOT NULL, \
                     request_hash bytea NOT NULL, response_status integer, response_body bytea, \
                     created_at timestamptz NOT NULL DEFAULT now(), \
                     expires_at timestamptz NOT NULL); \
                 CREATE INDEX ON {table} (expires_at);"
            ))
            .map_err(|e| err("creating the probe's table", e))?;
        Ok(PgProbe {
            url,
            table,
            cell,
            body: body(),
        })
    }
}

#[cfg(feature = "postgres")]
impl Drop for PgProbe {
    fn drop(&mut self) {
        if let Ok(mut client) = postgres::Client::connect(&self.url, postgres::NoTls) {
            let schema = self.table.trim_end_matches(".idempotency_keys");
            let _ = client.batch_execute(&format!("DROP SCHEMA IF EXISTS {schema} CASCADE"));
        }
    }
}

#[cfg(feature = "postgres")]
struct PgProbeClient<'a> {
    probe: &'a PgProbe,
    client: postgres::Client,
    insert: postgres::Statement,
    update: postgres::Statement,
    fresh: Fresh,
}

#[cfg(feature = "postgres")]
impl System for PgProbe {
    fn client(&self, thread: usize) -> Res<Box<dyn Client + '_>> {
        let mut client = postgres::Client::connect(&self.url, postgres::NoTls)
            .map_err(|e| err("connecting to PostgreSQL", e))?;
        let insert = client
            .prepare(&format!(
                "INSERT INTO {} (key, status, request_hash, expires_at) \
                 VALUES ($1, 'in_progress', $2, now() + interval '1 day') \
                 ON CONFLICT (key) DO NOTHING RETURNING status",
                self.table
            ))
            .map_err(|e| err("prepare", e))?;
        let update = client
            .prepare(&format!(
                "UPDATE {} SET status = 'completed', response_status = $2, response_body = $3 \
                 WHERE key = $1 AND status = 'in_progress'",
                self.table
            ))
            .map_err(|e| err("prepare", e))?;
        Ok(Box::new(PgProbeClient {
            probe: self,
            client,
            insert,
            update,
            fresh: fresh_for(thread, self.cell),
        }))
    }
}

#[cfg(feature = "postgres")]
impl Client for PgProbeClient<'_> {
    fn pair(&mut self) -> Res<()> {
        let name = self.fresh.next();
        let hash = fingerprint_of(&name).digest().to_vec();
        let claimed = self
            .client
            .query_opt(&self.insert, &[&name, &hash])
            .map_err(|e| err("probe insert", e))?;
        if claimed.is_none() {
            return Err(format!("fresh key {name} not inserted"));
        }
        let updated = self
            .client
            .execute(&self.update, &[&name, &200i32, &self.probe.body])
            .map_err(|e| err("probe update", e))?;
        if updated != 1 {
            return Err(format!("fresh key {name} not updated"));
        }
        Ok(())
    }

    fn replay(&mut self) -> Res<()> {
        Err("pg-probe measures pairs only".into())
    }
}

struct Runner<'a> {
    args: &'a Args,
    out: &'a Out,
    base: PathBuf,
    set: Arc<ReplaySet>,
    /// (workload, system, threads) → figure
    pairs: Vec<(String, usize, f64, Option<Lat>)>,
    replay: Vec<(String, usize, f64)>,
    mixed: Vec<(String, f64, f64, Option<Lat>)>,
    payments: Vec<(String, usize, f64, Option<Lat>)>,
}

/// The systems that run the payments workload.
const PAYMENT_SYSTEMS: [&str; 3] = ["store", "store-txn", "sqlite-full"];

impl Runner<'_> {
    /// Whether `--only` keeps the cell: names of systems and of workloads are filters of their
    /// own kind, and a cell must pass both (`--only store,pairs` = the store's pair cells).
    fn wants(&self, system: &str, workload: &str) -> bool {
        wanted(&self.args.only, system, workload)
    }

    /// A fresh system in a fresh directory, its replay set completed beforehand if asked.
    fn with_system<T>(
        &self,
        system: &str,
        prefill: bool,
        f: impl FnOnce(&dyn System) -> Res<T>,
    ) -> Res<T> {
        let dir = fresh_dir(&self.base, system)?;
        let cell = CELL.fetch_add(1, Ordering::Relaxed);
        match system {
            #[cfg(feature = "postgres")]
            "pg-probe" => f(&PgProbe::create(cell)?),
            "postgres" | "postgres-tls" => {
                let sys = StoreSys {
                    store: Arc::from(open_pg(cell, system == "postgres-tls")?),
                    redb: None,
                    slow_effects: false,
                    set: Arc::clone(&self.set),
                    cell,
                    body: body(),
                };
                if prefill {
                    let set = Arc::clone(&self.set);
                    prefill_store(
                        sys.store.as_ref(),
                        set.names.len() as u64,
                        32,
                        &|i| set.names[i as usize].clone(),
                        &Out { quiet: true },
                    )?;
                }
                f(&sys)
            }
            "log-bound" => f(&LogBound::create(dir.path())?),
            "outbox" => {
                let store = Arc::new(open_store(dir.path(), false, Durability::Immediate)?);
                f(&OutboxSys {
                    outbox: Outbox::new(store),
                    cell,
                    body: body(),
                })
            }
            "sqlite-full" => {
                let sys = SqliteSys::create(dir.path(), Arc::clone(&self.set), cell)?;
                if prefill {
                    sys.prefill()?;
                }
                f(&sys)
            }
            _ => {
                let durability = if system == "store-quickrepair" {
                    Durability::QuickRepair
                } else {
                    Durability::Immediate
                };
                let nogc = system == "store-nogc";
                if prefill {
                    // Complete the replay set with group commit, then reopen with the system's
                    // own settings (replays never reach the committer anyway).
                    let store = open_store(dir.path(), false, durability)?;
                    let set = Arc::clone(&self.set);
                    prefill_store(
                        &store,
                        set.names.len() as u64,
                        32,
                        &|i| set.names[i as usize].clone(),
                        &Out { quiet: true },
                    )?;
                    drop(store);
                }
                let store = Arc::new(open_store(dir.path(), nogc, durability)?);
                let sys = StoreSys {
                    store: Arc::clone(&store) as Arc<dyn IdempotencyStore>,
                    redb: Some(store),
                    slow_effects: system == "store-txn",
                    set: Arc::clone(&self.set),
                    cell,
                    body: body(),
                };
                f(&sys)
            }
        }
    }

    fn run(&mut self) -> Res<()> {
        let secs = self.args.seconds;
        let threads = self.args.threads.clone();
        for &t in &threads {
            for system in systems() {
                if !self.wants(system, "pairs") {
                    continue;
                }
                self.out.note(format!("pairs  {system:<12} {t:>3} threads"));
                let r = self.with_system(system, false, |sys| {
                    run_cell(sys, &[(Work::Pairs, t)], secs)
                })?;
                if let Some((rate, lat)) = r.pairs {
                    self.pairs.push((system.to_owned(), t, rate, lat));
                }
            }
            for system in PAYMENT_SYSTEMS {
                if !self.wants(system, "payments") {
                    continue;
                }
                self.out
                    .note(format!("payments {system:<10} {t:>3} threads"));
                let r = self.with_system(system, false, |sys| {
                    run_cell(sys, &[(Work::Payments, t)], secs)
                })?;
                if let Some((rate, lat)) = r.pairs {
                    self.payments.push((system.to_owned(), t, rate, lat));
                }
            }
            if t == 1 && self.wants("store-quickrepair", "pairs") {
                self.out.note("pairs  store-quickrepair   1 thread");
                let r = self.with_system("store-quickrepair", false, |sys| {
                    run_cell(sys, &[(Work::Pairs, 1)], secs)
                })?;
                if let Some((rate, lat)) = r.pairs {
                    self.pairs.push(("store-quickrepair".into(), 1, rate, lat));
                }
            }
        }
        for system in systems() {
            let want_replay = self.wants(system, "replay");
            let want_mixed = self.wants(system, "mixed");
            if !want_replay && !want_mixed {
                continue;
            }
            // One prefilled database per system serves its replay and mixed cells.
            self.out.note(format!(
                "replay {system:<12} prefilling {}",
                self.set.names.len()
            ));
            let (replay, mixed) = self.with_system(system, true, |sys| {
                let mut replay = Vec::new();
                if want_replay {
                    for &t in &threads {
                        self.out.note(format!("replay {system:<12} {t:>3} threads"));
                        let r = run_cell(sys, &[(Work::Replay, t)], secs)?;
                        replay.push((t, r.replay.unwrap_or(0.0)));
                    }
                }
                let mut mixed = None;
                if want_mixed {
                    self.out.note(format!(
                        "mixed  {system:<12} {MIXED_HALF} replay + {MIXED_HALF} pair threads"
                    ));
                    let r = run_cell(
                        sys,
                        &[(Work::Replay, MIXED_HALF), (Work::Pairs, MIXED_HALF)],
                        secs,
                    )?;
                    let (p, lat) = r.pairs.unwrap_or((0.0, None));
                    mixed = Some((r.replay.unwrap_or(0.0), p, lat));
                }
                Ok((replay, mixed))
            })?;
            for (t, rate) in replay {
                self.replay.push((system.to_owned(), t, rate));
            }
            if let Some((r, p, lat)) = mixed {
                self.mixed.push((system.to_owned(), r, p, lat));
            }
        }
        Ok(())
    }

    fn pairs_at(&self, system: &str, t: usize) -> Option<f64> {
        self.pairs
            .iter()
            .find(|(s, n, _, _)| s == system && *n == t)
            .map(|p| p.2)
    }

    fn payments_at(&self, system: &str, t: usize) -> Option<f64> {
        self.payments
            .iter()
            .find(|(s, n, _, _)| s == system && *n == t)
            .map(|p| p.2)
    }

    fn replay_at(&self, system: &str, t: usize) -> Option<f64> {
        self.replay
            .iter()
            .find(|(s, n, _)| s == system && *n == t)
            .map(|p| p.2)
    }
}

const WORKLOADS: [&str; 4] = ["pairs", "replay", "mixed", "payments"];

fn wanted(only: &[String], system: &str, workload: &str) -> bool {
    if matches!(system, "log-bound" | "pg-probe" | "outbox") && workload != "pairs" {
        return false;
    }
    // store-txn runs payments only, and payments run on PAYMENT_SYSTEMS only.
    let payments = workload == "payments";
    if (system == "store-txn" && !payments) || (payments && !PAYMENT_SYSTEMS.contains(&system)) {
        return false;
    }
    let (workloads, systems): (Vec<&String>, Vec<&String>) =
        only.iter().partition(|o| WORKLOADS.contains(&o.as_str()));
    (systems.is_empty() || systems.iter().any(|s| *s == system))
        && (workloads.is_empty() || workloads.iter().any(|w| *w == workload))
}

struct Target {
    name: &'static str,
    value: Option<f64>,
    min: f64,
}

fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

fn fmt_rate(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

fn verdict(value: Option<f64>, pass: bool) -> &'static str {
    match (value, pass) {
        (None, _) => "n/a",
        (Some(_), true) => "PASS",
        (Some(_), false) => "FAIL",
    }
}

fn machine_json() -> Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default();
    let load = std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default();
    let cpus = thread::available_parallelism().map_or(0, |n| n.get() as u64);
    let mut j = obj();
    j.set("cpus", Value::from(cpus))
        .set("cpu", Value::String(cpu))
        .set("kernel", Value::String(kernel))
        .set("loadavg", Value::String(load));
    j
}

fn main_run(args: &Args, out: &Out, base: PathBuf) -> Res<Value> {
    let fs = filesystem_of(&base);
    out.line(format!(
        "loadtest: {} s per cell, threads {:?}, bench dir {} on {fs}",
        args.seconds,
        args.threads,
        base.display()
    ));
    let wants_fsync = args.only.is_empty() || args.only.iter().any(|o| o == "fdatasync");
    if let Some(bad) = args.only.iter().find(|o| {
        !(WORKLOADS.contains(&o.as_str())
            || systems().contains(&o.as_str())
            || *o == "postgres"
            || *o == "store-quickrepair"
            || *o == "store-txn"
            || *o == "fdatasync")
    }) {
        return Err(format!("--only {bad:?}: not a system or workload name"));
    }
    let fsync_dir = fresh_dir(&base, "fdatasync")?;
    let fsync_before = if wants_fsync {
        out.note("fdatasync loop");
        Some(fdatasync_rate(fsync_dir.path(), args.seconds, 0)?)
    } else {
        None
    };
    let fsync_pages = if wants_fsync {
        out.note(format!(
            "fdatasync loop, {COMMIT_PAGES} scattered pages per sync"
        ));
        Some(fdatasync_rate(
            fsync_dir.path(),
            args.seconds,
            COMMIT_PAGES,
        )?)
    } else {
        None
    };

    let mut runner = Runner {
        args,
        out,
        base: base.clone(),
        set: Arc::new(ReplaySet::new(args.replay_keys)?),
        pairs: Vec::new(),
        replay: Vec::new(),
        mixed: Vec::new(),
        payments: Vec::new(),
    };
    let started = Instant::now();
    runner.run()?;

    let fsync_after = if wants_fsync {
        out.note("fdatasync loop (again)");
        Some(fdatasync_rate(fsync_dir.path(), args.seconds, 0)?)
    } else {
        None
    };
    // The mean of the loop before and after the cells, to even out drifting load.
    let fsync = match (fsync_before, fsync_after) {
        (Some((a, _)), Some((b, _))) => Some((a + b) / 2.0),
        _ => None,
    };

    // ---- tables
    let threads = &args.threads;
    let header = |title: &str, width: usize| {
        let mut h = format!("{title:<20}");
        for t in threads {
            let _ = write!(h, "{:>width$}", format!("{t} thr"));
        }
        h
    };
    out.line("");
    out.line("pairs/s (fresh key: claim + complete, 200 B body, each durable)");
    out.line(header("system", 11));
    for system in systems().iter().chain(&["store-quickrepair"]) {
        if !runner.pairs.iter().any(|p| p.0 == *system) {
            continue;
        }
        let mut row = format!("{system:<20}");
        for &t in threads {
            let _ = write!(row, "{:>11}", fmt_rate(runner.pairs_at(system, t)));
        }
        out.line(row);
    }
    if let Some(rate) = fsync {
        out.line(format!(
            "{:<20}{:>11}   (raw pwrite+fdatasync/s, 1 thread; pair bound = {:.0}/s)",
            "fdatasync",
            format!("{rate:.0}"),
            rate / 2.0
        ));
    }
    if let Some((rate, _)) = fsync_pages {
        out.line(format!(
            "{:<20}{:>11}   (info: {COMMIT_PAGES} x 4 KiB scattered + header, then fdatasync; \
             the shape of a one-op commit; pair bound = {:.0}/s)",
            "fdatasync-commit",
            format!("{rate:.0}"),
            rate / 2.0
        ));
    }
    out.line("");
    out.line("pair latency p50 / p99 (µs)");
    out.line(header("system", 16));
    for system in systems().iter().chain(&["store-quickrepair"]) {
        if !runner.pairs.iter().any(|p| p.0 == *system) {
            continue;
        }
        let mut row = format!("{system:<20}");
        for &t in threads {
            let cell = runner
                .pairs
                .iter()
                .find(|p| p.0 == *system && p.1 == t)
                .and_then(|p| p.3)
                .map_or_else(
                    || "-".to_owned(),
                    |l| format!("{:.0}/{:.0}", l.p50_us, l.p99_us),
                );
            let _ = write!(row, "{cell:>16}");
        }
        out.line(row);
    }
    if !runner.replay.is_empty() {
        out.line("");
        out.line(format!(
            "replays/s (claim of a completed key, matching fingerprint; {} keys)",
            args.replay_keys
        ));
        out.line(header("system", 11));
        for system in systems() {
            if !runner.replay.iter().any(|p| p.0 == system) {
                continue;
            }
            let mut row = format!("{system:<20}");
            for &t in threads {
                let _ = write!(row, "{:>11}", fmt_rate(runner.replay_at(system, t)));
            }
            out.line(row);
        }
    }
    if !runner.mixed.is_empty() {
        out.line("");
        out.line(format!(
            "mixed: {MIXED_HALF} replay threads + {MIXED_HALF} fresh-pair threads"
        ));
        out.line(format!(
            "{:<20}{:>12}{:>12}{:>16}{:>14}",
            "system", "replays/s", "pairs/s", "replay-only@16", "mixed/only"
        ));
        for (system, r, p, _) in &runner.mixed {
            let only = runner.replay_at(system, MIXED_HALF);
            out.line(format!(
                "{system:<20}{r:>12.0}{p:>12.0}{:>16}{:>14}",
                fmt_rate(only),
                ratio(Some(*r), only).map_or_else(|| "-".into(), |x| format!("{x:.2}"))
            ));
        }
    }

    if !runner.payments.is_empty() {
        out.line("");
        out.line(
            "payments/s (fresh key: claim, then one ledger row + the response, atomically; each durable)",
        );
        out.line(header("system", 11));
        for system in PAYMENT_SYSTEMS {
            if !runner.payments.iter().any(|p| p.0 == system) {
                continue;
            }
            let mut row = format!("{system:<20}");
            for &t in threads {
                let _ = write!(row, "{:>11}", fmt_rate(runner.payments_at(system, t)));
            }
            out.line(row);
        }
    }

    // ---- targets
    let max_t = threads.iter().copied().max().unwrap_or(1);
    let store_mixed = runner.mixed.iter().find(|m| m.0 == "store").map(|m| m.1);
    let targets = [
        Target {
            name: "pairs_1t_store_over_sqlite",
            value: ratio(
                runner.pairs_at("store", 1),
                runner.pairs_at("sqlite-full", 1),
            ),
            min: 1.0,
        },
        Target {
            name: "pairs_1t_store_over_fdatasync_half",
            value: ratio(runner.pairs_at("store", 1), fsync.map(|f| f / 2.0)),
            min: 0.5,
        },
        Target {
            name: "pairs_64t_store_over_sqlite",
            value: ratio(
                runner.pairs_at("store", 64),
                runner.pairs_at("sqlite-full", 64),
            ),
            min: 10.0,
        },
        Target {
            name: "pairs_store_64t_over_1t",
            value: ratio(runner.pairs_at("store", 64), runner.pairs_at("store", 1)),
            min: 8.0,
        },
        Target {
            name: "replay_1t_store_over_sqlite",
            value: ratio(
                runner.replay_at("store", 1),
                runner.replay_at("sqlite-full", 1),
            ),
            min: 1.5,
        },
        Target {
            name: "mixed_replay_over_replay_only_16t",
            value: ratio(store_mixed, runner.replay_at("store", MIXED_HALF)),
            min: 0.8,
        },
        Target {
            name: "outbox_1t_begin_finish_over_store_pairs",
            value: ratio(runner.pairs_at("outbox", 1), runner.pairs_at("store", 1)),
            min: 0.8,
        },
        Target {
            name: "outbox_64t_begin_finish_over_store_pairs",
            value: ratio(runner.pairs_at("outbox", 64), runner.pairs_at("store", 64)),
            min: 0.8,
        },
        Target {
            name: "payments_64t_store_over_store_pairs",
            value: ratio(
                runner.payments_at("store", 64),
                runner.pairs_at("store", 64),
            ),
            min: 0.7,
        },
        Target {
            name: "payments_64t_store_over_sqlite",
            value: ratio(
                runner.payments_at("store", 64),
                runner.payments_at("sqlite-full", 64),
            ),
            min: 4.0,
        },
        Target {
            name: "payments_1t_store_over_sqlite",
            value: ratio(
                runner.payments_at("store", 1),
                runner.payments_at("sqlite-full", 1),
            ),
            min: 1.0,
        },
    ];
    out.line("");
    out.line("targets");
    for t in &targets {
        let pass = t.value.is_some_and(|v| v >= t.min);
        out.line(format!(
            "  {:<50} {:>8}  (>= {:<4})  {}",
            t.name,
            t.value.map_or_else(|| "-".into(), |v| format!("{v:.2}")),
            t.min,
            verdict(t.value, pass)
        ));
    }
    // Informative ratios (no target).
    let extra = [
        (
            "pairs_store_over_nogc_max_threads",
            ratio(
                runner.pairs_at("store", max_t),
                runner.pairs_at("store-nogc", max_t),
            ),
        ),
        (
            "pairs_1t_quickrepair_over_store",
            ratio(
                runner.pairs_at("store-quickrepair", 1),
                runner.pairs_at("store", 1),
            ),
        ),
        (
            "pairs_1t_store_over_commit_shaped_fdatasync_half",
            ratio(runner.pairs_at("store", 1), fsync_pages.map(|f| f.0 / 2.0)),
        ),
        // The floor's own ratios: what the 64-thread targets would read if the store cost
        // nothing beyond queueing, one log append and a shared sync per batch.
        (
            "pairs_64t_log_bound_over_sqlite",
            ratio(
                runner.pairs_at("log-bound", 64),
                runner.pairs_at("sqlite-full", 64),
            ),
        ),
        (
            "pairs_log_bound_64t_over_store_1t",
            ratio(
                runner.pairs_at("log-bound", 64),
                runner.pairs_at("store", 1),
            ),
        ),
        (
            "pairs_64t_store_over_log_bound",
            ratio(
                runner.pairs_at("store", 64),
                runner.pairs_at("log-bound", 64),
            ),
        ),
        (
            "pairs_1t_sqlite_over_fdatasync_half",
            ratio(runner.pairs_at("sqlite-full", 1), fsync.map(|f| f / 2.0)),
        ),
        // What sharing the batch buys over a commit of its own per payment.
        (
            "payments_64t_store_over_store_txn",
            ratio(
                runner.payments_at("store", 64),
                runner.payments_at("store-txn", 64),
            ),
        ),
    ];
    for (name, v) in &extra {
        out.line(format!(
            "  {:<50} {:>8}  (info)",
            name,
            v.map_or_else(|| "-".into(), |v| format!("{v:.2}"))
        ));
    }
    out.line(format!(
        "cells took {:.0} s",
        started.elapsed().as_secs_f64()
    ));

    // ---- JSON
    let mut j = obj();
    j.set("mode", Value::String("loadtest".into()))
        .set("seconds_per_cell", num(args.seconds))
        .set(
            "threads",
            Value::Array(threads.iter().map(|&t| Value::from(t as u64)).collect()),
        )
        .set("replay_keys", Value::from(args.replay_keys as u64))
        .set("body_bytes", Value::from(BODY_LEN as u64))
        .set("dir", Value::String(base.display().to_string()))
        .set("filesystem", Value::String(fs))
        .set("machine", machine_json());
    let mut fj = obj();
    fj.set("per_s", opt(fsync))
        .set("before_per_s", opt(fsync_before.map(|f| f.0)))
        .set("after_per_s", opt(fsync_after.map(|f| f.0)))
        .set("latency", lat_json(fsync_before.and_then(|f| f.1)))
        .set("pair_bound_per_s", opt(fsync.map(|f| f / 2.0)));
    j.set("fdatasync", fj);
    let mut cj = obj();
    cj.set("pages", Value::from(COMMIT_PAGES))
        .set("per_s", opt(fsync_pages.map(|f| f.0)))
        .set("latency", lat_json(fsync_pages.and_then(|f| f.1)))
        .set("pair_bound_per_s", opt(fsync_pages.map(|f| f.0 / 2.0)));
    j.set("fdatasync_commit_shaped", cj);
    for (system, t, rate, lat) in &runner.pairs {
        let mut cell = obj();
        cell.set("per_s", num(*rate)).set("latency", lat_json(*lat));
        j.child("pairs").child(system).set(t.to_string(), cell);
    }
    for (system, t, rate, lat) in &runner.payments {
        let mut cell = obj();
        cell.set("per_s", num(*rate)).set("latency", lat_json(*lat));
        j.child("payments").child(system).set(t.to_string(), cell);
    }
    for (system, t, rate) in &runner.replay {
        j.child("replay")
            .child(system)
            .set(t.to_string(), num(*rate));
    }
    for (system, r, p, lat) in &runner.mixed {
        let mut cell = obj();
        cell.set("replay_per_s", num(*r))
            .set("pairs_per_s", num(*p))
            .set("pair_latency", lat_json(*lat))
            .set(
                "replay_over_replay_only_16",
                opt(ratio(Some(*r), runner.replay_at(system, MIXED_HALF))),
            );
        j.child("mixed").set(system.clone(), cell);
    }
    let mut tj = obj();
    for t in &targets {
        let mut cell = obj();
        cell.set("value", opt(t.value)).set("min", num(t.min)).set(
            "pass",
            t.value.map_or(Value::Null, |v| Value::Bool(v >= t.min)),
        );
        tj.set(t.name, cell);
    }
    j.set("targets", tj);
    let mut ej = obj();
    for (name, v) in extra {
        ej.set(name, opt(v));
    }
    j.set("ratios", ej);
    Ok(j)
}

// ---------------------------------------------------------------------------------------------
// --sweep: claim latency while sweep_all deletes a million expired records

/// Fresh-key claims from this thread until `stop` says so (or `max` passes); latencies in ns.
fn claim_loop(
    store: &Store,
    stream: u64,
    stop: &dyn Fn(Instant) -> bool,
) -> Res<(Vec<u64>, Duration)> {
    let mut lat = Vec::new();
    let mut i = 0;
    let started = Instant::now();
    loop {
        let t0 = Instant::now();
        if stop(t0) {
            return Ok((lat, started.elapsed()));
        }
        i += 1;
        let name = key_name(stream, i);
        let key = Key::new(&name).map_err(|e| err("key", e))?;
        match store.claim(&key, fingerprint_of(&name)) {
            Ok(Claim::Acquired(_lease)) => {}
            Ok(other) => return Err(format!("fresh key not acquired: {other:?}")),
            Err(e) => return Err(err("claim", e)),
        }
        lat.push(t0.elapsed().as_nanos() as u64);
    }
}

/// `sweep_all` with another batch size: `sweep(batch)` until a batch comes back short.
fn sweep_in(store: &Store, batch: usize) -> idempotency_store::Result<u64> {
    let mut total = 0;
    loop {
        let n = store.sweep(batch)?;
        total += n as u64;
        if n < batch {
            return Ok(total);
        }
    }
}

fn sweep_run(args: &Args, out: &Out, base: PathBuf) -> Res<Value> {
    let fs = filesystem_of(&base);
    let n = args.records;
    out.line(format!(
        "sweep: {n} expired records, claim p99 without and during sweep_all; dir {} on {fs}",
        base.display()
    ));
    let dir = fresh_dir(&base, "sweep")?;
    let retention = Duration::from_secs(3600);
    let clock = ManualClock::new(Timestamp::from_millis(1_800_000_000_000));
    let store = Store::builder()
        .clock(clock.clone())
        .retention(retention)
        .open(dir.path().join("store.redb"))
        .map_err(|e| err("open", e))?;
    let prefill = prefill_store(&store, n, args.prefill_threads, &|i| key_name(1, i), out)?;
    out.line(format!(
        "prefilled {n} completed records in {:.1} s ({:.0} pairs/s, {} threads)",
        prefill.as_secs_f64(),
        n as f64 / prefill.as_secs_f64(),
        args.prefill_threads
    ));
    // Everything so far is now past its retention.
    clock.advance(retention + Duration::from_secs(1));
    let file_before = std::fs::metadata(dir.path().join("store.redb")).map_or(0, |m| m.len());

    let window = Duration::from_secs_f64(args.seconds);
    // Warm-up, then the baseline.
    let warm_end = Instant::now() + Duration::from_millis(300);
    claim_loop(&store, 2, &|t| t >= warm_end)?;
    let base_end = Instant::now() + window;
    let (base_lat, _) = claim_loop(&store, 3, &|t| t >= base_end)?;
    let base_n = base_lat.len();
    let baseline = percentiles(base_lat);

    let done = AtomicBool::new(false);
    let (sweep_result, during) = thread::scope(|s| {
        let sweeper = s.spawn(|| {
            let t0 = Instant::now();
            let r = match args.sweep_batch {
                None => store.sweep_all(),
                Some(batch) => sweep_in(&store, batch),
            };
            done.store(true, Ordering::SeqCst);
            (r, t0.elapsed())
        });
        // Measure while the sweep runs (at most 3 windows, so a stuck sweep cannot hang us).
        let cap = Instant::now() + window * 3;
        let during = claim_loop(&store, 4, &|t| done.load(Ordering::SeqCst) || t >= cap);
        let sweep = sweeper.join().map_err(|_| "sweeper panicked".to_owned());
        (sweep, during)
    });
    let (sweep_result, sweep_time) = sweep_result?;
    let swept = sweep_result.map_err(|e| err("sweep_all", e))?;
    let (during_lat, during_time) = during?;
    let during_n = during_lat.len();
    let during = percentiles(during_lat);
    let p99_ratio = match (baseline, during) {
        (Some(a), Some(b)) if a.p99_us > 0.0 => Some(b.p99_us / a.p99_us),
        _ => None,
    };
    let pass = p99_ratio.is_some_and(|r| r <= 3.0);
    let show = |l: Option<Lat>| {
        l.map_or_else(
            || "-".into(),
            |l| {
                format!(
                    "p50 {:.0} µs, p99 {:.0} µs, max {:.0} µs ({} claims)",
                    l.p50_us, l.p99_us, l.max_us, l.n
                )
            },
        )
    };
    out.line(format!(
        "claims without sweep:  {} ({:.0}/s)",
        show(baseline),
        base_n as f64 / window.as_secs_f64()
    ));
    out.line(format!(
        "claims during sweep:   {} ({:.0}/s over {:.2} s)",
        show(during),
        during_n as f64 / during_time.as_secs_f64().max(1e-9),
        during_time.as_secs_f64()
    ));
    out.line(format!(
        "{} deleted {swept} in {:.2} s ({:.0}/s)",
        args.sweep_batch
            .map_or_else(|| "sweep_all".to_owned(), |b| format!("sweep({b}) loop")),
        sweep_time.as_secs_f64(),
        swept as f64 / sweep_time.as_secs_f64().max(1e-9)
    ));
    out.line(format!(
        "target: p99 during sweep / p99 without <= 3.0: {} {}",
        p99_ratio.map_or_else(|| "-".into(), |r| format!("{r:.2}")),
        verdict(p99_ratio, pass)
    ));
    let mut j = obj();
    j.set("mode", Value::String("sweep".into()))
        .set("records", Value::from(n))
        .set("dir", Value::String(base.display().to_string()))
        .set("filesystem", Value::String(fs))
        .set("machine", machine_json())
        .set("prefill_s", num(prefill.as_secs_f64()))
        .set("prefill_threads", Value::from(args.prefill_threads as u64))
        .set("file_bytes", Value::from(file_before))
        .set("claim_without_sweep", lat_json(baseline))
        .set("claim_during_sweep", lat_json(during))
        .set("during_window_s", num(during_time.as_secs_f64()))
        .set("swept", Value::from(swept))
        .set("sweep_s", num(sweep_time.as_secs_f64()))
        .set(
            "sweep_batch",
            args.sweep_batch
                .map_or(Value::String("sweep_all".into()), |b| Value::from(b as u64)),
        )
        .set("p99_ratio", opt(p99_ratio))
        .set("p99_ratio_max", num(3.0))
        .set("pass", p99_ratio.map_or(Value::Null, |_| Value::Bool(pass)));
    Ok(j)
}

// ---------------------------------------------------------------------------------------------
// --space: a million completed records: peak RSS and file size

fn space_run(args: &Args, out: &Out, base: PathBuf) -> Res<Value> {
    let fs = filesystem_of(&base);
    let n = args.records;
    out.line(format!(
        "space: {n} completed records with {BODY_LEN} B bodies; dir {} on {fs}",
        base.display()
    ));
    let dir = fresh_dir(&base, "space")?;
    let path = dir.path().join("store.redb");
    let store = Store::open(&path).map_err(|e| err("open", e))?;
    let took = prefill_store(&store, n, args.prefill_threads, &|i| key_name(1, i), out)?;
    let rss_open = peak_rss_kib();
    // Where the resident memory is right after the inserts (the peak is VmHWM).
    let mut now_rss = obj();
    for field in ["VmRSS", "RssAnon", "RssFile", "VmStk"] {
        now_rss.set(
            field,
            opt(proc_status_kib(field).map(|k| k as f64 / 1024.0)),
        );
    }
    let (file_open, alloc_open) = file_bytes(&path);
    let stats = store.stats().map_err(|e| err("stats", e))?;
    drop(store);
    let (file_closed, alloc_closed) = file_bytes(&path);
    let rss = peak_rss_kib();
    // key (36 B) + fingerprint digest (32 B) + body + headers (none) per record.
    let raw = n * (36 + 32 + BODY_LEN as u64);
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let rss_mib = rss.map(|k| k as f64 / 1024.0);
    let ratio = file_open.max(file_closed) as f64 / raw as f64;
    let rss_pass = rss_mib.is_some_and(|r| r <= 64.0);
    let file_pass = ratio <= 2.0;
    out.line(format!(
        "inserted in {:.1} s ({:.0} pairs/s, {} threads); stats: {} completed",
        took.as_secs_f64(),
        n as f64 / took.as_secs_f64(),
        args.prefill_threads,
        stats.completed
    ));
    out.line(format!(
        "peak RSS (VmHWM): {} MiB  target <= 64 MiB: {}",
        rss_mib.map_or_else(|| "-".into(), |r| format!("{r:.1}")),
        verdict(rss_mib, rss_pass)
    ));
    out.line(format!(
        "file: {:.1} MiB open, {:.1} MiB after close; raw {:.1} MiB; ratio {ratio:.2} \
         (the larger)  target <= 2.0: {}",
        mib(file_open),
        mib(file_closed),
        mib(raw),
        verdict(Some(ratio), file_pass)
    ));
    out.line(format!(
        "allocated on disk (st_blocks, the file is sparse): {:.1} MiB open, {:.1} MiB after \
         close; allocated/raw {:.2}",
        mib(alloc_open),
        mib(alloc_closed),
        alloc_open.max(alloc_closed) as f64 / raw as f64
    ));
    let mut j = obj();
    j.set("mode", Value::String("space".into()))
        .set("records", Value::from(n))
        .set("dir", Value::String(base.display().to_string()))
        .set("filesystem", Value::String(fs))
        .set("machine", machine_json())
        .set("insert_s", num(took.as_secs_f64()))
        .set("threads", Value::from(args.prefill_threads as u64))
        .set("completed", Value::from(stats.completed))
        .set("peak_rss_mib", opt(rss_mib))
        .set(
            "peak_rss_mib_while_open",
            opt(rss_open.map(|k| k as f64 / 1024.0)),
        )
        .set("file_bytes_open", Value::from(file_open))
        .set("file_bytes_closed", Value::from(file_closed))
        .set("allocated_bytes_open", Value::from(alloc_open))
        .set("allocated_bytes_closed", Value::from(alloc_closed))
        .set("closed_file_over_raw", num(file_closed as f64 / raw as f64))
        .set("mib_after_insert", now_rss)
        .set("raw_bytes", Value::from(raw))
        .set("file_over_raw", num(ratio))
        .set(
            "rss_pass",
            rss_mib.map_or(Value::Null, |_| Value::Bool(rss_pass)),
        )
        .set("file_pass", Value::Bool(file_pass));
    Ok(j)
}

// ---------------------------------------------------------------------------------------------
// --recovery: the first open after a crash, per durability setting

/// Fills a store with `--records` completed records, then aborts: no clean close, so the next
/// open finds the file as a crash leaves it.
fn recovery_child(args: &Args, out: &Out) -> Res<Value> {
    let (path, durability) = args.child.clone().ok_or("--recovery-child needs a path")?;
    let store = Store::builder()
        .durability(durability)
        .open(&path)
        .map_err(|e| err("open", e))?;
    prefill_store(
        &store,
        args.records,
        args.prefill_threads,
        &|i| key_name(1, i),
        out,
    )?;
    std::process::abort();
}

fn recovery_run(args: &Args, out: &Out, base: PathBuf) -> Res<Value> {
    let n = args.records;
    out.line(format!(
        "recovery: first open after a crash (child aborted after {n} completed records), per durability"
    ));
    let exe = std::env::current_exe().map_err(|e| err("current exe", e))?;
    let mut j = obj();
    j.set("mode", Value::String("recovery".into()))
        .set("records", Value::from(n))
        .set("machine", machine_json());
    for (name, durability) in [
        ("immediate", Durability::Immediate),
        ("quick-repair", Durability::QuickRepair),
    ] {
        let dir = fresh_dir(&base, name)?;
        let path = dir.path().join("store.redb");
        let status = std::process::Command::new(&exe)
            .arg("--recovery-child")
            .arg(&path)
            .arg(name)
            .args(["--records", &n.to_string(), "--json-only"])
            .status()
            .map_err(|e| err("spawn", e))?;
        if status.success() {
            return Err("the recovery child did not crash".into());
        }
        let open = || {
            let started = Instant::now();
            let store = Store::builder()
                .durability(durability)
                .open(&path)
                .map_err(|e| err("reopen", e))?;
            let took = started.elapsed();
            let completed = store.stats().map_err(|e| err("stats", e))?.completed;
            Ok::<_, String>((took, completed))
        };
        let (after_crash, completed) = open()?;
        let (clean, _) = open()?;
        let mib = file_bytes(&path).1 as f64 / (1 << 20) as f64;
        out.line(format!(
            "{name:<13} first open after crash {:>9.1} ms, after a clean close {:>7.1} ms; \
             {completed} records survived; {mib:.0} MiB allocated",
            after_crash.as_secs_f64() * 1e3,
            clean.as_secs_f64() * 1e3,
        ));
        let mut r = obj();
        r.set("open_after_crash_ms", num(after_crash.as_secs_f64() * 1e3))
            .set("open_after_clean_close_ms", num(clean.as_secs_f64() * 1e3))
            .set("records_survived", Value::from(completed))
            .set("allocated_mib", num(mib));
        j.set(name, r);
    }
    Ok(j)
}

fn main() -> ExitCode {
    // A usage error exits 2 with clap's message; --help prints to stdout and exits 0.
    let args = parse_args();
    let out = Out {
        quiet: args.json_only,
    };
    let recorder = if args.recorder {
        // Configured as the example servers' `install_prometheus` does: histograms with the
        // store's bucket bounds.
        let seconds: Vec<f64> = idempotency_store::metrics::LATENCY_BUCKETS_US
            .iter()
            .map(|&us| Duration::from_micros(us).as_secs_f64())
            .collect();
        let installed = metrics_exporter_prometheus::PrometheusBuilder::new()
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
                &seconds,
            )
            .and_then(|builder| builder.install_recorder());
        match installed {
            Ok(handle) => {
                // As a deployment would (the exporter's own listener does this every 5 s):
                // without upkeep, histogram samples pile up for the whole run.
                let upkeep = handle.clone();
                std::thread::spawn(move || {
                    loop {
                        std::thread::sleep(Duration::from_secs(5));
                        upkeep.run_upkeep();
                    }
                });
                Some(handle)
            }
            Err(e) => {
                eprintln!("installing the Prometheus recorder: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        None
    };
    let result = bench_dir(&args).and_then(|base| match args.mode {
        Mode::Main => main_run(&args, &out, base),
        Mode::Sweep => sweep_run(&args, &out, base),
        Mode::Space => space_run(&args, &out, base),
        Mode::Recovery => recovery_run(&args, &out, base),
        Mode::RecoveryChild => recovery_child(&args, &out),
    });
    let result = result.map(|mut j| {
        j.set("metrics_feature", Value::Bool(cfg!(feature = "metrics")))
            .set("tracing_feature", Value::Bool(cfg!(feature = "tracing")));
        if let Some(handle) = &recorder {
            // Proof that the values reached the recorder: its rendered sample lines.
            let samples = handle
                .render()
                .lines()
                .filter(|l| !l.starts_with('#'))
                .count();
            j.set("recorder_samples", Value::from(samples as u64));
        }
        j
    });
    match result {
        Ok(j) => {
            println!("JSON: {j}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("loadtest failed: {e}");
            ExitCode::FAILURE
        }
    }
}
