//! A service on diesel-async that writes a business row and its event in one transaction, and a
//! relay in the same process that publishes the events to Redis Streams.
//!
//! Run it (PostgreSQL and Redis on their default local ports):
//!
//! ```sh
//! cargo run -p txoutbox-examples --features diesel,redis --example diesel_redis
//! # or elsewhere:
//! DATABASE_URL=postgres://user@host/db REDIS_URL=redis://host:6379 cargo run -p txoutbox-examples --features diesel,redis --example diesel_redis
//! ```
//!
//! It runs the outbox migration for `example_diesel_redis.outbox_events`, creates an `accounts`
//! table, opens three accounts (row and `account.opened` event in one diesel transaction, with
//! a `pg_notify` there so the relay wakes at commit), waits until the relay has published them,
//! and prints the Redis stream `example:accounts` (XRANGE).

use std::sync::Arc;
use std::time::Duration;

use diesel::sql_types::{Text, Uuid as SqlUuid};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use serde_json::json;
use txoutbox_core::{CancellationToken, NewEvent, OutboxRepository, Relay, Status};
use txoutbox_diesel::{DieselConfig, DieselOutboxRepository, PoolSettings, WriteError, build_pool};
use txoutbox_postgres::TableName;
use txoutbox_redis_broker::{RedisBroker, RedisBrokerConfig};
use uuid::Uuid;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let redis_url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
    let table = TableName::new("example_diesel_redis.outbox_events")?;
    txoutbox_diesel::run_migrations_url(&db, &table).await?;
    let mut conn = AsyncPgConnection::establish(&db).await?;
    diesel::sql_query(
        "CREATE TABLE IF NOT EXISTS example_diesel_redis.accounts (id uuid PRIMARY KEY, owner text NOT NULL)",
    )
    .execute(&mut conn)
    .await?;

    // The relay: diesel-async repository, Redis broker (XADD acknowledged before completion).
    let pool = build_pool(&db, &PoolSettings::default())?;
    let repo = Arc::new(DieselOutboxRepository::new(
        pool,
        DieselConfig::default().table(table.clone()),
    ));
    let broker =
        RedisBroker::connect(RedisBrokerConfig::new(redis_url.clone()).key_prefix("example:"))
            .await?;
    let relay = Arc::new(
        Relay::builder(repo.clone(), Arc::new(broker))
            .worker_id(txoutbox_examples::default_worker_id())
            .build()?,
    );
    // LISTEN on diesel-async's notification stream (no sqlx); reconnects by itself.
    let _listener = txoutbox_diesel::WakeListener::spawn(&db, &table, vec![relay.waker()]).await?;
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    // The service: business row and event in one diesel transaction.
    let writer = repo.writer().notify(true);
    let mut ids = Vec::new();
    for owner in ["ada", "brian", "chen"] {
        let account = Uuid::new_v4();
        let event = NewEvent::builder()
            .event_type("account.opened")
            .aggregate("account", account)
            .topic("accounts")
            .partition_key(account.to_string())
            .payload_json(json!({ "account": account, "owner": owner }))
            .build()?;
        ids.push(event.id());
        let writer = writer.clone();
        conn.transaction::<_, WriteError, _>(async move |c| {
            diesel::sql_query(
                "INSERT INTO example_diesel_redis.accounts (id, owner) VALUES ($1, $2)",
            )
            .bind::<SqlUuid, _>(account)
            .bind::<Text, _>(owner)
            .execute(c)
            .await?;
            writer.write(c, vec![event]).await?;
            Ok(())
        })
        .await?;
        println!("opened account {account} for {owner}");
    }

    // Wait (bounded) until the relay completed the three rows.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    for id in &ids {
        loop {
            let row = repo.get(*id).await?.ok_or("row vanished")?;
            if row.status == Status::Completed {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                return Err(format!("event {id} not published within 30 s").into());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    stop.cancel();
    running.await??;

    let client = redis::Client::open(redis_url)?;
    let mut rc = client.get_multiplexed_async_connection().await?;
    let reply: redis::streams::StreamRangeReply =
        redis::AsyncCommands::xrange_all(&mut rc, "example:accounts").await?;
    println!("stream example:accounts (this run's entries marked *):");
    for entry in reply.ids {
        let field = |k: &str| entry.get::<String>(k).unwrap_or_default();
        let id = field("event_id");
        let mine = ids.iter().any(|e| e.to_string() == id);
        println!(
            "{} {} {} {} {}",
            if mine { "*" } else { " " },
            entry.id,
            field("event_type"),
            id,
            field("payload")
        );
    }
    Ok(())
}
