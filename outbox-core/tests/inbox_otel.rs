//! Conformance scenario A-04 on the in-memory inbox (features `opentelemetry`, `testing`): each
//! handler run's span is `process {event_type}`, of kind consumer, and continues the trace of
//! the message's valid `traceparent` (R170).

use std::sync::Arc;

use async_trait::async_trait;
use opentelemetry::trace::{SpanId, SpanKind, Status, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use tracing_subscriber::layer::SubscriberExt;
use txoutbox_core::CancellationToken;
use txoutbox_core::clock::ManualClock;
use txoutbox_core::inbox::memory::{InMemoryInbox, MemInboxTx};
use txoutbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use txoutbox_core::inbox::{
    Handler, HandlerError, HandlerOutcome, InboxEvent, InboxRepository, Processor, Runner,
};

const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const ZERO: &str = "00-00000000000000000000000000000000-00f067aa0ba902b7-01";

struct H(std::sync::Mutex<u32>);

#[async_trait]
impl Handler<MemInboxTx> for H {
    async fn handle(
        &self,
        row: &InboxEvent,
        _tx: &mut MemInboxTx,
    ) -> Result<HandlerOutcome, HandlerError> {
        if row.message_id == "m3" {
            let mut n = self.0.lock().unwrap();
            *n += 1;
            if *n == 1 {
                return Err(HandlerError::new("x"));
            }
        }
        Ok(HandlerOutcome::completed())
    }
}

#[tokio::test]
async fn a_04_spans_continue_the_messages_trace() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test"));
    let _guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));

    let clock = ManualClock::starting_now();
    let inbox = InMemoryInbox::new(Arc::new(clock.clone()));
    let sub = ScriptedSubscription::new(Arc::new(clock.clone()));
    let f = MessageFactory::new();
    let handler = Arc::new(H(Default::default()));
    for (id, tp) in [("m1", TP), ("m2", ZERO), ("m3", TP)] {
        sub.push(f.nats(
            &[
                ("event_id", id),
                ("topic", "src"),
                ("event_type", "e"),
                ("traceparent", tp),
            ],
            "{\"n\": 1}",
        ));
    }
    let runner = Runner::builder(inbox.clone(), Arc::new(sub.clone()), "g")
        .handler(handler.clone())
        .worker_id("w1")
        .process_stored(false)
        .build()
        .unwrap();
    for _ in 0..3 {
        runner.handle_next().await.unwrap().unwrap();
    }
    let g = txoutbox_core::inbox::ConsumerGroup::new("g").unwrap();
    let m3 = inbox.get_by_message_id("m3", &g).await.unwrap().unwrap();
    clock.set(m3.scheduled_at);
    let p = Processor::builder(inbox.clone(), "g", handler)
        .worker_id("p1")
        .build()
        .unwrap();
    p.cycle(&CancellationToken::new()).await.unwrap();
    let _ = provider.force_flush();

    let spans = exporter.get_finished_spans().unwrap();
    let of = |mid: &str| -> Vec<_> {
        spans
            .iter()
            .filter(|s| {
                s.attributes
                    .iter()
                    .any(|kv| kv.key.as_str() == "messaging.message.id" && kv.value.as_str() == mid)
            })
            .cloned()
            .collect()
    };
    let remote_trace = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    let remote_parent = SpanId::from_hex("00f067aa0ba902b7").unwrap();
    let m1 = of("m1");
    assert_eq!(m1.len(), 1);
    assert_eq!(m1[0].name, "process e");
    assert_eq!(m1[0].span_kind, SpanKind::Consumer);
    assert_eq!(m1[0].span_context.trace_id(), remote_trace);
    assert_eq!(m1[0].parent_span_id, remote_parent);
    for key in [
        "event.id",
        "event.type",
        "worker.id",
        "messaging.consumer.group.name",
        "messaging.destination.name",
    ] {
        assert!(
            m1[0].attributes.iter().any(|kv| kv.key.as_str() == key),
            "field {key}"
        );
    }
    let m2 = of("m2");
    assert_eq!(m2.len(), 1);
    assert_ne!(
        m2[0].span_context.trace_id(),
        remote_trace,
        "an invalid traceparent is ignored"
    );
    let m3 = of("m3");
    assert_eq!(m3.len(), 2, "the runner's run and the processor's");
    for s in &m3 {
        assert_eq!(
            (s.span_context.trace_id(), s.parent_span_id),
            (remote_trace, remote_parent)
        );
    }
    assert!(
        matches!(m3[0].status, Status::Error { .. }),
        "the failed run is an error"
    );
}
