//! Broker trials (K-01 to K-06) and a broker outage trial, run against
//! a live broker through a real adapter.
//!
//! A broker adapter crate implements [`BrokerUnderTest`] in its tests and invokes
//! [`crate::broker_suite!`], which generates one test per trial. Each trial makes a fresh
//! stream or key prefix ([`BrokerUnderTest::trial`]) and cleans it up at the end; the relay runs
//! over an [`InMemoryRepository`] on a [`ManualClock`], so time only moves when a trial moves it.
//!
//! The outage trial ([`outage_mid_drain`]) puts a [`LoopbackProxy`] between the adapter and the
//! server, closes it in the middle of a drain and opens it again.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use serde_json::{Value, json};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinHandle;
use txoutbox_core::clock::{Clock, ManualClock};
use txoutbox_core::event::{NewEvent, OutboxEvent, Status};
use txoutbox_core::relay::{CycleReport, Relay};
use txoutbox_core::repository::OutboxRepository;
use txoutbox_core::{Broker, CancellationToken, InMemoryRepository, Message};
use uuid::Uuid;

/// Which broker: the trials expect what each one can do (K-05).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerKind {
    /// NATS JetStream: drops a republished event id within the duplicate window.
    Nats,
    /// Redis Streams: no server-side deduplication.
    Redis,
    /// Kafka (or a Kafka-compatible broker): a republish is a new record (R87).
    Kafka,
    /// RabbitMQ: a republish is a new message (R90).
    RabbitMq,
}

impl BrokerKind {
    /// Whether the broker drops a republished event id (K-05): NATS only.
    pub fn drops_republished_ids(self) -> bool {
        self == Self::Nats
    }

    /// Whether a message carries the event id as a broker-level message id ([`Received::message_id`]):
    /// every broker but Redis.
    pub fn carries_message_id(self) -> bool {
        self != Self::Redis
    }
}

/// How to set up one trial.
#[derive(Debug, Clone)]
pub struct TrialOptions {
    /// Where the adapter connects: the real server when `None`, or e.g. a [`LoopbackProxy`].
    /// Reading back always goes straight to the real server.
    pub connect_to: Option<SocketAddr>,
    /// The adapter's own timeout (its bound on one publish).
    pub adapter_timeout: Duration,
}

impl Default for TrialOptions {
    fn default() -> Self {
        Self {
            connect_to: None,
            adapter_timeout: Duration::from_secs(5),
        }
    }
}

/// A message as read back from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// NATS: the subject. Redis: the stream key. Kafka: the topic. RabbitMQ: the routing key.
    pub destination: String,
    /// NATS: the body. Redis: the `payload` field.
    pub body: Vec<u8>,
    /// NATS: the headers, except those starting with `Nats-`. Redis: every field except
    /// `payload` and `headers`, plus the entries of the `headers` field (a field wins over a
    /// header of the same name).
    pub attributes: BTreeMap<String, String>,
    /// NATS: the `Nats-Msg-Id` header. Redis: none. Kafka: the `id` header. RabbitMQ: the
    /// message_id property.
    pub message_id: Option<String>,
}

impl Received {
    /// The body as JSON (null when it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    /// One attribute.
    pub fn attr(&self, name: &str) -> Option<&str> {
        self.attributes.get(name).map(String::as_str)
    }
}

/// A live broker under test: makes trials on fresh streams or key prefixes.
#[async_trait]
pub trait BrokerUnderTest: Send + Sync {
    /// Which broker.
    fn kind(&self) -> BrokerKind;
    /// The address of the real server (the upstream of a [`LoopbackProxy`]).
    fn server_addr(&self) -> SocketAddr;
    /// A fresh trial: an adapter on a fresh stream (NATS) or key prefix (Redis). Panics when the
    /// broker cannot be reached (a trial fails, never skips).
    async fn trial(&self, opts: TrialOptions) -> Box<dyn BrokerTrial>;
    /// An adapter pointed at `addr`, where nothing listens, created without waiting for a
    /// connection, with `adapter_timeout` as its own timeout (K-03).
    async fn unreachable(&self, addr: SocketAddr, adapter_timeout: Duration) -> Arc<dyn Broker>;
}

