//! The sqlx backend: [`PgOutboxRepository`] (relay and operator side), [`PgOutboxWriter`]
//! (writes in the caller's transaction) and [`create_schema`].

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_core::error::RepositoryError;
use outbox_core::event::{NewEvent, OutboxEvent, Status, WorkerId, force_unlock_text};
use outbox_core::repository::{
    BlockedKey, Capabilities, DEFAULT_BACKEND_BATCH_SIZE, Delivery, DeliveryBound, EmptyDelivery,
    FetchRequest, Fetched, OutboxRepository, Outcome, OutcomeResult, STALE_LOCK_MAX_BATCHES,
    StatusCount, UndecodableRow, WriteResult, WrittenOutcome, args, check_backend_batch_size,
};
use sqlx::postgres::{PgPool, PgRow};
use sqlx::{AssertSqlSafe, PgConnection, Row};
use uuid::Uuid;

use crate::error::Error;
use crate::shared;
use crate::sql::{
    self, BlockedKeysParams, ErrorClass, FetchParams, HeadRows, InsertColumns, Layout, RawRow,
    Statements, TableName, Take, WalkCursor,
};

/// Settings of the sqlx backend.
#[derive(Debug, Clone)]
pub struct PgConfig {
    table: TableName,
    layout: Layout,
    batch_size: usize,
    error_max_length: usize,
}

impl Default for PgConfig {
    fn default() -> Self {
        Self {
            table: TableName::default(),
            layout: Layout::Plain,
            batch_size: DEFAULT_BACKEND_BATCH_SIZE,
            error_max_length: outbox_core::event::limits::DEFAULT_ERROR_MAX_LENGTH,
        }
    }
}

impl PgConfig {
    /// The table name, `table` or `schema.table`, validated (R78).
    pub fn table_name(mut self, name: &str) -> Result<Self, Error> {
        self.table = TableName::new(name)?;
        Ok(self)
    }

    /// An already validated table name.
    pub fn table(mut self, table: TableName) -> Self {
        self.table = table;
        self
    }

    /// The table's layout (default [`Layout::Plain`]); it must match how the table was created
    /// ([`create_schema_with`]). The repository's [`PgOutboxRepository::writer`] writes with it.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// The configured layout.
    pub fn layout_ref(&self) -> Layout {
        self.layout
    }

    /// Maintenance batch size (R63): 1 to 10,000, default 1000.
    pub fn batch_size(mut self, n: usize) -> Result<Self, outbox_core::ConfigError> {
        self.batch_size = check_backend_batch_size(n)?;
        Ok(self)
    }

    /// last_error limit in bytes (R9): 16 to 2,000 (the size of the `last_error` column), default
    /// 2,000; a larger value is a configuration error.
    pub fn error_max_length(mut self, n: usize) -> Result<Self, outbox_core::ConfigError> {
        self.error_max_length = outbox_core::event::check_error_max_length(n)?;
        Ok(self)
    }

    /// The configured table.
    pub fn table_ref(&self) -> &TableName {
        &self.table
    }
}

/// Maps a sqlx error to the core vocabulary: connection, pool and timeout problems are
/// [`RepositoryError::Unavailable`] (transient for the relay); constraint violations are
/// [`RepositoryError::Constraint`] naming the rule; a missing table is
/// [`RepositoryError::Schema`].
pub fn map_err(table: &TableName, e: sqlx::Error) -> RepositoryError {
    match e {
        sqlx::Error::Database(db) => {
            let code = db.code().map(|c| c.into_owned()).unwrap_or_default();
            match sql::classify(&code) {
                ErrorClass::Transient => RepositoryError::Unavailable {
                    message: format!("{db} (SQLSTATE {code})"),
                },
                ErrorClass::Constraint => RepositoryError::Constraint {
                    message: match db.constraint() {
                        Some(c) => format!("{} ({db})", sql::constraint_rule(table, c)),
                        None => format!("{db} (SQLSTATE {code})"),
                    },
                },
                ErrorClass::Schema => RepositoryError::Schema(format!(
                    "{db} (SQLSTATE {code}); create the schema for table {table} first (create_schema)"
                )),
                ErrorClass::Other => RepositoryError::Other(format!("{db} (SQLSTATE {code})")),
            }
        }
        e @ (sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed
        | sqlx::Error::Protocol(_)) => RepositoryError::Unavailable {
            message: e.to_string(),
        },
        other => RepositoryError::Other(other.to_string()),
    }
}

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

