//! A service on sqlx that writes a business row and its event in one transaction, and a relay
//! in the same process that publishes the events to NATS JetStream.
//!
//! Run it (PostgreSQL and NATS with JetStream on their default local ports):
//!
//! ```sh
//! cargo run -p outbox-examples --example sqlx_nats
//! # or elsewhere:
//! DATABASE_URL=postgres://user@host/db NATS_URL=nats://host:4222 cargo run -p outbox-examples --example sqlx_nats
//! ```
//!
//! It creates the schema `example_sqlx_nats` (tables `orders` and `outbox_events`), places five
//! orders, each with its `order.placed` event written in the order's transaction (and a
//! `pg_notify` there, so the relay wakes at commit), prints each event as a consumer of the
//! stream `EXAMPLE_ORDERS` receives it, and stops the relay.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use outbox_core::{CancellationToken, NewEvent, Relay};
use outbox_nats_broker::{NatsBroker, NatsBrokerConfig, StreamSpec};
use outbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, TableName, create_schema};
use serde_json::json;
use uuid::Uuid;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let nats = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let pool = sqlx::PgPool::connect(&db).await?;
    let table = TableName::new("example_sqlx_nats.outbox_events")?;
    create_schema(&pool, &table).await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS example_sqlx_nats.orders (
             id uuid PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;

    // The relay: JetStream acknowledges each event before the row is completed.
    let broker = NatsBroker::connect(
        NatsBrokerConfig::new(nats.clone())
            .subject_prefix("example.")
            .ensure_stream(StreamSpec::new("EXAMPLE_ORDERS")),
    )
    .await?;
    let repo = Arc::new(PgOutboxRepository::new(
        pool.clone(),
        PgConfig::default().table(table.clone()),
    ));
    let relay = Arc::new(
        Relay::builder(repo, Arc::new(broker))
            .worker_id(outbox_examples::default_worker_id())
            .build()?,
    );
    // Wakes the relay on each commit of a notifying writer; reconnects by itself.
    let _listener =
        outbox_postgres::WakeListener::spawn(&pool, &table, vec![relay.waker()]).await?;
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    // A consumer (core subscription; a real one would use a durable JetStream consumer).
    let client = async_nats::connect(nats).await?;
    let mut consumer = client.subscribe("example.orders").await?;
    client.flush().await?;

    // The service: business row and event in one transaction.
    let writer = PgOutboxWriter::new(&table).notify(true);
    for (customer, total) in [
        ("ada", 1200),
        ("brian", 450),
        ("ada", 999),
        ("chen", 120),
        ("brian", 75),
    ] {
        let order = Uuid::new_v4();
        let mut tx = pool.begin().await?;
        sqlx::query(
            "INSERT INTO example_sqlx_nats.orders (id, customer, total_cents) VALUES ($1, $2, $3)",
        )
        .bind(order)
        .bind(customer)
        .bind(total as i64)
        .execute(&mut *tx)
        .await?;
        let event = NewEvent::builder()
            .event_type("order.placed")
            .aggregate("order", order)
            .topic("orders")
            .partition_key(customer) // one customer's events stay in order
            .payload_json(json!({ "order": order, "customer": customer, "total_cents": total }))
            .build()?;
        writer.write(&mut tx, vec![event]).await?;
        tx.commit().await?;
        println!("placed order {order} for {customer}");
    }

    for _ in 0..5 {
        let m = tokio::time::timeout(Duration::from_secs(30), consumer.next())
            .await?
            .ok_or("subscription closed")?;
        let key = m
            .headers
            .as_ref()
            .and_then(|h| h.get("partition_key"))
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        println!(
            "received on {} (key {key}): {}",
            m.subject,
            String::from_utf8_lossy(&m.payload)
        );
    }
    stop.cancel();
    running.await??;
    Ok(())
}
