//! `outbox-relay run` started while the broker or the database is down (issue 13): it does not
//! exit, logs that it waits (password redacted), retries with backoff, and drains once the
//! server is reachable. And a 10 s NATS outage while it runs (issue 14): the loops back off and
//! the client's reconnection wakes them. The server is made unreachable by pointing the relay at
//! a local port that a forwarder to the real server opens and closes.

mod common;

use std::time::Duration;

use common::{Db, Stream, command, nats_url, stderr_lines, wait};
use tokio::sync::mpsc::UnboundedReceiver;
use txoutbox_conformance::net::Forwarder;

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

/// No stream covers the subjects (`--nats-stream ""` creates none, and nobody else made one):
/// this relay could never publish, so `run` says so at start-up and exits 4 (broker) instead of
/// leaving every row pending with a retry; the row is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_without_a_stream_for_its_subjects_exits_4_at_start_up() {
    let db = Db::fresh().await;
    db.migrate().await;
    db.write_events("nostream", 1, 1, 1).await;
    let before = db.digest().await;
    let stream = Stream::fresh().await; // never created
    let mut a = args(&db, &stream, &nats_url());
    let at = a.iter().position(|x| x == "--nats-stream").expect("flag") + 1;
    a[at] = String::new();
    let out = wait(
        command(&a.iter().map(String::as_str).collect::<Vec<_>>())
            .spawn()
            .expect("spawn outbox-relay"),
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(out.code, 4, "{}", out.stderr);
    assert!(
        out.stderr.contains("no JetStream stream covers")
            && out.stderr.contains(&format!("{}>", stream.prefix)),
        "{}",
        out.stderr
    );
    assert_eq!(db.digest().await, before, "the row is untouched");
    db.drop_schema().await;
}

/// What a 10 s NATS outage cost three relay loops in one `run` process, and how soon they
/// published once NATS was reachable again.
#[derive(Debug)]
struct OutageFigures {
    cycles: usize,
    rows_fetched: usize,
    first_publish_after: Duration,
}

