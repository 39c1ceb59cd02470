//! Writing events inside the caller's transaction (R12 to R17), for every driver.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Arc;

use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::{NewEvent, OutboxEvent};
use txoutbox_core::repository::WriteResult;
use uuid::Uuid;

use crate::driver::outbox::OutboxRows;
use crate::driver::{Bind, Driver};
use crate::shared;
use crate::sql::{self, InsertColumns, Layout, RawRow, Statements, TableName};

/// Writes events inside the caller's transaction (R12). Never begins, commits or rolls back:
/// the events become visible to relays when, and only if, the caller commits.
///
/// With [`Writer::notify`] on, a write that inserted at least one row also runs `pg_notify` on
/// the table's channel ([`TableName::notify_channel`]) in the same transaction: PostgreSQL
/// delivers it at commit, never for a rollback, and a relay that LISTENs on the channel starts
/// a cycle at once instead of waiting for its poll.
pub struct Writer<D> {
    stmts: Arc<Statements>,
    notify: bool,
    driver: PhantomData<fn() -> D>,
}

impl<D> Clone for Writer<D> {
    fn clone(&self) -> Self {
        Self {
            stmts: self.stmts.clone(),
            notify: self.notify,
            driver: PhantomData,
        }
    }
}

impl<D> std::fmt::Debug for Writer<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer")
            .field("table", &self.stmts.table)
            .field("layout", &self.stmts.layout)
            .field("notify", &self.notify)
            .finish()
    }
}

/// A row read outside a fetch; an undecodable one is an error naming it.
pub(crate) fn decoded(raw: RawRow) -> Result<OutboxEvent, RepositoryError> {
    raw.decode().map_err(|u| {
        RepositoryError::Other(format!("row {} cannot be decoded: {}", u.id, u.reason))
    })
}

impl<D> Writer<D> {
    /// A writer for `table`, notification off.
    pub fn new(table: &TableName) -> Self {
        Self::from_statements(Arc::new(Statements::new(table)))
    }

    /// A writer for `table` with `layout` (which must match the table's), notification off. On
    /// the partitioned layout a write with idempotency keys first takes one advisory lock per
    /// key (R17; [`crate::sql::partitioned`]).
    pub fn with_layout(table: &TableName, layout: Layout) -> Self {
        Self::from_statements(Arc::new(Statements::with_layout(table, layout)))
    }

    #[doc(hidden)]
    pub fn from_statements(stmts: Arc<Statements>) -> Self {
        Self {
            stmts,
            notify: false,
            driver: PhantomData,
        }
    }

    /// Turns the wake-up notification of relays on or off (off by default: NOTIFY takes a
    /// database-wide lock at commit, which serializes the commits of notifying transactions;
    /// turn it on when commit-to-publish latency matters more than peak write rate).
    pub fn notify(mut self, on: bool) -> Self {
        self.notify = on;
        self
    }

    /// Writes for `pooler` (R194): under [`crate::sql::Pooler::Transaction`] no statement of a
    /// write is prepared beyond the caller's transaction (a writer from
    /// `Repository::writer` has its repository's setting already).
    pub fn pooler(mut self, pooler: crate::sql::Pooler) -> Self {
        self.stmts = Arc::new(Statements::clone(&self.stmts).for_pooler(pooler));
        self
    }

    /// Whether writes notify.
    pub fn notifies(&self) -> bool {
        self.notify
    }

    /// The table it writes to.
    pub fn table(&self) -> &TableName {
        &self.stmts.table
    }

    /// The layout it writes with.
    pub fn layout(&self) -> Layout {
        self.stmts.layout
    }
}

