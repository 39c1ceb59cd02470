//! TLS to PostgreSQL over rustls (feature `tls`): a URL with `sslmode=verify-full` and the
//! server's CA in `sslrootcert=` connects encrypted; a certificate issued to another host name
//! is refused; a URL that does not ask for TLS stays plain. Needs the local server's TLS certificate:
//! `OUTBOX_TEST_PG_CA` (default `/etc/ssl/certs/ssl-cert-snakeoil.pem`, issued to `localhost`)
//! and `OUTBOX_TEST_PG_TLS_URL` (default `postgres://postgres@localhost:5432/test`).

use diesel::sql_types::Bool;
use diesel_async::RunQueryDsl;
use txoutbox_diesel::{PoolSettings, build_pool};

#[derive(diesel::QueryableByName)]
struct Ssl {
    #[diesel(sql_type = Bool)]
    ssl: bool,
}

fn base() -> String {
    std::env::var("OUTBOX_TEST_PG_TLS_URL")
        .unwrap_or_else(|_| "postgres://postgres@localhost:5432/test".into())
}

fn ca() -> String {
    std::env::var("OUTBOX_TEST_PG_CA")
        .unwrap_or_else(|_| "/etc/ssl/certs/ssl-cert-snakeoil.pem".into())
}

async fn ssl_of(url: &str) -> Result<bool, String> {
    let pool = build_pool(url, &PoolSettings::default().max_size(1).unwrap())
        .map_err(|e| e.to_string())?;
    let mut conn = pool.get().await.map_err(|e| e.to_string())?;
    diesel::sql_query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .get_result::<Ssl>(&mut conn)
        .await
        .map(|r| r.ssl)
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn verify_full_with_the_servers_ca_connects_over_tls() {
    let url = format!("{}?sslmode=verify-full&sslrootcert={}", base(), ca());
    assert_eq!(ssl_of(&url).await, Ok(true));
    // The diesel connection used by the migrations takes the same URL.
    let conn = txoutbox_diesel::tls::establish(&url).await;
    assert!(conn.is_ok(), "{:?}", conn.err().map(|e| e.to_string()));
}

#[tokio::test]
async fn a_certificate_issued_to_another_host_is_refused() {
    // The server's certificate names `localhost`; reached as 127.0.0.1, rustls refuses it even
    // with the CA trusted: host names are always verified.
    let url = base().replacen("@localhost:", "@127.0.0.1:", 1);
    assert_ne!(
        url,
        base(),
        "OUTBOX_TEST_PG_TLS_URL must name the host localhost"
    );
    let e = ssl_of(&format!("{url}?sslmode=require&sslrootcert={}", ca()))
        .await
        .unwrap_err();
    assert!(e.contains("TLS handshake"), "{e}");
    assert!(e.contains("certificate"), "the cause is kept: {e}");
}

#[tokio::test]
async fn a_url_that_asks_for_no_tls_stays_plain() {
    assert_eq!(ssl_of(&base()).await, Ok(false));
    assert_eq!(
        ssl_of(&format!("{}?sslmode=disable", base())).await,
        Ok(false)
    );
}

#[tokio::test]
async fn a_missing_ca_file_fails_when_the_pool_is_built() {
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        base()
    );
    let Err(e) = build_pool(&url, &PoolSettings::default()) else {
        panic!("a pool was built with a CA file that does not exist");
    };
    let e = e.to_string();
    assert!(e.contains("/nonexistent/ca.pem"), "{e}");
}
