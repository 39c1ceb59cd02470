//! RabbitMQ broker trials (brokers.md section 4.2): K-08, K-09, K-10, K-12, K-13, K-14, K-17 and
//! K-18's RabbitMQ case, run through the relay against a live broker.
//!
//! The adapter crate implements [`RabbitMqUnderTest`] with a plain AMQP client (queues, basic.get)
//! and invokes [`crate::rabbitmq_suite!`]. Every trial declares fresh queues named
//! `ob.{name}-{r}` and deletes them at the end; the adapter publishes through the default exchange
//! with routing-key prefix `ob.` unless the trial names an exchange.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use txoutbox_core::clock::Clock;
use txoutbox_core::event::Status;
use txoutbox_core::{Broker, Message};
use uuid::Uuid;

use crate::broker::{LoopbackProxy, cycle, event, fresh_suffix, get, relay_for, write_one};

/// The routing-key prefix of every trial's adapter.
pub const PREFIX: &str = "ob.";

/// A queue a trial declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueKind {
    /// A durable classic queue.
    Classic,
    /// A durable quorum queue.
    Quorum,
    /// A classic queue with `x-max-length` 1 and `x-overflow` `reject-publish` (K-13).
    RejectPublishAtOne,
}

/// A header value as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeaderValue {
    /// An AMQP long string, as UTF-8.
    LongString(String),
    /// Any other AMQP type, in the client's debug form.
    Other(String),
}

/// A message read back with basic.get.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AmqpMessage {
    /// The exchange it was published to.
    pub exchange: String,
    /// Its routing key.
    pub routing_key: String,
    /// The body.
    pub body: Vec<u8>,
    /// The delivery_mode property.
    pub delivery_mode: Option<u8>,
    /// The content_type property.
    pub content_type: Option<String>,
    /// The message_id property.
    pub message_id: Option<String>,
    /// The type property.
    pub kind: Option<String>,
    /// The correlation_id property.
    pub correlation_id: Option<String>,
    /// The headers table.
    pub headers: BTreeMap<String, HeaderValue>,
}

impl AmqpMessage {
    /// A header as a long string.
    pub fn header(&self, name: &str) -> Option<&str> {
        match self.headers.get(name) {
            Some(HeaderValue::LongString(s)) => Some(s),
            _ => None,
        }
    }
}

/// How a trial's adapter is built.
#[derive(Debug, Clone)]
pub struct RabbitAdapter {
    /// Where it connects: the broker when `None`, or e.g. a [`LoopbackProxy`].
    pub connect_to: Option<SocketAddr>,
    /// The exchange (`""`: the default exchange).
    pub exchange: String,
    /// Its confirm timeout.
    pub confirm_timeout: Duration,
    /// `Some(source)`: message_format `cloudevents` with this source.
    pub cloudevents_source: Option<String>,
}

impl Default for RabbitAdapter {
    fn default() -> Self {
        Self {
            connect_to: None,
            exchange: String::new(),
            confirm_timeout: Duration::from_secs(5),
            cloudevents_source: None,
        }
    }
}

/// A live RabbitMQ with a plain client beside the adapter.
#[async_trait]
pub trait RabbitMqUnderTest: Send + Sync {
    /// The broker's address (the upstream of a [`LoopbackProxy`]).
    fn server_addr(&self) -> SocketAddr;
    /// Declares a durable queue (deleting one of that name first).
    async fn declare_queue(&self, name: &str, kind: QueueKind);
    /// Deletes a queue.
    async fn delete_queue(&self, name: &str);
    /// Publishes a body to a queue through the default exchange, with a plain client.
    async fn publish_plain(&self, queue: &str, body: &[u8]);
    /// Purges a queue.
    async fn purge(&self, queue: &str);
    /// basic.get (acknowledging what it got).
    async fn get(&self, queue: &str) -> Option<AmqpMessage>;
    /// The adapter, routing-key prefix [`PREFIX`], built without its start check (no broker
    /// needed).
    async fn adapter(&self, opts: &RabbitAdapter) -> Arc<dyn Broker>;
}

fn queue(name: &str, r: &str) -> (String, String) {
    let topic = format!("{name}-{r}");
    (topic.clone(), format!("{PREFIX}{topic}"))
}

async fn drain(b: &dyn RabbitMqUnderTest, q: &str) -> Vec<AmqpMessage> {
    let mut out = Vec::new();
    while let Some(m) = b.get(q).await {
        out.push(m);
    }
    out
}

