//! Small tools: output, JSON, keys, random numbers, percentiles, the bench directory.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use idempotency_store::Fingerprint;
use serde_json::{Map, Value};

use crate::args::Args;
use crate::{BODY_LEN, Res};

/// Prints unless `--json-only`.
pub(crate) struct Out {
    pub(crate) quiet: bool,
}

impl Out {
    pub(crate) fn line(&self, s: impl AsRef<str>) {
        if !self.quiet {
            println!("{}", s.as_ref());
        }
    }

    /// Progress notes go to stderr so that stdout stays a clean report.
    pub(crate) fn note(&self, s: impl AsRef<str>) {
        if !self.quiet {
            eprintln!("  .. {}", s.as_ref());
        }
    }
}

/// Building the report on `serde_json` values: `set` chains fields onto an object, `child` is
/// the object under a key (created if missing).
pub(crate) trait Report {
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
pub(crate) fn obj() -> Value {
    Value::Object(Map::new())
}

/// A measured figure, to 3 decimals; `null` if it is not finite.
pub(crate) fn num(n: f64) -> Value {
    if n.is_finite() {
        Value::from((n * 1000.0).round() / 1000.0)
    } else {
        Value::Null
    }
}

/// An optional figure, `null` when absent.
pub(crate) fn opt(v: Option<f64>) -> Value {
    v.map_or(Value::Null, num)
}

/// splitmix64's finaliser: a bijection on u64, so distinct inputs give distinct outputs.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A UUID-shaped key (36 bytes) for record `index` of `stream`; unique per (stream, index) and
/// scattered over the key space like client-generated UUIDv4s.
pub(crate) fn key_name(stream: u64, index: u64) -> String {
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

pub(crate) fn fingerprint_of(name: &str) -> Fingerprint {
    Fingerprint::of(["POST", "/payments", name])
}

/// xorshift64*: a cheap per-thread generator for picking replay keys.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(mix64(seed) | 1)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let r = self.0.wrapping_mul(0x2545_f491_4f6c_dd1d);
        ((u128::from(r) * n as u128) >> 64) as usize
    }
}

pub(crate) fn body() -> Vec<u8> {
    (0..BODY_LEN).map(|i| b'a' + (i % 26) as u8).collect()
}

pub(crate) fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// Latency percentiles of a sample in nanoseconds, reported in microseconds.
#[derive(Clone, Copy, Default)]
pub(crate) struct Lat {
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) max_us: f64,
    pub(crate) n: usize,
}

pub(crate) fn percentiles(mut ns: Vec<u64>) -> Option<Lat> {
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

pub(crate) fn lat_json(lat: Option<Lat>) -> Value {
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
pub(crate) fn filesystem_of(path: &Path) -> String {
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
pub(crate) fn bench_dir(args: &Args) -> Res<PathBuf> {
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

pub(crate) fn fresh_dir(base: &Path, label: &str) -> Res<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(&format!("loadtest-{label}-"))
        .tempdir_in(base)
        .map_err(|e| format!("temp dir in {}: {e}", base.display()))
}

pub(crate) fn peak_rss_kib() -> Option<u64> {
    proc_status_kib("VmHWM")
}

/// A `kB` field of `/proc/self/status` (`VmHWM`, `VmRSS`, `RssAnon`, `RssFile`).
pub(crate) fn proc_status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status
        .lines()
        .find(|l| l.split(':').next() == Some(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// Length and allocated bytes (`st_blocks` × 512) of a file.
pub(crate) fn file_bytes(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map_or((0, 0), |m| (m.len(), m.blocks() * 512))
}

pub(crate) fn err(context: &str, e: impl std::fmt::Display) -> String {
    format!("{context}: {e}")
}
