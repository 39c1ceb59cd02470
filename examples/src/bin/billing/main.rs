//! `billing`: the consuming half of the two-service example (see examples/README.md, "Two
//! services"). It reads the `order.placed` events that `orders` publishes, from NATS JetStream,
//! Redis Streams, Kafka (feature `kafka`) or a RabbitMQ queue (feature `rabbitmq`), through the
//! inbox: each message lands in `billing_service.inbox_events` and its handler writes one ledger
//! row in the same transaction, so a message redelivered (a relay that published twice, a runner
//! killed before its ack) is a duplicate and bills nothing twice; one customer's orders are
//! billed in the order they were placed.
//!
//! ```sh
//! cargo run -p txoutbox-examples --features redis --bin billing -- --broker nats
//! cargo run -p txoutbox-examples --features diesel --bin billing -- --store diesel
//! ```
//!
//! The store that runs the inbox is `--store sqlx` (outbox-postgres's sqlx inbox, the handler
//! gets the sqlx `Transaction`: `store_sqlx.rs`) or `--store diesel` (cargo feature `diesel`:
//! outbox-diesel's inbox, the handler gets the diesel-async `AsyncPgConnection` inside the inbox
//! transaction: `store_diesel.rs`). Both keep the same tables, so either can take over from the
//! other. Everything else (arguments, subscription, runner) is this file's, shared.
//!
//! A failed handler run is recorded in the inbox row (the default `on_failure record`) and
//! retried by the runner's embedded processor with backoff, while the customer's later orders
//! wait behind it. `--fail-rate 0.05` makes the handler fail on purpose, to watch that happen;
//! the end-to-end fault trial (examples/tests/e2e_faults.rs) runs it so.

mod store_diesel;
mod store_sqlx;

use std::sync::Arc;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use rand::RngExt;
use txoutbox_core::CancellationToken;
use txoutbox_core::inbox::repository::{HandlerTx, InboxBackend};
use txoutbox_core::inbox::{Handler, HandlerError, InboxEvent, Runner};
use txoutbox_core::{Backoff, inbox::Subscription};
use txoutbox_postgres::TableName;

