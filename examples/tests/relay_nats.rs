//! The `outbox-relay` binary against PostgreSQL and NATS JetStream: a relay killed with
//! SIGKILL mid-drain and started again, and two relay processes draining one table.
//!
//! Each test has its own schema and stream. A core NATS subscription on the test's subject
//! prefix sees every publish as it happens (duplicates included, which the stream's Msg-Id
//! window drops); a sentinel published by the test after the relays exited marks the end of
//! what they sent.

mod common;

use std::collections::HashSet;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::{Db, Stream, check_order, command, nats_url, wait};
use futures::StreamExt;
use uuid::Uuid;

const TOPIC: &str = "orders";

/// A core subscription on `prefix>`: every publish of the relays, in the order the server
/// routed them.
struct Tap {
    client: async_nats::Client,
    sub: async_nats::Subscriber,
    prefix: String,
    seen: Vec<(Uuid, String)>,
}

impl Tap {
    async fn new(prefix: &str) -> Self {
        let client = async_nats::connect(nats_url()).await.expect("NATS");
        let sub = client
            .subscribe(format!("{prefix}>"))
            .await
            .expect("subscribe");
        client.flush().await.expect("flush");
        Self {
            client,
            sub,
            prefix: prefix.to_owned(),
            seen: Vec::new(),
        }
    }

    fn record(&mut self, m: async_nats::Message) -> bool {
        if m.subject.as_str() == format!("{}sentinel", self.prefix) {
            return true;
        }
        let h = m.headers.expect("headers");
        let id = h
            .get("event_id")
            .expect("event_id")
            .as_str()
            .parse()
            .expect("uuid");
        let key = h.get("partition_key").expect("key").as_str().to_owned();
        self.seen.push((id, key));
        false
    }

    /// Receives until `n` messages were seen.
    async fn until(&mut self, n: usize) {
        let within = Duration::from_secs(60);
        tokio::time::timeout(within, async {
            while self.seen.len() < n {
                let m = self.sub.next().await.expect("subscription open");
                self.record(m);
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "only {} of {n} publishes within {within:?}",
                self.seen.len()
            )
        });
    }

    /// Receives everything sent before now: publishes a sentinel (not stored by the stream) and
    /// reads up to it.
    async fn finish(&mut self) {
        self.client
            .publish(format!("{}sentinel", self.prefix), "end".into())
            .await
            .expect("sentinel");
        self.client.flush().await.expect("flush");
        tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                let m = self.sub.next().await.expect("subscription open");
                if self.record(m) {
                    return;
                }
            }
        })
        .await
        .expect("the sentinel did not come back");
    }
}

