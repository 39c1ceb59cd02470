//! What keeps `outbox-relay` from losing events or leaking secrets: `run` needs `--broker`
//! (flag or OUTBOX_BROKER), `noop` warns that it discards, `--help` shows no environment
//! values, and error messages carry no password.

mod common;

use common::{Db, command, relay, wait};
use std::time::Duration;

fn args<'a>(db: &'a Db, cmd: &'a [&'a str]) -> Vec<&'a str> {
    let mut v = cmd.to_vec();
    v.push("--table");
    v.push(Box::leak(db.table_arg().into_boxed_str()));
    v
}

#[tokio::test(flavor = "multi_thread")]
async fn run_without_a_broker_is_refused_and_publishes_nothing() {
    let db = Db::fresh().await;
    db.migrate().await;
    db.write_events("safety", 2, 3, 10).await;
    let out = relay(&args(&db, &["run", "--until-drained"])).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("--broker"), "{}", out.stderr);
    assert!(out.stdout.is_empty(), "printed events: {}", out.stdout);
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'pending' AND attempts_made = 0")
            .await,
        6,
        "no row may change"
    );

    // OUTBOX_BROKER names it as well as the flag does.
    let mut c = command(&args(
        &db,
        &["run", "--until-drained", "--summary-interval", "0"],
    ));
    c.env("OUTBOX_BROKER", "stdout");
    let out = wait(c.spawn().unwrap(), Duration::from_secs(60)).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(out.stdout.lines().count(), 6, "{}", out.stdout);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_noop_broker_warns_that_it_discards_events() {
    let db = Db::fresh().await;
    db.migrate().await;
    db.write_events("safety", 1, 2, 10).await;
    let out = relay(&args(
        &db,
        &[
            "run",
            "--broker",
            "noop",
            "--until-drained",
            "--summary-interval",
            "0",
        ],
    ))
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let warning = out
        .stderr
        .lines()
        .find(|l| l.contains("WARN") && l.contains("--broker noop"))
        .unwrap_or_else(|| panic!("no warning: {}", out.stderr));
    assert!(warning.contains("DISCARDED"), "{warning}");
    // The stdout broker, when named, is no reason to warn.
    let out = relay(&args(
        &db,
        &[
            "run",
            "--broker",
            "stdout",
            "--until-drained",
            "--summary-interval",
            "0",
        ],
    ))
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(!out.stderr.contains("DISCARDED"), "{}", out.stderr);
    db.drop_schema().await;
}

const SECRETS: [(&str, &str); 3] = [
    (
        "DATABASE_URL",
        "postgres://app:pg-s3cret@127.0.0.1:5432/test",
    ),
    ("NATS_URL", "nats://app:nats-s3cret@127.0.0.1:4222"),
    ("REDIS_URL", "redis://:redis-s3cret@127.0.0.1:6379"),
];

