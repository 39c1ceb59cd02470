//! Connecting to the database and picking the store (sqlx or diesel-async).

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};
use txoutbox_core::OutboxRepository;
use txoutbox_core::inbox::InboxRepository;
use txoutbox_postgres::sql::Statements;
use txoutbox_postgres::{
    Layout, PgConfig, PgOutboxRepository, Pooler, SqlxInbox, TableKind, TableName,
};
use uuid::Uuid;

use crate::error::{CliError, Result, TableRole, code};

/// Which backend crate runs the queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// outbox-postgres on sqlx (always compiled in).
    Sqlx,
    /// outbox-diesel on diesel-async (cargo feature `diesel`).
    Diesel,
}

/// A connected store: the repository the relay and the ops commands use, the queries the
/// repository trait has no method for ([`Store::drained`], [`Store::failed_ids`]) on the same
/// backend, and a sqlx pool (the same database; sqlx is always compiled in) for the first
/// connection and table checks, so both stores fail alike, and for LISTEN with `--store sqlx`
/// (`txoutbox_postgres::WakeListener`; with `--store diesel` it is `txoutbox_diesel::WakeListener`).
pub struct Store {
    pub repo: Arc<dyn OutboxRepository>,
    pub pool: PgPool,
    pub table: TableName,
    /// The pooler mode (R194): the statements below run as the repository's do.
    pub pooler: Pooler,
    direct: Direct,
}

/// The pool of the chosen backend, for the statements outside the repository trait.
enum Direct {
    Sqlx(PgPool),
    #[cfg(feature = "diesel")]
    Diesel(txoutbox_diesel::PgPool),
}

#[cfg(feature = "diesel")]
mod diesel_rows {
    #[derive(diesel::QueryableByName)]
    pub struct Drained {
        #[diesel(sql_type = diesel::sql_types::Bool)]
        pub drained: bool,
    }

    #[derive(diesel::QueryableByName)]
    pub struct Id {
        #[diesel(sql_type = diesel::sql_types::Uuid)]
        pub id: uuid::Uuid,
    }
}

impl Store {
    /// Whether the table is drained: no pending row is held (by any relay, expired leases
    /// included), and no row is a due head (pending, due, attempts left, and no earlier row of
    /// its key in line: due, tried or held). One statement, so one snapshot: a fetch of another
    /// relay that has not committed yet leaves its heads due here. Rows waiting for a later
    /// retry, and the rows behind them, do not count. Runs on the chosen backend.
    pub async fn drained(&self) -> std::result::Result<bool, String> {
        let sql = Statements::new(&self.table).for_pooler(self.pooler).drained;
        match &self.direct {
            Direct::Sqlx(pool) => {
                let mut c = pool.acquire().await.map_err(|e| e.to_string())?;
                let rows = txoutbox_postgres::driver::sqlx::rows(&mut c, &sql, Vec::new())
                    .await
                    .map_err(|e| e.to_string())?;
                let row = rows
                    .first()
                    .ok_or("the drained statement returned no row")?;
                sqlx::Row::try_get(row, 0).map_err(|e| e.to_string())
            }
            #[cfg(feature = "diesel")]
            Direct::Diesel(pool) => {
                use diesel_async::{AsyncConnection, RunQueryDsl};
                let mut conn = pool.get().await.map_err(|e| e.to_string())?;
                // In a transaction: one statement through a transaction-pooling proxy (R194).
                conn.transaction(async |c| {
                    diesel::sql_query(sql)
                        .get_result::<diesel_rows::Drained>(c)
                        .await
                })
                .await
                .map(|r| r.drained)
                .map_err(|e| e.to_string())
            }
        }
    }