/// K-08 What the RabbitMQ message carries.
pub async fn k_08(b: &dyn RabbitMqUnderTest) {
    let r = fresh_suffix();
    let (topic, q) = queue("orders", &r);
    b.declare_queue(&q, QueueKind::Classic).await;
    let (repo, _clock) = crate::broker::repo();
    let first = write_one(
        &repo,
        event(&topic, "acct-1", json!({"n": 1}))
            .event_type("order.paid")
            .correlation_id("c-1")
            .header("tenant", "acme")
            .header("event_id", "spoof")
            .build()
            .expect("valid"),
    )
    .await;
    let long_type = "𝔼".repeat(100);
    let second = write_one(
        &repo,
        event(&topic, "acct-2", json!({"n": 2}))
            .event_type(long_type.clone())
            .build()
            .expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, b.adapter(&RabbitAdapter::default()).await)
        .build()
        .expect("relay");
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed.len(), 2, "K-08: both complete: {rep:?}");
    let m1 = b.get(&q).await.expect("K-08: the first message");
    let m2 = b.get(&q).await.expect("K-08: the second message");
    let (m1, m2) = if m1.message_id.as_deref() == Some(&first.id.hyphenated().to_string()) {
        (m1, m2)
    } else {
        (m2, m1)
    };
    let id = first.id.hyphenated().to_string();
    assert_eq!(m1.exchange, "", "K-08: the default exchange");
    assert_eq!(m1.routing_key, q, "K-08: routing key = prefix + topic");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&m1.body).expect("JSON body"),
        json!({"n": 1}),
        "K-08: the body is the payload"
    );
    assert_eq!(m1.delivery_mode, Some(2), "K-08: persistent");
    assert_eq!(m1.content_type.as_deref(), Some("application/json"));
    assert_eq!(m1.message_id.as_deref(), Some(id.as_str()));
    assert_eq!(m1.kind.as_deref(), Some("order.paid"));
    assert_eq!(m1.correlation_id, None, "K-08: no correlation_id property");
    let names: Vec<&str> = m1.headers.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "aggregate_id",
            "aggregate_type",
            "correlation_id",
            "created_at",
            "event_id",
            "event_type",
            "partition_key",
            "tenant",
            "topic"
        ],
        "K-08: exactly these headers"
    );
    assert!(
        m1.headers
            .values()
            .all(|v| matches!(v, HeaderValue::LongString(_))),
        "K-08: all long strings: {:?}",
        m1.headers
    );
    let created = first
        .created_at
        .to_rfc3339_opts(txoutbox_core::broker::CREATED_AT_FORMAT, true);
    for (k, v) in [
        ("event_id", id.as_str()),
        ("event_type", "order.paid"),
        ("topic", topic.as_str()),
        ("partition_key", "acct-1"),
        ("aggregate_type", "test"),
        ("aggregate_id", "00000000-0000-0000-0000-000000000000"),
        ("created_at", created.as_str()),
        ("correlation_id", "c-1"),
        ("tenant", "acme"),
    ] {
        assert_eq!(m1.header(k), Some(v), "K-08: header {k}");
    }
    assert_eq!(
        m2.message_id.as_deref(),
        Some(second.id.hyphenated().to_string().as_str())
    );
    assert_eq!(m2.kind, None, "K-08: a type over 255 bytes is no property");
    assert_eq!(m2.header("event_type"), Some(long_type.as_str()));
    b.delete_queue(&q).await;
}

/// K-09 Per-key order through RabbitMQ: 5 keys × 40 rows, max_per_key 10,
/// publish_concurrency 4, one quorum queue.
pub async fn k_09(b: &dyn RabbitMqUnderTest) {
    let r = fresh_suffix();
    let (topic, q) = queue("orders", &r);
    b.declare_queue(&q, QueueKind::Quorum).await;
    let (repo, _clock) = crate::broker::repo();
    let mut written: HashMap<String, Vec<Uuid>> = HashMap::new();
    for seq in 0..40 {
        for k in 0..5 {
            let key = format!("key-{k}");
            let row = write_one(
                &repo,
                event(&topic, &key, json!({"key": key, "seq": seq}))
                    .build()
                    .expect("valid"),
            )
            .await;
            written.entry(key).or_default().push(row.id);
        }
    }
    let relay = relay_for(&repo, b.adapter(&RabbitAdapter::default()).await)
        .max_per_key(10)
        .publish_concurrency(4)
        .build()
        .expect("relay");
    for cycles in 0.. {
        let rep = cycle(&relay).await;
        assert!(
            rep.counted.is_empty() && rep.transient.is_empty(),
            "K-09: no failure: {rep:?}"
        );
        if rep.fetched.is_empty() {
            break;
        }
        assert!(cycles < 100, "K-09: the drain did not end");
    }
    let got = drain(b, &q).await;
    assert_eq!(got.len(), 200, "K-09: 200 messages");
    let mut seen: HashMap<String, Vec<Uuid>> = HashMap::new();
    for m in &got {
        seen.entry(m.header("partition_key").expect("key").to_owned())
            .or_default()
            .push(Uuid::parse_str(m.message_id.as_deref().expect("id")).expect("uuid"));
    }
    assert_eq!(seen, written, "K-09: per key, queue order = write order");
    b.delete_queue(&q).await;
}

