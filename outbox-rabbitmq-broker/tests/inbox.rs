//! The inbox's RabbitMQ subscription against the machine's RabbitMQ (`AMQP_URL`, default
//! `amqp://guest:guest@127.0.0.1:5672/%2f`): the shared broker trials of `outbox-conformance`
//! (G-01, G-03, the poison message, dead-lettering) and the RabbitMQ scenarios J-23 to J-30 and
//! J-33 (brokers.md section 4.4). Each test declares fresh queues `inboxtest.q-{r}` (quorum
//! unless the scenario says classic) and deletes them at the end; messages are published through
//! the default exchange with a plain client, with publisher confirms.

mod common;

use std::sync::Mutex;

use common::{Arc, Duration, async_trait, fresh_suffix, server_addr, url, url_at};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;
use tokio::task::JoinHandle;
use txoutbox_conformance::amqp_proxy::{AmqpProxy, Mode};
use txoutbox_conformance::inbox::broker_subs::{SubscriptionTrial, SubscriptionUnderTest};
use txoutbox_conformance::inbox::ctx::{Recorder, g};
use txoutbox_conformance::inbox::harness::InboxHarness;
use txoutbox_conformance::inbox::memory::MemInboxHarness;
use txoutbox_conformance::inbox::script::{Act, Gate, ScriptedHandler};
use txoutbox_core::backoff::{Backoff, SeededRng};
use txoutbox_core::event::Status;
use txoutbox_core::inbox::decode::{AmqpValue, BrokerMessage};
use txoutbox_core::inbox::repository::InboxRepository;
use txoutbox_core::inbox::subscription::SubscriptionCapabilities;
use txoutbox_core::inbox::{
    AckHandle, DeliveryOutcome as O, InMemoryInbox, InboxDelivery, OnFailure, Runner,
    RunnerBuilder, Subscription, SubscriptionError,
};
use txoutbox_rabbitmq_broker::{
    DeadLetterMode, QueueType, RabbitMqBrokerConfig, RabbitSubscription, RabbitSubscriptionConfig,
};

// ---- The broker side: queues and a confirmed publisher ----

async fn connect() -> Connection {
    Connection::connect(&url(), ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("RabbitMQ at {} is unreachable: {e}", url()))
}

/// Declares a durable queue (deleting an old one of that name) with these arguments.
async fn declare(ch: &Channel, name: &str, args: &[(&str, AMQPValue)]) {
    let _ = ch
        .queue_delete(name.into(), QueueDeleteOptions::default())
        .await;
    let mut t = FieldTable::default();
    for (k, v) in args {
        t.insert(ShortString::from(*k), v.clone());
    }
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        t,
    )
    .await
    .unwrap_or_else(|e| panic!("declare queue {name}: {e}"));
}

fn quorum() -> (&'static str, AMQPValue) {
    ("x-queue-type", AMQPValue::LongString("quorum".into()))
}

fn text(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

fn headers(attrs: &[(&str, &str)]) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in attrs {
        t.insert(ShortString::from(*k), text(v));
    }
    t
}

/// One test's broker objects: queue `q` (and whatever else it declares), a confirm channel.
struct Broker {
    q: String,
    r: String,
    ch: Channel,
    _conn: Connection,
    extra: Mutex<Vec<String>>,
}

impl Broker {
    async fn new(args: &[(&str, AMQPValue)]) -> Self {
        let conn = connect().await;
        let ch = conn.create_channel().await.expect("channel");
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        let r = fresh_suffix();
        let q = format!("inboxtest.q-{r}");
        declare(&ch, &q, args).await;
        Self {
            q,
            r,
            ch,
            _conn: conn,
            extra: Mutex::default(),
        }
    }

    /// Declares another queue, deleted at cleanup.
    async fn queue(&self, name: &str, args: &[(&str, AMQPValue)]) {
        declare(&self.ch, name, args).await;
        self.extra.lock().unwrap().push(name.to_owned());
    }

    fn dead_letter_queue(&self) -> String {
        format!("{}.dead-letter", self.q)
    }

    /// Publishes to `q` through the default exchange and waits for the broker's confirm.
    async fn publish(&self, props: BasicProperties, body: &[u8]) {
        let confirm = self
            .ch
            .basic_publish(
                "".into(),
                self.q.as_str().into(),
                BasicPublishOptions::default(),
                body,
                props.with_delivery_mode(2),
            )
            .await
            .expect("publish")
            .await
            .expect("confirm");
        assert!(confirm.is_ack(), "the broker took the message");
    }

    /// Publishes a message with event_id `id` on key `key` (none: no partition_key).
    async fn publish_event(&self, id: &str, key: Option<&str>, n: i64) {
        let mut attrs = vec![("event_id", id), ("topic", "src"), ("event_type", "e")];
        if let Some(k) = key {
            attrs.push(("partition_key", k));
        }
        let body = json!({"key": key, "n": n}).to_string();
        self.publish(
            BasicProperties::default().with_headers(headers(&attrs)),
            body.as_bytes(),
        )
        .await;
    }

    /// The number of ready messages in a queue (a passive declare).
    async fn ready(&self, queue: &str) -> u32 {
        let ch = connect().await.create_channel().await.expect("channel");
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("passive declare")
        .message_count()
    }

