//! `outbox-bench`: the throughput benchmark of the outbox.
//!
//! `outbox-bench run …` prepares a fresh table in its own schema, preloads pending events in
//! bulk and drains them one way, then prints one JSON line:
//!
//! * `--mode relay`: R `txoutbox_core::Relay` loops (sqlx or diesel store; no-op, NATS JetStream
//!   or Redis Streams broker) in this process;
//! * `--mode reference`: the same preload drained with plain SQL and no ordering, 2 statements
//!   per cycle on R connections (the ceiling of a Postgres queue on this machine);
//! * `--mode raw`: the broker client alone publishing N messages with the relay's concurrency
//!   (the ceiling of the broker);
//! * `--mode statements`: the library's fetch and completion statements run by hand, timed
//!   round trip by round trip (where the database time of a cycle goes).
//!
//! `outbox-bench suite` runs the standard set (targets 1 to 6 of `examples/BENCHMARKS.md`)
//! several times, each run in a child process, and prints a table of medians and ratios;
//! `outbox-bench burst` the fresh-table burst (a backlog on a table without statistics),
//! `outbox-bench run --mode capacity` the sustained-capacity search, `outbox-bench inbox` the
//! inbox shapes and `outbox-bench e2e` the whole path through `outbox-relay` and `billing`
//! processes. See `examples/BENCHMARKS.md`.

mod brokers;
mod burst;
mod capacity;
mod db;
mod e2e;
mod inbox;
mod inbox_brokers;
mod suite;
mod timed;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde_json::{Value, json};
use txoutbox_core::{Broker, CancellationToken, OutboxRepository, Relay};

use crate::timed::{OrderCheck, Phases, Timed, TimedBroker};

/// A failure of the benchmark, with what went wrong.
#[derive(Debug)]
pub struct BenchError(pub String);

impl std::fmt::Display for BenchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "outbox-bench",
    about = "Throughput benchmark of the outbox relay"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// One run: fresh table, bulk preload, drain; prints one JSON line.
    Run(RunArgs),
    /// The standard set (targets 1 to 6 of `examples/BENCHMARKS.md`), each run several times
    /// in child processes; prints the JSON lines and a table of medians and ratios.
    Suite(suite::SuiteArgs),
    /// The fresh-table burst of issue 19: the same backlog drained with fresh, absent and
    /// stale planner statistics, in both delivery modes; prints the drain times and ratios.
    Burst(burst::BurstArgs),
    /// Sustained capacity (issue 19): the highest write rate the relays keep up with, per
    /// delivery mode and broker (runs of `run --mode capacity`).
    Capacity(capacity::SearchArgs),
    /// The inbox shapes of issues 21 and 22 (land, drain, duplicates, nats, redis), each with
    /// its plain-SQL or raw-broker reference in the same run.
    Inbox(inbox::InboxArgs),
    /// The whole path of issue 22 (writers → `outbox-relay` processes → broker → `billing`
    /// runner processes → ledger row): the highest sustained rate and its commit-to-effect
    /// latency at N relays and runners, on NATS and Redis.
    E2e(e2e::E2eArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Relay loops (txoutbox_core::Relay).
    Relay,
    /// Plain SQL, unordered, 2 statements per cycle: the ceiling.
    Reference,
    /// Plain SQL, unordered, with a lease: the fetch stamps locked_at/locked_by and commits, the
    /// completion is a second transaction (the ceiling of any lease-stamping relay).
    LeaseReference,
    /// The broker client alone: the broker's ceiling.
    Raw,
    /// The library's fetch and completion statements, timed round trip by round trip.
    Statements,
    /// Preload only and keep the table (for EXPLAIN); prints its name and the library's fetch
    /// statement to stderr. Drop the schema yourself afterwards.
    Preload,
    /// Sustained capacity: writers in this process at `--rate` while the relays deliver (see
    /// the `capacity` module); no preload.
    Capacity,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// outbox-postgres (sqlx).
    Sqlx,
    /// outbox-diesel (diesel-async).
    Diesel,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BrokerKind {
    /// txoutbox_core::broker::NoopBroker.
    Noop,
    /// NATS JetStream (outbox-nats-broker), a fresh stream per run.
    Nats,
    /// Redis Streams (outbox-redis-broker), a fresh stream key per run.
    Redis,
}

/// Service URLs.
#[derive(Args, Debug, Clone)]
pub struct Conn {
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    pub database_url: String,
    /// NATS URL.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// Redis URL.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
}

/// The backlog: `events` rows spread round-robin over `keys` keys, plus `hot_events` rows on one
/// more key (`hot`), interleaved in time with the others.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub events: usize,
    pub keys: usize,
    pub hot_events: usize,
}

