//! The publish of one key's run: steps, broker call with its timeout, and the outcome each
//! result decides (R36, R37, R45 to R47, R49).

use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::FutureExt;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::backoff::TRANSIENT_RETRY;
use crate::broker::{Broker, Message};
use crate::error::{BrokerError, StepError};
use crate::event::{OutboxEvent, limits};
use crate::ordering::Key;
use crate::repository::{Fetched, OutcomeKind, Retry};
use crate::step::StepDecision;

use super::Relay;
use super::cycle::{CycleState, Stop};

fn timeout_text(t: Duration) -> String {
    let s = format!("{}", t.as_secs_f64());
    let s = if s.contains('.') { s } else { format!("{s}.0") };
    format!("Publish timed out after {s}s")
}

impl Relay {
    fn retry_for_counted(
        &self,
        row_created: Option<DateTime<Utc>>,
        attempts: i32,
        explicit: Option<DateTime<Utc>>,
    ) -> Retry {
        if let Some(t) = explicit.and_then(|t| valid_explicit(t, row_created)) {
            return Retry::At(t);
        }
        let mut rng = self.rng.lock().expect("rng poisoned");
        match self
            .config
            .backoff
            .delay(attempts.max(0) as u32, rng.as_mut())
        {
            Some(d) => Retry::After(d),
            None => Retry::Keep,
        }
    }

    /// Runs the pipeline steps before the publish, in order, until one does not continue
    /// (R37). A step that panics fails the row as a counted failure whose last_error is the
    /// panic message, like a step error; the cycle goes on.
    async fn before_publish_steps(&self, row: &OutboxEvent) -> Result<StepDecision, StepError> {
        let mut verdict = Ok(StepDecision::Continue);
        for s in &self.steps {
            verdict = match AssertUnwindSafe(s.before_publish(row)).catch_unwind().await {
                Ok(v) => v,
                Err(payload) => {
                    let text = panic_text(payload.as_ref());
                    tracing::error!(id = %row.id, panic = %text, "a pipeline step panicked in before_publish; the row fails as a counted failure");
                    Err(StepError::counted(format!(
                        "pipeline step panicked: {text}"
                    )))
                }
            };
            if !matches!(verdict, Ok(StepDecision::Continue)) {
                break;
            }
        }
        verdict
    }

    /// The span of one publish: the OpenTelemetry messaging attributes, and the trace context
    /// stored with the row (see `crate::trace`), recorded as `messaging.traceparent`; with the
    /// feature `opentelemetry` also a link to that context.
    fn publish_span(&self, row: &OutboxEvent, msg: &Message) -> tracing::Span {
        let span = tracing::info_span!(
            "process",
            otel.name = %format_args!("process {}", row.event_type),
            otel.kind = "producer",
            messaging.system = self.broker.messaging_system(),
            messaging.destination.name = %self.broker.destination_name(msg),
            messaging.message.id = %row.id,
            messaging.operation.type = "send",
            messaging.traceparent = msg.traceparent().unwrap_or(""),
            event.id = %row.id,
            "event.type" = %row.event_type,
            worker.id = %self.config.worker_id,
            event.trace_id = row.trace_id.as_deref().unwrap_or(""),
            error = tracing::field::Empty,
        );
        #[cfg(feature = "opentelemetry")]
        if let Some(tp) = msg
            .traceparent()
            .and_then(|t| crate::trace::TraceParent::parse(t).ok())
        {
            use tracing_opentelemetry::OpenTelemetrySpanExt;
            span.add_link(crate::trace::span_context(&tp));
        }
        span
    }

