//! The end-to-end benchmark of issue 22: `outbox-bench e2e`.
//!
//! The whole path, with the shipped processes: writers in this process commit `order.placed`
//! events through the outbox writer (`PgOutboxWriter`, NOTIFY on) at a fixed offered rate; N
//! `outbox-relay run` processes publish them to NATS JetStream or Redis Streams; N `billing`
//! processes of one consumer group consume them through the inbox, the handler writing one
//! ledger row in the inbox transaction (the effect). Relays and runners are real processes, not
//! tasks here, because that is how they are deployed: each has its own runtime, pool, LISTEN
//! connection and broker client and competes for rows and messages with the others through
//! PostgreSQL and the broker only, and the binaries run with their own defaults; the writers'
//! scheduling in this process cannot delay them.
//!
//! Per broker and per N (1, 2, 4 by default), in a fresh schema `e2e_<pid>_<ns>` (the outbox
//! table, the inbox table and the ledger), a fresh JetStream stream or Redis key prefix:
//!
//! 1. the first runner starts (it creates the inbox table and the ledger), then the others,
//!    then the relays; each counts as started when it says so on its output;
//! 2. the offered rate is stepped: each step runs `--settle-s` seconds, then the measured
//!    window of `--window-s` seconds, between two readings of the database clock. A step is
//!    *sustained* when the writers committed the offered rate within 5 % in the window and the
//!    backlog (events committed without their ledger row) grew by at most 5 % of the window's
//!    writes. The rate goes up by `--factor` after a sustained step and down by it after one
//!    that was not, and is bisected once both are known, for at most `--steps` steps; after a
//!    step that was not sustained the writers pause until the backlog is gone;
//! 3. the writers stop, the backlog drains, and the latency of each step is read from the
//!    tables: per event committed in the window, the ledger row's `billed_at` minus the outbox
//!    row's `created_at` (both `clock_timestamp()` of the database, just before each commit),
//!    p50 / p99 / max. It also checks every event has exactly one ledger row.
//!
//! Every process connects with `application_name` set to the run's tag and its role
//! (`_bench`, `_relay<i>`, `_runner<i>`), and a sampler counts the run's PostgreSQL connections
//! in `pg_stat_activity` twice a second: the peaks (all at once, per relay, per runner, this
//! process) are printed.
//! One JSON line per step, then a table: the highest sustained rate per broker and N with its
//! latency, and the lowest rate that was not sustained.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde_json::{Value, json};
use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, Row};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{Notify, watch};
use txoutbox_core::NewEvent;
use txoutbox_postgres::{PgOutboxWriter, TableName};
use uuid::Uuid;

use crate::suite::load_avg;
use crate::{BenchError, Conn, round};

/// The broker of an end-to-end run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum E2eBroker {
    /// NATS JetStream: a fresh stream; the runners share one durable consumer.
    Nats,
    /// Redis Streams: a fresh key prefix; the runners are consumers of one group.
    Redis,
}

