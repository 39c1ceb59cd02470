//! TLS to PostgreSQL without C: rustls under tokio-postgres (no OpenSSL, no libpq).
//!
//! The URL says whether a connection uses TLS, with the parameters sqlx and libpq read, so one
//! URL serves both stores:
//!
//! | URL | connection |
//! |---|---|
//! | no `sslmode`, `sslmode=disable` or `sslmode=prefer` | plain TCP |
//! | `sslmode=require`, `verify-ca` or `verify-full` | TLS (cargo feature `tls`), or a configuration error naming the feature |
//!
//! With TLS, rustls always verifies the server's certificate chain and host name (every TLS
//! mode behaves as `verify-full`), against the system's root certificates plus the PEM file of
//! `sslrootcert=` when given (a private CA, or a self-signed server certificate).
//!
//! ```text
//! postgres://app:secret@db.internal:5432/app?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem
//! ```

use std::path::PathBuf;

use crate::error::Error;

/// What a URL asks for: the URL tokio-postgres reads (TLS parameters it does not know taken
/// out, `verify-*` given as `require`) and the TLS settings, none for plain TCP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsUrl {
    /// The URL for tokio-postgres.
    pub url: String,
    /// TLS settings; `None` for a plain connection.
    pub tls: Option<TlsSettings>,
}

/// TLS settings read from the URL.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsSettings {
    /// PEM file of certificates to trust besides the system's (`sslrootcert=`).
    pub root_certificates: Option<PathBuf>,
}

