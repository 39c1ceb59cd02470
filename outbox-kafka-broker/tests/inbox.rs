//! The inbox's Kafka subscription against the broker at `KAFKA_BROKERS` (default
//! `127.0.0.1:9092`, the Tansu broker `.ci/run` starts; point it at a real Kafka to run the same
//! trials there): the shared broker trials of `outbox-conformance` (G-01, G-03, the poison
//! message, dead-lettering) and the Kafka scenarios J-16 (without its proxy part), J-17, J-18,
//! J-20, J-21, J-22 and the Kafka part of J-33. Each test uses a fresh topic `in.src-{r}` and a
//! fresh Kafka group `g-{r}` (the inbox group is `g`), deleted at the end.

mod common;

use std::sync::Mutex;

use common::*;
use krafka::Record;
use tokio::task::JoinHandle;
use txoutbox_conformance::inbox::broker_subs::{SubscriptionTrial, SubscriptionUnderTest};
use txoutbox_conformance::inbox::ctx::{Recorder, g};
use txoutbox_conformance::inbox::harness::InboxHarness;
use txoutbox_conformance::inbox::memory::MemInboxHarness;
use txoutbox_conformance::inbox::script::{Act, Gate, ScriptedHandler};
use txoutbox_conformance::kafka::{KafkaCapability, KafkaUnderTest, report};
use txoutbox_conformance::kafka_proxy::{DropFirstProduceAnswer, Mode, OFFSET_COMMIT};
use txoutbox_core::backoff::SeededRng;
use txoutbox_core::event::Status;
use txoutbox_core::inbox::repository::InboxRepository;
use txoutbox_core::inbox::{
    AckStrategy, AncestorAckSettings, CommitOffsetPolicy, DeliveryOutcome as O, InMemoryInbox,
    OnFailure, Runner, RunnerBuilder, Subscription,
};
use txoutbox_kafka_broker::{KafkaSubscription, KafkaSubscriptionConfig};

/// One fresh topic `in.src-{r}` (with its dead-letter topic) and Kafka group `g-{r}`.
struct Topic {
    r: String,
    partitions: i32,
    bootstrap: String,
}

impl Topic {
    async fn new(partitions: i32) -> Self {
        let t = Self::without_dead_letter(partitions).await;
        create_topic(&t.dead_letter(), 1, &[]).await;
        t
    }
    async fn without_dead_letter(partitions: i32) -> Self {
        Self::at(&brokers(), partitions).await
    }
    /// A topic (without dead-letter topic) on the broker bootstrapped at `bootstrap`.
    async fn at(bootstrap: &str, partitions: i32) -> Self {
        let t = Self {
            r: fresh_suffix(),
            partitions,
            bootstrap: bootstrap.to_owned(),
        };
        create_topic_at(bootstrap, &t.name(), partitions, &[]).await;
        t
    }
    /// The topic under the prefix `in.`.
    fn short(&self) -> String {
        format!("src-{}", self.r)
    }
    fn name(&self) -> String {
        format!("in.{}", self.short())
    }
    fn dead_letter(&self) -> String {
        format!("{}.dead-letter", self.name())
    }
    fn group(&self) -> String {
        format!("g-{}", self.r)
    }
    fn config(&self, worker: &str) -> KafkaSubscriptionConfig {
        KafkaSubscriptionConfig::new(
            KafkaBrokerConfig::new(self.bootstrap.clone())
                .topic_prefix("in.")
                .idempotence(Idempotence::Off),
            "g",
            [self.short()],
        )
        // The inbox's group is the runner's ("g"); the Kafka group, fresh per trial.
        .kafka_group_id(self.group())
        .client_id(worker)
        .session_timeout(Duration::from_secs(6))
    }
    async fn sub(&self, worker: &str) -> KafkaSubscription {
        KafkaSubscription::connect(self.config(worker))
            .await
            .expect("connect the subscription")
    }
    /// A plain record: headers, key, value (none: a tombstone), to `partition` (0 unless
    /// the topic has more and none is given: then the producer's default).
    async fn send(
        &self,
        partition: Option<i32>,
        headers: &[(&str, &str)],
        key: Option<&str>,
        value: Option<&str>,
    ) {
        let kafka = client_at(&self.bootstrap).await;
        let p = kafka
            .producer()
            .idempotent(false)
            .acks(krafka::producer::Acks::All)
            .build()
            .await
            .expect("producer");
        let mut rec = Record::new(self.name(), Vec::<u8>::new()).without_key();
        rec = match value {
            Some(v) => rec.value(v.as_bytes().to_vec()),
            None => rec.without_value(),
        };
        if let Some(k) = key {
            rec = rec.key(k.as_bytes().to_vec());
        }
        if let Some(pt) = partition.or((self.partitions == 1).then_some(0)) {
            rec = rec.partition(pt);
        }
        for (k, v) in headers {
            rec = rec.header(*k, v.as_bytes().to_vec());
        }
        let m = p.send(rec).await.expect("send");
        assert!(m.is_persisted(), "{m:?}");
        let _ = p.close().await;
    }
    /// An event `id` on inbox key `key`, as the shared trials publish it.
    async fn event(&self, id: &str, key: &str) {
        let body = serde_json::json!({"key": key, "id": id}).to_string();
        self.send(
            None,
            &[
                ("event_id", id),
                ("topic", "src"),
                ("event_type", "e"),
                ("partition_key", key),
            ],
            Some(key),
            Some(&body),
        )
        .await;
    }
    /// The group's committed offset of partition `p`, read by a client outside the group.
    async fn committed(&self, p: i32) -> Option<i64> {
        let kafka = client_at(&self.bootstrap).await;
        let c = kafka
            .consumer(self.group())
            .build()
            .await
            .expect("consumer");
        let m = c
            .committed(&[(self.name().as_str(), p)])
            .await
            .expect("committed offsets");
        drop(c);
        m.get(&(self.name(), p))
            .map(|c| c.offset)
            .filter(|o| *o >= 0)
    }
    async fn cleanup(&self) {
        let admin = client_at(&self.bootstrap).await.admin();
        let _ = admin
            .delete_topics([self.name(), self.dead_letter()], Default::default())
            .await;
    }
}

