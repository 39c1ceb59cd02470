//! The brokers of a run (a fresh JetStream stream or Redis stream key per run, removed after)
//! and the raw broker mode: the broker client alone, publishing N messages with C in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use txoutbox_core::Broker;
use txoutbox_core::broker::NoopBroker;

use crate::{BenchError, BrokerKind, Conn};

/// A broker for one run and what to remove afterwards.
pub struct RunBroker {
    pub broker: Arc<dyn Broker>,
    cleanup: Cleanup,
}

// One value per benchmark run: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Cleanup {
    None,
    #[cfg(feature = "nats")]
    Nats(txoutbox_nats_broker::NatsBroker, String),
    #[cfg(feature = "redis")]
    Redis(txoutbox_redis_broker::RedisBroker, String),
}

/// The payload body of message `i`, the same shape as the preload's.
fn body(i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "seq": i, "amount": i % 1000, "note": "outbox benchmark event"
    }))
    .expect("JSON always serializes")
}

pub async fn open(kind: BrokerKind, conn: &Conn, tag: &str) -> Result<RunBroker, BenchError> {
    match kind {
        BrokerKind::Noop => Ok(RunBroker {
            broker: Arc::new(NoopBroker),
            cleanup: Cleanup::None,
        }),
        BrokerKind::Nats => nats(conn, tag).await,
        BrokerKind::Redis => redis(conn, tag).await,
    }
}

impl RunBroker {
    pub async fn close(self) {
        match self.cleanup {
            Cleanup::None => {}
            #[cfg(feature = "nats")]
            Cleanup::Nats(b, stream) => {
                let _ = b.jetstream().delete_stream(&stream).await;
            }
            #[cfg(feature = "redis")]
            Cleanup::Redis(b, key) => {
                let mut c = b.connection();
                let _: Result<i64, _> = redis::cmd("DEL").arg(&key).query_async(&mut c).await;
            }
        }
    }

    /// Messages stored by the broker for this run (JetStream stream messages, Redis XLEN), for
    /// the end-to-end check; None for the no-op broker.
    pub async fn stored(&self) -> Option<u64> {
        match &self.cleanup {
            Cleanup::None => None,
            #[cfg(feature = "nats")]
            Cleanup::Nats(b, stream) => {
                let mut s = b.jetstream().get_stream(stream).await.ok()?;
                Some(s.info().await.ok()?.state.messages)
            }
            #[cfg(feature = "redis")]
            Cleanup::Redis(b, key) => {
                let mut c = b.connection();
                redis::cmd("XLEN").arg(key).query_async(&mut c).await.ok()
            }
        }
    }

    /// Publishes `n` messages with the broker client alone, `concurrency` tasks each awaiting
    /// the broker's answer before its next message; returns the seconds taken.
    pub async fn raw(&self, n: usize, concurrency: usize) -> Result<f64, BenchError> {
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..concurrency {
            let next = next.clone();
            let client = self.raw_client()?;
            tasks.push(tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return Ok::<(), BenchError>(());
                    }
                    client.send(i).await?;
                }
            }));
        }
        for t in tasks {
            t.await
                .map_err(|e| BenchError(format!("raw task: {e}")))??;
        }
        Ok(started.elapsed().as_secs_f64())
    }

    fn raw_client(&self) -> Result<RawClient, BenchError> {
        match &self.cleanup {
            Cleanup::None => Err(BenchError(
                "--mode raw needs --broker nats or --broker redis".into(),
            )),
            #[cfg(feature = "nats")]
            Cleanup::Nats(b, _) => Ok(RawClient::Nats(
                b.jetstream().clone(),
                b.config().subject_for_topic("bench"),
            )),
            #[cfg(feature = "redis")]
            Cleanup::Redis(b, key) => Ok(RawClient::Redis(b.connection(), key.clone())),
        }
    }
}

// One value per benchmark run: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum RawClient {
    #[cfg(feature = "nats")]
    Nats(async_nats::jetstream::Context, String),
    #[cfg(feature = "redis")]
    Redis(redis::aio::ConnectionManager, String),
}