impl E2eBroker {
    fn name(self) -> &'static str {
        match self {
            Self::Nats => "nats",
            Self::Redis => "redis",
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct E2eArgs {
    /// Brokers, in this order.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "nats,redis")]
    pub brokers: Vec<E2eBroker>,
    /// Relay and runner counts: N relays and N runners each.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub scales: Vec<usize>,
    /// First offered rate (events/s) of a broker's first N; the next N of the same broker
    /// starts at the rate found for the previous one.
    #[arg(long, default_value_t = 300)]
    pub start: u64,
    /// Factor between two rates while only one side (sustained or not) is known.
    #[arg(long, default_value_t = 1.5)]
    pub factor: f64,
    /// At most this many steps per broker and N.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Seconds at a new rate before its window.
    #[arg(long, default_value_t = 3)]
    pub settle_s: u64,
    /// The measured window of each step, seconds.
    #[arg(long, default_value_t = 12)]
    pub window_s: u64,
    /// Longest wait for the backlog to drain, seconds.
    #[arg(long, default_value_t = 90)]
    pub drain_timeout_s: u64,
    /// Writer tasks, each on its own connection.
    #[arg(long, default_value_t = 2)]
    pub writers: usize,
    /// Events per writer transaction.
    #[arg(long, default_value_t = 1)]
    pub per_tx: usize,
    /// Customers (partition keys), each writer owning its share; a customer's orders are
    /// numbered in write order.
    #[arg(long, default_value_t = 200)]
    pub customers: usize,
    /// The relays' delivery mode (`outbox-relay run --delivery`).
    #[arg(long, default_value = "lease")]
    pub delivery: String,
    /// Each relay's PostgreSQL pool (`outbox-relay run --max-connections`, LISTEN's connection
    /// included).
    #[arg(long, default_value_t = 2)]
    pub relay_connections: u32,
    /// Each runner's concurrency (`billing --concurrency`).
    #[arg(long, default_value_t = 2)]
    pub runner_concurrency: usize,
    /// Each runner's PostgreSQL pool (`billing --max-connections`, above the concurrency).
    #[arg(long, default_value_t = 3)]
    pub runner_connections: u32,
    /// The `outbox-relay` binary (default: beside this one).
    #[arg(long)]
    pub relay_bin: Option<PathBuf>,
    /// The `billing` binary (default: beside this one).
    #[arg(long)]
    pub billing_bin: Option<PathBuf>,
    /// Append every JSON line to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[command(flatten)]
    pub conn: Conn,
}

fn db(during: &'static str) -> impl Fn(sqlx::Error) -> BenchError {
    move |e| BenchError(format!("PostgreSQL error during {during}: {e}"))
}

/// `url` with `application_name=<name>`, so the run's connections can be counted.
fn with_app_name(url: &str, name: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}application_name={name}")
}

fn sibling(name: &str, given: &Option<PathBuf>) -> Result<PathBuf, BenchError> {
    if let Some(p) = given {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe().map_err(|e| BenchError(e.to_string()))?;
    let p = exe.with_file_name(name);
    if !p.exists() {
        return Err(BenchError(format!(
            "{} not found: build it with `cargo build --release -p txoutbox-examples --features nats,redis,diesel --bin outbox-bench --bin outbox-relay --bin billing` (or scripts/bench e2e)",
            p.display()
        )));
    }
    Ok(p)
}

/// A child process whose output is read line by line: a line containing its ready marker marks
/// it started; the last lines are kept for the error message if it exits.
struct Proc {
    name: String,
    child: tokio::process::Child,
    ready: Arc<AtomicBool>,
    seen: Arc<Notify>,
    tail: Arc<Mutex<VecDeque<String>>>,
}

impl Proc {
    fn spawn(
        name: String,
        bin: &PathBuf,
        args: &[String],
        log: &str,
        marker: &'static str,
    ) -> Result<Self, BenchError> {
        let mut child = tokio::process::Command::new(bin)
            .args(args)
            .env("RUST_LOG", log)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| BenchError(format!("start {name} ({}): {e}", bin.display())))?;
        let ready = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Notify::new());
        let tail = Arc::new(Mutex::new(VecDeque::new()));
        let out = child.stdout.take().map(|o| Box::new(o) as Box<dyn Reader>);
        let err = child.stderr.take().map(|e| Box::new(e) as Box<dyn Reader>);
        for r in [out, err].into_iter().flatten() {
            let (ready, seen, tail) = (ready.clone(), seen.clone(), tail.clone());
            tokio::spawn(async move {
                let mut lines = BufReader::new(r).lines();
                while let Ok(Some(l)) = lines.next_line().await {
                    if !ready.load(Ordering::Relaxed) && l.contains(marker) {
                        ready.store(true, Ordering::SeqCst);
                        seen.notify_waiters();
                    }
                    let mut t = tail.lock().expect("tail");
                    if t.len() == 20 {
                        t.pop_front();
                    }
                    t.push_back(l);
                }
                seen.notify_waiters();
            });
        }
        Ok(Self {
            name,
            child,
            ready,
            seen,
            tail,
        })
    }

    fn tail(&self) -> String {
        let t = self.tail.lock().expect("tail");
        t.iter().cloned().collect::<Vec<_>>().join("\n  ")
    }

    /// An error if the process has exited.
    fn check(&mut self) -> Result<(), BenchError> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(st)) => Err(BenchError(format!(
                "{} exited ({st}); its last lines:\n  {}",
                self.name,
                self.tail()
            ))),
            Err(e) => Err(BenchError(format!("{}: {e}", self.name))),
        }
    }

    async fn wait_ready(&mut self, limit: Duration) -> Result<(), BenchError> {
        let deadline = Instant::now() + limit;
        let seen = self.seen.clone();
        loop {
            let woken = seen.notified();
            if self.ready.load(Ordering::SeqCst) {
                return Ok(());
            }
            self.check()?;
            if Instant::now() >= deadline {
                return Err(BenchError(format!(
                    "{} did not start within {limit:?}; its last lines:\n  {}",
                    self.name,
                    self.tail()
                )));
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), woken).await;
        }
    }

    /// SIGTERM, then SIGKILL after 10 s.
    async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }
}

