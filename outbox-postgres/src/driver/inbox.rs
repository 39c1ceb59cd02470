//! The inbox's driver layer (semver-exempt): what the one inbox store
//! ([`crate::inbox::store`]) needs from a Postgres driver, one method per statement kind, typed
//! binds in, decoded rows out, a transaction handle. sqlx implements it in this crate
//! ([`crate::inbox::sqlx`]), diesel-async in `outbox-diesel`; the flow (which statement, in
//! which order, under which lock) is written once, in the store.
//!
//! Every value reaches SQL as a bound parameter ([`Bind`]); statement texts come from
//! [`crate::inbox::sql::InboxStatements`], rendered for a validated table name.

use std::collections::BTreeMap;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_core::error::RepositoryError;
use outbox_core::event::Status;
use outbox_core::inbox::InboxEvent;
use uuid::Uuid;

/// One bound parameter, in the Postgres type the statement casts it to.
#[derive(Debug, Clone, PartialEq)]
pub enum Bind {
    /// `uuid`.
    Uuid(Uuid),
    /// `text`, or NULL.
    Text(Option<String>),
    /// `int4`.
    Int4(i32),
    /// `int8`, or NULL.
    Int8(Option<i64>),
    /// `timestamptz`, or NULL.
    Timestamp(Option<DateTime<Utc>>),
    /// `uuid[]`.
    UuidArray(Vec<Uuid>),
    /// `text[]`, or NULL.
    TextArray(Option<Vec<String>>),
}

impl Bind {
    /// A non-null `text`.
    pub fn text(v: impl Into<String>) -> Self {
        Bind::Text(Some(v.into()))
    }
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

/// A Postgres driver as the inbox store uses it: a way to begin a transaction.
#[async_trait]
pub trait InboxDriver: Clone + Send + Sync + 'static {
    /// The driver's open transaction.
    type Tx: InboxDriverTx;

    /// Begins a transaction (READ COMMITTED); an error is a persistence error (R132).
    async fn begin(&self) -> Result<Self::Tx, RepositoryError>;
}

/// An open transaction of a driver. Dropping it without [`commit`](Self::commit) rolls it back.
#[async_trait]
pub trait InboxDriverTx: Send + Sized {
    /// What a handler gets (R181): the driver's own transaction type.
    type Handle: Send;

    /// The handler's view of this transaction.
    fn handle(&mut self) -> &mut Self::Handle;

    /// Runs a statement returning inbox rows ([`crate::inbox::sql::INBOX_COLUMNS`]).
    async fn inbox_rows(
        &mut self,
        sql: &str,
        binds: &[Bind],
    ) -> Result<Vec<InboxRawRow>, RepositoryError>;

    /// Runs a statement; returns the affected-row count.
    async fn execute(&mut self, sql: &str, binds: &[Bind]) -> Result<u64, RepositoryError>;

    /// Runs a statement returning one row whose first column is a nullable `int8`.
    async fn int8(&mut self, sql: &str, binds: &[Bind]) -> Result<Option<i64>, RepositoryError>;

    /// Runs a statement returning one row whose first column is a nullable `text`.
    async fn text(&mut self, sql: &str, binds: &[Bind]) -> Result<Option<String>, RepositoryError>;

    /// Runs a statement returning one row whose first column is a `timestamptz`.
    async fn timestamp(
        &mut self,
        sql: &str,
        binds: &[Bind],
    ) -> Result<DateTime<Utc>, RepositoryError>;

    /// Runs a statement returning `(text, text, int8)` rows.
    async fn text_text_int8(
        &mut self,
        sql: &str,
        binds: &[Bind],
    ) -> Result<Vec<(String, String, i64)>, RepositoryError>;

    /// Commits.
    async fn commit(self) -> Result<(), RepositoryError>;

    /// Rolls back (errors are ignored: the connection is then discarded).
    async fn rollback(self);
}