/// K-10 An unreachable RabbitMQ broker is transient: refused, then black-holed, then back.
pub async fn k_10(b: &dyn RabbitMqUnderTest) {
    let r = fresh_suffix();
    let (topic, q) = queue("orders", &r);
    b.declare_queue(&q, QueueKind::Classic).await;
    let proxy = LoopbackProxy::start(b.server_addr()).await;
    proxy.close().await;
    let adapter = b
        .adapter(&RabbitAdapter {
            connect_to: Some(proxy.addr()),
            confirm_timeout: Duration::from_secs(1),
            ..Default::default()
        })
        .await;
    let (repo, clock) = crate::broker::repo();
    let mut ids = Vec::new();
    for k in 0..3 {
        let row = write_one(
            &repo,
            event(&topic, &format!("k{k}"), json!({"k": k}))
                .build()
                .expect("valid"),
        )
        .await;
        ids.push(row.id);
    }
    let relay = relay_for(&repo, adapter)
        .publish_timeout(Duration::from_secs(2))
        // One publish at a time, so that the first transient failure defers the other two.
        .publish_concurrency(1)
        .build()
        .expect("relay");
    for (phase, allow_timeout_text) in [("refused", false), ("black-holed", true)] {
        if phase == "black-holed" {
            proxy.stall();
            proxy.reopen().await;
            clock.advance(Duration::from_millis(1500));
        }
        let started = std::time::Instant::now();
        let rep = cycle(&relay).await;
        let took = started.elapsed();
        eprintln!("K-10 ({phase}): {took:?} {:?}", rep.transient);
        assert!(
            took <= Duration::from_secs(2),
            "K-10 ({phase}): took {took:?}"
        );
        assert!(
            rep.counted.is_empty() && rep.completed.is_empty(),
            "K-10: {rep:?}"
        );
        assert_eq!(
            rep.transient.len(),
            1,
            "K-10 ({phase}): one transient: {rep:?}"
        );
        assert_eq!(
            rep.deferred.len(),
            2,
            "K-10 ({phase}): two deferred: {rep:?}"
        );
        crate::broker::assert_next_try_in_one_second(&rep.transient[0], clock.now());
        let row = get(&repo, rep.transient[0].id).await;
        assert_eq!(row.attempts_made, 0, "K-10: no attempt spent");
        let last = row.last_error.unwrap_or_default();
        assert!(
            last.starts_with("RabbitMQ broker unreachable: ")
                || (allow_timeout_text && last == "Publish timed out after 2.0s"),
            "K-10 ({phase}): last_error {last:?}"
        );
    }
    proxy.resume();
    clock.advance(Duration::from_millis(1500));
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed.len(), 3, "K-10: all three sent: {rep:?}");
    let got = drain(b, &q).await;
    let mut stored: Vec<String> = got.iter().filter_map(|m| m.message_id.clone()).collect();
    stored.sort();
    let mut want: Vec<String> = ids.iter().map(|i| i.hyphenated().to_string()).collect();
    want.sort();
    assert_eq!(stored, want, "K-10: each stored once");
    proxy.shutdown().await;
    b.delete_queue(&q).await;
}