trait Reader: tokio::io::AsyncRead + Unpin + Send + 'static {}
impl<T: tokio::io::AsyncRead + Unpin + Send + 'static> Reader for T {}

/// The broker side of one configuration: a fresh stream or key prefix, the relays' and the
/// runners' flags for it, and its removal.
struct BrokerBed {
    kind: E2eBroker,
    relay_args: Vec<String>,
    billing_args: Vec<String>,
    name: String,
}

impl BrokerBed {
    async fn create(kind: E2eBroker, conn: &Conn, tag: &str) -> Result<Self, BenchError> {
        match kind {
            E2eBroker::Nats => {
                let stream = tag.to_uppercase();
                let prefix = format!("{tag}.");
                create_nats_stream(&conn.nats_url, &stream, &prefix).await?;
                Ok(Self {
                    kind,
                    relay_args: vec![
                        "--broker".into(),
                        "nats".into(),
                        "--nats-url".into(),
                        conn.nats_url.clone(),
                        "--nats-stream".into(),
                        stream.clone(),
                        "--nats-subject-prefix".into(),
                        prefix.clone(),
                    ],
                    billing_args: vec![
                        "--broker".into(),
                        "nats".into(),
                        "--nats-url".into(),
                        conn.nats_url.clone(),
                        "--nats-stream".into(),
                        stream.clone(),
                        "--subject-prefix".into(),
                        prefix,
                    ],
                    name: stream,
                })
            }
            E2eBroker::Redis => {
                let prefix = format!("{tag}:");
                Ok(Self {
                    kind,
                    relay_args: vec![
                        "--broker".into(),
                        "redis".into(),
                        "--redis-url".into(),
                        conn.redis_url.clone(),
                        "--redis-key-pattern".into(),
                        format!("{prefix}{{topic}}"),
                    ],
                    billing_args: vec![
                        "--broker".into(),
                        "redis".into(),
                        "--redis-url".into(),
                        conn.redis_url.clone(),
                        "--redis-key-prefix".into(),
                        prefix.clone(),
                    ],
                    name: format!("{prefix}{TOPIC}"),
                })
            }
        }
    }

    async fn remove(self, conn: &Conn) {
        match self.kind {
            E2eBroker::Nats => remove_nats_stream(&conn.nats_url, &self.name).await,
            E2eBroker::Redis => remove_redis_key(&conn.redis_url, &self.name).await,
        }
    }
}

#[cfg(feature = "nats")]
async fn create_nats_stream(url: &str, stream: &str, prefix: &str) -> Result<(), BenchError> {
    let client = async_nats::connect(url)
        .await
        .map_err(|e| BenchError(format!("NATS at {url} is unreachable: {e}")))?;
    async_nats::jetstream::new(client)
        .create_stream(async_nats::jetstream::stream::Config {
            name: stream.to_owned(),
            subjects: vec![format!("{prefix}>")],
            // `outbox-relay run`'s --nats-duplicate-window default, as if it made the stream.
            duplicate_window: Duration::from_secs(600),
            ..Default::default()
        })
        .await
        .map_err(|e| BenchError(format!("NATS: creating the stream: {e}")))?;
    Ok(())
}

#[cfg(not(feature = "nats"))]
async fn create_nats_stream(_: &str, _: &str, _: &str) -> Result<(), BenchError> {
    Err(BenchError("--brokers nats needs the nats feature".into()))
}

#[cfg(feature = "nats")]
async fn remove_nats_stream(url: &str, stream: &str) {
    if let Ok(client) = async_nats::connect(url).await {
        let _ = async_nats::jetstream::new(client)
            .delete_stream(stream)
            .await;
    }
}

#[cfg(not(feature = "nats"))]
async fn remove_nats_stream(_: &str, _: &str) {}

#[cfg(feature = "redis")]
async fn remove_redis_key(url: &str, key: &str) {
    if let Ok(c) = redis::Client::open(url)
        && let Ok(mut c) = c.get_multiplexed_async_connection().await
    {
        let _: Result<i64, _> = redis::cmd("DEL").arg(key).query_async(&mut c).await;
    }
}

#[cfg(not(feature = "redis"))]
async fn remove_redis_key(_: &str, _: &str) {}

/// The topic of the orders' events (billing's subscription and sources).
const TOPIC: &str = "orders";

/// The tables of one configuration, in schema `tag`.
struct Tables {
    outbox: String,
    ledger: String,
}