// ---- the shared broker trials ----

struct Tansu;

#[async_trait]
impl SubscriptionTrial for Topic {
    async fn publish(&self, attrs: &[(&str, &str)], body: &str) {
        let key = attrs
            .iter()
            .find(|(k, _)| *k == "partition_key")
            .map(|(_, v)| *v);
        self.send(None, attrs, key, Some(body)).await;
    }

    /// The session timeout stands for the broker's redelivery time (at least 2 s).
    /// Returns once the member holds partitions, so that runners built one after the other
    /// share the topic's two partitions before either runs.
    async fn subscription(&self, worker: &str, redeliver_after: Duration) -> Arc<dyn Subscription> {
        let sub = KafkaSubscription::connect(self.config(worker).session_timeout(
            redeliver_after.clamp(Duration::from_secs(2), Duration::from_secs(10)),
        ))
        .await
        .expect("connect the subscription");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
        while sub.assignment().await.is_empty() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{worker} got no partition within 15 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Arc::new(sub)
    }

    fn no_second_reader_on_demand(&self) -> Option<&'static str> {
        Some("a Kafka partition is read by one member of the group at a time (R175)")
    }

    async fn cleanup(&self) {
        Topic::cleanup(self).await;
    }
}

#[async_trait]
impl SubscriptionUnderTest for Tansu {
    async fn trial(&self) -> Box<dyn SubscriptionTrial> {
        // Two partitions: the trials' keys k0 to k2 hash to partition 1, k3 and k to 0.
        Box::new(Topic::new(2).await)
    }
}

txoutbox_conformance::inbox_broker_suite!(Tansu);

// ---- the J scenarios ----

struct Bed {
    h: Arc<MemInboxHarness>,
    handler: Arc<ScriptedHandler<MemInboxHarness>>,
    rec: Arc<Recorder>,
    t: Topic,
}

struct Running {
    runner: Arc<Runner<InMemoryInbox>>,
    task: JoinHandle<()>,
    sub: KafkaSubscription,
}

impl Running {
    async fn stop(self) {
        self.runner.stop();
        let _ = self.task.await;
    }
    /// The loop and its subscription are dropped with their deliveries unended: the member
    /// stops answering without leaving the group.
    async fn kill(self) {
        self.task.abort();
        let _ = self.task.await;
    }
}

