//! The sqlx driver's row decoding: [`sql::COLUMNS`] column by column, timestamps range-checked.

use chrono::{DateTime, Utc};
use sqlx::Row;
use sqlx::postgres::PgRow;
use txoutbox_core::repository::{Fetched, UndecodableRow};

use crate::sql::{self, RawRow};

/// Decodes [`sql::COLUMNS`] of a row into a [`RawRow`]. A column that cannot be decoded is an
/// error naming it; timestamps outside chrono's range (`infinity`, year 300000) are errors, not
/// the panic of sqlx's own chrono decoding.
pub fn raw_row(r: &PgRow) -> Result<RawRow, sqlx::Error> {
    Ok(RawRow {
        id: col(r, 0)?,
        event_type: col(r, 1)?,
        payload: col(r, 2)?,
        headers: col(r, 3)?,
        trace_id: col(r, 4)?,
        idempotency_key: col(r, 5)?,
        correlation_id: col(r, 6)?,
        causation_id: col(r, 7)?,
        schema_version: col(r, 8)?,
        status: col(r, 9)?,
        attempts_made: col(r, 10)?,
        max_attempts: col(r, 11)?,
        last_error: col(r, 12)?,
        scheduled_at: required_time(r, 13)?,
        completed_at: time(r, 14)?,
        locked_at: time(r, 15)?,
        locked_by: col(r, 16)?,
        created_at: required_time(r, 17)?,
        updated_at: time(r, 18)?,
        aggregate_type: col(r, 19)?,
        aggregate_id: col(r, 20)?,
        topic: col(r, 21)?,
        partition_key: col(r, 22)?,
    })
}

/// A fetched row (R82): decoded; or, when any column or the outbox's own decoding fails,
/// [`Fetched::Undecodable`] naming the problem, so the row fails alone and the fetch, already
/// committed, still hands out the others. Only an id that cannot be read fails the fetch.
pub fn fetched_row(r: &PgRow) -> Result<Fetched, sqlx::Error> {
    Ok(match raw_row(r) {
        Ok(raw) => match raw.decode() {
            Ok(e) => Fetched::Row(e),
            Err(u) => Fetched::Undecodable(u),
        },
        Err(e) => Fetched::Undecodable(UndecodableRow {
            id: col(r, 0)?,
            topic: col(r, 21).unwrap_or_default(),
            partition_key: col(r, 22).unwrap_or_default(),
            attempts_made: col(r, 10).unwrap_or_default(),
            reason: match e {
                sqlx::Error::ColumnDecode { index, source } => {
                    format!("column {index} cannot be decoded: {source}")
                }
                other => other.to_string(),
            },
        }),
    })
}

fn col<'r, T>(r: &'r PgRow, i: usize) -> Result<T, sqlx::Error>
where
    T: sqlx::Decode<'r, sqlx::Postgres> + sqlx::Type<sqlx::Postgres>,
{
    r.try_get(i).map_err(|e| match e {
        sqlx::Error::ColumnDecode { source, .. } => sqlx::Error::ColumnDecode {
            index: sql::COLUMNS[i].to_owned(),
            source,
        },
        other => other,
    })
}

/// A nullable timestamptz column, range-checked before chrono sees it.
fn time(r: &PgRow, i: usize) -> Result<Option<DateTime<Utc>>, sqlx::Error> {
    use sqlx::ValueRef;
    let v = r.try_get_raw(i)?;
    if v.is_null() {
        return Ok(None);
    }
    let bad = |source: sqlx::error::BoxDynError| sqlx::Error::ColumnDecode {
        index: sql::COLUMNS[i].to_owned(),
        source,
    };
    match v.format() {
        sqlx::postgres::PgValueFormat::Binary => {
            let micros = <i64 as sqlx::Decode<sqlx::Postgres>>::decode(v).map_err(bad)?;
            sql::timestamp_from_pg_micros(micros)
                .map(Some)
                .ok_or_else(|| bad(format!("timestamp {micros} µs from 2000-01-01 is outside the range this library reads (infinity or beyond chrono's years)").into()))
        }
        sqlx::postgres::PgValueFormat::Text => col(r, i),
    }
}

fn required_time(r: &PgRow, i: usize) -> Result<DateTime<Utc>, sqlx::Error> {
    time(r, i)?.ok_or_else(|| sqlx::Error::ColumnDecode {
        index: sql::COLUMNS[i].to_owned(),
        source: "unexpected NULL".into(),
    })
}
