//! Measures the latency from a writer's commit to the broker's acknowledgement with an idle
//! relay, once with LISTEN/NOTIFY wake-ups and once polling only. Not a test: a measurement
//! whose figures examples/README.md states.
//!
//! ```sh
//! cargo run --release -p txoutbox-examples --example latency               # 1000 events per mode
//! cargo run --release -p txoutbox-examples --example latency -- 200 250ms  # events, poll interval
//! ```
//!
//! Needs PostgreSQL (DATABASE_URL, default postgres://postgres@127.0.0.1:5432/test) and NATS
//! with JetStream (NATS_URL, default nats://127.0.0.1:4222). It uses a fresh schema and stream,
//! and drops both at the end.
//!
//! Per event: the writer inserts one event in its own transaction (in NOTIFY mode with
//! `pg_notify` in that transaction), commits, and takes the time when `COMMIT` returned; the
//! relay's broker is wrapped so that the time JetStream's acknowledgement came back is taken
//! for that event id. Latency = ack time − commit time. Before each event the writer waits a
//! random 0 to 1 poll interval (NOTIFY mode: 0 to 20 ms), so each event finds the relay idle
//! at a random point of its wait.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use rand::RngExt;
use tokio::sync::mpsc;
use txoutbox_core::{Ack, Broker, BrokerError, CancellationToken, Message, NewEvent, Relay};
use txoutbox_nats_broker::{NatsBroker, NatsBrokerConfig, StreamSpec};
use txoutbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, TableName, create_schema};
use uuid::Uuid;

/// Reports each acknowledged event id with the time its ack came back.
struct AckTimer<B> {
    inner: B,
    tx: mpsc::UnboundedSender<(Uuid, Instant)>,
}

#[async_trait]
impl<B: Broker> Broker for AckTimer<B> {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let r = self.inner.publish(m).await;
        if r.is_ok() {
            let _ = self.tx.send((m.event_id, Instant::now()));
        }
        r
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

async fn measure(
    db: &str,
    nats: &str,
    events: usize,
    notify: bool,
    poll: Duration,
) -> Result<Vec<Duration>, Box<dyn std::error::Error>> {
    let tag = format!("{}_{}", std::process::id(), if notify { "n" } else { "p" });
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(db)
        .await?;
    let schema = format!("latency_{tag}");
    let table = TableName::new(&format!("{schema}.outbox_events"))?;
    create_schema(&pool, &table).await?;
    let stream = format!("LATENCY_{}", tag.to_uppercase());
    let prefix = format!("latency.{tag}.");
    let nats_broker = NatsBroker::connect(
        NatsBrokerConfig::new(nats)
            .subject_prefix(prefix)
            .ensure_stream(StreamSpec::new(stream.clone())),
    )
    .await?;
    let js = nats_broker.jetstream().clone();
    let (tx, mut acks) = mpsc::unbounded_channel();
    let repo = Arc::new(PgOutboxRepository::new(
        pool.clone(),
        PgConfig::default().table(table.clone()),
    ));
    let relay = Arc::new(
        Relay::builder(
            repo,
            Arc::new(AckTimer {
                inner: nats_broker,
                tx,
            }),
        )
        .poll_interval(poll)
        .build()?,
    );
    let _listener = if notify {
        Some(txoutbox_postgres::WakeListener::spawn(&pool, &table, vec![relay.waker()]).await?)
    } else {
        None
    };
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    let writer = PgOutboxWriter::new(&table).notify(notify);
    let mut out = Vec::with_capacity(events);
    for i in 0..events {
        let gap = if notify {
            Duration::from_millis(20)
        } else {
            poll
        };
        let wait = gap.mul_f64(rand::rng().random_range(0.0..1.0));
        tokio::time::sleep(wait).await;
        let e = NewEvent::builder()
            .event_type("latency.probe")
            .aggregate("probe", Uuid::new_v4())
            .topic("probes")
            .partition_key(format!("k{}", i % 16))
            .payload_json(serde_json::json!({ "n": i }))
            .build()?;
        let id = e.id();
        let mut t = pool.begin().await?;
        writer.write(&mut t, vec![e]).await?;
        t.commit().await?;
        let committed = Instant::now();
        loop {
            let (got, at) = tokio::time::timeout(Duration::from_secs(60), acks.recv())
                .await?
                .ok_or("relay stopped")?;
            if got == id {
                out.push(at.saturating_duration_since(committed));
                break;
            }
        }
    }
    stop.cancel();
    running.await??;
    let _ = js.delete_stream(&stream).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{schema}\" CASCADE"
    )))
    .execute(&pool)
    .await?;
    Ok(out)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let db = std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let nats = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    let mut args = std::env::args().skip(1);
    let events: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1000);
    let poll = match args.next() {
        Some(s) => Duration::from_secs_f64(s.trim_end_matches("ms").parse::<f64>()? / 1000.0),
        None => Duration::from_millis(500),
    };
    println!("{events} events per mode; polling-only mode with a {poll:?} poll interval");
    for (name, notify) in [("LISTEN/NOTIFY", true), ("polling only", false)] {
        let mut v = measure(&db, &nats, events, notify, poll).await?;
        v.sort();
        println!(
            "{name:>14}: median {:.2} ms, p99 {:.2} ms, max {:.2} ms (n = {})",
            pct(&v, 0.5).as_secs_f64() * 1e3,
            pct(&v, 0.99).as_secs_f64() * 1e3,
            v.last().expect("events").as_secs_f64() * 1e3,
            v.len()
        );
    }
    Ok(())
}