/// One trial's adapter and its view of the broker.
#[async_trait]
pub trait BrokerTrial: Send + Sync {
    /// The adapter under test.
    fn broker(&self) -> Arc<dyn Broker>;
    /// Another adapter like [`broker`](Self::broker) (same settings, destinations and
    /// address) with a connection of its own, as a second relay process would have. Default:
    /// [`broker`](Self::broker) itself, for adapters whose clones do not share a connection.
    async fn another_adapter(&self) -> Arc<dyn Broker> {
        self.broker()
    }
    /// Where a message of this topic lands (NATS subject, Redis stream key).
    fn destination(&self, topic: &str) -> String;
    /// Every stored message of this topic, in stored order, read straight from the server.
    async fn read(&self, topic: &str) -> Vec<Received>;
    /// K-04: makes the broker refuse a message of this topic whose payload is about 2 KiB
    /// (NATS: the stream's maximum message size becomes 1024 bytes; Redis: the stream key gets
    /// a plain string). Returns a text the refusal stored as last_error contains.
    async fn prepare_refusal(&self, topic: &str) -> String;
    /// Waits (at most `within`) until the adapter can reach the broker again after an outage;
    /// returns whether it can. Waits on the adapter's own signal, or drives a request.
    async fn await_reachable(&self, within: Duration) -> bool;
    /// Removes what the trial created (streams, keys).
    async fn cleanup(&self);
}

/// What a drain delivered, reduced for the at-least-once and per-key order checks: each event's
/// first delivery grouped by key in delivery order, and how many deliveries repeated an event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FirstDeliveries {
    /// Per partition key, the event ids in the order of their first delivery.
    pub per_key: HashMap<String, Vec<Uuid>>,
    /// Distinct events delivered.
    pub distinct: usize,
    /// Deliveries of an event already delivered.
    pub repeated: usize,
}

impl FirstDeliveries {
    /// Reduces `(partition key, event id)` deliveries, in delivery order.
    pub fn of(deliveries: impl IntoIterator<Item = (String, Uuid)>) -> Self {
        let mut seen = HashSet::new();
        let mut out = Self::default();
        for (key, id) in deliveries {
            if seen.insert(id) {
                out.per_key.entry(key).or_default().push(id);
            } else {
                out.repeated += 1;
            }
        }
        out.distinct = seen.len();
        out
    }

    /// The same from messages read back from a broker (their `partition_key` and `event_id`
    /// attributes).
    pub fn of_received(got: &[Received]) -> Self {
        Self::of(got.iter().map(|m| {
            (
                m.attr("partition_key").expect("partition_key").to_owned(),
                Uuid::parse_str(m.attr("event_id").expect("event_id")).expect("uuid"),
            )
        }))
    }
}

/// The NATS subject / Redis stream-key part that makes names unique per trial.
pub fn fresh_suffix() -> String {
    Uuid::new_v4().simple().to_string()[..12].to_owned()
}

pub(crate) fn relay_for(
    repo: &InMemoryRepository,
    broker: Arc<dyn Broker>,
) -> txoutbox_core::RelayBuilder {
    Relay::builder(Arc::new(repo.clone()) as Arc<dyn OutboxRepository>, broker).worker_id("w1")
}

pub(crate) fn event(topic: &str, key: &str, payload: Value) -> txoutbox_core::EventBuilder {
    NewEvent::builder()
        .event_type("test.happened")
        .aggregate("test", Uuid::nil())
        .topic(topic)
        .partition_key(key)
        .payload_json(payload)
}

pub(crate) async fn write_one(repo: &InMemoryRepository, e: NewEvent) -> OutboxEvent {
    let r = repo.write_committed(vec![e]).await.expect("write");
    r.into_iter().next().expect("one row").event
}

pub(crate) async fn get(repo: &InMemoryRepository, id: Uuid) -> OutboxEvent {
    repo.get(id).await.expect("get").expect("row exists")
}