impl Shape {
    pub fn total(&self) -> usize {
        self.events + self.hot_events
    }
}

#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    /// What drains the preload.
    #[arg(long, value_enum, default_value = "relay")]
    pub mode: Mode,
    /// Store of the relay.
    #[arg(long, value_enum, default_value = "sqlx")]
    pub store: StoreKind,
    /// Broker of the relay (and of --mode raw).
    #[arg(long, value_enum, default_value = "noop")]
    pub broker: BrokerKind,
    /// Events spread over --keys keys.
    #[arg(long, default_value_t = 20_000)]
    pub events: usize,
    /// Keys of the --events rows (event i goes to key i mod keys).
    #[arg(long, default_value_t = 1_000)]
    pub keys: usize,
    /// Extra events on one hot key, interleaved in time with the rest.
    #[arg(long, default_value_t = 0)]
    pub hot_events: usize,
    /// Relay loops (relay mode) or connections (reference mode) in this process.
    #[arg(long, default_value_t = 1)]
    pub relays: usize,
    /// Rows per fetch.
    #[arg(long, default_value_t = 100)]
    pub batch: usize,
    /// Rows per key per fetch (relay mode).
    #[arg(long, default_value_t = 16)]
    pub max_per_key: usize,
    /// Keys published at once per relay; raw mode uses relays × this many in flight.
    #[arg(long, default_value_t = 16)]
    pub publish_concurrency: usize,
    /// Delivery mode of the relay (relay mode): lease or transaction.
    #[arg(long, default_value = "lease", value_parser = parse_delivery)]
    pub delivery: txoutbox_core::DeliveryMode,
    /// Check every key's publishes arrive in write order (relay mode).
    #[arg(long)]
    pub check_order: bool,
    /// How the table is prepared, and so the planner's statistics when the drain starts.
    #[arg(long, value_enum, default_value = "vacuum")]
    pub stats: db::Stats,
    #[command(flatten)]
    pub capacity: capacity::CapacityOpts,
    /// Time the phases of each cycle (fetch, publish, outcome write) with a timing decorator of
    /// the repository.
    #[arg(long)]
    pub profile: bool,
    #[command(flatten)]
    pub conn: Conn,
}

fn parse_delivery(s: &str) -> Result<txoutbox_core::DeliveryMode, String> {
    s.parse()
        .map_err(|e: txoutbox_core::ConfigError| e.to_string())
}

/// VmHWM (peak resident set) of this process in MiB, from /proc/self/status.
fn peak_rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some((kb / 1024.0 * 10.0).round() / 10.0)
}

fn round(v: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (v * m).round() / m
}

