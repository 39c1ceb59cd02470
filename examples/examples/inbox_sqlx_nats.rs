//! The inbox's consumer of README.md ("The inbox: consuming exactly once"), runnable: the lines
//! between the two `README consumer` comments below are the README's snippet as it is, up to
//! its `main` (`scripts/scratch-crate` checks that they stay the same). This file's own `main`
//! gives it a fresh stream, subject prefix and schema, publishes five orders through the relay,
//! runs the consumer until their ledger rows are written, prints them and exits.
//!
//! ```sh
//! cargo run -p txoutbox-examples --example inbox_sqlx_nats
//! # or elsewhere:
//! DATABASE_URL=postgres://user@host/db NATS_URL=nats://host:4222 cargo run -p txoutbox-examples --example inbox_sqlx_nats
//! ```
//!
//! It leaves nothing behind: the stream, the schema and its ledger rows are removed at the end.

// README consumer: begin
use txoutbox_core::CancellationToken;
use txoutbox_core::inbox::{HandlerOutcome, InboxEvent, Runner, handler_fn};
use txoutbox_nats_broker::async_nats::{self, jetstream};
use txoutbox_nats_broker::{NatsSubscription, NatsSubscriptionConfig};
use txoutbox_postgres::sqlx::{self, PgPool};
use txoutbox_postgres::{Layout, SqlxHandlerTx, SqlxInbox, TableName, create_inbox_schema};

/// The payload of the orders service's `order.placed` events.
#[derive(serde::Deserialize)]
struct OrderPlaced {
    order: String,
}

/// Bills each placed order once, until `shutdown` is cancelled.
async fn consume(
    pool: PgPool,
    nats: async_nats::Client,
    stream: &str,
    subject_prefix: &str,
    schema: &str,
    shutdown: CancellationToken,
) -> Result<(), Box<dyn std::error::Error>> {
    let inbox_table = TableName::new(&format!("{schema}.inbox_events"))?;
    create_inbox_schema(&pool, &inbox_table, Layout::Plain).await?; // idempotent
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS billing_ledger (message_id text PRIMARY KEY, order_id text NOT NULL)",
    )
    .execute(&pool)
    .await?;
    let inbox = SqlxInbox::sqlx(pool, &inbox_table, Layout::Plain);

    // The stream is the producer's (its relay creates it); created here too when missing, so
    // that the consumer may start first.
    jetstream::new(nats.clone())
        .get_or_create_stream(jetstream::stream::Config {
            name: stream.into(),
            subjects: vec![format!("{subject_prefix}>")],
            ..Default::default()
        })
        .await?;
    // The group and the topics, given once: the runner takes them from the subscription. The
    // durable consumer `billing` is created when missing, for subject prefix + `placed`.
    let subscription = NatsSubscription::bind(
        nats,
        NatsSubscriptionConfig::new(stream, "billing")
            .subject_prefix(subject_prefix)
            .topics(["placed"]),
    )
    .await?;
    let runner = Runner::for_subscription(inbox, subscription)
        .handler(handler_fn(|row: &InboxEvent, tx: &mut SqlxHandlerTx| {
            Box::pin(async move {
                let placed: OrderPlaced = row.payload_as()?; // a counted failure if it does not decode
                // In the inbox's transaction: committed with the row, so once per message.
                sqlx::query("INSERT INTO billing_ledger (message_id, order_id) VALUES ($1, $2)")
                    .bind(&row.message_id)
                    .bind(&placed.order)
                    .execute(&mut **tx)
                    .await?;
                Ok(HandlerOutcome::completed())
            })
        }))
        .build()?;
    runner.run(shutdown).await?; // starts, consumes, and stops cleanly once shutdown is cancelled
    Ok(())
}

// README consumer: end

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use txoutbox_core::{NewEvent, Relay};
use txoutbox_nats_broker::{NatsBroker, NatsBrokerConfig, StreamSpec};
use txoutbox_postgres::{PgConfig, PgOutboxRepository, create_schema};

/// An error of `main`.
type BoxError = Box<dyn std::error::Error>;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt::init();
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    // Fresh names per run: the stream, its subjects and the schema of both tables.
    let run = uuid::Uuid::new_v4().simple().to_string()[..8].to_owned();
    let stream = format!("INBOX_EXAMPLE_{run}");
    let subject_prefix = format!("inboxex{run}.");
    let schema = format!("example_inbox_{run}");

    let pool = PgPool::connect(&db).await?;
    let nats = async_nats::connect(&nats_url).await?;

    // The producer half (README "Use it in your service"): the outbox and a relay to NATS.
    let cfg = PgConfig::default().table_name(&format!("{schema}.outbox_events"))?;
    create_schema(&pool, cfg.table_ref()).await?;
    let repo = PgOutboxRepository::new(pool.clone(), cfg);
    let writer = repo.writer();
    let broker = NatsBroker::connect(
        NatsBrokerConfig::new(nats_url.clone())
            .subject_prefix(subject_prefix.clone())
            .ensure_stream(StreamSpec::new(stream.clone())),
    )
    .await?;
    let relay = Arc::new(Relay::builder(Arc::new(repo), Arc::new(broker)).build()?);
    let shutdown = CancellationToken::new();
    let relaying = tokio::spawn({
        let (relay, shutdown) = (relay.clone(), shutdown.clone());
        async move { relay.run(shutdown).await }
    });

    let mut ids = Vec::new();
    for (n, customer) in ["ada", "brian", "ada", "chen", "brian"].iter().enumerate() {
        let event = NewEvent::builder()
            .event_type("order.placed")
            .aggregate("order", uuid::Uuid::new_v4())
            .topic("placed")
            .partition_key(*customer)
            .payload_json(json!({ "order": format!("o-{run}-{n}"), "customer": customer }))
            .build()?;
        ids.push(event.id().hyphenated().to_string());
        let mut tx = pool.begin().await?;
        writer.write(&mut tx, vec![event]).await?;
        tx.commit().await?;
    }
    println!("placed {} orders; consuming them", ids.len());

    // The consumer half, until every order has its ledger row; then both stop.
    let wait_for_ledger = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            // The ledger table is created by `consume`; until then the query fails.
            let rows: Vec<(String, String)> = sqlx::query_as(
                "SELECT message_id, order_id FROM billing_ledger WHERE message_id = ANY($1) ORDER BY order_id",
            )
            .bind(&ids)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
            if rows.len() >= ids.len() || tokio::time::Instant::now() >= deadline {
                shutdown.cancel();
                return rows;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    let (consumed, rows) = tokio::join!(
        consume(
            pool.clone(),
            nats.clone(),
            &stream,
            &subject_prefix,
            &schema,
            shutdown.clone()
        ),
        wait_for_ledger
    );
    consumed?;
    relaying.await??;
    for (message_id, order_id) in &rows {
        println!("handled: message {message_id} -> ledger row for {order_id}");
    }
    let complete = rows.len() == ids.len();

    // Leave nothing behind.
    sqlx::query("DELETE FROM billing_ledger WHERE message_id = ANY($1)")
        .bind(&ids)
        .execute(&pool)
        .await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{schema}\" CASCADE"
    )))
    .execute(&pool)
    .await?;
    jetstream::new(nats).delete_stream(&stream).await?;

    if !complete {
        return Err(format!(
            "{} of {} orders were handled within 60 s",
            rows.len(),
            ids.len()
        )
        .into());
    }
    println!("{} orders, each handled once", rows.len());
    Ok(())
}