impl Bed {
    async fn new(partitions: i32) -> Self {
        Self {
            t: Topic::new(partitions).await,
            ..Self::new_without_topic()
        }
    }
    /// A bed whose topic the caller gives (a placeholder topic name that is never created).
    fn new_without_topic() -> Self {
        let h = Arc::new(MemInboxHarness::default());
        Self {
            handler: Arc::new(ScriptedHandler::new(h.clone())),
            h,
            rec: Arc::default(),
            t: Topic {
                r: String::new(),
                partitions: 1,
                bootstrap: brokers(),
            },
        }
    }

    async fn builder(&self, worker: &str) -> (RunnerBuilder<InMemoryInbox>, KafkaSubscription) {
        let sub = self.t.sub(worker).await;
        let b = Runner::builder(self.h.backend(), Arc::new(sub.clone()), "g")
            .worker_id(worker)
            .handler(self.handler.clone())
            .process_stored(false)
            .sources(["src"])
            // The J scenarios of this file count on one message per transaction (batches.md:
            // R183's 1 keeps Part II word for word); with the default the runner refuses a
            // concurrency below 16.
            .messages_per_transaction(1)
            .concurrency(1)
            .hooks(self.rec.clone())
            .random_source(Box::new(SeededRng::new(7)));
        (b, sub)
    }

    fn run(&self, (b, sub): (RunnerBuilder<InMemoryInbox>, KafkaSubscription)) -> Running {
        let runner = Arc::new(b.build().expect("runner builds"));
        runner.start();
        let r = runner.clone();
        let task = tokio::spawn(async move {
            r.run_until_stopped().await.expect("runner runs");
        });
        Running { runner, task, sub }
    }

