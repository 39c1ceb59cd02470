//! Flags of `outbox-relay` that relay_nats.rs and ops.rs do not drive: `--store diesel` (run,
//! migrate and operator commands), `--broker redis`, `--loops`, `--max-connections`, `--log-json` /
//! `OUTBOX_LOG_JSON`, and `--metrics-addr`.
//!
//! Each test has its own schema (and Redis stream key). The relay runs with the `stdout`
//! broker where the test reads what was published from its stdout (one JSON line per event,
//! `attributes.event_id` and `partition_key`), and with the `noop` broker where only the table,
//! the logs or the metrics are checked.

mod common;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{Db, check_order, command, stderr_lines, wait};
use uuid::Uuid;

const TOPIC: &str = "flags";

/// `run` on the test's table with small batches and a short poll, then `extra`.
fn run_args(db: &Db, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
        "run",
        "--table",
        &db.table_arg(),
        "--batch-size",
        "20",
        "--publish-concurrency",
        "4",
        "--poll-interval",
        "200ms",
    ]
    .map(String::from)
    .to_vec();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The events the `stdout` broker printed, in print order: (event id, partition key).
fn stdout_events(stdout: &str) -> Vec<(Uuid, String)> {
    stdout
        .lines()
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("stdout line {l:?}: {e}"));
            assert_eq!(v["topic"], TOPIC, "{l}");
            let id = v["attributes"]["event_id"]
                .as_str()
                .unwrap_or_else(|| panic!("no attributes.event_id in {l}"))
                .parse()
                .expect("uuid");
            let key = v["partition_key"]
                .as_str()
                .unwrap_or_else(|| panic!("no partition_key in {l}"))
                .to_owned();
            (id, key)
        })
        .collect()
}

fn total(written: &HashMap<String, Vec<Uuid>>) -> usize {
    written.values().map(Vec::len).sum()
}

async fn completed(db: &Db) -> usize {
    db.scalar_i64("SELECT count(*) FROM {t} WHERE status = 'completed'")
        .await as usize
}

/// Runs `run --until-drained` with the `stdout` broker and `extra`, checks exit 0 and returns
/// its output.
async fn drain_to_stdout(db: &Db, extra: &[&str]) -> common::Out {
    let mut a = vec![
        "--broker",
        "stdout",
        "--until-drained",
        "--summary-interval",
        "0",
    ];
    a.extend_from_slice(extra);
    let child = command(&strs(&run_args(db, &a)))
        .spawn()
        .expect("spawn outbox-relay");
    let out = wait(child, Duration::from_secs(120)).await;
    assert_eq!(out.code, 0, "run: {}", out.stderr);
    out
}

