//! Tracing across the broker: an event written to PostgreSQL with the producer's W3C trace
//! context reaches a Redis Streams consumer with the field `traceparent`, from which the
//! consumer continues the producer's trace (same trace id, the producer's span as parent).
//! Real PostgreSQL and Redis (`DATABASE_URL`, `REDIS_URL`); a fresh schema and key prefix.

mod common;

use common::*;
use txoutbox_core::{CancellationToken, NewEvent, OutboxRepository, Relay, TraceParent};
use txoutbox_testkit::{PgHarness, database_url};

const PRODUCER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_consumer_reads_the_producers_traceparent() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    let traced = NewEvent::builder()
        .event_type("order.created")
        .aggregate("order", uuid::Uuid::new_v4())
        .topic("orders")
        .partition_key("o-1")
        .payload_json(serde_json::json!({"n": 1}))
        .header("tenant", "t1")
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
    let row = h.sqlx_repository().get(traced_id).await.unwrap().unwrap();
    assert_eq!(row.traceparent(), Some(PRODUCER));

    let t = Redis.trial(TrialOptions::default()).await;
    let relay = Relay::builder(h.sqlx_repository(), t.broker())
        .worker_id("trace-test")
        .build()
        .unwrap();
    let r = relay.cycle(&CancellationToken::new()).await.unwrap();
    assert_eq!(r.completed.len(), 2, "{r:?}");

    // The consumer reads the stream entries.
    let mut conn = admin().await;
    let entries = xrange(&mut conn, &t.destination("orders")).await;
    assert_eq!(entries.len(), 2);
    let field = |fields: &Vec<(String, String)>, name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let of = |id: uuid::Uuid| {
        entries
            .iter()
            .map(|(_, f)| f)
            .find(|f| field(f, "event_id") == Some(id.to_string()))
            .unwrap()
            .clone()
    };
    let traced_fields = of(traced_id);
    let tp = field(&traced_fields, "traceparent").expect("a traceparent field");
    let ctx = TraceParent::parse(&tp).expect("a valid W3C traceparent");
    assert_eq!(ctx.trace_id(), "0af7651916cd43dd8448eb211c80319c");
    assert_eq!(ctx.parent_id(), "b7ad6b7169203331");
    // A field of its own, not repeated among the user's headers.
    let headers: BTreeMap<String, String> =
        serde_json::from_str(&field(&traced_fields, "headers").expect("headers")).unwrap();
    assert_eq!(headers.get("tenant").map(String::as_str), Some("t1"));
    assert!(!headers.contains_key("traceparent"), "{headers:?}");
    let plain_fields = of(plain_id);
    assert_eq!(field(&plain_fields, "traceparent"), None);
    t.cleanup().await;
}
