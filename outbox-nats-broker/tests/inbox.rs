//! The inbox's JetStream subscription against the machine's NATS (`NATS_URL`, default
//! `nats://127.0.0.1:4222`): the shared broker trials of `outbox-conformance` (G-01 to G-06,
//! G-08, G-09, the poison message, dead-lettering), its end-to-end trials (J-14, J-15, SI-03)
//! and the NATS scenarios J-01 to J-07 and J-31. Each trial uses a fresh stream `INBOX_…` with
//! subjects `{prefix}>` (and a dead-letter stream capturing `deadletter.{prefix}>`), deleted at
//! the end.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use async_trait::async_trait;
use futures::StreamExt;
use txoutbox_conformance::broker::{BrokerKind, fresh_suffix};
use txoutbox_conformance::inbox::broker_subs::{SubscriptionTrial, SubscriptionUnderTest};
use txoutbox_conformance::inbox::ctx::g;
use txoutbox_conformance::inbox::end_to_end::{EndToEndTrial, EndToEndUnderTest};
use txoutbox_conformance::inbox::harness::InboxHarness;
use txoutbox_conformance::inbox::memory::MemInboxHarness;
use txoutbox_core::inbox::repository::InboxRepository;
use txoutbox_core::inbox::{DeliveryOutcome, OnFailure, Runner, Subscription};
use txoutbox_nats_broker::{NatsSubscription, NatsSubscriptionConfig};

fn url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

struct Nats;

struct Trial {
    client: async_nats::Client,
    js: jetstream::Context,
    stream: String,
    dl_stream: String,
    prefix: String,
}

impl Trial {
    async fn new(with_dead_letter: bool) -> Self {
        let suffix = fresh_suffix();
        let stream = format!("INBOX_{suffix}");
        let dl_stream = format!("INBOX_DL_{suffix}");
        let prefix = format!("inboxtest.{suffix}.");
        let client = async_nats::connect(url())
            .await
            .unwrap_or_else(|e| panic!("NATS at {} is unreachable: {e}", url()));
        let js = jetstream::new(client.clone());
        js.create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![format!("{prefix}>")],
            ..Default::default()
        })
        .await
        .expect("create the trial's stream");
        if with_dead_letter {
            js.create_stream(jetstream::stream::Config {
                name: dl_stream.clone(),
                subjects: vec![format!("deadletter.{prefix}>")],
                ..Default::default()
            })
            .await
            .expect("create the dead-letter stream");
        }
        Self {
            client,
            js,
            stream,
            dl_stream,
            prefix,
        }
    }

    fn config(&self, group: &str, ack_wait: Duration) -> NatsSubscriptionConfig {
        NatsSubscriptionConfig::new(&self.stream, group)
            .subject_prefix(&self.prefix)
            .topics(["src"])
            .ack_wait(ack_wait)
    }

    async fn consumer_info(&self, name: &str) -> jetstream::consumer::Info {
        self.js
            .get_stream(&self.stream)
            .await
            .expect("stream")
            .consumer_info(name)
            .await
            .expect("consumer info")
    }
}

#[async_trait]
impl SubscriptionTrial for Trial {
    async fn publish(&self, attrs: &[(&str, &str)], body: &str) {
        let mut h = async_nats::HeaderMap::new();
        for (k, v) in attrs {
            h.insert(*k, *v);
        }
        self.js
            .publish_with_headers(format!("{}src", self.prefix), h, body.to_owned().into())
            .await
            .expect("publish")
            .await
            .expect("publish ack");
    }

    async fn subscription(
        &self,
        _worker: &str,
        redeliver_after: Duration,
    ) -> Arc<dyn Subscription> {
        Arc::new(
            NatsSubscription::bind(self.client.clone(), self.config("g", redeliver_after))
                .await
                .expect("bind the subscription"),
        )
    }

    async fn cleanup(&self) {
        let _ = self.js.delete_stream(&self.stream).await;
        let _ = self.js.delete_stream(&self.dl_stream).await;
    }
}

#[async_trait]
impl SubscriptionUnderTest for Nats {
    async fn trial(&self) -> Box<dyn SubscriptionTrial> {
        Box::new(Trial::new(true).await)
    }
}

txoutbox_conformance::inbox_broker_suite!(Nats);