/// What one step measured.
#[derive(Debug, Clone)]
struct Step {
    rate: u64,
    w0: chrono::DateTime<chrono::Utc>,
    w1: chrono::DateTime<chrono::Utc>,
    window_s: f64,
    written: i64,
    effects: i64,
    backlog_start: i64,
    backlog_end: i64,
    relay_backlog_end: i64,
    load: String,
}

impl Step {
    fn write_rate(&self) -> f64 {
        self.written as f64 / self.window_s
    }
    fn effect_rate(&self) -> f64 {
        self.effects as f64 / self.window_s
    }
    fn growth(&self) -> i64 {
        self.backlog_end - self.backlog_start
    }
    /// Why the step is not sustained, or None.
    fn verdict(&self) -> Option<String> {
        let r = self.rate as f64;
        if (self.write_rate() - r).abs() > 0.05 * r {
            return Some(format!(
                "the writers committed {:.0} ev/s of {}",
                self.write_rate(),
                self.rate
            ));
        }
        if self.growth() as f64 > 0.05 * self.written as f64 {
            return Some(format!("the backlog grew by {}", self.growth()));
        }
        None
    }
}

/// Counts of the configuration's tables: events written, effects, events not completed by
/// the relays.
async fn counts(pool: &PgPool, t: &Tables) -> Result<(i64, i64, i64), BenchError> {
    let r = sqlx::query(AssertSqlSafe(format!(
        "SELECT (SELECT count(*) FROM {o}), (SELECT count(*) FROM {l}),
                (SELECT count(*) FROM {o} WHERE status <> 'completed')",
        o = t.outbox,
        l = t.ledger
    )))
    .fetch_one(pool)
    .await
    .map_err(db("the counts"))?;
    Ok((r.get(0), r.get(1), r.get(2)))
}

async fn db_now(pool: &PgPool) -> Result<chrono::DateTime<chrono::Utc>, BenchError> {
    sqlx::query_scalar("SELECT clock_timestamp()")
        .fetch_one(pool)
        .await
        .map_err(db("the clock"))
}

/// The writers: `--writers` tasks committing at the rate of the watch channel (0 pauses them).
struct Writers {
    rate: watch::Sender<u64>,
    tasks: Vec<tokio::task::JoinHandle<Result<(), BenchError>>>,
}

impl Writers {
    fn start(a: &E2eArgs, pool: PgPool, table: &TableName) -> Self {
        let (rate, rx) = watch::channel(0u64);
        let writer = PgOutboxWriter::new(table).notify(true);
        let w_n = a.writers.max(1);
        let own = (a.customers / w_n).max(1);
        let mut tasks = Vec::new();
        for w in 0..w_n {
            let (mut rx, pool, writer, per_tx) =
                (rx.clone(), pool.clone(), writer.clone(), a.per_tx);
            tasks.push(tokio::spawn(async move {
                let mut n: usize = 0;
                let mut due = tokio::time::Instant::now();
                // The time between two transactions of this writer at offered rate `r`.
                let period =
                    |r: u64| Duration::from_secs_f64((per_tx * w_n) as f64 / r.max(1) as f64);
                loop {
                    let r = *rx.borrow_and_update();
                    if r == 0 {
                        if rx.changed().await.is_err() {
                            return Ok(());
                        }
                        // Writers start spread over one period, so their commits interleave.
                        let p = period(*rx.borrow());
                        due = tokio::time::Instant::now() + p.mul_f64(w as f64 / w_n as f64);
                        continue;
                    }
                    tokio::select! {
                        _ = tokio::time::sleep_until(due) => {}
                        c = rx.changed() => {
                            if c.is_err() {
                                return Ok(());
                            }
                            continue;
                        }
                    }
                    due += period(r);
                    let events = (0..per_tx)
                        .map(|i| {
                            let j = n + i;
                            let customer = format!("c{}", w + w_n * (j % own));
                            let seq = j / own + 1;
                            let order = Uuid::now_v7();
                            NewEvent::builder()
                                .event_type("order.placed")
                                .aggregate("order", order)
                                .topic(TOPIC)
                                .partition_key(customer.clone())
                                .payload_json(json!({
                                    "order": order, "customer": customer, "seq": seq,
                                    "total_cents": 100 + (j % 1000) as i64,
                                }))
                                .build()
                        })
                        .collect::<Result<Vec<_>, _>>()
                        .map_err(|e| BenchError(format!("event: {e}")))?;
                    n += per_tx;
                    let mut tx = pool.begin().await.map_err(db("a writer's begin"))?;
                    writer
                        .write(&mut tx, events)
                        .await
                        .map_err(|e| BenchError(format!("write: {e}")))?;
                    tx.commit().await.map_err(db("a writer's commit"))?;
                }
            }));
        }
        Self { rate, tasks }
    }