    async fn cleanup(&self) {
        let mut names = vec![self.q.clone()];
        names.extend(self.extra.lock().unwrap().iter().cloned());
        for n in names {
            let _ = self
                .ch
                .queue_delete(n.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
}

// ---- The shared broker trials ----

struct RabbitInbox;

struct Trial(Broker);

#[async_trait]
impl SubscriptionTrial for Trial {
    async fn publish(&self, attrs: &[(&str, &str)], body: &str) {
        self.0
            .publish(
                BasicProperties::default().with_headers(headers(attrs)),
                body.as_bytes(),
            )
            .await;
    }

    async fn subscription(
        &self,
        _worker: &str,
        _redeliver_after: Duration,
    ) -> Arc<dyn Subscription> {
        Arc::new(
            RabbitSubscription::start(sub_config(&self.0.q, url()).concurrency(2))
                .await
                .expect("start the subscription"),
        )
    }

    fn no_second_reader_on_demand(&self) -> Option<&'static str> {
        Some(
            "RabbitMQ pushes the copy into the first runner's prefetch window (2 x concurrency); \
             a prefetch of 1 would keep the other trials' runners from holding deliveries that \
             wait for their key (G-08)",
        )
    }

    /// RabbitMQ returns a killed runner's deliveries as soon as its connection closes.
    fn redelivery_floor(&self, _redeliver_after: Duration) -> Duration {
        Duration::ZERO
    }

    async fn cleanup(&self) {
        self.0.cleanup().await;
    }
}

#[async_trait]
impl SubscriptionUnderTest for RabbitInbox {
    async fn trial(&self) -> Box<dyn SubscriptionTrial> {
        let b = Broker::new(&[quorum()]).await;
        let dl = b.dead_letter_queue();
        b.queue(&dl, &[]).await;
        Box::new(Trial(b))
    }
}

txoutbox_conformance::inbox_broker_suite!(RabbitInbox);

/// J-38, R136's bound on RabbitMQ, given once to the runner: a rewound delivery is held in the
/// process (RabbitMQ has no delayed redelivery), at most the runner's concurrency (1) at once;
/// the second failure, with no room, is recorded in its row and acknowledged (R126, R136,
/// R178). Before the transport layer each hold was a task of its own, unbounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_38() {
    txoutbox_conformance::inbox::broker_subs::rewinds_bounded_by_the_runner_concurrency(
        &RabbitInbox,
        true,
    )
    .await;
}

// ---- The J scenarios ----

fn sub_config(queue: &str, target: String) -> RabbitSubscriptionConfig {
    RabbitSubscriptionConfig::new(
        RabbitMqBrokerConfig::new(target)
            .connect_timeout(Duration::from_secs(2))
            .confirm_timeout(Duration::from_secs(5)),
        "g",
        [queue],
    )
}

/// One delivery as the runner got it.
#[derive(Debug, Clone)]
struct Seen {
    id: Option<String>,
    n: u32,
    redelivered: bool,
    delivery_count: Option<i64>,
    at: tokio::time::Instant,
}

/// An ack operation: its name, the message's id, when.
type Op = (&'static str, Option<String>, tokio::time::Instant);

/// A subscription that records what it hands out and every ack operation (op, id, when).
struct Spy {
    inner: Arc<dyn Subscription>,
    seen: Arc<Mutex<Vec<Seen>>>,
    ops: Arc<Mutex<Vec<Op>>>,
}

impl Spy {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
    fn ops(&self) -> Vec<Op> {
        self.ops.lock().unwrap().clone()
    }
    fn seen_of(&self, id: &str) -> Vec<Seen> {
        self.seen()
            .into_iter()
            .filter(|s| s.id.as_deref() == Some(id))
            .collect()
    }
}

struct SpyAck {
    inner: Arc<dyn AckHandle>,
    id: Option<String>,
    ops: Arc<Mutex<Vec<Op>>>,
}

impl SpyAck {
    fn note(&self, op: &'static str) {
        self.ops
            .lock()
            .unwrap()
            .push((op, self.id.clone(), tokio::time::Instant::now()));
    }
}

#[async_trait]
impl AckHandle for SpyAck {
    async fn commit(&self) -> Result<(), SubscriptionError> {
        self.note("commit");
        self.inner.commit().await
    }
    async fn rewind(&self, delay: Duration) -> Result<(), SubscriptionError> {
        self.note("rewind");
        self.inner.rewind(delay).await
    }
    async fn term(&self, reason: &str) -> Result<(), SubscriptionError> {
        self.note("term");
        self.inner.term(reason).await
    }
    async fn renew(&self) -> Result<(), SubscriptionError> {
        self.inner.renew().await
    }
    async fn dead_letter(&self, reason: &str, group: &str) -> Result<(), SubscriptionError> {
        self.note("dead_letter");
        self.inner.dead_letter(reason, group).await
    }
}

fn id_of(m: &BrokerMessage) -> Option<String> {
    let BrokerMessage::RabbitMq {
        headers,
        message_id,
        ..
    } = m
    else {
        return None;
    };
    headers
        .iter()
        .find_map(|(k, v)| match v {
            AmqpValue::Text(s) if k == "event_id" => Some(s.clone()),
            _ => None,
        })
        .or_else(|| message_id.clone())
}

#[async_trait]
impl Subscription for Spy {
    fn capabilities(&self) -> SubscriptionCapabilities {
        self.inner.capabilities()
    }
    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        let mut v = self.inner.next(max, wait).await?;
        let now = tokio::time::Instant::now();
        for d in &mut v {
            let BrokerMessage::RabbitMq {
                redelivered,
                headers,
                ..
            } = &d.message
            else {
                panic!("not a RabbitMQ delivery");
            };
            let id = id_of(&d.message);
            self.seen.lock().unwrap().push(Seen {
                id: id.clone(),
                n: d.delivery_number,
                redelivered: *redelivered,
                delivery_count: headers.iter().find_map(|(k, v)| match v {
                    AmqpValue::Integer(i) if k == "x-delivery-count" => Some(*i),
                    _ => None,
                }),
                at: now,
            });
            d.ack = Arc::new(SpyAck {
                inner: d.ack.clone(),
                id,
                ops: self.ops.clone(),
            });
        }
        Ok(v)
    }
    async fn stop_reading(&self) {
        self.inner.stop_reading().await
    }
    async fn close(&self) {
        self.inner.close().await
    }
}

struct Bed {
    h: Arc<MemInboxHarness>,
    handler: Arc<ScriptedHandler<MemInboxHarness>>,
    rec: Arc<Recorder>,
    b: Broker,
}

struct Running {
    runner: Arc<Runner<InMemoryInbox>>,
    task: JoinHandle<()>,
    spy: Arc<Spy>,
}

impl Running {
    async fn stop(self) -> Arc<Spy> {
        self.runner.stop();
        let _ = self.task.await;
        self.spy
    }
    /// A crash: the loop and its subscription are dropped, and the connection closes with it.
    fn kill(self) -> Arc<Spy> {
        self.task.abort();
        self.spy
    }
}

impl Bed {
    async fn new(args: &[(&str, AMQPValue)]) -> Self {
        let h = Arc::new(MemInboxHarness::default());
        Self {
            handler: Arc::new(ScriptedHandler::new(h.clone())),
            h,
            rec: Arc::default(),
            b: Broker::new(args).await,
        }
    }