pub(crate) async fn cycle(relay: &Relay) -> CycleReport {
    relay
        .cycle(&CancellationToken::new())
        .await
        .expect("fetch succeeds on the in-memory backend")
}

pub(crate) fn repo() -> (InMemoryRepository, ManualClock) {
    let clock = ManualClock::starting_now();
    (InMemoryRepository::new(Arc::new(clock.clone())), clock)
}

/// K-01 What the message carries.
pub async fn k_01(b: &dyn BrokerUnderTest) {
    let t = b.trial(TrialOptions::default()).await;
    let (repo, _clock) = repo();
    let row = write_one(
        &repo,
        event("orders", "acct-1", json!({"n": 1, "text": "héllo"}))
            .header("tenant", "acme")
            .header("event_id", "spoof")
            .trace_id("tr-1")
            .schema_version("1.0.0")
            .build()
            .expect("valid event"),
    )
    .await;
    let relay = relay_for(&repo, t.broker()).build().expect("relay");
    let r = cycle(&relay).await;
    assert_eq!(r.completed, vec![row.id], "K-01: the row completes: {r:?}");
    let got = t.read("orders").await;
    assert_eq!(got.len(), 1, "K-01: one message: {got:?}");
    let m = &got[0];
    assert_eq!(
        m.json(),
        json!({"n": 1, "text": "héllo"}),
        "K-01: the body equals the payload"
    );
    let id = row.id.hyphenated().to_string();
    assert_eq!(
        m.attr("event_id"),
        Some(id.as_str()),
        "K-01: event_id is the row's id, not the header"
    );
    assert_eq!(m.attr("event_type"), Some("test.happened"));
    assert_eq!(m.attr("topic"), Some("orders"));
    assert_eq!(m.attr("partition_key"), Some("acct-1"));
    assert_eq!(m.attr("tenant"), Some("acme"));
    assert_eq!(m.attr("trace_id"), Some("tr-1"));
    assert_eq!(m.attr("schema_version"), Some("1.0.0"));
    assert_eq!(
        m.destination,
        t.destination("orders"),
        "K-01: prefix + topic"
    );
    if b.kind().carries_message_id() {
        assert_eq!(
            m.message_id.as_deref(),
            Some(id.as_str()),
            "K-01: the broker's message id ({:?})",
            b.kind()
        );
    } else {
        assert_eq!(m.message_id, None);
    }
    t.cleanup().await;
}

/// K-02 Per-key order on the broker: 5 keys × 40 rows, interleaved; max_per_key 10,
/// publish_concurrency 4.
pub async fn k_02(b: &dyn BrokerUnderTest) {
    let t = b.trial(TrialOptions::default()).await;
    let (repo, _clock) = repo();
    let mut written: HashMap<String, Vec<Uuid>> = HashMap::new();
    for seq in 0..40 {
        for k in 0..5 {
            let key = format!("key-{k}");
            let row = write_one(
                &repo,
                event("orders", &key, json!({"key": key, "seq": seq}))
                    .build()
                    .expect("valid"),
            )
            .await;
            written.entry(key).or_default().push(row.id);
        }
    }
    let relay = relay_for(&repo, t.broker())
        .max_per_key(10)
        .publish_concurrency(4)
        .build()
        .expect("relay");
    let mut cycles = 0;
    loop {
        let r = cycle(&relay).await;
        assert!(
            r.counted.is_empty() && r.transient.is_empty(),
            "K-02: no failure: {r:?}"
        );
        if r.fetched.is_empty() {
            break;
        }
        cycles += 1;
        assert!(
            cycles <= 100,
            "K-02: the drain did not end within 100 cycles"
        );
    }
    let got = t.read("orders").await;
    assert_eq!(got.len(), 200, "K-02: 200 messages");
    let mut seen: HashMap<String, Vec<Uuid>> = HashMap::new();
    for m in &got {
        let key = m.attr("partition_key").expect("partition_key").to_owned();
        let id = Uuid::parse_str(m.attr("event_id").expect("event_id")).expect("uuid");
        seen.entry(key).or_default().push(id);
    }
    assert_eq!(
        seen, written,
        "K-02: per key, the messages are in write order"
    );
    t.cleanup().await;
}

