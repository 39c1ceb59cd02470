//! `orders`: the producing half of the two-service example (see examples/README.md, "Two
//! services"). It places orders for a few customers, each order's row and its `order.placed`
//! event in one transaction through the outbox writer, and (unless `--relay none`) runs a relay
//! in the same process that publishes the events to NATS JetStream or Redis Streams. `billing`
//! consumes them through the inbox.
//!
//! ```sh
//! cargo run -p txoutbox-examples --features redis --bin orders -- --broker nats
//! ```
//!
//! One customer's orders are written one after the other, numbered 1, 2, … in the payload
//! (`seq`), and published with the customer as partition key, so billing sees them in that
//! order. The end-to-end fault trial (examples/tests/e2e_faults.rs) runs it with `--relay none`
//! and `outbox-relay` processes beside it.

use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use serde_json::json;
use txoutbox_core::{Broker, CancellationToken, NewEvent, Relay};
use txoutbox_postgres::sqlx::{self, PgPool};
use txoutbox_postgres::{PgConfig, PgOutboxRepository, WakeListener, create_schema};
use uuid::Uuid;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum RelayBroker {
    /// No relay here: `outbox-relay` processes publish the events.
    None,
    /// NATS JetStream (subjects `<prefix>orders`).
    Nats,
    /// Redis Streams.
    #[cfg(feature = "redis")]
    Redis,
}

/// Places orders, each with its event in the order's transaction.
#[derive(Debug, Parser)]
#[command(name = "orders", version)]
struct Args {
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test",
        hide_env_values = true
    )]
    database_url: String,
    /// The schema of the service's tables (`orders`, `outbox_events`).
    #[arg(long, default_value = "orders_service")]
    schema: String,
    /// Where the in-process relay publishes; `none` leaves it to `outbox-relay`.
    #[arg(long, value_enum, default_value_t = RelayBroker::Nats)]
    relay: RelayBroker,
    /// NATS URL of the in-process relay.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// The JetStream stream the relay ensures (subjects `<prefix>>`).
    #[arg(long, default_value = "ORDERS")]
    nats_stream: String,
    /// Subject prefix (a subject is prefix + topic).
    #[arg(long, default_value = "shop.")]
    subject_prefix: String,
    /// Redis URL of the in-process relay.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Redis stream key pattern (`{topic}` is replaced).
    #[arg(long, default_value = "shop:{topic}")]
    redis_key_pattern: String,
    /// Customers (partition keys), each placing its orders in sequence.
    #[arg(long, default_value_t = 3)]
    customers: u32,
    /// Orders per customer.
    #[arg(long, default_value_t = 4)]
    orders: u32,
    /// Pause between two orders of one customer.
    #[arg(long, default_value = "500ms", value_parser = parse_ms)]
    interval: Duration,
    /// Prefix of the customer names (`<prefix>1`, `<prefix>2`, …).
    #[arg(long, default_value = "customer-")]
    customer_prefix: String,
    /// Keep the relay running after the last order until stopped (Ctrl-C).
    #[arg(long)]
    stay: bool,
}

fn parse_ms(s: &str) -> Result<Duration, String> {
    let ms = s
        .strip_suffix("ms")
        .map(|v| v.parse::<u64>())
        .or_else(|| {
            s.strip_suffix('s')
                .map(|v| v.parse::<u64>().map(|s| s * 1000))
        })
        .ok_or_else(|| format!("{s:?}: give a duration like 500ms or 2s"))?
        .map_err(|e| format!("{s:?}: {e}"))?;
    Ok(Duration::from_millis(ms))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let pool = PgPool::connect(&args.database_url).await?;
    let cfg = PgConfig::default().table_name(&format!("{}.outbox_events", args.schema))?;
    create_schema(&pool, cfg.table_ref()).await?;
    // The service's own table beside the outbox's, its name validated like the outbox table's.
    let orders_table =
        txoutbox_postgres::TableName::new(&format!("{}.orders", args.schema))?.qualified();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {orders_table} (
             id uuid PRIMARY KEY, customer text NOT NULL, seq integer NOT NULL,
             total_cents bigint NOT NULL, placed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
             UNIQUE (customer, seq))"
    )))
    .execute(&pool)
    .await?;
    let repo = PgOutboxRepository::new(pool.clone(), cfg);
    let writer = repo.writer().notify(true);

    let stop = CancellationToken::new();
    let relay = match args.relay {
        RelayBroker::None => None,
        kind => {
            let broker = broker(&args, kind).await?;
            let table = repo.table().clone();
            let relay = Arc::new(
                Relay::builder(Arc::new(repo.clone()), broker)
                    .step(Arc::new(PrintPublished))
                    .build()?,
            );
            let listener = WakeListener::spawn(&pool, &table, vec![relay.waker()]).await?;
            let running = tokio::spawn({
                let (relay, stop) = (relay.clone(), stop.clone());
                async move { relay.run(stop).await }
            });
            Some((running, listener))
        }
    };

    // One task per customer: its orders one after the other, each in its own transaction.
    let mut customers = Vec::new();
    for c in 1..=args.customers {
        let (pool, writer) = (pool.clone(), writer.clone());
        let customer = format!("{}{c}", args.customer_prefix);
        let (orders, interval, table) = (args.orders, args.interval, orders_table.clone());
        customers.push(tokio::spawn(async move {
            // A second run goes on where the last one stopped: seq stays unique per customer.
            let last: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT coalesce(max(seq), 0) FROM {table} WHERE customer = $1"
            )))
            .bind(&customer)
            .fetch_one(&pool)
            .await?;
            for seq in (last as u32 + 1)..=(last as u32 + orders) {
                // A failed write is tried again (the database restarting, say); a retry that
                // finds the order placed means the failed attempt's commit went through.
                let mut tries = 0u32;
                let order = loop {
                    match place(&pool, &writer, &table, &customer, seq).await {
                        Ok(order) => break Some(order),
                        Err(e) if is_unique_violation(&e) => break None,
                        Err(e) if tries < 60 => {
                            tries += 1;
                            eprintln!("orders: placing {customer} #{seq} failed ({e}); retrying");
                            tokio::time::sleep(Duration::from_millis(500)).await;
                        }
                        Err(e) => return Err(e),
                    }
                };
                let total = total_cents(seq);
                match order {
                    Some(order) => println!(
                        "orders: placed order {order} for {customer} (#{seq}, {total} cents)"
                    ),
                    None => println!("orders: {customer} #{seq} was placed by the failed attempt"),
                }
                if !interval.is_zero() {
                    tokio::time::sleep(interval).await;
                }
            }
            Ok::<_, BoxError>(())
        }));
    }
    for c in customers {
        c.await?.map_err(|e| e.to_string())?;
    }
    println!("orders: all orders placed");

    if let Some((running, _listener)) = relay {
        if args.stay {
            tokio::signal::ctrl_c().await?;
        } else {
            // Give the relay the time to publish the last events, then stop it.
            wait_drained(&repo, Duration::from_secs(30)).await?;
        }
        stop.cancel();
        running.await??;
        println!("orders: relay stopped");
    }
    Ok(())
}

