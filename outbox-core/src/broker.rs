//! The broker trait and the message format (contract section 6).

use std::collections::BTreeMap;

use async_trait::async_trait;
use uuid::Uuid;

use crate::error::BrokerError;
use crate::event::OutboxEvent;

/// The precision of the `created_at` attribute (R50): microseconds, as
/// `2026-12-01T10:15:30.123456Z`.
pub const CREATED_AT_FORMAT: chrono::SecondsFormat = chrono::SecondsFormat::Micros;

/// The message a broker adapter sends for one row (R50).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The event id.
    pub event_id: Uuid,
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
    /// Event type.
    pub event_type: String,
    /// The body: the payload as compact JSON.
    pub body: Vec<u8>,
    /// The user's headers, as stored.
    pub headers: BTreeMap<String, String>,
    /// The attributes of R50: the user's headers overridden by `event_id`, `event_type`,
    /// `topic`, `partition_key`, `aggregate_type`, `aggregate_id`, `created_at` (RFC 3339 in
    /// UTC with six fractional digits, [`CREATED_AT_FORMAT`]) and, when set,
    /// `schema_version`, `trace_id`, `correlation_id`, `causation_id`.
    pub attributes: BTreeMap<String, String>,
}

impl Message {
    /// Builds the message of a row.
    pub fn from_event(e: &OutboxEvent) -> Self {
        let headers = e.headers.clone().unwrap_or_default();
        let mut attributes = headers.clone();
        attributes.insert("event_id".into(), e.id.hyphenated().to_string());
        attributes.insert("event_type".into(), e.event_type.clone());
        attributes.insert("topic".into(), e.topic.clone());
        attributes.insert("partition_key".into(), e.partition_key.clone());
        attributes.insert("aggregate_type".into(), e.aggregate_type.clone());
        attributes.insert(
            "aggregate_id".into(),
            e.aggregate_id.hyphenated().to_string(),
        );
        attributes.insert(
            "created_at".into(),
            e.created_at.to_rfc3339_opts(CREATED_AT_FORMAT, true),
        );
        for (k, v) in [
            ("schema_version", &e.schema_version),
            ("trace_id", &e.trace_id),
            ("correlation_id", &e.correlation_id),
            ("causation_id", &e.causation_id),
        ] {
            if let Some(v) = v {
                attributes.insert(k.into(), v.clone());
            }
        }
        Self {
            event_id: e.id,
            topic: e.topic.clone(),
            partition_key: e.partition_key.clone(),
            event_type: e.event_type.clone(),
            body: serde_json::to_vec(&e.payload).expect("a JSON value always serializes"),
            headers,
            attributes,
        }
    }

    /// The W3C trace context the event was written with (the attribute `traceparent`, see
    /// [`crate::trace`]); adapters send it so the consumer continues the producer's trace.
    pub fn traceparent(&self) -> Option<&str> {
        self.attributes
            .get(crate::trace::TRACEPARENT)
            .map(String::as_str)
    }

    /// The payload as JSON.
    pub fn payload(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or(serde_json::Value::Null)
    }
}

/// An acknowledgement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ack {
    /// The broker said it already had this message (NATS duplicate window, R53).
    pub duplicate: bool,
}

/// A message broker.
///
/// Contract (R36, R45, R51, R52):
/// * `Ok` only after the broker durably accepted the message (K-06);
/// * [`BrokerError::Rejected`] when the broker answered and refused this message (an attempt is
///   spent; K-04, T-03);
/// * [`BrokerError::Transient`] when it could not be reached or did not answer (no attempt;
///   K-03, T-01); an adapter's own retries end within the relay's publish timeout;
/// * the relay never calls `publish` for two rows of one key at once, and never batches them
///   (K-02, X-01).
///
/// Outage recovery (optional; both default to "not offered"): while a relay loop waits out an
/// outage (a cycle found the broker unreachable), it starts the next cycle as soon as
/// [`reconnects`](Broker::reconnects) moves or [`probe`](Broker::probe) answers
/// [`Probe::Up`], instead of waiting out its whole back-off. Checked by the loop tests in
/// `outbox-core/src/relay/run_loop.rs` (`outage_backoff_cuts_cycles_and_writes_and_a_reconnect_wakes_the_loop`,
/// `without_reconnect_events_the_probe_wakes_the_loop`), and for the adapters by
/// `outbox-nats-broker/tests/reconnect.rs` and `outbox-redis-broker/tests/reconnect.rs`.
///
/// Tracing: the relay's publish span records [`messaging_system`](Self::messaging_system) and
/// [`destination_name`](Self::destination_name) as the OpenTelemetry attributes
/// `messaging.system` and `messaging.destination.name`. An adapter sends the message's
/// `traceparent` attribute ([`Message::traceparent`]) the way its broker carries headers.
#[async_trait]
pub trait Broker: Send + Sync {
    /// Publishes one message.
    async fn publish(&self, message: &Message) -> Result<Ack, BrokerError>;

