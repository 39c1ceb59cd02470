//! `outbox-relay run`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use sqlx::PgPool;
use tokio::sync::Notify;
use txoutbox_core::backoff::Backoff;
use txoutbox_core::metrics::MetricsStep;
use txoutbox_core::relay::{CycleReport, LoopBackoff, LoopControl, LoopHooks, RunOptions};
use txoutbox_core::{CancellationToken, OutboxRepository, Relay, RunError};
use txoutbox_postgres::TableName;

use crate::broker::{self, BrokerArgs};
use crate::error::{CliError, Result, code};
use crate::{DbArgs, parse_dur, store};

/// Flags of `run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub db: DbArgs,
    #[command(flatten)]
    pub broker: BrokerArgs,
    /// This relay's worker id (R10: at most 255 of A-Z a-z 0-9 . - / :). Default: host-pid.
    /// With --loops N > 1 each loop is `<id>-<n>`.
    #[arg(long, env = "OUTBOX_WORKER_ID")]
    pub worker_id: Option<String>,
    /// Relay loops in this process, each with its own worker id.
    #[arg(long, env = "OUTBOX_LOOPS", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub loops: u32,
    /// PostgreSQL connections of the relay's pool, LISTEN's included: at least --loops + 1
    /// (--loops with --no-listen). LISTEN holds one for good, a loop uses one at a time, the
    /// summary's backlog queries wait for free ones. Default: 2 × --loops + 3.
    #[arg(long, env = "OUTBOX_MAX_CONNECTIONS", value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: Option<u32>,
    /// Rows per fetch.
    #[arg(long, env = "OUTBOX_BATCH_SIZE", default_value_t = 50)]
    pub batch_size: usize,
    /// Rows per key per fetch (1 = head only).
    #[arg(long, env = "OUTBOX_MAX_PER_KEY", default_value_t = 16)]
    pub max_per_key: usize,
    /// Keys published at once (each key strictly in order).
    #[arg(long, env = "OUTBOX_PUBLISH_CONCURRENCY", default_value_t = 16)]
    pub publish_concurrency: usize,
    /// Lease TTL: a row locked longer than this may be taken by another relay.
    /// How rows are delivered: `lease` (stamp a lease, publish with no transaction open, write
    /// outcomes in a second transaction) or `transaction` (hold the rows' row locks in one
    /// transaction while publishing, write each row once, free them at once on a crash). See
    /// the README, "Choosing the delivery mode".
    #[arg(long, env = "OUTBOX_DELIVERY", default_value = "lease", value_parser = parse_delivery)]
    pub delivery: txoutbox_core::DeliveryMode,
    /// What the failure that spends a row's last attempt writes: `release` (the row becomes
    /// failed and its key goes on without it) or `park` (the row stays pending and holds its
    /// key until `outbox-relay redrive` or `discard`).
    #[arg(long, env = "OUTBOX_ON_EXHAUSTED", default_value = "release", value_parser = parse_exhausted)]
    pub on_exhausted: txoutbox_core::repository::OnExhausted,
    #[arg(long, env = "OUTBOX_LEASE", default_value = "300s", value_parser = parse_dur)]
    pub lease: Duration,
    /// How long an idle relay waits between fetches when no NOTIFY wakes it.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "5s", value_parser = parse_dur)]
    pub poll_interval: Duration,
    /// A key parked longer than this is logged at warn, once per key, by the summary task
    /// (R193; at least 1s).
    #[arg(long, env = "OUTBOX_PARK_ALERT_AFTER", default_value = "15m", value_parser = parse_dur)]
    pub park_alert_after: Duration,
    /// Backoff base after a counted failure (0 = retry at once).
    #[arg(long, env = "OUTBOX_RETRY_BACKOFF_BASE", default_value = "10s", value_parser = parse_dur)]
    pub retry_backoff_base: Duration,
    /// Backoff cap.
    #[arg(long, env = "OUTBOX_RETRY_BACKOFF_CAP", default_value = "3600s", value_parser = parse_dur)]
    pub retry_backoff_cap: Duration,
    /// Longest wait for one publish's acknowledgement (below --lease).
    #[arg(long, env = "OUTBOX_PUBLISH_TIMEOUT", default_value = "30s", value_parser = parse_dur)]
    pub publish_timeout: Duration,
    /// First wait after a cycle found the broker unreachable; it doubles per such cycle up to
    /// --outage-backoff-cap. The broker's reconnection (NATS) or a successful probe (Redis PING)
    /// starts the next cycle at once.
    #[arg(long, env = "OUTBOX_OUTAGE_BACKOFF_BASE", default_value = "1s", value_parser = parse_dur)]
    pub outage_backoff_base: Duration,
    /// Longest wait between two cycles during a broker outage.
    #[arg(long, env = "OUTBOX_OUTAGE_BACKOFF_CAP", default_value = "30s", value_parser = parse_dur)]
    pub outage_backoff_cap: Duration,
    /// Exits 0 once nothing is due or held (for batch jobs and benchmarks). Rows waiting for a
    /// retry later do not keep it running.
    #[arg(long, env = "OUTBOX_UNTIL_DRAINED")]
    pub until_drained: bool,
    /// Polls only: no LISTEN on the table's channel.
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    pub no_listen: bool,
    /// The wake-up check (R196): a probe NOTIFY after LISTEN and whenever this long passes
    /// without a notification (at least 1s).
    #[arg(long, env = "OUTBOX_NOTIFY_CHECK_INTERVAL", default_value = "60s", value_parser = parse_dur)]
    pub notify_check_interval: Duration,
    /// While the probe does not arrive (LISTEN silent, e.g. through a transaction-pooling
    /// proxy), the loops poll this often (at least 10ms).
    #[arg(long, env = "OUTBOX_FALLBACK_POLL_INTERVAL", default_value = "500ms", value_parser = parse_dur)]
    pub fallback_poll_interval: Duration,
    /// Interval of the one-line summary (events/s, backlog, blocked keys, oldest due age); 0 = off
    /// (with --metrics-addr the backlog gauges are still updated, every 10 s).
    #[arg(long, env = "OUTBOX_SUMMARY_INTERVAL", default_value = "10s", value_parser = parse_dur)]
    pub summary_interval: Duration,
    /// Prefix of the metric names (R70: ^[a-zA-Z_][a-zA-Z0-9_]*$, joined with `_`).
    #[arg(long, env = "OUTBOX_METRICS_PREFIX")]
    pub metrics_prefix: Option<String>,
    /// Serves Prometheus metrics on this address, e.g. 127.0.0.1:9000 (cargo feature `prometheus`).
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

