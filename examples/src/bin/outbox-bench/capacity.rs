//! Sustained capacity: writers in this process commit events at a fixed rate while
//! relays deliver them, the way a production service loads the relay, instead of draining a
//! preloaded table.
//!
//! One run (`outbox-bench run --mode capacity --rate R …`): a fresh table (the schema creation
//! of the store, autovacuum on, as `migrate` leaves it); `--writers` tasks commit transactions
//! of `--per-tx` events (10 events per key, `--per-key`) on a schedule that adds up to `--rate`
//! events/s, for `--warmup-s` and then the measured `--window-s`; `--relays` relay loops
//! (`Relay::run`, woken by LISTEN/NOTIFY: the writers notify) on a runtime of their own
//! (`--relay-threads` threads), so their CPU time is theirs alone. After the window the writers
//! stop and the relays drain what is left. Reported:
//!
//! * the achieved write rate (rows created in the window / window) and the delivered rate
//!   (broker acknowledgements in the window / window);
//! * the backlog at the end of the window (rows not completed, from the table);
//! * commit-to-acknowledgement latency of the rows written in the window: from the row's
//!   created_at (the writer's insert, just before its commit) to the broker's answer to the
//!   relay's publish (recorded by a broker decorator: the ack time, not a relay counter),
//!   p50/p95/p99/max; a row not acknowledged by the end of the drain counts as the drain's
//!   end;
//! * the drain time after the writers stop, and the relay runtime's CPU seconds per 1,000
//!   events delivered;
//! * `sustained`: the write rate met within 2 %, the backlog at the end at most one second of
//!   writes, and p99 ≤ 1 s.
//!
//! `outbox-bench capacity` searches the highest sustained rate for each delivery mode and
//! broker: rates doubled from `--start` until one is not sustained, then bisected.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use clap::Args;
use serde_json::{Value, json};
use sqlx::{AssertSqlSafe, Row};
use txoutbox_core::{Ack, Broker, BrokerError, CancellationToken, Message, NewEvent, Relay};
use txoutbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, WakeListener};
use uuid::Uuid;

use crate::suite::{child, load_avg};
use crate::{BenchError, RunArgs, Shape, StoreKind, brokers, db, round};

/// The options of one capacity run (part of `outbox-bench run`).
#[derive(Args, Debug, Clone)]
pub struct CapacityOpts {
    /// Capacity mode: events per second the writers commit, in total.
    #[arg(long, default_value_t = 1_000)]
    pub rate: u64,
    /// Capacity mode: writer tasks (each its own connection).
    #[arg(long, default_value_t = 8)]
    pub writers: usize,
    /// Capacity mode: events per writer transaction.
    #[arg(long, default_value_t = 5)]
    pub per_tx: usize,
    /// Capacity mode: events per key (a writer moves to a new key after this many).
    #[arg(long, default_value_t = 10)]
    pub per_key: usize,
    /// Capacity mode: seconds of writes before the measured window.
    #[arg(long, default_value_t = 5)]
    pub warmup_s: u64,
    /// Capacity mode: the measured window, seconds.
    #[arg(long, default_value_t = 20)]
    pub window_s: u64,
    /// Capacity mode: longest wait for the drain after the writers stop, seconds.
    #[arg(long, default_value_t = 120)]
    pub drain_timeout_s: u64,
    /// Capacity mode: worker threads of the relays' runtime.
    #[arg(long, default_value_t = 2)]
    pub relay_threads: usize,
}

/// A broker that records when the inner broker acknowledged each message.
struct AckLog {
    inner: Arc<dyn Broker>,
    acks: Mutex<HashMap<Uuid, SystemTime>>,
}

#[async_trait]
impl Broker for AckLog {
    async fn publish(&self, message: &Message) -> Result<Ack, BrokerError> {
        let r = self.inner.publish(message).await;
        if r.is_ok() {
            let now = SystemTime::now();
            if let Ok(mut m) = self.acks.lock() {
                m.entry(message.event_id).or_insert(now);
            }
        }
        r
    }