fn runner(
    h: &MemInboxHarness,
    sub: NatsSubscription,
) -> txoutbox_core::inbox::RunnerBuilder<txoutbox_core::inbox::InMemoryInbox> {
    Runner::builder(h.backend(), Arc::new(sub), "g")
        .worker_id("w1")
        .process_stored(false)
        .sources(["src"])
        .messages_per_transaction(1)
        .concurrency(1)
}

/// J-01: a commit is a confirmed ack: num_ack_pending 0 and no redelivery (R134).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_01() {
    let t = Trial::new(false).await;
    t.publish(&[("event_id", "m1"), ("topic", "src")], r#"{"n":1}"#)
        .await;
    let h = MemInboxHarness::default();
    let sub = NatsSubscription::bind(t.client.clone(), t.config("g", Duration::from_secs(1)))
        .await
        .unwrap();
    let r = runner(&h, sub.clone())
        .handler(Arc::new(Noop))
        .build()
        .unwrap();
    let res = r.handle_next().await.unwrap().expect("a delivery");
    assert_eq!(
        (res.outcome, res.committed),
        (DeliveryOutcome::Completed, true)
    );
    assert_eq!(t.consumer_info("g").await.num_ack_pending, 0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        sub.next(1, Duration::from_millis(300))
            .await
            .unwrap()
            .is_empty()
    );
    t.cleanup().await;
}

struct Noop;

#[async_trait]
impl txoutbox_core::inbox::Handler<txoutbox_core::inbox::MemInboxTx> for Noop {
    async fn handle(
        &self,
        _row: &txoutbox_core::inbox::InboxEvent,
        _tx: &mut txoutbox_core::inbox::MemInboxTx,
    ) -> Result<txoutbox_core::inbox::HandlerOutcome, txoutbox_core::inbox::HandlerError> {
        Ok(txoutbox_core::inbox::HandlerOutcome::completed())
    }
}

/// J-03: an invalid message is copied to `deadletter.` + subject with R140's headers, then
/// terminated (the MSG_TERMINATED advisory names the stream and sequence; servers from 2.10.4
/// on add the reason). Variant: with no stream capturing the copy, the delivery is rewound 1 s
/// and comes back with delivery count 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_03() {
    let t = Trial::new(true).await;
    let mut advisories = t
        .client
        .subscribe(format!(
            "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.g",
            t.stream
        ))
        .await
        .unwrap();
    t.publish(&[("tenant", "acme")], "not json").await;
    let h = MemInboxHarness::default();
    let sub = NatsSubscription::bind(t.client.clone(), t.config("g", Duration::from_secs(5)))
        .await
        .unwrap();
    let r = runner(&h, sub).handler(Arc::new(Noop)).build().unwrap();
    let res = r.handle_next().await.unwrap().expect("a delivery");
    assert_eq!(res.outcome, DeliveryOutcome::Invalid);
    let reason = "invalid message: body is not JSON";
    let dl = t.js.get_stream(&t.dl_stream).await.unwrap();
    let m = dl
        .get_last_raw_message_by_subject(&format!("deadletter.{}src", t.prefix))
        .await
        .expect("one dead-letter copy");
    assert_eq!(&m.payload[..], b"not json");
    let hv = |n: &str| m.headers.get(n).map(|v| v.as_str().to_owned());
    assert_eq!(hv("tenant").as_deref(), Some("acme"));
    assert_eq!(hv("Inbox-Invalid-Reason").as_deref(), Some(reason));
    assert_eq!(hv("Inbox-Consumer-Group").as_deref(), Some("g"));
    assert_eq!(
        hv("Inbox-Original-Stream").as_deref(),
        Some(t.stream.as_str())
    );
    assert_eq!(hv("Inbox-Original-Sequence").as_deref(), Some("1"));
    assert_eq!(hv("Nats-Msg-Id"), Some(format!("{}:1:g", t.stream)));
    // Servers before 2.10.4 end the message on `+TERM {reason}` without an advisory reason
    // (the machine's may be older); from 2.10.4 on the advisory carries it.
    let version = t.client.server_info().version;
    if version_at_least(&version, (2, 10, 4)) {
        let adv = tokio::time::timeout(Duration::from_secs(3), advisories.next())
            .await
            .expect("a MSG_TERMINATED advisory")
            .expect("advisory");
        let a: serde_json::Value = serde_json::from_slice(&adv.payload).unwrap();
        assert_eq!(a["stream"], t.stream.as_str());
        assert_eq!(a["stream_seq"], 1);
        assert_eq!(a["reason"], reason);
    } else {
        eprintln!("NATS server {version}: the MSG_TERMINATED advisory's reason is not checked");
    }
    assert_eq!(t.consumer_info("g").await.num_ack_pending, 0);
    t.cleanup().await;

    // Variant: no stream captures the copy.
    let t = Trial::new(false).await;
    t.publish(&[], "not json").await;
    let sub = NatsSubscription::bind(
        t.client.clone(),
        t.config("g", Duration::from_secs(5))
            .timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap();
    let r = runner(&h, sub.clone())
        .handler(Arc::new(Noop))
        .build()
        .unwrap();
    let res = r.handle_next().await.unwrap().expect("a delivery");
    assert_eq!(res.outcome, DeliveryOutcome::Invalid);
    assert_eq!(res.rewind_delay, Some(Duration::from_secs(1)));
    let start = tokio::time::Instant::now();
    let again = sub.next(1, Duration::from_secs(3)).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].delivery_number, 2);
    assert!(start.elapsed() >= Duration::from_millis(300));
    t.cleanup().await;
}

