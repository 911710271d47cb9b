//! TLS for [`PgStore`](crate::PgStore): `sslmode` and `sslrootcert` read from the connection
//! string as libpq reads them, and the `native-tls` connector they configure.
//!
//! `tokio-postgres` knows only `disable`, `prefer` and `require` and rejects `sslrootcert`, so
//! both options are taken out of the string here and the rest is parsed by `postgres`.

use std::path::PathBuf;

use ::postgres::Config;
use ::postgres::config::SslMode as WireMode;
use postgres_native_tls::MakeTlsConnector;

use crate::error::{Error, Result};

/// libpq's `sslmode` values (`allow` is treated as `prefer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<SslMode> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(invalid(format!(
                    "sslmode {other:?} is not one of disable, allow, prefer, require, \
                     verify-ca, verify-full"
                )));
            }
        })
    }

    /// What `connect` was doing, for the error of a failed connection: with verification on,
    /// a certificate problem is the likely cause and the message says what is checked.
    pub(crate) fn context(self) -> &'static str {
        match self {
            SslMode::Disable => "connecting to PostgreSQL (sslmode=disable: no TLS)",
            SslMode::Prefer | SslMode::Require => "connecting to PostgreSQL",
            SslMode::VerifyCa => {
                "connecting to PostgreSQL over TLS (sslmode=verify-ca: the server's certificate \
                 must be signed by a certificate in sslrootcert)"
            }
            SslMode::VerifyFull => {
                "connecting to PostgreSQL over TLS (sslmode=verify-full: the server's certificate \
                 must be signed by a certificate in sslrootcert and name the host connected to)"
            }
        }
    }
}

/// A parsed connection string and the TLS connector its `sslmode` asks for.
pub(crate) struct Connection {
    pub config: Config,
    pub tls: MakeTlsConnector,
    pub mode: SslMode,
}

/// Parses `url` (a `postgres://` URL or `key=value` pairs), honouring `sslmode` (default
/// `prefer`) and `sslrootcert` (a PEM file of trusted certificates, or `system`).
pub(crate) fn parse(url: &str) -> Result<Connection> {
    let (rest, options) = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        split_url(url)?
    } else {
        split_pairs(url)?
    };
    let mut mode = SslMode::Prefer;
    let mut root_cert = None;
    for (key, value) in options {
        if key == "sslmode" {
            mode = SslMode::parse(&value)?;
        } else {
            root_cert = Some(value);
        }
    }
    // As libpq: `require` with a root certificate file checks the chain, like `verify-ca`.
    if mode == SslMode::Require && root_cert.as_deref().is_some_and(|c| c != "system") {
        mode = SslMode::VerifyCa;
    }
    let mut config: Config = rest.parse().map_err(|e| {
        invalid(format!(
            "the PostgreSQL connection string does not parse: {e}"
        ))
    })?;
    config.ssl_mode(match mode {
        SslMode::Disable => WireMode::Disable,
        SslMode::Prefer => WireMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => WireMode::Require,
    });
    let tls = connector(mode, root_cert.map(PathBuf::from))?;
    Ok(Connection { config, tls, mode })
}

/// The connector: `prefer` and `require` encrypt without checking the certificate (as libpq
/// does without a root certificate); `verify-ca` checks the chain, `verify-full` the chain and
/// the host name (or IP address).
fn connector(mode: SslMode, root_cert: Option<PathBuf>) -> Result<MakeTlsConnector> {
    let mut builder = native_tls::TlsConnector::builder();
    match mode {
        SslMode::Disable | SslMode::Prefer | SslMode::Require => {
            builder
                .danger_accept_invalid_certs(true)
                .danger_accept_invalid_hostnames(true);
        }
        SslMode::VerifyCa => {
            builder.danger_accept_invalid_hostnames(true);
        }
        SslMode::VerifyFull => {}
    }
    if let Some(path) = root_cert.filter(|p| p.as_os_str() != "system") {
        let pem = std::fs::read(&path).map_err(|e| {
            invalid(format!(
                "sslrootcert {} cannot be read: {e}",
                path.display()
            ))
        })?;
        let certificate = native_tls::Certificate::from_pem(&pem).map_err(|e| {
            invalid(format!(
                "sslrootcert {} is not a PEM certificate: {e}",
                path.display()
            ))
        })?;
        builder
            .add_root_certificate(certificate)
            .disable_built_in_roots(true);
    }
    let connector = builder
        .build()
        .map_err(|e| invalid(format!("the TLS connector cannot be set up: {e}")))?;
    Ok(MakeTlsConnector::new(connector))
}

fn invalid(reason: String) -> Error {
    Error::InvalidConfig { reason }
}