    fn outcomes(&self, id: &str) -> Vec<O> {
        self.rec
            .results()
            .into_iter()
            .filter(|r| r.message_id.as_deref() == Some(id))
            .map(|r| r.outcome)
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

    async fn wait_committed(&self, p: i32, want: i64, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let c = self.t.committed(p).await;
            if c == Some(want) {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "committed offset of partition {p} is {c:?}, not {want}, after {within:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn status(&self, id: &str) -> Option<Status> {
        self.h
            .inbox
            .get_by_message_id(id, &g())
            .await
            .unwrap()
            .map(|r| r.status)
    }
}

const WITHIN: Duration = Duration::from_secs(20);

/// J-16: the committed offset is 1, 2 and 3 after m1, m2 and m3, and each time the row was
/// committed before the offset moved; then, through a proxy that discards OffsetCommit
/// requests, m4 is commit_failed after commit_timeout (1 s), and after a kill the next owner
/// reads it again as a duplicate (R115, R131, R176). The proxy part runs against a private
/// Tansu the test starts (it advertises the proxy's address).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_16() {
    let b = Bed::new(1).await;
    b.handler.always(Act::Write);
    let w1 = b.run(b.builder("w1").await);
    for (i, id) in ["m1", "m2", "m3"].into_iter().enumerate() {
        b.t.event(id, &format!("k{i}")).await;
        b.wait_committed(0, i as i64 + 1, WITHIN).await;
        assert_eq!(
            b.status(id).await,
            Some(Status::Completed),
            "{id}'s row was committed when the offset moved past it"
        );
    }
    w1.stop().await;
    assert_eq!(b.h.effects().await, vec!["m1", "m2", "m3"]);
    b.t.cleanup().await;
    // With the proxy: an OffsetCommit that gets no answer is commit_failed after commit_timeout;
    // the next owner reads the record again, as a duplicate.
    let (listener, proxy_addr) = DropFirstProduceAnswer::bind().await;
    let Some(private) = TestKafka.private_broker(proxy_addr).await else {
        report("SKIPPED J-16 (proxy part): needs a broker the test can start behind its proxy");
        return;
    };
    let proxy = DropFirstProduceAnswer::with_mode(
        listener,
        private.listen,
        Mode::DropRequests(OFFSET_COMMIT),
    );
    let b = Bed {
        t: Topic::at(&proxy.addr().to_string(), 1).await,
        ..Bed::new_without_topic()
    };
    b.handler.always(Act::Write);
    let (bl, sub) = b.builder("w1").await;
    let w1 = b.run((bl.commit_timeout(Duration::from_secs(1)), sub));
    for (i, id) in ["m1", "m2", "m3"].into_iter().enumerate() {
        b.t.event(id, &format!("k{i}")).await;
        b.wait_committed(0, i as i64 + 1, WITHIN).await;
    }
    proxy.set_dropping(true);
    let sent = tokio::time::Instant::now();
    b.t.event("m4", "k3").await;
    b.wait_for("m4 ended", WITHIN, |b| !b.outcomes("m4").is_empty())
        .await;
    let took = sent.elapsed();
    let r4 = b
        .rec
        .results()
        .into_iter()
        .find(|r| r.message_id.as_deref() == Some("m4"))
        .unwrap();
    assert_eq!(
        (r4.outcome, r4.commit_failed),
        (O::Completed, true),
        "{r4:?}"
    );
    assert!(
        took < Duration::from_secs(5),
        "commit_failed after {took:?}"
    );
    assert!(
        proxy.produce_requests() >= 1,
        "an OffsetCommit was discarded"
    );
    w1.kill().await;
    proxy.set_dropping(false);
    let w2 = b.run(b.builder("w2").await);
    b.wait_committed(0, 4, Duration::from_secs(30)).await;
    w2.stop().await;
    assert_eq!(b.outcomes("m4"), vec![O::Completed, O::Duplicate]);
    assert_eq!(b.h.effects().await, vec!["m1", "m2", "m3", "m4"]);
    b.t.cleanup().await;
    drop(proxy);
    drop(private);
}

/// J-17: with concurrency 4 the commit does not pass m1 while it runs; after a kill the next
/// owner reads from offset 0: m1 completed, m2 and m3 duplicates, m4 after m1 (R144, R166, R176).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_17() {
    let b = Bed::new(1).await;
    let gate = Gate::new();
    b.handler
        .script("m1", vec![Act::Gate(gate.clone()), Act::Write]);
    b.handler.always(Act::Write);
    for (id, k) in [("m1", "a"), ("m2", "b"), ("m3", "c"), ("m4", "a")] {
        b.t.event(id, k).await;
    }
    let (bl, sub) = b.builder("w1").await;
    let w1 = b.run((bl.concurrency(4), sub));
    tokio::time::timeout(WITHIN, gate.reached(1))
        .await
        .expect("w1 starts m1");
    b.wait_for("m2 and m3 completed", WITHIN, |b| {
        b.outcomes("m2") == vec![O::Completed] && b.outcomes("m3") == vec![O::Completed]
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(b.t.committed(0).await.unwrap_or(0), 0, "m1 has not ended");
    assert_eq!(b.handler.runs_of("m4"), 0, "m4 waits for its key");
    w1.kill().await;
    let (bl, sub) = b.builder("w2").await;
    let w2 = b.run((bl.concurrency(4), sub));
    b.wait_committed(0, 4, Duration::from_secs(30)).await;
    w2.stop().await;
    assert_eq!(b.outcomes("m1"), vec![O::Completed]);
    assert_eq!(b.outcomes("m2"), vec![O::Completed, O::Duplicate]);
    assert_eq!(b.outcomes("m3"), vec![O::Completed, O::Duplicate]);
    assert_eq!(b.outcomes("m4"), vec![O::Completed]);
    let effects = b.h.effects().await;
    let mut sorted = effects.clone();
    sorted.sort();
    assert_eq!(sorted, vec!["m1", "m2", "m3", "m4"], "each id once");
    let pos = |id: &str| effects.iter().position(|e| e == id).unwrap();
    assert!(pos("m1") < pos("m4"), "{effects:?}");
    b.t.cleanup().await;
}

/// J-18, as amended by issue 28 (conformance README): a persistence error inside the runner's
/// loop no longer rewinds m1 by 1.0 s; the loop keeps m1 (and m3, waiting behind it on key a),
/// reads nothing and starts nothing until a probe finds the database answering, then runs m1
/// again. The partition is still held: no run of m3, nor (concurrency 1) of m2, before m1's
/// second run; committed 3 (R132 as amended, R146, R176). Variant with concurrency 4: m2
/// (another key) was already running at the gate and completes once, with no seek to read it
/// again; m3 never runs before m1's second run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_18() {
    for concurrency in [1usize, 4] {
        let b = Bed::new(1).await;
        b.handler.always(Act::Write);
        let gate = Gate::new();
        if concurrency == 4 {
            b.handler
                .script("m2", vec![Act::Gate(gate.clone()), Act::Write]);
        }
        for (id, k) in [("m1", "a"), ("m2", "b"), ("m3", "a")] {
            b.t.event(id, k).await;
        }
        b.h.fail_next_row_commit();
        let (bl, sub) = b.builder("w1").await;
        let w1 = b.run((bl.concurrency(concurrency), sub));
        b.wait_for("m1 persist_failed", WITHIN, |b| {
            b.outcomes("m1").first() == Some(&O::PersistFailed)
        })
        .await;
        let failed = b
            .rec
            .results()
            .into_iter()
            .find(|r| r.outcome == O::PersistFailed)
            .expect("m1's persist_failed result");
        assert_eq!(
            failed.rewind_delay, None,
            "c={concurrency}: m1 kept, not rewound"
        );
        gate.open();
        b.wait_for("m1 completed", WITHIN, |b| {
            b.outcomes("m1").contains(&O::Completed)
        })
        .await;
        b.wait_committed(0, 3, WITHIN).await;
        w1.stop().await;
        let runs = b.handler.run_ids();
        let m1_second = runs
            .iter()
            .enumerate()
            .filter(|(_, id)| *id == "m1")
            .nth(1)
            .map(|(i, _)| i)
            .expect("m1 ran twice");
        let m3_first = runs.iter().position(|id| id == "m3").expect("m3 ran");
        assert!(m3_first > m1_second, "c={concurrency}: runs {runs:?}");
        assert_eq!(b.outcomes("m3"), vec![O::Completed]);
        assert_eq!(
            b.outcomes("m2"),
            vec![O::Completed],
            "c={concurrency}: no seek, no re-read"
        );
        let effects = b.h.effects().await;
        if concurrency == 1 {
            let m2_first = runs.iter().position(|id| id == "m2").expect("m2 ran");
            assert!(m2_first > m1_second, "runs {runs:?}");
            assert_eq!(effects, vec!["m1", "m2", "m3"]);
        } else {
            let m2_first = runs.iter().position(|id| id == "m2").expect("m2 ran");
            assert!(m2_first < m1_second, "m2 ran meanwhile: runs {runs:?}");
            let mut sorted = effects.clone();
            sorted.sort();
            assert_eq!(
                sorted,
                vec!["m1", "m2", "m3"],
                "each effect once: {effects:?}"
            );
            let pos = |id: &str| effects.iter().position(|e| e == id).unwrap();
            assert!(pos("m1") < pos("m3"), "key a in order: {effects:?}");
        }
        b.t.cleanup().await;
    }
}

/// J-20: an invalid value and a tombstone are copied to `in.src-{r}.dead-letter` as received
/// with R140's headers; m3 completes; no rows; committed 3 (R139, R140, R176, R179). Variant,
/// needs `no_auto_create`: without the dead-letter topic r1 is rewound 1.0 s again and again,
/// r2 and m3 wait, and the committed offset stays 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_20() {
    let b = Bed::new(1).await;
    b.handler.always(Act::Write);
    b.t.send(Some(0), &[("tenant", "acme")], None, Some("not json"))
        .await;
    b.t.send(Some(0), &[("event_id", "r2")], Some("k"), None)
        .await;
    b.t.event("m3", "c").await;
    let w1 = b.run(b.builder("w1").await);
    b.wait_committed(0, 3, WITHIN).await;
    w1.stop().await;
    assert_eq!(b.outcomes("m3"), vec![O::Completed]);
    let dl = read_topic(&b.t.dead_letter()).await;
    assert_eq!(dl.len(), 2, "{dl:?}");
    let topic = b.t.name();
    let want = |r: &txoutbox_conformance::kafka::KafkaRecord, reason: &str, offset: &str| {
        assert_eq!(r.header("Inbox-Invalid-Reason").as_deref(), Some(reason));
        assert_eq!(r.header("Inbox-Consumer-Group").as_deref(), Some("g"));
        assert_eq!(
            r.header("Inbox-Original-Topic").as_deref(),
            Some(topic.as_str())
        );
        assert_eq!(r.header("Inbox-Original-Partition").as_deref(), Some("0"));
        assert_eq!(r.header("Inbox-Original-Offset").as_deref(), Some(offset));
    };
    want(&dl[0], "invalid message: body is not JSON", "0");
    assert_eq!(dl[0].value.as_deref(), Some(&b"not json"[..]));
    assert_eq!(dl[0].header("tenant").as_deref(), Some("acme"));
    assert_eq!(dl[0].key, None);
    want(&dl[1], "invalid message: record has no value", "1");
    assert_eq!(dl[1].value, None);
    assert_eq!(dl[1].key.as_deref(), Some(&b"k"[..]));
    assert!(b.status("r2").await.is_none());
    assert_eq!(b.h.effects().await, vec!["m3"]);
    b.t.cleanup().await;
    let caps = capabilities().await;
    if !caps.contains(&KafkaCapability::NoAutoCreate) {
        report(
            "SKIPPED J-20 (variant without the dead-letter topic): needs no_auto_create, which the broker under test does not declare",
        );
        return;
    }
    // Variant: no dead-letter topic. r1 is rewound 1.0 s again and again and holds the
    // partition: r2 and m3 are not handled, and the committed offset stays 0.
    let b = Bed {
        t: Topic::without_dead_letter(1).await,
        ..Bed::new_without_topic()
    };
    b.handler.always(Act::Write);
    b.t.send(Some(0), &[("tenant", "acme")], None, Some("not json"))
        .await;
    b.t.send(Some(0), &[("event_id", "r2")], Some("k"), None)
        .await;
    b.t.event("m3", "c").await;
    let w1 = b.run(b.builder("w1").await);
    let rewinds = |b: &Bed| {
        b.rec
            .results()
            .iter()
            .filter(|r| r.outcome == O::Invalid && r.rewind_delay == Some(Duration::from_secs(1)))
            .count()
    };
    b.wait_for("r1 rewound twice", WITHIN, |b| rewinds(b) >= 2)
        .await;
    w1.stop().await;
    let results = b.rec.results();
    assert!(
        results
            .iter()
            .all(|r| r.error.as_deref() == Some("invalid message: body is not JSON")),
        "only r1 was read: {results:?}"
    );
    assert_eq!(b.t.committed(0).await.unwrap_or(0), 0);
    assert!(b.h.effects().await.is_empty());
    b.t.cleanup().await;
}

