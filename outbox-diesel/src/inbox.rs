//! The inbox on diesel-async (contract Part II): the one inbox store of
//! `outbox_postgres::inbox` over [`DieselDriver`]. A handler gets the diesel-async connection
//! inside the transaction of its run (R181): `&mut AsyncPgConnection`, through which it makes
//! every write that belongs to the message.

use std::ops::DerefMut;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Int4, Jsonb, Nullable, Text, Timestamptz};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use outbox_core::RepositoryError;
use outbox_postgres::driver::Bind;
use outbox_postgres::driver::inbox::{InboxDriver, InboxRawRow, InboxRows};
use outbox_postgres::inbox::schema::create_inbox_schema_on;
use outbox_postgres::inbox::store::PgInbox;
use outbox_postgres::sql::{Layout, TableName};
use serde_json::Value;
use uuid::Uuid;

use crate::driver::{Diesel, DieselDriver, DieselTx, query};
use crate::pool::PgPool;

type SqlUuid = diesel::sql_types::Uuid;

/// The diesel-async inbox.
pub type DieselInbox = PgInbox<DieselDriver>;

/// The diesel-async inbox on `table` (plain or partitioned) over `pool`.
pub fn diesel_inbox(pool: PgPool, table: &TableName, layout: Layout) -> DieselInbox {
    PgInbox::new(DieselDriver(pool), table, layout)
}

/// Creates the inbox schema of `table` (Appendix D; idempotent, R173's index rule: see
/// `outbox_postgres::inbox::schema`) on `conn` in one transaction under the schema-creation
/// advisory lock.
pub async fn create_inbox_schema(
    conn: &mut AsyncPgConnection,
    table: &TableName,
    layout: Layout,
) -> Result<(), RepositoryError> {
    let table = table.clone();
    conn.transaction(async |c| {
        create_inbox_schema_on(&mut Diesel(c), &table, layout)
            .await
            .map_err(SchemaError::Repository)
    })
    .await
    .map_err(|e| match e {
        SchemaError::Repository(e) => e,
        SchemaError::Diesel(e) => crate::error::map_diesel(&table, e),
    })
}

/// An error inside the schema transaction: ours, or diesel's own (its commit, its rollback).
enum SchemaError {
    Repository(RepositoryError),
    Diesel(diesel::result::Error),
}

impl From<diesel::result::Error> for SchemaError {
    fn from(e: diesel::result::Error) -> Self {
        SchemaError::Diesel(e)
    }
}

/// The inbox columns, read by name.
#[derive(Debug, QueryableByName)]
#[diesel(check_for_backend(diesel::pg::Pg))]
struct InboxRow {
    #[diesel(sql_type = SqlUuid)]
    id: Uuid,
    #[diesel(sql_type = Text)]
    event_type: String,
    #[diesel(sql_type = Jsonb)]
    payload: Value,
    #[diesel(sql_type = Nullable<Jsonb>)]
    headers: Option<Value>,
    #[diesel(sql_type = Nullable<Text>)]
    trace_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    idempotency_key: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    correlation_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    causation_id: Option<String>,
    #[diesel(sql_type = Nullable<Text>)]
    schema_version: Option<String>,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = Int4)]
    attempts_made: i32,
    #[diesel(sql_type = Int4)]
    max_attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    scheduled_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    completed_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    locked_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Nullable<Text>)]
    locked_by: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    created_at: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    updated_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = Text)]
    message_id: String,
    #[diesel(sql_type = Text)]
    consumer_group: String,
    #[diesel(sql_type = Text)]
    source: String,
    #[diesel(sql_type = Nullable<Text>)]
    partition_key: Option<String>,
}

impl From<InboxRow> for InboxRawRow {
    fn from(r: InboxRow) -> Self {
        InboxRawRow {
            id: r.id,
            event_type: r.event_type,
            payload: r.payload,
            headers: r.headers,
            trace_id: r.trace_id,
            idempotency_key: r.idempotency_key,
            correlation_id: r.correlation_id,
            causation_id: r.causation_id,
            schema_version: r.schema_version,
            status: r.status,
            attempts_made: r.attempts_made,
            max_attempts: r.max_attempts,
            last_error: r.last_error,
            scheduled_at: r.scheduled_at,
            completed_at: r.completed_at,
            locked_at: r.locked_at,
            locked_by: r.locked_by,
            created_at: r.created_at,
            updated_at: r.updated_at,
            message_id: r.message_id,
            consumer_group: r.consumer_group,
            source: r.source,
            partition_key: r.partition_key,
        }
    }
}

#[derive(QueryableByName)]
struct Int8Row {
    #[diesel(sql_type = Nullable<BigInt>)]
    n: Option<i64>,
}

#[derive(QueryableByName)]
struct TextRow {
    #[diesel(sql_type = Nullable<Text>)]
    v: Option<String>,
}

#[derive(QueryableByName)]
struct NowRow {
    #[diesel(sql_type = Timestamptz)]
    now: DateTime<Utc>,
}

#[derive(QueryableByName)]
struct CountRow {
    #[diesel(sql_type = Text)]
    source: String,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = BigInt)]
    count: i64,
}

#[async_trait]
impl<T: DerefMut<Target = AsyncPgConnection> + Send> InboxRows for Diesel<T> {
    fn sqlstate(e: &Self::Error) -> Option<String> {
        use diesel::result::{DatabaseErrorKind as K, Error as E};
        // diesel keeps the kind, not the code: the class 23 kinds it names.
        match e {
            E::DatabaseError(K::CheckViolation, _) => Some("23514".into()),
            E::DatabaseError(K::NotNullViolation, _) => Some("23502".into()),
            E::DatabaseError(K::ForeignKeyViolation, _) => Some("23503".into()),
            E::DatabaseError(K::UniqueViolation, _) => Some("23505".into()),
            E::DatabaseError(K::ExclusionViolation, _) => Some("23P01".into()),
            _ => None,
        }
    }

    async fn inbox_rows(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<InboxRawRow>, Self::Error> {
        let rows: Vec<InboxRow> = query(sql, binds).load(&mut *self.0).await?;
        Ok(rows.into_iter().map(InboxRawRow::from).collect())
    }

    async fn inbox_int8(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<i64>, Self::Error> {
        let r: Int8Row = query(sql, binds).get_result(&mut *self.0).await?;
        Ok(r.n)
    }

    async fn inbox_text(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<String>, Self::Error> {
        let r: TextRow = query(sql, binds).get_result(&mut *self.0).await?;
        Ok(r.v)
    }

    async fn inbox_now(&mut self, sql: &str) -> Result<DateTime<Utc>, Self::Error> {
        let r: NowRow = query(sql, Vec::new()).get_result(&mut *self.0).await?;
        Ok(r.now)
    }

    async fn inbox_counts(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<(String, String, i64)>, Self::Error> {
        let rows: Vec<CountRow> = query(sql, binds).load(&mut *self.0).await?;
        Ok(rows
            .into_iter()
            .map(|r| (r.source, r.status, r.count))
            .collect())
    }
}

impl InboxDriver for DieselDriver {
    type Handle = AsyncPgConnection;

    fn handle(tx: &mut DieselTx) -> &mut AsyncPgConnection {
        &mut (**tx).0
    }
}