    fn config(&self) -> RabbitSubscriptionConfig {
        sub_config(&self.b.q, url())
    }

    async fn spy(&self, cfg: RabbitSubscriptionConfig) -> Arc<Spy> {
        Arc::new(Spy {
            inner: Arc::new(
                RabbitSubscription::start(cfg)
                    .await
                    .expect("start the subscription"),
            ),
            seen: Arc::default(),
            ops: Arc::default(),
        })
    }

    fn builder(&self, spy: &Arc<Spy>, worker: &str) -> RunnerBuilder<InMemoryInbox> {
        Runner::builder(self.h.backend(), spy.clone(), "g")
            .worker_id(worker)
            .handler(self.handler.clone())
            .process_stored(false)
            .sources(["src"])
            .messages_per_transaction(1)
            .concurrency(2)
            .hooks(self.rec.clone())
            .random_source(Box::new(SeededRng::new(7)))
    }

    /// Starts a runner with subscription settings `cfg`, built by `f`.
    async fn run_with(
        &self,
        worker: &str,
        cfg: RabbitSubscriptionConfig,
        f: impl FnOnce(RunnerBuilder<InMemoryInbox>) -> RunnerBuilder<InMemoryInbox>,
    ) -> Running {
        let spy = self.spy(cfg).await;
        let runner = Arc::new(
            f(self.builder(&spy, worker))
                .build()
                .expect("runner builds"),
        );
        runner.start();
        let r = runner.clone();
        let task = tokio::spawn(async move {
            r.run_until_stopped().await.expect("runner runs");
        });
        Running { runner, task, spy }
    }

    fn results_of(&self, id: &str) -> Vec<txoutbox_core::inbox::DeliveryResult> {
        self.rec
            .results()
            .into_iter()
            .filter(|r| r.message_id.as_deref() == Some(id))
            .collect()
    }

    /// Results of invalid deliveries (they carry no message id).
    fn invalid(&self) -> Vec<txoutbox_core::inbox::DeliveryResult> {
        self.rec
            .results()
            .into_iter()
            .filter(|r| r.outcome == O::Invalid)
            .collect()
    }

    fn completed(&self) -> Vec<String> {
        self.rec
            .results()
            .into_iter()
            .filter(|r| r.outcome == O::Completed)
            .filter_map(|r| r.message_id)
            .collect()
    }

