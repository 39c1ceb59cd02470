//! The sqlx driver of the inbox store: [`SqlxInboxDriver`] over a [`PgPool`]; a handler gets a
//! sqlx [`Transaction`] (R181): write through `&mut **tx`.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_core::error::RepositoryError;
use sqlx::postgres::{PgArguments, PgPool, PgRow};
use sqlx::query::Query;
use sqlx::{AssertSqlSafe, Postgres, Row, Transaction};

use crate::driver::inbox::{Bind, InboxDriver, InboxDriverTx, InboxRawRow};
use crate::inbox::sql as isql;
use crate::inbox::store::PgInbox;
use crate::sql::{Layout, TableName};

/// The sqlx inbox: [`PgInbox`] over [`SqlxInboxDriver`].
pub type SqlxInbox = PgInbox<SqlxInboxDriver>;

/// The sqlx driver of the inbox store.
#[derive(Debug, Clone)]
pub struct SqlxInboxDriver {
    pool: PgPool,
    table: TableName,
}

impl SqlxInbox {
    /// The sqlx inbox on `table` (plain or partitioned) over `pool`.
    pub fn sqlx(pool: PgPool, table: &TableName, layout: Layout) -> Self {
        PgInbox::new(
            SqlxInboxDriver {
                pool,
                table: table.clone(),
            },
            table,
            layout,
            "postgres-sqlx",
        )
    }
}

/// Creates the inbox schema of `table` (Appendix D; idempotent, [`isql::inbox_ddl`]) in one
/// transaction under the schema-creation advisory lock.
pub async fn create_inbox_schema(
    pool: &PgPool,
    table: &TableName,
    layout: Layout,
) -> Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext($1::text))")
        .bind(isql::schema_lock_key(table))
        .execute(&mut *tx)
        .await?;
    for stmt in isql::inbox_ddl(table, layout) {
        sqlx::raw_sql(AssertSqlSafe(stmt)).execute(&mut *tx).await?;
    }
    tx.commit().await
}

fn query<'q>(sql: &'q str, binds: &[Bind]) -> Query<'q, Postgres, PgArguments> {
    let mut q = sqlx::query(AssertSqlSafe(sql));
    for b in binds {
        q = match b {
            Bind::Uuid(v) => q.bind(*v),
            Bind::Text(v) => q.bind(v.clone()),
            Bind::Int4(v) => q.bind(*v),
            Bind::Int8(v) => q.bind(*v),
            Bind::Timestamp(v) => q.bind(*v),
            Bind::UuidArray(v) => q.bind(v.clone()),
            Bind::TextArray(v) => q.bind(v.clone()),
        };
    }
    q
}

fn raw(r: &PgRow) -> Result<InboxRawRow, sqlx::Error> {
    Ok(InboxRawRow {
        id: r.try_get(0)?,
        event_type: r.try_get(1)?,
        payload: r.try_get(2)?,
        headers: r.try_get(3)?,
        trace_id: r.try_get(4)?,
        idempotency_key: r.try_get(5)?,
        correlation_id: r.try_get(6)?,
        causation_id: r.try_get(7)?,
        schema_version: r.try_get(8)?,
        status: r.try_get(9)?,
        attempts_made: r.try_get(10)?,
        max_attempts: r.try_get(11)?,
        last_error: r.try_get(12)?,
        scheduled_at: r.try_get(13)?,
        completed_at: r.try_get(14)?,
        locked_at: r.try_get(15)?,
        locked_by: r.try_get(16)?,
        created_at: r.try_get(17)?,
        updated_at: r.try_get(18)?,
        message_id: r.try_get(19)?,
        consumer_group: r.try_get(20)?,
        source: r.try_get(21)?,
        partition_key: r.try_get(22)?,
    })
}

#[async_trait]
impl InboxDriver for SqlxInboxDriver {
    type Tx = SqlxInboxTx;

    async fn begin(&self) -> Result<SqlxInboxTx, RepositoryError> {
        let tx = self
            .pool
            .begin()
            .await
            .map_err(|e| crate::backend::map_err(&self.table, e))?;
        Ok(SqlxInboxTx {
            tx,
            table: self.table.clone(),
        })
    }
}

/// An open sqlx transaction of the inbox store.
#[derive(Debug)]
pub struct SqlxInboxTx {
    tx: Transaction<'static, Postgres>,
    table: TableName,
}

impl SqlxInboxTx {
    fn err(&self, e: sqlx::Error) -> RepositoryError {
        crate::backend::map_err(&self.table, e)
    }
}

#[async_trait]
impl InboxDriverTx for SqlxInboxTx {
    type Handle = Transaction<'static, Postgres>;

    fn handle(&mut self) -> &mut Transaction<'static, Postgres> {
        &mut self.tx
    }

    async fn inbox_rows(
        &mut self,
        sql: &str,
        binds: &[Bind],
    ) -> Result<Vec<InboxRawRow>, RepositoryError> {
        let rows = query(sql, binds)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(raw)
            .collect::<Result<_, _>>()
            .map_err(|e| RepositoryError::Other(format!("undecodable row: {e}")))
    }

    async fn execute(&mut self, sql: &str, binds: &[Bind]) -> Result<u64, RepositoryError> {
        let r = query(sql, binds)
            .execute(&mut *self.tx)
            .await
            .map_err(|e| self.err(e))?;
        Ok(r.rows_affected())
    }

    async fn int8(&mut self, sql: &str, binds: &[Bind]) -> Result<Option<i64>, RepositoryError> {
        let r = query(sql, binds)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(|e| self.err(e))?;
        r.try_get(0).map_err(|e| self.err(e))
    }

    async fn text(&mut self, sql: &str, binds: &[Bind]) -> Result<Option<String>, RepositoryError> {
        let r = query(sql, binds)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(|e| self.err(e))?;
        r.try_get(0).map_err(|e| self.err(e))
    }

    async fn timestamp(
        &mut self,
        sql: &str,
        binds: &[Bind],
    ) -> Result<DateTime<Utc>, RepositoryError> {
        let r = query(sql, binds)
            .fetch_one(&mut *self.tx)
            .await
            .map_err(|e| self.err(e))?;
        r.try_get(0).map_err(|e| self.err(e))
    }

    async fn text_text_int8(
        &mut self,
        sql: &str,
        binds: &[Bind],
    ) -> Result<Vec<(String, String, i64)>, RepositoryError> {
        let rows = query(sql, binds)
            .fetch_all(&mut *self.tx)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| self.err(e))
    }

    async fn commit(self) -> Result<(), RepositoryError> {
        let table = self.table;
        self.tx
            .commit()
            .await
            .map_err(|e| crate::backend::map_err(&table, e))
    }

    async fn rollback(self) {
        let _ = self.tx.rollback().await;
    }
}
