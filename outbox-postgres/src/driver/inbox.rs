//! The inbox's row shapes (semver-exempt, see [`crate::driver`]): each method runs one
//! statement of [`crate::inbox::sql::InboxStatements`] and decodes its rows. The inbox store
//! ([`crate::inbox::store`]) is written once over [`super::Driver`] and these; sqlx implements
//! them in `driver::sqlx`, diesel-async in `outbox-diesel`.
//!
//! A driver reads a row column by column into [`InboxRawRow`]: a column it cannot read (a
//! timestamp beyond chrono's range such as `infinity`, a jsonb number beyond f64) takes a
//! placeholder and is recorded with [`Unreadable`], so that the row is undecodable alone and
//! keeps its place in the rules of order (R106); only an id it cannot read fails the statement.
//!
//! [`Bind`] has no nullable scalar, so the inbox statements take a nullable value as a
//! one-element array (`($n::text[])[1]`), bound with [`nullable_text`], [`nullable_int8`] and
//! [`nullable_timestamp`].

use std::collections::BTreeMap;
use std::fmt::Display;

use async_trait::async_trait;
use chrono::{DateTime, NaiveDate, Utc};
use txoutbox_core::event::Status;
use txoutbox_core::inbox::{InboxEvent, UndecodableInboxRow};
use uuid::Uuid;

use super::{Bind, Connection};

/// A nullable `text` as the inbox statements bind it: a one-element `text[]`.
pub fn nullable_text(v: Option<&str>) -> Bind {
    Bind::NullableTexts(vec![v.map(str::to_owned)])
}

/// A nullable `int8` as the inbox statements bind it: a one-element `int8[]`.
pub fn nullable_int8(v: Option<i64>) -> Bind {
    Bind::NullableInt8s(vec![v])
}

/// A nullable `timestamptz` as the inbox statements bind it: a one-element `timestamptz[]`.
pub fn nullable_timestamp(v: Option<DateTime<Utc>>) -> Bind {
    Bind::NullableTimestamps(vec![v])
}

/// The inbox columns of one row as a driver reads them ([`crate::inbox::sql::INBOX_COLUMNS`]
/// order), before [`InboxRawRow::decode`].
#[derive(Debug, Clone, PartialEq)]
pub struct InboxRawRow {
    /// `id uuid`.
    pub id: Uuid,
    /// `event_type varchar`.
    pub event_type: String,
    /// `payload jsonb`.
    pub payload: serde_json::Value,
    /// `headers jsonb`.
    pub headers: Option<serde_json::Value>,
    /// `trace_id varchar`.
    pub trace_id: Option<String>,
    /// `idempotency_key varchar`.
    pub idempotency_key: Option<String>,
    /// `correlation_id varchar`.
    pub correlation_id: Option<String>,
    /// `causation_id varchar`.
    pub causation_id: Option<String>,
    /// `schema_version varchar`.
    pub schema_version: Option<String>,
    /// `status varchar`.
    pub status: String,
    /// `attempts_made int4`.
    pub attempts_made: i32,
    /// `max_attempts int4`.
    pub max_attempts: i32,
    /// `last_error varchar`.
    pub last_error: Option<String>,
    /// `scheduled_at timestamptz`.
    pub scheduled_at: DateTime<Utc>,
    /// `completed_at timestamptz`.
    pub completed_at: Option<DateTime<Utc>>,
    /// `locked_at timestamptz`.
    pub locked_at: Option<DateTime<Utc>>,
    /// `locked_by varchar`.
    pub locked_by: Option<String>,
    /// `created_at timestamptz`.
    pub created_at: DateTime<Utc>,
    /// `updated_at timestamptz`.
    pub updated_at: Option<DateTime<Utc>>,
    /// `message_id varchar`.
    pub message_id: String,
    /// `consumer_group varchar`.
    pub consumer_group: String,
    /// `source varchar`.
    pub source: String,
    /// `partition_key varchar` (the addition of Appendix D).
    pub partition_key: Option<String>,
    /// The first column the driver could not read, with why ([`Unreadable`]); that column
    /// holds a placeholder and the row does not decode.
    pub unreadable: Option<String>,
    /// The column `earlier` after the row's, when the statement returns one (`land_run.sql`):
    /// whether an earlier row of the row's inbox key is in line.
    pub earlier: Option<bool>,
    /// The column `timeout_before` after the row's, when the statement returns one
    /// (`land_run.sql`, `lock_row_run.sql`): the statement_timeout in force before the
    /// statement set the handler's; none when it set none.
    pub timeout_before: Option<String>,
}