/// K-12 An unroutable RabbitMQ message is counted; a missing exchange is a refusal.
pub async fn k_12(b: &dyn RabbitMqUnderTest) {
    let r = fresh_suffix();
    let (topic, q) = queue("orders", &r);
    b.declare_queue(&q, QueueKind::Classic).await;
    let nowhere = format!("nowhere-{r}");
    let (repo, clock) = crate::broker::repo();
    let a = write_one(
        &repo,
        event(&nowhere, "ka", json!({"n": 1}))
            .build()
            .expect("valid"),
    )
    .await;
    let bb = write_one(
        &repo,
        event(&topic, "kb", json!({"n": 2})).build().expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, b.adapter(&RabbitAdapter::default()).await)
        .publish_concurrency(2)
        .build()
        .expect("relay");
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed, vec![bb.id], "K-12: B completes: {rep:?}");
    assert_eq!(rep.counted.len(), 1, "K-12: A is counted: {rep:?}");
    let row = get(&repo, a.id).await;
    assert_eq!(row.attempts_made, 1);
    assert_eq!(
        row.last_error.as_deref(),
        Some(
            format!(
                "RabbitMQ could not route the message: exchange \"\", routing key \"{PREFIX}{nowhere}\" (312 NO_ROUTE)"
            )
            .as_str()
        ),
        "K-12: last_error"
    );
    let wait = row.scheduled_at - clock.now();
    assert!(
        (chrono::Duration::seconds(5)..=chrono::Duration::seconds(10)).contains(&wait),
        "K-12: next try in [5, 10] s: {wait:?}"
    );

    // Variant: a missing exchange, publish_concurrency 1.
    let (repo, _clock) = crate::broker::repo();
    let c = write_one(
        &repo,
        event(&topic, "kc", json!({"n": 3})).build().expect("valid"),
    )
    .await;
    let d = write_one(
        &repo,
        event(&topic, "kd", json!({"n": 4})).build().expect("valid"),
    )
    .await;
    let adapter = b
        .adapter(&RabbitAdapter {
            exchange: format!("missing-{r}"),
            ..Default::default()
        })
        .await;
    let relay = relay_for(&repo, adapter)
        .publish_concurrency(1)
        .build()
        .expect("relay");
    let rep = cycle(&relay).await;
    assert!(
        rep.transient.is_empty(),
        "K-12 variant: none transient: {rep:?}"
    );
    assert_eq!(rep.counted.len(), 2, "K-12 variant: both counted: {rep:?}");
    for id in [c.id, d.id] {
        let last = get(&repo, id).await.last_error.unwrap_or_default();
        assert!(
            last.starts_with("RabbitMQ refused the message: 404"),
            "K-12 variant: {last:?}"
        );
    }
    b.delete_queue(&q).await;
}

/// K-13 A RabbitMQ nack is transient.
pub async fn k_13(b: &dyn RabbitMqUnderTest) {
    let r = fresh_suffix();
    let (topic, q) = queue("full", &r);
    b.declare_queue(&q, QueueKind::RejectPublishAtOne).await;
    b.publish_plain(&q, b"{}").await;
    let (repo, clock) = crate::broker::repo();
    for k in 0..3 {
        write_one(
            &repo,
            event(&topic, &format!("k{k}"), json!({"k": k}))
                .build()
                .expect("valid"),
        )
        .await;
    }
    let relay = relay_for(&repo, b.adapter(&RabbitAdapter::default()).await)
        // One publish at a time, so that the nack defers the rows after it.
        .publish_concurrency(1)
        .build()
        .expect("relay");
    let rep = cycle(&relay).await;
    assert!(
        rep.counted.is_empty() && rep.completed.is_empty(),
        "K-13: {rep:?}"
    );
    assert_eq!(rep.transient.len(), 1, "K-13: one nacked publish: {rep:?}");
    assert_eq!(rep.deferred.len(), 2, "K-13: two deferred: {rep:?}");
    crate::broker::assert_next_try_in_one_second(&rep.transient[0], clock.now());
    let row = get(&repo, rep.transient[0].id).await;
    assert_eq!(row.attempts_made, 0);
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or_default()
            .starts_with("RabbitMQ did not take the message (basic.nack)"),
        "K-13: {:?}",
        row.last_error
    );
    b.purge(&q).await;
    clock.advance(Duration::from_millis(1500));
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed.len(), 1, "K-13: one completed: {rep:?}");
    assert_eq!(rep.transient.len(), 1, "K-13: the next nacked: {rep:?}");
    assert_eq!(rep.deferred.len(), 1, "K-13: the third deferred: {rep:?}");
    assert!(rep.counted.is_empty());
    assert!(
        repo.rows().iter().all(|r| r.attempts_made == 0),
        "K-13: nothing counted"
    );
    b.delete_queue(&q).await;
}

/// K-14 Success means stored on RabbitMQ (a quorum queue).
pub async fn k_14(b: &dyn RabbitMqUnderTest) {
    let r = fresh_suffix();
    let (topic, q) = queue("orders", &r);
    b.declare_queue(&q, QueueKind::Quorum).await;
    let (repo, _clock) = crate::broker::repo();
    let row = write_one(
        &repo,
        event(&topic, "k", json!({"n": 14})).build().expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, b.adapter(&RabbitAdapter::default()).await)
        .build()
        .expect("relay");
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed, vec![row.id], "K-14: completed");
    let m = b.get(&q).await.expect("K-14: the message is already there");
    assert_eq!(m.message_id, Some(row.id.hyphenated().to_string()));
    b.delete_queue(&q).await;
}