fn parse_delivery(s: &str) -> std::result::Result<txoutbox_core::DeliveryMode, String> {
    s.parse()
        .map_err(|e: txoutbox_core::ConfigError| e.to_string())
}

fn parse_exhausted(s: &str) -> std::result::Result<txoutbox_core::repository::OnExhausted, String> {
    s.parse()
        .map_err(|e: txoutbox_core::ConfigError| e.to_string())
}

fn usage<E: std::fmt::Display>(flag: &'static str) -> impl Fn(E) -> CliError {
    move |e| CliError::usage(format!("{flag}: {e}"))
}

fn worker_ids(a: &RunArgs) -> Result<Vec<String>> {
    let base = a
        .worker_id
        .clone()
        .unwrap_or_else(txoutbox_examples::default_worker_id);
    let ids: Vec<String> = if a.loops == 1 {
        vec![base]
    } else {
        (1..=a.loops).map(|i| format!("{base}-{i}")).collect()
    };
    for id in &ids {
        txoutbox_core::WorkerId::new(id.clone()).map_err(usage("--worker-id"))?;
    }
    Ok(ids)
}

/// The buckets of every `_seconds` histogram (publish duration, write-to-ack lag, handler
/// duration): 1 ms to 5 min.
#[cfg(feature = "prometheus")]
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0,
];

fn install_prometheus(addr: Option<std::net::SocketAddr>) -> Result<()> {
    let Some(addr) = addr else { return Ok(()) };
    #[cfg(feature = "prometheus")]
    {
        use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
        PrometheusBuilder::new()
            .with_http_listener(addr)
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .map_err(|e| CliError::usage(format!("--metrics-addr {addr}: {e}")))?
            .install()
            .map_err(|e| CliError::usage(format!("--metrics-addr {addr}: {e}")))?;
        tracing::info!(%addr, "serving Prometheus metrics on /metrics");
        Ok(())
    }
    #[cfg(not(feature = "prometheus"))]
    {
        Err(CliError::usage(format!(
            "--metrics-addr {addr} needs the Prometheus exporter; rebuild with `cargo build -p txoutbox-examples --features prometheus --bin outbox-relay`"
        )))
    }
}