/// J-06: consumer requirements (R133): ack policy none or all refused, max_deliver below
/// max_attempts refused under rewind; a created consumer of group `a.b c` is `a_b_c` with
/// max_deliver −1; a record runner binds to a max_deliver 3 consumer; on a max_deliver 6
/// consumer with max_attempts 6 the sixth delivery is the last and is recorded `failed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_06() {
    use jetstream::consumer::{AckPolicy, pull::Config};
    let t = Trial::new(false).await;
    let stream = t.js.get_stream(&t.stream).await.unwrap();
    for (name, policy, max_deliver) in [
        ("none", AckPolicy::None, -1),
        ("all", AckPolicy::All, -1),
        ("md3", AckPolicy::Explicit, 3),
        ("md6", AckPolicy::Explicit, 6),
    ] {
        stream
            .create_consumer(Config {
                durable_name: Some(name.into()),
                ack_policy: policy,
                max_deliver,
                ack_wait: Duration::from_secs(5),
                filter_subject: format!("{}src", t.prefix),
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let bind = |c: &str, rewind: bool| {
        let mut cfg = NatsSubscriptionConfig::new(&t.stream, "g")
            .consumer(c)
            .subject_prefix(&t.prefix);
        if rewind {
            cfg = cfg.rewinds_with_max_attempts(6);
        }
        NatsSubscription::bind(t.client.clone(), cfg)
    };
    for c in ["none", "all"] {
        let e = bind(c, true).await.unwrap_err().to_string();
        assert!(e.contains("ack_policy must be explicit"), "{e}");
    }
    let e = bind("md3", true).await.unwrap_err().to_string();
    assert!(
        e.contains("max_deliver (3) is below max_attempts (6)"),
        "{e}"
    );
    bind("md3", false)
        .await
        .expect("a record runner binds to max_deliver 3");

    let md6 = bind("md6", true).await.unwrap();
    assert_eq!(md6.max_deliver(), Some(6));
    t.publish(&[("event_id", "m1"), ("topic", "src")], r#"{"n":1}"#)
        .await;
    let h = MemInboxHarness::default();
    let r = runner(&h, md6.clone())
        .handler(Arc::new(AlwaysTransient))
        .on_failure(OnFailure::Rewind)
        .max_attempts(6)
        .backoff(txoutbox_core::backoff::Backoff::new(1.0, 8.0).unwrap())
        .build()
        .unwrap();
    let mut outcomes = Vec::new();
    for _ in 0..20 {
        if outcomes.len() == 6 {
            break;
        }
        let ds = md6.next(1, Duration::from_secs(2)).await.unwrap();
        for d in ds {
            assert_eq!(d.delivery_number as usize, outcomes.len() + 1);
            assert_eq!(d.is_last(), outcomes.len() == 5);
            outcomes.push(r.handle_delivery(d).await.outcome);
        }
    }
    assert_eq!(outcomes.len(), 6, "{outcomes:?}");
    assert_eq!(&outcomes[..5], &[DeliveryOutcome::Rewound; 5]);
    assert_eq!(outcomes[5], DeliveryOutcome::Recorded);
    let row = h
        .inbox
        .get_by_message_id("m1", &g())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(row.status, txoutbox_core::event::Status::Failed);

    let created = NatsSubscription::bind(
        t.client.clone(),
        NatsSubscriptionConfig::new(&t.stream, "a.b c")
            .subject_prefix(&t.prefix)
            .topics(["src"]),
    )
    .await
    .unwrap();
    assert_eq!(created.consumer_name(), "a_b_c");
    assert_eq!(created.max_deliver(), None);
    assert_eq!(t.consumer_info("a_b_c").await.config.max_deliver, -1);
    t.cleanup().await;
}

fn version_at_least(v: &str, min: (u64, u64, u64)) -> bool {
    let p: Vec<u64> = v
        .split(|c: char| !c.is_ascii_digit())
        .filter(|x| !x.is_empty())
        .take(3)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    (
        p.first().copied().unwrap_or(0),
        p.get(1).copied().unwrap_or(0),
        p.get(2).copied().unwrap_or(0),
    ) >= min
}

struct AlwaysTransient;

#[async_trait]
impl txoutbox_core::inbox::Handler<txoutbox_core::inbox::MemInboxTx> for AlwaysTransient {
    async fn handle(
        &self,
        _row: &txoutbox_core::inbox::InboxEvent,
        _tx: &mut txoutbox_core::inbox::MemInboxTx,
    ) -> Result<txoutbox_core::inbox::HandlerOutcome, txoutbox_core::inbox::HandlerError> {
        Err(txoutbox_core::inbox::HandlerError::transient("down"))
    }
}

/// J-07: messages without id headers get `{stream}:{sequence}` as message_id (R138).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_07() {
    let t = Trial::new(false).await;
    for n in 1..=3 {
        t.publish(&[], &format!("{{\"n\":{n}}}")).await;
    }
    let h = MemInboxHarness::default();
    let sub = NatsSubscription::bind(t.client.clone(), t.config("g", Duration::from_secs(5)))
        .await
        .unwrap();
    let r = runner(&h, sub).handler(Arc::new(Noop)).build().unwrap();
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push(
            r.handle_next()
                .await
                .unwrap()
                .expect("a delivery")
                .message_id
                .unwrap(),
        );
    }
    let s = &t.stream;
    assert_eq!(
        ids,
        vec![format!("{s}:1"), format!("{s}:2"), format!("{s}:3")]
    );
    t.cleanup().await;
}

/// J-02: a rewind is a nak with a delay: redelivered 0.5 s to 2 s after it with delivery count
/// 2, then completed (R127, R134).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_02() {
    txoutbox_conformance::inbox::broker_subs::rewind_is_redelivered_later(&Nats).await;
}

