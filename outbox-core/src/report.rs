//! What a cycle reports (R58): per row and in total. The pipeline steps' observers receive
//! it too, so it lives apart from the relay that makes it.

use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

/// What happened to one fetched row in a cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowOutcome {
    /// Published and completed.
    Completed {
        /// Publish duration.
        duration: Duration,
    },
    /// Counted failure.
    Counted {
        /// The error.
        error: String,
        /// Next try as written (none if the commit failed).
        next_try: Option<DateTime<Utc>>,
        /// Whether the row became `failed`.
        terminal: bool,
    },
    /// Transient failure (no attempt).
    Transient {
        /// The error.
        error: String,
        /// Next try as written.
        next_try: Option<DateTime<Utc>>,
    },
    /// Deferred (no attempt, schedule kept).
    Deferred {
        /// The error.
        error: String,
    },
    /// Released untouched.
    Released,
    /// The guard failed; nothing written (R55).
    LeaseLost,
}

/// A failure in a report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureReport {
    /// Row id.
    pub id: Uuid,
    /// The error text.
    pub error: String,
    /// Next try, when written.
    pub next_try: Option<DateTime<Utc>>,
}

/// What one cycle did (R58).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CycleReport {
    /// Rows fetched, in fetch order.
    pub fetched: Vec<Uuid>,
    /// Completed rows, in publish order.
    pub completed: Vec<Uuid>,
    /// Counted failures.
    pub counted: Vec<FailureReport>,
    /// Transient failures.
    pub transient: Vec<FailureReport>,
    /// Deferred rows.
    pub deferred: Vec<FailureReport>,
    /// Rows released untouched.
    pub released: Vec<Uuid>,
    /// Rows whose lease was lost.
    pub lease_lost: Vec<Uuid>,
    /// Whether the outcome transaction failed (R57), after its retries.
    pub commit_failed: bool,
    /// How many times the outcome write was retried after a transient failure (0 when the
    /// first try went through).
    pub commit_retries: u32,
    /// Whether a transient failure or timeout stopped the cycle (R47).
    pub broker_unreachable: bool,
    /// Whether the circuit breaker is open after this cycle (or kept it from fetching).
    pub breaker_open: bool,
    /// Per-row outcomes in fetch order.
    pub outcomes: Vec<(Uuid, RowOutcome)>,
}
