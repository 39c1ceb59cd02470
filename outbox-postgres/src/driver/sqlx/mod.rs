//! The sqlx driver (cargo feature `sqlx`): [`SqlxDriver`] on a [`PgPool`], statements on a
//! [`PgConnection`]. Semver-exempt, like all of [`crate::driver`].
//!
//! NOTE (h-pginbox): a minimal stand-in with the names and shapes of the sqlx driver being
//! written on h-flow (issue 20), so the inbox store compiles before that lands; on merge, take
//! h-flow's version of this file and keep its `mod inbox;` line.

mod inbox;

use async_trait::async_trait;
use outbox_core::error::RepositoryError;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgArguments, PgPool};
use sqlx::{AssertSqlSafe, PgConnection, Postgres};

use super::{Bind, Connection, Driver};
use crate::sql::TableName;

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

fn query(sql: &str, binds: Vec<Bind>) -> PgQuery<'_> {
    bind_all(sqlx::query(AssertSqlSafe(sql)), binds)
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
        crate::backend::map_err(table, e)
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
        Ok(query(sql, binds).execute(&mut *self).await?.rows_affected())
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
        self.0
            .acquire()
            .await
            .map_err(|e| crate::backend::map_err(table, e))
    }

    async fn begin(&self, table: &TableName) -> Result<Self::Tx, RepositoryError> {
        self.0
            .begin()
            .await
            .map_err(|e| crate::backend::map_err(table, e))
    }

    async fn commit(table: &TableName, tx: Self::Tx) -> Result<(), RepositoryError> {
        tx.commit()
            .await
            .map_err(|e| crate::backend::map_err(table, e))
    }

    async fn rollback(table: &TableName, tx: Self::Tx) -> Result<(), RepositoryError> {
        tx.rollback()
            .await
            .map_err(|e| crate::backend::map_err(table, e))
    }
}