fn decoded(table: &TableName, r: &PgRow) -> Result<OutboxEvent, RepositoryError> {
    raw_row(r)
        .map_err(|e| map_err(table, e))?
        .decode()
        .map_err(|u| {
            RepositoryError::Other(format!("row {} cannot be decoded: {}", u.id, u.reason))
        })
}

/// Creates the table and its indexes if missing, in one transaction under an advisory lock
/// (idempotent; on an existing ancestor table it adds only what is missing, R79). Creates the
/// schema of a qualified name too. The plain layout; see [`create_schema_with`].
pub async fn create_schema(pool: &PgPool, table: &TableName) -> Result<(), Error> {
    create_schema_with(pool, table, Layout::Plain).await
}

/// [`create_schema`] for either layout. For [`Layout::Partitioned`] it runs
/// [`sql::partitioned::ddl`] with [`sql::partitioned::DEFAULT_MONTHS_AHEAD`]: the partitioned
/// table, its default partition, the seven indexes and the monthly partitions of this month
/// and the next three; it refuses (changing nothing) an existing table that is not
/// partitioned. Idempotent.
pub async fn create_schema_with(
    pool: &PgPool,
    table: &TableName,
    layout: Layout,
) -> Result<(), Error> {
    let ddl = match layout {
        Layout::Plain => sql::ddl(table),
        Layout::Partitioned => sql::partitioned::ddl(table, sql::partitioned::DEFAULT_MONTHS_AHEAD),
    };
    locked_ddl(pool, table, "schema creation", ddl).await
}

/// Partitioned layout: creates the missing monthly partitions from the current month (database
/// clock, UTC months) through `months_ahead` months ahead (at most
/// [`sql::partitioned::MONTHS_AHEAD_MAX`]), in one transaction under the schema advisory lock
/// ([`sql::partitioned::ensure_partitions`]). Run it regularly (daily, say) so each month's
/// partition exists before its rows arrive. Fails with [`Error::Database`], creating nothing,
/// when the default partition already holds rows of a missing month (the message says what to
/// do), and with [`Error::Partitions`] for a bad `months_ahead`.
pub async fn ensure_partitions(
    pool: &PgPool,
    table: &TableName,
    months_ahead: u32,
) -> Result<(), Error> {
    let n = sql::partitioned::check_months_ahead(months_ahead)?;
    let stmt = sql::partitioned::ensure_partitions(table, n);
    locked_ddl(pool, table, "partition maintenance", vec![stmt]).await
}

async fn locked_ddl(
    pool: &PgPool,
    table: &TableName,
    during: &'static str,
    ddl: Vec<String>,
) -> Result<(), Error> {
    let db = |e: sqlx::Error| Error::Database {
        during,
        message: e.to_string(),
    };
    let stmts = Statements::new(table);
    let mut tx = pool.begin().await.map_err(db)?;
    sqlx::query(AssertSqlSafe(stmts.schema_lock.as_str()))
        .bind(stmts.schema_lock_key())
        .execute(&mut *tx)
        .await
        .map_err(db)?;
    for s in ddl {
        sqlx::raw_sql(AssertSqlSafe(s))
            .execute(&mut *tx)
            .await
            .map_err(db)?;
    }
    tx.commit().await.map_err(db)
}

/// Writes events inside the caller's transaction (R12): pass `&mut *tx` of a sqlx
/// `Transaction<'_, Postgres>` (or any `&mut PgConnection` inside a transaction). Never begins,
/// commits or rolls back.
///
/// With [`PgOutboxWriter::notify`] on, a write that inserted at least one row also runs
/// `pg_notify` on the table's channel ([`TableName::notify_channel`]) in the same transaction:
/// PostgreSQL delivers it at commit, never for a rollback, and a relay that LISTENs on the
/// channel (`outbox-relay run` does) starts a cycle at once instead of waiting for its poll.
#[derive(Debug, Clone)]
pub struct PgOutboxWriter {
    stmts: Arc<Statements>,
    notify: bool,
}

impl PgOutboxWriter {
    /// A writer for `table`, notification off.
    pub fn new(table: &TableName) -> Self {
        Self {
            stmts: Arc::new(Statements::new(table)),
            notify: false,
        }
    }

