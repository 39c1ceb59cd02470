//! The Redis broker under test, shared by the test files of this crate.
#![allow(dead_code)]

pub use std::collections::BTreeMap;
pub use std::net::{SocketAddr, ToSocketAddrs};
pub use std::sync::Arc;
pub use std::time::Duration;

pub use async_trait::async_trait;
pub use redis::aio::MultiplexedConnection;
pub use txoutbox_conformance::broker::{
    BrokerKind, BrokerTrial, BrokerUnderTest, Received, TrialOptions, fresh_suffix,
};
pub use txoutbox_core::Broker;
pub use txoutbox_redis_broker::{RedisBroker, RedisBrokerConfig};

pub fn url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

pub async fn admin() -> MultiplexedConnection {
    redis::Client::open(url())
        .expect("REDIS_URL parses")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("Redis at {} is unreachable: {e}", url()))
}

pub struct Redis;

struct RedisTrial {
    broker: RedisBroker,
    config: RedisBrokerConfig,
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
        let broker = RedisBroker::connect(cfg.clone())
            .await
            .expect("connect the adapter");
        Box::new(RedisTrial {
            broker,
            config: cfg,
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

pub type Entry = (String, Vec<(String, String)>);

pub async fn xrange(conn: &mut MultiplexedConnection, key: &str) -> Vec<Entry> {
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

    async fn another_adapter(&self) -> Arc<dyn Broker> {
        Arc::new(
            RedisBroker::connect(self.config.clone())
                .await
                .expect("connect another adapter"),
        )
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
