//! Metrics through the [`metrics`] facade, as an outbox-core [`PipelineStep`] observer.
//!
//! Names follow contract R70, each with the optional prefix joined by `_`:
//!
//! | name | kind | labels | set when |
//! |---|---|---|---|
//! | `outbox_locked_batch_size` | gauge | | after every fetch: rows fetched and locked |
//! | `outbox_events_published_total` | counter | `event_type`, `status` | after the outcome commit, once per row |
//! | `outbox_handler_duration_seconds` | histogram | `event_type` | for each completed publish |
//! | `outbox_backlog` | gauge | | by [`MetricsStep::record_backlog`]: pending rows |
//! | `outbox_blocked_keys` | gauge | | by [`MetricsStep::record_backlog`]: keys whose head waits or is held (R80) |
//! | `outbox_oldest_due_age_seconds` | gauge | | by [`MetricsStep::record_backlog`]: age of the oldest due row (0 when none) |
//!
//! `status` is one of `success` (acknowledged, completed), `retry` (counted failure, tried again
//! later), `failed` (counted failure that spent the last attempt), `transient` (no attempt spent),
//! `deferred` (broker found unreachable, schedule kept), `released` (not processed this cycle)
//! and `lease_lost` (the row was taken over; nothing written).
//!
//! Install any `metrics` recorder (e.g. `metrics-exporter-prometheus`, see the `outbox-relay`
//! binary's `--metrics-addr` with the `prometheus` feature); without one the calls do nothing.

use std::time::Duration;

use async_trait::async_trait;
use outbox_core::relay::RowOutcome;
use outbox_core::step::{ObservedOutcome, PipelineStep};

/// The `status` label of an outcome.
pub fn status_label(o: &RowOutcome) -> &'static str {
    match o {
        RowOutcome::Completed { .. } => "success",
        RowOutcome::Counted { terminal: true, .. } => "failed",
        RowOutcome::Counted { .. } => "retry",
        RowOutcome::Transient { .. } => "transient",
        RowOutcome::Deferred { .. } => "deferred",
        RowOutcome::Released => "released",
        RowOutcome::LeaseLost => "lease_lost",
    }
}

/// Why a metric prefix was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid metrics prefix {0:?}: it must match ^[a-zA-Z_][a-zA-Z0-9_]*$ (R70)")]
pub struct PrefixError(pub String);

/// The metrics observer. Add it to a relay with `RelayBuilder::step(Arc::new(step))`.
#[derive(Debug, Clone)]
pub struct MetricsStep {
    batch: String,
    published: String,
    duration: String,
    backlog: String,
    blocked: String,
    oldest: String,
}

impl Default for MetricsStep {
    fn default() -> Self {
        Self::names("")
    }
}

impl MetricsStep {
    /// Metrics without a prefix.
    pub fn new() -> Self {
        Self::default()
    }

    /// Metrics whose names start with `prefix_` (prefix per R70).
    pub fn with_prefix(prefix: &str) -> Result<Self, PrefixError> {
        let mut chars = prefix.chars();
        let ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(PrefixError(prefix.to_owned()));
        }
        Ok(Self::names(&format!("{prefix}_")))
    }

    fn names(p: &str) -> Self {
        Self {
            batch: format!("{p}outbox_locked_batch_size"),
            published: format!("{p}outbox_events_published_total"),
            duration: format!("{p}outbox_handler_duration_seconds"),
            backlog: format!("{p}outbox_backlog"),
            blocked: format!("{p}outbox_blocked_keys"),
            oldest: format!("{p}outbox_oldest_due_age_seconds"),
        }
    }

    /// The name of the published counter (with the prefix).
    pub fn published_name(&self) -> &str {
        &self.published
    }

    /// Sets the backlog gauges: pending rows, blocked keys, age of the oldest due row.
    pub fn record_backlog(&self, pending: u64, blocked_keys: u64, oldest_due: Option<Duration>) {
        metrics::gauge!(self.backlog.clone()).set(pending as f64);
        metrics::gauge!(self.blocked.clone()).set(blocked_keys as f64);
        metrics::gauge!(self.oldest.clone()).set(oldest_due.map_or(0.0, |d| d.as_secs_f64()));
    }
}

#[async_trait]
impl PipelineStep for MetricsStep {
    async fn on_fetch(&self, rows: usize) {
        metrics::gauge!(self.batch.clone()).set(rows as f64);
    }

    async fn on_outcome(&self, o: &ObservedOutcome<'_>) {
        let event_type = o.event.event_type.clone();
        metrics::counter!(
            self.published.clone(),
            "event_type" => event_type.clone(),
            "status" => status_label(o.outcome)
        )
        .increment(1);
        if let (RowOutcome::Completed { .. }, Some(d)) = (o.outcome, o.duration) {
            metrics::histogram!(self.duration.clone(), "event_type" => event_type)
                .record(d.as_secs_f64());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_rule() {
        assert!(MetricsStep::with_prefix("svc_1").is_ok());
        assert!(MetricsStep::with_prefix("_x").is_ok());
        for bad in ["", "1x", "a-b", "a b"] {
            assert!(MetricsStep::with_prefix(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            MetricsStep::with_prefix("svc").unwrap().published_name(),
            "svc_outbox_events_published_total"
        );
    }
}