/// The published count of the final log line `relay stopped published=N` (text logs).
fn published_in_log(stderr: &str) -> usize {
    stderr
        .lines()
        .filter(|l| l.contains("relay stopped"))
        .find_map(|l| l.split("published=").nth(1))
        .and_then(|n| n.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no final count in the log: {stderr}"))
}

/// A `--until-drained` run with the stdout broker published every written event exactly once,
/// in per-key write order, completed every row, and logged the same count when it stopped.
async fn assert_drained_once_in_order(
    db: &Db,
    written: &HashMap<String, Vec<Uuid>>,
    out: &common::Out,
) {
    let n = total(written);
    let got = stdout_events(&out.stdout);
    assert_eq!(
        check_order(written, &got),
        0,
        "an event was published twice"
    );
    assert_eq!(got.len(), n);
    assert_eq!(completed(db).await, n, "every row completed");
    assert_eq!(published_in_log(&out.stderr), n);
}

/// Sends SIGTERM to the child.
fn sigterm(child: &tokio::process::Child) {
    let pid = child.id().expect("the relay is running");
    let st = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(st.success(), "kill -TERM {pid}");
}

#[cfg(feature = "diesel")]
#[tokio::test(flavor = "multi_thread")]
async fn diesel_store_migrates_drains_in_key_order_and_runs_the_operator_commands() {
    use common::relay;
    let db = Db::fresh().await;
    let table = db.table_arg();
    // migrate --store diesel creates the table (through outbox-diesel's migrations), and again
    // changes nothing.
    for _ in 0..2 {
        let out = relay(&["migrate", "--store", "diesel", "--table", &table]).await;
        assert_eq!(out.code, 0, "migrate --store diesel: {}", out.stderr);
        assert!(out.stdout.contains("is ready"), "{}", out.stdout);
    }
    let exists: bool = sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL")
        .bind(&table)
        .fetch_one(&db.pool)
        .await
        .expect("to_regclass");
    assert!(exists, "migrate --store diesel created no table {table}");

    let written = db.write_events(TOPIC, 25, 12, 20).await;
    let n = total(&written);
    let out = drain_to_stdout(&db, &["--store", "diesel"]).await;
    assert!(
        out.stderr.contains("store=Diesel"),
        "the relay did not run on the diesel store: {}",
        out.stderr
    );
    assert_drained_once_in_order(&db, &written, &out).await;

    // stats --store diesel sees the drained table.
    let out = relay(&["stats", "--store", "diesel", "--json", "--table", &table]).await;
    assert_eq!(out.code, 0, "stats --store diesel: {}", out.stderr);
    let v: serde_json::Value = serde_json::from_str(&out.stdout).expect("stats JSON");
    assert_eq!(v["completed"], n, "{v}");
    assert_eq!(v["pending"], 0, "{v}");
    assert_eq!(v["failed"], 0, "{v}");
    assert_eq!(v["blocked_keys"], 0, "{v}");

    // The rows of key-3 as if their publishes had failed for good; requeue-failed --key on the
    // diesel store moves exactly those back to pending.
    let failed = db
        .exec(
            "UPDATE {t} SET status = 'failed', completed_at = NULL, attempts_made = max_attempts, \
             last_error = 'test: refused' WHERE partition_key = 'key-3'",
        )
        .await as usize;
    assert_eq!(failed, written["key-3"].len());
    let requeue_key_3 = [
        "requeue-failed",
        "--store",
        "diesel",
        "--key",
        "key-3",
        "--table",
        &table,
    ];
    let out = relay(&requeue_key_3).await;
    assert_eq!(out.code, 0, "requeue-failed --store diesel: {}", out.stderr);
    assert!(
        out.stdout
            .contains(&format!("requeued {failed} failed rows for key \"key-3\"")),
        "{}",
        out.stdout
    );
    assert_eq!(
        db.scalar_i64(
            "SELECT count(*) FROM {t} WHERE partition_key = 'key-3' AND status = 'pending' \
             AND attempts_made = 0 AND last_error IS NULL"
        )
        .await as usize,
        failed
    );
    assert_eq!(
        db.scalar_i64("SELECT count(*) FROM {t} WHERE status <> 'completed'")
            .await as usize,
        failed,
        "only key-3's rows were requeued"
    );
    // Nothing failed is left for that key: refused (exit 1), nothing changed.
    let before = db.digest().await;
    let out = relay(&requeue_key_3).await;
    assert_eq!(out.code, 1, "{}", out.stderr);
    assert!(out.stderr.contains("no failed rows"), "{}", out.stderr);
    assert_eq!(db.digest().await, before);

    // A second drain on the diesel store publishes exactly the requeued rows, in key order.
    let out = drain_to_stdout(&db, &["--store", "diesel"]).await;
    let again = stdout_events(&out.stdout);
    let only_key3: HashMap<String, Vec<Uuid>> =
        HashMap::from([("key-3".to_owned(), written["key-3"].clone())]);
    assert_eq!(check_order(&only_key3, &again), 0);
    assert_eq!(completed(&db).await, n);
    db.drop_schema().await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread")]
async fn redis_broker_stream_holds_every_event_once_in_key_order() {
    let db = Db::fresh().await;
    db.migrate().await;
    let redis_url =
        std::env::var("OUTBOX_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let prefix = format!("relayt:{}:", common::suffix());
    let pattern = format!("{prefix}{{topic}}");
    let stream = format!("{prefix}{TOPIC}");
    let written = db.write_events(TOPIC, 20, 15, 25).await;
    let n = total(&written);

    let child = command(&strs(&run_args(
        &db,
        &[
            "--broker",
            "redis",
            "--redis-url",
            &redis_url,
            "--redis-key-pattern",
            &pattern,
            "--until-drained",
            "--summary-interval",
            "0",
        ],
    )))
    .spawn()
    .expect("spawn");
    let out = wait(child, Duration::from_secs(120)).await;

    let client = redis::Client::open(redis_url.as_str()).expect("redis URL");
    let mut conn = client.get_multiplexed_async_connection().await.expect(
        "Redis must be reachable at OUTBOX_TEST_REDIS_URL (default redis://127.0.0.1:6379)",
    );
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(&stream)
        .arg("-")
        .arg("+")
        .query_async(&mut conn)
        .await
        .expect("XRANGE");
    let _: () = redis::cmd("DEL")
        .arg(&stream)
        .query_async(&mut conn)
        .await
        .expect("DEL");

    assert_eq!(out.code, 0, "run --broker redis: {}", out.stderr);
    assert!(
        out.stdout.is_empty(),
        "the redis broker printed: {}",
        out.stdout
    );
    let got: Vec<(Uuid, String)> = entries
        .iter()
        .map(|(_, fields)| {
            let f: HashMap<&str, &str> = fields
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            assert_eq!(f.get("topic"), Some(&TOPIC), "{fields:?}");
            (
                f["event_id"].parse().expect("uuid"),
                f["partition_key"].to_owned(),
            )
        })
        .collect();
    assert_eq!(check_order(&written, &got), 0, "an event was added twice");
    assert_eq!(got.len(), n);
    assert_eq!(completed(&db).await, n, "every row completed");
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn three_loops_in_one_process_publish_every_event_once_in_key_order() {
    let db = Db::fresh().await;
    db.migrate().await;
    let written = db.write_events(TOPIC, 30, 10, 30).await;
    let out = drain_to_stdout(&db, &["--loops", "3", "--worker-id", "lp"]).await;
    assert_drained_once_in_order(&db, &written, &out).await;
    // Three loops ran, each under its own worker id, and each saw the table drained.
    for i in 1..=3 {
        let id = format!("worker=lp-{i}");
        assert!(
            out.stderr
                .lines()
                .any(|l| l.contains("drained: nothing due or held") && l.contains(&id)),
            "loop {id} did not report the drain: {}",
            out.stderr
        );
    }
    assert!(
        !out.stderr.contains("worker=lp "),
        "a loop ran under the bare id: {}",
        out.stderr
    );
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pool_of_the_loops_and_listen_drains_every_event_once_and_a_smaller_one_is_refused() {
    let db = Db::fresh().await;
    db.migrate().await;
    let written = db.write_events(TOPIC, 30, 10, 30).await;
    // Refused before anything connects: exit 2, nothing published.
    let child = command(&strs(&run_args(
        &db,
        &[
            "--broker",
            "stdout",
            "--loops",
            "2",
            "--max-connections",
            "2",
        ],
    )))
    .spawn()
    .expect("spawn outbox-relay");
    let out = wait(child, Duration::from_secs(30)).await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(
        out.stderr.contains("--max-connections 2 is below 3"),
        "{}",
        out.stderr
    );
    assert!(out.stdout.is_empty(), "published: {}", out.stdout);
    assert_eq!(completed(&db).await, 0);
    // Two loops sharing two connections besides LISTEN's.
    let out = drain_to_stdout(&db, &["--loops", "2", "--max-connections", "3"]).await;
    assert_drained_once_in_order(&db, &written, &out).await;
    db.drop_schema().await;
}

/// Parses a JSON log line and checks its shape: an object with a level and `fields.message`.
fn json_line(l: &str) -> serde_json::Value {
    let v: serde_json::Value =
        serde_json::from_str(l).unwrap_or_else(|e| panic!("log line is not JSON ({e}): {l}"));
    assert!(v.is_object(), "log line is not a JSON object: {l}");
    assert!(
        matches!(
            v["level"].as_str(),
            Some("TRACE" | "DEBUG" | "INFO" | "WARN" | "ERROR")
        ),
        "no level in {l}"
    );
    assert!(v["fields"]["message"].is_string(), "no message in {l}");
    v
}

fn message(v: &serde_json::Value) -> &str {
    v["fields"]["message"].as_str().unwrap_or("")
}

/// `run` with JSON logs (by `how`: the flag, or the environment variable) until the summary
/// reports an empty backlog, then SIGTERM: every stderr line is a JSON object with a level and
/// a message; the summary, the per-cycle debug line (in the `outbox.cycle` span, with its
/// fields) and the final count are among them and agree with the table.
async fn json_logs(how: &str) {
    let db = Db::fresh().await;
    db.migrate().await;
    let written = db.write_events(TOPIC, 10, 12, 20).await;
    let n = total(&written);
    // The summary every 100 ms.
    let mut extra = vec![
        "--broker",
        "noop",
        "--worker-id",
        "js",
        "--summary-interval",
        "100ms",
    ];
    if how == "flag" {
        extra.push("--log-json");
    }
    let mut cmd = command(&strs(&run_args(&db, &extra)));
    cmd.env("RUST_LOG", "info,txoutbox_core::relay=debug")
        .stdout(Stdio::null());
    match how {
        "flag" => cmd.env_remove("OUTBOX_LOG_JSON"),
        _ => cmd.env("OUTBOX_LOG_JSON", "true"),
    };
    let mut child = cmd.spawn().expect("spawn");
    let mut rx = stderr_lines(&mut child);
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    // Until a summary reports the backlog empty (every row completed).
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let l = tokio::time::timeout(left, rx.recv())
            .await
            .unwrap_or_else(|_| panic!("no summary with backlog 0 within 60 s: {lines:#?}"))
            .unwrap_or_else(|| panic!("the relay exited early: {lines:#?}"));
        let v = json_line(&l);
        lines.push(l);
        if message(&v).starts_with("summary:") && message(&v).contains("backlog 0,") {
            break;
        }
    }
    sigterm(&child);
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("the relay did not stop within 30 s of SIGTERM")
        .expect("wait");
    while let Some(l) = rx.recv().await {
        lines.push(l);
    }
    assert_eq!(status.code(), Some(0), "exit after SIGTERM: {lines:#?}");
    assert_eq!(completed(&db).await, n);

    let logs: Vec<serde_json::Value> = lines.iter().map(|l| json_line(l)).collect();
    let find = |m: &str| {
        logs.iter()
            .find(|v| message(v) == m)
            .unwrap_or_else(|| panic!("no JSON line {m:?}: {lines:#?}"))
    };
    let started = find("relay started");
    assert_eq!(started["level"], "INFO");
    assert!(
        started["fields"]["workers"]
            .as_str()
            .unwrap_or("")
            .contains("js"),
        "{started}"
    );
    let stopped = find("relay stopped");
    assert_eq!(stopped["fields"]["published"], n, "{stopped}");
    assert!(
        logs.iter().any(|v| message(v).contains("signal received")),
        "{lines:#?}"
    );
    // The per-cycle lines: in the cycle's span, with the worker id; their completed counts add
    // up to the rows published.
    let cycles: Vec<&serde_json::Value> = logs.iter().filter(|v| message(v) == "cycle").collect();
    assert!(!cycles.is_empty(), "no cycle lines: {lines:#?}");
    let mut sum = 0;
    for c in &cycles {
        assert_eq!(c["level"], "DEBUG", "{c}");
        assert_eq!(c["span"]["name"], "outbox.cycle", "{c}");
        assert_eq!(c["span"]["worker.id"], "js", "{c}");
        sum += c["fields"]["completed"].as_u64().expect("completed") as usize;
    }
    assert_eq!(sum, n, "the cycles' completed counts add up to the rows");
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn log_json_flag_writes_every_stderr_line_as_json() {
    json_logs("flag").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn outbox_log_json_env_writes_every_stderr_line_as_json() {
    json_logs("env").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn without_log_json_the_logs_are_text() {
    let db = Db::fresh().await;
    db.migrate().await;
    db.write_events(TOPIC, 3, 3, 9).await;
    let mut cmd = command(&strs(&run_args(
        &db,
        &[
            "--broker",
            "noop",
            "--until-drained",
            "--summary-interval",
            "0",
        ],
    )));
    cmd.env("OUTBOX_LOG_JSON", "false");
    let out = wait(cmd.spawn().expect("spawn"), Duration::from_secs(60)).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_eq!(published_in_log(&out.stderr), 9);
    assert!(
        out.stderr
            .lines()
            .all(|l| serde_json::from_str::<serde_json::Value>(l).is_err()),
        "JSON lines with OUTBOX_LOG_JSON=false: {}",
        out.stderr
    );
    db.drop_schema().await;
}

/// One sample of a Prometheus text exposition: name, labels, value.
#[cfg(feature = "prometheus")]
#[derive(Debug)]
struct Sample {
    name: String,
    labels: HashMap<String, String>,
    value: f64,
}

#[cfg(feature = "prometheus")]
fn parse_exposition(body: &str) -> Vec<Sample> {
    body.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (head, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("sample {l:?}"));
            let (name, labels) = match head.split_once('{') {
                None => (head.to_owned(), HashMap::new()),
                Some((name, rest)) => {
                    let rest = rest.strip_suffix('}').expect("closing brace");
                    let labels = rest
                        .split(',')
                        .filter(|p| !p.is_empty())
                        .map(|p| {
                            let (k, v) = p.split_once('=').expect("label");
                            (k.to_owned(), v.trim_matches('"').to_owned())
                        })
                        .collect();
                    (name.to_owned(), labels)
                }
            };
            Sample {
                name,
                labels,
                value: value
                    .parse()
                    .unwrap_or_else(|e| panic!("value in {l:?}: {e}")),
            }
        })
        .collect()
}

/// GET /metrics over plain HTTP/1.0; None while nothing listens.
#[cfg(feature = "prometheus")]
async fn scrape(addr: std::net::SocketAddr) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .ok()?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.ok()?;
    let text = String::from_utf8(buf).expect("UTF-8 response");
    let (head, body) = text.split_once("\r\n\r\n").expect("HTTP response");
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    Some(body.to_owned())
}

#[cfg(feature = "prometheus")]
#[tokio::test(flavor = "multi_thread")]
async fn metrics_addr_serves_the_metrics_while_running_and_sigterm_exits_0() {
    let db = Db::fresh().await;
    db.migrate().await;
    let written = db.write_events(TOPIC, 20, 10, 25).await;
    let n = total(&written);
    // A free port: bound, read, released.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port");
    let addr_s = addr.to_string();
    // The summary line off: the backlog gauges must still be updated (every 10 s).
    let mut cmd = command(&strs(&run_args(
        &db,
        &[
            "--broker",
            "noop",
            "--metrics-addr",
            &addr_s,
            "--summary-interval",
            "0",
        ],
    )));
    let child = cmd.spawn().expect("spawn");

    // Scrape until every row is counted as published and a backlog update after the drain set
    // the pending gauge to 0.
    let deadline = Instant::now() + Duration::from_secs(60);
    let outcomes = "outbox_publish_outcomes_total";
    let samples = loop {
        if let Some(body) = scrape(addr).await {
            let s = parse_exposition(&body);
            let published: f64 = s
                .iter()
                .filter(|x| x.name == outcomes && x.labels["outcome"] == "published")
                .map(|x| x.value)
                .sum();
            let pending = s.iter().find(|x| x.name == "outbox_pending_events");
            if published as usize == n && pending.is_some_and(|b| b.value == 0.0) {
                break s;
            }
            assert!(published as usize <= n, "more publishes than rows: {body}");
        }
        assert!(
            Instant::now() < deadline,
            "the metrics did not show {n} published rows and no pending row within 60 s (last: {:?})",
            scrape(addr).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let one = |name: &str| -> &Sample {
        let v: Vec<&Sample> = samples.iter().filter(|x| x.name == name).collect();
        assert_eq!(v.len(), 1, "{name}: {v:?}");
        v[0]
    };
    // Every publish succeeded: one outcome series, `published`, with no other label.
    let outs: Vec<&Sample> = samples.iter().filter(|x| x.name == outcomes).collect();
    assert_eq!(outs.len(), 1, "{outs:?}");
    assert_eq!(outs[0].labels.len(), 1, "{outs:?}");
    assert_eq!(outs[0].value as usize, n);
    // The histograms: one observation per completed publish, with the binary's buckets.
    for h in [
        "outbox_publish_duration_seconds",
        "outbox_write_to_ack_seconds",
    ] {
        assert_eq!(one(&format!("{h}_count")).value as usize, n, "{h}");
        assert!(one(&format!("{h}_sum")).value >= 0.0, "{h}");
        let buckets: Vec<&Sample> = samples
            .iter()
            .filter(|x| x.name == format!("{h}_bucket"))
            .collect();
        assert_eq!(buckets.len(), 18, "{h}: 17 buckets and +Inf: {buckets:?}");
        let inf = buckets
            .iter()
            .find(|b| b.labels["le"] == "+Inf")
            .unwrap_or_else(|| panic!("{h}: no +Inf bucket"));
        assert_eq!(inf.value as usize, n, "{h}");
    }
    // The contract's series (R70): every row counted with status success.
    let pubs: Vec<&Sample> = samples
        .iter()
        .filter(|x| x.name == "outbox_events_published_total")
        .collect();
    assert_eq!(pubs.len(), 1, "{pubs:?}");
    assert_eq!(pubs[0].labels["event_type"], "test.event");
    assert_eq!(pubs[0].labels["status"], "success");
    assert_eq!(pubs[0].value as usize, n);
    let count = one("outbox_handler_duration_seconds_count");
    assert_eq!(count.labels["event_type"], "test.event");
    assert_eq!(count.value as usize, n);
    let batch = one("outbox_locked_batch_size").value;
    assert!((0.0..=20.0).contains(&batch), "locked batch size {batch}");
    // The backlog gauges.
    assert_eq!(one("outbox_pending_events").value, 0.0);
    assert_eq!(one("outbox_blocked_keys").value, 0.0);
    assert_eq!(one("outbox_oldest_due_age_seconds").value, 0.0);
    assert_eq!(completed(&db).await, n);

    sigterm(&child);
    let out = wait(child, Duration::from_secs(30)).await;
    assert_eq!(out.code, 0, "exit after SIGTERM: {}", out.stderr);
    assert_eq!(published_in_log(&out.stderr), n);
    db.drop_schema().await;
}