impl<D: Driver> Writer<D> {
    /// Writes `events` in one insert statement: created_at is one `clock_timestamp()` for the
    /// call (R73); a repeated idempotency key returns the row already there, in any status, and
    /// inserts nothing; a key repeated in the call collapses to its first occurrence; a writer
    /// of a key that another open transaction wrote waits for it (R16, R17). Returns, per event
    /// in order, the stored row and whether this call inserted it (R13).
    ///
    /// Fails with [`RepositoryError::Other`], writing nothing, when `conn` is not inside a
    /// transaction the driver knows of (R12): in autocommit the events would reach the relay
    /// whether or not the application's change commits. The message says how to open one.
    pub async fn write(
        &self,
        conn: &mut D::Conn,
        events: Vec<NewEvent>,
    ) -> Result<Vec<WriteResult>, RepositoryError>
    where
        D::Conn: OutboxRows,
    {
        self.write_on(conn, events).await
    }

    /// [`Writer::write`] on any connection that runs the outbox statements (a driver crate's
    /// writer passes its wrapper of the application's connection here).
    #[doc(hidden)]
    pub async fn write_on<C: OutboxRows + ?Sized>(
        &self,
        conn: &mut C,
        events: Vec<NewEvent>,
    ) -> Result<Vec<WriteResult>, RepositoryError> {
        let table = &self.stmts.table;
        let err = |e| C::map_err(table, e);
        if !conn.in_transaction().map_err(err)? {
            return Err(RepositoryError::Other(D::NOT_IN_TRANSACTION.into()));
        }
        if events.is_empty() {
            return Ok(Vec::new());
        }
        let plan = sql::dedupe_write(&events);
        // Partitioned layout: serialize the writers of each key (R17) before the insert.
        if let Some(lock) = &self.stmts.idempotency_lock {
            let keys = sql::partitioned::lock_keys(&events, &plan);
            if !keys.is_empty() {
                let isolation = conn
                    .isolation(lock, vec![Bind::Texts(keys)])
                    .await
                    .map_err(err)?;
                shared::check_write_isolation(table, &isolation)?;
            }
        }
        let c = InsertColumns::new(plan.unique.iter().map(|&i| &events[i]));
        let binds = vec![
            Bind::Uuids(c.id),
            Bind::Texts(c.event_type),
            Bind::Texts(c.payload),
            Bind::NullableTexts(c.headers),
            Bind::NullableTexts(c.trace_id),
            Bind::NullableTexts(c.idempotency_key),
            Bind::NullableTexts(c.correlation_id),
            Bind::NullableTexts(c.causation_id),
            Bind::NullableTexts(c.schema_version),
            Bind::Int4s(c.max_attempts),
            Bind::NullableTimestamps(c.scheduled_at),
            Bind::NullableInt8s(c.delay_us),
            Bind::Texts(c.aggregate_type),
            Bind::Uuids(c.aggregate_id),
            Bind::Texts(c.topic),
            Bind::Texts(c.partition_key),
        ];
        let rows = conn.events(&self.stmts.insert, binds).await.map_err(|e| {
            match C::server_message(&e).and_then(sql::schedule_refusal) {
                Some(v) => RepositoryError::Validation(v),
                None => err(e),
            }
        })?;
        let mut inserted: HashMap<Uuid, OutboxEvent> = HashMap::with_capacity(rows.len());
        for r in rows {
            let e = decoded(r)?;
            inserted.insert(e.id, e);
        }
        // Events the insert skipped (ON CONFLICT DO NOTHING): read the rows already there.
        let mut existing = Vec::new();
        if let Some((ids, keys)) = shared::skipped_lookup(&events, &plan, &inserted) {
            let rows = conn
                .events(
                    &self.stmts.select_existing,
                    vec![Bind::Uuids(ids), Bind::Texts(keys)],
                )
                .await
                .map_err(err)?;
            for r in rows {
                existing.push(decoded(r)?);
            }
        }
        if self.notify && !inserted.is_empty() {
            conn.execute(&self.stmts.notify, vec![Bind::Text(table.notify_channel())])
                .await
                .map_err(err)?;
        }
        shared::write_results(&events, &plan, &inserted, existing)
    }
}
