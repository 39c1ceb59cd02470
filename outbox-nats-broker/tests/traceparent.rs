//! Tracing across the broker: an event written to PostgreSQL with the producer's W3C trace
//! context reaches a NATS subscriber with the header `traceparent`, from which the consumer
//! continues the producer's trace (same trace id, the producer's span as parent). Real
//! PostgreSQL and NATS (`DATABASE_URL`, `NATS_URL`); a fresh schema and stream.

mod common;

use common::*;
use futures::StreamExt;
use txoutbox_core::{CancellationToken, NewEvent, OutboxRepository, Relay, TraceParent};
use txoutbox_testkit::{PgHarness, database_url};

const PRODUCER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_consumer_reads_the_producers_traceparent() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    let traced = NewEvent::builder()
        .event_type("order.created")
        .aggregate("order", uuid::Uuid::new_v4())
        .topic("orders")
        .partition_key("o-1")
        .payload_json(serde_json::json!({"n": 1}))
        .traceparent(PRODUCER)
        .build()
        .unwrap();
    let plain = NewEvent::builder()
        .event_type("order.created")
        .aggregate("order", uuid::Uuid::new_v4())
        .topic("orders")
        .partition_key("o-2")
        .payload_json(serde_json::json!({"n": 2}))
        .build()
        .unwrap();
    let (traced_id, plain_id) = (traced.id(), plain.id());
    let mut tx = h.pool().begin().await.unwrap();
    h.sqlx_repository()
        .writer()
        .write(&mut tx, vec![traced, plain])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    // Stored with the row, in the headers column.
    let row = h.sqlx_repository().get(traced_id).await.unwrap().unwrap();
    assert_eq!(row.traceparent(), Some(PRODUCER));

    let t = Nats.trial(TrialOptions::default()).await;
    let consumer = async_nats::connect(url()).await.unwrap();
    let mut sub = consumer.subscribe(t.destination("orders")).await.unwrap();
    consumer.flush().await.unwrap();

    let relay = Relay::builder(h.sqlx_repository(), t.broker())
        .worker_id("trace-test")
        .build()
        .unwrap();
    let r = relay.cycle(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.completed.len(), 2, "{r:?}");

    let mut got = std::collections::HashMap::new();
    for _ in 0..2 {
        let m = tokio::time::timeout(Duration::from_secs(10), sub.next())
            .await
            .expect("the consumer got the message")
            .expect("subscription open");
        let h = m.headers.expect("headers");
        let id = h.get("event_id").expect("event_id").as_str().to_owned();
        got.insert(id, h.get("traceparent").map(|v| v.as_str().to_owned()));
    }
    let tp = got[&traced_id.to_string()]
        .as_deref()
        .expect("traceparent header");
    // The consumer continues the producer's trace.
    let ctx = TraceParent::parse(tp).expect("a valid W3C traceparent");
    assert_eq!(ctx.trace_id(), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(ctx.parent_id(), "b7ad6b7169203331");
    assert!(ctx.sampled());
    assert_eq!(got[&plain_id.to_string()], None, "no context, no header");
    t.cleanup().await;
}
