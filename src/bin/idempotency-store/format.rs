//! Formatting for people: tables, times, sizes, bytes; and the encodings JSON output uses.

use std::fmt::Write as _;
use std::io::{self, Write};

use idempotency_store::Timestamp;

/// The longest body, header value or checkpoint shown as text in `get` (characters).
const SHOW_TEXT: usize = 1000;

/// Rows under a header, in columns as wide as their widest cell.
pub(crate) fn table(out: &mut dyn Write, header: &[&str], rows: &[Vec<String>]) -> io::Result<()> {
    let cell = |row: &[String], i: usize| row.get(i).map_or(0, |c| c.chars().count());
    let widths: Vec<usize> = (0..header.len())
        .map(|i| {
            rows.iter()
                .map(|r| cell(r, i))
                .chain([header.get(i).map_or(0, |h| h.len())])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let header: Vec<String> = header.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let mut line = String::new();
        for (cell, width) in row.iter().zip(&widths) {
            let _ = write!(line, "{cell:<width$}  ");
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// A timestamp as UTC, to the second: `2026-05-01T12:00:05Z`.
pub(crate) fn utc(t: Timestamp) -> String {
    let secs = t.as_millis() / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// `t` relative to `now`: `in 4m05s`, `3h02m ago`.
pub(crate) fn relative(t: Timestamp, now: Timestamp) -> String {
    if t > now {
        format!("in {}", span(t, now))
    } else {
        format!("{} ago", span(now, t))
    }
}

/// `later - earlier`, coarsely: `59s`, `4m05s`, `3h02m`, `2d01h`.
pub(crate) fn span(later: Timestamp, earlier: Timestamp) -> String {
    let s = later.saturating_duration_since(earlier).as_secs();
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        3600..86_400 => format!("{}h{:02}m", s / 3600, s / 60 % 60),
        _ => format!("{}d{:02}h", s / 86_400, s / 3600 % 24),
    }
}

/// A size in bytes, in binary units: `1.1 MiB`.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS.get(unit).copied().unwrap_or("TiB"))
}

/// The plural ending for `n` things.
pub(crate) fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

/// Printable text (control characters escaped), or `None` for bytes that are not UTF-8.
pub(crate) fn printable(bytes: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut shown = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == SHOW_TEXT {
            shown.push('…');
            break;
        }
        if c.is_control() {
            shown.extend(c.escape_default());
        } else {
            shown.push(c);
        }
    }
    Some(shown)
}

/// `17 bytes: {"id":"pay_1"}`, or a pointer to `--json` for binary data.
pub(crate) fn shown_bytes(bytes: &[u8]) -> String {
    let n = bytes.len();
    match printable(bytes) {
        Some(text) if !text.is_empty() => format!("{n} byte{}: {text}", plural(n as u64)),
        Some(_) => "0 bytes".to_owned(),
        None => format!("{n} bytes of binary data (`--json` shows them in base64)"),
    }
}

/// Lowercase hex.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

/// Standard base64 (RFC 4648 §4) with padding.
pub(crate) fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let byte = |i: usize| u32::from(chunk.get(i).copied().unwrap_or(0));
        let n = (byte(0) << 16) | (byte(1) << 8) | byte(2);
        for i in 0..4 {
            if i <= chunk.len() {
                let sextet = (n >> (18 - 6 * i)) & 63;
                out.push(char::from(ALPHABET[sextet as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}
