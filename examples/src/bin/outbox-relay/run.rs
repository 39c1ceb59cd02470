//! `outbox-relay run`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::Args;
use outbox_core::backoff::Backoff;
use outbox_core::{CancellationToken, OutboxRepository, Relay, RepositoryError};
use outbox_examples::metrics::MetricsStep;
use outbox_postgres::TableName;
use sqlx::PgPool;
use tokio::sync::Notify;
use tracing::Instrument;

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
    pub delivery: outbox_core::DeliveryMode,
    #[arg(long, env = "OUTBOX_LEASE", default_value = "300s", value_parser = parse_dur)]
    pub lease: Duration,
    /// How long an idle relay waits between fetches when no NOTIFY wakes it.
    #[arg(long, env = "OUTBOX_POLL_INTERVAL", default_value = "5s", value_parser = parse_dur)]
    pub poll_interval: Duration,
    /// Backoff base after a counted failure (0 = retry at once).
    #[arg(long, env = "OUTBOX_RETRY_BACKOFF_BASE", default_value = "10s", value_parser = parse_dur)]
    pub retry_backoff_base: Duration,
    /// Backoff cap.
    #[arg(long, env = "OUTBOX_RETRY_BACKOFF_CAP", default_value = "3600s", value_parser = parse_dur)]
    pub retry_backoff_cap: Duration,
    /// Longest wait for one publish's acknowledgement (below --lease).
    #[arg(long, env = "OUTBOX_PUBLISH_TIMEOUT", default_value = "30s", value_parser = parse_dur)]
    pub publish_timeout: Duration,
    /// Exits 0 once nothing is due or held (for batch jobs and benchmarks). Rows waiting for a
    /// retry later do not keep it running.
    #[arg(long, env = "OUTBOX_UNTIL_DRAINED")]
    pub until_drained: bool,
    /// Polls only: no LISTEN on the table's channel.
    #[arg(long, env = "OUTBOX_NO_LISTEN")]
    pub no_listen: bool,
    /// Interval of the one-line summary (events/s, backlog, blocked keys, oldest due age); 0 = off.
    #[arg(long, env = "OUTBOX_SUMMARY_INTERVAL", default_value = "10s", value_parser = parse_dur)]
    pub summary_interval: Duration,
    /// Prefix of the metric names (R70: ^[a-zA-Z_][a-zA-Z0-9_]*$, joined with `_`).
    #[arg(long, env = "OUTBOX_METRICS_PREFIX")]
    pub metrics_prefix: Option<String>,
    /// Serves Prometheus metrics on this address, e.g. 127.0.0.1:9000 (cargo feature `prometheus`).
    #[arg(long, env = "OUTBOX_METRICS_ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

fn parse_delivery(s: &str) -> std::result::Result<outbox_core::DeliveryMode, String> {
    s.parse()
        .map_err(|e: outbox_core::ConfigError| e.to_string())
}

fn usage<E: std::fmt::Display>(flag: &'static str) -> impl Fn(E) -> CliError {
    move |e| CliError::usage(format!("{flag}: {e}"))
}

fn worker_ids(a: &RunArgs) -> Result<Vec<String>> {
    let base = a
        .worker_id
        .clone()
        .unwrap_or_else(outbox_examples::default_worker_id);
    let ids: Vec<String> = if a.loops == 1 {
        vec![base]
    } else {
        (1..=a.loops).map(|i| format!("{base}-{i}")).collect()
    };
    for id in &ids {
        outbox_core::WorkerId::new(id.clone()).map_err(usage("--worker-id"))?;
    }
    Ok(ids)
}

fn install_prometheus(addr: Option<std::net::SocketAddr>) -> Result<()> {
    let Some(addr) = addr else { return Ok(()) };
    #[cfg(feature = "prometheus")]
    {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| CliError::usage(format!("--metrics-addr {addr}: {e}")))?;
        tracing::info!(%addr, "serving Prometheus metrics on /metrics");
        Ok(())
    }
    #[cfg(not(feature = "prometheus"))]
    {
        Err(CliError::usage(format!(
            "--metrics-addr {addr} needs the Prometheus exporter; rebuild with `cargo build -p outbox-examples --features prometheus --bin outbox-relay`"
        )))
    }
}