fn run_args(db: &Db, st: &Stream, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec!["run".into(), "--table".into(), db.table_arg()];
    v.extend(st.args());
    v.extend(
        [
            "--batch-size",
            "20",
            "--publish-concurrency",
            "4",
            "--lease",
            "2s",
            "--publish-timeout",
            "1s",
            "--broker-timeout",
            "900ms",
            "--poll-interval",
            "200ms",
            "--summary-interval",
            "0",
        ]
        .map(String::from),
    );
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn kill_9_mid_drain_then_restart_delivers_every_event_in_key_order() {
    kill_9_then_restart("lease").await;
}

/// In transaction delivery the killed relay's rows are free as soon as PostgreSQL notices the
/// dead connection: the second relay runs with a 600 s lease, so a row that waited for any
/// lease would not be drained within the test's 120 s.
#[tokio::test(flavor = "multi_thread")]
async fn kill_9_mid_drain_in_transaction_delivery_frees_the_rows_at_once() {
    kill_9_then_restart("transaction").await;
}

async fn kill_9_then_restart(mode: &str) {
    let db = Db::fresh().await;
    db.migrate().await;
    let st = Stream::fresh().await;
    // The stream covers the topic's subject only, so the sentinel is not stored; a duplicate
    // window of 10 min, far longer than the test.
    st.js
        .create_stream(async_nats::jetstream::stream::Config {
            name: st.name.clone(),
            subjects: vec![format!("{}{TOPIC}", st.prefix)],
            duplicate_window: Duration::from_secs(600),
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("stream");
    let written = db.write_events(TOPIC, 40, 60, 25).await;
    let total: usize = written.values().map(Vec::len).sum();
    let mut tap = Tap::new(&st.prefix).await;

    let first = command(&strs(&run_args(
        &db,
        &st,
        &["--worker-id", "relay-a", "--delivery", mode],
    )))
    .spawn()
    .expect("spawn");
    tap.until(total / 5).await;
    let mut first = first;
    first.start_kill().expect("SIGKILL");
    let status = first.wait().await.expect("wait");
    assert_eq!(status.signal(), Some(9), "the relay died of SIGKILL");

    let completed = db
        .scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
        .await as usize;
    assert!(
        completed < total,
        "the kill came after the drain ({completed} of {total} completed): nothing was tested"
    );
    // Rows the dead relay held: the only ones it may have published without a record.
    let held: HashSet<Uuid> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {} WHERE status = 'pending' AND locked_by = 'relay-a'",
        db.table.qualified()
    )))
    .fetch_all(&db.pool)
    .await
    .expect("held")
    .into_iter()
    .collect();

    let mut args = run_args(
        &db,
        &st,
        &[
            "--worker-id",
            "relay-b",
            "--until-drained",
            "--delivery",
            mode,
        ],
    );
    if mode == "transaction" {
        // Nothing of the dead relay is leased: no row may need a lease to expire.
        assert!(held.is_empty(), "transaction delivery stamps no lease");
        let at = args.iter().position(|a| a == "--lease").expect("--lease");
        args[at + 1] = "600s".into();
    }
    let started = std::time::Instant::now();
    let second = command(&strs(&args)).spawn().expect("spawn");
    let out = wait(second, Duration::from_secs(120)).await;
    let drain_secs = started.elapsed().as_secs_f64();
    assert_eq!(out.code, 0, "restarted relay: {}", out.stderr);
    tap.finish().await;

    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
            .await as usize,
        total,
        "every row completed"
    );
    // Every publish the server saw: every event, per key in write order of first arrival;
    // a repeat only of a row the dead relay held.
    let repeats = check_order(&written, &tap.seen);
    let mut once = HashSet::new();
    let mut twice = 0;
    for (id, _) in &tap.seen {
        if !once.insert(*id) {
            twice += 1;
            // Lease delivery: only a row the dead relay held. Transaction delivery: only rows
            // of the one cycle it had open (at most a batch, 20).
            assert!(
                held.contains(id) || mode == "transaction",
                "event {id} was published twice but was not held by the killed relay"
            );
        }
    }
    assert!(
        twice <= 20,
        "{twice} repeats: more than one open cycle's rows"
    );
    // The stream dropped the repeats (Nats-Msg-Id = event id): each event stored once.
    let stored = st.messages().await;
    assert_eq!(stored.len(), total, "stream holds each event once");
    assert_eq!(check_order(&written, &stored), 0);
    eprintln!(
        "{mode}: kill -9 after {completed}/{total} completed, {} held; {repeats} publishes repeated, all dropped by the stream; restarted relay drained in {drain_secs:.1} s",
        held.len()
    );
    st.delete().await;
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_until_drained_publish_every_event_once_in_key_order() {
    two_processes("lease").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn two_processes_in_transaction_delivery_publish_every_event_once_in_key_order() {
    two_processes("transaction").await;
}

async fn two_processes(mode: &str) {
    let db = Db::fresh().await;
    db.migrate().await;
    let st = Stream::fresh().await;
    st.js
        .create_stream(async_nats::jetstream::stream::Config {
            name: st.name.clone(),
            subjects: vec![format!("{}{TOPIC}", st.prefix)],
            storage: async_nats::jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("stream");
    let written = db.write_events(TOPIC, 30, 80, 40).await;
    let total: usize = written.values().map(Vec::len).sum();
    let mut tap = Tap::new(&st.prefix).await;

    let a = command(&strs(&run_args(
        &db,
        &st,
        &[
            "--worker-id",
            "proc-a",
            "--until-drained",
            "--delivery",
            mode,
        ],
    )))
    .spawn()
    .expect("spawn a");
    let b = command(&strs(&run_args(
        &db,
        &st,
        &[
            "--worker-id",
            "proc-b",
            "--until-drained",
            "--delivery",
            mode,
        ],
    )))
    .spawn()
    .expect("spawn b");
    let (oa, ob) = tokio::join!(
        wait(a, Duration::from_secs(120)),
        wait(b, Duration::from_secs(120))
    );
    assert_eq!(oa.code, 0, "process a: {}", oa.stderr);
    assert_eq!(ob.code, 0, "process b: {}", ob.stderr);
    tap.finish().await;

    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
            .await as usize,
        total
    );
    // Every publish the server saw, from both processes: each event exactly once, per key in
    // write order.
    assert_eq!(
        check_order(&written, &tap.seen),
        0,
        "an event was published twice"
    );
    assert_eq!(tap.seen.len(), total);
    // Each process's own count of completed rows adds up to the total.
    let published = |s: &str| -> usize {
        s.lines()
            .filter(|l| l.contains("relay stopped"))
            .find_map(|l| l.split("published=").nth(1))
            .and_then(|n| n.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no final count in the log: {s}"))
    };
    let (na, nb) = (published(&oa.stderr), published(&ob.stderr));
    assert_eq!(na + nb, total, "a published {na}, b {nb}");
    eprintln!("{mode}: process a published {na}, process b {nb}");
    st.delete().await;
    db.drop_schema().await;
}