fn is_tls_option(key: &str) -> bool {
    key == "sslmode" || key == "sslrootcert"
}

/// Takes `sslmode` and `sslrootcert` out of a URL's query string.
fn split_url(url: &str) -> Result<(String, Vec<(String, String)>)> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), Vec::new()));
    };
    let mut kept = Vec::new();
    let mut options = Vec::new();
    for part in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = part.split_once('=').unwrap_or((part, ""));
        let key = percent_decode(key)?;
        if is_tls_option(&key) {
            options.push((key, percent_decode(value)?));
        } else {
            kept.push(part);
        }
    }
    let rest = if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((rest, options))
}

fn percent_decode(text: &str) -> Result<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let byte = text
                .get(i + 1..i + 3)
                .and_then(|hex| u8::from_str_radix(hex, 16).ok())
                .ok_or_else(|| invalid(format!("bad percent-encoding in {text:?}")))?;
            out.push(byte);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| invalid(format!("{text:?} does not decode to UTF-8")))
}

/// Takes `sslmode` and `sslrootcert` out of `key=value` pairs; the others are written back
/// quoted, which `postgres` reads exactly as it reads them unquoted.
fn split_pairs(text: &str) -> Result<(String, Vec<(String, String)>)> {
    let mut chars = text.chars().peekable();
    let mut kept = Vec::new();
    let mut options = Vec::new();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            break;
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| !c.is_whitespace() && *c != '=') {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            return Err(invalid(format!(
                "the PostgreSQL connection string does not parse: {key:?} has no `=value`"
            )));
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let value = pair_value(&mut chars)?;
        if is_tls_option(&key) {
            options.push((key, value));
        } else {
            let quoted = value.replace('\\', "\\\\").replace('\'', "\\'");
            kept.push(format!("{key}='{quoted}'"));
        }
    }
    Ok((kept.join(" "), options))
}

/// One value: quoted (`'…'`, backslash escapes) or up to the next whitespace.
fn pair_value(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) -> Result<String> {
    let mut value = String::new();
    let quoted = chars.next_if_eq(&'\'').is_some();
    loop {
        match chars.next() {
            None if quoted => {
                return Err(invalid(
                    "the PostgreSQL connection string has an unterminated quote".to_owned(),
                ));
            }
            None => return Ok(value),
            Some('\'') if quoted => return Ok(value),
            Some(c) if c.is_whitespace() && !quoted => return Ok(value),
            Some('\\') => value.extend(chars.next()),
            Some(c) => value.push(c),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_options_are_taken_out_of_key_value_pairs() -> Result<()> {
        let (rest, options) = split_pairs(
            "host=127.0.0.1 password = 'it\\'s' sslmode=verify-full sslrootcert='/tmp/a b.pem'",
        )?;
        assert_eq!(rest, "host='127.0.0.1' password='it\\'s'");
        assert_eq!(
            options,
            [
                ("sslmode".to_owned(), "verify-full".to_owned()),
                ("sslrootcert".to_owned(), "/tmp/a b.pem".to_owned())
            ]
        );
        let config: Config = rest.parse().map_err(|e| invalid(format!("{e}")))?;
        assert_eq!(config.get_password(), Some(&b"it's"[..]));
        Ok(())
    }

    #[test]
    fn tls_options_are_taken_out_of_a_url() -> Result<()> {
        let (rest, options) = split_url(
            "postgresql://u:p@localhost/db?sslmode=require&application_name=x&sslrootcert=%2Ftmp%2Fca.pem",
        )?;
        assert_eq!(rest, "postgresql://u:p@localhost/db?application_name=x");
        assert_eq!(
            options,
            [
                ("sslmode".to_owned(), "require".to_owned()),
                ("sslrootcert".to_owned(), "/tmp/ca.pem".to_owned())
            ]
        );
        assert_eq!(
            split_url("postgres://h/db?sslmode=disable")?.0,
            "postgres://h/db"
        );
        Ok(())
    }

    #[test]
    fn modes_follow_libpq() -> Result<()> {
        assert_eq!(parse("host=h")?.mode, SslMode::Prefer);
        assert_eq!(parse("host=h sslmode=disable")?.mode, SslMode::Disable);
        assert!(matches!(
            parse("host=h sslmode=verify"),
            Err(Error::InvalidConfig { .. })
        ));
        assert!(matches!(
            parse("host=h sslmode=verify-full sslrootcert=/nonexistent/ca.pem"),
            Err(Error::InvalidConfig { reason }) if reason.contains("/nonexistent/ca.pem")
        ));
        assert_eq!(
            parse("host=h sslmode=verify-full sslrootcert=system")?.mode,
            SslMode::VerifyFull
        );
        Ok(())
    }
}
