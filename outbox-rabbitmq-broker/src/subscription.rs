//! The inbox's RabbitMQ subscription (brokers.md R177, R178, R137's RabbitMQ column, R140).
//!
//! [`RabbitSubscription`] consumes one or more existing queues, each with one consumer on a
//! channel of its own, with manual acknowledgements and a per-consumer prefetch. It declares and
//! binds nothing: a queue that does not exist fails the start with `RabbitMQ queue {q:?} does not
//! exist` (a passive declare). The group is the queue: runners of one group consume the same
//! queue and RabbitMQ hands each message to one of them.
//!
//! The operations of a delivery (R178):
//!
//! | operation | AMQP 0-9-1 |
//! |---|---|
//! | commit | basic.ack, confirmed once written on the open channel (AMQP does not answer it) |
//! | rewind(d), d > 0 | the delivery is held unacknowledged for d (at most `hold_max`), then basic.reject with requeue |
//! | rewind(0) | basic.nack with requeue at once: the runner gives back unstarted deliveries this way at a stop (R167), which RabbitMQ 4.3 and later do not count |
//! | term(reason) | `dead_letter` = `copy`: basic.ack (after the copy); `broker`: basic.reject without requeue |
//! | renew | nothing: a delivery stays with its consumer until its channel closes |
//! | dead-letter copy | `copy`: a persistent publish to `dead_letter_exchange` with routing key `dead_letter_routing_key` (default `{queue}.dead-letter`) carrying R140's headers, mandatory and confirmed; `broker`: nothing |
//!
//! n is `x-delivery-count` + 1 when the header is there (a quorum queue counts failed deliveries
//! in it); without it, on a quorum queue n = 1, and on a classic queue n = 1 when the redelivered
//! flag is clear, else the larger of 2 and 1 + the rewinds of that message id this subscription
//! counted (a lower bound). With `delivery_limit` set (the queue's `x-delivery-limit`), a delivery
//! with n ≥ delivery_limit is the last (R182); one still unended after hold_max is returned with
//! basic.nack with requeue (R178). A closed subscription gives the deliveries it
//! received but did not hand over back with basic.nack with requeue, and returns held rewinds at
//! once with basic.reject with requeue.
//!
//! Checked by J-23 to J-30 and J-33 and the shared broker trials in this crate's
//! `tests/inbox.rs`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, BasicRejectOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use txoutbox_core::inbox::decode::{AmqpValue, BrokerMessage};
use txoutbox_core::inbox::subscription::{
    RunnerSettings, SubscriptionCapabilities, SubscriptionError,
};
use txoutbox_core::inbox::transport::{
    DeadLetter, Received, Transport, TransportCapabilities, TransportSubscription,
};

use crate::config::RabbitMqBrokerConfig;
use crate::error::RabbitMqBrokerError;

/// The longest hold of a rewound delivery (R178).
pub const DEFAULT_HOLD_MAX: Duration = Duration::from_secs(900);
/// RabbitMQ's default consumer timeout; hold_max must stay below it (R178).
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// The runner's default concurrency, which the default prefetch doubles (R166, R177).
pub const DEFAULT_CONCURRENCY: usize = 16;
/// The suffix of the default dead-letter routing key (R140).
pub const DEAD_LETTER_SUFFIX: &str = ".dead-letter";
/// The reply code of a passive declare of a queue that does not exist.
const NOT_FOUND: u16 = 404;

/// The kind of the consumed queues, which decides how n is read (R178).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// Quorum queues (the ones to use, R177): n = `x-delivery-count` + 1, 1 without it.
    #[default]
    Quorum,
    /// Classic queues: n from the redelivered flag and the rewinds this runner counted.
    Classic,
}

/// Where an invalid delivery's dead letter goes (R140, R178).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeadLetterMode {
    /// A confirmed copy with R140's headers, then basic.ack (default).
    #[default]
    Copy,
    /// No copy: basic.reject without requeue, leaving the dead letter to the queue's own
    /// dead-letter exchange (without the reason).
    Broker,
}

/// Settings of a [`RabbitSubscription`].
#[derive(Debug, Clone)]
pub struct RabbitSubscriptionConfig {
    connection: RabbitMqBrokerConfig,
    group: String,
    queues: Vec<String>,
    routing_key_prefix: String,
    concurrency: usize,
    prefetch: Option<u16>,
    queue_type: QueueType,
    hold_max: Duration,
    delivery_limit: Option<u32>,
    max_attempts: u32,
    dead_letter: DeadLetterMode,
    dead_letter_exchange: String,
    dead_letter_routing_key: Option<String>,
}