impl RawClient {
    async fn send(&self, i: usize) -> Result<(), BenchError> {
        let id = uuid::Uuid::new_v4().hyphenated().to_string();
        let key = format!("k{}", i % 1000);
        match self {
            #[cfg(feature = "nats")]
            RawClient::Nats(js, subject) => {
                use async_nats::jetstream::message::PublishMessage;
                let mut h = async_nats::HeaderMap::new();
                h.insert("event_id", id.as_str());
                h.insert("event_type", "bench.created");
                h.insert("topic", "bench");
                h.insert("partition_key", key.as_str());
                h.insert("aggregate_type", "bench");
                h.insert("aggregate_id", id.as_str());
                let msg = PublishMessage::build()
                    .payload(body(i).into())
                    .headers(h)
                    .message_id(id.clone());
                js.send_publish(subject.clone(), msg)
                    .await
                    .map_err(|e| BenchError(format!("JetStream publish: {e}")))?
                    .await
                    .map_err(|e| BenchError(format!("JetStream ack: {e}")))?;
                Ok(())
            }
            #[cfg(feature = "redis")]
            RawClient::Redis(conn, stream) => {
                let mut c = conn.clone();
                let payload = String::from_utf8(body(i)).expect("JSON is UTF-8");
                let _: String = redis::cmd("XADD")
                    .arg(stream)
                    .arg("*")
                    .arg("event_id")
                    .arg(&id)
                    .arg("event_type")
                    .arg("bench.created")
                    .arg("topic")
                    .arg("bench")
                    .arg("partition_key")
                    .arg(&key)
                    .arg("payload")
                    .arg(payload)
                    .arg("aggregate_type")
                    .arg("bench")
                    .arg("aggregate_id")
                    .arg(&id)
                    .query_async(&mut c)
                    .await
                    .map_err(|e| BenchError(format!("XADD: {e}")))?;
                Ok(())
            }
            #[allow(unreachable_patterns)]
            _ => unreachable!("no broker feature compiled in"),
        }
    }
}

#[cfg(feature = "nats")]
async fn nats(conn: &Conn, tag: &str) -> Result<RunBroker, BenchError> {
    use txoutbox_nats_broker::{NatsBroker, NatsBrokerConfig, StreamSpec};
    let stream = tag.to_uppercase();
    let cfg = NatsBrokerConfig::new(conn.nats_url.clone())
        .subject_prefix(format!("{tag}."))
        .ensure_stream(StreamSpec::new(stream.clone()));
    let b = NatsBroker::connect(cfg)
        .await
        .map_err(|e| BenchError(e.to_string()))?;
    Ok(RunBroker {
        broker: Arc::new(b.clone()),
        cleanup: Cleanup::Nats(b, stream),
    })
}

#[cfg(not(feature = "nats"))]
async fn nats(_conn: &Conn, _tag: &str) -> Result<RunBroker, BenchError> {
    Err(BenchError(
        "--broker nats needs the nats feature (on by default)".into(),
    ))
}

#[cfg(feature = "redis")]
async fn redis(conn: &Conn, tag: &str) -> Result<RunBroker, BenchError> {
    use txoutbox_redis_broker::{RedisBroker, RedisBrokerConfig};
    let cfg = RedisBrokerConfig::new(conn.redis_url.clone()).key_prefix(format!("{tag}:"));
    let key = cfg.stream_key("bench", "");
    let b = RedisBroker::connect(cfg)
        .await
        .map_err(|e| BenchError(e.to_string()))?;
    Ok(RunBroker {
        broker: Arc::new(b.clone()),
        cleanup: Cleanup::Redis(b, key),
    })
}

#[cfg(not(feature = "redis"))]
async fn redis(_conn: &Conn, _tag: &str) -> Result<RunBroker, BenchError> {
    Err(BenchError(
        "--broker redis needs the redis feature: cargo build --release -p txoutbox-examples --features redis".into(),
    ))
}
