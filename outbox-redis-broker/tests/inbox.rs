//! The inbox's Redis Streams subscription against the machine's Redis (`REDIS_URL`, default
//! `redis://127.0.0.1:6379`): the shared broker trials of `outbox-conformance` (G-01 to G-06,
//! G-08, G-09, the poison message, dead-lettering), its end-to-end trials (J-14, J-15, SI-03)
//! and the Redis scenarios J-08 to J-13 and the clean-stop part of J-32. Each trial uses a fresh key prefix, deleted at the end.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use redis::aio::MultiplexedConnection;
use txoutbox_conformance::broker::{BrokerKind, fresh_suffix};
use txoutbox_conformance::inbox::broker_subs::{SubscriptionTrial, SubscriptionUnderTest};
use txoutbox_conformance::inbox::end_to_end::{EndToEndTrial, EndToEndUnderTest};
use txoutbox_conformance::inbox::harness::InboxHarness;
use txoutbox_conformance::inbox::memory::MemInboxHarness;
use txoutbox_core::inbox::{DeliveryOutcome, Runner, Subscription};
use txoutbox_redis_broker::{RedisSubscription, RedisSubscriptionConfig};

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

struct Trial {
    prefix: String,
}

impl Trial {
    fn new() -> Self {
        Self {
            prefix: format!("inboxtest:{}:", fresh_suffix()),
        }
    }
    fn stream(&self) -> String {
        format!("{}src", self.prefix)
    }
    fn config(&self, worker: &str, claim_idle: Duration) -> RedisSubscriptionConfig {
        RedisSubscriptionConfig::new(url(), "g", worker, ["src"])
            .key_prefix(&self.prefix)
            .claim_idle(claim_idle)
    }
    async fn sub(&self, worker: &str) -> RedisSubscription {
        RedisSubscription::connect(self.config(worker, Duration::from_secs(30)))
            .await
            .expect("connect the subscription")
    }
    async fn pending(&self) -> Vec<(String, String, i64)> {
        let mut c = admin().await;
        let v: Vec<(String, String, i64, i64)> = redis::cmd("XPENDING")
            .arg(self.stream())
            .arg("g")
            .arg("-")
            .arg("+")
            .arg(100)
            .query_async(&mut c)
            .await
            .expect("XPENDING");
        v.into_iter().map(|(id, c, _, n)| (id, c, n)).collect()
    }
    async fn consumers(&self) -> Vec<String> {
        let mut c = admin().await;
        let v: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
            .arg("CONSUMERS")
            .arg(self.stream())
            .arg("g")
            .query_async(&mut c)
            .await
            .expect("XINFO CONSUMERS");
        v.into_iter()
            .filter_map(|m| match m.get("name") {
                Some(redis::Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
                _ => None,
            })
            .collect()
    }
}

#[async_trait]
impl SubscriptionTrial for Trial {
    async fn publish(&self, attrs: &[(&str, &str)], body: &str) {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.stream()).arg("*");
        for (k, v) in attrs {
            cmd.arg(*k).arg(*v);
        }
        cmd.arg("payload").arg(body);
        let mut c = admin().await;
        let _: String = cmd.query_async(&mut c).await.expect("XADD");
    }

    async fn subscription(&self, worker: &str, redeliver_after: Duration) -> Arc<dyn Subscription> {
        Arc::new(
            RedisSubscription::connect(self.config(worker, redeliver_after))
                .await
                .expect("connect the subscription"),
        )
    }

    async fn cleanup(&self) {
        let mut c = admin().await;
        let _: Result<i64, _> = redis::cmd("DEL")
            .arg(self.stream())
            .arg(format!("{}:dead-letter", self.stream()))
            .query_async(&mut c)
            .await;
    }
}

#[async_trait]
impl SubscriptionUnderTest for Redis {
    async fn trial(&self) -> Box<dyn SubscriptionTrial> {
        Box::new(Trial::new())
    }
}

txoutbox_conformance::inbox_broker_suite!(Redis);

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

fn runner(
    h: &MemInboxHarness,
    sub: RedisSubscription,
    worker: &str,
) -> Runner<txoutbox_core::inbox::InMemoryInbox> {
    Runner::builder(h.backend(), Arc::new(sub), "g")
        .worker_id(worker)
        .process_stored(false)
        .sources(["src"])
        .messages_per_transaction(1)
        .concurrency(1)
        .handler(Arc::new(Noop))
        .build()
        .expect("runner")
}

/// J-08: a commit is XACK; the group has no pending entry (R136).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_08() {
    let t = Trial::new();
    let sub = t.sub("w1").await;
    t.publish(&[("event_id", "m1"), ("topic", "src")], r#"{"n":1}"#)
        .await;
    let h = MemInboxHarness::default();
    let r = runner(&h, sub, "w1");
    let res = r.handle_next().await.unwrap().expect("a delivery");
    assert_eq!(
        (res.outcome, res.committed),
        (DeliveryOutcome::Completed, true)
    );
    assert!(t.pending().await.is_empty());
    t.cleanup().await;
}