/// K-03 An unreachable broker is transient: the adapter points at a closed port on 127.0.0.1;
/// publish timeout 2 s.
pub async fn k_03(b: &dyn BrokerUnderTest) {
    let addr = closed_port().await;
    let broker = b.unreachable(addr, Duration::from_millis(1500)).await;
    let (repo, clock) = repo();
    let row = write_one(
        &repo,
        event("orders", "k", json!({"n": 1}))
            .build()
            .expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, broker)
        .publish_timeout(Duration::from_secs(2))
        .build()
        .expect("relay");
    let started = std::time::Instant::now();
    let r = cycle(&relay).await;
    let took = started.elapsed();
    eprintln!("K-03: {took:?}: {:?}", r.transient);
    assert!(
        took <= Duration::from_secs(2),
        "K-03: reported within 2 s, took {took:?}"
    );
    assert!(r.counted.is_empty(), "K-03: no counted failure: {r:?}");
    assert_eq!(r.transient.len(), 1, "K-03: one transient failure: {r:?}");
    let now = clock.now();
    assert_eq!(
        r.transient[0].next_try,
        Some(now + chrono::Duration::seconds(1)),
        "K-03: next try = now + 1.0 s"
    );
    let stored = get(&repo, row.id).await;
    assert_eq!(stored.attempts_made, 0, "K-03: no attempt spent");
    assert_eq!(stored.status, Status::Pending);
    assert!(!stored.is_held(), "K-03: released");
}

/// K-04 A refusal is counted.
pub async fn k_04(b: &dyn BrokerUnderTest) {
    let t = b.trial(TrialOptions::default()).await;
    let expected = t.prepare_refusal("orders").await;
    let (repo, _clock) = repo();
    let big = "x".repeat(2048);
    let row = write_one(
        &repo,
        event("orders", "k", json!({"blob": big}))
            .build()
            .expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, t.broker()).build().expect("relay");
    let r = cycle(&relay).await;
    assert!(
        r.transient.is_empty() && r.completed.is_empty(),
        "K-04: {r:?}"
    );
    assert_eq!(r.counted.len(), 1, "K-04: one counted failure: {r:?}");
    let stored = get(&repo, row.id).await;
    assert_eq!(stored.attempts_made, 1, "K-04: attempts_made 1");
    let last = stored.last_error.unwrap_or_default();
    eprintln!("K-04: last_error {last:?}");
    assert!(
        last.contains(&expected),
        "K-04: last_error {last:?} is the broker's refusal (contains {expected:?})"
    );
    t.cleanup().await;
}

/// K-05 A republished event id.
pub async fn k_05(b: &dyn BrokerUnderTest) {
    let t = b.trial(TrialOptions::default()).await;
    let e = event("orders", "k", json!({"n": 5}))
        .build()
        .expect("valid");
    let row = e.clone().into_row(chrono::Utc::now());
    let m = Message::from_event(&row);
    let broker = t.broker();
    let first = broker
        .publish(&m)
        .await
        .expect("K-05: first publish succeeds");
    let second = broker
        .publish(&m)
        .await
        .expect("K-05: second publish succeeds");
    let got = t.read("orders").await;
    let id = row.id.hyphenated().to_string();
    if b.kind().drops_republished_ids() {
        assert!(!first.duplicate, "K-05: the first is no duplicate");
        assert!(
            second.duplicate,
            "K-05: the second acknowledgement is marked duplicate"
        );
        assert_eq!(got.len(), 1, "K-05: the stream holds one message");
    } else {
        assert_eq!(got.len(), 2, "K-05: {:?} stores two entries", b.kind());
    }
    assert!(
        got.iter().all(|m| m.attr("event_id") == Some(id.as_str())),
        "K-05: same event_id"
    );
    t.cleanup().await;
}