impl RabbitSubscriptionConfig {
    /// Consumes `queues` for consumer group `group`, connecting as `connection` says (its URI,
    /// TLS, connect timeout, connection name, and its confirm timeout for dead-letter copies;
    /// its exchange and routing-key prefix are the outbox's and are not used here).
    pub fn new<S: Into<String>>(
        connection: RabbitMqBrokerConfig,
        group: impl Into<String>,
        queues: impl IntoIterator<Item = S>,
    ) -> Self {
        Self {
            connection,
            group: group.into(),
            queues: queues.into_iter().map(Into::into).collect(),
            routing_key_prefix: String::new(),
            concurrency: DEFAULT_CONCURRENCY,
            prefetch: None,
            queue_type: QueueType::Quorum,
            hold_max: DEFAULT_HOLD_MAX,
            delivery_limit: None,
            max_attempts: 6,
            dead_letter: DeadLetterMode::Copy,
            dead_letter_exchange: String::new(),
            dead_letter_routing_key: None,
        }
    }

    /// The routing-key prefix the topics are published under (R89), e.g. `in.`; a message
    /// without a source header gets its routing key without it as source (R137).
    pub fn routing_key_prefix(mut self, p: impl Into<String>) -> Self {
        self.routing_key_prefix = p.into();
        self
    }

    /// The runner's concurrency (default 16): the default prefetch is twice it, and a prefetch
    /// below it is refused (R177).
    pub fn concurrency(mut self, c: usize) -> Self {
        self.concurrency = c;
        self
    }

    /// The per-consumer prefetch (default 2 × concurrency, R177).
    pub fn prefetch(mut self, p: u16) -> Self {
        self.prefetch = Some(p);
        self
    }

    /// The kind of the queues (default quorum), which decides how n is read (R178).
    pub fn queue_type(mut self, t: QueueType) -> Self {
        self.queue_type = t;
        self
    }

    /// The longest hold of a rewound delivery (default 900 s; above zero and below RabbitMQ's
    /// default consumer timeout of 30 minutes, R178).
    pub fn hold_max(mut self, d: Duration) -> Self {
        self.hold_max = d;
        self
    }

    /// The queues' delivery limit (`x-delivery-limit` of a quorum queue): a delivery with
    /// n ≥ it is the last (R178, R182). It must be at least max_attempts.
    pub fn delivery_limit(mut self, l: u32) -> Self {
        self.delivery_limit = Some(l);
        self
    }

    /// The runner's max_attempts (default 6), checked against delivery_limit (R178).
    pub fn max_attempts(mut self, m: u32) -> Self {
        self.max_attempts = m;
        self
    }

    /// Where dead letters go (default [`DeadLetterMode::Copy`], R140).
    pub fn dead_letter(mut self, m: DeadLetterMode) -> Self {
        self.dead_letter = m;
        self
    }

    /// The exchange dead-letter copies are published to (default `""`, the default exchange).
    pub fn dead_letter_exchange(mut self, x: impl Into<String>) -> Self {
        self.dead_letter_exchange = x.into();
        self
    }

    /// The routing key of dead-letter copies (default `{queue}.dead-letter`).
    pub fn dead_letter_routing_key(mut self, k: impl Into<String>) -> Self {
        self.dead_letter_routing_key = Some(k.into());
        self
    }

    /// The prefetch used: the configured one, else 2 × concurrency (at most 65,535).
    pub fn prefetch_value(&self) -> u16 {
        self.prefetch.unwrap_or_else(|| {
            u16::try_from(self.concurrency.saturating_mul(2)).unwrap_or(u16::MAX)
        })
    }

    /// Checks the settings (R177, R178).
    pub fn validate(&self) -> Result<(), RabbitMqBrokerError> {
        let bad = |m: String| Err(RabbitMqBrokerError::Config(m));
        self.connection.validate()?;
        if self.group.trim().is_empty() {
            return bad("the subscription's consumer group must not be empty".into());
        }
        if self.queues.is_empty() || self.queues.iter().any(|q| q.trim().is_empty()) {
            return bad("the subscription needs at least one queue, none of them empty".into());
        }
        if self.concurrency == 0 {
            return bad("concurrency must be at least 1".into());
        }
        let p = self.prefetch_value();
        if usize::from(p) < self.concurrency {
            return bad(format!(
                "prefetch ({p}) is below concurrency ({})",
                self.concurrency
            ));
        }
        if self.hold_max.is_zero() || self.hold_max >= DEFAULT_CONSUMER_TIMEOUT {
            return bad(format!(
                "hold_max ({:?}) must be above zero and below RabbitMQ's consumer timeout (30 minutes)",
                self.hold_max
            ));
        }
        if let Some(l) = self.delivery_limit
            && l < self.max_attempts
        {
            return bad(format!(
                "delivery_limit ({l}) is below max_attempts ({})",
                self.max_attempts
            ));
        }
        Ok(())
    }
}

