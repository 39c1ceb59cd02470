//! Decoding rows: diesel reads the columns by name into [`OutboxRow`] with the SQL types of
//! [`crate::schema::outbox_events`]; the outbox's own decoding (headers must be a string map,
//! status one of three, R82) is `txoutbox_postgres::sql::RawRow::decode`, shared with the sqlx
//! backend.

use chrono::{DateTime, Utc};
use diesel::QueryableByName;
use diesel::deserialize::{self, FromSql, QueryableByName as BuildByName};
use diesel::pg::Pg;
use diesel::row::NamedRow;
use diesel::sql_types::{BigInt, Int4, Jsonb, Nullable, Text, Timestamptz};

use serde_json::Value;
use txoutbox_core::repository::{BlockedKey, Fetched, UndecodableRow};
use txoutbox_postgres::sql::RawRow;
use uuid::Uuid;

/// The columns of `txoutbox_postgres::sql::COLUMNS`, read by name.
#[derive(Debug, Clone, QueryableByName)]
#[diesel(table_name = crate::schema::outbox_events)]
#[diesel(check_for_backend(diesel::pg::Pg))]
pub(crate) struct OutboxRow {
    id: Uuid,
    event_type: String,
    payload: Value,
    headers: Option<Value>,
    trace_id: Option<String>,
    idempotency_key: Option<String>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
    schema_version: Option<String>,
    status: String,
    attempts_made: i32,
    max_attempts: i32,
    last_error: Option<String>,
    scheduled_at: DateTime<Utc>,
    completed_at: Option<DateTime<Utc>>,
    locked_at: Option<DateTime<Utc>>,
    locked_by: Option<String>,
    created_at: DateTime<Utc>,
    updated_at: Option<DateTime<Utc>>,
    aggregate_type: String,
    aggregate_id: Uuid,
    topic: String,
    partition_key: String,
}

impl From<OutboxRow> for RawRow {
    fn from(r: OutboxRow) -> Self {
        RawRow {
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
            aggregate_type: r.aggregate_type,
            aggregate_id: r.aggregate_id,
            topic: r.topic,
            partition_key: r.partition_key,
        }
    }
}

/// A row of a fetch, read column by column (R82): a column that cannot be decoded (a
/// timestamp beyond chrono's range, a jsonb number beyond f64, …) or a row the outbox cannot
/// decode becomes [`Fetched::Undecodable`] for that row alone, so the fetch, already committed,
/// still hands out the others. Only an id that cannot be read fails the load.
pub(crate) struct FetchedRow(pub(crate) Fetched);

fn column<'a, ST, T>(row: &impl NamedRow<'a, Pg>, name: &str) -> Result<T, String>
where
    T: FromSql<ST, Pg>,
{
    NamedRow::get::<ST, T>(row, name).map_err(|e| format!("column {name} cannot be decoded: {e}"))
}

fn raw<'a>(row: &impl NamedRow<'a, Pg>, id: Uuid) -> Result<RawRow, String> {
    type Ts = Timestamptz;
    type OptText = Nullable<Text>;
    type OptTs = Nullable<Timestamptz>;
    Ok(RawRow {
        id,
        event_type: column::<Text, _>(row, "event_type")?,
        payload: column::<Jsonb, _>(row, "payload")?,
        headers: column::<Nullable<Jsonb>, _>(row, "headers")?,
        trace_id: column::<OptText, _>(row, "trace_id")?,
        idempotency_key: column::<OptText, _>(row, "idempotency_key")?,
        correlation_id: column::<OptText, _>(row, "correlation_id")?,
        causation_id: column::<OptText, _>(row, "causation_id")?,
        schema_version: column::<OptText, _>(row, "schema_version")?,
        status: column::<Text, _>(row, "status")?,
        attempts_made: column::<Int4, _>(row, "attempts_made")?,
        max_attempts: column::<Int4, _>(row, "max_attempts")?,
        last_error: column::<OptText, _>(row, "last_error")?,
        scheduled_at: column::<Ts, _>(row, "scheduled_at")?,
        completed_at: column::<OptTs, _>(row, "completed_at")?,
        locked_at: column::<OptTs, _>(row, "locked_at")?,
        locked_by: column::<OptText, _>(row, "locked_by")?,
        created_at: column::<Ts, _>(row, "created_at")?,
        updated_at: column::<OptTs, _>(row, "updated_at")?,
        aggregate_type: column::<Text, _>(row, "aggregate_type")?,
        aggregate_id: column::<diesel::sql_types::Uuid, _>(row, "aggregate_id")?,
        topic: column::<Text, _>(row, "topic")?,
        partition_key: column::<Text, _>(row, "partition_key")?,
    })
}

