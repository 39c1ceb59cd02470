//! Issue 23's broker benchmark: per broker, in one run, the relay end to end against the no-op
//! relay and against the raw client's publish rate at the same acknowledgement level.
//!
//! * `noop`: the relay over the in-memory store with the no-op broker (the relay's own cost).
//! * `relay`: the same relay and store with the adapter (Kafka: krafka, acks = all, idempotent
//!   producer; RabbitMQ: lapin, publisher confirms, mandatory, persistent).
//! * `raw`: the client alone, `--concurrency` publishes in flight (the relay's publish
//!   concurrency), each awaited for its acknowledgement (Kafka: acks = all, idempotent;
//!   RabbitMQ: one confirm channel, mandatory, persistent).
//!
//! The store is the in-memory reference backend, so the figures isolate the broker path; the
//! PostgreSQL figures are `outbox-bench`'s (examples/BENCHMARKS.md). The three modes run one
//! after another per repetition, so their ratios are measured under the same load.
//!
//! ```text
//! cargo run --release -p txoutbox-examples --features kafka,rabbitmq --example broker_bench -- \
//!     --events 5000 --runs 3
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use txoutbox_core::broker::NoopBroker;
use txoutbox_core::{Broker, CancellationToken, InMemoryRepository, NewEvent, Relay, SystemClock};
use txoutbox_kafka_broker::krafka;
use txoutbox_kafka_broker::{Idempotence, KafkaBroker, KafkaBrokerConfig};
use txoutbox_rabbitmq_broker::lapin;
use txoutbox_rabbitmq_broker::{RabbitMqBroker, RabbitMqBrokerConfig};

#[derive(Parser)]
struct Args {
    /// Events per measurement.
    #[arg(long, default_value_t = 5000)]
    events: usize,
    /// Keys the events are spread over (event i goes to key i mod keys).
    #[arg(long, default_value_t = 100)]
    keys: usize,
    /// Repetitions.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// The relay's publish concurrency, and the raw client's publishes in flight.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Kafka bootstrap brokers.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    kafka: String,
    /// RabbitMQ URI.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp: String,
}

type Res<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

fn body(i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "seq": i, "amount": i % 1000, "note": "outbox benchmark event"
    }))
    .expect("JSON always serializes")
}