/// The first column of a row a driver could not read (R106). A column that cannot be read takes
/// a placeholder, so that the row still has a place in the rules of order, and makes the row
/// undecodable.
#[derive(Debug, Default)]
pub struct Unreadable(Option<String>);

/// The earliest `timestamptz` PostgreSQL holds (4714-11-24 BC): the placeholder of an
/// unreadable time on the early side, which binds back.
fn earliest_time() -> DateTime<Utc> {
    NaiveDate::from_ymd_opt(-4713, 11, 24)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .map_or(DateTime::<Utc>::MIN_UTC, |t| t.and_utc())
}

impl Unreadable {
    /// Records that `column` could not be read (only the first such column is kept).
    pub fn record(&mut self, column: &str, why: impl Display) {
        if self.0.is_none() {
            self.0 = Some(format!("column {column} cannot be decoded: {why}"));
        }
    }

    /// The value read, or `placeholder` when it could not be read.
    pub fn or<T, E: Display>(&mut self, column: &str, v: Result<T, E>, placeholder: T) -> T {
        v.unwrap_or_else(|e| {
            self.record(column, e);
            placeholder
        })
    }

    /// A `timestamptz` from its wire value, microseconds from 2000-01-01. Beyond chrono's range
    /// (`infinity`, `-infinity`, year 300000) the column is unreadable and takes the end of the
    /// range on its side, which keeps SQL's order: chrono's latest time, or PostgreSQL's
    /// earliest.
    pub fn time(&mut self, column: &str, micros: i64) -> DateTime<Utc> {
        crate::sql::timestamp_from_pg_micros(micros).unwrap_or_else(|| {
            self.record(
                column,
                format_args!(
                    "timestamp {micros} µs from 2000-01-01 is outside the range this library reads (infinity or beyond chrono's years)"
                ),
            );
            if micros > 0 {
                DateTime::<Utc>::MAX_UTC
            } else {
                earliest_time()
            }
        })
    }

    /// A `timestamptz` the schema declares NOT NULL: NULL is unreadable (the earliest time).
    pub fn required(&mut self, column: &str, v: Option<DateTime<Utc>>) -> DateTime<Utc> {
        v.unwrap_or_else(|| {
            self.record(column, "unexpected NULL");
            earliest_time()
        })
    }

    /// What was recorded, for [`InboxRawRow::unreadable`].
    pub fn finish(self) -> Option<String> {
        self.0
    }
}

impl InboxRawRow {
    /// The stored row, or, when a column could not be read, the headers are not a string map or
    /// the status is not one of the three (a row written by others, R106), the row as
    /// undecodable with the reason (the text after `undecodable row: `).
    pub fn decode(mut self) -> Result<InboxEvent, UndecodableInboxRow> {
        let headers = crate::sql::decode_headers(self.headers.take());
        match (self.reason(&headers), headers) {
            (None, Ok(headers)) => {
                let status = self.status.parse().unwrap_or(Status::Failed);
                Ok(self.into_event(headers, status))
            }
            (reason, _) => Err(UndecodableInboxRow {
                id: self.id,
                source: self.source,
                partition_key: self.partition_key,
                attempts_made: self.attempts_made,
                reason: reason.unwrap_or_default(),
            }),
        }
    }