async fn run(a: RunArgs) -> Result<Value, BenchError> {
    let shape = Shape {
        events: a.events,
        keys: a.keys,
        hot_events: a.hot_events,
    };
    let tag = format!(
        "bench_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_micros())
            .unwrap_or(0)
    );
    let mut out = json!({
        "mode": a.mode.to_possible_value().map(|v| v.get_name().to_owned()),
        "store": format!("{:?}", a.store).to_lowercase(),
        "delivery": a.delivery.to_string(),
        "broker": format!("{:?}", a.broker).to_lowercase(),
        "events": shape.total(),
        "keys": a.keys + usize::from(a.hot_events > 0),
        "hot_events": a.hot_events,
        "relays": a.relays,
        "batch": a.batch,
        "max_per_key": a.max_per_key,
        "publish_concurrency": a.publish_concurrency,
        "stats": a.stats.to_possible_value().map(|v| v.get_name().to_owned()),
    });
    if a.mode == Mode::Capacity {
        let v = capacity::run(&a, &tag).await?;
        if let (Value::Object(o), Value::Object(e)) = (&mut out, v) {
            o.extend(e);
        }
        out["peak_rss_mb"] = json!(peak_rss_mb());
        return Ok(out);
    }
    let (seconds, cycles, extra) = match a.mode {
        Mode::Preload => {
            let fresh =
                db::prepare(&a.conn.database_url, &tag, &shape, a.store, 2, a.stats).await?;
            let stmts = txoutbox_postgres::sql::Statements::new(&fresh.table);
            eprintln!(
                "kept table {}; fetch statements (parameters in outbox-postgres/src/sql/statements/; window {}, walk limit {}):\n{}\n\n{}",
                fresh.table,
                txoutbox_postgres::sql::fetch_window(a.batch),
                txoutbox_postgres::sql::fetch_walk_limit(a.batch),
                stmts.fetch_heads,
                stmts.fetch_take
            );
            (0.0, 0, json!({ "table": fresh.table.to_string() }))
        }
        Mode::Raw => {
            let rb = brokers::open(a.broker, &a.conn, &tag).await?;
            let conc = a.relays * a.publish_concurrency;
            let r = rb.raw(shape.total(), conc).await;
            let stored = rb.stored().await;
            rb.close().await;
            out["store"] = json!("none");
            (r?, 0, json!({ "in_flight": conc, "broker_stored": stored }))
        }
        Mode::Reference | Mode::LeaseReference | Mode::Statements => {
            let fresh =
                db::prepare(&a.conn.database_url, &tag, &shape, a.store, 2, a.stats).await?;
            let url = &a.conn.database_url;
            let r = match a.mode {
                Mode::Reference => db::reference_drain(&fresh, url, a.relays, a.batch).await,
                Mode::LeaseReference => {
                    db::lease_reference_drain(&fresh, url, a.relays, a.batch).await
                }
                _ => db::statement_profile(&fresh, url, a.batch, a.max_per_key).await,
            };
            let left = fresh.not_completed().await;
            fresh.drop().await;
            let r = r?;
            out["store"] = json!("plain-sql");
            out["broker"] = json!("none");
            let mut extra = json!({ "not_completed": left? });
            if a.mode == Mode::Statements {
                let per = |s: f64| round(s / r.cycles.max(1) as f64 * 1000.0, 3);
                extra["profile"] = json!({
                    "begin_ms": per(r.phases[0]),
                    "fetch_stmt_ms": per(r.phases[1]),
                    "complete_stmt_ms": per(r.phases[2]),
                    "commit_ms": per(r.phases[3]),
                    "cycle_ms": per(r.seconds),
                });
            }
            (r.seconds, r.cycles, extra)
        }
        Mode::Capacity => unreachable!("handled above"),
        Mode::Relay => {
            let fresh =
                db::prepare(&a.conn.database_url, &tag, &shape, a.store, 2, a.stats).await?;
            let rb = match brokers::open(a.broker, &a.conn, &tag).await {
                Ok(b) => b,
                Err(e) => {
                    fresh.drop().await;
                    return Err(e);
                }
            };
            let r = relay_drain(&a, &shape, &fresh, &rb).await;
            let stored = rb.stored().await;
            let left = fresh.not_completed().await;
            rb.close().await;
            fresh.drop().await;
            let (s, c, mut extra) = r?;
            extra["not_completed"] = json!(left?);
            extra["broker_stored"] = json!(stored);
            (s, c, extra)
        }
    };
    out["seconds"] = json!(round(seconds, 4));
    out["events_per_s"] = json!(round(shape.total() as f64 / seconds, 0));
    out["cycles"] = json!(cycles);
    if let (Value::Object(o), Value::Object(e)) = (&mut out, extra) {
        o.extend(e);
    }
    out["peak_rss_mb"] = json!(peak_rss_mb());
    Ok(out)
}

