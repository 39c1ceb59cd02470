//! The handler run's span (contract R170): `process {event_type}`, kind consumer, with the
//! messaging fields; with the feature `opentelemetry`, its parent is the remote context of the
//! row's valid `traceparent`, so the consumer's trace continues the producer's (D32). An invalid
//! traceparent is ignored.

use crate::event::WorkerId;
use crate::inbox::handler::RunResult;
use crate::inbox::model::InboxEvent;

/// The span of one handler run on `row` by `worker`.
pub fn handler_span(row: &InboxEvent, worker: &WorkerId) -> tracing::Span {
    let span = tracing::info_span!(
        "process",
        otel.name = %format_args!("process {}", row.event_type),
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        event.id = %row.id,
        "event.type" = %row.event_type,
        worker.id = %worker,
        event.trace_id = row.trace_id.as_deref().unwrap_or(""),
        messaging.message.id = %row.message_id,
        messaging.consumer.group.name = %row.consumer_group,
        messaging.destination.name = %row.source,
        handler.status = tracing::field::Empty,
        error = tracing::field::Empty,
    );
    #[cfg(feature = "opentelemetry")]
    if let Some(tp) = row
        .traceparent()
        .and_then(|v| crate::trace::TraceParent::parse(v).ok())
    {
        use opentelemetry::trace::TraceContextExt;
        use tracing_opentelemetry::OpenTelemetrySpanExt;
        let cx =
            opentelemetry::Context::new().with_remote_span_context(crate::trace::span_context(&tp));
        let _ = span.set_parent(cx);
    }
    span
}

/// Records the run's result on its span: the handler status, or the error.
pub fn record_result(span: &tracing::Span, result: &RunResult) {
    match result {
        RunResult::Failed(f) => {
            span.record("otel.status_code", "ERROR");
            span.record("error", f.error.as_str());
        }
        other => {
            if let Some(s) = other.status() {
                span.record("handler.status", s);
            }
        }
    }
}