    /// Why the row does not decode, if it does not (the text after `undecodable row: `).
    pub fn problem(&self) -> Option<String> {
        self.reason(&crate::sql::decode_headers(self.headers.clone()))
    }

    fn reason(&self, headers: &Result<Option<BTreeMap<String, String>>, String>) -> Option<String> {
        if let Some(r) = &self.unreadable {
            return Some(r.clone());
        }
        if let Err(r) = headers {
            return Some(r.clone());
        }
        self.status
            .parse::<Status>()
            .err()
            .map(|_| format!("status {:?} is not one of the three", self.status))
    }

    /// The row for the rules of order and visibility (the fetch's choice, blocked keys), which
    /// read its key, times, attempts and lease: as [`decode`](Self::decode) for a row that
    /// decodes; one that does not keeps those, its headers dropped when they are not a string
    /// map, a status not one of the three read as `failed` (not in line: SQL's
    /// `status = 'pending'` does not hold for it either).
    pub fn into_ordering_view(mut self) -> InboxEvent {
        let headers = crate::sql::decode_headers(self.headers.take()).unwrap_or_default();
        let status = self.status.parse().unwrap_or(Status::Failed);
        self.into_event(headers, status)
    }

    fn into_event(self, headers: Option<BTreeMap<String, String>>, status: Status) -> InboxEvent {
        InboxEvent {
            id: self.id,
            event_type: self.event_type,
            payload: self.payload,
            headers,
            trace_id: self.trace_id,
            idempotency_key: self.idempotency_key,
            correlation_id: self.correlation_id,
            causation_id: self.causation_id,
            schema_version: self.schema_version,
            status,
            attempts_made: self.attempts_made,
            max_attempts: self.max_attempts,
            last_error: self.last_error,
            scheduled_at: self.scheduled_at,
            completed_at: self.completed_at,
            locked_at: self.locked_at,
            locked_by: self.locked_by,
            created_at: self.created_at,
            updated_at: self.updated_at,
            message_id: self.message_id,
            consumer_group: self.consumer_group,
            source: self.source,
            partition_key: self.partition_key,
        }
    }
}

/// The inbox statements' row shapes on a [`Connection`].
#[async_trait]
pub trait InboxRows: Connection {
    /// The SQLSTATE of a database error, when the driver knows it: the inbox store reads
    /// classes 22 and 23 as the database refusing the message (R132).
    fn sqlstate(e: &Self::Error) -> Option<String>;

    /// Rows of [`crate::inbox::sql::INBOX_COLUMNS`], read column by column: a column that
    /// cannot be read takes a placeholder and is recorded in [`InboxRawRow::unreadable`]
    /// ([`Unreadable`]); only an id that cannot be read is an error (R106).
    async fn inbox_rows(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<InboxRawRow>, Self::Error>;

    /// One row whose first column, named `n`, is a nullable `int8` (counts, probes, ages).
    async fn inbox_int8(&mut self, sql: &str, binds: Vec<Bind>)
    -> Result<Option<i64>, Self::Error>;

    /// One row whose first column, named `v`, is a nullable `text` (the statement timeout
    /// before a run).
    async fn inbox_text(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<String>, Self::Error>;

    /// `now`: the database's clock (one column named `now`).
    async fn inbox_now(&mut self, sql: &str) -> Result<DateTime<Utc>, Self::Error>;

    /// `counts`: rows of columns `source text, status text, count int8`.
    async fn inbox_counts(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<(String, String, i64)>, Self::Error>;
}

/// A driver the inbox store runs on: its connections have the inbox's row shapes, and it names
/// what a handler gets from the transaction of its run (R181): sqlx's `Transaction`, the
/// diesel-async connection inside its transaction.
pub trait InboxDriver: super::Driver<Conn: InboxRows> {
    /// What a handler gets.
    type Handle: Send;

    /// The handler's view of an open transaction.
    fn handle(tx: &mut Self::Tx) -> &mut Self::Handle;
}
