//! Writing events inside the caller's diesel-async transaction (R12 to R17): the one writer
//! of `txoutbox_postgres::outbox`, on the application's `&mut AsyncPgConnection`.

use diesel_async::AsyncPgConnection;
use txoutbox_core::RepositoryError;
use txoutbox_core::event::NewEvent;
use txoutbox_core::repository::WriteResult;
use txoutbox_postgres::outbox::Writer;
use txoutbox_postgres::sql::{Layout, TableName};

use crate::driver::{Diesel, DieselDriver};
use crate::error::map_diesel;

/// Writes events inside the caller's open transaction: pass the `&mut AsyncPgConnection` that
/// `conn.transaction(async |conn| …)` hands you. It never begins, commits or rolls back (R12);
/// the events become visible to relays when, and only if, the caller commits.
///
/// ```no_run
/// # async fn demo(conn: &mut diesel_async::AsyncPgConnection, w: txoutbox_diesel::DieselOutboxWriter,
/// #               event: txoutbox_core::NewEvent) -> Result<(), txoutbox_core::RepositoryError> {
/// use diesel_async::AsyncConnection;
/// conn.transaction(async |conn| {
///     // … the application's own writes on `conn` …
///     w.write(conn, vec![event]).await?;
///     Ok::<_, txoutbox_diesel::WriteError>(())
/// })
/// .await?;
/// # Ok(()) }
/// ```
///
/// With [`DieselOutboxWriter::notify`] on, a write that inserted at least one row also runs
/// `pg_notify` on the table's channel (`TableName::notify_channel`) in the same transaction, so
/// a relay that LISTENs on it wakes at commit.
#[derive(Debug, Clone)]
pub struct DieselOutboxWriter(Writer<DieselDriver>);

impl From<Writer<DieselDriver>> for DieselOutboxWriter {
    fn from(w: Writer<DieselDriver>) -> Self {
        Self(w)
    }
}

impl DieselOutboxWriter {
    /// A writer for `table`.
    pub fn new(table: &TableName) -> Self {
        Self(Writer::new(table))
    }

    /// A writer for `table` with `layout` (which must match the table's, see
    /// [`crate::run_migrations_with`]).
    pub fn with_layout(table: &TableName, layout: Layout) -> Self {
        Self(Writer::with_layout(table, layout))
    }

    /// The layout it writes with.
    pub fn layout(&self) -> Layout {
        self.0.layout()
    }

    /// Turns the wake-up notification of relays on or off (see [`Writer::notify`]).
    pub fn notify(self, on: bool) -> Self {
        Self(self.0.notify(on))
    }

    /// Whether writes notify.
    pub fn notifies(&self) -> bool {
        self.0.notifies()
    }

    /// The table written to.
    pub fn table(&self) -> &TableName {
        self.0.table()
    }

    /// Writes `events` with one insert statement inside the caller's transaction: the rules of
    /// [`Writer::write`]. Fails with [`RepositoryError::Other`] when `conn` is not inside a
    /// transaction.
    pub async fn write(
        &self,
        conn: &mut AsyncPgConnection,
        events: Vec<NewEvent>,
    ) -> Result<Vec<WriteResult>, RepositoryError> {
        self.0.write_on(&mut Diesel(conn), events).await
    }
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