/// The relay draining `a.events` rows of `topic` from memory through `broker`: events/s.
async fn relay(a: &Args, broker: Arc<dyn Broker>, topic: &str) -> Res<f64> {
    let repo = Arc::new(InMemoryRepository::new(Arc::new(SystemClock)));
    let rows = (0..a.events)
        .map(|i| {
            NewEvent::builder()
                .event_type("bench")
                .aggregate("a", uuid::Uuid::new_v4())
                .topic(topic)
                .partition_key(format!("k{}", i % a.keys))
                .payload_json(serde_json::from_slice(&body(i)).expect("JSON"))
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    repo.write_committed(rows).await?;
    let relay = Relay::builder(repo.clone(), broker)
        .worker_id("bench")
        .publish_concurrency(a.concurrency)
        .poll_interval(Duration::from_millis(10))
        .build()?;
    let stop = CancellationToken::new();
    let t0 = Instant::now();
    let run = {
        let stop = stop.clone();
        tokio::spawn(async move { relay.run(stop).await })
    };
    loop {
        let done = repo
            .rows()
            .iter()
            .filter(|r| r.status == txoutbox_core::Status::Completed)
            .count();
        if done == a.events {
            break;
        }
        if t0.elapsed() > Duration::from_secs(600) {
            return Err(format!("the relay completed {done} of {} in 600 s", a.events).into());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let took = t0.elapsed();
    stop.cancel();
    run.await??;
    Ok(a.events as f64 / took.as_secs_f64())
}

/// `a.events` publishes with `a.concurrency` in flight: events/s.
async fn raw<F, Fut>(a: &Args, send: F) -> Res<f64>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Res<()>>,
{
    let t0 = Instant::now();
    let mut s = futures::stream::iter((0..a.events).map(send)).buffer_unordered(a.concurrency);
    while let Some(r) = s.next().await {
        r?;
    }
    Ok(a.events as f64 / t0.elapsed().as_secs_f64())
}

async fn kafka_round(a: &Args, run: usize) -> Res<(f64, f64)> {
    let topic = format!("bench.kafka-{}-{run}", std::process::id());
    let admin = krafka::Kafka::builder(a.kafka.clone()).connect().await?;
    for (n, r) in admin
        .admin()
        .create_topics(
            [krafka::admin::NewTopic::new(&topic, 4, 1)?],
            Default::default(),
        )
        .await?
    {
        r.map_err(|e| format!("create topic {n}: {e}"))?;
    }
    let adapter =
        KafkaBroker::connect(KafkaBrokerConfig::new(a.kafka.clone()).idempotence(Idempotence::On))
            .await?;
    let relay_rate = relay(a, Arc::new(adapter), &topic).await?;
    let producer = Arc::new(
        admin
            .producer()
            .acks(krafka::producer::Acks::All)
            .idempotent(true)
            .build()
            .await?,
    );
    let raw_rate = raw(a, |i| {
        let (p, t) = (producer.clone(), topic.clone());
        async move {
            let r = krafka::Record::new(t, body(i)).key(format!("k{}", i % a.keys).into_bytes());
            let meta = p.send(r).await?;
            if meta.is_persisted() {
                Ok(())
            } else {
                Err(format!("not persisted: {:?}", meta.delivery).into())
            }
        }
    })
    .await?;
    let _ = producer.close().await;
    let _ = admin
        .admin()
        .delete_topics([topic.as_str()], Default::default())
        .await;
    Ok((relay_rate, raw_rate))
}

async fn rabbit_round(a: &Args, run: usize) -> Res<(f64, f64)> {
    use lapin::options::{
        BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::FieldTable;
    let queue = format!("bench.rabbit-{}-{run}", std::process::id());
    let conn = lapin::Connection::connect(&a.amqp, lapin::ConnectionProperties::default()).await?;
    let ch = conn.create_channel().await?;
    let durable = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.as_str().into(), durable, FieldTable::default())
        .await?;
    let adapter = RabbitMqBroker::connect(RabbitMqBrokerConfig::new(a.amqp.clone())).await?;
    let relay_rate = relay(a, Arc::new(adapter), &queue).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let raw_rate = raw(a, |i| {
        let (ch, q) = (ch.clone(), queue.clone());
        async move {
            let props = lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into());
            let options = BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            };
            let confirm = ch
                .basic_publish("".into(), q.as_str().into(), options, &body(i), props)
                .await?
                .await?;
            match confirm {
                lapin::Confirmation::Ack(None) => Ok(()),
                other => Err(format!("not confirmed: {other:?}").into()),
            }
        }
    })
    .await?;
    ch.queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await?;
    let _ = conn.close(200, "done".into()).await;
    Ok((relay_rate, raw_rate))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[tokio::main]
async fn main() -> Res<()> {
    let a = Args::parse();
    let mut rows: Vec<[f64; 5]> = Vec::new();
    for run in 0..a.runs {
        let noop = relay(&a, Arc::new(NoopBroker), "bench").await?;
        let (kr, kraw) = kafka_round(&a, run).await?;
        let (rr, rraw) = rabbit_round(&a, run).await?;
        println!(
            "{}",
            serde_json::json!({
                "run": run, "events": a.events, "keys": a.keys, "concurrency": a.concurrency,
                "noop_relay": noop, "kafka_relay": kr, "kafka_raw": kraw,
                "rabbitmq_relay": rr, "rabbitmq_raw": rraw,
            })
        );
        rows.push([noop, kr, kraw, rr, rraw]);
    }
    let col = |i: usize| median(rows.iter().map(|r| r[i]).collect());
    let ratio = |n: usize, d: usize| median(rows.iter().map(|r| r[n] / r[d]).collect());
    println!(
        "| broker | relay ev/s | raw client ev/s | no-op relay ev/s | relay / raw | relay / no-op |"
    );
    println!("|---|---|---|---|---|---|");
    for (name, r, w) in [
        ("Kafka (krafka, acks=all, idempotent)", 1, 2),
        ("RabbitMQ (lapin, confirms, mandatory)", 3, 4),
    ] {
        println!(
            "| {name} | {:.0} | {:.0} | {:.0} | {:.2} | {:.3} |",
            col(r),
            col(w),
            col(0),
            ratio(r, w),
            ratio(r, 0)
        );
    }
    Ok(())
}