/// Cancels `token` on SIGINT or SIGTERM.
fn on_signals(token: CancellationToken) {
    tokio::spawn(async move {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        #[cfg(not(unix))]
        let _ = ctrl_c.await;
        tracing::info!("signal received: finishing the cycle in flight and releasing the rest");
        token.cancel();
    });
}

/// LISTENs on the table's channel and wakes every loop on each notification.
async fn listen(pool: &PgPool, table: &TableName, wakers: Vec<Arc<Notify>>) -> Result<()> {
    let channel = table.notify_channel();
    outbox_examples::wake::spawn_listener(pool, table, wakers)
        .await
        .map_err(|e| CliError::new(code::DATABASE, format!("LISTEN {channel}: {e}")))?;
    tracing::info!(%channel, "listening for wake-ups");
    Ok(())
}

struct Shared {
    completed: AtomicU64,
    token: CancellationToken,
    until_drained: bool,
    store: Arc<store::Store>,
}

fn fatal(table: &TableName, e: RepositoryError) -> Option<CliError> {
    match e {
        RepositoryError::Schema(_) => Some(CliError::repo(&table.to_string(), e)),
        _ => None,
    }
}

async fn relay_loop(relay: Relay, wake: Arc<Notify>, sh: Arc<Shared>) -> Result<()> {
    let worker = relay.config().worker_id().to_string();
    let poll = relay.config().poll_interval();
    loop {
        if sh.token.is_cancelled() {
            return Ok(());
        }
        let span = tracing::info_span!(
            "outbox.cycle",
            worker.id = %worker,
            fetched = tracing::field::Empty,
            completed = tracing::field::Empty,
            failed = tracing::field::Empty,
        );
        let res = relay.cycle(&sh.token).instrument(span.clone()).await;
        let (again, fetched) = match res {
            Ok(r) => {
                span.record("fetched", r.fetched.len());
                span.record("completed", r.completed.len());
                span.record("failed", r.counted.len() + r.transient.len());
                if !r.fetched.is_empty() {
                    // One line per cycle that fetched something (RUST_LOG=outbox_relay=debug),
                    // inside the cycle's span so its fields come along.
                    tracing::debug!(
                        parent: &span,
                        fetched = r.fetched.len(),
                        completed = r.completed.len(),
                        failed = r.counted.len() + r.transient.len(),
                        "cycle"
                    );
                }
                sh.completed
                    .fetch_add(r.completed.len() as u64, Ordering::Relaxed);
                (
                    !r.fetched.is_empty() && !r.broker_unreachable && !r.breaker_open,
                    r.fetched.len(),
                )
            }
            Err(e) => {
                if let Some(f) = fatal(&sh.store.table, e.clone_shallow()) {
                    return Err(f);
                }
                tracing::warn!(error = %e, transient = e.is_transient(), "fetch failed; waiting for the next poll");
                (false, usize::MAX)
            }
        };
        if again {
            continue;
        }
        if sh.until_drained && fetched == 0 {
            match sh.store.drained().await {
                Ok(true) => {
                    tracing::info!(%worker, "drained: nothing due or held");
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "drain check failed"),
            }
        }
        let wait = if sh.until_drained {
            poll.min(Duration::from_millis(200))
        } else {
            poll
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = wake.notified() => {}
            _ = sh.token.cancelled() => return Ok(()),
        }
    }
}

trait CloneShallow {
    fn clone_shallow(&self) -> RepositoryError;
}

impl CloneShallow for RepositoryError {
    fn clone_shallow(&self) -> RepositoryError {
        match self {
            RepositoryError::Schema(m) => RepositoryError::Schema(m.clone()),
            other => RepositoryError::Other(other.to_string()),
        }
    }
}