/// J-04: a killed runner's message comes back to runner B with delivery count 2 within 3 s
/// (ack_wait 2 s) and is completed once (R119, R134).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_04() {
    txoutbox_conformance::inbox::broker_subs::killed_runner_message_comes_back(
        &Nats,
        Duration::from_secs(2),
        Duration::from_secs(3),
    )
    .await;
}

/// J-38, R136's bound given once, to the runner: NATS holds its rewinds itself (a nak with a delay), so the second failure is rewound too and nothing waits in the process (R126, R136).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_38() {
    txoutbox_conformance::inbox::broker_subs::rewinds_bounded_by_the_runner_concurrency(
        &Nats, false,
    )
    .await;
}

/// J-05: with ack_wait 1 s, in-progress renewals keep a 3 s run's message: one delivery, one
/// run, completed (R134).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_05() {
    txoutbox_conformance::inbox::broker_subs::renewal_keeps_slow_run(&Nats).await;
}

/// A handler that takes 1.5 s and counts its runs per message.
#[derive(Default)]
struct Slow {
    runs: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

#[async_trait]
impl txoutbox_core::inbox::Handler<txoutbox_core::inbox::MemInboxTx> for Slow {
    async fn handle(
        &self,
        row: &txoutbox_core::inbox::InboxEvent,
        _tx: &mut txoutbox_core::inbox::MemInboxTx,
    ) -> Result<txoutbox_core::inbox::HandlerOutcome, txoutbox_core::inbox::HandlerError> {
        *self
            .runs
            .lock()
            .unwrap()
            .entry(row.message_id.clone())
            .or_default() += 1;
        tokio::time::sleep(Duration::from_millis(1500)).await;
        Ok(txoutbox_core::inbox::HandlerOutcome::completed())
    }
}

/// J-31: with ack_wait 1 s and concurrency 2, a runner pulls only what it can hold: six 1.5 s
/// runs on six keys all complete once, num_redelivered stays 0 and num_ack_pending is never
/// above 2 (read every 0.2 s) (R134, R166).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_31() {
    let t = Trial::new(false).await;
    for n in 1..=6 {
        let (id, key) = (format!("m{n}"), format!("k{n}"));
        t.publish(
            &[("event_id", &id), ("topic", "src"), ("partition_key", &key)],
            &format!("{{\"n\":{n}}}"),
        )
        .await;
    }
    let h = MemInboxHarness::default();
    let sub = NatsSubscription::bind(t.client.clone(), t.config("g", Duration::from_secs(1)))
        .await
        .unwrap();
    let slow = Arc::new(Slow::default());
    let r = Arc::new(
        runner(&h, sub)
            .concurrency(2)
            .handler(slow.clone())
            .build()
            .unwrap(),
    );
    r.start();
    let task = tokio::spawn({
        let r = r.clone();
        async move { r.run_until_stopped().await.unwrap() }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let mut max_pending = 0;
    loop {
        let info = t.consumer_info("g").await;
        max_pending = max_pending.max(info.num_ack_pending);
        assert_eq!(
            info.num_redelivered, 0,
            "a pulled message waited past ack_wait"
        );
        let done = slow.runs.lock().unwrap().len() == 6 && info.num_ack_pending == 0;
        if done && info.num_pending == 0 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "six runs not done: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    r.stop();
    task.await.unwrap();
    assert!(max_pending <= 2, "num_ack_pending reached {max_pending}");
    let runs = slow.runs.lock().unwrap().clone();
    assert!(runs.values().all(|n| *n == 1), "{runs:?}");
    for n in 1..=6 {
        let row = h
            .inbox
            .get_by_message_id(&format!("m{n}"), &g())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(row.status, txoutbox_core::event::Status::Completed);
    }
    t.cleanup().await;
}

/// The end-to-end trials (J-14, J-15, SI-03): the outbox adapter (subject prefix `{prefix}`)
/// and the subscription on one fresh trial stream `INBOX_…` capturing `{prefix}>`, with
/// JetStream's default 2 min duplicate window (J-15).
struct NatsEndToEnd;

struct EndToEnd {
    trial: Trial,
    adapter: txoutbox_nats_broker::NatsBroker,
    adapter_config: txoutbox_nats_broker::NatsBrokerConfig,
}

#[async_trait]
impl EndToEndTrial for EndToEnd {
    fn adapter(&self) -> Arc<dyn txoutbox_core::Broker> {
        Arc::new(self.adapter.clone())
    }

    async fn another_adapter(&self) -> Arc<dyn txoutbox_core::Broker> {
        Arc::new(
            txoutbox_nats_broker::NatsBroker::connect(self.adapter_config.clone())
                .await
                .expect("connect another adapter"),
        )
    }

    async fn subscription(
        &self,
        _worker: &str,
        topics: &[&str],
        redeliver_after: Duration,
    ) -> Arc<dyn Subscription> {
        Arc::new(
            NatsSubscription::bind(
                self.trial.client.clone(),
                NatsSubscriptionConfig::new(&self.trial.stream, "g")
                    .subject_prefix(&self.trial.prefix)
                    .topics(topics.iter().copied())
                    .ack_wait(redeliver_after),
            )
            .await
            .expect("bind the subscription"),
        )
    }

    async fn cleanup(&self) {
        SubscriptionTrial::cleanup(&self.trial).await;
    }
}

#[async_trait]
impl EndToEndUnderTest for NatsEndToEnd {
    fn kind(&self) -> BrokerKind {
        BrokerKind::Nats
    }

    async fn trial(&self) -> Box<dyn EndToEndTrial> {
        let trial = Trial::new(false).await;
        let adapter_config = txoutbox_nats_broker::NatsBrokerConfig::new(url())
            .subject_prefix(&trial.prefix)
            .timeout(Duration::from_secs(5));
        let adapter = txoutbox_nats_broker::NatsBroker::connect(adapter_config.clone())
            .await
            .expect("connect the adapter");
        Box::new(EndToEnd {
            trial,
            adapter,
            adapter_config,
        })
    }
}

txoutbox_conformance::inbox_end_to_end_suite!(NatsEndToEnd);

/// Issue 28: PostgreSQL cut for 3 s (through a proxy: connections refused, then reset) while
/// messages come: no message completes more than 5 s after it is back, each once, each key in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_37() {
    use txoutbox_conformance::inbox::broker_subs::{DbFault, database_outage};
    for fault in [DbFault::Refuse, DbFault::Reset] {
        let db = txoutbox_testkit::inbox::PgOutageInbox::default();
        let f = database_outage(&Nats, &db, fault).await;
        println!("{f}");
    }
}
