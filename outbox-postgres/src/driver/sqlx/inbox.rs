//! The inbox's row shapes on a sqlx [`PgConnection`] ([`InboxRows`]).

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use super::{one, rows};
use crate::driver::Bind;
use crate::driver::inbox::{InboxDriver, InboxRawRow, InboxRows, Unreadable};
use crate::inbox::sql::INBOX_COLUMNS;

/// Reads [`INBOX_COLUMNS`] of a row, column by column: a column that cannot be decoded takes a
/// placeholder and is recorded in [`InboxRawRow::unreadable`], timestamps are range-checked
/// before chrono sees them (sqlx's own chrono decoding panics on `infinity`); only an id that
/// cannot be read is an error (R106).
fn inbox_raw_row(r: &PgRow) -> Result<InboxRawRow, sqlx::Error> {
    let mut u = Unreadable::default();
    let id = r.try_get(0)?;
    let event_type = get(r, 1, &mut u);
    let payload = get(r, 2, &mut u);
    let headers = get(r, 3, &mut u);
    let trace_id = get(r, 4, &mut u);
    let idempotency_key = get(r, 5, &mut u);
    let correlation_id = get(r, 6, &mut u);
    let causation_id = get(r, 7, &mut u);
    let schema_version = get(r, 8, &mut u);
    let status = get(r, 9, &mut u);
    let attempts_made = get(r, 10, &mut u);
    let max_attempts = get(r, 11, &mut u);
    let last_error = get(r, 12, &mut u);
    let scheduled_at = time(r, 13, &mut u);
    let scheduled_at = u.required(INBOX_COLUMNS[13], scheduled_at);
    let completed_at = time(r, 14, &mut u);
    let locked_at = time(r, 15, &mut u);
    let locked_by = get(r, 16, &mut u);
    let created_at = time(r, 17, &mut u);
    let created_at = u.required(INBOX_COLUMNS[17], created_at);
    let updated_at = time(r, 18, &mut u);
    Ok(InboxRawRow {
        id,
        event_type,
        payload,
        headers,
        trace_id,
        idempotency_key,
        correlation_id,
        causation_id,
        schema_version,
        status,
        attempts_made,
        max_attempts,
        last_error,
        scheduled_at,
        completed_at,
        locked_at,
        locked_by,
        created_at,
        updated_at,
        message_id: get(r, 19, &mut u),
        consumer_group: get(r, 20, &mut u),
        source: get(r, 21, &mut u),
        partition_key: get(r, 22, &mut u),
        unreadable: u.finish(),
        earlier: extra(r, "earlier"),
        timeout_before: extra(r, "timeout_before"),
    })
}

/// A column after the row's (`earlier`, `timeout_before`), when the statement returns it.
fn extra<'r, T>(r: &'r PgRow, name: &str) -> Option<T>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    if r.len() <= INBOX_COLUMNS.len() {
        return None;
    }
    r.try_get::<Option<T>, _>(name).ok().flatten()
}

/// Column `i`, or its type's default when it cannot be decoded (recorded in `u`).
fn get<'r, T>(r: &'r PgRow, i: usize, u: &mut Unreadable) -> T
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Default,
{
    let v = r.try_get(i).map_err(|e| match e {
        sqlx::Error::ColumnDecode { source, .. } => source.to_string(),
        other => other.to_string(),
    });
    u.or(INBOX_COLUMNS[i], v, T::default())
}

/// A nullable timestamptz column, range-checked before chrono sees it ([`Unreadable::time`]).
fn time(r: &PgRow, i: usize, u: &mut Unreadable) -> Option<DateTime<Utc>> {
    use sqlx::ValueRef;
    let column = INBOX_COLUMNS[i];
    let v = match r.try_get_raw(i) {
        Ok(v) => v,
        Err(e) => {
            u.record(column, e);
            return None;
        }
    };
    if v.is_null() {
        return None;
    }
    match v.format() {
        sqlx::postgres::PgValueFormat::Binary => {
            match <i64 as sqlx::Decode<sqlx::Postgres>>::decode(v) {
                Ok(micros) => Some(u.time(column, micros)),
                Err(e) => {
                    u.record(column, e);
                    None
                }
            }
        }
        sqlx::postgres::PgValueFormat::Text => get(r, i, u),
    }
}

#[async_trait]
impl InboxRows for PgConnection {
    fn sqlstate(e: &sqlx::Error) -> Option<String> {
        match e {
            sqlx::Error::Database(db) => db.code().map(|c| c.into_owned()),
            _ => None,
        }
    }

    async fn inbox_rows(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<InboxRawRow>, sqlx::Error> {
        rows(self, sql, binds)
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
        one(self, sql, binds).await?.try_get(0)
    }

    async fn inbox_text(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<String>, sqlx::Error> {
        one(self, sql, binds).await?.try_get(0)
    }

    async fn inbox_now(&mut self, sql: &str) -> Result<DateTime<Utc>, sqlx::Error> {
        one(self, sql, Vec::new()).await?.try_get(0)
    }

    async fn inbox_counts(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<(String, String, i64)>, sqlx::Error> {
        rows(self, sql, binds)
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