/// K-06 Success means stored.
pub async fn k_06(b: &dyn BrokerUnderTest) {
    let t = b.trial(TrialOptions::default()).await;
    let (repo, _clock) = repo();
    let row = write_one(
        &repo,
        event("orders", "k", json!({"n": 6}))
            .build()
            .expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, t.broker()).build().expect("relay");
    let r = cycle(&relay).await;
    assert_eq!(r.completed, vec![row.id], "K-06: completed: {r:?}");
    let got = t.read("orders").await;
    let id = row.id.hyphenated().to_string();
    assert_eq!(got.len(), 1, "K-06: the message is already there");
    assert_eq!(got[0].attr("event_id"), Some(id.as_str()));
    t.cleanup().await;
}

/// The broker goes away in the middle of a drain (a [`LoopbackProxy`] closes): rows stay
/// pending with attempts unchanged while it is down, and the drain finishes once it is back.
/// Every row arrives; per key, first deliveries are in write order.
pub async fn outage_mid_drain(b: &dyn BrokerUnderTest) {
    let proxy = LoopbackProxy::start(b.server_addr()).await;
    let t = b
        .trial(TrialOptions {
            connect_to: Some(proxy.addr()),
            adapter_timeout: Duration::from_secs(1),
        })
        .await;
    let (repo, clock) = repo();
    let mut written: HashMap<String, Vec<Uuid>> = HashMap::new();
    let mut ids = Vec::new();
    for seq in 0..10 {
        for k in 0..3 {
            let key = format!("key-{k}");
            let row = write_one(
                &repo,
                event("orders", &key, json!({"key": key, "seq": seq}))
                    .build()
                    .expect("valid"),
            )
            .await;
            written.entry(key).or_default().push(row.id);
            ids.push(row.id);
        }
    }
    let relay = relay_for(&repo, t.broker())
        .batch_size(6)
        .max_per_key(2)
        .publish_concurrency(2)
        .publish_timeout(Duration::from_secs(3))
        .build()
        .expect("relay");

    // Up: one cycle drains part of the backlog.
    let r = cycle(&relay).await;
    assert_eq!(
        r.completed.len(),
        6,
        "outage: the first cycle publishes 6 rows: {r:?}"
    );

    // Down.
    proxy.close().await;
    let before: HashMap<Uuid, OutboxEvent> = repo.rows().into_iter().map(|e| (e.id, e)).collect();
    for i in 0..3 {
        clock.advance(Duration::from_secs(1));
        let r = cycle(&relay).await;
        assert!(
            r.completed.is_empty(),
            "outage: nothing completes while down (cycle {i}): {r:?}"
        );
        assert!(
            r.counted.is_empty(),
            "outage: no counted failure while down (cycle {i}): {r:?}"
        );
        assert!(
            r.broker_unreachable,
            "outage: the cycle finds the broker unreachable: {r:?}"
        );
        assert!(
            !r.transient.is_empty(),
            "outage: a transient failure: {r:?}"
        );
        eprintln!("outage: down cycle {i}: {:?}", r.transient[0].error);
    }
    for row in repo.rows() {
        let was = &before[&row.id];
        assert_eq!(
            row.status, was.status,
            "outage: status unchanged for {}",
            row.id
        );
        assert_eq!(
            row.attempts_made, 0,
            "outage: attempts unchanged for {}",
            row.id
        );
        assert!(!row.is_held(), "outage: {} is released", row.id);
    }
    let pending = repo
        .rows()
        .iter()
        .filter(|r| r.status == Status::Pending)
        .count();
    assert_eq!(pending, 24, "outage: 24 rows still pending");

    // Back.
    proxy.reopen().await;
    let mut cycles = 0;
    while repo.rows().iter().any(|r| r.status != Status::Completed) {
        cycles += 1;
        assert!(
            cycles <= 60,
            "outage: the drain did not finish within 60 cycles after the broker came back"
        );
        clock.advance(Duration::from_secs(1));
        let r = cycle(&relay).await;
        assert!(r.counted.is_empty(), "outage: no counted failure: {r:?}");
        eprintln!(
            "outage: cycle {cycles} after reopening: {} completed, unreachable {}",
            r.completed.len(),
            r.broker_unreachable
        );
        if r.broker_unreachable {
            assert!(
                t.await_reachable(Duration::from_secs(10)).await,
                "outage: the adapter did not reach the broker within 10 s after it came back"
            );
        }
    }
    for row in repo.rows() {
        assert_eq!(
            row.attempts_made, 0,
            "outage: no attempt spent on {}",
            row.id
        );
    }
    let first = FirstDeliveries::of_received(&t.read("orders").await);
    assert_eq!(first.distinct, ids.len(), "outage: every row arrived");
    assert_eq!(
        first.per_key, written,
        "outage: per key, first deliveries in write order"
    );
    t.cleanup().await;
    proxy.shutdown().await;
}