/// J-21: two runners of one group share 4 partitions; a stop hands w2's partitions to w1, a
/// kill hands w1's to w2 after the session timeout; every message once, per-key order
/// (R119, R144, R167, R175, R176).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_21() {
    let b = Bed::new(4).await;
    b.handler.always(Act::Write);
    let adapter = KafkaBroker::connect(
        KafkaBrokerConfig::new(brokers())
            .topic_prefix("in.")
            .idempotence(Idempotence::Off),
    )
    .await
    .expect("adapter");
    // (event id, key, index) of every message published, in publish order.
    let published: Arc<Mutex<Vec<(String, usize, i64)>>> = Arc::default();
    let publish = |n: std::ops::Range<i64>| {
        let adapter = adapter.clone();
        let topic = b.t.short();
        let published = published.clone();
        async move {
            for i in n {
                for k in 0..10usize {
                    let row = txoutbox_core::NewEvent::builder()
                        .aggregate("test", uuid::Uuid::nil())
                        .topic(topic.clone())
                        .partition_key(format!("k{k}"))
                        .event_type("e")
                        .payload_json(serde_json::json!({"i": i}))
                        .build()
                        .expect("valid")
                        .into_row(chrono::Utc::now());
                    let m = txoutbox_core::Message::from_event(&row);
                    adapter.publish(&m).await.expect("publish");
                    published
                        .lock()
                        .unwrap()
                        .push((m.event_id.to_string(), k, i));
                }
            }
        }
    };
    publish(0..20).await;
    let c4 = |x: (RunnerBuilder<InMemoryInbox>, KafkaSubscription)| (x.0.concurrency(4), x.1);
    let w1 = b.run(c4(b.builder("w1").await));
    let w2 = b.run(c4(b.builder("w2").await));
    let done = |b: &Bed| {
        b.rec
            .results()
            .iter()
            .filter(|r| r.outcome == O::Completed)
            .count()
    };
    let deadline = tokio::time::Instant::now() + WITHIN;
    loop {
        let (a1, a2) = (w1.sub.assignment().await, w2.sub.assignment().await);
        if !a1.is_empty() && !a2.is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{a1:?} {a2:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    b.wait_for("100 completed", Duration::from_secs(60), |b| done(b) >= 100)
        .await;
    w2.stop().await;
    b.wait_for("200 completed", Duration::from_secs(60), |b| done(b) >= 200)
        .await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while w1.sub.assignment().await.len() < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "w1 holds all four within 15 s of w2's stop"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let w2 = b.run(c4(b.builder("w2").await));
    publish(20..22).await;
    b.wait_for("10 of the new ones", Duration::from_secs(60), |b| {
        done(b) >= 210
    })
    .await;
    w1.kill().await;
    let killed = tokio::time::Instant::now();
    let deadline = killed + Duration::from_secs(15);
    while w2.sub.assignment().await.len() < 4 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "w2 took all four within 15 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // After the kill, count committed effects, not `Completed` results: a run w1 committed
    // whose hook the kill cut off is redelivered to w2 as a `duplicate`, so the results may
    // never count 220 completions although every effect is there.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let n = b.h.effects().await.len();
        if n >= 220 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{n} of 220 effects within 60 s of the kill; results: {:?}",
            b.rec.results().len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w2.stop().await;
    let effects = b.h.effects().await;
    let mut sorted = effects.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 220);
    assert_eq!(effects.len(), 220, "each message's effect once");
    let order: std::collections::HashMap<String, (usize, i64)> = published
        .lock()
        .unwrap()
        .iter()
        .map(|(id, k, i)| (id.clone(), (*k, *i)))
        .collect();
    for k in 0..10usize {
        let of_key: Vec<i64> = effects
            .iter()
            .filter_map(|e| order.get(e))
            .filter(|(kk, _)| *kk == k)
            .map(|(_, i)| *i)
            .collect();
        assert_eq!(
            of_key,
            (0..22).collect::<Vec<i64>>(),
            "key k{k} in publish order"
        );
    }
    for r in b.rec.results() {
        assert!(matches!(r.outcome, O::Completed | O::Duplicate), "{r:?}");
    }
    b.t.cleanup().await;
}