    async fn wait_for(&self, what: &str, within: Duration, f: impl Fn(&Self) -> bool) {
        let deadline = tokio::time::Instant::now() + within;
        while !f(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {within:?} waiting for {what}; results: {:?}",
                self.rec.results()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn row_status(&self, id: &str) -> Option<(Status, i32)> {
        self.h
            .inbox
            .get_by_message_id(id, &g())
            .await
            .unwrap()
            .map(|r| (r.status, r.attempts_made))
    }
}

/// J-23: a commit is one basic.ack with the delivery's tag, sent after the row committed; no
/// nack or reject; once the runner's channel closed the queue holds nothing and nothing comes
/// back (R178).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_23() {
    let bed = Bed::new(&[quorum()]).await;
    let proxy = AmqpProxy::start(server_addr(), Mode::Forward).await;
    bed.handler.always(Act::Write);
    bed.b.publish_event("m1", Some("k1"), 0).await;
    let w1 = bed
        .run_with("w1", sub_config(&bed.b.q, url_at(proxy.addr())), |b| b)
        .await;
    bed.wait_for("m1 completed", Duration::from_secs(10), |b| {
        b.completed() == ["m1"]
    })
    .await;
    let r = &bed.results_of("m1")[0];
    assert!(r.committed && !r.commit_failed, "{r:?}");
    // The runner's channel closes with its stop.
    let spy = w1.stop().await;
    let commit_at = spy
        .ops()
        .iter()
        .find(|(op, ..)| *op == "commit")
        .map(|(.., t)| *t)
        .expect("the runner committed");
    let delivers = proxy.frames_of("basic.deliver");
    let acks = proxy.frames_of("basic.ack");
    assert_eq!(delivers.len(), 1, "{delivers:?}");
    assert_eq!(acks.len(), 1, "exactly one basic.ack: {acks:?}");
    assert_eq!(
        (acks[0].channel, acks[0].tag),
        (delivers[0].channel, delivers[0].tag),
        "the ack names the delivery"
    );
    assert!(
        acks[0].at >= commit_at,
        "the ack went after the row committed"
    );
    assert!(proxy.frames_of("basic.nack").is_empty());
    assert!(proxy.frames_of("basic.reject").is_empty());
    assert_eq!(
        bed.row_status("m1").await.map(|r| r.0),
        Some(Status::Completed)
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        bed.b.ready(&bed.b.q).await,
        0,
        "nothing came back to the queue"
    );
    assert_eq!(bed.h.effects().await, ["m1"]);
    bed.b.cleanup().await;
}

/// J-24: an ack lost with its connection: w1's ack is written on an open channel (so w1 counts
/// it committed) but never reaches the broker; once w1's connection is cut RabbitMQ delivers
/// m1 again, redelivered, to w2: a duplicate, committed. One row, one effect (R109, R178).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_24() {
    let bed = Bed::new(&[quorum()]).await;
    let proxy = AmqpProxy::start(server_addr(), Mode::DropAcks).await;
    bed.handler.always(Act::Write);
    bed.b.publish_event("m1", Some("k1"), 0).await;
    let w1 = bed
        .run_with("w1", sub_config(&bed.b.q, url_at(proxy.addr())), |b| b)
        .await;
    bed.wait_for("m1 completed by w1", Duration::from_secs(10), |b| {
        b.completed() == ["m1"]
    })
    .await;
    let r = &bed.results_of("m1")[0];
    assert!(r.committed, "w1: committed: {r:?}");
    let acks = proxy.frames_of("basic.ack");
    assert!(acks.len() == 1 && acks[0].dropped, "{acks:?}");
    proxy.cut();
    let w2 = bed.run_with("w2", bed.config(), |b| b).await;
    bed.wait_for("m1's second delivery ended", Duration::from_secs(10), |b| {
        b.results_of("m1").len() == 2
    })
    .await;
    let spy2 = w2.stop().await;
    w1.kill();
    let second = &bed.results_of("m1")[1];
    assert_eq!(second.outcome, O::Duplicate, "{second:?}");
    assert!(second.committed);
    let seen = spy2.seen_of("m1");
    assert!(seen.len() == 1 && seen[0].redelivered, "{seen:?}");
    assert_eq!(bed.h.inbox.rows().len(), 1);
    assert_eq!(bed.h.effects().await, ["m1"]);
    assert_eq!(bed.b.ready(&bed.b.q).await, 0);
    bed.b.cleanup().await;
}

/// J-25 on one queue kind: m1 fails once under on_failure rewind and is held for d ∈ [0.5, 1] s
/// while m2 (another key, published after it) completes; m1 comes back no sooner than d after
/// the rewind, redelivered, with n = 2, and completes. Effects [m2, m1] (R127, R146, R178).
async fn j_25_on(args: &[(&str, AMQPValue)], kind: QueueType) {
    let bed = Bed::new(args).await;
    bed.handler
        .script("m1", vec![Act::Fail("x".into()), Act::Write]);
    bed.handler.script("m2", vec![Act::Write]);
    bed.b.publish_event("m1", Some("k1"), 0).await;
    bed.b.publish_event("m2", Some("k2"), 0).await;
    let w1 = bed
        .run_with("w1", bed.config().queue_type(kind), |b| {
            b.on_failure(OnFailure::Rewind)
                .backoff(Backoff::new(1.0, 8.0).expect("backoff"))
        })
        .await;
    bed.wait_for("m1 and m2 completed", Duration::from_secs(10), |b| {
        b.completed().len() == 2
    })
    .await;
    let spy = w1.stop().await;
    let rewound = bed.results_of("m1")[0].clone();
    assert_eq!(rewound.outcome, O::Rewound, "{rewound:?}");
    let d = rewound.rewind_delay.expect("a rewind delay");
    assert!(
        d >= Duration::from_millis(500) && d <= Duration::from_secs(1),
        "d = {d:?}"
    );
    let rewound_at = spy
        .ops()
        .iter()
        .find(|(op, id, _)| *op == "rewind" && id.as_deref() == Some("m1"))
        .map(|(.., t)| *t)
        .expect("m1 rewound");
    let m1 = spy.seen_of("m1");
    assert_eq!(m1.len(), 2, "m1 reached no other consumer: {m1:?}");
    assert!(m1[1].at.duration_since(rewound_at) >= d, "back after d");
    assert!(m1[1].redelivered);
    assert_eq!(m1[1].n, 2, "{m1:?}");
    if kind == QueueType::Quorum {
        assert_eq!(m1[1].delivery_count, Some(1), "{m1:?}");
    }
    let m2_done = spy
        .ops()
        .iter()
        .find(|(op, id, _)| *op == "commit" && id.as_deref() == Some("m2"))
        .map(|(.., t)| *t)
        .expect("m2 committed");
    assert!(m2_done < m1[1].at, "m2 completed during m1's hold");
    assert_eq!(bed.h.effects().await, ["m2", "m1"]);
    assert_eq!(bed.b.ready(&bed.b.q).await, 0);
    bed.b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_25_quorum() {
    j_25_on(&[quorum()], QueueType::Quorum).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_25_classic() {
    j_25_on(&[], QueueType::Classic).await;
}

/// J-26: on a quorum queue with `x-delivery-limit` 6 and a runner with delivery_limit 6 and
/// max_attempts 6, a message that always fails transiently is rewound five times (delivery 1
/// without `x-delivery-count`, then 1 to 4) and its sixth delivery, the last, is recorded failed
/// and acked; nothing is dropped or dead-lettered. A runner with delivery_limit 3 is refused
/// (R128, R178, R182).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_26() {
    let bed = Bed::new(&[quorum(), ("x-delivery-limit", AMQPValue::LongLongInt(6))]).await;
    let e = RabbitSubscription::start(bed.config().max_attempts(6).delivery_limit(3))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("delivery_limit (3) is below max_attempts (6)"),
        "{e}"
    );
    bed.handler.always(Act::Transient("down".into()));
    bed.b.publish_event("m1", Some("k1"), 0).await;
    let w1 = bed
        .run_with("w1", bed.config().max_attempts(6).delivery_limit(6), |b| {
            b.on_failure(OnFailure::Rewind)
                .max_attempts(6)
                .backoff(Backoff::new(0.4, 8.0).expect("backoff"))
        })
        .await;
    bed.wait_for("m1 failed", Duration::from_secs(20), |b| {
        b.rec.results().iter().any(|r| r.terminal)
    })
    .await;
    let spy = w1.stop().await;
    let seen = spy.seen_of("m1");
    let counts: Vec<_> = seen.iter().map(|s| s.delivery_count).collect();
    assert_eq!(
        counts,
        [None, Some(1), Some(2), Some(3), Some(4), Some(5)],
        "{seen:?}"
    );
    let ns: Vec<_> = seen.iter().map(|s| s.n).collect();
    assert_eq!(ns, [1, 2, 3, 4, 5, 6]);
    let outcomes: Vec<_> = bed.results_of("m1").iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        [
            O::Rewound,
            O::Rewound,
            O::Rewound,
            O::Rewound,
            O::Rewound,
            O::Recorded
        ]
    );
    let row = bed
        .h
        .inbox
        .get_by_message_id("m1", &g())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Failed, 6, Some("down"))
    );
    assert!(
        bed.results_of("m1")[5].committed,
        "the last delivery was acked"
    );
    assert_eq!(bed.b.ready(&bed.b.q).await, 0, "the queue is empty");
    bed.b.cleanup().await;
}