async fn summary(
    repo: Arc<dyn OutboxRepository>,
    sh: Arc<Shared>,
    every: Duration,
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
        let counts = repo.counts().await;
        let blocked = repo.blocked_keys(lease, 10_000).await;
        let oldest = repo.oldest_due_age().await;
        match (counts, blocked, oldest) {
            (Ok(c), Ok(b), Ok(o)) => {
                let backlog: i64 = c
                    .iter()
                    .filter(|c| c.status == outbox_core::Status::Pending)
                    .map(|c| c.count)
                    .sum();
                metrics.record_backlog(backlog.max(0) as u64, b.len() as u64, o);
                tracing::info!(
                    "summary: {rate:.1} events/s, backlog {backlog}, blocked keys {}, oldest due {}",
                    b.len(),
                    o.map_or("-".to_string(), |d| format!("{:.1}s", d.as_secs_f64()))
                );
            }
            (c, b, o) => {
                let e = c.err().or(b.err()).or(o.err()).map(|e| e.to_string());
                tracing::warn!(error = ?e, "summary: {rate:.1} events/s; backlog query failed");
            }
        }
    }
}

pub async fn run(a: RunArgs) -> Result<()> {
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
    // Settings are checked before anything connects: build a throwaway relay on a no-op repo.
    check_settings(&a, &ids[0], backoff)?;
    install_prometheus(a.metrics_addr)?;

    let pool_size = a.loops * 2 + 3;
    let st = Arc::new(store::open(&a.db.database_url, a.db.store, &a.db.table, pool_size).await?);
    let broker = broker::build(&a.broker).await?;
    let token = CancellationToken::new();
    on_signals(token.clone());

    let mut relays = Vec::new();
    for id in &ids {
        let relay = Relay::builder(st.repo.clone(), broker.clone())
            .worker_id(id.clone())
            .batch_size(a.batch_size)
            .max_per_key(a.max_per_key)
            .publish_concurrency(a.publish_concurrency)
            .lease_ttl(a.lease)
            .poll_interval(a.poll_interval)
            .publish_timeout(a.publish_timeout)
            .delivery(a.delivery)
            .backoff(backoff)
            .step(Arc::new(metrics.clone()))
            .build()
            .map_err(|e| CliError::usage(e.to_string()))?;
        relays.push(relay);
    }
    let wakers: Vec<Arc<Notify>> = relays.iter().map(|r| r.waker()).collect();
    if !a.no_listen {
        listen(&st.pool, &st.table, wakers.clone()).await?;
    }
    tracing::info!(
        table = %st.table,
        store = ?a.db.store,
        broker = ?a.broker.broker,
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
    let summary_task = (!a.summary_interval.is_zero()).then(|| {
        tokio::spawn(summary(
            st.repo.clone(),
            sh.clone(),
            a.summary_interval,
            a.lease,
            metrics.clone(),
        ))
    });
    let tasks: Vec<_> = relays
        .into_iter()
        .zip(wakers)
        .map(|(r, w)| tokio::spawn(relay_loop(r, w, sh.clone())))
        .collect();
    let mut result = Ok(());
    for t in tasks {
        match t.await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                token.cancel();
                if result.is_ok() {
                    result = Err(e);
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
    let repo = Arc::new(outbox_core::InMemoryRepository::default());
    Relay::builder(repo, Arc::new(outbox_core::broker::NoopBroker))
        .worker_id(id)
        .batch_size(a.batch_size)
        .max_per_key(a.max_per_key)
        .publish_concurrency(a.publish_concurrency)
        .lease_ttl(a.lease)
        .poll_interval(a.poll_interval)
        .publish_timeout(a.publish_timeout)
        .delivery(a.delivery)
        .backoff(backoff)
        .build()
        .map(drop)
        .map_err(|e| CliError::usage(format!("{e} (check --batch-size, --max-per-key, --publish-concurrency, --lease, --publish-timeout, --delivery)")))
}
