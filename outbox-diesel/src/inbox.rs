//! The inbox on diesel-async (contract Part II): the one inbox store of
//! `txoutbox_postgres::inbox` over [`DieselDriver`]. A handler gets the diesel-async connection
//! inside the transaction of its run (R181): `&mut AsyncPgConnection`, through which it makes
//! every write that belongs to the message.

use std::ops::DerefMut;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::data_types::PgTimestamp;
use diesel::deserialize::{self, FromSql};
use diesel::pg::Pg;
use diesel::row::NamedRow;
use diesel::sql_types::{BigInt, Int4, Jsonb, Nullable, Text, Timestamptz};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use serde_json::Value;
use txoutbox_core::RepositoryError;
use txoutbox_postgres::driver::Bind;
use txoutbox_postgres::driver::inbox::{InboxDriver, InboxRawRow, InboxRows, Unreadable};
use txoutbox_postgres::inbox::schema::create_inbox_schema_on;
use txoutbox_postgres::inbox::store::PgInbox;
use txoutbox_postgres::sql::{Layout, TableName};
use uuid::Uuid;

use crate::driver::{Diesel, DieselDriver, DieselTx, run};
use crate::pool::PgPool;

type SqlUuid = diesel::sql_types::Uuid;

/// The diesel-async inbox.
pub type DieselInbox = PgInbox<DieselDriver>;

/// The diesel-async inbox on `table` (plain or partitioned) over `pool`.
pub fn diesel_inbox(pool: PgPool, table: &TableName, layout: Layout) -> DieselInbox {
    PgInbox::new(DieselDriver(pool), table, layout)
}

/// Creates the inbox schema of `table` (Appendix D; idempotent, R173's index rule: see
/// `txoutbox_postgres::inbox::schema`) on `conn` in one transaction under the schema-creation
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

/// The inbox columns, read by name and one by one: a column that cannot be decoded takes a
/// placeholder and is recorded in [`InboxRawRow::unreadable`], timestamps are read as their wire
/// value and range-checked ([`Unreadable::time`]); only an id that cannot be read fails the
/// load (R106).
struct InboxRow(InboxRawRow);

/// Column `name`, or its type's default when it cannot be decoded (recorded in `u`).
fn get<'a, ST, T>(row: &impl NamedRow<'a, Pg>, name: &str, u: &mut Unreadable) -> T
where
    T: FromSql<ST, Pg> + Default,
{
    u.or(name, NamedRow::get::<ST, T>(row, name), T::default())
}

/// A nullable timestamptz column.
fn time<'a>(row: &impl NamedRow<'a, Pg>, name: &str, u: &mut Unreadable) -> Option<DateTime<Utc>> {
    match NamedRow::get::<Nullable<Timestamptz>, Option<PgTimestamp>>(row, name) {
        Ok(v) => v.map(|PgTimestamp(micros)| u.time(name, micros)),
        Err(e) => {
            u.record(name, e);
            None
        }
    }
}

impl QueryableByName<Pg> for InboxRow {
    fn build<'a>(row: &impl NamedRow<'a, Pg>) -> deserialize::Result<Self> {
        type OptText = Nullable<Text>;
        let mut u = Unreadable::default();
        let id = NamedRow::get::<SqlUuid, Uuid>(row, "id")?;
        let event_type = get::<Text, _>(row, "event_type", &mut u);
        let payload = get::<Jsonb, Value>(row, "payload", &mut u);
        let headers = get::<Nullable<Jsonb>, _>(row, "headers", &mut u);
        let trace_id = get::<OptText, _>(row, "trace_id", &mut u);
        let idempotency_key = get::<OptText, _>(row, "idempotency_key", &mut u);
        let correlation_id = get::<OptText, _>(row, "correlation_id", &mut u);
        let causation_id = get::<OptText, _>(row, "causation_id", &mut u);
        let schema_version = get::<OptText, _>(row, "schema_version", &mut u);
        let status = get::<Text, _>(row, "status", &mut u);
        let attempts_made = get::<Int4, _>(row, "attempts_made", &mut u);
        let max_attempts = get::<Int4, _>(row, "max_attempts", &mut u);
        let last_error = get::<OptText, _>(row, "last_error", &mut u);
        let scheduled_at = time(row, "scheduled_at", &mut u);
        let scheduled_at = u.required("scheduled_at", scheduled_at);
        let completed_at = time(row, "completed_at", &mut u);
        let locked_at = time(row, "locked_at", &mut u);
        let locked_by = get::<OptText, _>(row, "locked_by", &mut u);
        let created_at = time(row, "created_at", &mut u);
        let created_at = u.required("created_at", created_at);
        let updated_at = time(row, "updated_at", &mut u);
        Ok(InboxRow(InboxRawRow {
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
            message_id: get::<Text, _>(row, "message_id", &mut u),
            consumer_group: get::<Text, _>(row, "consumer_group", &mut u),
            source: get::<Text, _>(row, "source", &mut u),
            partition_key: get::<OptText, _>(row, "partition_key", &mut u),
            unreadable: u.finish(),
            // Columns after the row's, when the statement returns them (land_run.sql,
            // lock_row_run.sql); absent elsewhere.
            earlier: NamedRow::get::<Nullable<diesel::sql_types::Bool>, Option<bool>>(
                row, "earlier",
            )
            .ok()
            .flatten(),
            timeout_before: NamedRow::get::<OptText, Option<String>>(row, "timeout_before")
                .ok()
                .flatten(),
        }))
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
        // diesel-async keeps the kind, not the code: the class 23 kinds it names, and the
        // class 22 data exceptions, which it reports as `Unknown`, told by the server's
        // message through the sqlx store's own table (`sql::data_exception_from_message`), so
        // that both drivers refuse the same messages (R132, E-18).
        match e {
            E::DatabaseError(K::CheckViolation, _) => Some("23514".into()),
            E::DatabaseError(K::NotNullViolation, _) => Some("23502".into()),
            E::DatabaseError(K::ForeignKeyViolation, _) => Some("23503".into()),
            E::DatabaseError(K::UniqueViolation, _) => Some("23505".into()),
            E::DatabaseError(K::RestrictViolation, _) => Some("23001".into()),
            E::DatabaseError(K::ExclusionViolation, _) => Some("23P01".into()),
            E::DatabaseError(_, info) => {
                txoutbox_postgres::sql::data_exception_from_message(info.message())
                    .map(str::to_owned)
            }
            _ => None,
        }
    }

    async fn inbox_rows(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<InboxRawRow>, Self::Error> {
        let rows: Vec<InboxRow> = run!(&mut *self.0, sql, binds, load)?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    async fn inbox_int8(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<i64>, Self::Error> {
        let r: Int8Row = run!(&mut *self.0, sql, binds, get_result)?;
        Ok(r.n)
    }

    async fn inbox_text(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Option<String>, Self::Error> {
        let r: TextRow = run!(&mut *self.0, sql, binds, get_result)?;
        Ok(r.v)
    }

    async fn inbox_now(&mut self, sql: &str) -> Result<DateTime<Utc>, Self::Error> {
        let r: NowRow = run!(&mut *self.0, sql, Vec::new(), get_result)?;
        Ok(r.now)
    }

    async fn inbox_counts(
        &mut self,
        sql: &str,
        binds: Vec<Bind>,
    ) -> Result<Vec<(String, String, i64)>, Self::Error> {
        let rows: Vec<CountRow> = run!(&mut *self.0, sql, binds, load)?;
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