/// One consumer: its queue, channel and tag.
struct Consumer {
    queue: String,
    channel: Channel,
    tag: ShortString,
}

/// One delivery as a consumer received it.
struct Arrived {
    queue: String,
    delivery: lapin::message::Delivery,
}

/// One delivery as read: its queue, the id its rewinds are counted under, and a token
/// cancelled when the runner ends it (which ends a last delivery's hold_max bound).
pub struct RabbitDelivery {
    queue: String,
    id_key: Option<String>,
    delivery: lapin::message::Delivery,
    ended: CancellationToken,
}

/// The RabbitMQ half of the inbox's subscription ([`Transport`]): one consumer per queue, each
/// on a channel of its own. Reached through [`RabbitSubscription`].
pub struct RabbitTransport {
    config: RabbitSubscriptionConfig,
    /// Rewinds counted per message id, for n on classic queues (R178).
    rewinds: std::sync::Mutex<HashMap<String, u32>>,
    /// Cancelled at close and on drop: the readers and the last deliveries' bounds end.
    closing: CancellationToken,
    /// The confirm channel of dead-letter copies, opened on first use.
    publisher: tokio::sync::Mutex<Option<Channel>>,
    connection: tokio::sync::Mutex<Option<Arc<Connection>>>,
    consumers: tokio::sync::Mutex<Vec<Consumer>>,
    /// What the consumers received (the prefetch bounds it), until a read takes it.
    rx: tokio::sync::Mutex<mpsc::UnboundedReceiver<Arrived>>,
    tx: mpsc::UnboundedSender<Arrived>,
    /// Reader tasks alive; none means the consumers must be opened again.
    readers: Arc<std::sync::atomic::AtomicUsize>,
    reading_stopped: AtomicBool,
    closed: AtomicBool,
}

impl Drop for RabbitTransport {
    /// A dropped subscription (a killed runner) ends its readers without a word to the broker;
    /// the connection closes with them and RabbitMQ returns what it held (R178).
    fn drop(&mut self) {
        self.closing.cancel();
    }
}

txoutbox_core::transport_subscription! {
    /// The inbox's subscription on RabbitMQ queues (R177, R178): the generic subscription over
    /// [`RabbitTransport`], which holds rewound deliveries in the process, at most the runner's
    /// concurrency at once (R136's bound). Cloning shares it.
    pub struct RabbitSubscription(RabbitTransport);
}

fn transient(what: &str, e: impl std::fmt::Display) -> SubscriptionError {
    txoutbox_core::inbox::transport::transient(
        "RabbitMQ",
        what,
        txoutbox_core::redact::secrets(&e.to_string()),
    )
}

impl RabbitSubscription {
    /// Checks the settings, connects, checks that every queue exists, and starts one consumer
    /// per queue (R177). Fails with `RabbitMQ queue {q:?} does not exist` for a missing queue.
    pub async fn start(config: RabbitSubscriptionConfig) -> Result<Self, RabbitMqBrokerError> {
        config.validate()?;
        let (tx, rx) = mpsc::unbounded_channel();
        let t = RabbitTransport {
            config,
            rewinds: std::sync::Mutex::default(),
            closing: CancellationToken::new(),
            publisher: tokio::sync::Mutex::new(None),
            connection: tokio::sync::Mutex::new(None),
            consumers: tokio::sync::Mutex::new(Vec::new()),
            rx: tokio::sync::Mutex::new(rx),
            tx,
            readers: Arc::default(),
            reading_stopped: AtomicBool::new(false),
            closed: AtomicBool::new(false),
        };
        t.consume().await?;
        Ok(Self(TransportSubscription::new(t)))
    }

    /// The settings.
    pub fn config(&self) -> &RabbitSubscriptionConfig {
        &self.transport().config
    }
}