/// J-22: on_failure rewind is refused at build (also through the ancestor's aliases); a new
/// group starts at the earliest offset; a failure is recorded, not rewound, and the commit
/// passes it (R123, R126, R175, R176).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_22() {
    let b = Bed::new(1).await;
    b.handler.always(Act::Write);
    b.handler.script("m4", vec![Act::Transient("down".into())]);
    for (id, k) in [("m1", "x"), ("m2", "y"), ("m3", "z"), ("m4", "a")] {
        b.t.event(id, k).await;
    }
    let w1 = b.run(b.builder("w1").await);
    b.wait_committed(0, 4, WITHIN).await;
    w1.stop().await;
    // The builds that are refused, after the run (each subscription joins the group).
    let want = "on_failure rewind is refused on Kafka: a rewind holds its whole partition";
    let (bl, _s1) = b.builder("w0").await;
    let e = bl.on_failure(OnFailure::Rewind).build();
    let e = refused(e);
    assert_eq!(e.to_string(), want);
    let (bl, _s2) = b.builder("w0").await;
    let e = bl
        .ancestor_ack_settings(AncestorAckSettings {
            ack_strategy: Some(AckStrategy::AtLeastOnce),
            commit_offset_policy: Some(CommitOffsetPolicy::OnSuccess),
            exactly_once_commit_on_failed: None,
        })
        .build();
    let e = refused(e);
    assert_eq!(e.to_string(), want);
    _s1.close().await;
    _s2.close().await;
    for id in ["m1", "m2", "m3"] {
        assert_eq!(b.outcomes(id), vec![O::Completed], "{id}");
    }
    assert_eq!(b.outcomes("m4"), vec![O::Recorded]);
    assert_eq!(b.handler.runs_of("m4"), 1, "not read again");
    let row =
        b.h.inbox
            .get_by_message_id("m4", &g())
            .await
            .unwrap()
            .unwrap();
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Pending, 0, Some("down"))
    );
    b.t.cleanup().await;
}