    fn messaging_system(&self) -> &'static str {
        self.inner.messaging_system()
    }

    fn destination_name(&self, message: &Message) -> String {
        self.inner.destination_name(message)
    }
}

/// The relays' runtime, shut down without blocking when dropped (a runtime dropped inside
/// another one's task would panic).
struct RuntimeGuard(Option<tokio::runtime::Runtime>);

impl Drop for RuntimeGuard {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// CPU seconds (user + system) of this process's threads whose name starts with `prefix`.
fn thread_cpu_seconds(prefix: &str) -> f64 {
    let ticks = 100.0; // USER_HZ on Linux
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return f64::NAN;
    };
    let mut sum = 0.0;
    for t in dir.flatten() {
        let p = t.path();
        let name = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
        if !name.trim_end().starts_with(prefix) {
            continue;
        }
        let stat = std::fs::read_to_string(p.join("stat")).unwrap_or_default();
        // Fields after the command name in parentheses: utime is the 14th, stime the 15th.
        if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            let num = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
            sum += (num(11) + num(12)) / ticks;
        }
    }
    sum
}

fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    Some(sorted[i.min(sorted.len() - 1)])
}

/// One capacity run; returns its JSON fields.
pub async fn run(a: &RunArgs, tag: &str) -> Result<Value, BenchError> {
    if a.store != StoreKind::Sqlx {
        return Err(BenchError(
            "--mode capacity runs the sqlx store (its writer)".into(),
        ));
    }
    let o = &a.capacity;
    let url = a.conn.database_url.clone();
    let empty = Shape {
        events: 0,
        keys: 1,
        hot_events: 0,
    };
    let fresh = db::prepare(&url, tag, &empty, a.store, 2, db::Stats::Analyzed).await?;
    let table = fresh.table.clone();
    let q = table.qualified();
    sqlx::query(AssertSqlSafe(format!(
        "ALTER TABLE {q} RESET (autovacuum_enabled)"
    )))
    .execute(&fresh.pool)
    .await
    .map_err(|e| BenchError(format!("table settings: {e}")))?;

    // The relays, their pool, the wake listener and the broker client on a runtime of their own.
    let rt = RuntimeGuard(Some(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(o.relay_threads.max(1))
            .thread_name("relay-rt")
            .enable_all()
            .build()
            .map_err(|e| BenchError(format!("relay runtime: {e}")))?,
    ));
    let token = CancellationToken::new();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let relays_task = {
        let (a, token, url, table, tag) = (
            a.clone(),
            token.clone(),
            url.clone(),
            table.clone(),
            tag.to_owned(),
        );
        rt.0.as_ref().expect("the runtime runs").spawn(async move {
            let rb = brokers::open(a.broker, &a.conn, &tag).await?;
            let log = Arc::new(AckLog {
                inner: rb.broker.clone(),
                acks: Mutex::new(HashMap::new()),
            });
            let pool = db::pool(&url, a.relays as u32 + 1).await?;
            let repo = Arc::new(PgOutboxRepository::new(
                pool.clone(),
                PgConfig::default().table(table.clone()),
            ));
            let mut relays = Vec::new();
            for i in 0..a.relays {
                relays.push(Arc::new(
                    Relay::builder(repo.clone(), log.clone())
                        .worker_id(format!("cap-{i}"))
                        .batch_size(a.batch)
                        .max_per_key(a.max_per_key)
                        .publish_concurrency(a.publish_concurrency)
                        .delivery(a.delivery)
                        .build()
                        .map_err(|e| BenchError(format!("relay settings: {e}")))?,
                ));
            }
            let listener =
                WakeListener::spawn(&pool, &table, relays.iter().map(|r| r.waker()).collect())
                    .await
                    .map_err(|e| BenchError(format!("wake listener: {e}")))?;
            let _ = ready_tx.send(());
            let loops: Vec<_> = relays
                .iter()
                .map(|r| {
                    let (r, token) = (r.clone(), token.clone());
                    tokio::spawn(async move { r.run(token).await })
                })
                .collect();
            for l in loops {
                l.await
                    .map_err(|e| BenchError(format!("relay task: {e}")))?
                    .map_err(|e| BenchError(format!("relay loop: {e}")))?;
            }
            drop(listener);
            let stored = rb.stored().await;
            rb.close().await;
            let acks = std::mem::take(&mut *log.acks.lock().expect("ack log"));
            Ok::<_, BenchError>((acks, stored))
        })
    };
    ready_rx
        .await
        .map_err(|_| BenchError("the relays did not start".into()))?;

    // The writers, on this runtime.
    let writer_pool = db::pool(&url, o.writers as u32).await?;
    let writer = PgOutboxWriter::new(&table).notify(true);
    let per_writer = o.rate as f64 / o.writers as f64;
    let period = Duration::from_secs_f64(o.per_tx as f64 / per_writer.max(1e-9));
    let stop = Arc::new(AtomicBool::new(false));
    let written = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let total = Duration::from_secs(o.warmup_s + o.window_s);
    let mut writers = Vec::new();
    for w in 0..o.writers {
        let (pool, writer, stop, written) = (
            writer_pool.clone(),
            writer.clone(),
            stop.clone(),
            written.clone(),
        );
        let (per_tx, per_key, nw) = (o.per_tx, o.per_key.max(1), o.writers as f64);
        writers.push(tokio::spawn(async move {
            // Writers start spread over one period, so their commits interleave.
            let offset = period.mul_f64(w as f64 / nw);
            let mut n: usize = 0;
            let mut due = tokio::time::Instant::now() + offset;
            while !stop.load(Ordering::Relaxed) {
                tokio::time::sleep_until(due).await;
                due += period;
                if started.elapsed() >= total {
                    break;
                }
                let events = (0..per_tx)
                    .map(|i| {
                        let k = (n + i) / per_key;
                        NewEvent::builder()
                            .event_type("bench.capacity")
                            .aggregate("bench", Uuid::now_v7())
                            .topic("bench")
                            .partition_key(format!("w{w}-{k}"))
                            .payload_json(json!({ "seq": n + i, "note": "capacity" }))
                            .build()
                    })
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| BenchError(format!("event: {e}")))?;
                n += per_tx;
                let mut tx = pool
                    .begin()
                    .await
                    .map_err(|e| BenchError(format!("writer begin: {e}")))?;
                writer
                    .write(&mut tx, events)
                    .await
                    .map_err(|e| BenchError(format!("write: {e}")))?;
                tx.commit()
                    .await
                    .map_err(|e| BenchError(format!("writer commit: {e}")))?;
                written.fetch_add(per_tx as u64, Ordering::Relaxed);
            }
            Ok::<(), BenchError>(())
        }));
    }
    // The window: database times of its start and end (the rows' clock).
    tokio::time::sleep(Duration::from_secs(o.warmup_s)).await;
    let db_now = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT clock_timestamp()")
            .fetch_one(&fresh.pool)
            .await
            .map_err(|e| BenchError(format!("clock: {e}")))
    };
    let w0 = db_now().await?;
    let cpu0 = thread_cpu_seconds("relay-rt");
    tokio::time::sleep(Duration::from_secs(o.window_s)).await;
    let w1 = db_now().await?;
    let backlog_end: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {q} WHERE status <> 'completed'"
    )))
    .fetch_one(&fresh.pool)
    .await
    .map_err(|e| BenchError(format!("backlog: {e}")))?;
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await
            .map_err(|e| BenchError(format!("writer task: {e}")))??;
    }
    let writers_stopped = Instant::now();
    // The drain: until every row is completed, or the timeout.
    let deadline = writers_stopped + Duration::from_secs(o.drain_timeout_s);
    let mut left: i64;
    loop {
        left = fresh.not_completed().await?;
        if left == 0 || Instant::now() >= deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let drain_s = writers_stopped.elapsed().as_secs_f64();
    let cpu1 = thread_cpu_seconds("relay-rt");
    token.cancel();
    let (acks, stored) = relays_task
        .await
        .map_err(|e| BenchError(format!("relays: {e}")))??;
    drop(rt);

    // What the table says about the window.
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT id, created_at FROM {q} WHERE created_at >= $1 AND created_at < $2"
    )))
    .bind(w0)
    .bind(w1)
    .fetch_all(&fresh.pool)
    .await
    .map_err(|e| BenchError(format!("window rows: {e}")))?;
    fresh.drop().await;
    let window = (w1 - w0).num_microseconds().unwrap_or(0) as f64 / 1e6;
    let end = SystemTime::now();
    let mut lat: Vec<f64> = Vec::with_capacity(rows.len());
    let mut unacked = 0usize;
    for r in &rows {
        let id: Uuid = r.get(0);
        let created: chrono::DateTime<chrono::Utc> = r.get(1);
        let created = SystemTime::UNIX_EPOCH
            + Duration::from_micros(created.timestamp_micros().max(0) as u64);
        let at = acks.get(&id).copied().unwrap_or_else(|| {
            unacked += 1;
            end
        });
        lat.push(
            at.duration_since(created)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
        );
    }
    lat.sort_by(|a, b| a.total_cmp(b));
    let (w0s, w1s) = (
        SystemTime::UNIX_EPOCH + Duration::from_micros(w0.timestamp_micros() as u64),
        SystemTime::UNIX_EPOCH + Duration::from_micros(w1.timestamp_micros() as u64),
    );
    let acked_in_window = acks.values().filter(|t| **t >= w0s && **t < w1s).count();
    let write_rate = rows.len() as f64 / window;
    let delivered_rate = acked_in_window as f64 / window;
    let ms = |v: Option<f64>| v.map(|v| round(v * 1000.0, 1));
    let p99 = percentile(&lat, 0.99);
    let sustained = (write_rate - o.rate as f64).abs() <= 0.02 * o.rate as f64
        && (backlog_end as f64) <= o.rate as f64
        && p99.is_some_and(|p| p <= 1.0)
        && left == 0;
    let delivered_total = acks.len().max(1);
    Ok(json!({
        "rate": o.rate,
        "writers": o.writers,
        "per_tx": o.per_tx,
        "per_key": o.per_key,
        "warmup_s": o.warmup_s,
        "window_s": round(window, 3),
        "write_rate": round(write_rate, 0),
        "delivered_rate": round(delivered_rate, 0),
        "backlog_end": backlog_end,
        "latency_ms": {
            "p50": ms(percentile(&lat, 0.5)),
            "p95": ms(percentile(&lat, 0.95)),
            "p99": ms(p99),
            "max": ms(lat.last().copied()),
        },
        "unacked": unacked,
        "drain_s": round(drain_s, 3),
        "not_completed": left,
        "written": written.load(Ordering::Relaxed),
        "broker_stored": stored,
        "relay_cpu_s_per_1000": round((cpu1 - cpu0) / delivered_total as f64 * 1000.0, 4),
        "sustained": sustained,
        "load": load_avg(),
    }))
}