impl RabbitTransport {
    /// Opens a connection and one consumer per queue.
    async fn consume(&self) -> Result<(), RabbitMqBrokerError> {
        let cfg = &self.config;
        let uri = txoutbox_core::redact::secrets(&cfg.connection.uri);
        let connect_err = |message: String| RabbitMqBrokerError::Connect {
            uri: uri.clone(),
            message,
        };
        let conn =
            tokio::time::timeout(cfg.connection.connect_timeout, crate::open(&cfg.connection))
                .await
                .map_err(|_| connect_err("no connection within the connect timeout".into()))?
                .map_err(connect_err)?;
        let conn = Arc::new(conn);
        let channel_err =
            |e: lapin::Error| connect_err(txoutbox_core::redact::secrets(&e.to_string()));
        let mut consumers = Vec::new();
        for q in &cfg.queues {
            let ch = conn.create_channel().await.map_err(channel_err)?;
            let passive = QueueDeclareOptions {
                passive: true,
                ..Default::default()
            };
            if let Err(e) = ch
                .queue_declare(q.as_str().into(), passive, FieldTable::default())
                .await
            {
                let _ = conn.close(200, "start check failed".into()).await;
                return Err(match e.kind() {
                    lapin::ErrorKind::ProtocolError(a) if a.get_id() == NOT_FOUND => {
                        RabbitMqBrokerError::NoQueue { queue: q.clone() }
                    }
                    _ => channel_err(e),
                });
            }
            ch.basic_qos(cfg.prefetch_value(), BasicQosOptions { global: false })
                .await
                .map_err(channel_err)?;
            let consumer = ch
                .basic_consume(
                    q.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(channel_err)?;
            consumers.push(Consumer {
                queue: q.clone(),
                channel: ch,
                tag: consumer.tag(),
            });
            self.spawn_reader(q.clone(), consumer);
        }
        *self.consumers.lock().await = consumers;
        *self.publisher.lock().await = None;
        *self.connection.lock().await = Some(conn);
        tracing::info!(queues = ?cfg.queues, prefetch = cfg.prefetch_value(), "RabbitMQ inbox subscription consuming");
        Ok(())
    }

    /// A task that moves one consumer's deliveries into the channel until the consumer ends or
    /// the subscription closes. The prefetch bounds what it can hold.
    fn spawn_reader(&self, queue: String, mut consumer: lapin::Consumer) {
        let tx = self.tx.clone();
        let readers = self.readers.clone();
        let closing = self.closing.clone();
        readers.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = closing.cancelled() => break,
                    d = consumer.next() => match d {
                        Some(Ok(delivery)) => {
                            if tx.send(Arrived { queue: queue.clone(), delivery }).is_err() {
                                break;
                            }
                        }
                        Some(Err(e)) => {
                            tracing::warn!(queue, error = %e, "RabbitMQ consumer failed");
                            break;
                        }
                        None => break,
                    }
                }
            }
            readers.fetch_sub(1, Ordering::SeqCst);
        });
    }

    /// The headers of a delivery, typed as R141 reads them.
    fn headers(d: &lapin::message::Delivery) -> Vec<(String, AmqpValue)> {
        d.properties
            .headers()
            .as_ref()
            .map(|t| {
                t.inner()
                    .iter()
                    .map(|(k, v)| (k.to_string(), amqp_value(v)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// n (R178): `x-delivery-count` + 1; else 1 on a quorum queue; on a classic queue 1 when
    /// the redelivered flag is clear, else the larger of 2 and 1 + the rewinds counted.
    fn delivery_number(&self, m: &RabbitDelivery, headers: &[(String, AmqpValue)]) -> u32 {
        let count = headers.iter().find_map(|(k, v)| match v {
            AmqpValue::Integer(i) if k == "x-delivery-count" => Some(*i),
            _ => None,
        });
        match (count, self.config.queue_type) {
            (Some(c), _) => u32::try_from(c.max(0)).unwrap_or(u32::MAX - 1) + 1,
            (None, QueueType::Quorum) => 1,
            (None, QueueType::Classic) if !m.delivery.redelivered => 1,
            (None, QueueType::Classic) => {
                let counted = m
                    .id_key
                    .as_ref()
                    .and_then(|k| self.rewinds.lock().expect("rewinds").get(k).copied())
                    .unwrap_or(0);
                2.max(1 + counted)
            }
        }
    }

    /// A delivery as read; a last delivery gets its hold_max bound.
    fn arrived(&self, a: Arrived) -> RabbitDelivery {
        let headers = Self::headers(&a.delivery);
        let property = a
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string());
        let m = RabbitDelivery {
            queue: a.queue,
            id_key: id_key(&headers, property.as_deref()),
            delivery: a.delivery,
            ended: CancellationToken::new(),
        };
        let n = self.delivery_number(&m, &headers);
        if self.config.delivery_limit.is_some_and(|l| n >= l) {
            self.bound_last_delivery(&m);
        }
        m
    }

    /// R178: a last delivery is kept and tried again in place (R182) for at most hold_max, well
    /// within the consumer timeout; then it is returned with basic.nack with requeue (not counted
    /// from RabbitMQ 4.3), so that it comes back, again as the last delivery. The runner's later
    /// end of it then fails (commit_failed) and the delivery that comes back is a duplicate or
    /// is landed.
    fn bound_last_delivery(&self, m: &RabbitDelivery) {
        let acker = m.delivery.acker.clone();
        let closing = self.closing.clone();
        let ended = m.ended.clone();
        let hold_max = self.config.hold_max;
        tokio::spawn(async move {
            tokio::select! {
                _ = ended.cancelled() => {}
                _ = closing.cancelled() => {}
                _ = tokio::time::sleep(hold_max) => {
                    let nack = BasicNackOptions { multiple: false, requeue: true };
                    if let Ok(true) = acker.nack(nack).await {
                        tracing::warn!(?hold_max, "a last delivery still unended after hold_max is returned to RabbitMQ (basic.nack)");
                    }
                }
            }
        });
    }

    fn forget_rewinds(&self, m: &RabbitDelivery) {
        if let Some(k) = &m.id_key {
            self.rewinds.lock().expect("rewinds").remove(k);
        }
    }

    fn ended(r: Result<bool, lapin::Error>, what: &str) -> Result<(), SubscriptionError> {
        match r {
            Ok(true) => Ok(()),
            Ok(false) => Err(SubscriptionError::transient(format!(
                "RabbitMQ: {what} was not sent: the channel closed first (RabbitMQ delivers the message again) or the delivery was already ended"
            ))),
            Err(e) => Err(transient(what, e)),
        }
    }

    /// d = 0: basic.nack with requeue (a give-back, R167, not counted from RabbitMQ 4.3);
    /// d > 0: the rewind is counted (classic queues' n) and the delivery returned with
    /// basic.reject with requeue.
    async fn requeue(&self, m: &RabbitDelivery, delay: Duration) -> Result<(), SubscriptionError> {
        m.ended.cancel();
        if delay.is_zero() {
            let nack = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            return Self::ended(m.delivery.acker.nack(nack).await, "basic.nack");
        }
        if let Some(k) = &m.id_key {
            let mut counted = self.rewinds.lock().expect("rewinds");
            if counted.len() >= MAX_COUNTED_REWINDS && !counted.contains_key(k) {
                counted.clear();
            }
            *counted.entry(k.clone()).or_default() += 1;
        }
        let requeue = BasicRejectOptions { requeue: true };
        Self::ended(m.delivery.acker.reject(requeue).await, "basic.reject")
    }
}

/// At most this many message ids with counted rewinds are remembered (classic queues' n is a
/// lower bound anyway, R178).
const MAX_COUNTED_REWINDS: usize = 10_000;

/// The id this subscription counts rewinds under: what R137 reads as message_id.
fn id_key(headers: &[(String, AmqpValue)], property: Option<&str>) -> Option<String> {
    let text = |name: &str| {
        headers.iter().find_map(|(k, v)| match v {
            AmqpValue::Text(s) if k == name => Some(s.clone()),
            _ => None,
        })
    };
    text("message_id")
        .or_else(|| text("event_id"))
        .or_else(|| property.map(str::to_owned))
        .or_else(|| text("cloudEvents_id"))
        .or_else(|| text("cloudEvents:id"))
}

/// A lapin header value as R141 reads it.
pub fn amqp_value(v: &AMQPValue) -> AmqpValue {
    match v {
        AMQPValue::ShortString(s) => AmqpValue::Text(s.to_string()),
        AMQPValue::LongString(s) => match std::str::from_utf8(s.as_bytes()) {
            Ok(t) => AmqpValue::Text(t.to_owned()),
            Err(_) => AmqpValue::Other("long string that is not UTF-8".into()),
        },
        AMQPValue::ByteArray(b) => match std::str::from_utf8(b.as_slice()) {
            Ok(t) => AmqpValue::Text(t.to_owned()),
            Err(_) => AmqpValue::Other("byte array".into()),
        },
        AMQPValue::Boolean(b) => AmqpValue::Boolean(*b),
        AMQPValue::ShortShortInt(i) => AmqpValue::Integer((*i).into()),
        AMQPValue::ShortShortUInt(i) => AmqpValue::Integer((*i).into()),
        AMQPValue::ShortInt(i) => AmqpValue::Integer((*i).into()),
        AMQPValue::ShortUInt(i) => AmqpValue::Integer((*i).into()),
        AMQPValue::LongInt(i) => AmqpValue::Integer((*i).into()),
        AMQPValue::LongUInt(i) => AmqpValue::Integer((*i).into()),
        AMQPValue::LongLongInt(i) => AmqpValue::Integer(*i),
        AMQPValue::Float(f) => AmqpValue::Decimal(f.to_string()),
        AMQPValue::Double(f) => AmqpValue::Decimal(f.to_string()),
        AMQPValue::DecimalValue(d) => AmqpValue::Decimal(decimal_text(d.scale, d.value)),
        AMQPValue::FieldArray(_) => AmqpValue::Other("array".into()),
        AMQPValue::FieldTable(_) => AmqpValue::Other("table".into()),
        AMQPValue::Timestamp(_) => AmqpValue::Other("timestamp".into()),
        AMQPValue::Void => AmqpValue::Other("void".into()),
    }
}

/// An AMQP decimal (value × 10^-scale) as text, e.g. scale 2, value 314 → `3.14`.
fn decimal_text(scale: u8, value: u32) -> String {
    let digits = value.to_string();
    let scale = usize::from(scale);
    if scale == 0 {
        return digits;
    }
    let padded = format!("{digits:0>width$}", width = scale + 1);
    let (int, frac) = padded.split_at(padded.len() - scale);
    format!("{int}.{frac}")
}

#[async_trait]
impl Transport for RabbitTransport {
    type Message = RabbitDelivery;

    /// A rewind holds the delivery in the process (RabbitMQ has no delayed redelivery), for at
    /// most hold_max, bounded by the runner's concurrency (R136, R178).
    fn capabilities(&self) -> TransportCapabilities {
        TransportCapabilities {
            subscription: SubscriptionCapabilities {
                name: "rabbitmq",
                rewind: true,
                last_delivery: self.config.delivery_limit.is_some(),
                renew_every: None,
                rewind_refusal: None,
            },
            holds_rewinds: true,
            longest_hold: Some(self.config.hold_max),
        }
    }

    /// The config's consumer group: the runner's (`Runner::for_subscription` takes it). The
    /// subscription names no topics (it reads queues, R177): the runner's sources are given.
    fn group(&self) -> Option<&str> {
        Some(&self.config.group)
    }

    /// A rewinding runner's max_attempts above the queues' delivery_limit is refused (R178);
    /// a runner's concurrency above the prefetch is let be with a warning (the runner then
    /// holds at most the prefetch, R177).
    fn check_settings(&self, settings: &RunnerSettings) -> Result<(), String> {
        if let (Some(l), Some(m)) = (self.config.delivery_limit, settings.rewind_max_attempts)
            && l < m
        {
            return Err(format!(
                "delivery_limit ({l}) is below the runner's max_attempts ({m}): raise the queues' x-delivery-limit or lower max_attempts"
            ));
        }
        let p = self.config.prefetch_value();
        if usize::from(p) < settings.concurrency {
            tracing::warn!(
                prefetch = p,
                concurrency = settings.concurrency,
                "the RabbitMQ prefetch is below the runner's concurrency: the runner holds at most the prefetch; give the subscription's config the runner's concurrency"
            );
        }
        Ok(())
    }

    /// Up to `max` deliveries the consumers received (the prefetch bounds them), waiting at
    /// most `wait` for the first. A lost connection is opened again here.
    async fn read(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<RabbitDelivery>, SubscriptionError> {
        if self.reading_stopped.load(Ordering::SeqCst) {
            return Ok(Vec::new());
        }
        let mut rx = self.rx.lock().await;
        if rx.is_empty() && self.readers.load(Ordering::SeqCst) == 0 {
            self.consume()
                .await
                .map_err(|e| transient("consuming again after the connection was lost", e))?;
        }
        let first = match tokio::time::timeout(wait, rx.recv()).await {
            Err(_) => return Ok(Vec::new()),
            Ok(None) => {
                return Err(SubscriptionError::transient(
                    "RabbitMQ: the consumers ended",
                ));
            }
            Ok(Some(a)) => a,
        };
        let mut out = vec![self.arrived(first)];
        while out.len() < max {
            match rx.try_recv() {
                Ok(a) => out.push(self.arrived(a)),
                Err(_) => break,
            }
        }
        Ok(out)
    }

    fn received(&self, m: &RabbitDelivery) -> Result<Received, SubscriptionError> {
        let d = &m.delivery;
        let headers = Self::headers(d);
        let n = self.delivery_number(m, &headers);
        let last = self.config.delivery_limit.is_some_and(|l| n >= l);
        Ok(Received {
            message: BrokerMessage::RabbitMq {
                queue: m.queue.clone(),
                exchange: d.exchange.to_string(),
                routing_key: d.routing_key.to_string(),
                routing_key_prefix: self.config.routing_key_prefix.clone(),
                message_id: d.properties.message_id().as_ref().map(|s| s.to_string()),
                kind: d.properties.kind().as_ref().map(|s| s.to_string()),
                headers,
                body: d.data.clone(),
                redelivered: d.redelivered,
            },
            delivery_number: n,
            redelivered_later: !last,
        })
    }

    /// basic.ack, confirmed once written on the open channel (R178).
    async fn commit(&self, m: &RabbitDelivery) -> Result<(), SubscriptionError> {
        m.ended.cancel();
        let r = m.delivery.acker.ack(BasicAckOptions::default()).await;
        self.forget_rewinds(m);
        Self::ended(r, "basic.ack")
    }

    /// A rewind that is not held (beyond the bound, or at close): returned at once (R178).
    async fn rewind(&self, m: &RabbitDelivery, delay: Duration) -> Result<(), SubscriptionError> {
        self.requeue(m, delay).await
    }

    /// A held rewind is due: basic.reject with requeue (basic.nack for a give-back with no
    /// delay); it comes back through the consumer.
    async fn take_back(
        &self,
        m: &RabbitDelivery,
        delay: Duration,
    ) -> Result<Vec<RabbitDelivery>, SubscriptionError> {
        self.requeue(m, delay).await?;
        Ok(Vec::new())
    }

    /// `copy`: basic.ack (the copy was made); `broker`: basic.reject without requeue, to the
    /// queue's own dead-letter exchange (R178).
    async fn term(&self, m: &RabbitDelivery, reason: &str) -> Result<(), SubscriptionError> {
        m.ended.cancel();
        self.forget_rewinds(m);
        tracing::info!(queue = m.queue, reason, "RabbitMQ delivery terminated");
        match self.config.dead_letter {
            DeadLetterMode::Copy => Self::ended(
                m.delivery.acker.ack(BasicAckOptions::default()).await,
                "basic.ack",
            ),
            DeadLetterMode::Broker => Self::ended(
                m.delivery
                    .acker
                    .reject(BasicRejectOptions { requeue: false })
                    .await,
                "basic.reject",
            ),
        }
    }

    /// Nothing: RabbitMQ has no lease on a delivery (R178).
    async fn renew(&self, _m: &RabbitDelivery) -> Result<(), SubscriptionError> {
        Ok(())
    }

    /// `copy`: publishes the message as received, persistent, with R140's headers, to the
    /// dead-letter exchange and routing key, mandatory and confirmed; a return or a nack is a
    /// failed copy. `broker`: copies nothing.
    async fn dead_letter(
        &self,
        m: &RabbitDelivery,
        letter: &DeadLetter<'_>,
    ) -> Result<(), SubscriptionError> {
        let cfg = &self.config;
        if cfg.dead_letter == DeadLetterMode::Broker {
            return Ok(());
        }
        let d = &m.delivery;
        let mut headers = d.properties.headers().clone().unwrap_or_default();
        let text = |s: &str| AMQPValue::LongString(s.as_bytes().to_vec().into());
        let added = letter.headers(&[
            ("Queue", m.queue.clone()),
            ("Exchange", d.exchange.to_string()),
            ("Routing-Key", d.routing_key.to_string()),
        ]);
        for (k, v) in &added {
            headers.insert(k.as_str().into(), text(v));
        }
        let props: BasicProperties = d
            .properties
            .clone()
            .with_delivery_mode(crate::message::PERSISTENT)
            .with_headers(headers);
        let key = cfg
            .dead_letter_routing_key
            .clone()
            .unwrap_or_else(|| format!("{}{DEAD_LETTER_SUFFIX}", m.queue));
        let x = cfg.dead_letter_exchange.as_str();
        let dest = format!("exchange {x:?}, routing key {key:?}");
        let mut slot = self.publisher.lock().await;
        let ch =
            match slot.as_ref() {
                Some(c) if c.status().connected() => c.clone(),
                _ => {
                    let conn =
                        self.connection.lock().await.clone().ok_or_else(|| {
                            SubscriptionError::transient("RabbitMQ: not connected")
                        })?;
                    let c = conn
                        .create_channel()
                        .await
                        .map_err(|e| transient("opening the dead-letter channel", e))?;
                    c.confirm_select(ConfirmSelectOptions::default())
                        .await
                        .map_err(|e| transient("confirm.select on the dead-letter channel", e))?;
                    *slot = Some(c.clone());
                    c
                }
            };
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let outcome = tokio::time::timeout(cfg.connection.confirm_timeout, async {
            ch.basic_publish(x.into(), key.as_str().into(), options, &d.data, props)
                .await?
                .await
        })
        .await;
        match outcome {
            Err(_) => {
                *slot = None;
                Err(SubscriptionError::transient(format!(
                    "RabbitMQ: no confirm of the dead-letter copy to {dest} within {:?}",
                    cfg.connection.confirm_timeout
                )))
            }
            Ok(Ok(Confirmation::Ack(None))) => Ok(()),
            Ok(Ok(Confirmation::Ack(Some(ret)))) => Err(SubscriptionError::transient(format!(
                "RabbitMQ returned the dead-letter copy to {dest} ({} {}): no queue is bound for it",
                ret.reply_code, ret.reply_text
            ))),
            Ok(Ok(Confirmation::Nack(_))) => Err(SubscriptionError::transient(format!(
                "RabbitMQ did not take the dead-letter copy to {dest} (basic.nack)"
            ))),
            Ok(Ok(Confirmation::NotRequested)) => {
                *slot = None;
                Err(SubscriptionError::transient(
                    "RabbitMQ: the dead-letter channel was not in confirm mode",
                ))
            }
            Ok(Err(e)) => {
                *slot = None;
                Err(transient(&format!("the dead-letter copy to {dest}"), e))
            }
        }
    }

    /// Cancels every consumer (basic.cancel), so that nothing more arrives and nothing given
    /// back returns to this runner (R167); what arrived before stays for the close to give
    /// back.
    async fn stop_reading(&self) {
        if self.reading_stopped.swap(true, Ordering::SeqCst) {
            return;
        }
        let consumers = self.consumers.lock().await;
        for c in consumers.iter() {
            if let Err(e) = c
                .channel
                .basic_cancel(c.tag.clone(), BasicCancelOptions::default())
                .await
            {
                tracing::debug!(queue = c.queue, error = %e, "basic.cancel at stop failed");
            }
        }
        drop(consumers);
        // The deliveries sent before basic.cancel-ok reach the channel before the readers end.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while self.readers.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Stops reading, gives back with basic.nack (requeue) what was received and not read,
    /// and closes the connection (R167, R178); the generic subscription has given back what
    /// it read ahead and the held rewinds already.
    async fn close(&self) {
        self.stop_reading().await;
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.closing.cancel();
        let mut rx = self.rx.lock().await;
        while let Ok(a) = rx.try_recv() {
            let nack = BasicNackOptions {
                multiple: false,
                requeue: true,
            };
            if let Err(e) = a.delivery.acker.nack(nack).await {
                tracing::warn!(error = %e, "giving back a received delivery at close failed");
            }
        }
        let consumers = std::mem::take(&mut *self.consumers.lock().await);
        for c in &consumers {
            let _ = c.channel.close(200, "inbox runner stopped".into()).await;
        }
        if let Some(conn) = self.connection.lock().await.take() {
            let _ = conn.close(200, "inbox runner stopped".into()).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decimals_and_values() {
        assert_eq!(decimal_text(2, 314), "3.14");
        assert_eq!(decimal_text(3, 5), "0.005");
        assert_eq!(decimal_text(0, 7), "7");
        assert_eq!(
            amqp_value(&AMQPValue::LongLongInt(3)),
            AmqpValue::Integer(3)
        );
        assert_eq!(
            amqp_value(&AMQPValue::Boolean(true))
                .stored_text()
                .as_deref(),
            Some("true")
        );
        assert_eq!(amqp_value(&AMQPValue::Void).stored_text(), None);
    }

    fn cfg() -> RabbitSubscriptionConfig {
        RabbitSubscriptionConfig::new(
            RabbitMqBrokerConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "g",
            ["q"],
        )
    }

    #[test]
    fn settings_checked() {
        let e = cfg().concurrency(4).prefetch(2).validate().unwrap_err();
        assert!(
            e.to_string()
                .contains("prefetch (2) is below concurrency (4)")
        );
        assert_eq!(cfg().concurrency(4).prefetch_value(), 8);
        let e = cfg()
            .max_attempts(6)
            .delivery_limit(3)
            .validate()
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("delivery_limit (3) is below max_attempts (6)")
        );
        assert!(cfg().hold_max(DEFAULT_CONSUMER_TIMEOUT).validate().is_err());
        assert!(cfg().validate().is_ok());
    }
}