/// An error of `main`.
type BoxError = Box<dyn std::error::Error>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum StoreKind {
    /// outbox-postgres's inbox on sqlx.
    Sqlx,
    /// outbox-diesel's inbox on diesel-async (cargo feature `diesel`).
    #[cfg(feature = "diesel")]
    Diesel,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BrokerKind {
    /// NATS JetStream: a durable pull consumer named after the group.
    Nats,
    /// Redis Streams: a consumer group.
    #[cfg(feature = "redis")]
    Redis,
    /// Kafka: a consumer group reading the topic prefix + `orders`.
    #[cfg(feature = "kafka")]
    Kafka,
    /// RabbitMQ: the runners of a group consume one queue (bound to the orders' routing key).
    #[cfg(feature = "rabbitmq")]
    Rabbitmq,
}

/// Bills each placed order once, in order per customer.
#[derive(Debug, Parser)]
#[command(name = "billing", version)]
struct Args {
    /// PostgreSQL URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test",
        hide_env_values = true
    )]
    database_url: String,
    /// The schema of the service's tables (`inbox_events`, `billing_ledger`).
    #[arg(long, default_value = "billing_service")]
    schema: String,
    /// The store that runs the inbox and whose transaction the handler writes in.
    #[arg(long, value_enum, default_value_t = StoreKind::Sqlx)]
    store: StoreKind,
    /// The broker to read from.
    #[arg(long, value_enum, default_value_t = BrokerKind::Nats)]
    broker: BrokerKind,
    /// NATS URL.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// The JetStream stream that holds the orders' subjects.
    #[arg(long, default_value = "ORDERS")]
    nats_stream: String,
    /// Subject prefix (the relay's): subjects are prefix + topic.
    #[arg(long, default_value = "shop.")]
    subject_prefix: String,
    /// How long NATS waits for an ack before it redelivers (a killed runner's message).
    #[arg(long, default_value = "30s", value_parser = parse_dur)]
    ack_wait: Duration,
    /// Redis URL.
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    redis_url: String,
    /// Redis stream key prefix (the relay's): streams are prefix + topic.
    #[arg(long, default_value = "shop:")]
    redis_key_prefix: String,
    /// How long a Redis entry stays idle before another consumer claims it.
    #[arg(long, default_value = "60s", value_parser = parse_dur)]
    claim_idle: Duration,
    /// Kafka bootstrap brokers, host:port, comma separated.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    kafka_brokers: String,
    /// Kafka topic prefix (the relay's): the topic is prefix + `orders`.
    #[arg(long, default_value = "shop.")]
    kafka_topic_prefix: String,
    /// The Kafka group session timeout: a runner that stops answering (a killed one) loses its
    /// partitions after it.
    #[arg(long, default_value = "10s", value_parser = parse_dur)]
    kafka_session_timeout: Duration,
    /// RabbitMQ URI.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        hide_env_values = true
    )]
    amqp_url: String,
    /// The RabbitMQ routing-key prefix (the relay's): a message's source is its routing key
    /// without it when it carries no source header.
    #[arg(long, default_value = "shop.")]
    rabbitmq_routing_key_prefix: String,
    /// The RabbitMQ quorum queue the group consumes (it must exist; default: the routing-key
    /// prefix + `orders`, the queue the default exchange routes the orders to).
    #[arg(long)]
    rabbitmq_queue: Option<String>,
    /// The consumer group (one inbox line per group).
    #[arg(long, default_value = "billing")]
    group: String,
    /// This runner's worker id (default: host-pid).
    #[arg(long)]
    worker_id: Option<String>,
    /// Attempts a message gets before it is `failed`.
    #[arg(long, default_value_t = 3)]
    max_attempts: u32,
    /// Retry backoff base and cap of a failed run.
    #[arg(long, default_value = "10s", value_parser = parse_dur)]
    retry_base: Duration,
    /// Retry backoff cap.
    #[arg(long, default_value = "60s", value_parser = parse_dur)]
    retry_cap: Duration,
    /// How long a row taken by the embedded processor stays held by this runner (a killed
    /// runner's row is taken over after it).
    #[arg(long, default_value = "60s", value_parser = parse_dur)]
    lease: Duration,
    /// Longest handler run; a run past it is a counted failure (below --lease).
    #[arg(long, default_value = "30s", value_parser = parse_dur)]
    handler_timeout: Duration,
    /// Deliveries held at once (each key in one transaction at a time; R166, R183).
    #[arg(long, default_value_t = txoutbox_core::inbox::runner::DEFAULT_RUNNER_CONCURRENCY)]
    concurrency: usize,
    /// Messages per transaction, 1 to 64 (R183; 1 is one message per transaction). Default the
    /// library's (16), or --concurrency when that is smaller.
    #[arg(long)]
    messages_per_transaction: Option<usize>,
    /// PostgreSQL connections of the service's pool. A transaction holds one and briefly takes
    /// a second to read the database clock, so give more than the transactions in flight
    /// (⌈--concurrency / --messages-per-transaction⌉).
    #[arg(long, default_value_t = 10)]
    max_connections: u32,
    /// Fraction of handler runs that fail on purpose (a counted failure), 0 to 1.
    #[arg(long, default_value_t = 0.0)]
    fail_rate: f64,
    /// Every order of this customer fails (a poison key, to watch `--on-exhausted park`).
    #[arg(long)]
    poison_customer: Option<String>,
    /// What the failure that spends a message's last attempt writes: `release` (failed; the
    /// customer's later orders go on) or `park` (the row stays pending and holds the customer's
    /// later orders until `outbox-relay inbox redrive` or `discard`).
    #[arg(long, default_value = "release", value_parser = parse_exhausted)]
    on_exhausted: txoutbox_core::repository::OnExhausted,
}

fn parse_exhausted(s: &str) -> Result<txoutbox_core::repository::OnExhausted, String> {
    s.parse()
        .map_err(|e: txoutbox_core::ConfigError| e.to_string())
}

/// --messages-per-transaction, or the library's default capped at --concurrency.
fn messages_per_transaction(args: &Args) -> usize {
    args.messages_per_transaction.unwrap_or(
        txoutbox_core::inbox::runner::DEFAULT_MESSAGES_PER_TRANSACTION.min(args.concurrency.max(1)),
    )
}

fn parse_dur(s: &str) -> Result<Duration, String> {
    let (n, unit) = s
        .find(|c: char| !c.is_ascii_digit())
        .map(|i| s.split_at(i))
        .ok_or_else(|| format!("{s:?}: give a duration like 500ms, 2s or 1m"))?;
    let n: u64 = n.parse().map_err(|e| format!("{s:?}: {e}"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("{s:?}: the unit is ms, s or m")),
    }
}

/// The inbox table and the ledger table of `--schema`.
fn tables(args: &Args) -> Result<(TableName, TableName), BoxError> {
    Ok((
        TableName::new(&format!("{}.inbox_events", args.schema))?,
        TableName::new(&format!("{}.billing_ledger", args.schema))?,
    ))
}

/// The ledger table, created if missing (run by either store before it consumes).
fn ledger_ddl(ledger: &TableName) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (
             id bigserial PRIMARY KEY, message_id text NOT NULL, order_id uuid,
             customer text NOT NULL, seq integer NOT NULL, total_cents bigint NOT NULL,
             billed_at timestamptz NOT NULL DEFAULT clock_timestamp())",
        ledger.qualified()
    )
}