/// Three loops (`--loops 3`, default poll 5 s) publish through a forwarder to NATS; the
/// forwarder is closed (every connection cut, new ones refused) for 10 s, during which 600 rows
/// on 200 keys are written (each commit notifies); then it opens again. With `until_drained`, a
/// row held under another worker's live lease keeps `--until-drained` from ending the run
/// early, and is released at the end so the run drains and exits 0.
async fn broker_outage_10s(until_drained: bool, redis: bool) -> OutageFigures {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    let db = Db::fresh().await;
    db.migrate().await;
    let stream = Stream::fresh().await;
    stream.create(Duration::from_secs(600)).await;
    let sink = if redis {
        Sink::redis()
    } else {
        Sink::Nats(&stream)
    };
    if until_drained {
        db.write_events("hold", 1, 1, 1).await;
        db.exec("UPDATE {t} SET locked_by = 'elsewhere', locked_at = now()")
            .await;
    }
    let mut port = Forwarder::closed().await.expect("a free port");
    let target = sink.target();
    port.open(target.clone()).await.expect("forward");

    let mut a = args(&db, &stream, &format!("nats://{}", port.addr()));
    if let Sink::Redis { key, .. } = &sink {
        let b = a.iter().position(|x| x == "--broker").expect("flag");
        a[b + 1] = "redis".to_owned();
        a.extend([
            "--redis-url".to_owned(),
            format!("redis://{}", port.addr()),
            "--redis-key-pattern".to_owned(),
            key.replace("outage", "{topic}"),
        ]);
    }
    a.retain(|x| x != "--until-drained");
    let pos = a.iter().position(|x| x == "--poll-interval").expect("flag");
    a.drain(pos..pos + 2);
    a.extend(["--loops", "3", "--log-json"].map(String::from));
    if until_drained {
        a.push("--until-drained".into());
    }
    let mut child = command(&a.iter().map(String::as_str).collect::<Vec<_>>())
        .env("RUST_LOG", "info,txoutbox_core::relay=debug")
        .spawn()
        .expect("spawn outbox-relay");
    let mut rx = stderr_lines(&mut child);
    line_with(&mut rx, "relay started", 1).await;
    let lines: Arc<Mutex<Vec<(Instant, String)>>> = Arc::default();
    let collector = tokio::spawn({
        let lines = lines.clone();
        async move {
            while let Some(l) = rx.recv().await {
                lines.lock().unwrap().push((Instant::now(), l));
            }
        }
    });

    port.close().await;
    let t0 = Instant::now();
    let written = db.write_events("outage", 200, 3, 20).await;
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(t0.elapsed())).await;
    port.open(target).await.expect("forward again");
    let t1 = Instant::now();
    let first_publish_after = loop {
        if sink.count().await > 0 {
            break t1.elapsed();
        }
        assert!(
            t1.elapsed() < Duration::from_secs(30),
            "nothing published 30 s after the outage"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let n: usize = written.values().map(Vec::len).sum();
    let deadline = Instant::now() + Duration::from_secs(60);
    while (sink.count().await as usize) < n {
        assert!(
            Instant::now() < deadline,
            "not all {n} events published within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    if until_drained {
        db.exec("UPDATE {t} SET locked_by = NULL, locked_at = NULL WHERE topic = 'hold'")
            .await;
    } else {
        let pid = child.id().expect("running").to_string();
        std::process::Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .expect("kill");
    }
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait())
        .await
        .expect("the relay did not exit")
        .expect("wait");
    collector.await.expect("collector");
    assert_eq!(status.code(), Some(0));
    let msgs: Vec<_> = sink
        .messages()
        .await
        .into_iter()
        .filter(|(id, _)| written.values().any(|v| v.contains(id)))
        .collect();
    assert_eq!(
        common::check_order(&written, &msgs),
        0,
        "a repeat in the stream"
    );

    let lines = std::mem::take(&mut *lines.lock().unwrap());
    let during: Vec<serde_json::Value> = lines
        .iter()
        .filter(|(t, _)| *t >= t0 && *t < t1)
        .filter_map(|(_, l)| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["fields"]["message"] == "cycle")
        .collect();
    let figures = OutageFigures {
        cycles: during.len(),
        rows_fetched: during
            .iter()
            .map(|v| v["fields"]["fetched"].as_u64().unwrap_or(0) as usize)
            .sum(),
        first_publish_after,
    };
    eprintln!(
        "10 s {} outage, 3 loops, until_drained={until_drained}: {figures:?}",
        if redis { "Redis" } else { "NATS" }
    );
    sink.delete().await;
    stream.delete().await;
    db.drop_schema().await;
    figures
}

/// Issue 14's targets, from outside the process: during the outage at most 10 % of the
/// ancestor's row updates (46,060 with 3 relays; each fetched row is written twice, leased and
/// released), and the first publish within 1 s of NATS accepting connections again.
async fn check_outage(until_drained: bool, redis: bool) {
    let f = broker_outage_10s(until_drained, redis).await;
    assert!(f.cycles <= 3 * 5, "{f:?}");
    assert!(f.rows_fetched * 2 * 10 <= 46_060, "{f:?}");
    assert!(f.first_publish_after < Duration::from_secs(1), "{f:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_backs_off_and_the_reconnect_wakes_the_relays() {
    check_outage(false, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_outage_backs_off_and_the_reconnect_wakes_the_relays_until_drained() {
    check_outage(true, false).await;
}

/// Redis has no connection events: the loops probe it with PING every 250 ms while they wait.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_backs_off_and_the_probe_wakes_the_relays() {
    check_outage(false, true).await;
}

/// Where the relay publishes in the outage tests.
enum Sink<'a> {
    Nats(&'a Stream),
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    Redis {
        url: String,
        key: String,
    },
}

impl Sink<'_> {
    #[cfg(feature = "redis")]
    fn redis() -> Self {
        let url = std::env::var("OUTBOX_TEST_REDIS_URL")
            .unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        Sink::Redis {
            url,
            // The stream of the topic `outage` (the pattern passed is `outboxt:<suffix>:{topic}`).
            key: format!("outboxt:{}:outage", common::suffix()),
        }
    }

    #[cfg(not(feature = "redis"))]
    fn redis() -> Self {
        unreachable!("Redis outage tests need the redis feature")
    }

    /// The real server's `host:port`.
    fn target(&self) -> String {
        match self {
            Sink::Nats(_) => nats_url().trim_start_matches("nats://").to_owned(),
            Sink::Redis { url, .. } => url
                .trim_start_matches("redis://")
                .trim_end_matches('/')
                .to_owned(),
        }
    }

    async fn count(&self) -> u64 {
        match self {
            Sink::Nats(s) => s.count().await,
            Sink::Redis { .. } => self.messages().await.len() as u64,
        }
    }

    async fn messages(&self) -> Vec<(uuid::Uuid, String)> {
        match self {
            Sink::Nats(s) => s.messages().await,
            #[cfg(feature = "redis")]
            Sink::Redis { url, key } => {
                let client = redis::Client::open(url.as_str()).expect("redis URL");
                let mut c = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("Redis must be reachable at OUTBOX_TEST_REDIS_URL");
                let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
                    .arg(key)
                    .arg("-")
                    .arg("+")
                    .query_async(&mut c)
                    .await
                    .expect("XRANGE");
                entries
                    .into_iter()
                    .map(|(_, fields)| {
                        let get = |k: &str| {
                            fields
                                .iter()
                                .find(|(f, _)| f == k)
                                .map(|(_, v)| v.clone())
                                .unwrap_or_default()
                        };
                        (get("event_id").parse().expect("uuid"), get("partition_key"))
                    })
                    .collect()
            }
            #[cfg(not(feature = "redis"))]
            Sink::Redis { .. } => unreachable!(),
        }
    }

    async fn delete(&self) {
        #[cfg(feature = "redis")]
        if let Sink::Redis { url, key } = self {
            let client = redis::Client::open(url.as_str()).expect("redis URL");
            if let Ok(mut c) = client.get_multiplexed_async_connection().await {
                let _: Result<(), _> = redis::cmd("DEL").arg(key).query_async(&mut c).await;
            }
        }
    }
}
