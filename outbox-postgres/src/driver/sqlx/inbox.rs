//! The inbox's row shapes on a sqlx [`PgConnection`] ([`InboxRows`]).

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use super::query;
use crate::driver::Bind;
use crate::driver::inbox::{InboxDriver, InboxRawRow, InboxRows};

/// Reads [`crate::inbox::sql::INBOX_COLUMNS`] of a row.
fn inbox_raw_row(r: &PgRow) -> Result<InboxRawRow, sqlx::Error> {
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
impl InboxRows for PgConnection {
    async fn inbox_rows(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<InboxRawRow>, sqlx::Error> {
        query(sql, binds)
            .fetch_all(&mut *self)
            .await?
            .iter()
            .map(inbox_raw_row)
            .collect()
    }

    async fn inbox_int8(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<i64>, sqlx::Error> {
        query(sql, binds).fetch_one(&mut *self).await?.try_get(0)
    }

    async fn inbox_text(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<String>, sqlx::Error> {
        query(sql, binds).fetch_one(&mut *self).await?.try_get(0)
    }

    async fn inbox_now(&mut self, sql: &str) -> Result<DateTime<Utc>, sqlx::Error> {
        query(sql, Vec::new())
            .fetch_one(&mut *self)
            .await?
            .try_get(0)
    }

    async fn inbox_counts(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
        query(sql, binds)
            .fetch_all(&mut *self)
            .await?
            .iter()
            .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
            .collect()
    }
}

impl InboxDriver for super::SqlxDriver {
    type Handle = sqlx::Transaction<'static, sqlx::Postgres>;

    fn handle(tx: &mut Self::Tx) -> &mut Self::Handle {
        tx
    }
}