    pub(super) async fn publish_run(
        &self,
        key: &Key,
        run: &[&Fetched],
        shutdown: &CancellationToken,
        lease_deadline: tokio::time::Instant,
        state: &Mutex<CycleState>,
    ) {
        let decide = |id: Uuid, kind: OutcomeKind, d: Option<Duration>| {
            let mut st = state.lock().expect("cycle state poisoned");
            if matches!(kind, OutcomeKind::Completed) {
                st.completion_order.push(id);
            } else {
                st.failed_keys.insert(key.clone());
            }
            st.decided.insert(id, (kind, d));
        };
        let stop = |s: Stop| {
            let mut st = state.lock().expect("cycle state poisoned");
            if st.stop.is_none()
                || matches!(s, Stop::Unreachable(_)) && st.stop == Some(Stop::Other)
            {
                st.stop = Some(s);
            }
        };
        for fetched in run {
            if state.lock().expect("cycle state poisoned").stop.is_some() || shutdown.is_cancelled()
            {
                return;
            }
            let now = self.clock.now();
            if lease_deadline.saturating_duration_since(now) < self.config.publish_timeout {
                tracing::debug!(id = %fetched.id(), "lease too short to start a publish; released");
                return;
            }
            let row = match fetched {
                Fetched::Undecodable(u) => {
                    let retry = self.retry_for_counted(None, u.attempts_made, None);
                    decide(
                        u.id,
                        OutcomeKind::Counted {
                            error: format!("undecodable row: {}", u.reason),
                            retry,
                            exhausted: self.config.on_exhausted,
                        },
                        None,
                    );
                    return;
                }
                Fetched::Row(e) => e,
            };
            let verdict = self.before_publish_steps(row).await;
            match verdict {
                Ok(StepDecision::Continue) => {}
                Ok(StepDecision::StopCycle) => {
                    stop(Stop::Other);
                    return;
                }
                Ok(StepDecision::Fail {
                    error,
                    counted: true,
                    retry_at,
                }) => {
                    let retry =
                        self.retry_for_counted(Some(row.created_at), row.attempts_made, retry_at);
                    decide(
                        row.id,
                        OutcomeKind::Counted {
                            error,
                            retry,
                            exhausted: self.config.on_exhausted,
                        },
                        None,
                    );
                    return;
                }
                Ok(StepDecision::Fail {
                    error,
                    counted: false,
                    retry_at,
                }) => {
                    let retry = retry_at
                        .and_then(|t| valid_explicit(t, Some(row.created_at)))
                        .map_or(Retry::Keep, Retry::At);
                    decide(row.id, OutcomeKind::Transient { error, retry }, None);
                    return;
                }
                Err(e) if e.transient => {
                    decide(
                        row.id,
                        OutcomeKind::Transient {
                            error: e.message.clone(),
                            retry: Retry::After(TRANSIENT_RETRY),
                        },
                        None,
                    );
                    stop(Stop::Unreachable(e.message));
                    return;
                }
                Err(e) => {
                    let retry =
                        self.retry_for_counted(Some(row.created_at), row.attempts_made, None);
                    decide(
                        row.id,
                        OutcomeKind::Counted {
                            error: e.to_string(),
                            retry,
                            exhausted: self.config.on_exhausted,
                        },
                        None,
                    );
                    return;
                }
            }
            // The publish (R45, R36).
            let msg = Message::from_event(row);
            let span = self.publish_span(row, &msg);
            let started = self.clock.now();
            // A broker client that panics is a refusal of this row (counted), not the end of
            // the cycle.
            let publish = AssertUnwindSafe(self.broker.publish(&msg))
                .catch_unwind()
                .map(|r| {
                    r.unwrap_or_else(|payload| {
                        Err(BrokerError::Rejected(format!(
                            "broker client panicked: {}",
                            panic_text(payload.as_ref())
                        )))
                    })
                });
            let result = tokio::time::timeout(self.config.publish_timeout, publish)
                .instrument(span.clone())
                .await;
            let elapsed = self.clock.now().saturating_duration_since(started);
            let text = match result {
                Ok(Ok(_ack)) => {
                    self.breaker_record(true);
                    decide(row.id, OutcomeKind::Completed, Some(elapsed));
                    continue;
                }
                Ok(Err(BrokerError::Rejected(text))) => {
                    span.record("error", true);
                    tracing::warn!(parent: &span, error = %text, "publish rejected (counted)");
                    let retry =
                        self.retry_for_counted(Some(row.created_at), row.attempts_made, None);
                    decide(
                        row.id,
                        OutcomeKind::Counted {
                            error: text,
                            retry,
                            exhausted: self.config.on_exhausted,
                        },
                        None,
                    );
                    if self.breaker_record(false) {
                        stop(Stop::Other);
                    }
                    return;
                }
                Ok(Err(BrokerError::Transient(text))) => text,
                Err(_elapsed) => timeout_text(self.config.publish_timeout),
            };
            span.record("error", true);
            tracing::warn!(parent: &span, error = %text, "broker unreachable (not counted)");
            decide(
                row.id,
                OutcomeKind::Transient {
                    error: text.clone(),
                    retry: Retry::After(TRANSIENT_RETRY),
                },
                None,
            );
            stop(Stop::Unreachable(text));
            if self.breaker_record(false) {
                stop(Stop::Other);
            }
            return;
        }
    }
}

/// The text of a panic payload (a `&str` or `String` message, else a placeholder).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// An explicit retry time is valid within [created_at, created_at + 365 days] (R44).
fn valid_explicit(t: DateTime<Utc>, created: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
    let Some(c) = created else { return Some(t) };
    let latest = c
        .checked_add_signed(chrono::Duration::seconds(limits::SCHEDULE_MAX_AHEAD_SECS))
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    if t < c || t > latest {
        tracing::warn!(retry_at = %t, created_at = %c, "explicit retry time outside [created_at, created_at + 365 days]; using the backoff instead");
        None
    } else {
        Some(t)
    }
}
