//! Feature `opentelemetry`: the builder captures the current span's W3C context, and the
//! relay's publish span links to the context stored with the row.

use std::sync::Arc;

use opentelemetry::trace::{TraceContextExt, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use txoutbox_core::broker::NoopBroker;
use txoutbox_core::{CancellationToken, EventBuilder, InMemoryRepository, NewEvent, Relay};

fn otel() -> (
    InMemorySpanExporter,
    SdkTracerProvider,
    tracing::subscriber::DefaultGuard,
) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("outbox-test"));
    let guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));
    (exporter, provider, guard)
}

fn event() -> EventBuilder {
    NewEvent::builder()
        .event_type("order.created")
        .aggregate("order", uuid::Uuid::new_v4())
        .topic("orders")
        .partition_key("k")
        .payload_json(serde_json::json!({"n": 1}))
}

#[test]
fn the_builder_captures_the_current_spans_context() {
    let (_exporter, _provider, _guard) = otel();
    let span = tracing::info_span!("place order");
    let (e, cx) = span.in_scope(|| {
        (
            event().current_trace_context().build().unwrap(),
            tracing::Span::current().context(),
        )
    });
    let sc = cx.span().span_context().clone();
    assert!(sc.is_valid());
    assert_eq!(
        e.traceparent(),
        Some(format!("00-{}-{}-01", sc.trace_id(), sc.span_id()).as_str())
    );
    // No span, no context: nothing is stored.
    assert_eq!(
        event()
            .current_trace_context()
            .build()
            .unwrap()
            .traceparent(),
        None
    );
}

#[tokio::test(flavor = "current_thread")]
async fn the_publish_span_links_to_the_stored_context() {
    let (exporter, provider, _guard) = otel();
    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let repo = InMemoryRepository::default();
    repo.write_committed(vec![event().traceparent(TP).build().unwrap()])
        .await
        .unwrap();
    let relay = Relay::builder(Arc::new(repo), Arc::new(NoopBroker))
        .worker_id("w1")
        .build()
        .unwrap();
    let r = relay.cycle(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.completed.len(), 1);
    provider.force_flush().unwrap();
    let spans = exporter.get_finished_spans().unwrap();
    let publish = spans
        .iter()
        .find(|s| s.name == "process order.created")
        .unwrap_or_else(|| {
            panic!(
                "no publish span in {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        });
    let want = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    let link = publish
        .links
        .iter()
        .find(|l| l.span_context.trace_id() == want)
        .expect("a link to the producer's trace");
    assert_eq!(link.span_context.span_id().to_string(), "00f067aa0ba902b7");
    assert!(link.span_context.is_remote());
    let attr = |k: &str| {
        publish
            .attributes
            .iter()
            .find(|a| a.key.as_str() == k)
            .map(|a| a.value.to_string())
    };
    assert_eq!(attr("messaging.system").as_deref(), Some("noop"));
    assert_eq!(
        attr("messaging.destination.name").as_deref(),
        Some("orders")
    );
}
