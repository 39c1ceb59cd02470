//! Pipeline steps: small composable additions to the relay cycle, in the spirit of tower.
//!
//! A [`PipelineStep`] can act before the publish ([`PipelineStep::before_publish`]) and observe
//! what happened afterwards (fetch, outcomes, terminal failures, cycle end). Steps run in the
//! order they were added. Observer methods run only after the outcome transaction committed
//! (R68, R83); a step that panics there is logged and changes nothing (M-03).

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use crate::error::StepError;
use crate::event::OutboxEvent;
use crate::report::{CycleReport, RowOutcome};

/// What a step decides before a publish (R37).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StepDecision {
    /// Go on to the next step and the publish (H-01).
    Continue,
    /// Fail the row without publishing.
    Fail {
        /// The text stored as last_error (R9).
        error: String,
        /// Whether an attempt is spent (H-05) or not (B-08).
        counted: bool,
        /// An explicit next try, which wins over the backoff (R44; B-06, H-13).
        retry_at: Option<DateTime<Utc>>,
    },
    /// Stop the cycle: this row and every row not yet published are released untouched (R77;
    /// P-07).
    StopCycle,
}

/// An outcome as observers see it, after the commit.
#[derive(Debug, Clone)]
pub struct ObservedOutcome<'a> {
    /// The row as fetched.
    pub event: &'a OutboxEvent,
    /// What happened to it.
    pub outcome: &'a RowOutcome,
    /// The publish duration, for completions.
    pub duration: Option<Duration>,
}

/// A step in the relay pipeline. Every method has a default that does nothing.
#[async_trait]
pub trait PipelineStep: Send + Sync {
    /// Before a publish; an error is a counted failure (or transient, if marked) whose text is
    /// its display (R37; H-08, H-09). A panic here is caught and fails the row as a counted
    /// failure with last_error `pipeline step panicked: {message}`; the cycle goes on.
    async fn before_publish(&self, _event: &OutboxEvent) -> Result<StepDecision, StepError> {
        Ok(StepDecision::Continue)
    }

    /// After every fetch that ran, with the row count (0 included).
    async fn on_fetch(&self, _rows: usize) {}

    /// After the commit, once per row outcome.
    async fn on_outcome(&self, _observed: &ObservedOutcome<'_>) {}

    /// After the commit, for a row that became `failed`: the row as it was before the failure,
    /// and the error (a dead-letter sink belongs here; P-03).
    async fn on_terminal_failure(&self, _event: &OutboxEvent, _error: &str) {}

    /// After the commit, for a row that was parked (R191, R193): its attempts are spent under
    /// `on_exhausted = park`, it stays `pending` holding its key. `event` is the row as it was
    /// before the failure, `error` the failure. A park does not call
    /// [`on_terminal_failure`](Self::on_terminal_failure): the row is not lost, an operator
    /// redrives or discards it (R192). A discard runs in the repository or `outbox-relay`
    /// (no relay, so no pipeline step, sees it): it is logged by the operator command, and
    /// reaches this trait only if the caller wires it. Checked by OP-01.
    async fn on_parked(&self, _event: &OutboxEvent, _error: &str) {}

    /// At the end of every cycle, on every path (R68): after a full cycle, and with an empty
    /// report when the shutdown signal or an open breaker (`breaker_open` set) kept the cycle
    /// from fetching or the fetch failed.
    async fn on_cycle_end(&self, _report: &CycleReport) {}
}
