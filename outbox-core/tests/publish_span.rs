//! The relay's publish span carries the OpenTelemetry messaging attributes and the trace
//! context stored with the row (`txoutbox_core::trace`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::Registry;
use txoutbox_core::{
    Ack, Broker, BrokerError, CancellationToken, InMemoryRepository, Message, NewEvent, Relay,
};

const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Keeps the fields of every span named `process`.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<Vec<HashMap<String, String>>>>);

struct Fields<'a>(&'a mut HashMap<String, String>);

impl Visit for Fields<'_> {
    fn record_str(&mut self, f: &Field, v: &str) {
        self.0.insert(f.name().to_owned(), v.to_owned());
    }
    fn record_debug(&mut self, f: &Field, v: &dyn std::fmt::Debug) {
        self.0.insert(f.name().to_owned(), format!("{v:?}"));
    }
}

impl<S: tracing::Subscriber> Layer<S> for Spans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _id: &tracing::span::Id,
        _ctx: Context<'_, S>,
    ) {
        if attrs.metadata().name() == "process" {
            let mut m = HashMap::new();
            attrs.record(&mut Fields(&mut m));
            self.0.lock().unwrap().push(m);
        }
    }
}

/// A broker that keeps what it was given and names itself like a real adapter.
#[derive(Default)]
struct Keeping(Mutex<Vec<Message>>);

#[async_trait]
impl Broker for Keeping {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        self.0.lock().unwrap().push(m.clone());
        Ok(Ack::default())
    }
    fn messaging_system(&self) -> &'static str {
        "testbus"
    }
    fn destination_name(&self, m: &Message) -> String {
        format!("bus.{}", m.topic)
    }
}

fn event(key: &str, traceparent: Option<&str>) -> NewEvent {
    let b = NewEvent::builder()
        .event_type("order.created")
        .aggregate("order", uuid::Uuid::new_v4())
        .topic("orders")
        .partition_key(key)
        .payload_json(serde_json::json!({"k": key}));
    match traceparent {
        Some(tp) => b.traceparent(tp),
        None => b,
    }
    .build()
    .unwrap()
}

#[tokio::test(flavor = "current_thread")]
async fn the_publish_span_has_the_messaging_attributes_and_the_stored_trace_context() {
    let spans = Spans::default();
    let _guard = tracing::subscriber::set_default(Registry::default().with(spans.clone()));
    let repo = InMemoryRepository::default();
    let traced = event("a", Some(TP));
    let plain = event("b", None);
    let (traced_id, plain_id) = (traced.id(), plain.id());
    repo.write_committed(vec![traced, plain]).await.unwrap();
    let broker = Arc::new(Keeping::default());
    let relay = Relay::builder(Arc::new(repo), broker.clone())
        .worker_id("w1")
        .build()
        .unwrap();
    let r = relay.cycle(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.completed.len(), 2);

    // The message carries the stored context as its `traceparent` attribute.
    let sent = broker.0.lock().unwrap().clone();
    let by_id = |id| sent.iter().find(|m| m.event_id == id).unwrap();
    assert_eq!(by_id(traced_id).traceparent(), Some(TP));
    assert_eq!(
        by_id(traced_id)
            .attributes
            .get("traceparent")
            .map(String::as_str),
        Some(TP)
    );
    assert_eq!(by_id(plain_id).traceparent(), None);

    let spans = spans.0.lock().unwrap().clone();
    assert_eq!(spans.len(), 2, "{spans:?}");
    let span_of = |id: uuid::Uuid| {
        spans
            .iter()
            .find(|s| s.get("messaging.message.id") == Some(&id.to_string()))
            .unwrap_or_else(|| panic!("no span for {id}: {spans:?}"))
    };
    let s = span_of(traced_id);
    assert_eq!(s["messaging.system"], "testbus");
    assert_eq!(s["messaging.destination.name"], "bus.orders");
    assert_eq!(s["messaging.operation.type"], "send");
    assert_eq!(s["otel.kind"], "producer");
    assert_eq!(s["messaging.traceparent"], TP);
    assert_eq!(span_of(plain_id)["messaging.traceparent"], "");
}
