//! Writing events inside the caller's diesel-async transaction (R12 to R17).

use std::collections::HashMap;
use std::sync::Arc;

use diesel::sql_types::{Array, Int4, Int8, Nullable, Text, Timestamptz};
use diesel_async::{AnsiTransactionManager, AsyncPgConnection, RunQueryDsl, TransactionManager};
use outbox_core::RepositoryError;
use outbox_core::event::{NewEvent, OutboxEvent};
use outbox_core::repository::WriteResult;
use outbox_postgres::shared;

use crate::prepared::Prepared;
use outbox_postgres::sql::{self, InsertColumns, Layout, Statements, TableName};
use uuid::Uuid;

use crate::error::map_diesel;
use crate::row::OutboxRow;

type SqlUuid = diesel::sql_types::Uuid;

/// The row of `Statements::idempotency_lock`.
#[derive(diesel::QueryableByName)]
struct IsolationRow {
    #[diesel(sql_type = Text)]
    isolation: String,
}

/// Writes events inside the caller's open transaction: pass the `&mut AsyncPgConnection` that
/// `conn.transaction(async |conn| …)` hands you. It never begins, commits or rolls back (R12);
/// the events become visible to relays when, and only if, the caller commits.
///
/// ```no_run
/// # async fn demo(conn: &mut diesel_async::AsyncPgConnection, w: outbox_diesel::DieselOutboxWriter,
/// #               event: outbox_core::NewEvent) -> Result<(), outbox_core::RepositoryError> {
/// use diesel_async::AsyncConnection;
/// conn.transaction(async |conn| {
///     // … the application's own writes on `conn` …
///     w.write(conn, vec![event]).await?;
///     Ok::<_, outbox_diesel::WriteError>(())
/// })
/// .await?;
/// # Ok(()) }
/// ```
///
/// With [`DieselOutboxWriter::notify`] on, a write that inserted at least one row also runs
/// `pg_notify` on the table's channel (`TableName::notify_channel`) in the same transaction, so
/// a relay that LISTENs on it wakes at commit.
#[derive(Debug, Clone)]
pub struct DieselOutboxWriter {
    stmts: Arc<Statements>,
    notify: bool,
}