/// One `order.placed` payload.
struct Order {
    id: Option<uuid::Uuid>,
    customer: String,
    seq: i32,
    total_cents: i64,
}

/// The handler: one ledger row per order, in the inbox transaction. It implements
/// [`Handler`] once per store (`store_sqlx.rs`, `store_diesel.rs`), each binding [`Bill::insert`]
/// its driver's way; what an order is, the injected failures and the output are here.
struct Bill {
    ledger: TableName,
    fail_rate: f64,
    poison_customer: Option<String>,
}

impl Bill {
    /// The order the row carries: none for a payload that is not an order (the run is then a
    /// skip); an error for an injected failure (`--fail-rate`).
    fn order(&self, row: &InboxEvent) -> Result<Option<Order>, HandlerError> {
        let p = &row.payload;
        let (Some(customer), Some(seq)) = (p["customer"].as_str(), p["seq"].as_i64()) else {
            return Ok(None);
        };
        if self.poison_customer.as_deref() == Some(customer) {
            println!(
                "billing: poison customer {customer}: {} fails (#{seq}, attempt {})",
                row.message_id,
                row.attempts_made + 1
            );
            return Err(HandlerError::new(format!("poison customer {customer}")));
        }
        if self.fail_rate > 0.0 && rand::rng().random_range(0.0..1.0) < self.fail_rate {
            println!(
                "billing: injected failure for {} ({customer} #{seq}, attempt {})",
                row.message_id,
                row.attempts_made + 1
            );
            return Err(HandlerError::new("injected failure (--fail-rate)"));
        }
        Ok(Some(Order {
            id: p["order"].as_str().and_then(|s| s.parse().ok()),
            customer: customer.to_owned(),
            seq: seq as i32,
            total_cents: p["total_cents"].as_i64().unwrap_or(0),
        }))
    }

    /// The ledger insert: $1 message_id text, $2 order_id uuid (nullable), $3 customer text,
    /// $4 seq int4, $5 total_cents int8.
    fn insert(&self) -> String {
        format!(
            "INSERT INTO {} (message_id, order_id, customer, seq, total_cents)
             VALUES ($1, $2, $3, $4, $5)",
            self.ledger.qualified()
        )
    }

    /// Reports a billed order.
    fn billed(&self, row: &InboxEvent, o: &Order) {
        println!(
            "billing: billed {} #{} (message {}, {} cents)",
            o.customer, o.seq, row.message_id, o.total_cents
        );
    }
}

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    // The stop signal first: a SIGTERM during start-up (waiting for the database or for the
    // producer's stream) stops the process cleanly (exit 0) instead of killing it.
    let stop = txoutbox_core::signal::stop_on_signals()?;
    let args = Args::parse();
    if !(0.0..=1.0).contains(&args.fail_rate) {
        return Err(format!("--fail-rate {} is not between 0 and 1", args.fail_rate).into());
    }
    let per_tx = messages_per_transaction(&args);
    let transactions = args.concurrency.div_ceil(per_tx.max(1));
    if args.max_connections as usize <= transactions {
        return Err(format!(
            "--max-connections {} must exceed the {transactions} transaction(s) in flight \
             (--concurrency {} / --messages-per-transaction {per_tx}): a transaction takes a \
             second connection while it holds one",
            args.max_connections, args.concurrency
        )
        .into());
    }
    let (_, ledger) = tables(&args)?;
    let bill = Bill {
        ledger,
        fail_rate: args.fail_rate,
        poison_customer: args.poison_customer.clone(),
    };
    match args.store {
        StoreKind::Sqlx => store_sqlx::run(&args, bill, &stop).await,
        #[cfg(feature = "diesel")]
        StoreKind::Diesel => store_diesel::run(&args, bill, &stop).await,
    }
}

/// Runs `attempt` until it succeeds, every 2 s, printing why it failed: a runner started while
/// PostgreSQL restarts waits for it instead of exiting. `None` when `stop` came first (a stop
/// signal during start-up), even in the middle of an attempt.
async fn until_ready<T, F, Fut>(what: &str, stop: &CancellationToken, mut attempt: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, BoxError>>,
{
    loop {
        let tried = tokio::select! {
            r = attempt() => r,
            _ = stop.cancelled() => return None,
        };
        match tried {
            Ok(v) => return Some(v),
            Err(e) => {
                println!("billing: {what} is not ready ({e}); trying again in 2 s");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                    _ = stop.cancelled() => return None,
                }
            }
        }
    }
}

/// Said when a stop signal ended the start-up.
fn stopped_during_start_up() -> Result<(), BoxError> {
    println!("billing: stopped during start-up");
    Ok(())
}

