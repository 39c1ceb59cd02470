//! The sqlx driver (cargo feature `sqlx`): [`SqlxDriver`] on a [`PgPool`], statements on a
//! [`PgConnection`]. Semver-exempt, like all of [`crate::driver`].

mod error;
mod inbox;
mod row;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgPool, PgRow};
use sqlx::{AssertSqlSafe, PgConnection, Postgres, Row};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::repository::{BlockedKey, Fetched};
use uuid::Uuid;

pub use error::map_err;
pub use row::{fetched_row, raw_row};

use super::outbox::{
    AppliedRow, CountRow, OutboxDriver, OutboxRows, fetch_heads_binds, fetch_take_binds,
};
use super::{Bind, Connection, Driver};
use crate::sql::pooler::is_unprepared;
use crate::sql::{FetchParams, RawRow, Statements, TableName, WalkCursor};

/// A sqlx query with its arguments.
pub type PgQuery<'q> = sqlx::query::Query<'q, Postgres, PgArguments>;

/// Binds `binds` to `query` in order, each with its PostgreSQL type.
pub fn bind_all<'q>(mut query: PgQuery<'q>, binds: Vec<Bind>) -> PgQuery<'q> {
    for b in binds {
        query = match b {
            Bind::Uuid(v) => query.bind(v),
            Bind::Uuids(v) => query.bind(v),
            Bind::OptUuids(v) => query.bind(v),
            Bind::Text(v) => query.bind(v),
            Bind::Texts(v) => query.bind(v),
            Bind::OptTexts(v) => query.bind(v),
            Bind::NullableTexts(v) => query.bind(v),
            Bind::Int4(v) => query.bind(v),
            Bind::Int8(v) => query.bind(v),
            Bind::Int4s(v) => query.bind(v),
            Bind::NullableInt8s(v) => query.bind(v),
            Bind::Bools(v) => query.bind(v),
            Bind::Timestamp(v) => query.bind(v),
            Bind::NullableTimestamps(v) => query.bind(v),
        };
    }
    query
}

/// `sql` with `binds`; a statement marked for a transaction-pooling proxy
/// ([`crate::sql::pooler`], R194) is unnamed and uncached (`persistent(false)`: sqlx names
/// every persistent statement, even with its cache off).
fn query(sql: &str, binds: Vec<Bind>) -> PgQuery<'_> {
    bind_all(sqlx::query(AssertSqlSafe(sql)), binds).persistent(!is_unprepared(sql))
}