    /// The ids of the failed rows of `topic` and/or `key` (none = any), oldest first, on the
    /// chosen backend; errors map as the repository's do.
    pub async fn failed_ids(&self, topic: Option<&str>, key: Option<&str>) -> Result<Vec<Uuid>> {
        let sql = Statements::new(&self.table)
            .for_pooler(self.pooler)
            .failed_ids;
        let t = &self.table;
        let res = match &self.direct {
            Direct::Sqlx(pool) => {
                async {
                    let mut c = pool.acquire().await?;
                    let q = sqlx::query_scalar::<_, Uuid>(sqlx::AssertSqlSafe(sql.as_str()))
                        .bind(topic)
                        .bind(key)
                        .persistent(self.pooler == Pooler::None);
                    if self.pooler == Pooler::None {
                        return q.fetch_all(&mut *c).await;
                    }
                    // One statement through a transaction-pooling proxy: in a transaction.
                    let mut tx = sqlx::Connection::begin(&mut *c).await?;
                    let ids = q.fetch_all(&mut *tx).await?;
                    tx.commit().await?;
                    Ok(ids)
                }
                .await
                .map_err(|e| txoutbox_postgres::driver::sqlx::map_err(t, e))
            }
            #[cfg(feature = "diesel")]
            Direct::Diesel(pool) => {
                use diesel::sql_types::{Nullable, Text};
                use diesel_async::{AsyncConnection, RunQueryDsl};
                match pool.get().await {
                    Err(e) => Err(txoutbox_diesel::error::map_pool(e)),
                    Ok(mut conn) => conn
                        .transaction(async |c| {
                            diesel::sql_query(sql)
                                .bind::<Nullable<Text>, _>(topic)
                                .bind::<Nullable<Text>, _>(key)
                                .load::<diesel_rows::Id>(c)
                                .await
                        })
                        .await
                        .map(|v| v.into_iter().map(|r| r.id).collect())
                        .map_err(|e| txoutbox_diesel::error::map_diesel(t, e)),
                }
            }
        };
        res.map_err(|e| CliError::repo(&t.to_string(), e))
    }
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
    // A missing CA file would reach the driver as a bare "No such file or directory".
    let root = url
        .split_once('?')
        .into_iter()
        .flat_map(|(_, q)| q.split('&'))
        .find_map(|p| p.strip_prefix("sslrootcert="));
    if let Some(path) = root.filter(|p| !std::path::Path::new(p).is_file()) {
        return Err(CliError::usage(format!(
            "invalid --database-url: its sslrootcert file {path} is not a readable file; give the PEM file of the CA that signed the server's certificate"
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
    // database, authentication); the pool then opens connections as needed. A server that
    // does not answer or refuses is worth waiting for; a refused login or an unknown database
    // is a configuration error.
    let first = tokio::time::timeout(Duration::from_secs(10), opts.connect())
        .await
        .map_err(|_| fail("no answer within 10 s".into()).retryable())?
        .map_err(|e| {
            let config = e
                .as_database_error()
                .and_then(|d| d.code())
                .is_some_and(|c| c.starts_with("28") || c == "3D000");
            let err = fail(e.to_string());
            if config { err } else { err.retryable() }
        })?;
    drop(first);
    Ok(PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(Duration::from_secs(10))
        .connect_lazy_with(opts))
}

/// Whether the table exists.
pub async fn table_exists(pool: &PgPool, table: &TableName) -> Result<bool> {
    Ok(table_kind(pool, table).await? != TableKind::Missing)
}

/// What stands under the table's name; a failure of the check is exit 3 (retryable when the
/// server is down or starting).
pub async fn table_kind(pool: &PgPool, table: &TableName) -> Result<TableKind> {
    txoutbox_postgres::table_kind(pool, table)
        .await
        .map_err(|e| {
            // A lost connection or a server shutting down or starting up is worth waiting
            // for; any other answer is not.
            let transient = e
                .as_database_error()
                .and_then(|d| d.code())
                .is_none_or(|c| c.starts_with("08") || c.starts_with("57P") || c.starts_with("53"));
            let err = CliError::new(code::DATABASE, format!("checking table {table}: {e}"));
            if transient { err.retryable() } else { err }
        })
}

/// Fails with exit 3 and the advice to migrate when the table is missing.
pub async fn require_table(pool: &PgPool, table: &TableName) -> Result<()> {
    if table_exists(pool, table).await? {
        Ok(())
    } else {
        Err(missing(TableRole::Outbox, table))
    }
}

/// Exit 3: the table is missing, with the advice to create it.
fn missing(role: TableRole, table: &TableName) -> CliError {
    CliError::new(
        code::DATABASE,
        format!(
            "the {} table {table} does not exist; {}",
            role.name(),
            role.create_advice(&table.to_string())
        ),
    )
}

/// Connects, checks the table and builds the repository of the chosen store.
pub async fn open(conn: &crate::ConnArgs, table: &TableName, pool_size: u32) -> Result<Store> {
    let pool = connect_pool(&conn.database_url, pool_size).await?;
    open_on(pool, conn, table, pool_size).await
}

/// Checks the table on a connected pool and builds the repository of `kind`.
pub async fn open_on(
    pool: PgPool,
    conn: &crate::ConnArgs,
    table: &TableName,
    pool_size: u32,
) -> Result<Store> {
    require_table(&pool, table).await?;
    let cfg = PgConfig::default().table(table.clone()).pooler(conn.pooler);
    let (repo, direct): (Arc<dyn OutboxRepository>, Direct) = match conn.store {
        StoreKind::Sqlx => (
            Arc::new(PgOutboxRepository::new(pool.clone(), cfg)),
            Direct::Sqlx(pool.clone()),
        ),
        StoreKind::Diesel => diesel_repo(&conn.database_url, cfg, pool_size)?,
    };
    Ok(Store {
        repo,
        pool,
        table: table.clone(),
        pooler: conn.pooler,
        direct,
    })
}

#[cfg(feature = "diesel")]
fn diesel_repo(
    url: &str,
    cfg: PgConfig,
    pool_size: u32,
) -> Result<(Arc<dyn OutboxRepository>, Direct)> {
    let pool = diesel_pool(url, pool_size)?;
    Ok((
        Arc::new(txoutbox_diesel::DieselOutboxRepository::new(
            pool.clone(),
            cfg,
        )),
        Direct::Diesel(pool),
    ))
}

#[cfg(not(feature = "diesel"))]
fn diesel_repo(
    _url: &str,
    _cfg: PgConfig,
    _pool_size: u32,
) -> Result<(Arc<dyn OutboxRepository>, Direct)> {
    Err(not_compiled())
}

/// The diesel-async pool of `--store diesel` (over rustls when the URL asks for TLS).
#[cfg(feature = "diesel")]
fn diesel_pool(url: &str, pool_size: u32) -> Result<txoutbox_diesel::PgPool> {
    let settings = txoutbox_diesel::PoolSettings::default()
        .max_size(pool_size as usize)
        .map_err(|e| CliError::usage(e.to_string()))?;
    txoutbox_diesel::build_pool(url, &settings)
        .map_err(|e| CliError::usage(format!("diesel pool: {e}")))
}

/// A connected inbox store: the library's inbox repository of the chosen backend
/// (`txoutbox_postgres::SqlxInbox` or `txoutbox_diesel::DieselInbox`, the one store of
/// `txoutbox_postgres::inbox::store` over each driver) on the table, in the table's layout.
pub struct InboxStore {
    pub repo: Arc<dyn InboxRepository>,
    pub table: TableName,
}

/// Connects (the same first connection and messages as the outbox commands), checks that the
/// inbox table exists, reads its layout (plain or partitioned: the statements differ) and
/// builds the inbox repository of `kind`.
pub async fn open_inbox(
    conn: &crate::ConnArgs,
    table: &TableName,
    pool_size: u32,
) -> Result<InboxStore> {
    let (url, kind) = (conn.database_url.as_str(), conn.store);
    let pool = connect_pool(url, pool_size).await?;
    let layout = match table_kind(&pool, table).await? {
        TableKind::Plain => Layout::Plain,
        TableKind::Partitioned => Layout::Partitioned,
        TableKind::Missing => return Err(missing(TableRole::Inbox, table)),
        TableKind::Other(k) => {
            return Err(CliError::new(
                code::DATABASE,
                format!(
                    "{table} is not a table (pg_class.relkind {k:?}); give the inbox table with --table (INBOX_TABLE)"
                ),
            ));
        }
    };
    let repo: Arc<dyn InboxRepository> = match kind {
        StoreKind::Sqlx => Arc::new(SqlxInbox::sqlx(pool, table, layout).with_pooler(conn.pooler)),
        StoreKind::Diesel => diesel_inbox(url, table, layout, pool_size, conn.pooler)?,
    };
    Ok(InboxStore {
        repo,
        table: table.clone(),
    })
}

#[cfg(feature = "diesel")]
fn diesel_inbox(
    url: &str,
    table: &TableName,
    layout: Layout,
    pool_size: u32,
    pooler: Pooler,
) -> Result<Arc<dyn InboxRepository>> {
    let pool = diesel_pool(url, pool_size)?;
    Ok(Arc::new(
        txoutbox_diesel::diesel_inbox(pool, table, layout).with_pooler(pooler),
    ))
}

#[cfg(not(feature = "diesel"))]
fn diesel_inbox(
    _url: &str,
    _table: &TableName,
    _layout: Layout,
    _pool_size: u32,
    _pooler: Pooler,
) -> Result<Arc<dyn InboxRepository>> {
    Err(not_compiled())
}

/// The error for `--store diesel` in a binary built without the feature.
#[cfg_attr(feature = "diesel", allow(dead_code))]
pub fn not_compiled() -> CliError {
    CliError::usage(
        "--store diesel is not compiled into this binary; rebuild with `cargo build -p txoutbox-examples --features diesel --bin outbox-relay`, or use --store sqlx (same table, same behaviour)",
    )
}