/// `outbox-bench capacity`: the search of the highest sustained rate.
#[derive(Args, Debug, Clone)]
pub struct SearchArgs {
    /// First rate tried (events/s); doubled until a rate is not sustained.
    #[arg(long, default_value_t = 1_000)]
    pub start: u64,
    /// Bisection steps after the first rate that is not sustained.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Highest rate tried.
    #[arg(long, default_value_t = 64_000)]
    pub max_rate: u64,
    /// Delivery modes searched.
    #[arg(long, value_delimiter = ',', default_value = "lease,transaction")]
    pub deliveries: Vec<String>,
    /// Brokers searched.
    #[arg(long, value_delimiter = ',', default_value = "noop,nats")]
    pub brokers: Vec<String>,
    /// Extra arguments of every run, one string: `--run-args="--relays 2 --window-s 20"`.
    #[arg(long, default_value = "--relays 2", allow_hyphen_values = true)]
    pub run_args: String,
    /// Append every JSON line to this file.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// A rate tried and its run.
type Tried = (u64, Value);

pub async fn search(a: SearchArgs) -> Result<(), BenchError> {
    let mut table = Vec::new();
    let mut file = match &a.out {
        Some(p) => Some(
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(p)
                .map_err(|e| BenchError(format!("{}: {e}", p.display())))?,
        ),
        None => None,
    };
    for delivery in &a.deliveries {
        for broker in &a.brokers {
            let mut try_rate = async |rate: u64| -> Result<Value, BenchError> {
                let args: Vec<String> = format!(
                    "--mode capacity --delivery {delivery} --broker {broker} --rate {rate} {}",
                    a.run_args
                )
                .split_whitespace()
                .map(str::to_owned)
                .collect();
                eprintln!(
                    "capacity: {delivery}, {broker}, {rate} ev/s (load {})",
                    load_avg()
                );
                let v = child(&args).await?;
                let line = json!({ "name": format!("capacity_{delivery}_{broker}"), "run": v });
                println!("{line}");
                if let Some(f) = file.as_mut() {
                    use std::io::Write;
                    let _ = writeln!(f, "{line}");
                }
                Ok(v)
            };
            let mut good: Option<Tried> = None;
            let mut bad: Option<Tried> = None;
            let mut rate = a.start;
            while rate <= a.max_rate {
                let v = try_rate(rate).await?;
                if v["sustained"] == true {
                    good = Some((rate, v));
                    rate *= 2;
                } else {
                    bad = Some((rate, v));
                    break;
                }
            }
            for _ in 0..a.steps {
                let (Some((g, _)), Some((b, _))) = (&good, &bad) else {
                    break;
                };
                let mid = (g + b) / 2;
                if mid <= *g || mid >= *b {
                    break;
                }
                let v = try_rate(mid).await?;
                if v["sustained"] == true {
                    good = Some((mid, v));
                } else {
                    bad = Some((mid, v));
                }
            }
            table.push((delivery.clone(), broker.clone(), good, bad));
        }
    }
    println!();
    println!(
        "Sustained capacity ({}): the highest rate sustained (write rate within 2 %, backlog at the end ≤ 1 s of writes, p99 ≤ 1 s, drained), and the lowest rate tried that was not.",
        a.run_args
    );
    println!();
    println!(
        "| delivery | broker | sustained ev/s | delivered ev/s | p50 / p95 / p99 / max ms | relay CPU s / 1,000 | not sustained at | there: written / delivered ev/s, backlog, p99 ms, drain s |"
    );
    println!("|---|---|---:|---:|---|---:|---:|---|");
    let lat = |v: &Value| {
        let l = &v["latency_ms"];
        format!("{} / {} / {} / {}", l["p50"], l["p95"], l["p99"], l["max"])
    };
    for (d, b, good, bad) in table {
        let (gr, gd, gl, gc) = match &good {
            Some((r, v)) => (
                r.to_string(),
                v["delivered_rate"].to_string(),
                lat(v),
                v["relay_cpu_s_per_1000"].to_string(),
            ),
            None => ("–".into(), "–".into(), "–".into(), "–".into()),
        };
        let (br, bt) = match &bad {
            Some((r, v)) => (
                r.to_string(),
                format!(
                    "{} / {}, {}, {}, {}",
                    v["write_rate"],
                    v["delivered_rate"],
                    v["backlog_end"],
                    v["latency_ms"]["p99"],
                    v["drain_s"]
                ),
            ),
            None => ("–".into(), "–".into()),
        };
        println!("| {d} | {b} | {gr} | {gd} | {gl} | {gc} | {br} | {bt} |");
    }
    Ok(())
}