#[tokio::test(flavor = "multi_thread")]
async fn help_shows_no_environment_values() {
    let subcommands = [
        &[][..],
        &["run"],
        &["migrate"],
        &["stats"],
        &["blocked-keys"],
        &["requeue-failed"],
        &["release-stale-locks"],
        &["cleanup"],
        &["force-unlock"],
    ];
    for sub in subcommands {
        let mut a: Vec<&str> = sub.to_vec();
        a.push("--help");
        let mut c = command(&a);
        for (k, v) in SECRETS {
            c.env(k, v);
        }
        let out = wait(c.spawn().unwrap(), Duration::from_secs(30)).await;
        assert_eq!(out.code, 0, "{sub:?}: {}", out.stderr);
        for needle in ["s3cret", "127.0.0.1:5432/test", "app:"] {
            assert!(
                !out.stdout.contains(needle),
                "{sub:?} --help shows {needle:?}:\n{}",
                out.stdout
            );
        }
        if sub == ["run"] {
            // The variables are still named, so the reader knows they are read.
            for (k, _) in SECRETS {
                assert!(out.stdout.contains(k), "{k} not named:\n{}", out.stdout);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn errors_about_a_database_url_never_show_its_password() {
    // A port where nothing listens (bound and released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let unreachable = format!("postgres://app:pg-s3cret@127.0.0.1:{port}/test");
    let out = relay(&["stats", "--database-url", &unreachable]).await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(out.stderr.contains("could not connect"), "{}", out.stderr);
    assert!(!out.stderr.contains("pg-s3cret"), "{}", out.stderr);

    // Malformed URLs: the parser's own text must not carry it either.
    for bad in [
        "postgres://app:pg-s3cret@127.0.0.1:notaport/test",
        "mysql://app:pg-s3cret@127.0.0.1/test",
    ] {
        let out = relay(&["stats", "--database-url", bad]).await;
        assert_eq!(out.code, 2, "{bad}: {}", out.stderr);
        assert!(!out.stderr.contains("pg-s3cret"), "{bad}: {}", out.stderr);
    }

    // From the environment, with the broker's URL too: `run` waits for the database (it does
    // not exit) and says so, without the password.
    let mut c = command(&["run", "--broker", "nats", "--summary-interval", "0"]);
    c.env("DATABASE_URL", &unreachable)
        .env("NATS_URL", "nats://app:nats-s3cret@127.0.0.1:1");
    let lines = waiting_lines(c, "waiting for the database").await;
    assert!(lines.iter().all(|l| !l.contains("s3cret")), "{lines:#?}");
    assert!(lines.iter().any(|l| l.contains("app:***@")), "{lines:#?}");
}

/// Runs `c` (a `run` command) until its stderr shows `needle` twice (it waits and retries
/// instead of exiting), then stops it with SIGTERM (exit 0); returns every stderr line.
async fn waiting_lines(mut c: tokio::process::Command, needle: &str) -> Vec<String> {
    let mut child = c.spawn().expect("spawn");
    let mut rx = common::stderr_lines(&mut child);
    let mut lines = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while lines
        .iter()
        .filter(|l: &&String| l.contains(needle))
        .count()
        < 2
    {
        let l = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} twice within 60 s: {lines:#?}"))
            .unwrap_or_else(|| panic!("run exited instead of waiting: {lines:#?}"));
        lines.push(l);
    }
    assert!(child.try_wait().expect("try_wait").is_none(), "run exited");
    let pid = child.id().expect("running").to_string();
    std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("run did not stop on SIGTERM")
        .expect("wait");
    while let Some(l) = rx.recv().await {
        lines.push(l);
    }
    assert_eq!(status.code(), Some(0), "{lines:#?}");
    lines
}

#[cfg(feature = "nats")]
#[tokio::test(flavor = "multi_thread")]
async fn errors_about_a_broker_url_never_show_its_password() {
    let db = Db::fresh().await;
    db.migrate().await;
    // `run` waits for an unreachable broker (it does not exit) and says so, without the
    // password.
    let a = args(
        &db,
        &[
            "run",
            "--broker",
            "nats",
            "--nats-url",
            "nats://app:nats-s3cret@127.0.0.1:1",
            "--summary-interval",
            "0",
        ],
    );
    let lines = waiting_lines(command(&a), "waiting for the broker").await;
    assert!(
        lines.iter().any(|l| l.contains("127.0.0.1:1")),
        "{lines:#?}"
    );
    assert!(
        lines.iter().all(|l| !l.contains("nats-s3cret")),
        "{lines:#?}"
    );
    db.drop_schema().await;
}

/// `--store diesel` over TLS (rustls, no OpenSSL, no libpq): the URL's `sslmode=verify-full`
/// and `sslrootcert` serve the sqlx check and the diesel store alike. Needs the local server's
/// certificate (issued to `localhost`): `OUTBOX_TEST_PG_CA`, default
/// `/etc/ssl/certs/ssl-cert-snakeoil.pem`.
#[cfg(feature = "diesel")]
#[tokio::test(flavor = "multi_thread")]
async fn the_diesel_store_connects_over_tls_when_the_url_asks_for_it() {
    let ca = std::env::var("OUTBOX_TEST_PG_CA")
        .unwrap_or_else(|_| "/etc/ssl/certs/ssl-cert-snakeoil.pem".into());
    let db = Db::fresh().await;
    let url = format!(
        "{}?sslmode=verify-full&sslrootcert={ca}",
        common::database_url().replacen("@127.0.0.1:", "@localhost:", 1)
    );
    let t = db.table_arg();
    for cmd in [&["migrate"][..], &["stats", "--json"]] {
        let mut a = cmd.to_vec();
        a.extend(["--store", "diesel", "--table", &t, "--database-url", &url]);
        let out = relay(&a).await;
        assert_eq!(out.code, 0, "{cmd:?}: {}", out.stderr);
    }
    assert_eq!(db.scalar_i64("SELECT count(*) FROM {t}").await, 0);
    // A CA file that is not there is a usage error naming it (exit 2), before any connection.
    let bad = url.replace(&ca, "/nonexistent/ca.pem");
    let out = relay(&[
        "stats",
        "--store",
        "diesel",
        "--table",
        &t,
        "--database-url",
        &bad,
    ])
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("/nonexistent/ca.pem"), "{}", out.stderr);
    db.drop_schema().await;
}
