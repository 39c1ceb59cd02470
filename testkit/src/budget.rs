//! The connection budget of the tests: database URL, schema names, patient connecting.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use uuid::Uuid;

/// The default database URL of the tests.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// `DATABASE_URL` or the default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// A fresh schema name `obx_<12 hex>`.
pub fn fresh_schema_name() -> String {
    format!("obx_{}", &Uuid::new_v4().simple().to_string()[..12])
}

/// Connections the Postgres test harnesses of one test process hold at most at once, unless
/// `OUTBOX_TEST_PG_CONNECTIONS` says otherwise: the database's 100 are shared with other
/// clients (other test processes, other people), and trials running in parallel must not take
/// them all.
pub const DEFAULT_TEST_CONNECTIONS: u32 = 40;

/// How long a trial waits for its share of the budget, and for the database to accept a
/// connection, before it fails.
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(90);

pub(super) fn budget() -> &'static (Arc<tokio::sync::Semaphore>, u32) {
    static BUDGET: std::sync::OnceLock<(Arc<tokio::sync::Semaphore>, u32)> =
        std::sync::OnceLock::new();
    BUDGET.get_or_init(|| {
        let n = std::env::var("OUTBOX_TEST_PG_CONNECTIONS")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|n| *n >= 1)
            .unwrap_or(DEFAULT_TEST_CONNECTIONS);
        (Arc::new(tokio::sync::Semaphore::new(n as usize)), n)
    })
}

/// A share of the process's connection budget ([`DEFAULT_TEST_CONNECTIONS`]), held by a
/// harness for as long as its pool lives; dropping it gives the share back.
#[derive(Debug)]
pub struct ConnectionShare(Option<tokio::sync::OwnedSemaphorePermit>);

impl ConnectionShare {
    /// Whether the share came out of the budget (false: granted over it after the wait).
    pub fn is_within_budget(&self) -> bool {
        self.0.is_some()
    }
}

/// Reserves `n` connections of the process's budget, waiting while other trials hold it. A
/// trial that takes a second share while holding one could wait for trials that wait for it, so
/// after [`CONNECT_PATIENCE`] the share is granted anyway (with a note on stderr): the budget
/// then stretches instead of the tests deadlocking. The semaphore is runtime-independent, so
/// trials on separate tokio runtimes share it.
pub async fn reserve_connections(n: u32) -> ConnectionShare {
    let (sem, total) = budget();
    let n = n.min(*total);
    match tokio::time::timeout(CONNECT_PATIENCE, sem.clone().acquire_many_owned(n)).await {
        Ok(Ok(p)) => ConnectionShare(Some(p)),
        _ => {
            eprintln!(
                "outbox test harness: waited {CONNECT_PATIENCE:?} for {n} of {total} test connections; going over the budget"
            );
            ConnectionShare(None)
        }
    }
}

/// Runs `connect` until it succeeds, waiting 20 ms doubling to 1 s between tries, for at most
/// [`CONNECT_PATIENCE`]: a database that is busy ("too many clients"), restarting or briefly
/// unreachable does not fail a trial. The last error is returned after that.
pub async fn connect_patiently<T, E, F, Fut>(mut connect: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + CONNECT_PATIENCE;
    let mut wait = Duration::from_millis(20);
    loop {
        match connect().await {
            Ok(v) => return Ok(v),
            Err(e) if tokio::time::Instant::now() + wait >= deadline => return Err(e),
            Err(_) => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// A small pool for one trial: at most `max` connections, sessions in `America/New_York`.
/// Opening connections waits while the database has no free slot (sqlx retries "too many
/// clients" until the acquire timeout, [`CONNECT_PATIENCE`]). Take a [`reserve_connections`]
/// share of `max` first.
pub async fn trial_pool(url: &str, max: u32) -> PgPool {
    let opts: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .expect("DATABASE_URL is a valid postgres URL");
    PgPoolOptions::new()
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                sqlx::query("SET TIME ZONE 'America/New_York'")
                    .execute(conn)
                    .await
                    .map(|_| ())
            })
        })
        .max_connections(max)
        .min_connections(0)
        .acquire_timeout(CONNECT_PATIENCE)
        .connect_with(opts)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is unreachable: {e}"))
}

/// `OUTBOX_TEST_POOLER_URL` or the local PgBouncer in transaction mode
/// (`scripts/pgbouncer start`: 127.0.0.1:6432, every database by its name), for the pooler
/// scenarios (R194 to R196, OP-08, OP-09).
pub fn pooler_url() -> String {
    std::env::var("OUTBOX_TEST_POOLER_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:6432/test".to_owned())
}

/// A small pool through a transaction-pooling proxy: as [`trial_pool`] without its session
/// `SET TIME ZONE` (a session setting does not belong to a client behind such a proxy), and
/// checked at once, so that a proxy that is not running fails the trial with its address.
/// PgBouncer's `default_pool_size` (20 in `scripts/pgbouncer`) bounds the server connections
/// all these pools use together: the proxy queues the rest.
pub async fn pooler_pool(url: &str, max: u32) -> PgPool {
    let opts: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .expect("the pooler URL is a valid postgres URL");
    PgPoolOptions::new()
        .max_connections(max)
        .min_connections(0)
        .acquire_timeout(CONNECT_PATIENCE)
        .connect_with(opts)
        .await
        .unwrap_or_else(|e| {
            panic!("the transaction-pooling proxy at {url} is unreachable: {e}; start it with `scripts/pgbouncer start`")
        })
}

/// The pool size of one harness.
pub const HARNESS_CONNECTIONS: u32 = 8;

/// The share of the budget one harness pool reserves: what a trial's pool holds at its busiest
/// in the suite's scenarios (a writer transaction, a fetch or outcome write, a fixture
/// statement), not its cap. Scenarios that open more (stand tests) rely on connecting
/// patiently. With 4 test threads and up to 3 harnesses per test, 4 × 3 × 3 = 36 stays under
/// the default budget, so no trial waits forever on another.
pub const HARNESS_SHARE: u32 = 3;
