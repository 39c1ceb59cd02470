//! What an inbox backend gives the suite: a fresh store per trial, its clock, and the fixtures
//! of scenarios.md section 19 (`set`, `advance`, `fail_next_row_commit`, `db_down`/`db_up`,
//! `before_fresh_write`, the effect store).
//!
//! A Postgres backend implements [`InboxHarness`] for a fresh schema and an [`InboxFactory`],
//! then invokes [`crate::inbox_suite!`] in a test file, as the outbox side does.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use txoutbox_core::clock::Clock;
use txoutbox_core::inbox::HandlerError;
use txoutbox_core::inbox::repository::{HandlerTx, InboxBackend};
use uuid::Uuid;

use crate::harness::BackendKind;

/// A direct change to a stored inbox row (the suite's `set`): the outbox's [`RowPatch`](crate::harness::RowPatch), whose
/// columns the inbox row has too.
pub use crate::harness::RowPatch as InboxPatch;

/// One fresh, isolated inbox store under test.
#[async_trait]
pub trait InboxHarness: Send + Sync + 'static {
    /// The backend.
    type Backend: InboxBackend;
    /// The kind of backend (decides `[mem]` and `[pg]`).
    fn kind(&self) -> BackendKind;
    /// The backend under test.
    fn backend(&self) -> Self::Backend;
    /// The suite's clock (the scripted subscription's redelivery times).
    fn clock(&self) -> Arc<dyn Clock>;
    /// Moves the backend clock forward by `d`.
    async fn advance(&self, d: Duration);
    /// Changes a stored row directly.
    async fn set(&self, id: Uuid, patch: InboxPatch);
    /// The next T or T_row fails when it commits.
    fn fail_next_row_commit(&self);
    /// Every new transaction fails to begin (`true`) or no longer does.
    fn set_db_down(&self, down: bool);
    /// Runs `f` just before the next transaction begins (R126's fresh transaction when called
    /// from inside a handler run).
    fn before_next_begin(&self, f: futures::future::BoxFuture<'static, ()>);
    /// The committed effects' message ids, in store order.
    async fn effects(&self) -> Vec<String>;
    /// Writes one effect through the handler's transaction.
    async fn write_effect(
        &self,
        tx: &mut HandlerTx<Self::Backend>,
        message_id: &str,
        key: Option<&str>,
        n: i64,
    ) -> Result<(), HandlerError>;
    /// Makes the handler's transaction unusable (`break_tx`).
    async fn break_tx(&self, tx: &mut HandlerTx<Self::Backend>);
    /// Runs one statement through the handler's transaction (`sql_error`, the `[pg]`
    /// scenarios); its failure is the handler's. Only SQL backends implement it.
    async fn sql_in(
        &self,
        _tx: &mut HandlerTx<Self::Backend>,
        _text: &str,
    ) -> Result<(), HandlerError> {
        panic!("sql_in: this backend runs no SQL (a [pg] scenario on a non-SQL harness)")
    }
    /// Runs plain SQL on a connection of its own: `{table}` is the quoted inbox table,
    /// `{schema}` the trial's schema. A query (SELECT, WITH, or with RETURNING) returns its
    /// rows as JSON objects; anything else returns none. Only SQL backends implement it.
    async fn sql(&self, _text: &str) -> Vec<serde_json::Value> {
        panic!("sql: this backend runs no SQL (a [pg] scenario on a non-SQL harness)")
    }
}

/// Makes a fresh inbox harness per trial.
#[async_trait]
pub trait InboxFactory: Send + Sync {
    /// The harness type.
    type Harness: InboxHarness;
    /// A fresh, empty store.
    async fn create(&self) -> Arc<Self::Harness>;
}