/// Runs `sql` and returns its rows. The one place every statement of this driver runs
/// (with [`exec`]): a statement marked for a transaction-pooling proxy (R194) on a connection
/// outside a transaction runs in a transaction of its own, so that its Parse and its Bind
/// reach the same server connection.
pub async fn rows(
    conn: &mut PgConnection,
    sql: &str,
    binds: Vec<Bind>,
) -> Result<Vec<PgRow>, sqlx::Error> {
    if !is_unprepared(sql) || sqlx::Connection::is_in_transaction(&*conn) {
        return query(sql, binds).fetch_all(&mut *conn).await;
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let r = query(sql, binds).fetch_all(&mut *tx).await;
    finish_lone(tx, r).await
}

/// Runs `sql`; returns the rows it affected. See [`rows`].
pub async fn exec(
    conn: &mut PgConnection,
    sql: &str,
    binds: Vec<Bind>,
) -> Result<u64, sqlx::Error> {
    if !is_unprepared(sql) || sqlx::Connection::is_in_transaction(&*conn) {
        return Ok(query(sql, binds).execute(&mut *conn).await?.rows_affected());
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let r = query(sql, binds).execute(&mut *tx).await;
    finish_lone(tx, r).await.map(|d| d.rows_affected())
}

/// The first row of `sql` (an error when there is none).
pub async fn one(
    conn: &mut PgConnection,
    sql: &str,
    binds: Vec<Bind>,
) -> Result<PgRow, sqlx::Error> {
    rows(conn, sql, binds)
        .await?
        .into_iter()
        .next()
        .ok_or(sqlx::Error::RowNotFound)
}

async fn finish_lone<T>(
    tx: sqlx::Transaction<'_, Postgres>,
    r: Result<T, sqlx::Error>,
) -> Result<T, sqlx::Error> {
    match r {
        Ok(v) => {
            tx.commit().await?;
            Ok(v)
        }
        Err(e) => {
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

/// Binds the parameters of [`Statements::fetch_heads`] in their order (`$1`–`$9`), for the
/// plan test and the benchmarks, which may put `EXPLAIN …` before the statement text.
pub fn bind_fetch_heads<'q>(
    query: PgQuery<'q>,
    p: &FetchParams,
    cursor: (String, String),
) -> PgQuery<'q> {
    bind_all(query, fetch_heads_binds(p, cursor))
}

/// Binds the parameters of [`Statements::fetch_take`] / [`Statements::fetch_take_transaction`]
/// in their order (`$1`–`$8`).
pub fn bind_fetch_take<'q>(
    query: PgQuery<'q>,
    worker: &str,
    p: &FetchParams,
    heads: Vec<Uuid>,
) -> PgQuery<'q> {
    bind_all(query, fetch_take_binds(worker, p, heads))
}

/// The lease fetch ([`crate::outbox::fetch`]) on a sqlx connection inside the caller's
/// transaction.
pub async fn fetch_rows(
    conn: &mut PgConnection,
    stmts: &Statements,
    worker: &str,
    p: &FetchParams,
    cursor: &WalkCursor,
) -> Result<Vec<Fetched>, sqlx::Error> {
    crate::outbox::fetch(conn, stmts, worker, p, cursor).await
}

/// The sqlx driver: a [`PgPool`].
#[derive(Debug, Clone)]
pub struct SqlxDriver(pub PgPool);

impl From<PgPool> for SqlxDriver {
    fn from(pool: PgPool) -> Self {
        Self(pool)
    }
}

#[async_trait]
impl Connection for PgConnection {
    type Error = sqlx::Error;

    fn map_err(table: &TableName, e: sqlx::Error) -> RepositoryError {
        map_err(table, e)
    }

    fn server_message(e: &sqlx::Error) -> Option<&str> {
        match e {
            sqlx::Error::Database(db) => Some(db.message()),
            _ => None,
        }
    }

    fn in_transaction(&mut self) -> Result<bool, sqlx::Error> {
        Ok(sqlx::Connection::is_in_transaction(&*self))
    }

    async fn execute(&mut self, sql: &str, binds: Vec<Bind>) -> Result<u64, sqlx::Error> {
        exec(self, sql, binds).await
    }
}

#[async_trait]
impl OutboxRows for PgConnection {
    async fn heads(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<(Option<Uuid>, String, String)>, sqlx::Error> {
        rows(self, sql, binds)
            .await?
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .collect()
    }

    async fn fetched(&mut self, sql: &str, binds: Vec<Bind>) -> Result<Vec<Fetched>, sqlx::Error> {
        rows(self, sql, binds)
            .await?
            .iter()
            .map(fetched_row)
            .collect()
    }

    async fn events(&mut self, sql: &str, binds: Vec<Bind>) -> Result<Vec<RawRow>, sqlx::Error> {
        rows(self, sql, binds).await?.iter().map(raw_row).collect()
    }

    async fn applied(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<AppliedRow>, sqlx::Error> {
        rows(self, sql, binds)
            .await?
            .iter()
            .map(|r| {
                Ok(AppliedRow {
                    id: r.try_get(0)?,
                    status: r.try_get(1)?,
                    attempts_made: r.try_get(2)?,
                    scheduled_at: r.try_get(3)?,
                })
            })
            .collect()
    }

    async fn blocked(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<BlockedKey>, sqlx::Error> {
        rows(self, sql, binds)
            .await?
            .iter()
            .map(|r| {
                let attempts_made: i32 = r.try_get(3)?;
                let max_attempts: i32 = r.try_get(4)?;
                Ok(BlockedKey {
                    topic: r.try_get(0)?,
                    partition_key: r.try_get(1)?,
                    head_id: r.try_get(2)?,
                    attempts_made,
                    max_attempts,
                    last_error: r.try_get(5)?,
                    next_try: r.try_get(6)?,
                    locked_by: r.try_get(7)?,
                    locked_at: r.try_get(8)?,
                    waiting: r.try_get(9)?,
                    // Every blocked head is pending: it is parked when its attempts are spent.
                    parked: attempts_made >= max_attempts,
                    parked_at: r.try_get(10)?,
                })
            })
            .collect()
    }

    async fn counts(&mut self, sql: &str) -> Result<Vec<CountRow>, sqlx::Error> {
        rows(self, sql, Vec::new())
            .await?
            .iter()
            .map(|r| {
                Ok(CountRow {
                    topic: r.try_get(0)?,
                    status: r.try_get(1)?,
                    count: r.try_get(2)?,
                })
            })
            .collect()
    }

    async fn now(&mut self, sql: &str) -> Result<DateTime<Utc>, sqlx::Error> {
        one(self, sql, Vec::new()).await?.try_get(0)
    }

    async fn isolation(&mut self, sql: &str, binds: Vec<Bind>) -> Result<String, sqlx::Error> {
        one(self, sql, binds).await?.try_get(0)
    }

    async fn age_us(&mut self, sql: &str) -> Result<Option<i64>, sqlx::Error> {
        one(self, sql, Vec::new()).await?.try_get(0)
    }
}

#[async_trait]
impl Driver for SqlxDriver {
    type Conn = PgConnection;
    type Pooled = PoolConnection<Postgres>;
    type Tx = sqlx::Transaction<'static, Postgres>;

    const NAME: &'static str = "postgres-sqlx";
    const NOT_IN_TRANSACTION: &'static str = "the outbox write needs the caller's open transaction, and this connection is in autocommit: open one with `let mut tx = pool.begin().await?`, pass `&mut *tx`, and commit it with the application's change";

    async fn acquire(&self, table: &TableName) -> Result<Self::Pooled, RepositoryError> {
        self.0.acquire().await.map_err(|e| map_err(table, e))
    }

    async fn begin(&self, table: &TableName) -> Result<Self::Tx, RepositoryError> {
        self.0.begin().await.map_err(|e| map_err(table, e))
    }

    async fn begin_on(table: &TableName, conn: Self::Pooled) -> Result<Self::Tx, RepositoryError> {
        // What `Pool::begin` does with the connection it acquires.
        sqlx::Transaction::begin(conn, None)
            .await
            .map_err(|e| map_err(table, e))
    }

    async fn commit(table: &TableName, tx: Self::Tx) -> Result<(), RepositoryError> {
        tx.commit().await.map_err(|e| map_err(table, e))
    }

    async fn rollback(table: &TableName, tx: Self::Tx) -> Result<(), RepositoryError> {
        tx.rollback().await.map_err(|e| map_err(table, e))
    }
}

impl OutboxDriver for SqlxDriver {
    type Writer = crate::outbox::Writer<SqlxDriver>;
}