/// J-12: an entry whose payload is not JSON is copied to `{stream}:dead-letter` with its fields
/// plus invalid_reason, consumer_group, original_stream and original_id, and acknowledged
/// (R140).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_12() {
    let t = Trial::new();
    let sub = t.sub("w1").await;
    t.publish(&[("tenant", "acme")], "not json").await;
    let h = MemInboxHarness::default();
    let r = runner(&h, sub, "w1");
    let res = r.handle_next().await.unwrap().expect("a delivery");
    assert_eq!(res.outcome, DeliveryOutcome::Invalid);
    let mut c = admin().await;
    let v: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(format!("{}:dead-letter", t.stream()))
        .arg("-")
        .arg("+")
        .query_async(&mut c)
        .await
        .expect("XRANGE");
    assert_eq!(v.len(), 1);
    let f: std::collections::HashMap<_, _> = v[0].1.iter().cloned().collect();
    assert_eq!(f["tenant"], "acme");
    assert_eq!(f["payload"], "not json");
    assert_eq!(f["invalid_reason"], "invalid message: body is not JSON");
    assert_eq!(f["consumer_group"], "g");
    assert_eq!(f["original_stream"], t.stream());
    assert!(!f["original_id"].is_empty());
    assert!(t.pending().await.is_empty());
    t.cleanup().await;
}

/// J-13: entries written before the group exists are read (group created at 0); after a
/// restart the runner reads its own pending entries first, then new ones (R135).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_13() {
    let t = Trial::new();
    for n in 1..=3 {
        t.publish(&[("event_id", &format!("m{n}"))], &format!("{{\"n\":{n}}}"))
            .await;
    }
    let h = MemInboxHarness::default();
    let r = runner(&h, t.sub("w1").await, "w1");
    for n in 1..=3 {
        let res = r.handle_next().await.unwrap().expect("a delivery");
        assert_eq!(res.message_id.as_deref(), Some(format!("m{n}").as_str()));
    }
    for n in 4..=5 {
        t.publish(&[("event_id", &format!("m{n}"))], &format!("{{\"n\":{n}}}"))
            .await;
    }
    // w1 reads both and is killed before handling them.
    let killed = t.sub("w1").await;
    let held = killed.next(2, Duration::from_millis(200)).await.unwrap();
    assert_eq!(held.len(), 2);
    drop(held);
    drop(killed);
    t.publish(&[("event_id", "m6")], r#"{"n":6}"#).await;
    let r = runner(&h, t.sub("w1").await, "w1");
    let mut ids = Vec::new();
    for _ in 0..3 {
        let res = r.handle_next().await.unwrap().expect("a delivery");
        ids.push(res.message_id.unwrap());
    }
    assert_eq!(ids, vec!["m4", "m5", "m6"]);
    assert!(t.pending().await.is_empty());
    t.cleanup().await;
}

/// J-32 (clean stops): after a clean stop the group has no consumer `w1`; a runner `w2` killed
/// while it holds an entry stays listed with its pending entry (R135).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_32_clean_stop() {
    let t = Trial::new();
    t.publish(&[("event_id", "m1")], r#"{"n":1}"#).await;
    let h = MemInboxHarness::default();
    let w1 = Arc::new(runner(&h, t.sub("w1").await, "w1"));
    w1.start();
    let run = tokio::spawn({
        let w1 = w1.clone();
        async move { w1.run_until_stopped().await.unwrap() }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !t.consumers().await.contains(&"w1".to_string()) || !t.pending().await.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "w1 never handled m1"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    w1.stop();
    run.await.unwrap();
    assert!(!t.consumers().await.contains(&"w1".to_string()));

    t.publish(&[("event_id", "m2")], r#"{"n":2}"#).await;
    let w2 = t.sub("w2").await;
    let held = w2.next(1, Duration::from_millis(200)).await.unwrap();
    assert_eq!(held.len(), 1);
    drop(held);
    drop(w2);
    assert!(t.consumers().await.contains(&"w2".to_string()));
    let p = t.pending().await;
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].1, "w2");
    t.cleanup().await;
}

/// J-09: a rewind keeps the entry pending; it is claimed again 0.5 s to 2 s after the rewind
/// with delivery count 2, then XACKed (R127, R136).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_09() {
    txoutbox_conformance::inbox::broker_subs::rewind_is_redelivered_later(&Redis).await;
}