async fn relay_drain(
    a: &RunArgs,
    shape: &Shape,
    fresh: &db::Fresh,
    rb: &brokers::RunBroker,
) -> Result<(f64, usize, Value), BenchError> {
    let total = shape.total();
    let phases = Arc::new(Phases::default());
    let repo = db::repository(a.store, &a.conn.database_url, fresh, a.relays as u32 + 1).await?;
    // Before the clock starts, open every connection of the pool and prepare the fetch on it,
    // as in a relay that is already running: R + 1 concurrent fetches with a topic filter that
    // matches no row (they lock nothing).
    let warm = txoutbox_core::FetchRequest::new(
        txoutbox_core::WorkerId::new("bench-warm-up").expect("valid worker id"),
        a.batch,
    )
    .max_per_key(a.max_per_key)
    .filter(txoutbox_core::FetchFilter::topics([
        "bench-warm-up-matches-nothing",
    ]));
    let warmed = futures::future::try_join_all((0..=a.relays).map(|_| repo.fetch_and_lock(&warm)))
        .await
        .map_err(|e| BenchError(format!("warm-up: {e}")))?;
    if warmed.iter().any(|w| !w.is_empty()) {
        return Err(BenchError("the warm-up fetch returned rows".into()));
    }
    let mut broker: Arc<dyn Broker> = rb.broker.clone();
    if a.profile {
        broker = Arc::new(TimedBroker {
            inner: broker,
            phases: phases.clone(),
        });
    }
    let order = a
        .check_order
        .then(|| Arc::new(OrderCheck::new(broker.clone())));
    if let Some(o) = &order {
        broker = o.clone();
    }
    let mut relays = Vec::new();
    for i in 0..a.relays {
        let r: Arc<dyn OutboxRepository> = if a.profile {
            Arc::new(Timed::new(repo.clone(), phases.clone()))
        } else {
            repo.clone()
        };
        relays.push(Arc::new(
            Relay::builder(r, broker.clone())
                .worker_id(format!("bench-{i}"))
                .batch_size(a.batch)
                .max_per_key(a.max_per_key)
                .publish_concurrency(a.publish_concurrency)
                .delivery(a.delivery)
                .build()
                .map_err(|e| BenchError(format!("relay settings: {e}")))?,
        ));
    }
    let done = Arc::new(AtomicUsize::new(0));
    let cycles = Arc::new(AtomicUsize::new(0));
    let empty = Arc::new(AtomicUsize::new(0));
    let token = CancellationToken::new();
    let started = Instant::now();
    let mut tasks = Vec::new();
    for relay in relays {
        let (done, cycles, empty, token, phases) = (
            done.clone(),
            cycles.clone(),
            empty.clone(),
            token.clone(),
            phases.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut idle_since: Option<Instant> = None;
            while done.load(Ordering::Relaxed) < total {
                let t = Instant::now();
                let r = relay
                    .cycle(&token)
                    .await
                    .map_err(|e| BenchError(format!("fetch failed: {e}")))?;
                if r.fetched.is_empty() {
                    // Every remaining row is locked by another relay, or nothing is left.
                    empty.fetch_add(1, Ordering::Relaxed);
                    let since = *idle_since.get_or_insert(t);
                    if since.elapsed() > Duration::from_secs(30) {
                        return Err(BenchError(format!(
                            "no row fetched for 30 s with {} of {total} completed",
                            done.load(Ordering::Relaxed)
                        )));
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                idle_since = None;
                phases.add_cycle(t.elapsed());
                cycles.fetch_add(1, Ordering::Relaxed);
                if r.commit_failed
                    || !r.counted.is_empty()
                    || !r.transient.is_empty()
                    || !r.deferred.is_empty()
                    || !r.lease_lost.is_empty()
                {
                    return Err(BenchError(format!(
                        "a cycle did not complete its rows: counted {:?}, transient {:?}, deferred {:?}, lease lost {}, commit failed {}",
                        r.counted.first(),
                        r.transient.first(),
                        r.deferred.first(),
                        r.lease_lost.len(),
                        r.commit_failed
                    )));
                }
                done.fetch_add(r.completed.len(), Ordering::Relaxed);
            }
            Ok::<(), BenchError>(())
        }));
    }
    let mut first_err = None;
    for t in tasks {
        let r = t
            .await
            .map_err(|e| BenchError(format!("relay task: {e}")))
            .and_then(|r| r);
        if let Err(e) = r {
            first_err.get_or_insert(e);
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    if let Some(e) = first_err {
        return Err(e);
    }
    let cycles = cycles.load(Ordering::Relaxed);
    let mut extra = json!({ "empty_fetches": empty.load(Ordering::Relaxed) });
    if let Some(o) = order {
        extra["order_checked"] = json!(o.checked.load(Ordering::Relaxed));
        extra["in_order"] = json!(o.violations.load(Ordering::Relaxed) == 0);
    }
    if a.profile {
        extra["profile"] = phases.json(cycles);
    }
    Ok((seconds, cycles, extra))
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Run(a) => run(a).await.map(|line| println!("{line}")),
        Cmd::Suite(s) => suite::suite(s).await,
        Cmd::Burst(b) => burst::burst(b).await,
        Cmd::Capacity(c) => capacity::search(c).await,
        Cmd::Inbox(i) => inbox::inbox(i).await,
        Cmd::E2e(e) => e2e::e2e(e).await,
    };
    match res {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("outbox-bench: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