    /// The OpenTelemetry `messaging.system` of this broker, e.g. `nats`, `redis`; `unknown` by
    /// default.
    fn messaging_system(&self) -> &'static str {
        "unknown"
    }

    /// Where `message` goes, for `messaging.destination.name` (NATS subject, Redis stream
    /// key); the topic by default.
    fn destination_name(&self, message: &Message) -> String {
        message.topic.clone()
    }

    /// A counter of the client's (re)connections: it moves each time the connection to the
    /// broker is established again. A relay loop waiting out an outage wakes when it changes.
    /// Default: `None` (the client has no connection events; see [`probe`](Broker::probe)).
    fn reconnects(&self) -> Option<ReconnectWatch> {
        None
    }

    /// A cheap reachability check (one round trip to the broker, no message sent), called
    /// every `probe_interval` while a relay loop waits out an outage: for clients without
    /// connection events, and for outages with no disconnect (a black-holed network). The loop
    /// bounds each call by [`PROBE_TIMEOUT`](crate::relay::PROBE_TIMEOUT) and counts a late
    /// answer as [`Probe::Down`]. It must not answer [`Probe::Up`] from local state alone (a
    /// flushed socket buffer is no answer). Default: [`Probe::Unsupported`] (never called
    /// again).
    async fn probe(&self) -> Probe {
        Probe::Unsupported
    }
}

/// What [`Broker::probe`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// The broker answered.
    Up,
    /// The broker did not answer.
    Down,
    /// This broker offers no probe.
    Unsupported,
}

/// The sending side of a reconnection counter, kept by a broker adapter: call
/// [`connected`](Self::connected) from the client's "connected" event.
#[derive(Debug, Clone)]
pub struct ReconnectSignal(std::sync::Arc<tokio::sync::watch::Sender<u64>>);

impl Default for ReconnectSignal {
    fn default() -> Self {
        Self::new()
    }
}

impl ReconnectSignal {
    /// A counter at 0.
    pub fn new() -> Self {
        Self(std::sync::Arc::new(tokio::sync::watch::channel(0).0))
    }

    /// Records one (re)connection and wakes every watcher.
    pub fn connected(&self) {
        self.0.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A watcher for [`Broker::reconnects`].
    pub fn watch(&self) -> ReconnectWatch {
        ReconnectWatch(self.0.subscribe())
    }
}

/// The watching side of a [`ReconnectSignal`].
#[derive(Debug, Clone)]
pub struct ReconnectWatch(tokio::sync::watch::Receiver<u64>);

impl ReconnectWatch {
    /// Forgets the (re)connections so far: [`changed`](Self::changed) waits for the next one.
    pub fn mark_seen(&mut self) {
        self.0.borrow_and_update();
    }

    /// Waits for a (re)connection after the last [`mark_seen`](Self::mark_seen) (or the last
    /// return of this method). Never returns when the broker is gone.
    pub async fn changed(&mut self) {
        if self.0.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

#[async_trait]
impl<B: Broker + ?Sized> Broker for std::sync::Arc<B> {
    async fn publish(&self, message: &Message) -> Result<Ack, BrokerError> {
        (**self).publish(message).await
    }

    fn messaging_system(&self) -> &'static str {
        (**self).messaging_system()
    }

    fn destination_name(&self, message: &Message) -> String {
        (**self).destination_name(message)
    }

    fn reconnects(&self) -> Option<ReconnectWatch> {
        (**self).reconnects()
    }

    async fn probe(&self) -> Probe {
        (**self).probe().await
    }
}

/// A broker that prints each message as one JSON line on stdout and acknowledges it.
#[derive(Debug, Default, Clone, Copy)]
pub struct StdoutBroker;

#[async_trait]
impl Broker for StdoutBroker {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let line = serde_json::json!({
            "topic": m.topic,
            "partition_key": m.partition_key,
            "attributes": m.attributes,
            "payload": m.payload(),
        });
        println!("{line}");
        Ok(Ack::default())
    }

    fn messaging_system(&self) -> &'static str {
        "stdout"
    }
}

/// A broker that acknowledges everything and does nothing (for benchmarks).
#[derive(Debug, Default, Clone, Copy)]
pub struct NoopBroker;

#[async_trait]
impl Broker for NoopBroker {
    async fn publish(&self, _m: &Message) -> Result<Ack, BrokerError> {
        Ok(Ack::default())
    }

    fn messaging_system(&self) -> &'static str {
        "noop"
    }
}