    /// Turns the wake-up notification of relays on or off (off by default: NOTIFY takes a
    /// database-wide lock at commit, which serializes the commits of notifying transactions;
    /// turn it on when commit-to-publish latency matters more than peak write rate).
    pub fn notify(mut self, on: bool) -> Self {
        self.notify = on;
        self
    }

    /// Whether writes notify.
    pub fn notifies(&self) -> bool {
        self.notify
    }

    /// A writer for `table` with `layout` (which must match the table's, see
    /// [`create_schema_with`]), notification off.
    pub fn with_layout(table: &TableName, layout: Layout) -> Self {
        Self {
            stmts: Arc::new(Statements::with_layout(table, layout)),
            notify: false,
        }
    }

    /// The table it writes to.
    pub fn table(&self) -> &TableName {
        &self.stmts.table
    }

    /// The layout it writes with.
    pub fn layout(&self) -> Layout {
        self.stmts.layout
    }

    /// Writes `events` in one insert statement: created_at is one `clock_timestamp()` for the
    /// call (R73); a repeated idempotency key returns the row already there (R16, R17). Returns,
    /// per event in order, the stored row and whether this call inserted it (R13).
    ///
    /// Fails with [`RepositoryError::Other`], writing nothing, when `conn` is not inside a sqlx
    /// transaction (R12): in autocommit the events would reach the relay whether or not the
    /// application's change commits. Open one with `pool.begin()` or `conn.begin()` and pass
    /// `&mut *tx`; a transaction begun with a raw `BEGIN` statement is not seen by sqlx and is
    /// refused too.
    pub async fn write(
        &self,
        conn: &mut PgConnection,
        events: Vec<NewEvent>,
    ) -> Result<Vec<WriteResult>, RepositoryError> {
        let table = &self.stmts.table;
        if !sqlx::Connection::is_in_transaction(&*conn) {
            return Err(RepositoryError::Other(
                "the outbox write needs the caller's open transaction, and this connection is in autocommit: open one with `let mut tx = pool.begin().await?`, pass `&mut *tx`, and commit it with the application's change".into(),
            ));
        }
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let plan = sql::dedupe_write(&events);
        // Partitioned layout: serialize the writers of each key (R17) before the insert.
        if let Some(lock) = &self.stmts.idempotency_lock {
            let keys = sql::partitioned::lock_keys(&events, &plan);
            if !keys.is_empty() {
                let isolation: String = sqlx::query_scalar(AssertSqlSafe(lock.as_str()))
                    .bind(keys)
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(|e| map_err(table, e))?;
                shared::check_write_isolation(table, &isolation)?;
            }
        }
        let c = InsertColumns::new(plan.unique.iter().map(|&i| &events[i]));
        let rows = sqlx::query(AssertSqlSafe(self.stmts.insert.as_str()))
            .bind(c.id)
            .bind(c.event_type)
            .bind(c.payload)
            .bind(c.headers)
            .bind(c.trace_id)
            .bind(c.idempotency_key)
            .bind(c.correlation_id)
            .bind(c.causation_id)
            .bind(c.schema_version)
            .bind(c.max_attempts)
            .bind(c.scheduled_at)
            .bind(c.delay_us)
            .bind(c.aggregate_type)
            .bind(c.aggregate_id)
            .bind(c.topic)
            .bind(c.partition_key)
            .fetch_all(&mut *conn)
            .await
            .map_err(|e| match &e {
                sqlx::Error::Database(db) => sql::schedule_refusal(db.message())
                    .map_or_else(|| map_err(table, e), RepositoryError::Validation),
                _ => map_err(table, e),
            })?;
        let mut inserted: HashMap<Uuid, OutboxEvent> = HashMap::with_capacity(rows.len());
        for r in &rows {
            let e = decoded(table, r)?;
            inserted.insert(e.id, e);
        }
        // Events the insert skipped: read the rows already there.
        let mut existing = Vec::new();
        if let Some((ids, keys)) = shared::skipped_lookup(&events, &plan, &inserted) {
            let rows = sqlx::query(AssertSqlSafe(self.stmts.select_existing.as_str()))
                .bind(ids)
                .bind(keys)
                .fetch_all(&mut *conn)
                .await
                .map_err(|e| map_err(table, e))?;
            for r in &rows {
                existing.push(decoded(table, r)?);
            }
        }
        if self.notify && !inserted.is_empty() {
            sqlx::query(AssertSqlSafe(self.stmts.notify.as_str()))
                .bind(table.notify_channel())
                .execute(&mut *conn)
                .await
                .map_err(|e| map_err(table, e))?;
        }
        shared::write_results(&events, &plan, &inserted, existing)
    }
}