/// J-33, Kafka part: stopping sets aside a delivery not started (m2 waits for its key behind
/// m1); m1 finishes and commits, the commit stops before m2, and the next owner gets m2 as its
/// first delivery (n = 1) and completes it (R167, R176).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_33() {
    let b = Bed::new(1).await;
    b.handler.always(Act::Write);
    let gate = Gate::new();
    b.handler
        .script("m1", vec![Act::Gate(gate.clone()), Act::Write]);
    b.t.event("m1", "k").await;
    b.t.event("m2", "k").await;
    let (bl, sub) = b.builder("w1").await;
    let w1 = b.run((bl.concurrency(2), sub));
    tokio::time::timeout(WITHIN, gate.reached(1))
        .await
        .expect("w1 starts m1");
    let stopping = tokio::spawn(w1.stop());
    tokio::time::sleep(Duration::from_millis(200)).await;
    gate.open();
    stopping.await.unwrap();
    assert_eq!(b.outcomes("m1"), vec![O::Completed]);
    assert_eq!(b.handler.runs_of("m2"), 0);
    assert_eq!(
        b.t.committed(0).await,
        Some(1),
        "the commit stops before m2"
    );
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (_, sub) = b.builder("w2").await;
    let spy = Arc::new(NumberSpy {
        inner: Arc::new(sub.clone()),
        seen: seen.clone(),
    });
    let bl = Runner::builder(b.h.backend(), spy, "g")
        .worker_id("w2")
        .handler(b.handler.clone())
        .process_stored(false)
        .sources(["src"])
        .hooks(b.rec.clone());
    let w2 = b.run((bl, sub));
    b.wait_committed(0, 2, WITHIN).await;
    w2.stop().await;
    assert_eq!(b.outcomes("m2"), vec![O::Completed]);
    assert_eq!(seen.lock().unwrap().clone(), vec![("m2".to_string(), 1)]);
    assert_eq!(b.h.effects().await, vec!["m1", "m2"]);
    b.t.cleanup().await;
}

