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

/// A timestamp as UTC, to the second: `2026-05-01T12:00:05Z`. `time` reaches the end of year
/// 9999; a later one (a saturated expiry, say) is shown as past that.
pub(crate) fn utc(t: Timestamp) -> String {
    let secs = i64::try_from(t.as_millis() / 1000).unwrap_or(i64::MAX);
    let Ok(at) = time::OffsetDateTime::from_unix_timestamp(secs) else {
        return "after 9999-12-31T23:59:59Z".to_owned();
    };
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z",
        at.year(),
        u8::from(at.month()),
        at.day(),
        at.hour(),
        at.minute(),
        at.second()
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
    hex::encode(bytes)
}

/// Standard base64 (RFC 4648 §4) with padding.
pub(crate) fn base64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates_and_encodings() {
        let at = |ms| utc(Timestamp::from_millis(ms));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_405_999), "2000-02-29T00:00:05Z");
        assert_eq!(at(1_777_636_805_000), "2026-05-01T12:00:05Z");
        assert_eq!(at(253_402_300_799_000), "9999-12-31T23:59:59Z");
        assert_eq!(at(253_402_300_800_000), "after 9999-12-31T23:59:59Z");
        assert_eq!(at(u64::MAX), "after 9999-12-31T23:59:59Z");
        assert_eq!(hex(&[0, 0xab, 0xff]), "00abff");
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo\xff"), "Zm9v/w==");
    }
}