impl BuildByName<Pg> for FetchedRow {
    fn build<'a>(row: &impl NamedRow<'a, Pg>) -> deserialize::Result<Self> {
        let id: Uuid = NamedRow::get::<diesel::sql_types::Uuid, Uuid>(row, "id")?;
        Ok(FetchedRow(match raw(row, id) {
            Ok(r) => match r.decode() {
                Ok(e) => Fetched::Row(e),
                Err(u) => Fetched::Undecodable(u),
            },
            Err(reason) => Fetched::Undecodable(UndecodableRow {
                id,
                topic: column::<Text, _>(row, "topic").unwrap_or_default(),
                partition_key: column::<Text, _>(row, "partition_key").unwrap_or_default(),
                attempts_made: column::<Int4, _>(row, "attempts_made").unwrap_or_default(),
                reason,
            }),
        }))
    }
}

/// What an outcome statement returns per written row.
#[derive(Debug, QueryableByName)]
pub(crate) struct AppliedRow {
    #[diesel(sql_type = diesel::sql_types::Uuid)]
    pub id: Uuid,
    #[diesel(sql_type = Text)]
    pub status: String,
    #[diesel(sql_type = Int4)]
    pub attempts_made: i32,
    #[diesel(sql_type = Timestamptz)]
    pub scheduled_at: DateTime<Utc>,
}

/// `SELECT now()`.
#[derive(Debug, QueryableByName)]
pub(crate) struct NowRow {
    #[diesel(sql_type = Timestamptz)]
    pub now: DateTime<Utc>,
}

/// One row of the fetch's first statement (`fetch_heads`).
#[derive(Debug, QueryableByName)]
pub(crate) struct HeadRow {
    #[diesel(sql_type = diesel::sql_types::Nullable<diesel::sql_types::Uuid>)]
    pub head_id: Option<uuid::Uuid>,
    #[diesel(sql_type = Text)]
    pub topic: String,
    #[diesel(sql_type = Text)]
    pub partition_key: String,
}

/// One row of the blocked-keys statement.
#[derive(Debug, QueryableByName)]
pub(crate) struct BlockedRow {
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Text)]
    partition_key: String,
    #[diesel(sql_type = diesel::sql_types::Uuid)]
    head_id: Uuid,
    #[diesel(sql_type = Int4)]
    attempts_made: i32,
    #[diesel(sql_type = Int4)]
    max_attempts: i32,
    #[diesel(sql_type = Nullable<Text>)]
    last_error: Option<String>,
    #[diesel(sql_type = Timestamptz)]
    next_try: DateTime<Utc>,
    #[diesel(sql_type = Nullable<Text>)]
    locked_by: Option<String>,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    locked_at: Option<DateTime<Utc>>,
    #[diesel(sql_type = BigInt)]
    waiting: i64,
    #[diesel(sql_type = Nullable<Timestamptz>)]
    parked_at: Option<DateTime<Utc>>,
}

impl From<BlockedRow> for BlockedKey {
    fn from(r: BlockedRow) -> Self {
        BlockedKey {
            topic: r.topic,
            partition_key: r.partition_key,
            head_id: r.head_id,
            attempts_made: r.attempts_made,
            max_attempts: r.max_attempts,
            last_error: r.last_error,
            next_try: r.next_try,
            locked_by: r.locked_by,
            locked_at: r.locked_at,
            waiting: r.waiting,
            // Every blocked head is pending: it is parked when its attempts are spent.
            parked: r.attempts_made >= r.max_attempts,
            parked_at: r.parked_at,
        }
    }
}

/// One row of the counts statement.
#[derive(Debug, QueryableByName)]
pub(crate) struct CountRow {
    #[diesel(sql_type = Text)]
    topic: String,
    #[diesel(sql_type = Text)]
    status: String,
    #[diesel(sql_type = BigInt)]
    count: i64,
}

impl From<CountRow> for txoutbox_postgres::driver::outbox::CountRow {
    fn from(r: CountRow) -> Self {
        Self {
            topic: r.topic,
            status: r.status,
            count: r.count,
        }
    }
}

/// The row of `Statements::idempotency_lock`.
#[derive(Debug, QueryableByName)]
pub(crate) struct IsolationRow {
    #[diesel(sql_type = Text)]
    pub isolation: String,
}

/// The oldest-due-age statement.
#[derive(Debug, QueryableByName)]
pub(crate) struct AgeRow {
    #[diesel(sql_type = Nullable<BigInt>)]
    pub age_us: Option<i64>,
}
