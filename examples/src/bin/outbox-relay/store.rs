//! Connecting to the database and picking the store (sqlx or diesel-async).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use outbox_core::OutboxRepository;
use outbox_postgres::{PgConfig, PgOutboxRepository, TableName};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

use crate::error::{CliError, Result, code};

/// Which backend crate runs the queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// outbox-postgres on sqlx (always compiled in).
    Sqlx,
    /// outbox-diesel on diesel-async (cargo feature `diesel`).
    Diesel,
}

/// A connected store: the repository the relay and the ops commands use, and a sqlx pool for
/// the checks and LISTEN (the same database; sqlx is always compiled in).
pub struct Store {
    pub repo: Arc<dyn OutboxRepository>,
    pub pool: PgPool,
    pub table: TableName,
}

/// Parses the URL: a malformed one is a usage error (exit 2).
pub fn parse_url(url: &str) -> Result<PgConnectOptions> {
    if url.trim().is_empty() {
        return Err(CliError::usage(
            "no database URL: pass --database-url or set DATABASE_URL, e.g. postgres://user@127.0.0.1:5432/db",
        ));
    }
    let scheme = url.split("://").next().unwrap_or("");
    if !url.contains("://") || !matches!(scheme, "postgres" | "postgresql") {
        return Err(CliError::usage(format!(
            "invalid --database-url: it must start with postgres:// or postgresql://, got scheme {scheme:?}; expected postgres://user[:password]@host[:port]/database"
        )));
    }
    PgConnectOptions::from_str(url).map_err(|e| {
        CliError::usage(format!(
            "invalid --database-url: {e}; expected postgres://user[:password]@host[:port]/database"
        ))
    })
}

fn where_(o: &PgConnectOptions) -> String {
    format!(
        "{}:{}/{}",
        o.get_host(),
        o.get_port(),
        o.get_database().unwrap_or("")
    )
}

/// Opens a sqlx pool and checks the connection (exit 3 when it fails).
pub async fn connect_pool(url: &str, max: u32) -> Result<PgPool> {
    let opts = parse_url(url)?;
    let at = where_(&opts);
    let fail = |e: String| {
        CliError::new(
            code::DATABASE,
            format!(
                "could not connect to PostgreSQL at {at}: {e}; check that the server runs and the URL (--database-url / DATABASE_URL)"
            ),
        )
    };
    // One connection first, for the driver's own reason when it fails (refused, unknown
    // database, authentication); the pool then opens connections as needed.
    let first = tokio::time::timeout(Duration::from_secs(10), opts.connect())
        .await
        .map_err(|_| fail("no answer within 10 s".into()))?
        .map_err(|e| fail(e.to_string()))?;
    drop(first);
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(opts))
}

/// Whether the table exists.
pub async fn table_exists(pool: &PgPool, table: &TableName) -> Result<bool> {
    sqlx::query_scalar::<_, bool>("SELECT to_regclass($1) IS NOT NULL")
        .bind(table.dotted())
        .fetch_one(pool)
        .await
        .map_err(|e| CliError::new(code::DATABASE, format!("checking table {table}: {e}")))
}

/// Fails with exit 3 and the advice to migrate when the table is missing.
pub async fn require_table(pool: &PgPool, table: &TableName) -> Result<()> {
    if table_exists(pool, table).await? {
        Ok(())
    } else {
        Err(CliError::new(
            code::DATABASE,
            format!(
                "the outbox table {table} does not exist; run `outbox-relay migrate --table {table}` first"
            ),
        ))
    }
}

/// Connects, checks the table and builds the repository of `kind`.
pub async fn open(url: &str, kind: StoreKind, table: &TableName, pool_size: u32) -> Result<Store> {
    let pool = connect_pool(url, pool_size).await?;
    require_table(&pool, table).await?;
    let repo: Arc<dyn OutboxRepository> = match kind {
        StoreKind::Sqlx => Arc::new(PgOutboxRepository::new(
            pool.clone(),
            PgConfig::default().table(table.clone()),
        )),
        StoreKind::Diesel => diesel_repo(url, table, pool_size)?,
    };
    Ok(Store {
        repo,
        pool,
        table: table.clone(),
    })
}

#[cfg(feature = "diesel")]
fn diesel_repo(url: &str, table: &TableName, pool_size: u32) -> Result<Arc<dyn OutboxRepository>> {
    let settings = outbox_diesel::PoolSettings::default()
        .max_size(pool_size as usize)
        .map_err(|e| CliError::usage(e.to_string()))?;
    let pool = outbox_diesel::build_pool(url, &settings)
        .map_err(|e| CliError::usage(format!("diesel pool: {e}")))?;
    Ok(Arc::new(outbox_diesel::DieselOutboxRepository::new(
        pool,
        outbox_diesel::DieselConfig::default().table(table.clone()),
    )))
}

#[cfg(not(feature = "diesel"))]
fn diesel_repo(
    _url: &str,
    _table: &TableName,
    _pool_size: u32,
) -> Result<Arc<dyn OutboxRepository>> {
    Err(not_compiled())
}

/// The error for `--store diesel` in a binary built without the feature.
#[cfg_attr(feature = "diesel", allow(dead_code))]
pub fn not_compiled() -> CliError {
    CliError::usage(
        "--store diesel is not compiled into this binary; rebuild with `cargo build -p outbox-examples --features diesel --bin outbox-relay`, or use --store sqlx (same table, same behaviour)",
    )
}