type PgQuery<'q> = sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// Binds the parameters of [`Statements::fetch_heads`] in their order (`$1`–`$9`). The one
/// place that knows that bind order: the repository uses it through [`fetch_rows`], and so do
/// the plan test and the benchmarks, which may put `EXPLAIN …` before the statement text.
pub fn bind_fetch_heads<'q>(
    query: PgQuery<'q>,
    p: &FetchParams,
    cursor: (String, String),
) -> PgQuery<'q> {
    query
        .bind(p.limit)
        .bind(p.lease_us)
        .bind(p.topics.clone())
        .bind(p.aggregate_types.clone())
        .bind(p.aggregate_ids.clone())
        .bind(p.window)
        .bind(p.walk_limit)
        .bind(cursor.0)
        .bind(cursor.1)
}

/// Binds the parameters of [`Statements::fetch_take`] / [`Statements::fetch_take_transaction`]
/// in their order (`$1`–`$8`): the worker, `p`, and the candidate heads from
/// [`Statements::fetch_heads`].
pub fn bind_fetch_take<'q>(
    query: PgQuery<'q>,
    worker: &str,
    p: &FetchParams,
    heads: Vec<Uuid>,
) -> PgQuery<'q> {
    query
        .bind(worker.to_owned())
        .bind(p.limit)
        .bind(p.lease_us)
        .bind(p.max_per_key)
        .bind(p.topics.clone())
        .bind(p.aggregate_types.clone())
        .bind(p.aggregate_ids.clone())
        .bind(heads)
}

/// Runs the two fetch statements on `conn`, inside the caller's transaction: the heads
/// ([`Statements::fetch_heads`], from `cursor`, which it then advances), then the take
/// ([`Statements::take`]). Returns the taken
/// rows ([`sql::COLUMNS`]) in return order.
///
/// With [`Take::Transaction`] the heads statement runs inside
/// [`Statements::window_savepoint`] and the window's row locks are released
/// ([`Statements::window_release`]) before the take: the delivery transaction stays open for
/// the whole cycle and must hold only the rows it took.
pub async fn fetch_rows(
    conn: &mut sqlx::PgConnection,
    stmts: &Statements,
    take: Take,
    worker: &str,
    p: &FetchParams,
    cursor: &WalkCursor,
) -> Result<Vec<PgRow>, sqlx::Error> {
    let release_window = take == Take::Transaction;
    let take = stmts.take(take);
    for attempt in 1..=sql::FETCH_ATTEMPTS {
        if release_window {
            sqlx::query(AssertSqlSafe(stmts.window_savepoint.as_str()))
                .execute(&mut *conn)
                .await?;
        }
        let heads = bind_fetch_heads(
            sqlx::query(AssertSqlSafe(stmts.fetch_heads.as_str())),
            p,
            cursor.get(),
        )
        .fetch_all(&mut *conn)
        .await?;
        let heads = HeadRows::new(
            heads
                .iter()
                .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
                .collect::<Result<Vec<_>, sqlx::Error>>()?,
        );
        cursor.advance(heads.walked_to);
        if release_window {
            sqlx::query(AssertSqlSafe(stmts.window_release.as_str()))
                .execute(&mut *conn)
                .await?;
        }
        if heads.ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows = bind_fetch_take(
            sqlx::query(AssertSqlSafe(take.to_owned())),
            worker,
            p,
            heads.ids,
        )
        .fetch_all(&mut *conn)
        .await?;
        // Every candidate was taken by another relay between the two statements: look again
        // (a new snapshot), a bounded number of times (sql::FETCH_ATTEMPTS).
        if !rows.is_empty() || attempt == sql::FETCH_ATTEMPTS {
            return Ok(rows);
        }
    }
    Ok(Vec::new())
}

/// The sqlx repository (relay and operator side) on a pool.
#[derive(Debug, Clone)]
pub struct PgOutboxRepository {
    pool: PgPool,
    stmts: Arc<Statements>,
    cfg: PgConfig,
    cursor: WalkCursor,
    fail_next_commit: Arc<AtomicBool>,
}