/// J-26, variant: the database is down when the sixth delivery (the last) arrives. It is not
/// returned: the runner tries again every 1.0 s, and once the database is back records it as
/// (m1, failed, 6, `down`); no delivery carried `x-delivery-count` 6 (R132, R178, R182).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_26_db_down() {
    let bed = Bed::new(&[quorum(), ("x-delivery-limit", AMQPValue::LongLongInt(6))]).await;
    bed.handler.always(Act::Transient("down".into()));
    bed.b.publish_event("m1", Some("k1"), 0).await;
    let w1 = bed
        .run_with("w1", bed.config().max_attempts(6).delivery_limit(6), |b| {
            b.on_failure(OnFailure::Rewind)
                .max_attempts(6)
                .backoff(Backoff::new(0.4, 8.0).expect("backoff"))
        })
        .await;
    bed.wait_for("the fifth rewind", Duration::from_secs(15), |b| {
        b.results_of("m1").len() == 5
    })
    .await;
    bed.h.set_db_down(true);
    bed.wait_for("the sixth delivery", Duration::from_secs(5), |_| {
        w1.spy.seen_of("m1").len() == 6
    })
    .await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // While the database is down, each failed try of the last delivery is a persistence
    // failure and nothing is rewound.
    let tries = bed.results_of("m1")[5..].to_vec();
    assert!(
        tries
            .iter()
            .all(|r| r.outcome == O::PersistFailed && r.rewind_delay.is_none()),
        "the last delivery is tried in place: {tries:?}"
    );
    assert_eq!(w1.spy.seen_of("m1").len(), 6, "and not returned");
    bed.h.set_db_down(false);
    bed.wait_for("m1 failed", Duration::from_secs(5), |b| {
        b.rec.results().iter().any(|r| r.terminal)
    })
    .await;
    let spy = w1.stop().await;
    let seen = spy.seen_of("m1");
    assert_eq!(
        seen.len(),
        6,
        "the last delivery was kept, not returned: {seen:?}"
    );
    assert!(seen.iter().all(|s| s.delivery_count != Some(6)));
    assert_eq!(seen[5].n, 6);
    let row = bed
        .h
        .inbox
        .get_by_message_id("m1", &g())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Failed, 6, Some("down"))
    );
    let rewinds = spy.ops().iter().filter(|(op, ..)| *op == "rewind").count();
    assert_eq!(rewinds, 5, "the sixth delivery was never rewound");
    assert_eq!(bed.b.ready(&bed.b.q).await, 0);
    bed.b.cleanup().await;
}

/// J-34 (added by the suite): hold_max bounds the in-place retries of a last delivery. With
/// delivery_limit 1 every delivery is the last; the database is down when m1 arrives, so the
/// runner keeps it and tries again every 1.0 s; after hold_max (1 s) the subscription returns
/// it with basic.nack with requeue and RabbitMQ delivers it again. Once the database is back,
/// m1 is completed once: one row, one effect, the queue empty (R178, R182).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_34() {
    let bed = Bed::new(&[quorum()]).await;
    let proxy = AmqpProxy::start(server_addr(), Mode::Forward).await;
    bed.handler.always(Act::Write);
    bed.h.set_db_down(true);
    bed.b.publish_event("m1", Some("k1"), 0).await;
    let cfg = sub_config(&bed.b.q, url_at(proxy.addr()))
        .max_attempts(1)
        .delivery_limit(1)
        .hold_max(Duration::from_secs(1));
    let w1 = bed.run_with("w1", cfg, |b| b.max_attempts(1)).await;
    bed.wait_for("the first delivery", Duration::from_secs(5), |_| {
        !w1.spy.seen_of("m1").is_empty()
    })
    .await;
    let first_at = w1.spy.seen_of("m1")[0].at;
    bed.wait_for("m1 delivered again", Duration::from_secs(5), |_| {
        w1.spy.seen_of("m1").len() >= 2
    })
    .await;
    let nacks = proxy.frames_of("basic.nack");
    let delivers = proxy.frames_of("basic.deliver");
    assert!(
        !nacks.is_empty() && nacks[0].flag && nacks[0].tag == delivers[0].tag,
        "the first delivery was returned with basic.nack (requeue): {nacks:?}"
    );
    let held = nacks[0].at.duration_since(first_at);
    assert!(
        held >= Duration::from_millis(900) && held <= Duration::from_secs(3),
        "returned {held:?} after it was handed over"
    );
    assert!(proxy.frames_of("basic.reject").is_empty());
    bed.h.set_db_down(false);
    bed.wait_for("m1 completed", Duration::from_secs(10), |b| {
        b.completed() == ["m1"]
    })
    .await;
    // Let the deliveries still held end (each a duplicate once the row is there).
    bed.wait_for("m1 acked", Duration::from_secs(10), |b| {
        b.results_of("m1").iter().any(|r| r.committed)
    })
    .await;
    w1.stop().await;
    assert_eq!(bed.h.effects().await, ["m1"]);
    assert_eq!(bed.h.inbox.rows().len(), 1);
    assert_eq!(
        bed.row_status("m1").await.map(|r| r.0),
        Some(Status::Completed)
    );
    assert_eq!(bed.b.ready(&bed.b.q).await, 0);
    bed.b.cleanup().await;
}