/// The LISTEN task of the chosen store (kept alive while the relay runs).
enum Listener {
    Sqlx(#[allow(dead_code)] txoutbox_postgres::WakeListener),
    #[cfg(feature = "diesel")]
    Diesel(#[allow(dead_code)] txoutbox_diesel::WakeListener),
}

/// LISTENs on the table's channel with the chosen store's listener (sqlx's `PgListener`, or
/// diesel-async's notification stream) and wakes every loop on each notification; the
/// listener reconnects by itself and wakes the loops once when it is back.
async fn listen(
    a: &RunArgs,
    pool: &PgPool,
    table: &TableName,
    wakers: Vec<Arc<Notify>>,
) -> Result<Listener> {
    let channel = table.notify_channel();
    let fail = |e: String| {
        CliError::new(
            code::DATABASE,
            format!("LISTEN {channel}: {e}; pass --no-listen to poll only"),
        )
    };
    let conn = &a.db.conn;
    let options = txoutbox_postgres::wake::WakeOptions::default()
        .pooler(conn.pooler)
        .check(wake_check(a)?);
    if conn.pooler == txoutbox_postgres::Pooler::Transaction && conn.listen_url.is_none() {
        tracing::warn!(
            %channel,
            "--pooler transaction without --listen-url: the wake-up listener LISTENs through the same URL, and notifications do not pass a transaction-pooling proxy; give PostgreSQL's own address with --listen-url (OUTBOX_LISTEN_URL) (a LISTEN through the proxy also sends stray notifications to other clients of its server connection, which fail the statement they run). Until then the wake-up check finds LISTEN silent and the loops poll every --fallback-poll-interval"
        );
    }
    let l = match conn.store {
        store::StoreKind::Sqlx => {
            let options = match &conn.listen_url {
                Some(u) => options.listen_url(u.clone()),
                None => options,
            };
            Listener::Sqlx(
                txoutbox_postgres::WakeListener::spawn_with(pool, table, wakers, options)
                    .await
                    .map_err(|e| fail(txoutbox_core::redact::secrets(&e.to_string())))?,
            )
        }
        #[cfg(feature = "diesel")]
        store::StoreKind::Diesel => {
            let url = conn.listen_url.as_deref().unwrap_or(&conn.database_url);
            let probe_pool = txoutbox_diesel::build_pool(
                &conn.database_url,
                &txoutbox_diesel::PoolSettings::default()
                    .max_size(1)
                    .map_err(|e| CliError::usage(e.to_string()))?,
            )
            .map_err(|e| CliError::usage(format!("diesel pool: {e}")))?;
            Listener::Diesel(
                txoutbox_diesel::WakeListener::spawn_with(
                    &probe_pool,
                    table,
                    wakers,
                    options.listen_url(url),
                )
                .await
                .map_err(|e| fail(txoutbox_core::redact::secrets(&e.to_string())))?,
            )
        }
        #[cfg(not(feature = "diesel"))]
        store::StoreKind::Diesel => return Err(store::not_compiled()),
    };
    tracing::info!(%channel, store = ?a.db.conn.store, "listening for wake-ups");
    Ok(l)
}

/// The wake-up check's settings from the flags (R196).
fn wake_check(a: &RunArgs) -> Result<txoutbox_postgres::wake::WakeCheck> {
    txoutbox_postgres::wake::WakeCheck::default()
        .notify_check_interval(a.notify_check_interval)
        .and_then(|c| c.fallback_poll_interval(a.fallback_poll_interval))
        .map_err(|e| CliError::usage(e.to_string()))
}

struct Shared {
    completed: AtomicU64,
    token: CancellationToken,
    until_drained: bool,
    store: Arc<store::Store>,
}

/// The binary's additions to the library loop: the published count for the summary line and
/// the final log line, and with --until-drained the drain check when a cycle fetched nothing.
struct Hooks {
    sh: Arc<Shared>,
    worker: String,
}

#[async_trait::async_trait]
impl LoopHooks for Hooks {
    async fn after_cycle(&self, r: &CycleReport) {
        self.sh
            .completed
            .fetch_add(r.completed.len() as u64, Ordering::Relaxed);
    }

    async fn on_idle(&self) -> LoopControl {
        if !self.sh.until_drained {
            return LoopControl::Continue;
        }
        match self.sh.store.drained().await {
            Ok(true) => {
                tracing::info!(worker = %self.worker, "drained: nothing due or held");
                LoopControl::Stop
            }
            Ok(false) => LoopControl::Continue,
            Err(e) => {
                tracing::warn!(error = %e, "drain check failed");
                LoopControl::Continue
            }
        }
    }
}

/// Runs `attempt` until it succeeds, waiting (250 ms doubling to 5 s) after each failure that
/// is marked retryable and logging that it waits for `what` at `at` (password redacted); other
/// failures end it. `None` when shutdown came first, before or during an attempt.
async fn wait_for<T, F, Fut>(
    token: &CancellationToken,
    what: &str,
    at: &str,
    mut attempt: F,
) -> Result<Option<T>>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T>>,
{
    let backoff = LoopBackoff::new(Duration::from_millis(250), Duration::from_secs(5))
        .expect("valid constant back-off");
    let mut tries = 0u32;
    loop {
        // A stop signal ends the wait, even in the middle of an attempt (a connect that hangs).
        let tried = tokio::select! {
            r = attempt() => r,
            _ = token.cancelled() => return Ok(None),
        };
        match tried {
            Ok(v) => {
                if tries > 0 {
                    tracing::info!(%at, "{what} is reachable");
                }
                return Ok(Some(v));
            }
            Err(e) if e.retryable => {
                tries += 1;
                let wait = backoff.wait(tries);
                tracing::warn!(%at, tries, retry_in = ?wait, error = %e.message, "waiting for {what}");
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = token.cancelled() => return Ok(None),
                }
            }
            Err(e) => return Err(e),
        }
    }
}

/// Every `every`: queries the backlog and sets the gauges (kept up to date whether or not the
/// summary line is on), and with `log` logs the one-line summary.
async fn summary(
    repo: Arc<dyn OutboxRepository>,
    sh: Arc<Shared>,
    every: Duration,
    log: bool,
    lease: Duration,
    metrics: MetricsStep,
) {
    let mut last = Instant::now();
    let mut last_n = 0u64;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = sh.token.cancelled() => return,
        }
        let n = sh.completed.load(Ordering::Relaxed);
        let rate = (n - last_n) as f64 / last.elapsed().as_secs_f64().max(1e-9);
        (last, last_n) = (Instant::now(), n);
        match metrics.update_backlog(repo.as_ref(), lease).await {
            Ok(b) if log => tracing::info!(
                "summary: {rate:.1} events/s, backlog {}, blocked keys {} ({} parked), oldest due {}",
                b.pending,
                b.blocked_keys,
                b.parked_keys,
                b.oldest_due
                    .map_or("-".to_string(), |d| format!("{:.1}s", d.as_secs_f64()))
            ),
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(error = %e, "summary: {rate:.1} events/s; backlog query failed")
            }
        }
    }
}

