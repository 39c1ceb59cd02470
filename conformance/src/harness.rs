//! What a backend gives the suite: a fresh store per trial and a few fixtures.
//!
//! A third-party backend implements [`Harness`] (and [`WriteTx`] for its writer) and a
//! [`Factory`] that makes a fresh, isolated store per call (Postgres: a fresh schema), then
//! invokes [`crate::suite!`] in one of its test files.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::{NewEvent, Status};
use txoutbox_core::repository::{DeliveryMode, OutboxRepository, WriteResult};
use uuid::Uuid;

/// The kind of backend, which decides the scenarios that apply (tags `[mem]` and `[pg]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// The in-memory reference backend (runs `[all]` and `[mem]`).
    Memory,
    /// A Postgres backend (runs `[all]` and `[pg]`).
    Postgres,
    /// Any other backend (runs `[all]`).
    Other,
}

/// A direct change to a stored row (the suite's `set` fixture). `None` leaves a column alone.
#[derive(Debug, Clone, Default)]
pub struct RowPatch {
    /// status.
    pub status: Option<Status>,
    /// attempts_made.
    pub attempts_made: Option<i32>,
    /// max_attempts.
    pub max_attempts: Option<i32>,
    /// last_error (Some(None) sets null).
    pub last_error: Option<Option<String>>,
    /// scheduled_at.
    pub scheduled_at: Option<DateTime<Utc>>,
    /// completed_at (Some(None) sets null).
    pub completed_at: Option<Option<DateTime<Utc>>>,
    /// The lock: Some(Some((worker, locked_at))) holds, Some(None) releases.
    pub lock: Option<Option<(String, DateTime<Utc>)>>,
}

impl RowPatch {
    /// Held by `worker` since `at`.
    pub fn held(worker: &str, at: DateTime<Utc>) -> Self {
        Self {
            lock: Some(Some((worker.to_owned(), at))),
            ..Self::default()
        }
    }
}

/// A writer transaction in the backend's own style (R12).
#[async_trait]
pub trait WriteTx: Send {
    /// Writes events inside this transaction.
    async fn write(&mut self, events: Vec<NewEvent>) -> Result<Vec<WriteResult>, RepositoryError>;
    /// Takes the application lock of `name` for the rest of the transaction (Postgres: a row of
    /// an `aggregates` table `SELECT … FOR UPDATE`; in memory: a mutex). Used by W-04, S-01.
    async fn lock_app(&mut self, name: &str);
    /// Runs one harmless statement, so the transaction has begun on the server (W-04).
    async fn touch(&mut self);
    /// Commits.
    async fn commit(self: Box<Self>) -> Result<(), RepositoryError>;
    /// Rolls back.
    async fn rollback(self: Box<Self>) -> Result<(), RepositoryError>;
}

/// One fresh, isolated store under test.
#[async_trait]
pub trait Harness: Send + Sync {
    /// The kind of backend.
    fn kind(&self) -> BackendKind;
    /// The repository under test.
    fn repository(&self) -> Arc<dyn OutboxRepository>;
    /// A second repository implementation on the same store, if the backend has one (PG-06,
    /// S-02 on Postgres). Defaults to the same repository.
    fn peer_repository(&self) -> Arc<dyn OutboxRepository> {
        self.repository()
    }
    /// Begins a writer transaction.
    async fn begin(&self) -> Box<dyn WriteTx>;
    /// Begins a writer transaction on the peer backend's writer (defaults to [`begin`](Self::begin)).
    async fn begin_peer(&self) -> Box<dyn WriteTx> {
        self.begin().await
    }
    /// Moves the backend clock forward by `d` (Postgres: shifts every row's times back by d).
    async fn advance(&self, d: Duration);
    /// Changes a stored row directly.
    async fn set(&self, id: Uuid, patch: RowPatch);
    /// Makes the next outcome transaction fail (R57).
    fn fail_next_outcome_commit(&self);
    /// Builds this backend's repository with these settings, as a user would configure it, and
    /// reports whether they were accepted (V-17: maintenance batch size 1 to 10,000;
    /// error_max_length > 15). The default says the backend has no such settings.
    fn try_configure(
        &self,
        _batch_size: usize,
        _error_max_length: usize,
    ) -> Option<Result<(), String>> {
        None
    }
    /// For `[pg]` scenarios PG-03 and PG-10: validates `table` as the backend's table-name setting
    /// (`table` or `schema.table`) and, when valid, runs the backend's schema creation for it.
    /// `None`: the backend has no such setting; `Some(Err(text))`: the name was rejected or the
    /// creation failed.
    async fn create_schema_for(&self, _table: &str) -> Option<Result<(), String>> {
        None
    }
    /// For `[pg]` scenarios: runs SQL on a connection of its own and returns the rows as JSON
    /// objects. `{table}` in the text is replaced by the qualified table name.
    async fn sql(&self, _statement: &str) -> Result<Vec<serde_json::Value>, String> {
        Err("this backend has no SQL".into())
    }
    /// The delivery mode the scenarios' relays run in (R76 lease by default; R84 with
    /// [`InTransaction`]).
    fn delivery(&self) -> DeliveryMode {
        DeliveryMode::Lease
    }
}

/// A factory whose harnesses run every relay of the suite with delivery in one transaction
/// (R84): `suite!(postgres_transaction: InTransaction(MyFactory::new()))`. The backend must
/// implement [`OutboxRepository::begin_delivery`].
#[derive(Debug, Clone)]
pub struct InTransaction<F>(pub F);

#[async_trait]
impl<F: Factory> Factory for InTransaction<F> {
    async fn create(&self) -> Arc<dyn Harness> {
        Arc::new(TransactionHarness(self.0.create().await))
    }
}

/// A harness that delegates everything but [`Harness::delivery`].
struct TransactionHarness(Arc<dyn Harness>);

#[async_trait]
impl Harness for TransactionHarness {
    fn kind(&self) -> BackendKind {
        self.0.kind()
    }
    fn repository(&self) -> Arc<dyn OutboxRepository> {
        self.0.repository()
    }
    fn peer_repository(&self) -> Arc<dyn OutboxRepository> {
        self.0.peer_repository()
    }
    async fn begin(&self) -> Box<dyn WriteTx> {
        self.0.begin().await
    }
    async fn begin_peer(&self) -> Box<dyn WriteTx> {
        self.0.begin_peer().await
    }
    async fn advance(&self, d: Duration) {
        self.0.advance(d).await
    }
    async fn set(&self, id: Uuid, patch: RowPatch) {
        self.0.set(id, patch).await
    }
    fn fail_next_outcome_commit(&self) {
        self.0.fail_next_outcome_commit()
    }
    fn try_configure(
        &self,
        batch_size: usize,
        error_max_length: usize,
    ) -> Option<Result<(), String>> {
        self.0.try_configure(batch_size, error_max_length)
    }
    async fn create_schema_for(&self, table: &str) -> Option<Result<(), String>> {
        self.0.create_schema_for(table).await
    }
    async fn sql(&self, statement: &str) -> Result<Vec<serde_json::Value>, String> {
        self.0.sql(statement).await
    }
    fn delivery(&self) -> DeliveryMode {
        DeliveryMode::Transaction
    }
}

/// Makes a fresh harness per trial.
#[async_trait]
pub trait Factory: Send + Sync {
    /// A fresh, empty store.
    async fn create(&self) -> Arc<dyn Harness>;
}