/// Records the delivery number of each delivery handed out, by message id header.
struct NumberSpy {
    inner: Arc<dyn Subscription>,
    seen: Arc<Mutex<Vec<(String, u32)>>>,
}

#[async_trait]
impl Subscription for NumberSpy {
    fn capabilities(&self) -> txoutbox_core::inbox::subscription::SubscriptionCapabilities {
        self.inner.capabilities()
    }
    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<txoutbox_core::inbox::InboxDelivery>, txoutbox_core::inbox::SubscriptionError>
    {
        let v = self.inner.next(max, wait).await?;
        for d in &v {
            let id = match &d.message {
                txoutbox_core::inbox::BrokerMessage::Kafka { headers, .. } => headers
                    .iter()
                    .find(|(k, _)| k == "event_id")
                    .and_then(|(_, v)| String::from_utf8(v.clone()?).ok())
                    .unwrap_or_default(),
                _ => String::new(),
            };
            self.seen.lock().unwrap().push((id, d.delivery_number));
        }
        Ok(v)
    }
    async fn close(&self) {
        self.inner.close().await
    }
}

/// The error of a build that must fail.
fn refused<T, E>(r: Result<T, E>) -> E {
    match r {
        Ok(_) => panic!("the runner built"),
        Err(e) => e,
    }
}

/// Issue 28: PostgreSQL cut for 3 s (through a proxy: connections refused, then reset) while
/// messages come: no message completes more than 5 s after it is back, each once, each key in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_37() {
    use txoutbox_conformance::inbox::broker_subs::{DbFault, database_outage};
    for fault in [DbFault::Refuse, DbFault::Reset] {
        let db = txoutbox_testkit::inbox::PgOutageInbox::default();
        let f = database_outage(&Tansu, &db, fault).await;
        println!("{f}");
    }
}
