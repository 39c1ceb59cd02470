//! The RabbitMQ broker under test, shared by the test files of this crate: the broker at
//! `AMQP_URL` (default `amqp://guest:guest@127.0.0.1:5672/%2f`), with a plain lapin client for
//! queues and basic.get.
#![allow(dead_code)]

pub use std::net::{SocketAddr, ToSocketAddrs};
pub use std::sync::Arc;
pub use std::time::Duration;

pub use async_trait::async_trait;
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
pub use txoutbox_conformance::broker::{
    BrokerKind, BrokerTrial, BrokerUnderTest, Received, TrialOptions, fresh_suffix,
};
use txoutbox_conformance::rabbitmq::{
    AmqpMessage, HeaderValue, QueueKind, RabbitAdapter, RabbitMqUnderTest,
};
pub use txoutbox_core::Broker;
pub use txoutbox_rabbitmq_broker::{MessageFormat, RabbitMqBroker, RabbitMqBrokerConfig};

pub fn url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

/// The same URL pointed at another address (a proxy or a closed port).
pub fn url_at(addr: SocketAddr) -> String {
    let u = url();
    let (scheme, rest) = u.split_once("://").expect("scheme");
    let (userinfo, after) = match rest.rsplit_once('@') {
        Some((ui, a)) => (format!("{ui}@"), a),
        None => (String::new(), rest),
    };
    let path = after.find('/').map_or("", |i| &after[i..]);
    format!("{scheme}://{userinfo}{addr}{path}")
}

pub fn server_addr() -> SocketAddr {
    let u = url();
    let rest = u.split_once("://").expect("scheme").1;
    let host = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let host = host.split('/').next().expect("host");
    host.to_socket_addrs()
        .expect("AMQP_URL resolves")
        .next()
        .expect("an address")
}

pub async fn channel() -> Channel {
    let c = Connection::connect(&url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {} is unreachable: {e}", url()));
    c.create_channel().await.expect("channel")
}

pub async fn declare_queue(name: &str, kind: QueueKind) {
    let ch = channel().await;
    let _ = ch
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await;
    let mut args = FieldTable::default();
    match kind {
        QueueKind::Classic => {}
        QueueKind::Quorum => {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        QueueKind::RejectPublishAtOne => {
            args.insert("x-max-length".into(), AMQPValue::LongLongInt(1));
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
        }
    }
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap_or_else(|e| panic!("declare queue {name}: {e}"));
}

pub async fn delete_queue(name: &str) {
    let _ = channel()
        .await
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await;
}

fn header_value(v: &AMQPValue) -> HeaderValue {
    match v {
        AMQPValue::LongString(s) => {
            HeaderValue::LongString(String::from_utf8(s.as_bytes().to_vec()).expect("UTF-8"))
        }
        other => HeaderValue::Other(format!("{other:?}")),
    }
}

pub async fn basic_get(queue: &str) -> Option<AmqpMessage> {
    let ch = channel().await;
    let got = ch
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .expect("basic.get")?;
    let d = &got.delivery;
    let p = &d.properties;
    let headers = p
        .headers()
        .as_ref()
        .map(|t| {
            t.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), header_value(v)))
                .collect()
        })
        .unwrap_or_default();
    Some(AmqpMessage {
        exchange: d.exchange.to_string(),
        routing_key: d.routing_key.to_string(),
        body: d.data.clone(),
        delivery_mode: *p.delivery_mode(),
        content_type: p.content_type().as_ref().map(|s| s.to_string()),
        message_id: p.message_id().as_ref().map(|s| s.to_string()),
        kind: p.kind().as_ref().map(|s| s.to_string()),
        correlation_id: p.correlation_id().as_ref().map(|s| s.to_string()),
        headers,
    })
}

fn adapter_config(target: String, confirm: Duration) -> RabbitMqBrokerConfig {
    RabbitMqBrokerConfig::new(target)
        .confirm_timeout(confirm)
        .connect_timeout(confirm.min(Duration::from_secs(2)))
}

/// The broker under test.
pub struct Rabbit;

#[async_trait]
impl RabbitMqUnderTest for Rabbit {
    fn server_addr(&self) -> SocketAddr {
        server_addr()
    }

    async fn declare_queue(&self, name: &str, kind: QueueKind) {
        declare_queue(name, kind).await
    }