/// J-10: a dead consumer's entry is claimed by w2 no sooner than claim_idle (2 s) after w1's
/// last renewal, with delivery count 2, and completed once. The bound after the kill is
/// claim_idle plus one claim period (claim_idle / 2) plus a second of slack (R119, R136).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_10() {
    txoutbox_conformance::inbox::broker_subs::killed_runner_message_comes_back(
        &Redis,
        Duration::from_secs(2),
        Duration::from_secs(4),
    )
    .await;
}

/// J-38, R136's bound given once, to the runner: the runner's concurrency (1) bounds the waiting rewinds with no `max_waiting_rewinds` in the config: the second failure is recorded (R126, R136).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_38() {
    txoutbox_conformance::inbox::broker_subs::rewinds_bounded_by_the_runner_concurrency(
        &Redis, true,
    )
    .await;
}

/// J-11: with claim_idle 1 s, renewals keep a 3 s run's entry: w2 never claims it; one run,
/// completed (R136).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_11() {
    txoutbox_conformance::inbox::broker_subs::renewal_keeps_slow_run(&Redis).await;
}

/// J-09 (XPENDING at once): right after a rewind the entry is still pending under consumer
/// `w1`, delivered once; the next claim of it is delivery 2 to `w1` (R127, R136).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_09_pending_after_rewind() {
    let t = Trial::new();
    let sub = t.sub("w1").await;
    t.publish(&[("event_id", "m1")], r#"{"n":1}"#).await;
    let d = sub.next(1, Duration::from_millis(200)).await.unwrap();
    assert_eq!(d.len(), 1);
    d[0].ack.rewind(Duration::from_millis(500)).await.unwrap();
    let p = t.pending().await;
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!((p[0].1.as_str(), p[0].2), ("w1", 1));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let again = loop {
        let v = sub.next(1, Duration::from_millis(100)).await.unwrap();
        if let Some(x) = v.into_iter().next() {
            break x;
        }
        assert!(tokio::time::Instant::now() < deadline, "never came back");
    };
    assert_eq!(again.delivery_number, 2);
    again.ack.commit().await.unwrap();
    assert!(t.pending().await.is_empty());
    t.cleanup().await;
}

/// J-35, R136's bound on waiting rewinds: with `max_waiting_rewinds(1)` a second rewind is left pending
/// without a timer (no room is reported once one waits); the first comes back when due as
/// delivery 2, the second only through XAUTOCLAIM once idle for claim_idle (2 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r136_rewinds_beyond_the_bound_wait_for_autoclaim() {
    let t = Trial::new();
    let sub = RedisSubscription::connect(
        t.config("w1", Duration::from_secs(2))
            .block(Duration::from_millis(200))
            .max_waiting_rewinds(1),
    )
    .await
    .expect("connect the subscription");
    t.publish(&[("event_id", "m1")], r#"{"n":1}"#).await;
    t.publish(&[("event_id", "m2")], r#"{"n":2}"#).await;
    let d = sub.next(2, Duration::from_millis(500)).await.unwrap();
    assert_eq!(d.len(), 2);
    assert!(d[0].ack.rewind_has_room(), "nothing waits yet");
    let rewound = std::time::Instant::now();
    d[0].ack.rewind(Duration::from_millis(300)).await.unwrap();
    assert!(
        !d[1].ack.rewind_has_room(),
        "one rewind waits: the bound is reached"
    );
    d[1].ack.rewind(Duration::from_millis(300)).await.unwrap();
    let mut back = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(8);
    while back.len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "came back: {back:?}"
        );
        for x in sub.next(2, Duration::from_millis(100)).await.unwrap() {
            let id = match &x.message {
                txoutbox_core::inbox::BrokerMessage::Redis { fields, .. } => fields
                    .iter()
                    .find(|(k, _)| k == "event_id")
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default(),
                other => panic!("not a Redis entry: {other:?}"),
            };
            back.push((id, x.delivery_number, rewound.elapsed()));
            x.ack.commit().await.unwrap();
        }
    }
    assert_eq!(back[0].0, "m1", "the rewind with a timer first: {back:?}");
    assert!(
        back[0].2 < Duration::from_millis(1500),
        "m1 when due: {back:?}"
    );
    assert_eq!((back[1].0.as_str(), back[1].1), ("m2", 2), "{back:?}");
    assert!(
        back[1].2 >= Duration::from_secs(2),
        "m2 only after claim_idle, through XAUTOCLAIM: {back:?}"
    );
    assert!(t.pending().await.is_empty());
    t.cleanup().await;
}

struct Fails;

#[async_trait]
impl txoutbox_core::inbox::Handler<txoutbox_core::inbox::MemInboxTx> for Fails {
    async fn handle(
        &self,
        _row: &txoutbox_core::inbox::InboxEvent,
        _tx: &mut txoutbox_core::inbox::MemInboxTx,
    ) -> Result<txoutbox_core::inbox::HandlerOutcome, txoutbox_core::inbox::HandlerError> {
        Err(txoutbox_core::inbox::HandlerError::new("boom"))
    }
}

