//! Tracing across the broker: the service writes an event with its W3C trace context, the relay
//! publishes it to NATS with the header `traceparent`, and a consumer continues the producer's
//! trace from it.
//!
//! Run it (PostgreSQL and NATS with JetStream on their default local ports):
//!
//! ```sh
//! cargo run -p txoutbox-examples --example tracing_nats
//! ```
//!
//! It creates the schema `example_tracing` (table `outbox_events`) and the stream
//! `EXAMPLE_TRACING`, writes one event, relays it, and prints the trace context the producer
//! had, the one the consumer read, and the consumer's own span in the same trace. In a service
//! the producer's context comes from its tracing setup (the current span, e.g. through
//! OpenTelemetry's W3C propagator), and the consumer hands what it read to the same propagator.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use txoutbox_core::{CancellationToken, NewEvent, Relay, TraceParent};
use txoutbox_nats_broker::{NatsBroker, NatsBrokerConfig, StreamSpec};
use txoutbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, TableName, create_schema};
use uuid::Uuid;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let nats = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let pool = sqlx::PgPool::connect(&db).await?;
    let table = TableName::new("example_tracing.outbox_events")?;
    create_schema(&pool, &table).await?;

    // The producer's span: trace id and span id as its tracing setup would give them.
    let producer = TraceParent::parse(&format!(
        "00-{:032x}-{:016x}-01",
        rand::random::<u128>() | 1,
        rand::random::<u64>() | 1
    ))?;
    println!("producer  traceparent {producer}");

    // The service writes the event, with its trace context, in its own transaction.
    let event = NewEvent::builder()
        .event_type("order.placed")
        .aggregate("order", Uuid::new_v4())
        .topic("orders")
        .partition_key("customer-7")
        .payload_json(json!({ "total_cents": 1200 }))
        .traceparent(producer.as_str())
        .build()?;
    let mut tx = pool.begin().await?;
    PgOutboxWriter::new(&table)
        .write(&mut tx, vec![event])
        .await?;
    tx.commit().await?;

    // A consumer, subscribed before the relay publishes.
    let client = async_nats::connect(nats.clone()).await?;
    let mut consumer = client.subscribe("example.tracing.orders").await?;
    client.flush().await?;

    // The relay: one cycle publishes the row (its publish span records the stored context).
    let broker = NatsBroker::connect(
        NatsBrokerConfig::new(nats)
            .subject_prefix("example.tracing.")
            .ensure_stream(StreamSpec::new("EXAMPLE_TRACING")),
    )
    .await?;
    let repo = Arc::new(PgOutboxRepository::new(
        pool.clone(),
        PgConfig::default().table(table),
    ));
    let relay = Relay::builder(repo, Arc::new(broker))
        .worker_id(txoutbox_examples::default_worker_id())
        .build()?;
    let report = relay.cycle(&CancellationToken::new()).await?;
    println!("relayed   {} event(s)", report.completed.len());

    // The consumer reads the header and continues the trace: same trace id, the producer's
    // span as parent, a span id of its own.
    let m = tokio::time::timeout(Duration::from_secs(30), consumer.next())
        .await?
        .ok_or("subscription closed")?;
    let header = m
        .headers
        .as_ref()
        .and_then(|h| h.get("traceparent"))
        .ok_or("no traceparent header")?;
    let received = TraceParent::parse(header.as_str())?;
    println!("consumer  read        {received}");
    let own = format!(
        "00-{}-{:016x}-01",
        received.trace_id(),
        rand::random::<u64>() | 1
    );
    println!(
        "consumer  span        {own} (trace {}, child of span {})",
        received.trace_id(),
        received.parent_id()
    );
    assert_eq!(received.trace_id(), producer.trace_id());
    Ok(())
}