impl PgOutboxRepository {
    /// A repository on `pool` with these settings. Create the schema first ([`create_schema`]).
    pub fn new(pool: PgPool, cfg: PgConfig) -> Self {
        Self {
            pool,
            stmts: Arc::new(Statements::with_layout(&cfg.table, cfg.layout)),
            cfg,
            cursor: WalkCursor::default(),
            fail_next_commit: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The writer for this repository's table (notification off; see
    /// [`PgOutboxWriter::notify`]).
    pub fn writer(&self) -> PgOutboxWriter {
        PgOutboxWriter {
            stmts: self.stmts.clone(),
            notify: false,
        }
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table's layout.
    pub fn layout(&self) -> Layout {
        self.cfg.layout
    }

    /// Partitioned layout: [`ensure_partitions`] on this repository's pool and table.
    pub async fn ensure_partitions(&self, months_ahead: u32) -> Result<(), Error> {
        ensure_partitions(&self.pool, &self.cfg.table, months_ahead).await
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.cfg.table
    }

    /// The statements in use.
    pub fn statements(&self) -> &Statements {
        &self.stmts
    }

    /// Test hook (cargo feature `testing`): the next outcome transaction runs its statements and
    /// then rolls back, and `write_outcomes` returns an error (R57; P-06).
    #[cfg(feature = "testing")]
    pub fn fail_next_outcome_commit(&self) {
        self.fail_next_commit.store(true, Ordering::SeqCst);
    }

    fn err(&self, e: sqlx::Error) -> RepositoryError {
        map_err(&self.cfg.table, e)
    }

    async fn exec_1(&self, sql: &str, id: Uuid, worker: &WorkerId) -> Result<u64, RepositoryError> {
        Ok(sqlx::query(AssertSqlSafe(sql))
            .bind(id)
            .bind(worker.as_str())
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected())
    }
}

fn applied(rows: &[PgRow], out: &mut HashMap<Uuid, OutcomeResult>) -> Result<(), sqlx::Error> {
    for r in rows {
        let status: String = r.try_get(1)?;
        let status = status
            .parse::<Status>()
            .map_err(|e| sqlx::Error::Decode(e.into()))?;
        out.insert(
            r.try_get(0)?,
            OutcomeResult::Applied {
                status,
                attempts_made: r.try_get(2)?,
                scheduled_at: r.try_get(3)?,
            },
        );
    }
    Ok(())
}

#[async_trait]
impl OutboxRepository for PgOutboxRepository {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "postgres-sqlx",
            database_clock: true,
            undecodable_rows: true,
            transaction_delivery: true,
        }
    }

    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        sqlx::query_scalar(AssertSqlSafe(self.stmts.now.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.err(e))
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxEvent>, RepositoryError> {
        let row = sqlx::query(AssertSqlSafe(self.stmts.get.as_str()))
            .bind(id)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        row.map(|r| decoded(&self.cfg.table, &r)).transpose()
    }

    async fn fetch_and_lock(&self, req: &FetchRequest) -> Result<Vec<Fetched>, RepositoryError> {
        req.validate()?;
        let p = FetchParams::new(req);
        let mut tx = self.pool.begin().await.map_err(|e| self.err(e))?;
        let rows = fetch_rows(
            &mut tx,
            &self.stmts,
            Take::Lease,
            req.worker.as_str(),
            &p,
            &self.cursor,
        )
        .await
        .map_err(|e| self.err(e))?;
        tx.commit().await.map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| fetched_row(r).map_err(|e| self.err(e)))
            .collect()
    }

    async fn begin_delivery(
        &self,
        req: &FetchRequest,
        bound: DeliveryBound,
    ) -> Result<(Vec<Fetched>, Box<dyn Delivery>), RepositoryError> {
        req.validate()?;
        let p = FetchParams::new(req);
        let mut tx = self.pool.begin().await.map_err(|e| self.err(e))?;
        sqlx::query(AssertSqlSafe(self.stmts.delivery_begin.as_str()))
            .bind(bound.server_timeout.as_millis().max(1).to_string())
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?;
        let rows = fetch_rows(
            &mut tx,
            &self.stmts,
            Take::Transaction,
            req.worker.as_str(),
            &p,
            &self.cursor,
        )
        .await
        .map_err(|e| self.err(e))?;
        let rows = rows
            .iter()
            .map(|r| fetched_row(r).map_err(|e| self.err(e)))
            .collect::<Result<Vec<_>, RepositoryError>>()?;
        if rows.is_empty() {
            // Nothing held: end the transaction now and hand the connection back.
            tx.commit().await.map_err(|e| self.err(e))?;
            return Ok((rows, Box::new(EmptyDelivery)));
        }
        let delivery = PgDelivery {
            tx: Some(tx),
            repo: self.clone(),
            worker: req.worker.clone(),
            fetched: shared::fetched_state(&rows),
        };
        Ok((rows, Box::new(delivery)))
    }

    async fn write_outcomes(
        &self,
        worker: &WorkerId,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        let b = shared::OutcomeBinds::new(outcomes, self.cfg.error_max_length);
        let mut results: HashMap<Uuid, OutcomeResult> = HashMap::new();
        let mut tx = self.pool.begin().await.map_err(|e| self.err(e))?;
        if !b.done.is_empty() {
            let rows = sqlx::query(AssertSqlSafe(self.stmts.complete.as_str()))
                .bind(&b.done)
                .bind(worker.as_str())
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
            applied(&rows, &mut results).map_err(|e| self.err(e))?;
        }
        if !b.fail_ids.is_empty() {
            let rows = sqlx::query(AssertSqlSafe(self.stmts.fail.as_str()))
                .bind(&b.fail_ids)
                .bind(&b.fail_counted)
                .bind(&b.fail_errors)
                .bind(&b.fail_after_us)
                .bind(&b.fail_at)
                .bind(worker.as_str())
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
            applied(&rows, &mut results).map_err(|e| self.err(e))?;
        }
        if !b.released.is_empty() {
            let rows = sqlx::query(AssertSqlSafe(self.stmts.release.as_str()))
                .bind(&b.released)
                .bind(worker.as_str())
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| self.err(e))?;
            applied(&rows, &mut results).map_err(|e| self.err(e))?;
        }
        if self.fail_next_commit.swap(false, Ordering::SeqCst) {
            tx.rollback().await.map_err(|e| self.err(e))?;
            return Err(RepositoryError::Other(
                "injected failure of the outcome commit (fail_next_outcome_commit)".into(),
            ));
        }
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(shared::written_outcomes(outcomes, &results))
    }

