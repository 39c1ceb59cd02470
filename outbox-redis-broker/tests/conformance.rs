//! Broker trials K-01 to K-06 and the outage trial against the machine's Redis (`REDIS_URL`,
//! default `redis://127.0.0.1:6379`). Each trial uses a fresh key prefix and deletes its keys at
//! the end. An unreachable server fails the trials.

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_conformance::broker::{
    BrokerKind, BrokerTrial, BrokerUnderTest, Received, TrialOptions, fresh_suffix,
};
use outbox_core::{Broker, BrokerError, Message, NewEvent};
use outbox_redis_broker::{RedisBroker, RedisBrokerConfig};
use redis::aio::MultiplexedConnection;

fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

async fn admin() -> MultiplexedConnection {
    redis::Client::open(url())
        .expect("REDIS_URL parses")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("Redis at {} is unreachable: {e}", url()))
}

struct Redis;

struct RedisTrial {
    broker: RedisBroker,
    admin: MultiplexedConnection,
    prefix: String,
}

#[async_trait]
impl BrokerUnderTest for Redis {
    fn kind(&self) -> BrokerKind {
        BrokerKind::Redis
    }

    fn server_addr(&self) -> SocketAddr {
        let u = url();
        let hp = u
            .trim_start_matches("redis://")
            .split('/')
            .next()
            .unwrap_or("")
            .to_owned();
        hp.to_socket_addrs()
            .expect("REDIS_URL resolves")
            .next()
            .expect("an address")
    }

    async fn trial(&self, opts: TrialOptions) -> Box<dyn BrokerTrial> {
        let prefix = format!("outboxtest:{}:", fresh_suffix());
        let admin = admin().await;
        let target = match opts.connect_to {
            Some(a) => format!("redis://{a}"),
            None => url(),
        };
        let cfg = RedisBrokerConfig::new(target)
            .key_prefix(&prefix)
            .timeout(opts.adapter_timeout);
        let broker = RedisBroker::connect(cfg)
            .await
            .expect("connect the adapter");
        Box::new(RedisTrial {
            broker,
            admin,
            prefix,
        })
    }

    async fn unreachable(&self, addr: SocketAddr, adapter_timeout: Duration) -> Arc<dyn Broker> {
        let cfg = RedisBrokerConfig::new(format!("redis://{addr}"))
            .key_prefix("outboxtest:unreachable:")
            .timeout(adapter_timeout)
            .connect_timeout(adapter_timeout);
        Arc::new(RedisBroker::connect_lazy(cfg).expect("a lazy adapter needs no server"))
    }
}

type Entry = (String, Vec<(String, String)>);

async fn xrange(conn: &mut MultiplexedConnection, key: &str) -> Vec<Entry> {
    redis::cmd("XRANGE")
        .arg(key)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await
        .expect("XRANGE")
}

#[async_trait]
impl BrokerTrial for RedisTrial {
    fn broker(&self) -> Arc<dyn Broker> {
        Arc::new(self.broker.clone())
    }

    fn destination(&self, topic: &str) -> String {
        format!("{}{topic}", self.prefix)
    }

    async fn read(&self, topic: &str) -> Vec<Received> {
        let key = self.destination(topic);
        let mut conn = self.admin.clone();
        let exists: bool = redis::cmd("EXISTS")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .expect("EXISTS");
        if !exists {
            return Vec::new();
        }
        xrange(&mut conn, &key)
            .await
            .into_iter()
            .map(|(_id, fields)| {
                let mut attributes = BTreeMap::new();
                let mut body = Vec::new();
                let mut headers = BTreeMap::new();
                for (k, v) in fields {
                    match k.as_str() {
                        "payload" => body = v.into_bytes(),
                        "headers" => {
                            headers = serde_json::from_str(&v)
                                .expect("headers is a JSON object of strings")
                        }
                        _ => {
                            attributes.insert(k, v);
                        }
                    }
                }
                for (k, v) in headers {
                    attributes.entry(k).or_insert(v);
                }
                Received {
                    destination: key.clone(),
                    body,
                    attributes,
                    message_id: None,
                }
            })
            .collect()
    }

    async fn prepare_refusal(&self, topic: &str) -> String {
        let mut conn = self.admin.clone();
        let _: () = redis::cmd("SET")
            .arg(self.destination(topic))
            .arg("a plain string")
            .query_async(&mut conn)
            .await
            .expect("SET");
        "WRONGTYPE".into()
    }

