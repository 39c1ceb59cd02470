//! Inbox metrics through the [`metrics`] facade (feature `metrics`), as an [`InboxHooks`]
//! implementation: add [`InboxMetrics`] to a runner's or a processor's hooks (contract R168,
//! R169). Names take the optional prefix of R70.
//!
//! | name | type | counts |
//! |---|---|---|
//! | `inbox_messages_consumed_total` | counter | deliveries read |
//! | `inbox_messages_committed_total` | counter | commits confirmed |
//! | `inbox_commit_failures_total` | counter | commits failed or unconfirmed |
//! | `inbox_messages_duplicate_total` | counter | duplicate deliveries and duplicate siblings |
//! | `inbox_messages_processed_total` | counter | handler runs ending in success |
//! | `inbox_messages_failed_total` | counter | handler runs ending in a failure |
//! | `inbox_events_processed_total{event_type,status}` | counter | runs and duplicates: `success`, `failure`, `skipped` |
//! | `inbox_handler_duration_seconds{event_type}` | histogram | every handler run |
//! | `inbox_messages_rewound_total` | counter | rewinds |
//! | `inbox_messages_invalid_total{reason}` | counter | invalid deliveries by R139's label |
//! | `inbox_persist_failures_total` | counter | persistence errors |
//! | `inbox_locked_batch_size` | gauge | rows of the processor's last fetch |
//!
//! A handler's status text never becomes a label (R169); rows a shutdown released count nowhere.

use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::error::ConfigError;
use crate::inbox::hooks::InboxHooks;
use crate::inbox::processor::RowReport;
use crate::inbox::runner::{DeliveryOutcome, DeliveryResult};

#[derive(Debug)]
struct Names {
    consumed: String,
    committed: String,
    commit_failures: String,
    duplicate: String,
    processed: String,
    failed: String,
    events: String,
    duration: String,
    rewound: String,
    invalid: String,
    persist: String,
    batch: String,
}

/// The inbox's metrics (R168), recorded from the hooks.
#[derive(Debug, Clone)]
pub struct InboxMetrics {
    names: Arc<Names>,
}

impl Default for InboxMetrics {
    fn default() -> Self {
        Self::named("")
    }
}

impl InboxMetrics {
    /// Metrics without a prefix.
    pub fn new() -> Self {
        Self::default()
    }

    /// Metrics whose names start with `prefix_` (`^[a-zA-Z_][a-zA-Z0-9_]*$`, R70).
    pub fn with_prefix(prefix: &str) -> Result<Self, ConfigError> {
        // The outbox's metrics check the same rule; reuse it.
        crate::metrics::MetricsStep::with_prefix(prefix)?;
        Ok(Self::named(&format!("{prefix}_")))
    }

    fn named(p: &str) -> Self {
        let n = |s: &str| format!("{p}{s}");
        Self {
            names: Arc::new(Names {
                consumed: n("inbox_messages_consumed_total"),
                committed: n("inbox_messages_committed_total"),
                commit_failures: n("inbox_commit_failures_total"),
                duplicate: n("inbox_messages_duplicate_total"),
                processed: n("inbox_messages_processed_total"),
                failed: n("inbox_messages_failed_total"),
                events: n("inbox_events_processed_total"),
                duration: n("inbox_handler_duration_seconds"),
                rewound: n("inbox_messages_rewound_total"),
                invalid: n("inbox_messages_invalid_total"),
                persist: n("inbox_persist_failures_total"),
                batch: n("inbox_locked_batch_size"),
            }),
        }
    }

    fn inc(&self, name: &str) {
        metrics::counter!(name.to_owned()).increment(1);
    }

    fn event(&self, event_type: &str, status: &'static str) {
        metrics::counter!(self.names.events.clone(), "event_type" => event_type.to_owned(), "status" => status)
            .increment(1);
    }

    fn run(&self, event_type: &str, success: Option<bool>, skipped: bool, d: Option<Duration>) {
        if let Some(d) = d {
            metrics::histogram!(self.names.duration.clone(), "event_type" => event_type.to_owned())
                .record(d.as_secs_f64());
        }
        match success {
            Some(true) if skipped => self.event(event_type, "skipped"),
            Some(true) => {
                self.inc(&self.names.processed);
                self.event(event_type, "success");
            }
            Some(false) => {
                self.inc(&self.names.failed);
                self.event(event_type, "failure");
            }
            None => {}
        }
    }
}

impl InboxHooks for InboxMetrics {
    fn on_delivery(&self, r: &DeliveryResult) {
        let n = &self.names;
        self.inc(&n.consumed);
        if r.committed {
            self.inc(&n.committed);
        }
        if r.commit_failed {
            self.inc(&n.commit_failures);
        }
        if r.rewind_delay.is_some() {
            self.inc(&n.rewound);
        }
        let et = r.event_type.as_deref().unwrap_or("");
        match r.outcome {
            DeliveryOutcome::Duplicate if r.handler_duration.is_none() => {
                self.inc(&n.duplicate);
                self.event(et, "skipped");
            }
            DeliveryOutcome::Invalid => {
                metrics::counter!(n.invalid.clone(), "reason" => r.invalid_label.unwrap_or("field"))
                    .increment(1);
            }
            DeliveryOutcome::PersistFailed => self.inc(&n.persist),
            _ => {}
        }
        if r.handler_duration.is_some() {
            let (ok, skipped) = match r.outcome {
                DeliveryOutcome::Completed => (true, false),
                DeliveryOutcome::Skipped => (true, true),
                _ => (false, false),
            };
            self.run(et, Some(ok), skipped, r.handler_duration);
        }
    }

    fn on_persist_failure(&self, r: &DeliveryResult) {
        self.on_delivery(r);
    }

    fn on_fetch(&self, rows: usize) {
        metrics::gauge!(self.names.batch.clone()).set(rows as f64);
    }

    fn on_row(&self, _id: Uuid, event_type: Option<&str>, report: &RowReport, d: Option<Duration>) {
        let et = event_type.unwrap_or("");
        match report {
            RowReport::Completed { .. } => self.run(et, Some(true), false, d),
            RowReport::Skipped { .. } => self.run(et, Some(true), true, d),
            RowReport::Counted { .. } | RowReport::NotCounted { .. } => {
                self.run(et, Some(false), false, d)
            }
            RowReport::Duplicate { .. } => {
                self.inc(&self.names.duplicate);
                self.event(et, "skipped");
            }
            RowReport::CommitFailed { .. } => self.run(et, None, false, d),
            RowReport::Released | RowReport::LeaseLost => {}
        }
    }
}