/// The network stalls after the broker was reached (a [`LoopbackProxy`] holds every byte): the
/// adapter gives up within its own timeout (0.5 s, under the relay's 3 s) with a transient
/// failure and no attempt is spent; once bytes flow again the row completes. NATS stores the
/// event once (the held publish and the retry share the `Nats-Msg-Id`); Redis may hold it twice.
pub async fn stalled_ack(b: &dyn BrokerUnderTest) {
    let proxy = LoopbackProxy::start(b.server_addr()).await;
    let t = b
        .trial(TrialOptions {
            connect_to: Some(proxy.addr()),
            adapter_timeout: Duration::from_millis(500),
        })
        .await;
    let (repo, clock) = repo();
    let row = write_one(
        &repo,
        event("orders", "k", json!({"n": 7}))
            .build()
            .expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, t.broker())
        .publish_timeout(Duration::from_secs(3))
        .build()
        .expect("relay");
    proxy.stall();
    let started = std::time::Instant::now();
    let r = cycle(&relay).await;
    let took = started.elapsed();
    eprintln!("stalled: {took:?}: {:?}", r.transient);
    assert!(
        r.counted.is_empty() && r.completed.is_empty(),
        "stalled: {r:?}"
    );
    assert_eq!(
        r.transient.len(),
        1,
        "stalled: one transient failure: {r:?}"
    );
    assert!(
        took < Duration::from_secs(2),
        "stalled: the adapter's own timeout ended the publish, not the relay's 3 s ({took:?})"
    );
    let stored = get(&repo, row.id).await;
    assert_eq!(stored.attempts_made, 0, "stalled: no attempt spent");
    assert_eq!(stored.status, Status::Pending);

    proxy.resume();
    let mut cycles = 0;
    while get(&repo, row.id).await.status != Status::Completed {
        cycles += 1;
        assert!(
            cycles <= 20,
            "stalled: the row did not complete within 20 cycles after resuming"
        );
        clock.advance(Duration::from_secs(1));
        let r = cycle(&relay).await;
        assert!(r.counted.is_empty(), "stalled: no counted failure: {r:?}");
        if r.broker_unreachable {
            assert!(
                t.await_reachable(Duration::from_secs(10)).await,
                "stalled: broker back"
            );
        }
    }
    let got = t.read("orders").await;
    let id = row.id.hyphenated().to_string();
    assert!(got.iter().all(|m| m.attr("event_id") == Some(id.as_str())));
    if b.kind().drops_republished_ids() {
        assert_eq!(got.len(), 1, "stalled: JetStream stores the event once");
    } else {
        assert!((1..=2).contains(&got.len()), "stalled: {got:?}");
    }
    t.cleanup().await;
    proxy.shutdown().await;
}

/// R43: a transient failure is retried 1.0 s after it was recorded (`now`, read right after the
/// cycle; the manual clock may have ticked by microseconds since).
pub fn assert_next_try_in_one_second(
    f: &txoutbox_core::relay::FailureReport,
    now: chrono::DateTime<chrono::Utc>,
) {
    let next = f.next_try.expect("a transient failure writes its next try");
    let wait = next - now;
    assert!(
        (chrono::Duration::milliseconds(990)..=chrono::Duration::milliseconds(1010))
            .contains(&wait),
        "next try = now + 1.0 s, got now + {wait:?}"
    );
}

/// An address on 127.0.0.1 where nothing listens (a port bound and released).
pub async fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let addr = l.local_addr().expect("local addr");
    drop(l);
    addr
}

