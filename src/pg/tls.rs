//! TLS for [`PgStore`](crate::pg::PgStore): `sslmode` and `sslrootcert` read from the connection
//! string as libpq reads them, and the rustls connector they configure.
//!
//! `tokio-postgres` knows only `disable`, `prefer` and `require` and rejects `sslrootcert`, so
//! both options are taken out of the string here and the rest is parsed by `postgres`; so is
//! `PgStore`'s own `prepare_statements` (see `PgStoreBuilder::prepare_statements`), which
//! belongs with the address, as it depends on whether a pooler answers there.

use std::path::PathBuf;
use std::sync::Arc;

use ::postgres::Config;
use ::postgres::config::SslMode as WireMode;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

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
    pub tls: MakeRustlsConnect,
    pub mode: SslMode,
    /// `prepare_statements=true|false`, if the string says.
    pub prepare_statements: Option<bool>,
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
    let mut prepare_statements = None;
    for (key, value) in options {
        match key.as_str() {
            "sslmode" => mode = SslMode::parse(&value)?,
            "prepare_statements" => prepare_statements = Some(parse_bool(&key, &value)?),
            _ => root_cert = Some(value),
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
    Ok(Connection {
        config,
        tls,
        mode,
        prepare_statements,
    })
}

/// The connector: `prefer` and `require` encrypt without checking the certificate (as libpq
/// does without a root certificate); `verify-ca` checks the chain, `verify-full` the chain and
/// the host name (or IP address). rustls with the `ring` provider, so that building needs no
/// system TLS library.
fn connector(mode: SslMode, root_cert: Option<PathBuf>) -> Result<MakeRustlsConnect> {
    // rustls 0.23.48 deprecates its ring provider for want of post-quantum key exchange. The
    // other provider, aws-lc-rs, needs cmake to build, which this crate keeps out (see the
    // `postgres` feature in Cargo.toml); `allow`, not `expect`: older 0.23s do not deprecate it.
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(format!("the TLS connector cannot be set up: {e}")))?;
    let config = match mode {
        SslMode::Disable | SslMode::Prefer | SslMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth(),
        SslMode::VerifyCa | SslMode::VerifyFull => {
            let roots = Arc::new(trusted_roots(root_cert)?);
            let chain = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| invalid(format!("the TLS connector cannot be set up: {e}")))?;
            let verifier: Arc<dyn ServerCertVerifier> = if mode == SslMode::VerifyCa {
                Arc::new(AnyName(chain))
            } else {
                chain
            };
            builder
                .dangerous()
                .with_custom_certificate_verifier(verifier)
                .with_no_client_auth()
        }
    };
    Ok(MakeRustlsConnect::new(config))
}

/// The roots a verifying mode trusts: the certificates of `sslrootcert`, or (without one, or
/// with `system`) the platform's.
fn trusted_roots(root_cert: Option<PathBuf>) -> Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    let Some(path) = root_cert.filter(|p| p.as_os_str() != "system") else {
        let found = rustls_native_certs::load_native_certs();
        let (added, _) = roots.add_parsable_certificates(found.certs);
        if added == 0 {
            return Err(invalid(format!(
                "no trusted root certificate found on this system ({:?}): name a PEM file \
                 with sslrootcert",
                found.errors
            )));
        }
        return Ok(roots);
    };
    let unreadable = |e: &dyn std::fmt::Display| {
        invalid(format!(
            "sslrootcert {} is not a readable PEM certificate: {e}",
            path.display()
        ))
    };
    let certs = CertificateDer::pem_file_iter(&path)
        .map_err(|e| unreadable(&e))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| unreadable(&e))?;
    if certs.is_empty() {
        return Err(unreadable(&"it holds no certificate"));
    }
    for cert in certs {
        roots.add(cert).map_err(|e| unreadable(&e))?;
    }
    Ok(roots)
}

/// `require`: any certificate, as libpq without a root certificate. The handshake's
/// signatures are still checked against the certificate's key, so the connection is encrypted
/// to whoever holds it.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted root, whatever names the certificate holds.
/// (The name is checked only once the chain is good, so a name error means a good chain.)
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

fn invalid(reason: String) -> Error {
    Error::InvalidConfig { reason }
}

/// The options taken out of the string before `postgres` parses the rest.
fn is_own_option(key: &str) -> bool {
    key == "sslmode" || key == "sslrootcert" || key == "prepare_statements"
}

fn parse_bool(key: &str, value: &str) -> Result<bool> {
    match value {
        "true" | "on" | "1" => Ok(true),
        "false" | "off" | "0" => Ok(false),
        other => Err(invalid(format!(
            "{key} {other:?} is not one of true, false, on, off, 1, 0"
        ))),
    }
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
        if is_own_option(&key) {
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

/// As `tokio-postgres` decodes the rest of the URL: a `%` not followed by two hex digits is
/// kept as it is.
fn percent_decode(text: &str) -> Result<String> {
    percent_encoding::percent_decode_str(text)
        .decode_utf8()
        .map(String::from)
        .map_err(|_| invalid(format!("{text:?} does not decode to UTF-8")))
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
        if is_own_option(&key) {
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
        assert_eq!(parse("host=h")?.prepare_statements, None);
        assert_eq!(
            parse("host=h prepare_statements=false")?.prepare_statements,
            Some(false)
        );
        assert_eq!(
            parse("postgresql://h/db?prepare_statements=on")?.prepare_statements,
            Some(true)
        );
        assert!(parse("host=h prepare_statements=maybe").is_err());
        Ok(())
    }
}