/// Prints each event the relay got acknowledged, after its row is completed.
struct PrintPublished;

#[async_trait::async_trait]
impl txoutbox_core::PipelineStep for PrintPublished {
    async fn on_outcome(&self, o: &txoutbox_core::ObservedOutcome<'_>) {
        if matches!(o.outcome, txoutbox_core::RowOutcome::Completed { .. }) {
            println!(
                "orders relay: published {} {} for {}",
                o.event.event_type, o.event.id, o.event.partition_key
            );
        }
    }
}

fn total_cents(seq: u32) -> i64 {
    100 + i64::from(seq) * 25
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Places one order: its row and its event in one transaction.
async fn place(
    pool: &PgPool,
    writer: &txoutbox_postgres::PgOutboxWriter,
    table: &str,
    customer: &str,
    seq: u32,
) -> Result<Uuid, BoxError> {
    let order = Uuid::now_v7();
    let total = total_cents(seq);
    let mut tx = pool.begin().await?;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (id, customer, seq, total_cents) VALUES ($1, $2, $3, $4)"
    )))
    .bind(order)
    .bind(customer)
    .bind(seq as i32)
    .bind(total)
    .execute(&mut *tx)
    .await?;
    let event = NewEvent::builder()
        .event_type("order.placed")
        .aggregate("order", order)
        .topic("orders")
        .partition_key(customer)
        .payload_json(json!({
            "order": order, "customer": customer, "seq": seq, "total_cents": total
        }))
        .build()?;
    writer.write(&mut tx, vec![event]).await?;
    tx.commit().await?;
    Ok(order)
}

fn is_unique_violation(e: &BoxError) -> bool {
    e.downcast_ref::<sqlx::Error>()
        .and_then(|e| e.as_database_error())
        .is_some_and(|d| d.code().as_deref() == Some("23505"))
}

async fn broker(
    args: &Args,
    kind: RelayBroker,
) -> Result<Arc<dyn Broker>, Box<dyn std::error::Error>> {
    Ok(match kind {
        RelayBroker::None => unreachable!("no relay"),
        RelayBroker::Nats => {
            use txoutbox_nats_broker::{NatsBroker, NatsBrokerConfig, StreamSpec};
            Arc::new(
                NatsBroker::connect(
                    NatsBrokerConfig::new(args.nats_url.clone())
                        .subject_prefix(args.subject_prefix.clone())
                        .ensure_stream(StreamSpec::new(args.nats_stream.clone())),
                )
                .await?,
            )
        }
        #[cfg(feature = "redis")]
        RelayBroker::Redis => {
            use txoutbox_redis_broker::{RedisBroker, RedisBrokerConfig};
            Arc::new(
                RedisBroker::connect(
                    RedisBrokerConfig::new(args.redis_url.clone())
                        .key_pattern(args.redis_key_pattern.clone()),
                )
                .await?,
            )
        }
    })
}

/// Waits until no pending row is left in the outbox (or `patience` passes).
async fn wait_drained(
    repo: &PgOutboxRepository,
    patience: Duration,
) -> Result<(), Box<dyn std::error::Error>> {
    use txoutbox_core::{OutboxRepository, Status};
    let deadline = tokio::time::Instant::now() + patience;
    loop {
        let pending: i64 = repo
            .counts()
            .await?
            .iter()
            .filter(|c| c.status == Status::Pending)
            .map(|c| c.count)
            .sum();
        if pending == 0 || tokio::time::Instant::now() >= deadline {
            if pending > 0 {
                println!("orders: {pending} events still pending; the next relay publishes them");
            }
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