/// K-17 A republished event on RabbitMQ: two messages with the same message_id.
pub async fn k_17(b: &dyn RabbitMqUnderTest) {
    let r = fresh_suffix();
    let (topic, q) = queue("orders", &r);
    b.declare_queue(&q, QueueKind::Quorum).await;
    let row = event(&topic, "k", json!({"n": 17}))
        .build()
        .expect("valid")
        .into_row(chrono::Utc::now());
    let m = Message::from_event(&row);
    let adapter = b.adapter(&RabbitAdapter::default()).await;
    adapter.publish(&m).await.expect("K-17: first publish");
    adapter.publish(&m).await.expect("K-17: second publish");
    let got = drain(b, &q).await;
    let id = row.id.hyphenated().to_string();
    assert_eq!(got.len(), 2, "K-17: two messages");
    assert!(
        got.iter()
            .all(|m| m.message_id.as_deref() == Some(id.as_str()))
    );
    b.delete_queue(&q).await;
}

/// K-18 CloudEvents binary mode, RabbitMQ case.
pub async fn k_18(b: &dyn RabbitMqUnderTest) {
    let r = fresh_suffix();
    let (topic, q) = queue("orders", &r);
    b.declare_queue(&q, QueueKind::Classic).await;
    let t = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    let (repo, _clock) = crate::broker::repo();
    let row = write_one(
        &repo,
        event(&topic, "acct 1", json!({"n": 18}))
            .event_type("order créé")
            .correlation_id("c-1")
            .header("tenant", "acme")
            .header("ce_id", "spoof")
            .header("traceparent", t)
            .build()
            .expect("valid"),
    )
    .await;
    let adapter = b
        .adapter(&RabbitAdapter {
            cloudevents_source: Some("/orders-service".into()),
            ..Default::default()
        })
        .await;
    let relay = relay_for(&repo, adapter).build().expect("relay");
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed, vec![row.id], "K-18: completed: {rep:?}");
    let m = b.get(&q).await.expect("K-18: the message");
    let id = row.id.hyphenated().to_string();
    let time = row
        .created_at
        .to_rfc3339_opts(txoutbox_core::broker::CREATED_AT_FORMAT, true);
    // Everything of the plain message.
    assert_eq!(m.message_id.as_deref(), Some(id.as_str()));
    assert_eq!(m.content_type.as_deref(), Some("application/json"));
    assert_eq!(m.header("event_id"), Some(id.as_str()));
    assert_eq!(m.header("tenant"), Some("acme"));
    assert_eq!(
        m.header("traceparent"),
        Some(t),
        "K-18: the event's traceparent"
    );
    assert_eq!(
        m.header("ce_id"),
        Some("spoof"),
        "K-18: not an AMQP attribute header"
    );
    // The AMQP binding's attributes.
    for (k, v) in [
        ("cloudEvents_specversion", "1.0"),
        ("cloudEvents_id", id.as_str()),
        ("cloudEvents_source", "/orders-service"),
        ("cloudEvents_type", "order créé"),
        ("cloudEvents_time", time.as_str()),
        ("cloudEvents_partitionkey", "acct 1"),
        ("cloudEvents_correlationid", "c-1"),
    ] {
        assert_eq!(m.header(k), Some(v), "K-18: {k}");
    }
    assert!(!m.headers.contains_key("cloudEvents_causationid"));
    assert!(!m.headers.contains_key("cloudEvents_traceparent"));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&m.body).expect("JSON"),
        json!({"n": 18}),
        "K-18: the body is the payload"
    );
    assert_eq!(get(&repo, row.id).await.status, Status::Completed);
    b.delete_queue(&q).await;
}

/// Generates one `#[tokio::test]` per RabbitMQ trial (`k_08` … `k_18`). `$b` is an expression
/// evaluated per test whose value implements [`RabbitMqUnderTest`].
#[macro_export]
macro_rules! rabbitmq_suite {
    ($b:expr) => {
        $crate::rabbitmq_suite!(@tests $b; k_08, k_09, k_10, k_12, k_13, k_14, k_17, k_18);
    };
    (@tests $b:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let b = $b;
                $crate::rabbitmq::$name(&b).await;
            }
        )*
    };
}