    async fn delete_queue(&self, name: &str) {
        delete_queue(name).await
    }

    async fn publish_plain(&self, queue: &str, body: &[u8]) {
        let ch = channel().await;
        ch.basic_publish(
            "".into(),
            queue.into(),
            BasicPublishOptions::default(),
            body,
            BasicProperties::default(),
        )
        .await
        .expect("publish");
    }

    async fn purge(&self, queue: &str) {
        channel()
            .await
            .queue_purge(queue.into(), QueuePurgeOptions::default())
            .await
            .expect("purge");
    }

    async fn get(&self, queue: &str) -> Option<AmqpMessage> {
        basic_get(queue).await
    }

    async fn adapter(&self, o: &RabbitAdapter) -> Arc<dyn Broker> {
        let target = o.connect_to.map_or_else(url, url_at);
        let mut cfg = adapter_config(target, o.confirm_timeout)
            .exchange(o.exchange.clone())
            .routing_key_prefix(txoutbox_conformance::rabbitmq::PREFIX);
        if let Some(s) = &o.cloudevents_source {
            cfg = cfg
                .message_format(MessageFormat::CloudEvents)
                .cloudevents_source(s.clone());
        }
        Arc::new(RabbitMqBroker::connect_lazy(cfg).expect("valid configuration"))
    }
}

struct RabbitTrial {
    broker: RabbitMqBroker,
    config: RabbitMqBrokerConfig,
    prefix: String,
}

#[async_trait]
impl BrokerUnderTest for Rabbit {
    fn kind(&self) -> BrokerKind {
        BrokerKind::RabbitMq
    }

    fn server_addr(&self) -> SocketAddr {
        server_addr()
    }

    async fn trial(&self, opts: TrialOptions) -> Box<dyn BrokerTrial> {
        let prefix = format!("outboxtest.{}.", fresh_suffix());
        declare_queue(&format!("{prefix}orders"), QueueKind::Classic).await;
        let target = opts.connect_to.map_or_else(url, url_at);
        let cfg = adapter_config(target, opts.adapter_timeout).routing_key_prefix(&prefix);
        let broker = RabbitMqBroker::connect(cfg.clone())
            .await
            .expect("connect the adapter");
        Box::new(RabbitTrial {
            broker,
            config: cfg,
            prefix,
        })
    }

    async fn unreachable(&self, addr: SocketAddr, adapter_timeout: Duration) -> Arc<dyn Broker> {
        Arc::new(
            RabbitMqBroker::connect_lazy(adapter_config(url_at(addr), adapter_timeout))
                .expect("a lazy adapter needs no broker"),
        )
    }
}

#[async_trait]
impl BrokerTrial for RabbitTrial {
    fn broker(&self) -> Arc<dyn Broker> {
        Arc::new(self.broker.clone())
    }

    async fn another_adapter(&self) -> Arc<dyn Broker> {
        Arc::new(
            RabbitMqBroker::connect(self.config.clone())
                .await
                .expect("connect"),
        )
    }

    fn destination(&self, topic: &str) -> String {
        format!("{}{topic}", self.prefix)
    }

    async fn read(&self, topic: &str) -> Vec<Received> {
        let q = self.destination(topic);
        let mut out = Vec::new();
        while let Some(m) = basic_get(&q).await {
            out.push(Received {
                destination: m.routing_key.clone(),
                attributes: m
                    .headers
                    .iter()
                    .filter_map(|(k, v)| match v {
                        HeaderValue::LongString(s) => Some((k.clone(), s.clone())),
                        HeaderValue::Other(_) => None,
                    })
                    .collect(),
                message_id: m.message_id.clone(),
                body: m.body,
            });
        }
        out
    }

    /// RabbitMQ refuses nothing by size below 16 MiB; the refusal of this trial is an
    /// unroutable message (its queue deleted): NO_ROUTE, counted (R90).
    async fn prepare_refusal(&self, topic: &str) -> String {
        delete_queue(&self.destination(topic)).await;
        "(312 NO_ROUTE)".into()
    }

    async fn await_reachable(&self, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline {
            if self.broker.probe().await == txoutbox_core::broker::Probe::Up {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    async fn cleanup(&self) {
        delete_queue(&self.destination("orders")).await;
    }
}