    async fn refresh_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        Ok(self.exec_1(&self.stmts.refresh_lock, id, worker).await? == 1)
    }

    async fn release_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        Ok(self.exec_1(&self.stmts.release_lock, id, worker).await? == 1)
    }

    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError> {
        let mut tx = self.pool.begin().await.map_err(|e| self.err(e))?;
        let n = sqlx::query(AssertSqlSafe(self.stmts.release_locks.as_str()))
            .bind(ids)
            .bind(worker.as_str())
            .execute(&mut *tx)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected();
        if n != ids.len() as u64 {
            tx.rollback().await.map_err(|e| self.err(e))?;
            return Err(RepositoryError::ReleaseMismatch {
                changed: n,
                expected: ids.len() as u64,
            });
        }
        tx.commit().await.map_err(|e| self.err(e))?;
        Ok(n)
    }

    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError> {
        args::stale_timeout(timeout)?;
        let batch = self.cfg.batch_size as i64;
        let mut total = 0;
        for _ in 0..STALE_LOCK_MAX_BATCHES {
            let n = sqlx::query(AssertSqlSafe(self.stmts.release_stale.as_str()))
                .bind(sql::micros(timeout))
                .bind(batch)
                .execute(&self.pool)
                .await
                .map_err(|e| self.err(e))?
                .rows_affected();
            total += n;
            if n < batch as u64 {
                break;
            }
        }
        Ok(total)
    }

    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError> {
        Ok(sqlx::query(AssertSqlSafe(self.stmts.requeue.as_str()))
            .bind(id)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected()
            == 1)
    }

    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError> {
        args::cleanup(retention_days, batch_size)?;
        Ok(
            sqlx::query(AssertSqlSafe(self.stmts.delete_old_completed.as_str()))
                .bind(i32::try_from(retention_days).unwrap_or(i32::MAX))
                .bind(i64::try_from(batch_size).unwrap_or(i64::MAX))
                .execute(&self.pool)
                .await
                .map_err(|e| self.err(e))?
                .rows_affected(),
        )
    }

    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError> {
        let text = force_unlock_text(reason)?;
        let n = sqlx::query(AssertSqlSafe(self.stmts.force_unlock.as_str()))
            .bind(id)
            .bind(text)
            .execute(&self.pool)
            .await
            .map_err(|e| self.err(e))?
            .rows_affected();
        if n == 0 {
            return Err(RepositoryError::NotLocked(id));
        }
        Ok(())
    }

    async fn blocked_keys(
        &self,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<BlockedKey>, RepositoryError> {
        let b = BlockedKeysParams::new(lease_ttl, limit);
        let rows = sqlx::query(AssertSqlSafe(self.stmts.blocked_keys.as_str()))
            .bind(b.lease_us)
            .bind(b.limit)
            .bind(b.candidates)
            .bind(b.waiting_cap)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        rows.iter()
            .map(|r| {
                Ok(BlockedKey {
                    topic: r.try_get(0)?,
                    partition_key: r.try_get(1)?,
                    head_id: r.try_get(2)?,
                    attempts_made: r.try_get(3)?,
                    max_attempts: r.try_get(4)?,
                    last_error: r.try_get(5)?,
                    next_try: r.try_get(6)?,
                    locked_by: r.try_get(7)?,
                    locked_at: r.try_get(8)?,
                    waiting: r.try_get(9)?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(|e| self.err(e))
    }

    async fn counts(&self) -> Result<Vec<StatusCount>, RepositoryError> {
        let rows = sqlx::query(AssertSqlSafe(self.stmts.counts.as_str()))
            .fetch_all(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        let mut out = Vec::with_capacity(rows.len());
        for r in &rows {
            let status: String = r.try_get(1).map_err(|e| self.err(e))?;
            let Ok(status) = status.parse::<Status>() else {
                // A status this library never writes (R2); not countable as one of the three.
                continue;
            };
            out.push(StatusCount {
                topic: r.try_get(0).map_err(|e| self.err(e))?,
                status,
                count: r.try_get(2).map_err(|e| self.err(e))?,
            });
        }
        out.sort();
        Ok(out)
    }

    async fn oldest_due_age(&self) -> Result<Option<Duration>, RepositoryError> {
        let us: Option<i64> = sqlx::query_scalar(AssertSqlSafe(self.stmts.oldest_due_age.as_str()))
            .fetch_one(&self.pool)
            .await
            .map_err(|e| self.err(e))?;
        Ok(us.map(|u| Duration::from_micros(u.max(0) as u64)))
    }
}

/// An open delivery transaction of the sqlx backend (R84). Dropping it rolls back.
struct PgDelivery {
    tx: Option<sqlx::Transaction<'static, sqlx::Postgres>>,
    repo: PgOutboxRepository,
    worker: WorkerId,
    fetched: HashMap<Uuid, OutcomeResult>,
}

#[async_trait]
impl Delivery for PgDelivery {
    async fn commit(
        mut self: Box<Self>,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        let repo = self.repo.clone();
        let mut tx = self.tx.take().expect("a delivery commits once");
        let b = shared::OutcomeBinds::new(
            &shared::delivery_writes(outcomes),
            repo.cfg.error_max_length,
        );
        let mut results: HashMap<Uuid, OutcomeResult> = HashMap::new();
        if !b.done.is_empty() {
            let rows = sqlx::query(AssertSqlSafe(repo.stmts.complete_in_delivery.as_str()))
                .bind(&b.done)
                .bind(self.worker.as_str())
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| repo.err(e))?;
            applied(&rows, &mut results).map_err(|e| repo.err(e))?;
        }
        if !b.fail_ids.is_empty() {
            let rows = sqlx::query(AssertSqlSafe(repo.stmts.fail_in_delivery.as_str()))
                .bind(&b.fail_ids)
                .bind(&b.fail_counted)
                .bind(&b.fail_errors)
                .bind(&b.fail_after_us)
                .bind(&b.fail_at)
                .bind(self.worker.as_str())
                .fetch_all(&mut *tx)
                .await
                .map_err(|e| repo.err(e))?;
            applied(&rows, &mut results).map_err(|e| repo.err(e))?;
        }
        if repo.fail_next_commit.swap(false, Ordering::SeqCst) {
            tx.rollback().await.map_err(|e| repo.err(e))?;
            return Err(RepositoryError::Other(
                "injected failure of the outcome commit (fail_next_outcome_commit)".into(),
            ));
        }
        tx.commit().await.map_err(|e| repo.err(e))?;
        Ok(shared::delivery_outcomes(outcomes, &results, &self.fetched))
    }

    async fn rollback(mut self: Box<Self>) {
        if let Some(tx) = self.tx.take() {
            let _ = tx.rollback().await;
        }
    }
}
