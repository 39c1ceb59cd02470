//! `outbox-relay run` started while the broker or the database is down (issue 13): it does not
//! exit, logs that it waits (password redacted), retries with backoff, and drains once the
//! server is reachable. The server is made unreachable by pointing the relay at a closed local
//! port, which a forwarder to the real server then opens.

mod common;

use std::time::Duration;

use common::{Db, Stream, command, nats_url, stderr_lines, wait};
use outbox_conformance::net::Forwarder;
use tokio::sync::mpsc::UnboundedReceiver;

/// Waits (at most 60 s) for the `n`-th stderr line containing `needle`; returns it.
async fn line_with(rx: &mut UnboundedReceiver<String>, needle: &str, n: usize) -> String {
    let mut seen = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let l = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no log line with {needle:?} within 60 s"))
            .unwrap_or_else(|| panic!("stderr closed before a line with {needle:?}"));
        if l.contains(needle) {
            seen += 1;
            if seen == n {
                return l;
            }
        }
    }
}

fn args(db: &Db, stream: &Stream, nats: &str) -> Vec<String> {
    [
        "run",
        "--table",
        &db.table_arg(),
        "--broker",
        "nats",
        "--nats-url",
        nats,
        "--nats-stream",
        &stream.name,
        "--nats-subject-prefix",
        &stream.prefix,
        "--until-drained",
        "--summary-interval",
        "0",
        "--poll-interval",
        "200ms",
    ]
    .map(String::from)
    .to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_started_with_the_broker_down_waits_and_drains_once_it_is_reachable() {
    let db = Db::fresh().await;
    db.migrate().await;
    let written = db.write_events("boot", 4, 5, 7).await;
    let stream = Stream::fresh().await;
    stream.create(Duration::from_secs(600)).await;

    let mut port = Forwarder::closed().await.expect("a free port");
    let url = format!("nats://relay:s3cret@{}", port.addr());
    let a = args(&db, &stream, &url);
    let mut child = command(&a.iter().map(String::as_str).collect::<Vec<_>>())
        .spawn()
        .expect("spawn outbox-relay");
    let mut rx = stderr_lines(&mut child);
    let first = line_with(&mut rx, "waiting for the broker", 1).await;
    assert!(!first.contains("s3cret"), "password in the log: {first}");
    assert!(first.contains("relay:***@"), "{first}");
    // It retries rather than exits.
    line_with(&mut rx, "waiting for the broker", 2).await;
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "the relay exited while the broker was down"
    );
    assert_eq!(stream.count().await, 0);

    let target = nats_url().trim_start_matches("nats://").to_owned();
    port.open(target).await.expect("forward to NATS");
    let out = wait(child, Duration::from_secs(60)).await;
    assert_eq!(out.code, 0, "run: {}", out.stderr);
    let n: usize = written.values().map(Vec::len).sum();
    assert_eq!(
        common::check_order(&written, &stream.messages().await),
        0,
        "an event was published twice"
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
            .await as usize,
        n
    );
    stream.delete().await;
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_started_with_the_database_down_waits_and_drains_once_it_is_reachable() {
    let db = Db::fresh().await;
    db.migrate().await;
    let written = db.write_events("boot", 3, 4, 5).await;
    let stream = Stream::fresh().await;
    stream.create(Duration::from_secs(600)).await;

    let mut port = Forwarder::closed().await.expect("a free port");
    let real = common::database_url();
    let (scheme_user, rest) = real.split_once('@').expect("DATABASE_URL has user@host");
    let db_path = rest.split_once('/').map_or("", |(_, p)| p);
    let url = format!("{scheme_user}:pw@{}/{db_path}", port.addr());
    let a = args(&db, &stream, &nats_url());
    let mut child = command(&a.iter().map(String::as_str).collect::<Vec<_>>())
        .env("DATABASE_URL", &url)
        .spawn()
        .expect("spawn outbox-relay");
    let mut rx = stderr_lines(&mut child);
    let first = line_with(&mut rx, "waiting for the database", 1).await;
    assert!(!first.contains(":pw@"), "password in the log: {first}");
    line_with(&mut rx, "waiting for the database", 2).await;
    assert!(
        child.try_wait().expect("try_wait").is_none(),
        "the relay exited while the database was down"
    );

    let target = rest.split_once('/').map_or(rest, |(h, _)| h).to_owned();
    port.open(target).await.expect("forward to PostgreSQL");
    let out = wait(child, Duration::from_secs(60)).await;
    assert_eq!(out.code, 0, "run: {}", out.stderr);
    assert_eq!(
        common::check_order(&written, &stream.messages().await),
        0,
        "an event was published twice"
    );
    stream.delete().await;
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_on_a_missing_table_exits_3_without_waiting() {
    let db = Db::fresh().await;
    let stream = Stream::fresh().await;
    let a = args(&db, &stream, &nats_url());
    let child = command(&a.iter().map(String::as_str).collect::<Vec<_>>())
        .spawn()
        .expect("spawn outbox-relay");
    let out = wait(child, Duration::from_secs(30)).await;
    assert_eq!(out.code, 3, "{}", out.stderr);
    assert!(
        out.stderr.contains("outbox-relay migrate"),
        "{}",
        out.stderr
    );
}