pub async fn run(a: RunArgs) -> Result<()> {
    // The stop signal first: a SIGTERM while the relay checks its settings or waits for the
    // database or the broker stops it cleanly (exit 0) instead of killing it (R197).
    let token = txoutbox_core::signal::stop_on_signals().map_err(|e| {
        CliError::new(
            code::OTHER,
            format!("could not install the SIGINT/SIGTERM handlers: {e}"),
        )
    })?;
    let ids = worker_ids(&a)?;
    let backoff = Backoff::new(
        a.retry_backoff_base.as_secs_f64(),
        a.retry_backoff_cap.as_secs_f64(),
    )
    .map_err(usage("--retry-backoff-base/--retry-backoff-cap"))?;
    let metrics = match &a.metrics_prefix {
        Some(p) => MetricsStep::with_prefix(p).map_err(usage("--metrics-prefix"))?,
        None => MetricsStep::new(),
    };
    let metrics = metrics
        .park_alert_after(a.park_alert_after)
        .map_err(usage("--park-alert-after"))?;
    // Settings are checked before anything connects: build a throwaway relay on a no-op repo.
    check_settings(&a, &ids[0], backoff)?;
    install_prometheus(a.metrics_addr)?;

    let outage = LoopBackoff::new(a.outage_backoff_base, a.outage_backoff_cap)
        .map_err(usage("--outage-backoff-base/--outage-backoff-cap"))?;
    if !broker::compiled(a.broker.broker) {
        // Not worth waiting for: say so before connecting anything.
        broker::build(&a.broker).await?;
    }

    // Start-up waits for the database and the broker instead of exiting: under a supervisor an
    // exit is a crash loop. Only configuration errors end it.
    let least = a.loops + u32::from(!a.no_listen);
    let pool_size = match a.max_connections {
        Some(n) if n < least => {
            return Err(CliError::usage(format!(
                "--max-connections {n} is below {least}: each of the {} loop(s) needs a connection{}",
                a.loops,
                if a.no_listen {
                    ""
                } else {
                    " and LISTEN holds one (unless --no-listen)"
                }
            )));
        }
        Some(n) => n,
        None => a.loops * 2 + 3,
    };
    let db_at = txoutbox_core::redact::secrets(&a.db.conn.database_url);
    // The connection and the table check both wait out a server that is down or restarting
    // (a relay restarted during a PostgreSQL restart must not exit); a missing table or a
    // refused login ends the run.
    let Some(st) = wait_for(&token, "the database", &db_at, || async {
        let pool = store::connect_pool(&a.db.conn.database_url, pool_size).await?;
        store::open_on(pool, &a.db.conn, &a.db.table, pool_size).await
    })
    .await?
    else {
        return Ok(());
    };
    let st = Arc::new(st);
    let broker_at = broker::redacted_url(&a.broker);
    let Some(broker) = wait_for(&token, "the broker", &broker_at, || {
        broker::build(&a.broker)
    })
    .await?
    else {
        return Ok(());
    };

    let poll = if a.until_drained {
        a.poll_interval.min(Duration::from_millis(200))
    } else {
        a.poll_interval
    };
    let mut relays = Vec::new();
    for id in &ids {
        let relay = Relay::builder(st.repo.clone(), broker.clone())
            .worker_id(id.clone())
            .batch_size(a.batch_size)
            .max_per_key(a.max_per_key)
            .publish_concurrency(a.publish_concurrency)
            .lease_ttl(a.lease)
            .poll_interval(poll)
            .publish_timeout(a.publish_timeout)
            .delivery(a.delivery)
            .on_exhausted(a.on_exhausted)
            .backoff(backoff)
            .step(Arc::new(metrics.clone()))
            .build()
            .map_err(|e| CliError::usage(e.to_string()))?;
        relays.push(relay);
    }
    let wakers: Vec<Arc<Notify>> = relays.iter().map(|r| r.waker()).collect();
    let _listener = if a.no_listen {
        None
    } else {
        Some(listen(&a, &st.pool, &st.table, wakers).await?)
    };
    tracing::info!(
        table = %st.table,
        store = ?a.db.conn.store,
        broker = ?a.broker.broker,
        broker_url = %broker_at,
        workers = ?ids,
        until_drained = a.until_drained,
        "relay started"
    );
    let sh = Arc::new(Shared {
        completed: AtomicU64::new(0),
        token: token.clone(),
        until_drained: a.until_drained,
        store: st.clone(),
    });
    // The backlog gauges are kept up to date when metrics are served, even with the summary
    // line off (then every 10 s).
    let log_summary = !a.summary_interval.is_zero();
    let summary_task = (log_summary || a.metrics_addr.is_some()).then(|| {
        let every = if log_summary {
            a.summary_interval
        } else {
            Duration::from_secs(10)
        };
        tokio::spawn(summary(
            st.repo.clone(),
            sh.clone(),
            every,
            log_summary,
            a.lease,
            metrics.clone(),
        ))
    });
    let table = st.table.to_string();
    let tasks: Vec<_> = relays
        .into_iter()
        .map(|r| {
            let hooks = Arc::new(Hooks {
                sh: sh.clone(),
                worker: r.config().worker_id().to_string(),
            });
            let options = RunOptions::new().outage_backoff(outage).hooks(hooks);
            let token = token.clone();
            tokio::spawn(async move { r.run_with(token, options).await })
        })
        .collect();
    let mut result = Ok(());
    for t in tasks {
        match t.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                token.cancel();
                if result.is_ok() {
                    result = Err(match e {
                        RunError::Repository { source, tries } => {
                            let mut err = CliError::repo(&table, source);
                            err.message =
                                format!("{} (failed {tries} times in a row)", err.message);
                            err
                        }
                        other => CliError::new(code::OTHER, other.to_string()),
                    });
                }
            }
            Err(e) => {
                token.cancel();
                if result.is_ok() {
                    result = Err(CliError::new(
                        code::OTHER,
                        format!("a relay loop panicked: {e}"),
                    ));
                }
            }
        }
    }
    token.cancel();
    if let Some(t) = summary_task {
        let _ = t.await;
    }
    let n = sh.completed.load(Ordering::Relaxed);
    tracing::info!(published = n, "relay stopped");
    result
}

fn check_settings(a: &RunArgs, id: &str, backoff: Backoff) -> Result<()> {
    crate::broker_kr::check_timeouts(&a.broker, a.publish_timeout)?;
    let repo = Arc::new(txoutbox_core::InMemoryRepository::default());
    Relay::builder(repo, Arc::new(txoutbox_core::broker::NoopBroker))
        .worker_id(id)
        .batch_size(a.batch_size)
        .max_per_key(a.max_per_key)
        .publish_concurrency(a.publish_concurrency)
        .lease_ttl(a.lease)
        .poll_interval(a.poll_interval)
        .publish_timeout(a.publish_timeout)
        .delivery(a.delivery)
        .on_exhausted(a.on_exhausted)
        .backoff(backoff)
        .build()
        .map(drop)
        .map_err(|e| CliError::usage(format!("{e} (check --batch-size, --max-per-key, --publish-concurrency, --lease, --publish-timeout, --delivery)")))
}