/// Consumes with a runner over `inbox` until `stop` (SIGINT or SIGTERM): the store's part is
/// done (tables created, inbox built); the rest is the same for every store. The runner ending
/// with an error (its embedded processor stopped for good, R197) ends the process with it.
async fn consume<B: InboxBackend>(
    args: &Args,
    inbox: B,
    bill: Bill,
    stop: &CancellationToken,
) -> Result<(), BoxError>
where
    Bill: Handler<HandlerTx<B>>,
{
    let worker = args
        .worker_id
        .clone()
        .unwrap_or_else(txoutbox_examples::default_worker_id);
    // The stream is the producer's: until it exists (orders not started yet), wait for it.
    let Some(subscription) =
        until_ready("the subscription", stop, || subscription(args, &worker)).await
    else {
        return stopped_during_start_up();
    };
    let runner = Runner::builder(inbox, subscription, args.group.clone())
        .handler(Arc::new(bill))
        .worker_id(worker.clone())
        .max_attempts(args.max_attempts)
        .on_exhausted(args.on_exhausted)
        .backoff(Backoff::new(
            args.retry_base.as_secs_f64(),
            args.retry_cap.as_secs_f64(),
        )?)
        .concurrency(args.concurrency)
        .messages_per_transaction(messages_per_transaction(args))
        .lease_ttl(args.lease)
        .handler_timeout(args.handler_timeout)
        // The embedded processor retries recorded failures of this source (R121).
        .sources(["orders"])
        .build()?;
    println!(
        "billing: {worker} consuming as group {} from {:?} on the {:?} store",
        args.group, args.broker, args.store
    );
    runner.run(stop.clone()).await?;
    println!("billing: stopped");
    Ok(())
}

// `worker` names the Redis consumer, the Kafka client and the RabbitMQ connection; NATS names its
// durable consumer after the group.
#[cfg_attr(
    not(any(feature = "redis", feature = "kafka", feature = "rabbitmq")),
    allow(unused_variables)
)]
async fn subscription(args: &Args, worker: &str) -> Result<Arc<dyn Subscription>, BoxError> {
    Ok(match args.broker {
        BrokerKind::Nats => {
            use txoutbox_nats_broker::{NatsSubscription, NatsSubscriptionConfig};
            let client = txoutbox_nats_broker::async_nats::connect(&args.nats_url).await?;
            Arc::new(
                NatsSubscription::bind(
                    client,
                    NatsSubscriptionConfig::new(args.nats_stream.clone(), args.group.clone())
                        .subject_prefix(args.subject_prefix.clone())
                        .topics(["orders"])
                        .ack_wait(args.ack_wait),
                )
                .await?,
            )
        }
        #[cfg(feature = "redis")]
        BrokerKind::Redis => {
            use txoutbox_redis_broker::{RedisSubscription, RedisSubscriptionConfig};
            Arc::new(
                RedisSubscription::connect(
                    RedisSubscriptionConfig::new(
                        args.redis_url.clone(),
                        args.group.clone(),
                        worker,
                        ["orders"],
                    )
                    .key_prefix(args.redis_key_prefix.clone())
                    .claim_idle(args.claim_idle)
                    .max_waiting_rewinds(args.concurrency.max(1)),
                )
                .await?,
            )
        }
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka => {
            use txoutbox_kafka_broker::{
                KafkaBrokerConfig, KafkaSubscription, KafkaSubscriptionConfig,
            };
            Arc::new(
                KafkaSubscription::connect(
                    KafkaSubscriptionConfig::new(
                        KafkaBrokerConfig::new(args.kafka_brokers.clone())
                            .topic_prefix(args.kafka_topic_prefix.clone()),
                        args.group.clone(),
                        ["orders"],
                    )
                    .client_id(worker)
                    .session_timeout(args.kafka_session_timeout)
                    // A partition given up at a rebalance waits at most for the runs in flight.
                    .revoke_timeout(args.handler_timeout + Duration::from_secs(5)),
                )
                .await?,
            )
        }
        #[cfg(feature = "rabbitmq")]
        BrokerKind::Rabbitmq => {
            use txoutbox_rabbitmq_broker::{
                RabbitMqBrokerConfig, RabbitSubscription, RabbitSubscriptionConfig,
            };
            let queue = args
                .rabbitmq_queue
                .clone()
                .unwrap_or_else(|| format!("{}orders", args.rabbitmq_routing_key_prefix));
            Arc::new(
                RabbitSubscription::start(
                    RabbitSubscriptionConfig::new(
                        RabbitMqBrokerConfig::new(args.amqp_url.clone())
                            .connection_name(format!("billing {worker}")),
                        args.group.clone(),
                        [queue],
                    )
                    .routing_key_prefix(args.rabbitmq_routing_key_prefix.clone())
                    .concurrency(args.concurrency)
                    .max_attempts(args.max_attempts),
                )
                .await?,
            )
        }
    })
}