    async fn stop(self) -> Result<(), BenchError> {
        drop(self.rate);
        for t in self.tasks {
            t.await
                .map_err(|e| BenchError(format!("writer task: {e}")))??;
        }
        Ok(())
    }
}

/// The most PostgreSQL connections the run held at once (one sample every 500 ms), and the
/// most one relay process, one runner process and this process held.
#[derive(Debug, Clone, Default)]
struct Peaks {
    total: i64,
    relay: i64,
    runner: i64,
    bench: i64,
}

impl Peaks {
    fn add(&mut self, tag: &str, rows: &[(String, i64)]) {
        self.total = self.total.max(rows.iter().map(|r| r.1).sum());
        for (name, n) in rows {
            let role = name.strip_prefix(tag).unwrap_or_default();
            let slot = if role.starts_with("_relay") {
                &mut self.relay
            } else if role.starts_with("_runner") {
                &mut self.runner
            } else {
                &mut self.bench
            };
            *slot = (*slot).max(*n);
        }
    }

    fn json(&self) -> Value {
        json!({"total": self.total, "per_relay": self.relay, "per_runner": self.runner,
            "bench": self.bench})
    }
}

/// One configuration: a broker, N relays and N runners.
struct Config<'a> {
    a: &'a E2eArgs,
    broker: E2eBroker,
    n: usize,
}

/// What a configuration found.
struct Found {
    broker: E2eBroker,
    n: usize,
    good: Option<(Step, Value)>,
    bad: Option<(Step, Value)>,
    peaks: Peaks,
    exactly_once: bool,
    load_start: String,
    load_end: String,
}