/// The error type to use for a `conn.transaction(…)` closure that writes events: it converts
/// from both diesel's error (the application's own statements) and the writer's
/// [`RepositoryError`], and back into a [`RepositoryError`].
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// A statement of the application failed, or the transaction could not commit.
    #[error(transparent)]
    Diesel(#[from] diesel::result::Error),
    /// The outbox write failed.
    #[error(transparent)]
    Outbox(#[from] RepositoryError),
}

impl From<WriteError> for RepositoryError {
    fn from(e: WriteError) -> Self {
        match e {
            WriteError::Outbox(r) => r,
            WriteError::Diesel(d) => map_diesel(&TableName::default(), d),
        }
    }
}

impl DieselOutboxWriter {
    /// A writer for `table`.
    pub fn new(table: &TableName) -> Self {
        Self::from_statements(Arc::new(Statements::new(table)))
    }

    /// A writer for `table` with `layout` (which must match the table's, see
    /// [`crate::run_migrations_with`]). On the partitioned layout a write with idempotency keys
    /// first takes one advisory lock per key (R17; `outbox_postgres::sql::partitioned`).
    pub fn with_layout(table: &TableName, layout: Layout) -> Self {
        Self::from_statements(Arc::new(Statements::with_layout(table, layout)))
    }

    /// The layout it writes with.
    pub fn layout(&self) -> Layout {
        self.stmts.layout
    }

    pub(crate) fn from_statements(stmts: Arc<Statements>) -> Self {
        Self {
            stmts,
            notify: false,
        }
    }

    /// Turns the wake-up notification of relays on or off (off by default: NOTIFY takes a
    /// database-wide lock at commit, which serializes the commits of notifying transactions).
    pub fn notify(mut self, on: bool) -> Self {
        self.notify = on;
        self
    }

    /// Whether writes notify.
    pub fn notifies(&self) -> bool {
        self.notify
    }

    /// The table written to.
    pub fn table(&self) -> &TableName {
        &self.stmts.table
    }

    /// Writes `events` with one insert statement inside the caller's transaction.
    ///
    /// created_at is one `clock_timestamp()` for the call (R73); a repeated idempotency key
    /// returns the row already there, in any status, and inserts nothing; a key repeated in the
    /// call collapses to its first occurrence; a writer of a key that another open transaction
    /// wrote waits for it (R16, R17). Returns, per event in order, the stored row and whether
    /// this call inserted it (R13).
    ///
    /// Fails with [`RepositoryError::Other`] when `conn` is not inside a transaction: writing in
    /// autocommit would publish the events whether or not the application's change commits.
    pub async fn write(
        &self,
        conn: &mut AsyncPgConnection,
        events: Vec<NewEvent>,
    ) -> Result<Vec<WriteResult>, RepositoryError> {
        let table = &self.stmts.table;
        let depth = AnsiTransactionManager::transaction_manager_status_mut(conn)
            .transaction_depth()
            .map_err(|e| map_diesel(table, e))?;
        if depth.is_none() {
            return Err(RepositoryError::Other(
                "the outbox write needs the caller's open transaction: call it inside conn.transaction(async |conn| …)".into(),
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
                let row: IsolationRow = diesel::sql_query(lock.as_str())
                    .bind::<Array<Text>, _>(keys)
                    .get_result(conn)
                    .await
                    .map_err(|e| map_diesel(table, e))?;
                shared::check_write_isolation(table, &row.isolation)?;
            }
        }
        let c = InsertColumns::new(plan.unique.iter().map(|&i| &events[i]));
        let rows: Vec<OutboxRow> = Prepared(
            diesel::sql_query(self.stmts.insert.as_str())
                .into_boxed()
                .bind::<Array<SqlUuid>, _>(c.id)
                .bind::<Array<Text>, _>(c.event_type)
                .bind::<Array<Text>, _>(c.payload)
                .bind::<Array<Nullable<Text>>, _>(c.headers)
                .bind::<Array<Nullable<Text>>, _>(c.trace_id)
                .bind::<Array<Nullable<Text>>, _>(c.idempotency_key)
                .bind::<Array<Nullable<Text>>, _>(c.correlation_id)
                .bind::<Array<Nullable<Text>>, _>(c.causation_id)
                .bind::<Array<Nullable<Text>>, _>(c.schema_version)
                .bind::<Array<Int4>, _>(c.max_attempts)
                .bind::<Array<Nullable<Timestamptz>>, _>(c.scheduled_at)
                .bind::<Array<Nullable<Int8>>, _>(c.delay_us)
                .bind::<Array<Text>, _>(c.aggregate_type)
                .bind::<Array<SqlUuid>, _>(c.aggregate_id)
                .bind::<Array<Text>, _>(c.topic)
                .bind::<Array<Text>, _>(c.partition_key),
        )
        .load(conn)
        .await
        .map_err(|e| match &e {
            diesel::result::Error::DatabaseError(_, info) => {
                outbox_postgres::sql::schedule_refusal(info.message())
                    .map_or_else(|| map_diesel(table, e), RepositoryError::Validation)
            }
            _ => map_diesel(table, e),
        })?;
        let mut inserted: HashMap<Uuid, OutboxEvent> = HashMap::with_capacity(rows.len());
        for r in rows {
            let e = r.into_event()?;
            inserted.insert(e.id, e);
        }
        // Events the insert skipped (ON CONFLICT DO NOTHING): read the rows already there.
        let mut existing = Vec::new();
        if let Some((ids, keys)) = shared::skipped_lookup(&events, &plan, &inserted) {
            let rows: Vec<OutboxRow> = diesel::sql_query(self.stmts.select_existing.as_str())
                .bind::<Array<SqlUuid>, _>(ids)
                .bind::<Array<Text>, _>(keys)
                .load(conn)
                .await
                .map_err(|e| map_diesel(table, e))?;
            for r in rows {
                existing.push(r.into_event()?);
            }
        }
        if self.notify && !inserted.is_empty() {
            diesel::sql_query(self.stmts.notify.as_str())
                .bind::<Text, _>(table.notify_channel())
                .execute(conn)
                .await
                .map_err(|e| map_diesel(table, e))?;
        }
        shared::write_results(&events, &plan, &inserted, existing)
    }
}