/// Reads the TLS parameters of a PostgreSQL URL (see the module docs).
pub fn parse_url(url: &str) -> Result<TlsUrl, Error> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok(TlsUrl {
            url: url.to_owned(),
            tls: None,
        });
    };
    let mut kept = Vec::new();
    let mut mode: Option<String> = None;
    let mut root = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "sslmode" => mode = Some(v.to_owned()),
            "sslrootcert" => root = Some(PathBuf::from(percent_decode(v))),
            _ => kept.push(pair),
        }
    }
    let tls = match mode.as_deref() {
        None | Some("disable") | Some("prefer") | Some("allow") => {
            if root.is_some() {
                return Err(Error::Config(
                    "the database URL gives sslrootcert= without a TLS sslmode; add sslmode=verify-full (or require) to use TLS".into(),
                ));
            }
            None
        }
        Some("require") | Some("verify-ca") | Some("verify-full") => Some(TlsSettings {
            root_certificates: root,
        }),
        Some(other) => {
            return Err(Error::Config(format!(
                "the database URL has sslmode={other}; use disable, prefer, require, verify-ca or verify-full"
            )));
        }
    };
    let mut url = base.to_owned();
    let mut params = kept.join("&");
    if tls.is_some() {
        if !params.is_empty() {
            params.push('&');
        }
        params.push_str("sslmode=require");
    } else if let Some(m) = mode.filter(|m| m != "allow") {
        if !params.is_empty() {
            params.push('&');
        }
        params.push_str(&format!("sslmode={m}"));
    }
    if !params.is_empty() {
        url.push('?');
        url.push_str(&params);
    }
    Ok(TlsUrl { url, tls })
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%' && i + 2 < b.len())
            .then(|| std::str::from_utf8(&b[i + 1..i + 3]).ok())
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        if let Some(v) = hex {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The rustls client configuration of `tls`: the system's roots plus the PEM file.
#[cfg(feature = "tls")]
pub fn client_config(tls: &TlsSettings) -> Result<rustls::ClientConfig, Error> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    let native = rustls_native_certs::load_native_certs();
    for c in native.certs {
        // A system certificate rustls cannot use is skipped, as browsers do.
        let _ = roots.add(c);
    }
    if let Some(path) = &tls.root_certificates {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<Result<_, _>>())
            .map_err(|e| {
                Error::Config(format!(
                    "could not read the sslrootcert file {}: {e}; give a PEM file of CA certificates",
                    path.display()
                ))
            })?;
        if certs.is_empty() {
            return Err(Error::Config(format!(
                "the sslrootcert file {} holds no PEM certificate",
                path.display()
            )));
        }
        for c in certs {
            roots.add(c).map_err(|e| {
                Error::Config(format!(
                    "a certificate of {} is not usable as a root: {e}",
                    path.display()
                ))
            })?;
        }
    }
    if roots.is_empty() {
        return Err(Error::Config(
            "no root certificate to verify the database server with: the system store is empty; give sslrootcert= in the URL".into(),
        ));
    }
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Config(format!("TLS setup: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// Opens one connection to `url`, over TLS when the URL asks for it (see the module docs).
///
/// diesel-async's connection setup runs two session settings (time zone, client encoding) as
/// prepared statements; they run here inside a transaction, so that through a
/// transaction-pooling proxy (R194) they reach one server connection and none is left prepared
/// there (a statement left behind would collide with another client's of the same name).
pub async fn establish(url: &str) -> diesel::ConnectionResult<diesel_async::AsyncPgConnection> {
    use diesel::ConnectionError;
    let t = parse_url(url).map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
    match t.tls {
        None => {
            let (client, conn) = tokio_postgres::connect(&t.url, tokio_postgres::NoTls)
                .await
                .map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
            setup_in_transaction(client, conn).await
        }
        #[cfg(feature = "tls")]
        Some(tls) => {
            let cfg = client_config(&tls).map_err(|e| ConnectionError::BadConnection(e.to_string()))?;
            let connector = tokio_postgres_rustls::MakeRustlsConnect::new(cfg);
            let (client, conn) = tokio_postgres::connect(&t.url, connector)
                .await
                .map_err(|e| ConnectionError::BadConnection(with_sources(&e)))?;
            setup_in_transaction(client, conn).await
        }
        #[cfg(not(feature = "tls"))]
        Some(_) => Err(ConnectionError::BadConnection(
            "the database URL asks for TLS (sslmode=require/verify-ca/verify-full), and outbox-diesel was built without its `tls` feature; enable it (rustls, no OpenSSL)".into(),
        )),
    }
}

/// `BEGIN` on the raw client (driving its connection meanwhile), diesel-async's setup, `COMMIT`.
async fn setup_in_transaction<T>(
    client: tokio_postgres::Client,
    mut conn: tokio_postgres::Connection<tokio_postgres::Socket, T>,
) -> diesel::ConnectionResult<diesel_async::AsyncPgConnection>
where
    T: tokio_postgres::tls::TlsStream + Unpin + Send + 'static,
{
    use diesel::ConnectionError;
    use diesel_async::SimpleAsyncConnection;
    {
        let begin = client.batch_execute("BEGIN");
        tokio::pin!(begin);
        tokio::select! {
            r = &mut begin => r.map_err(|e| ConnectionError::BadConnection(e.to_string()))?,
            r = &mut conn => {
                return Err(ConnectionError::BadConnection(match r {
                    Ok(()) => "the connection closed during setup".to_owned(),
                    Err(e) => e.to_string(),
                }));
            }
        }
    }
    let mut c =
        diesel_async::AsyncPgConnection::try_from_client_and_connection(client, conn).await?;
    c.batch_execute("COMMIT")
        .await
        .map_err(|e| ConnectionError::BadConnection(format!("setup: {e}")))?;
    Ok(c)
}

/// An error with its causes, `a: b: c` (tokio-postgres says "error performing TLS handshake"
/// and keeps the certificate problem in the source).
#[cfg(feature = "tls")]
fn with_sources(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_without_tls_stay_as_they_are() {
        for u in [
            "postgres://u@h/db",
            "postgres://u@h/db?sslmode=disable",
            "postgres://u@h/db?application_name=x&sslmode=prefer",
        ] {
            let t = parse_url(u).unwrap();
            assert_eq!(t.tls, None, "{u}");
            assert_eq!(t.url, u);
        }
    }

    #[test]
    fn tls_modes_become_require_and_the_root_file_is_taken_out() {
        let t = parse_url(
            "postgres://u@h/db?sslmode=verify-full&sslrootcert=/etc/ssl/my%20ca.pem&application_name=x",
        )
        .unwrap();
        assert_eq!(
            t.url,
            "postgres://u@h/db?application_name=x&sslmode=require"
        );
        assert_eq!(
            t.tls.unwrap().root_certificates.unwrap(),
            PathBuf::from("/etc/ssl/my ca.pem")
        );
        let t = parse_url("postgres://u@h/db?sslmode=require").unwrap();
        assert_eq!(t.tls, Some(TlsSettings::default()));
    }

    #[test]
    fn bad_tls_parameters_are_configuration_errors() {
        let e = parse_url("postgres://u@h/db?sslmode=sometimes").unwrap_err();
        assert!(e.to_string().contains("sslmode=sometimes"), "{e}");
        let e = parse_url("postgres://u@h/db?sslrootcert=/x.pem").unwrap_err();
        assert!(e.to_string().contains("sslmode=verify-full"), "{e}");
    }
}
