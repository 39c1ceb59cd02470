//! The inbox's row shapes (semver-exempt, see [`crate::driver`]): each method runs one
//! statement of [`crate::inbox::sql::InboxStatements`] and decodes its rows. The inbox store
//! ([`crate::inbox::store`]) is written once over [`super::Driver`] and these; sqlx implements
//! them in `driver::sqlx`, diesel-async in `outbox-diesel`.
//!
//! [`Bind`] has no nullable scalar, so the inbox statements take a nullable value as a
//! one-element array (`($n::text[])[1]`), bound with [`nullable_text`], [`nullable_int8`] and
//! [`nullable_timestamp`].

use std::collections::BTreeMap;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_core::error::RepositoryError;
use outbox_core::event::Status;
use outbox_core::inbox::InboxEvent;
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
}

impl InboxRawRow {
    /// The stored row. Fails, naming the row and the column, when the headers are not a
    /// string map or the status is not one of the three (a row written by others, R106).
    pub fn decode(self) -> Result<InboxEvent, RepositoryError> {
        let bad = |what: String| {
            RepositoryError::Other(format!("undecodable row: inbox row {}: {what}", self.id))
        };
        let headers: Option<BTreeMap<String, String>> =
            crate::sql::decode_headers(self.headers.clone()).map_err(bad)?;
        let status: Status = self
            .status
            .parse()
            .map_err(|_| bad(format!("status {:?} is not one of the three", self.status)))?;
        Ok(InboxEvent {
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
        })
    }
}

/// The inbox statements' row shapes on a [`Connection`].
#[async_trait]
pub trait InboxRows: Connection {
    /// Rows of [`crate::inbox::sql::INBOX_COLUMNS`], read column by column.
    async fn inbox_rows(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<InboxRawRow>, Self::Error>;

    /// One row whose first column is a nullable `int8` (counts, probes, ages).
    async fn inbox_int8(&mut self, sql: &str, binds: Vec<Bind>)
    -> Result<Option<i64>, Self::Error>;

    /// One row whose first column is a nullable `text` (the statement timeout before a run).
    async fn inbox_text(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<String>, Self::Error>;

    /// `now`: the database's clock.
    async fn inbox_now(&mut self, sql: &str) -> Result<DateTime<Utc>, Self::Error>;

    /// `counts`: `(source, status, count)` rows.
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