/// J-36, R136 on the runner: under `on_failure = rewind` with room for one waiting rewind, the first
/// failed delivery is rewound and the second, with no room left, is recorded in its row (R126)
/// and acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r136_a_failure_without_room_is_recorded() {
    let t = Trial::new();
    let sub = RedisSubscription::connect(
        t.config("w1", Duration::from_secs(30))
            .max_waiting_rewinds(1),
    )
    .await
    .expect("connect the subscription");
    t.publish(&[("event_id", "m1"), ("partition_key", "k1")], r#"{"n":1}"#)
        .await;
    t.publish(&[("event_id", "m2"), ("partition_key", "k2")], r#"{"n":2}"#)
        .await;
    let h = MemInboxHarness::default();
    let r = Runner::builder(h.backend(), Arc::new(sub), "g")
        .worker_id("w1")
        .process_stored(false)
        .sources(["src"])
        .messages_per_transaction(1)
        .concurrency(1)
        .on_failure(txoutbox_core::inbox::OnFailure::Rewind)
        .handler(Arc::new(Fails))
        .build()
        .expect("runner");
    let first = r.handle_next().await.unwrap().expect("m1");
    let second = r.handle_next().await.unwrap().expect("m2");
    assert_eq!(first.outcome, DeliveryOutcome::Rewound, "{first:?}");
    assert_eq!(
        (second.outcome, second.committed),
        (DeliveryOutcome::Recorded, true),
        "{second:?}"
    );
    let p = t.pending().await;
    assert_eq!(p.len(), 1, "only the rewound m1 stays pending: {p:?}");
    t.cleanup().await;
}

/// The end-to-end trials (J-14, J-15, SI-03): the outbox adapter and the subscriptions on one
/// fresh key prefix; every key under it is deleted at the end.
struct RedisEndToEnd;

struct EndToEnd {
    prefix: String,
    adapter: txoutbox_redis_broker::RedisBroker,
    adapter_config: txoutbox_redis_broker::RedisBrokerConfig,
}

#[async_trait]
impl EndToEndTrial for EndToEnd {
    fn adapter(&self) -> Arc<dyn txoutbox_core::Broker> {
        Arc::new(self.adapter.clone())
    }

    async fn another_adapter(&self) -> Arc<dyn txoutbox_core::Broker> {
        Arc::new(
            txoutbox_redis_broker::RedisBroker::connect(self.adapter_config.clone())
                .await
                .expect("connect another adapter"),
        )
    }

    async fn subscription(
        &self,
        worker: &str,
        topics: &[&str],
        redeliver_after: Duration,
    ) -> Arc<dyn Subscription> {
        Arc::new(
            RedisSubscription::connect(
                RedisSubscriptionConfig::new(url(), "g", worker, topics.iter().copied())
                    .key_prefix(&self.prefix)
                    .claim_idle(redeliver_after),
            )
            .await
            .expect("connect the subscription"),
        )
    }

    async fn cleanup(&self) {
        let mut c = admin().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}*", self.prefix))
            .query_async(&mut c)
            .await
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: Result<i64, _> = redis::cmd("DEL").arg(keys).query_async(&mut c).await;
        }
    }
}

#[async_trait]
impl EndToEndUnderTest for RedisEndToEnd {
    fn kind(&self) -> BrokerKind {
        BrokerKind::Redis
    }

    async fn trial(&self) -> Box<dyn EndToEndTrial> {
        let prefix = format!("inboxe2e:{}:", fresh_suffix());
        let adapter_config = txoutbox_redis_broker::RedisBrokerConfig::new(url())
            .key_prefix(&prefix)
            .timeout(Duration::from_secs(5));
        let adapter = txoutbox_redis_broker::RedisBroker::connect(adapter_config.clone())
            .await
            .unwrap_or_else(|e| panic!("Redis at {} is unreachable: {e}", url()));
        Box::new(EndToEnd {
            prefix,
            adapter,
            adapter_config,
        })
    }
}

txoutbox_conformance::inbox_end_to_end_suite!(RedisEndToEnd);

/// Issue 28: PostgreSQL cut for 3 s (through a proxy: connections refused, then reset) while
/// messages come: no message completes more than 5 s after it is back, each once, each key in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_37() {
    use txoutbox_conformance::inbox::broker_subs::{DbFault, database_outage};
    for fault in [DbFault::Refuse, DbFault::Reset] {
        let db = txoutbox_testkit::inbox::PgOutageInbox::default();
        let f = database_outage(&Redis, &db, fault).await;
        println!("{f}");
    }
}
