//! A service on sqlx that writes a business row and its event in one transaction, and a relay
//! in the same process that publishes the events to NATS JetStream; a JetStream consumer reads
//! them back and prints every header.
//!
//! Run it (PostgreSQL and NATS with JetStream on their default local ports):
//!
//! ```sh
//! cargo run -p txoutbox-examples --example sqlx_nats
//! # or elsewhere:
//! DATABASE_URL=postgres://user@host/db NATS_URL=nats://host:4222 cargo run -p txoutbox-examples --example sqlx_nats
//! ```
//!
//! It creates the schema `example_sqlx_nats` (tables `orders` and `outbox_events`) and the
//! stream `EXAMPLE_ORDERS` (subjects `example.>`), places five orders, each with its
//! `order.placed` event written in the order's transaction (and a `pg_notify` there, so the
//! relay wakes at commit), prints each event as a JetStream consumer of the stream receives it,
//! and stops the relay.
//!
//! This file uses nothing of the examples crate: copy it into a service whose Cargo.toml has
//!
//! ```toml
//! outbox-core = "0.1"
//! outbox-postgres = "0.1"
//! outbox-nats-broker = "0.1"
//! tokio = { version = "1", features = ["macros", "rt-multi-thread"] }
//! tracing-subscriber = "0.3"
//! futures = "0.3"
//! serde_json = "1"
//! uuid = { version = "1", features = ["v4"] }
//! ```
//!
//! sqlx and async-nats are named through `txoutbox_postgres::sqlx` and
//! `txoutbox_nats_broker::async_nats`, so they are the versions the adapters are built with.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use txoutbox_core::{CancellationToken, NewEvent, Relay};
use txoutbox_nats_broker::async_nats::jetstream::{self, consumer};
use txoutbox_nats_broker::{NatsBroker, NatsBrokerConfig, StreamSpec};
use txoutbox_postgres::sqlx::{self, PgPool};
use txoutbox_postgres::{PgConfig, PgOutboxRepository, WakeListener, create_schema};
use uuid::Uuid;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The relay reports through `tracing` (publish failures, outages, lost leases): without a
    // subscriber they go nowhere.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let nats = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());

    // The store: the outbox table next to the service's own.
    let pool = PgPool::connect(&db).await?;
    let cfg = PgConfig::default().table_name("example_sqlx_nats.outbox_events")?;
    create_schema(&pool, cfg.table_ref()).await?; // idempotent
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS example_sqlx_nats.orders (
             id uuid PRIMARY KEY, customer text NOT NULL, total_cents bigint NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let repo = PgOutboxRepository::new(pool.clone(), cfg);
    let writer = repo.writer().notify(true); // wake LISTENing relays at commit

    // The broker: subject = "example." + topic; the stream is created when missing, and
    // `connect` fails if no stream covered "example.>" (a relay that could never publish).
    let broker = NatsBroker::connect(
        NatsBrokerConfig::new(nats.clone())
            .subject_prefix("example.")
            .ensure_stream(StreamSpec::new("EXAMPLE_ORDERS")),
    )
    .await?;

    // A consumer of the stream, made before the writes: it gets the messages published from
    // now on. A real one would be durable (`durable_name`) and run in its own service.
    let js = jetstream::new(txoutbox_nats_broker::async_nats::connect(&nats).await?);
    let orders = js
        .get_stream("EXAMPLE_ORDERS")
        .await?
        .create_consumer(consumer::pull::Config {
            deliver_policy: consumer::DeliverPolicy::New,
            filter_subject: "example.orders".into(),
            ..Default::default()
        })
        .await?;
    let mut received = orders.messages().await?;

    // The relay, in this process: JetStream acknowledges each event before its row is completed.
    let table = repo.table().clone();
    let relay = Arc::new(Relay::builder(Arc::new(repo), Arc::new(broker)).build()?);
    // Wakes the relay on each commit of a notifying writer; reconnects by itself.
    let _listener = WakeListener::spawn(&pool, &table, vec![relay.waker()]).await?;
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    // The service: business row and event in one transaction.
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
        writer.write(&mut tx, vec![event]).await?; // in the order's transaction
        tx.commit().await?;
        println!("placed order {order} for {customer}");
    }

    for _ in 0..5 {
        let m = tokio::time::timeout(Duration::from_secs(30), received.next())
            .await?
            .ok_or("the consumer's message stream ended")??;
        println!(
            "received on {}: {}",
            m.subject,
            String::from_utf8_lossy(&m.payload)
        );
        if let Some(headers) = &m.headers {
            let mut lines: Vec<String> = headers
                .iter()
                .flat_map(|(name, values)| values.iter().map(move |v| format!("{name}: {v}")))
                .collect();
            lines.sort();
            for line in lines {
                println!("    {line}");
            }
        }
        m.ack().await.map_err(|e| e.to_string())?;
    }
    stop.cancel();
    running.await??;
    Ok(())
}