/// A fault-injecting TCP proxy on 127.0.0.1 in front of a server. Its modes: pass (the
/// default), refuse ([`close`](Self::close): listener gone, every connection cut;
/// [`reopen`](Self::reopen) on the same port), black hole ([`stall`](Self::stall): connections
/// open and accepted, no byte delivered; [`resume`](Self::resume)) and reset
/// ([`reset`](Self::reset): every open connection and every new one is reset with a TCP RST
/// mid-stream; [`stop_resetting`](Self::stop_resetting)).
pub struct LoopbackProxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    inner: Arc<Mutex<ProxyState>>,
    stalled: tokio::sync::watch::Sender<bool>,
    resetting: tokio::sync::watch::Sender<bool>,
}

#[derive(Default)]
struct ProxyState {
    acceptor: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl LoopbackProxy {
    /// Starts a proxy on a free loopback port forwarding to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = bind_reuse("127.0.0.1:0".parse().expect("addr")).await;
        let addr = listener.local_addr().expect("local addr");
        let p = Self {
            addr,
            upstream,
            inner: Arc::new(Mutex::new(ProxyState::default())),
            stalled: tokio::sync::watch::channel(false).0,
            resetting: tokio::sync::watch::channel(false).0,
        };
        p.serve(listener);
        p
    }

    /// The proxy's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops forwarding bytes in both directions while keeping every connection open (a
    /// network that drops nothing but delivers nothing); [`resume`](Self::resume) delivers what
    /// was held.
    pub fn stall(&self) {
        self.stalled.send_replace(true);
    }

    /// Forwards again after [`stall`](Self::stall).
    pub fn resume(&self) {
        self.stalled.send_replace(false);
    }

    /// Resets every open connection with a TCP RST, in whatever state it is, and every new one
    /// as soon as it is accepted, until [`stop_resetting`](Self::stop_resetting).
    pub fn reset(&self) {
        self.resetting.send_replace(true);
    }

    /// Accepts and forwards again after [`reset`](Self::reset).
    pub fn stop_resetting(&self) {
        self.resetting.send_replace(false);
    }

    fn serve(&self, listener: TcpListener) {
        let upstream = self.upstream;
        let conns = self.inner.lock().expect("proxy").conns.clone();
        let stalled = self.stalled.subscribe();
        let resetting = self.resetting.subscribe();
        let acceptor = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if *resetting.borrow() {
                    // Dropped with a zero linger: the client gets an RST.
                    let _ = client.set_zero_linger();
                    continue;
                }
                let stalled = stalled.clone();
                let mut reset = resetting.clone();
                let conn = tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let was_reset = tokio::select! {
                        _ = pump(&mut cr, &mut sw, stalled.clone()) => false,
                        _ = pump(&mut sr, &mut cw, stalled) => false,
                        r = reset.wait_for(|r| *r) => r.is_ok(),
                    };
                    if was_reset {
                        // Closing with a zero linger sends an RST to both peers.
                        let _ = cr.as_ref().set_zero_linger();
                        let _ = sr.as_ref().set_zero_linger();
                    }
                });
                let mut c = conns.lock().expect("proxy");
                c.retain(|h| !h.is_finished());
                c.push(conn);
            }
        });
        self.inner.lock().expect("proxy").acceptor = Some(acceptor);
    }

    /// Stops listening and cuts every connection; connecting to the port is then refused.
    pub async fn close(&self) {
        let (acceptor, conns) = {
            let mut st = self.inner.lock().expect("proxy");
            let conns: Vec<_> = st.conns.lock().expect("proxy").drain(..).collect();
            (st.acceptor.take(), conns)
        };
        if let Some(a) = acceptor {
            a.abort();
            let _ = a.await;
        }
        for c in conns {
            c.abort();
            let _ = c.await;
        }
    }

    /// Listens again on the same port.
    pub async fn reopen(&self) {
        let listener = bind_reuse(self.addr).await;
        self.serve(listener);
    }

    /// Closes the proxy for good.
    pub async fn shutdown(self) {
        self.close().await;
    }
}

