//! The process's CPU time, for the HTTP benchmarks (`examples/http_bench.rs` and
//! `bench/http_peers`, a crate of its own, which both include this file).

use std::time::Duration;

/// The CPU time (user and system) this process has used, from `/proc/self/stat` (zero where
/// there is none); in clock ticks of 10 ms, which a window of seconds makes fine enough.
pub(crate) fn process_cpu() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command name, which is in parentheses and may hold spaces.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime: fields 14 and 15 of the line, 11 and 12 counted from the state (0).
    Duration::from_millis((ticks(11) + ticks(12)) * 10)
}