    async fn await_reachable(&self, within: Duration) -> bool {
        // Each PING waits for a real connection attempt of the manager; no sleeping.
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline {
            if self.broker.ping().await.is_ok() {
                return true;
            }
        }
        false
    }

    async fn cleanup(&self) {
        let mut conn = self.admin.clone();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut conn)
            .await
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: Result<(), _> = redis::cmd("DEL").arg(keys).query_async(&mut conn).await;
        }
    }
}

outbox_conformance::broker_suite!(Redis);

fn message(topic: &str, key: &str) -> Message {
    message_with(topic, key, true)
}

fn message_with(topic: &str, key: &str, headers: bool) -> Message {
    let mut b = NewEvent::builder()
        .event_type("t.happened")
        .aggregate("order", uuid::Uuid::now_v7())
        .topic(topic)
        .partition_key(key)
        .payload_json(serde_json::json!({"n": 1}))
        .correlation_id("corr-1");
    if headers {
        b = b.header("tenant", "acme").header("topic", "spoofed");
    }
    let row = b.build().expect("valid").into_row(chrono::Utc::now());
    Message::from_event(&row)
}

/// The fields of one entry: names, order, the `headers` JSON without attribute names, and
/// `headers` absent when the event has none; MAXLEN trims approximately.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_and_maxlen() {
    let prefix = format!("outboxtest:{}:", fresh_suffix());
    let broker = RedisBroker::connect(
        RedisBrokerConfig::new(url())
            .key_prefix(&prefix)
            .max_len(10),
    )
    .await
    .expect("connect");
    let m = message("orders", "k1");
    broker.publish(&m).await.expect("publish");
    let mut conn = admin().await;
    let key = format!("{prefix}orders");
    let entries = xrange(&mut conn, &key).await;
    assert_eq!(entries.len(), 1);
    let names: Vec<&str> = entries[0].1.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "event_id",
            "event_type",
            "topic",
            "partition_key",
            "payload",
            "headers",
            "aggregate_type",
            "aggregate_id",
            "correlation_id"
        ]
    );
    let f: BTreeMap<_, _> = entries[0].1.iter().cloned().collect();
    assert_eq!(f["topic"], "orders", "the attribute wins over the header");
    assert_eq!(f["headers"], r#"{"tenant":"acme"}"#);
    assert_eq!(f["payload"], r#"{"n":1}"#);
    assert_eq!(f["event_id"], m.event_id.hyphenated().to_string());

    // No headers: no headers field.
    broker
        .publish(&message_with("orders", "k1", false))
        .await
        .expect("publish");
    let entries = xrange(&mut conn, &key).await;
    assert!(
        entries[1].1.iter().all(|(k, _)| k != "headers"),
        "{:?}",
        entries[1].1
    );

    // MAXLEN ~ 10: after 300 more entries, far fewer than 302 remain.
    for _ in 0..300 {
        broker.publish(&m).await.expect("publish");
    }
    let len: usize = redis::cmd("XLEN")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("XLEN");
    assert!(
        (10..302).contains(&len),
        "approximate trim keeps about 10 entries, has {len}"
    );
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("DEL");
}

/// The key pattern may hold the partition key: one stream per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_pattern_with_partition_key() {
    let prefix = format!("outboxtest:{}:", fresh_suffix());
    let broker = RedisBroker::connect(
        RedisBrokerConfig::new(url()).key_pattern(format!("{prefix}{{topic}}:{{partition_key}}")),
    )
    .await
    .expect("connect");
    broker
        .publish(&message("orders", "acct-7"))
        .await
        .expect("publish");
    let mut conn = admin().await;
    let key = format!("{prefix}orders:acct-7");
    assert_eq!(xrange(&mut conn, &key).await.len(), 1);
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("DEL");
}

/// A connect to a closed port fails with a message that names the URL; publishing through a
/// lazy adapter there is transient.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_port_errors() {
    let addr = outbox_conformance::broker::closed_port().await;
    let cfg = RedisBrokerConfig::new(format!("redis://{addr}")).timeout(Duration::from_secs(1));
    let err = RedisBroker::connect(cfg.clone())
        .await
        .expect_err("nothing listens");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    let lazy = RedisBroker::connect_lazy(cfg).expect("lazy");
    match lazy.publish(&message("orders", "k")).await {
        Err(BrokerError::Transient(t)) => assert!(t.contains("Redis"), "{t}"),
        other => panic!("expected a transient failure, got {other:?}"),
    }
}