/// Copies bytes from `r` to `w`, holding them while the proxy is stalled.
async fn pump(
    r: &mut tokio::net::tcp::OwnedReadHalf,
    w: &mut tokio::net::tcp::OwnedWriteHalf,
    mut stalled: tokio::sync::watch::Receiver<bool>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if stalled.wait_for(|s| !*s).await.is_err() {
            return;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

async fn bind_reuse(addr: SocketAddr) -> TcpListener {
    let s = TcpSocket::new_v4().expect("socket");
    s.set_reuseaddr(true).expect("SO_REUSEADDR");
    s.bind(addr).unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    s.listen(64).expect("listen")
}

/// Generates one `#[tokio::test]` per broker trial (`k_01` … `k_06`, `outage_mid_drain`,
/// `stalled_ack`).
/// `$b` is an expression evaluated per test whose value implements [`BrokerUnderTest`].
#[macro_export]
macro_rules! broker_suite {
    ($b:expr) => {
        $crate::broker_suite!(@tests $b; k_01, k_02, k_03, k_04, k_05, k_06, outage_mid_drain, stalled_ack);
    };
    (@tests $b:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let b = $b;
                $crate::broker::$name(&b).await;
            }
        )*
    };
}

/// The event the end-to-end trial writes: topic `topic`, key `key`, payload
/// `{"key": key, "seq": seq}`, header `tenant` = `t-<key>`, trace id `tr-<key>-<seq>`.
pub fn e2e_event(topic: &str, key: &str, seq: usize) -> NewEvent {
    event(topic, key, json!({"key": key, "seq": seq}))
        .header("tenant", format!("t-{key}"))
        .trace_id(format!("tr-{key}-{seq}"))
        .build()
        .expect("valid event")
}

/// End-to-end: drains `repo`, whose rows the caller wrote with [`e2e_event`] (`written` = per
/// partition key the ids in write order, all on `topic`), through a relay (max_per_key 5,
/// publish_concurrency 4) into the trial's broker, then reads the topic back as a consumer
/// would: every event arrives, per key in write order, with its payload and headers.
pub async fn drain_and_consume(
    t: &dyn BrokerTrial,
    repo: Arc<dyn OutboxRepository>,
    topic: &str,
    written: &HashMap<String, Vec<Uuid>>,
) {
    let relay = Relay::builder(repo, t.broker())
        .worker_id("e2e")
        .max_per_key(5)
        .publish_concurrency(4)
        .build()
        .expect("relay");
    let total: usize = written.values().map(Vec::len).sum();
    let mut completed = 0;
    let mut cycles = 0;
    loop {
        let r = relay.cycle(&CancellationToken::new()).await.expect("fetch");
        assert!(
            r.counted.is_empty() && r.transient.is_empty() && !r.commit_failed,
            "e2e: no failure: {r:?}"
        );
        completed += r.completed.len();
        if r.fetched.is_empty() {
            break;
        }
        cycles += 1;
        assert!(
            cycles <= 200,
            "e2e: the drain did not end within 200 cycles"
        );
    }
    assert_eq!(completed, total, "e2e: every row completed");
    let got = t.read(topic).await;
    assert_eq!(got.len(), total, "e2e: every event arrives once");
    let mut seen: HashMap<String, Vec<Uuid>> = HashMap::new();
    for m in &got {
        let key = m.attr("partition_key").expect("partition_key").to_owned();
        let id = Uuid::parse_str(m.attr("event_id").expect("event_id")).expect("uuid");
        let body = m.json();
        let seq = seen.get(&key).map_or(0, Vec::len);
        assert_eq!(
            body,
            json!({"key": key, "seq": seq}),
            "e2e: payload in key order"
        );
        let tenant = format!("t-{key}");
        assert_eq!(
            m.attr("tenant"),
            Some(tenant.as_str()),
            "e2e: the event's header"
        );
        let trace = format!("tr-{key}-{seq}");
        assert_eq!(m.attr("trace_id"), Some(trace.as_str()), "e2e: trace_id");
        assert_eq!(m.attr("topic"), Some(topic));
        seen.entry(key).or_default().push(id);
    }
    assert_eq!(&seen, written, "e2e: per key, the events in write order");
}
