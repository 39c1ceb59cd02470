//! Hooks of the runner and the processor (contract R158, R171): called after the transaction
//! committed, never when it failed; a hook that panics is logged and changes nothing.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::inbox::model::InboxEvent;
use crate::inbox::processor::RowReport;
use crate::inbox::runner::DeliveryResult;

/// Which side of the inbox a transaction served (R190's label `side`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransactionSide {
    /// The runner's T (R185).
    Runner,
    /// The processor's T_b or T_row (R189).
    Processor,
}

impl TransactionSide {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            TransactionSide::Runner => "runner",
            TransactionSide::Processor => "processor",
        }
    }
}

/// Why a batch transaction fell back to one message per transaction (R190's label `reason`,
/// batches.md's principle).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// A failed handler run under the optimistic form (R186).
    Handler,
    /// The database refused the landing or an outcome (SQLSTATE classes 22 and 23, R132).
    Refused,
    /// A deadlock or serialization failure (40P01, 40001).
    Deadlock,
    /// A lost connection, or a savepoint that could not be rolled back or released.
    Connection,
    /// The COMMIT failed (R188).
    Commit,
}

impl FallbackReason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            FallbackReason::Handler => "handler",
            FallbackReason::Refused => "refused",
            FallbackReason::Deadlock => "deadlock",
            FallbackReason::Connection => "connection",
            FallbackReason::Commit => "commit",
        }
    }
}

/// One transaction of the runner or the processor (R190): how many messages (rows) it carried,
/// how long it took from its begin to its commit or rollback, and, when it fell back, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransactionReport {
    /// The side.
    pub side: TransactionSide,
    /// Messages or rows in it.
    pub messages: usize,
    /// From its begin to its end.
    pub elapsed: Duration,
    /// Set when it rolled back and its messages went one per transaction (batches.md's
    /// principle); none when it committed.
    pub fallback: Option<FallbackReason>,
}

/// Observers of the inbox. Every method has an empty default.
pub trait InboxHooks: Send + Sync {
    /// A runner finished a delivery (R171): after T committed, or for an invalid delivery
    /// after its dead-letter copy. Not called when T failed (see
    /// [`on_persist_failure`](Self::on_persist_failure)).
    fn on_delivery(&self, _result: &DeliveryResult) {}
    /// A delivery's transaction failed (R132); nothing of it was stored.
    fn on_persist_failure(&self, _result: &DeliveryResult) {}
    /// A processor fetched `rows` rows (0 included).
    fn on_fetch(&self, _rows: usize) {}
    /// A processor finished a row (R157, R158), after T_row committed (or failed): its event
    /// type when the row was read, and the handler run's duration when the handler ran.
    fn on_row(
        &self,
        _id: Uuid,
        _event_type: Option<&str>,
        _report: &RowReport,
        _handler_duration: Option<Duration>,
    ) {
    }
    /// A row became `failed` (R128, R129, R158): `row` as it was before the failure, and the
    /// failure text. Called after the commit that wrote it.
    fn on_terminal_failure(&self, _row: &InboxEvent, _error: &str) {}
    /// A transaction ended (R190): committed, or rolled back to fall back (then `fallback` says
    /// why). The runner reports every T when `messages_per_transaction` is above 1 (BT-01,
    /// BT-04, BT-08).
    fn on_transaction(&self, _t: &TransactionReport) {}
    /// A row was parked (R191, R193): its attempts are spent under `on_exhausted = park`, it
    /// stays `pending` holding its key. `row` as it was before the failure, and the failure
    /// text; called after the commit that wrote it, by the runner or the processor that wrote
    /// it. A park does not call [`on_terminal_failure`](Self::on_terminal_failure) (nor a
    /// dead-letter copy). A discard (R192) is an operator's call on the repository or
    /// `outbox-relay inbox discard`, where no runner or processor (and so no hook) takes part:
    /// it is not reported to these hooks. Checked by OP-06.
    fn on_parked(&self, _row: &InboxEvent, _error: &str) {}
}

/// Calls every hook, catching panics (R68, R83).
pub(crate) fn each(hooks: &[Arc<dyn InboxHooks>], f: impl Fn(&dyn InboxHooks)) {
    for h in hooks {
        if std::panic::catch_unwind(AssertUnwindSafe(|| f(h.as_ref()))).is_err() {
            tracing::error!("an inbox hook panicked; its panic is ignored");
        }
    }
}