/// J-27: an invalid message is copied to `q.dead-letter` with the body, message_id and headers
/// as received plus R140's headers, then acked; no row. (a) Without a dead-letter queue the copy
/// is returned: the delivery is held 1.0 s, returned, and comes back redelivered; nothing stored.
/// (b) With `dead_letter` = `broker`, the queue's own dead-letter exchange gets it, with an
/// `x-death` entry and no `Inbox-` header (R140, R178).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_27() {
    let bed = Bed::new(&[quorum()]).await;
    let dlq = bed.b.dead_letter_queue();
    bed.b.queue(&dlq, &[]).await;
    let bad = || {
        BasicProperties::default()
            .with_message_id("bad-1".into())
            .with_headers(headers(&[("tenant", "acme")]))
    };
    bed.b.publish(bad(), b"not json").await;
    let w1 = bed.run_with("w1", bed.config(), |b| b).await;
    bed.wait_for("the invalid delivery", Duration::from_secs(10), |b| {
        !b.invalid().is_empty()
    })
    .await;
    let spy = w1.stop().await;
    let ops: Vec<_> = spy.ops().iter().map(|(op, ..)| *op).collect();
    assert_eq!(ops, ["dead_letter", "term"], "copied, then acked");
    let copy = common::basic_get(&dlq).await.expect("the dead-letter copy");
    assert_eq!(copy.body, b"not json");
    assert_eq!(copy.message_id.as_deref(), Some("bad-1"));
    assert_eq!(copy.delivery_mode, Some(2));
    for (k, v) in [
        ("tenant", "acme"),
        ("Inbox-Invalid-Reason", "invalid message: body is not JSON"),
        ("Inbox-Consumer-Group", "g"),
        ("Inbox-Original-Queue", bed.b.q.as_str()),
        ("Inbox-Original-Exchange", ""),
        ("Inbox-Original-Routing-Key", bed.b.q.as_str()),
    ] {
        assert_eq!(copy.header(k), Some(v), "{k}: {copy:?}");
    }
    assert!(common::basic_get(&dlq).await.is_none(), "one copy");
    assert_eq!(bed.b.ready(&bed.b.q).await, 0);
    assert!(bed.h.inbox.rows().is_empty(), "no row");
    bed.b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_27_a() {
    let bed = Bed::new(&[quorum()]).await;
    bed.b
        .publish(
            BasicProperties::default().with_message_id("bad-1".into()),
            b"not json",
        )
        .await;
    let w1 = bed.run_with("w1", bed.config(), |b| b).await;
    bed.wait_for("two invalid deliveries", Duration::from_secs(10), |b| {
        b.invalid().len() >= 2
    })
    .await;
    let spy = w1.stop().await;
    let rs = bed.invalid();
    assert_eq!(
        rs[0].rewind_delay,
        Some(Duration::from_secs(1)),
        "{:?}",
        rs[0]
    );
    let seen = spy.seen_of("bad-1");
    assert!(!seen[0].redelivered && seen[1].redelivered, "{seen:?}");
    let rewound = spy
        .ops()
        .iter()
        .find(|(op, ..)| *op == "rewind")
        .map(|(.., t)| *t)
        .expect("rewound");
    assert!(
        seen[1].at.duration_since(rewound) >= Duration::from_secs(1),
        "held 1.0 s"
    );
    assert!(bed.h.inbox.rows().is_empty(), "nothing stored");
    bed.b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_27_b() {
    let r = fresh_suffix();
    let dlx = format!("inboxtest.dlx-{r}");
    let dlq = format!("inboxtest.dlq-{r}");
    let bed = Bed::new(&[quorum(), ("x-dead-letter-exchange", text(&dlx))]).await;
    bed.b
        .ch
        .exchange_declare(
            dlx.as_str().into(),
            ExchangeKind::Fanout,
            ExchangeDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("declare the dead-letter exchange");
    bed.b.queue(&dlq, &[]).await;
    bed.b
        .ch
        .queue_bind(
            dlq.as_str().into(),
            dlx.as_str().into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("bind");
    bed.b
        .publish(
            BasicProperties::default()
                .with_message_id("bad-1".into())
                .with_headers(headers(&[("tenant", "acme")])),
            b"not json",
        )
        .await;
    let w1 = bed
        .run_with(
            "w1",
            bed.config().dead_letter(DeadLetterMode::Broker),
            |b| b,
        )
        .await;
    bed.wait_for("the invalid delivery", Duration::from_secs(10), |b| {
        !b.invalid().is_empty()
    })
    .await;
    w1.stop().await;
    let mut got = None;
    for _ in 0..50 {
        got = common::basic_get(&dlq).await;
        if got.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let m = got.expect("the queue's dead-letter exchange got the message");
    assert_eq!(m.body, b"not json");
    let death = m
        .headers
        .get("x-death")
        .unwrap_or_else(|| panic!("an x-death entry: {m:?}"));
    // The reader gives other types in the client's debug form, strings as their bytes.
    let reason = format!(
        "\"reason\"): LongString(LongString({:?}))",
        b"rejected".to_vec()
    );
    let txoutbox_conformance::rabbitmq::HeaderValue::Other(death) = death else {
        panic!("x-death is an array: {death:?}");
    };
    assert!(death.contains(&reason), "{death}");
    assert!(
        m.headers.keys().all(|k| !k.starts_with("Inbox-")),
        "{:?}",
        m.headers
    );
    assert!(bed.h.inbox.rows().is_empty());
    let _ = bed
        .b
        .ch
        .exchange_delete(dlx.as_str().into(), Default::default())
        .await;
    bed.b.cleanup().await;
}

/// J-28 (a): with concurrency 4 and prefetch 8, w1 and w2 each run 4 deliveries and hold 4 more
/// unacknowledged (the queue keeps 4 ready), and w3 gets the other 4; once the gates open, 20
/// effects (R166, R177).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_28_a() {
    let bed = Bed::new(&[quorum()]).await;
    let gate = Gate::new();
    bed.handler.always(Act::Gate(gate.clone()));
    for i in 0..20 {
        bed.b.publish_event(&format!("m{i}"), None, i).await;
    }
    let cfg = || bed.config().concurrency(4).prefetch(8);
    let w1 = bed.run_with("w1", cfg(), |b| b.concurrency(4)).await;
    gate.reached(4).await;
    let w2 = bed.run_with("w2", cfg(), |b| b.concurrency(4)).await;
    gate.reached(8).await;
    // Let the prefetch fill.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(bed.b.ready(&bed.b.q).await, 4, "w1 and w2 hold 8 each");
    assert_eq!(
        (w1.spy.seen().len(), w2.spy.seen().len()),
        (4, 4),
        "4 running each"
    );
    let w3 = bed.run_with("w3", cfg(), |b| b.concurrency(4)).await;
    gate.reached(12).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(w3.spy.seen().len(), 4, "w3 got the other 4");
    assert_eq!(bed.b.ready(&bed.b.q).await, 0);
    gate.open();
    bed.wait_for("20 completions", Duration::from_secs(15), |b| {
        b.completed().len() == 20
    })
    .await;
    for w in [w1, w2, w3] {
        w.stop().await;
    }
    let mut effects = bed.h.effects().await;
    effects.sort();
    effects.dedup();
    assert_eq!(effects.len(), 20);
    bed.b.cleanup().await;
}

/// J-28 (b) and (c): 10 keys × 20 messages, two runners: every message completed once, and
/// both runners handled some; on a single-active-consumer queue one runner handled all, each
/// key in publish order (R119, R177).
async fn j_28_shared(single_active: bool) {
    let mut args = vec![quorum()];
    if single_active {
        args.push(("x-single-active-consumer", AMQPValue::Boolean(true)));
    }
    let bed = Bed::new(&args).await;
    bed.handler.always(Act::Write);
    let mut ids = Vec::new();
    for n in 0..20 {
        for k in 0..10 {
            let id = format!("k{k}-{n:02}");
            bed.b.publish_event(&id, Some(&format!("k{k}")), n).await;
            ids.push(id);
        }
    }
    let cfg = || bed.config().concurrency(4).prefetch(8);
    let w1 = bed.run_with("w1", cfg(), |b| b.concurrency(4)).await;
    let w2 = bed.run_with("w2", cfg(), |b| b.concurrency(4)).await;
    bed.wait_for("200 completions", Duration::from_secs(30), |b| {
        b.completed().len() >= 200
    })
    .await;
    let (s1, s2) = (w1.stop().await, w2.stop().await);
    let mut effects = bed.h.effects().await;
    if single_active {
        let (a, b) = (s1.seen().len(), s2.seen().len());
        assert!(a == 0 || b == 0, "one runner handled all: {a} and {b}");
        for k in 0..10 {
            let mine: Vec<_> = effects
                .iter()
                .filter(|e| e.starts_with(&format!("k{k}-")))
                .cloned()
                .collect();
            let mut sorted = mine.clone();
            sorted.sort();
            assert_eq!(mine, sorted, "key k{k} in publish order");
        }
    } else {
        assert!(
            !s1.seen().is_empty() && !s2.seen().is_empty(),
            "both runners handled some"
        );
    }
    effects.sort();
    ids.sort();
    assert_eq!(effects, ids, "each message once");
    assert!(
        bed.h
            .inbox
            .rows()
            .iter()
            .all(|r| r.status == Status::Completed)
            && bed.h.inbox.rows().len() == 200
    );
    bed.b.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_28_b() {
    j_28_shared(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_28_c() {
    j_28_shared(true).await;
}

/// J-29: w1 starts m1 and waits at the gate; its connection closes (the runner is killed); w2
/// gets m1 within 3 s, redelivered, and completes it; one effect (R119, R178).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_29() {
    let bed = Bed::new(&[quorum()]).await;
    let gate = Gate::new();
    bed.handler
        .script("m1", vec![Act::Gate(gate.clone()), Act::Write]);
    bed.b.publish_event("m1", Some("k1"), 0).await;
    let w1 = bed.run_with("w1", bed.config(), |b| b).await;
    let w2 = bed.run_with("w2", bed.config(), |b| b).await;
    tokio::time::timeout(Duration::from_secs(10), gate.reached(1))
        .await
        .expect("a runner starts m1");
    // Whoever got it first is the one killed.
    let (first, other) = if w1.spy.seen().is_empty() {
        (w2, w1)
    } else {
        (w1, w2)
    };
    first.kill();
    let killed = tokio::time::Instant::now();
    bed.wait_for(
        "m1 completed by the other runner",
        Duration::from_secs(3),
        |b| b.completed() == ["m1"],
    )
    .await;
    let spy = other.stop().await;
    let seen = spy.seen_of("m1");
    assert!(seen.len() == 1 && seen[0].redelivered, "{seen:?}");
    assert!(seen[0].at.duration_since(killed) <= Duration::from_secs(3));
    assert_eq!(bed.h.effects().await, ["m1"]);
    bed.b.cleanup().await;
}

/// J-30: a prefetch below the concurrency and a missing queue are refused at start; a message
/// without an id is invalid (`message_id: missing`), copied to `q.dead-letter`, and leaves no
/// row and an empty queue (R138, R140, R177).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_30() {
    let bed = Bed::new(&[quorum()]).await;
    let e = RabbitSubscription::start(bed.config().concurrency(4).prefetch(2))
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("prefetch (2) is below concurrency (4)"),
        "{e}"
    );
    let nope = format!("nope-{}", bed.b.r);
    let e = RabbitSubscription::start(sub_config(&nope, url()))
        .await
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("RabbitMQ queue {nope:?} does not exist")
    );
    let dlq = bed.b.dead_letter_queue();
    bed.b.queue(&dlq, &[]).await;
    bed.b
        .publish(BasicProperties::default(), b"{\"n\": 1}")
        .await;
    let w1 = bed.run_with("w1", bed.config(), |b| b).await;
    bed.wait_for("the invalid delivery", Duration::from_secs(10), |b| {
        !b.rec.results().is_empty()
    })
    .await;
    w1.stop().await;
    let r = &bed.rec.results()[0];
    assert_eq!(r.outcome, O::Invalid);
    assert_eq!(
        r.error.as_deref(),
        Some("invalid message: message_id: missing")
    );
    let copy = common::basic_get(&dlq).await.expect("the copy");
    assert_eq!(
        copy.header("Inbox-Invalid-Reason"),
        Some("invalid message: message_id: missing")
    );
    assert_eq!(bed.b.ready(&bed.b.q).await, 0);
    assert!(bed.h.inbox.rows().is_empty());
    bed.b.cleanup().await;
}

/// J-33: stopping gives m2 (held, waiting for its key behind the gated m1) back with one
/// basic.nack with requeue and no basic.reject; m1 completes and is acked; w2 then receives m2
/// redelivered and completes it. On RabbitMQ 4.3 and later the nack is not counted (no
/// `x-delivery-count`, n = 1); earlier releases count it (`x-delivery-count` 1, n = 2)
/// (R167, R178).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_33() {
    let bed = Bed::new(&[quorum()]).await;
    let proxy = AmqpProxy::start(server_addr(), Mode::Forward).await;
    let gate = Gate::new();
    bed.handler
        .script("m1", vec![Act::Gate(gate.clone()), Act::Write]);
    bed.handler.script("m2", vec![Act::Write]);
    bed.b.publish_event("m1", Some("k"), 0).await;
    bed.b.publish_event("m2", Some("k"), 1).await;
    let w1 = bed
        .run_with(
            "w1",
            sub_config(&bed.b.q, url_at(proxy.addr()))
                .concurrency(2)
                .prefetch(4),
            |b| b.concurrency(2),
        )
        .await;
    tokio::time::timeout(Duration::from_secs(10), gate.reached(1))
        .await
        .expect("w1 starts m1");
    bed.wait_for("w1 holds m2", Duration::from_secs(5), |_| {
        w1.spy.seen_of("m2").len() == 1
    })
    .await;
    w1.runner.stop();
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.open();
    let spy1 = w1.stop().await;
    assert!(spy1.seen_of("m2").len() == 1);
    let m1 = bed.results_of("m1");
    assert!(
        m1.len() == 1 && m1[0].outcome == O::Completed && m1[0].committed,
        "{m1:?}"
    );
    let delivers = proxy.frames_of("basic.deliver");
    assert_eq!(delivers.len(), 2, "{delivers:?}");
    let nacks = proxy.frames_of("basic.nack");
    assert_eq!(nacks.len(), 1, "{nacks:?}");
    assert!(nacks[0].flag, "with requeue");
    assert_eq!(nacks[0].tag, delivers[1].tag, "m2's tag");
    assert!(proxy.frames_of("basic.reject").is_empty());
    assert_eq!(proxy.frames_of("basic.ack").len(), 1, "m1 acked");
    let w2 = bed.run_with("w2", bed.config(), |b| b).await;
    bed.wait_for("m2 completed", Duration::from_secs(10), |b| {
        b.completed().len() == 2
    })
    .await;
    let spy2 = w2.stop().await;
    let m2 = spy2.seen_of("m2");
    assert!(m2.len() == 1 && m2[0].redelivered, "{m2:?}");
    let version = proxy.server_version().expect("the server's version");
    let parts: Vec<u32> = version
        .split('.')
        .take(2)
        .map(|p| p.parse().unwrap_or(0))
        .collect();
    if (parts[0], parts.get(1).copied().unwrap_or(0)) >= (4, 3) {
        assert_eq!((m2[0].delivery_count, m2[0].n), (None, 1), "{version}");
    } else {
        assert_eq!((m2[0].delivery_count, m2[0].n), (Some(1), 2), "{version}");
    }
    assert_eq!(bed.h.effects().await, ["m1", "m2"]);
    bed.b.cleanup().await;
}

/// Issue 28: PostgreSQL cut for 3 s (through a proxy: connections refused, then reset) while
/// messages come: no message completes more than 5 s after it is back, each once, each key in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_37() {
    use txoutbox_conformance::inbox::broker_subs::{DbFault, database_outage};
    for fault in [DbFault::Refuse, DbFault::Reset] {
        let db = txoutbox_testkit::inbox::PgOutageInbox::default();
        let f = database_outage(&RabbitInbox, &db, fault).await;
        println!("{f}");
    }
}