impl Config<'_> {
    async fn run(&self, start: u64, lines: &mut Vec<Value>) -> Result<Found, BenchError> {
        let a = self.a;
        let tag = crate::inbox::run_tag("e2e");
        let url = with_app_name(&a.conn.database_url, &format!("{tag}_bench"));
        let relay_bin = sibling("outbox-relay", &a.relay_bin)?;
        let billing_bin = sibling("billing", &a.billing_bin)?;
        // One pool for the writers and this process's own queries (the counts, the clock, the
        // sampler): they wait for a writer's connection to be free.
        let admin = crate::db::pool(&url, a.writers.max(1) as u32).await?;
        let table = TableName::new(&format!("{tag}.outbox_events"))
            .map_err(|e| BenchError(format!("table name: {e}")))?;
        let tables = Tables {
            outbox: table.qualified(),
            ledger: TableName::new(&format!("{tag}.billing_ledger"))
                .map_err(|e| BenchError(format!("table name: {e}")))?
                .qualified(),
        };
        let bed = BrokerBed::create(self.broker, &a.conn, &tag).await;
        let res = async {
            let bed = bed.as_ref().map_err(|e| BenchError(e.0.clone()))?;
            txoutbox_postgres::create_schema(&admin, &table)
                .await
                .map_err(|e| BenchError(format!("create_schema: {e}")))?;
            let mut procs: Vec<Proc> = Vec::new();
            let r = self
                .measure(
                    start,
                    &tag,
                    &admin,
                    &table,
                    &tables,
                    bed,
                    &relay_bin,
                    &billing_bin,
                    &mut procs,
                    lines,
                )
                .await;
            for p in procs {
                p.stop().await;
            }
            r
        }
        .await;
        let _ = sqlx::query(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{tag}\" CASCADE"
        )))
        .execute(&admin)
        .await;
        admin.close().await;
        if let Ok(b) = bed {
            b.remove(&a.conn).await;
        }
        res
    }

    #[allow(clippy::too_many_arguments)]
    async fn measure(
        &self,
        start: u64,
        tag: &str,
        admin: &PgPool,
        table: &TableName,
        tables: &Tables,
        bed: &BrokerBed,
        relay_bin: &PathBuf,
        billing_bin: &PathBuf,
        procs: &mut Vec<Proc>,
        lines: &mut Vec<Value>,
    ) -> Result<Found, BenchError> {
        let a = self.a;
        let schema = table.schema().unwrap_or("public").to_owned();
        let load_start = load_avg();
        // The runners first, one at a time: the first creates the inbox table and the ledger.
        for i in 1..=self.n {
            let mut args = vec![
                "--database-url".into(),
                with_app_name(&a.conn.database_url, &format!("{tag}_runner{i}")),
                "--schema".into(),
                schema.clone(),
                "--group".into(),
                "billing".into(),
                "--worker-id".into(),
                format!("runner-{i}"),
                "--concurrency".into(),
                a.runner_concurrency.to_string(),
                "--max-connections".into(),
                a.runner_connections.to_string(),
            ];
            args.extend(bed.billing_args.iter().cloned());
            let mut p = Proc::spawn(
                format!("runner-{i}"),
                billing_bin,
                &args,
                "warn",
                "consuming as group",
            )?;
            p.wait_ready(Duration::from_secs(30)).await?;
            procs.push(p);
        }
        for i in 1..=self.n {
            let mut args = vec![
                "run".into(),
                "--database-url".into(),
                with_app_name(&a.conn.database_url, &format!("{tag}_relay{i}")),
                "--table".into(),
                table.to_string(),
                "--worker-id".into(),
                format!("relay-{i}"),
                "--delivery".into(),
                a.delivery.clone(),
                "--max-connections".into(),
                a.relay_connections.to_string(),
            ];
            args.extend(bed.relay_args.iter().cloned());
            let mut p = Proc::spawn(
                format!("relay-{i}"),
                relay_bin,
                &args,
                "info",
                "relay started",
            )?;
            p.wait_ready(Duration::from_secs(30)).await?;
            procs.push(p);
        }

        // The connection sampler.
        let peaks = Arc::new(Mutex::new(Peaks::default()));
        let sampling = Arc::new(AtomicBool::new(true));
        let sampler = {
            let (pool, peaks, sampling) = (admin.clone(), peaks.clone(), sampling.clone());
            let tag = tag.to_owned();
            tokio::spawn(async move {
                while sampling.load(Ordering::Relaxed) {
                    if let Ok(rows) = sqlx::query_as::<_, (String, i64)>(
                        "SELECT application_name, count(*) FROM pg_stat_activity
                          WHERE starts_with(application_name, $1) GROUP BY 1",
                    )
                    .bind(&tag)
                    .fetch_all(&pool)
                    .await
                    {
                        peaks.lock().expect("peaks").add(&tag, &rows);
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            })
        };

        let writers = Writers::start(a, admin.clone(), table);
        let res = self.search(start, admin, tables, &writers, procs).await;
        let stopped = writers.stop().await;
        sampling.store(false, Ordering::Relaxed);
        let _ = sampler.await;
        let steps = res?;
        stopped?;
        self.drain(admin, tables, procs).await?;

        // The latency of every step, from the tables, once everything has its effect.
        let mut good: Option<(Step, Value)> = None;
        let mut bad: Option<(Step, Value)> = None;
        for s in steps {
            let lat = latency(admin, tables, &s).await?;
            let verdict = s.verdict();
            let line = json!({
                "broker": self.broker.name(), "relays": self.n, "runners": self.n,
                "rate": s.rate, "window_s": round(s.window_s, 3),
                "write_rate": round(s.write_rate(), 0), "effect_rate": round(s.effect_rate(), 0),
                "backlog_start": s.backlog_start, "backlog_end": s.backlog_end,
                "relay_backlog_end": s.relay_backlog_end,
                "latency_ms": lat,
                "sustained": verdict.is_none(), "why_not": verdict,
                "writers": a.writers, "per_tx": a.per_tx, "customers": a.customers,
                "delivery": a.delivery, "relay_connections": a.relay_connections,
                "runner_concurrency": a.runner_concurrency,
                "runner_connections": a.runner_connections, "load": s.load,
            });
            println!("{line}");
            lines.push(line.clone());
            if verdict.is_none() {
                if good.as_ref().is_none_or(|(g, _)| s.rate > g.rate) {
                    good = Some((s, line));
                }
            } else if bad.as_ref().is_none_or(|(b, _)| s.rate < b.rate) {
                bad = Some((s, line));
            }
        }
        let r = sqlx::query(AssertSqlSafe(format!(
            "SELECT (SELECT count(*) FROM {o}),
                    (SELECT count(*) FROM {l}), (SELECT count(DISTINCT message_id) FROM {l}),
                    (SELECT count(*) FROM {o} o WHERE NOT EXISTS
                        (SELECT 1 FROM {l} l WHERE l.message_id = o.id::text))",
            o = tables.outbox,
            l = tables.ledger
        )))
        .fetch_one(admin)
        .await
        .map_err(db("the final check"))?;
        let (events, effects, distinct, missing): (i64, i64, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        let exactly_once = effects == events && distinct == effects && missing == 0;
        if !exactly_once {
            eprintln!(
                "e2e {} N={}: {events} events, {effects} ledger rows ({distinct} distinct), {missing} without one",
                self.broker.name(),
                self.n
            );
        }
        let peaks = peaks.lock().expect("peaks").clone();
        let line = json!({
            "broker": self.broker.name(), "relays": self.n, "runners": self.n,
            "events": events, "effects": effects, "distinct_effects": distinct,
            "without_effect": missing, "exactly_once": exactly_once,
            "peak_connections": peaks.json(),
        });
        println!("{line}");
        lines.push(line);
        Ok(Found {
            broker: self.broker,
            n: self.n,
            good,
            bad,
            peaks,
            exactly_once,
            load_start,
            load_end: load_avg(),
        })
    }

    /// Steps the offered rate; returns every step.
    async fn search(
        &self,
        start: u64,
        admin: &PgPool,
        tables: &Tables,
        writers: &Writers,
        procs: &mut [Proc],
    ) -> Result<Vec<Step>, BenchError> {
        let a = self.a;
        let mut steps: Vec<Step> = Vec::new();
        let (mut good, mut bad): (Option<u64>, Option<u64>) = (None, None);
        let mut rate = start.max(1);
        for _ in 0..a.steps.max(1) {
            eprintln!(
                "e2e {} N={}: {rate} ev/s (load {})",
                self.broker.name(),
                self.n,
                load_avg()
            );
            let load = load_avg();
            let _ = writers.rate.send(rate);
            self.sleep_checking(Duration::from_secs(a.settle_s), procs)
                .await?;
            let w0 = db_now(admin).await?;
            let (e0, f0, _) = counts(admin, tables).await?;
            self.sleep_checking(Duration::from_secs(a.window_s), procs)
                .await?;
            let w1 = db_now(admin).await?;
            let (e1, f1, pending) = counts(admin, tables).await?;
            let r = sqlx::query(AssertSqlSafe(format!(
                "SELECT (SELECT count(*) FROM {o} WHERE created_at >= $1 AND created_at < $2),
                        (SELECT count(*) FROM {l} WHERE billed_at >= $1 AND billed_at < $2)",
                o = tables.outbox,
                l = tables.ledger
            )))
            .bind(w0)
            .bind(w1)
            .fetch_one(admin)
            .await
            .map_err(db("the window's counts"))?;
            let step = Step {
                rate,
                w0,
                w1,
                window_s: (w1 - w0).num_microseconds().unwrap_or(0) as f64 / 1e6,
                written: r.get(0),
                effects: r.get(1),
                backlog_start: e0 - f0,
                backlog_end: e1 - f1,
                relay_backlog_end: pending,
                load: load.clone(),
            };
            let verdict = step.verdict();
            eprintln!(
                "  written {:.0} ev/s, effects {:.0} ev/s, backlog {} -> {} (relays {}): {}",
                step.write_rate(),
                step.effect_rate(),
                step.backlog_start,
                step.backlog_end,
                step.relay_backlog_end,
                verdict.clone().unwrap_or_else(|| "sustained".into())
            );
            steps.push(step);
            if verdict.is_none() {
                good = Some(good.map_or(rate, |g| g.max(rate)));
            } else {
                bad = Some(bad.map_or(rate, |b| b.min(rate)));
                let _ = writers.rate.send(0);
                self.drain(admin, tables, procs).await?;
            }
            rate = match (good, bad) {
                (Some(g), None) => (g as f64 * a.factor).round() as u64,
                (None, Some(b)) => (b as f64 / a.factor).round() as u64,
                (Some(g), Some(b)) => {
                    let mid = (g + b) / 2;
                    if mid <= g || mid >= b {
                        break;
                    }
                    mid
                }
                (None, None) => unreachable!("a step was measured"),
            };
            if rate == 0 {
                break;
            }
        }
        let _ = writers.rate.send(0);
        Ok(steps)
    }

    async fn sleep_checking(&self, d: Duration, procs: &mut [Proc]) -> Result<(), BenchError> {
        let end = Instant::now() + d;
        while Instant::now() < end {
            for p in procs.iter_mut() {
                p.check()?;
            }
            tokio::time::sleep(
                end.saturating_duration_since(Instant::now())
                    .min(Duration::from_millis(500)),
            )
            .await;
        }
        Ok(())
    }

    /// Waits until every event written has its effect.
    async fn drain(
        &self,
        admin: &PgPool,
        tables: &Tables,
        procs: &mut [Proc],
    ) -> Result<(), BenchError> {
        let deadline = Instant::now() + Duration::from_secs(self.a.drain_timeout_s);
        loop {
            let (e, f, _) = counts(admin, tables).await?;
            if f >= e {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(BenchError(format!(
                    "{} events still without their effect after {} s",
                    e - f,
                    self.a.drain_timeout_s
                )));
            }
            self.sleep_checking(Duration::from_millis(250), procs)
                .await?;
        }
    }
}

/// p50 / p99 / max commit-to-effect of the events committed in the step's window, in ms.
async fn latency(pool: &PgPool, t: &Tables, s: &Step) -> Result<Value, BenchError> {
    let r = sqlx::query(AssertSqlSafe(format!(
        "SELECT count(l.id),
                percentile_disc(0.5) WITHIN GROUP (ORDER BY x.ms),
                percentile_disc(0.99) WITHIN GROUP (ORDER BY x.ms),
                max(x.ms)
           FROM {o} o
           JOIN {l} l ON l.message_id = o.id::text,
                LATERAL (SELECT extract(epoch FROM l.billed_at - o.created_at)::float8 * 1000 AS ms) x
          WHERE o.created_at >= $1 AND o.created_at < $2",
        o = t.outbox,
        l = t.ledger
    )))
    .bind(s.w0)
    .bind(s.w1)
    .fetch_one(pool)
    .await
    .map_err(db("the latency"))?;
    let ms = |i: usize| r.get::<Option<f64>, _>(i).map(|v| round(v, 1));
    Ok(json!({"events": r.get::<i64, _>(0), "p50": ms(1), "p99": ms(2), "max": ms(3)}))
}

pub async fn e2e(a: E2eArgs) -> Result<(), BenchError> {
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
    let mut found = Vec::new();
    for &broker in &a.brokers {
        let mut start = a.start;
        for &n in &a.scales {
            let mut lines = Vec::new();
            let r = Config { a: &a, broker, n }.run(start, &mut lines).await;
            if let Some(f) = file.as_mut() {
                use std::io::Write;
                for l in &lines {
                    let _ = writeln!(f, "{l}");
                }
            }
            let f = r?;
            if let Some((g, _)) = &f.good {
                start = g.rate;
            }
            found.push(f);
        }
    }
    println!();
    println!(
        "End to end: {} writer connection(s), {} event(s) per transaction over {} keys; relays `outbox-relay run --delivery {} --max-connections {}`; runners `billing --concurrency {} --max-connections {}`; steps of {} s + {} s measured.",
        a.writers,
        a.per_tx,
        a.customers,
        a.delivery,
        a.relay_connections,
        a.runner_concurrency,
        a.runner_connections,
        a.settle_s,
        a.window_s
    );
    println!();
    println!(
        "| broker | relays + runners | sustained ev/s | effects ev/s | commit-to-effect p50 / p99 / max ms | load there | not sustained at | there | peak PG connections: all (per relay, per runner, bench) | exactly once | load start → end |"
    );
    println!("|---|---:|---:|---:|---|---|---:|---|---:|---|---|");
    for f in found {
        let (gr, ge, gl, gload) = match &f.good {
            Some((s, v)) => (
                s.rate.to_string(),
                format!("{:.0}", s.effect_rate()),
                format!(
                    "{} / {} / {}",
                    v["latency_ms"]["p50"], v["latency_ms"]["p99"], v["latency_ms"]["max"]
                ),
                s.load.clone(),
            ),
            None => ("–".into(), "–".into(), "–".into(), "–".into()),
        };
        let (br, bt) = match &f.bad {
            Some((s, _)) => (
                s.rate.to_string(),
                format!(
                    "written {:.0}, effects {:.0} ev/s, backlog {} → {}",
                    s.write_rate(),
                    s.effect_rate(),
                    s.backlog_start,
                    s.backlog_end
                ),
            ),
            None => ("–".into(), "–".into()),
        };
        println!(
            "| {} | {} | {gr} | {ge} | {gl} | {gload} | {br} | {bt} | {} ({}, {}, {}) | {} | {} → {} |",
            f.broker.name(),
            f.n,
            f.peaks.total,
            f.peaks.relay,
            f.peaks.runner,
            f.peaks.bench,
            if f.exactly_once { "yes" } else { "NO" },
            f.load_start,
            f.load_end
        );
    }
    Ok(())
}
