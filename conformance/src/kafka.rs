//! Kafka broker trials (brokers.md section 4.2): K-07, K-09, K-10 (refused, then forwarded),
//! K-11, K-14, K-15 (through [`crate::kafka_proxy`]), K-16, K-17 and K-18's Kafka case, run through the relay
//! against a live Kafka-compatible broker.
//!
//! The adapter crate implements [`KafkaUnderTest`] with a plain client (topic admin, a consumer
//! reading from the earliest offset with isolation `read_committed`) and declares the
//! [`KafkaCapability`]s a probe has shown the broker to have. Each trial creates a fresh topic
//! `ob.{name}-{r}` and deletes it at the end. A case that needs a capability the broker lacks is
//! reported as skipped with the capability's name ([`Outcome::Skipped`], printed on stderr),
//! never as passed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use txoutbox_core::clock::Clock;
use txoutbox_core::event::Status;
use txoutbox_core::{Broker, Message};
use uuid::Uuid;

use crate::broker::{cycle, event, fresh_suffix, get, relay_for, write_one};

/// The topic prefix of every trial's adapter.
pub const PREFIX: &str = "ob.";

/// What a probe has shown a Kafka broker to do (brokers.md 4.1, "Capabilities").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KafkaCapability {
    /// It grants InitProducerId and stores a resent batch once.
    IdempotentProducer,
    /// It enforces the `max.message.bytes` a topic is created with.
    TopicMaxMessageBytes,
    /// A metadata or produce request for an unknown topic does not create it.
    NoAutoCreate,
}

impl KafkaCapability {
    /// The capability's name in the scenarios.
    pub fn name(self) -> &'static str {
        match self {
            Self::IdempotentProducer => "idempotent_producer",
            Self::TopicMaxMessageBytes => "topic_max_message_bytes",
            Self::NoAutoCreate => "no_auto_create",
        }
    }
}

/// How a trial (or a case of it) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Every assertion held.
    Passed,
    /// Cases that did not run, each with the capability it needs (or, for "Needs: no X", the
    /// capability whose absence it needs), and what did run passed.
    Skipped(Vec<String>),
}

impl Outcome {
    fn skipped(case: &str, needs: &str, cap: KafkaCapability) {
        let verb = if needs.is_empty() {
            "does not declare"
        } else {
            "declares"
        };
        report(&format!(
            "SKIPPED {case}: needs {needs}{}, which the broker under test {verb}",
            cap.name()
        ));
    }
}

/// Writes a line to the process's stderr past the test harness's output capture (which takes
/// only `print!`/`eprint!`), so that a skipped case shows in the test output of a passing test.
pub fn report(line: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// How a trial's adapter is built (topic prefix [`PREFIX`]).
#[derive(Debug, Clone)]
pub struct KafkaAdapter {
    /// The bootstrap address: the broker when `None`, or e.g. a forwarder.
    pub bootstrap: Option<SocketAddr>,
    /// Idempotence `on` (true) or `off`.
    pub idempotence: bool,
    /// The adapter's delivery timeout.
    pub delivery_timeout: Duration,
    /// `Some(source)`: message_format `cloudevents` with this source.
    pub cloudevents_source: Option<String>,
}

/// A record as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaRecord {
    /// Partition.
    pub partition: i32,
    /// Offset.
    pub offset: i64,
    /// Key.
    pub key: Option<Vec<u8>>,
    /// Value.
    pub value: Option<Vec<u8>>,
    /// Headers in record order (a name may repeat; a null value is `None`).
    pub headers: Vec<(String, Option<Vec<u8>>)>,
}

impl KafkaRecord {
    /// The value of a header that occurs once, as UTF-8 (panics when it repeats).
    pub fn header(&self, name: &str) -> Option<String> {
        let mut found = self.headers.iter().filter(|(k, _)| k == name);
        let first = found.next()?;
        assert!(
            found.next().is_none(),
            "header {name} occurs more than once"
        );
        first
            .1
            .as_ref()
            .map(|v| String::from_utf8(v.clone()).expect("UTF-8 header"))
    }

    /// The value as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(self.value.as_deref().unwrap_or_default())
            .unwrap_or(serde_json::Value::Null)
    }
}

/// A live Kafka-compatible broker with a plain client beside the adapter.
#[async_trait]
pub trait KafkaUnderTest: Send + Sync {
    /// The capabilities a probe has shown this broker to have.
    async fn capabilities(&self) -> Vec<KafkaCapability>;
    /// The bootstrap address of the broker (for forwarders).
    fn server_addr(&self) -> SocketAddr;
    /// Creates a topic with this many partitions and topic configs.
    async fn create_topic(&self, name: &str, partitions: i32, configs: &[(&str, &str)]);
    /// Deletes a topic (errors ignored).
    async fn delete_topic(&self, name: &str);
    /// Every record of the topic, all partitions from the earliest offset, read with isolation
    /// `read_committed`, ordered by partition and offset.
    async fn read(&self, topic: &str) -> Vec<KafkaRecord>;
    /// Builds an adapter without the broker and runs its connection check, whose error text is
    /// returned beside it.
    async fn adapter(&self, opts: &KafkaAdapter) -> (Arc<dyn Broker>, Result<(), String>);
    /// A broker of the test's own that advertises `advertised` (where a proxy in front of it
    /// will listen), for K-15; `None` where the harness cannot start one (a real Kafka named by
    /// `KAFKA_BROKERS`).
    async fn private_broker(&self, advertised: SocketAddr) -> Option<PrivateBroker>;
    /// [`create_topic`](Self::create_topic) on the broker bootstrapped at `bootstrap`.
    async fn create_topic_at(&self, bootstrap: SocketAddr, name: &str, partitions: i32);
    /// [`read`](Self::read) from the broker bootstrapped at `bootstrap`.
    async fn read_at(&self, bootstrap: SocketAddr, topic: &str) -> Vec<KafkaRecord>;
}

/// A broker started by a test ([`KafkaUnderTest::private_broker`]); it stops when dropped.
pub struct PrivateBroker {
    /// Where it listens.
    pub listen: SocketAddr,
    /// Whatever keeps it running (a child process killed on drop).
    pub guard: Box<dyn Send + Sync>,
}

async fn has(b: &dyn KafkaUnderTest, c: KafkaCapability) -> bool {
    b.capabilities().await.contains(&c)
}

/// Section 16's default adapter: idempotence `on` where the broker declares
/// `idempotent_producer`, `off` elsewhere.
pub async fn default_adapter(b: &dyn KafkaUnderTest) -> KafkaAdapter {
    KafkaAdapter {
        bootstrap: None,
        idempotence: has(b, KafkaCapability::IdempotentProducer).await,
        delivery_timeout: Duration::from_secs(5),
        cloudevents_source: None,
    }
}

async fn adapter(b: &dyn KafkaUnderTest, opts: &KafkaAdapter) -> Arc<dyn Broker> {
    let (a, check) = b.adapter(opts).await;
    check.unwrap_or_else(|e| panic!("the adapter's connection check failed: {e}"));
    a
}

fn names(r: &str, name: &str) -> (String, String) {
    let topic = format!("{name}-{r}");
    (topic.clone(), format!("{PREFIX}{topic}"))
}

/// Kafka's murmur2 as the Java client computes it, the oracle of R86's partitioning.
pub fn murmur2(data: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ (data.len() as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]).wrapping_mul(M);
        k ^= k >> 24;
        h = h.wrapping_mul(M) ^ k.wrapping_mul(M);
    }
    let rest = chunks.remainder();
    if rest.len() >= 3 {
        h ^= u32::from(rest[2]) << 16;
    }
    if rest.len() >= 2 {
        h ^= u32::from(rest[1]) << 8;
    }
    if let Some(b0) = rest.first() {
        h ^= u32::from(*b0);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// R86: the partition of a key, `(murmur2(key) & 0x7fffffff) % partitions`.
pub fn partition_of(key: &str, partitions: i32) -> i32 {
    (murmur2(key.as_bytes()) & 0x7fff_ffff) % partitions
}

/// K-07 What the Kafka record carries.
pub async fn k_07(b: &dyn KafkaUnderTest) -> Outcome {
    let r = fresh_suffix();
    let (topic, kt) = names(&r, "orders");
    b.create_topic(&kt, 3, &[]).await;
    let (repo, _clock) = crate::broker::repo();
    let row = write_one(
        &repo,
        event(&topic, "acct-1", json!({"n": 1, "text": "héllo"}))
            .header("tenant", "acme")
            .header("id", "spoof")
            .header("event_id", "spoof")
            .trace_id("tr-1")
            .schema_version("1.0.0")
            .build()
            .expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, adapter(b, &default_adapter(b).await).await)
        .build()
        .expect("relay");
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed, vec![row.id], "K-07: completed: {rep:?}");
    let got = b.read(&kt).await;
    assert_eq!(got.len(), 1, "K-07: one record: {got:?}");
    let m = &got[0];
    assert_eq!(
        m.partition,
        partition_of("acct-1", 3),
        "K-07: murmur2 partition"
    );
    assert_eq!(m.key.as_deref(), Some(&b"acct-1"[..]));
    assert_eq!(
        m.value.as_deref(),
        Some(r#"{"n":1,"text":"héllo"}"#.as_bytes()),
        "K-07: the payload's compact JSON"
    );
    let id = row.id.hyphenated().to_string();
    let created = row
        .created_at
        .to_rfc3339_opts(txoutbox_core::broker::CREATED_AT_FORMAT, true);
    let mut names: Vec<&str> = m.headers.iter().map(|(k, _)| k.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "aggregate_id",
            "aggregate_type",
            "created_at",
            "event_id",
            "event_type",
            "id",
            "partition_key",
            "schema_version",
            "tenant",
            "topic",
            "trace_id"
        ],
        "K-07: exactly these headers, each once"
    );
    for (k, v) in [
        ("id", id.as_str()),
        ("event_id", id.as_str()),
        ("event_type", "test.happened"),
        ("topic", topic.as_str()),
        ("partition_key", "acct-1"),
        ("aggregate_type", "test"),
        ("aggregate_id", "00000000-0000-0000-0000-000000000000"),
        ("created_at", created.as_str()),
        ("trace_id", "tr-1"),
        ("schema_version", "1.0.0"),
        ("tenant", "acme"),
    ] {
        assert_eq!(m.header(k).as_deref(), Some(v), "K-07: header {k}");
    }
    b.delete_topic(&kt).await;
    Outcome::Passed
}

/// K-09 Per-key order through Kafka: 5 keys × 40 rows, max_per_key 10, publish_concurrency 4,
/// 3 partitions.
pub async fn k_09(b: &dyn KafkaUnderTest) -> Outcome {
    let r = fresh_suffix();
    let (topic, kt) = names(&r, "orders");
    b.create_topic(&kt, 3, &[]).await;
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
    let relay = relay_for(&repo, adapter(b, &default_adapter(b).await).await)
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
    let got = b.read(&kt).await;
    assert_eq!(got.len(), 200, "K-09: 200 records");
    let mut seen: HashMap<String, Vec<(i32, i64, Uuid)>> = HashMap::new();
    for m in &got {
        let key = m.header("partition_key").expect("partition_key");
        let id = Uuid::parse_str(&m.header("id").expect("id")).expect("uuid");
        seen.entry(key)
            .or_default()
            .push((m.partition, m.offset, id));
    }
    for (key, ids) in &written {
        let recs = &seen[key];
        let want = partition_of(key, 3);
        assert!(
            recs.iter().all(|(p, _, _)| *p == want),
            "K-09: every record of {key} on partition {want}"
        );
        let mut by_offset = recs.clone();
        by_offset.sort_by_key(|(_, o, _)| *o);
        let order: Vec<Uuid> = by_offset.iter().map(|(_, _, id)| *id).collect();
        assert_eq!(&order, ids, "K-09: offsets of {key} follow the write order");
    }
    b.delete_topic(&kt).await;
    Outcome::Passed
}

/// K-10 An unreachable Kafka broker is transient: the bootstrap port refuses, then forwards.
/// (The black-hole phase needs a proxy that rewrites the Metadata answers, which this harness
/// does not have: a Kafka client connects to the advertised address after bootstrap.)
pub async fn k_10(b: &dyn KafkaUnderTest) -> Outcome {
    let r = fresh_suffix();
    let (topic, kt) = names(&r, "orders");
    b.create_topic(&kt, 1, &[]).await;
    let mut port = crate::net::Forwarder::closed().await.expect("a free port");
    let (a, check) = b
        .adapter(&KafkaAdapter {
            bootstrap: Some(port.addr()),
            delivery_timeout: Duration::from_secs(1),
            ..default_adapter(b).await
        })
        .await;
    assert!(check.is_err(), "K-10: nothing listens yet");
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
    let relay = relay_for(&repo, a)
        .publish_timeout(Duration::from_secs(2))
        // One publish at a time, so that the first transient failure defers the other two.
        .publish_concurrency(1)
        .build()
        .expect("relay");
    let started = std::time::Instant::now();
    let rep = cycle(&relay).await;
    let took = started.elapsed();
    eprintln!("K-10 (refused): {took:?} {:?}", rep.transient);
    assert!(took <= Duration::from_secs(2), "K-10: took {took:?}");
    assert!(
        rep.counted.is_empty() && rep.completed.is_empty(),
        "K-10: {rep:?}"
    );
    assert_eq!(rep.transient.len(), 1, "K-10: one transient: {rep:?}");
    assert_eq!(rep.deferred.len(), 2, "K-10: two deferred: {rep:?}");
    crate::broker::assert_next_try_in_one_second(&rep.transient[0], clock.now());
    let row = get(&repo, rep.transient[0].id).await;
    assert_eq!(row.attempts_made, 0);
    assert!(
        row.last_error
            .as_deref()
            .unwrap_or_default()
            .starts_with("Kafka broker unreachable: "),
        "K-10: {:?}",
        row.last_error
    );
    port.open(b.server_addr().to_string())
        .await
        .expect("forward");
    clock.advance(Duration::from_millis(1500));
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed.len(), 3, "K-10: all three sent: {rep:?}");
    let got = b.read(&kt).await;
    let mut stored: Vec<String> = got.iter().filter_map(|m| m.header("id")).collect();
    stored.sort();
    let mut want: Vec<String> = ids.iter().map(|i| i.hyphenated().to_string()).collect();
    want.sort();
    assert_eq!(stored, want, "K-10: each stored once");
    b.delete_topic(&kt).await;
    Outcome::Passed
}

/// K-11 A refusal is counted on Kafka: (a) an invalid topic name; (b) needs
/// `topic_max_message_bytes`; (c) needs `no_auto_create`.
pub async fn k_11(b: &dyn KafkaUnderTest) -> Outcome {
    let r = fresh_suffix();
    let mut skipped = Vec::new();
    let a = adapter(b, &default_adapter(b).await).await;
    // (a)
    let (repo, clock) = crate::broker::repo();
    let row = write_one(
        &repo,
        event("bad topic!", "k", json!({"n": 1}))
            .build()
            .expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, a.clone()).build().expect("relay");
    let rep = cycle(&relay).await;
    assert_eq!(rep.counted.len(), 1, "K-11 (a): counted: {rep:?}");
    let stored = get(&repo, row.id).await;
    assert_eq!(stored.attempts_made, 1);
    assert_eq!(
        stored.last_error.as_deref(),
        Some("Kafka: \"ob.bad topic!\" is not a valid topic name")
    );
    let wait = stored.scheduled_at - clock.now();
    assert!(
        (chrono::Duration::seconds(5)..=chrono::Duration::seconds(10)).contains(&wait),
        "K-11 (a): next try in [5, 10] s: {wait:?}"
    );
    // (b)
    if has(b, KafkaCapability::TopicMaxMessageBytes).await {
        let (topic, kt) = names(&r, "small");
        b.create_topic(&kt, 1, &[("max.message.bytes", "1024")])
            .await;
        let (repo, _clock) = crate::broker::repo();
        let row = write_one(
            &repo,
            event(&topic, "k", json!({"blob": "x".repeat(2048)}))
                .build()
                .expect("valid"),
        )
        .await;
        let relay = relay_for(&repo, a.clone()).build().expect("relay");
        let rep = cycle(&relay).await;
        assert_eq!(rep.counted.len(), 1, "K-11 (b): counted: {rep:?}");
        let last = get(&repo, row.id).await.last_error.unwrap_or_default();
        assert!(
            last.starts_with("Kafka refused the record for topic")
                && last.contains("MESSAGE_TOO_LARGE (10)"),
            "K-11 (b): {last:?}"
        );
        assert!(b.read(&kt).await.is_empty(), "K-11 (b): nothing stored");
        b.delete_topic(&kt).await;
    } else {
        Outcome::skipped("K-11 (b)", "", KafkaCapability::TopicMaxMessageBytes);
        skipped.push(format!(
            "K-11 (b): {}",
            KafkaCapability::TopicMaxMessageBytes.name()
        ));
    }
    // (c)
    if has(b, KafkaCapability::NoAutoCreate).await {
        let (topic, kt) = names(&r, "absent");
        let (repo, _clock) = crate::broker::repo();
        let row = write_one(
            &repo,
            event(&topic, "k", json!({"n": 3})).build().expect("valid"),
        )
        .await;
        let relay = relay_for(&repo, a).build().expect("relay");
        let rep = cycle(&relay).await;
        assert_eq!(rep.counted.len(), 1, "K-11 (c): counted: {rep:?}");
        assert_eq!(
            get(&repo, row.id).await.last_error.as_deref(),
            Some(format!("Kafka: topic {kt:?} does not exist").as_str())
        );
    } else {
        Outcome::skipped("K-11 (c)", "", KafkaCapability::NoAutoCreate);
        skipped.push(format!(
            "K-11 (c): {}",
            KafkaCapability::NoAutoCreate.name()
        ));
    }
    if skipped.is_empty() {
        Outcome::Passed
    } else {
        Outcome::Skipped(skipped)
    }
}

/// K-14 Success means stored on Kafka: read at once from the partition's start,
/// `read_committed`.
pub async fn k_14(b: &dyn KafkaUnderTest) -> Outcome {
    let r = fresh_suffix();
    let (topic, kt) = names(&r, "orders");
    b.create_topic(&kt, 1, &[]).await;
    let (repo, _clock) = crate::broker::repo();
    let row = write_one(
        &repo,
        event(&topic, "k", json!({"n": 14})).build().expect("valid"),
    )
    .await;
    let relay = relay_for(&repo, adapter(b, &default_adapter(b).await).await)
        .build()
        .expect("relay");
    let rep = cycle(&relay).await;
    assert_eq!(rep.completed, vec![row.id], "K-14: completed");
    let got = b.read(&kt).await;
    assert_eq!(got.len(), 1, "K-14: the record is already there");
    assert_eq!(got[0].header("id"), Some(row.id.hyphenated().to_string()));
    b.delete_topic(&kt).await;
    Outcome::Passed
}

/// K-15 The idempotent producer stores a resent record once (Needs `idempotent_producer`; the
/// variant, idempotence `off`, needs nothing). The adapter reaches a broker of the test's own
/// through a proxy that discards the broker's answer to the first Produce request and closes
/// that connection; publish timeout 10 s, delivery timeout 8 s.
pub async fn k_15(b: &dyn KafkaUnderTest) -> Outcome {
    let mut skipped = Vec::new();
    for idempotence in [true, false] {
        let case = if idempotence {
            "K-15"
        } else {
            "K-15 variant (off)"
        };
        if idempotence && !has(b, KafkaCapability::IdempotentProducer).await {
            Outcome::skipped(case, "", KafkaCapability::IdempotentProducer);
            skipped.push(format!(
                "{case}: {}",
                KafkaCapability::IdempotentProducer.name()
            ));
            continue;
        }
        let (listener, proxy_addr) = crate::kafka_proxy::DropFirstProduceAnswer::bind().await;
        let Some(private) = b.private_broker(proxy_addr).await else {
            report(&format!(
                "SKIPPED {case}: needs a broker the test can start behind its proxy"
            ));
            skipped.push(format!("{case}: a broker the test can start"));
            continue;
        };
        let proxy =
            crate::kafka_proxy::DropFirstProduceAnswer::forward_to(listener, private.listen);
        let r = fresh_suffix();
        let (topic, kt) = names(&r, "resent");
        b.create_topic_at(proxy.addr(), &kt, 1).await;
        let (a, check) = b
            .adapter(&KafkaAdapter {
                bootstrap: Some(proxy.addr()),
                idempotence,
                delivery_timeout: Duration::from_secs(8),
                cloudevents_source: None,
            })
            .await;
        check.unwrap_or_else(|e| panic!("{case}: the adapter's start passes: {e}"));
        let (repo, _clock) = crate::broker::repo();
        let row = write_one(
            &repo,
            event(&topic, "k", json!({"n": 15})).build().expect("valid"),
        )
        .await;
        let relay = relay_for(&repo, a)
            .publish_timeout(Duration::from_secs(10))
            .build()
            .expect("relay");
        let rep = cycle(&relay).await;
        assert_eq!(rep.completed, vec![row.id], "{case}: completed: {rep:?}");
        assert_eq!(
            proxy.dropped(),
            1,
            "{case}: the first Produce answer was discarded"
        );
        assert!(
            proxy.produce_requests() >= 2,
            "{case}: the client resent the batch"
        );
        let got = b.read_at(proxy.addr(), &kt).await;
        let id = row.id.hyphenated().to_string();
        assert!(
            got.iter()
                .all(|m| m.header("id").as_deref() == Some(id.as_str())
                    && m.header("event_id").as_deref() == Some(id.as_str())),
            "{case}: {got:?}"
        );
        if idempotence {
            assert_eq!(got.len(), 1, "{case}: the resent batch is stored once");
        } else {
            assert_eq!(got.len(), 2, "{case}: the resent batch is stored twice");
            assert_eq!(got[0].partition, got[1].partition);
            assert_eq!(
                got[1].offset,
                got[0].offset + 1,
                "{case}: next to each other"
            );
        }
        drop(private);
    }
    if skipped.is_empty() {
        Outcome::Passed
    } else {
        Outcome::Skipped(skipped)
    }
}

/// K-16 A broker that grants no idempotent producer (Needs: no `idempotent_producer`).
pub async fn k_16(b: &dyn KafkaUnderTest) -> Outcome {
    if has(b, KafkaCapability::IdempotentProducer).await {
        Outcome::skipped("K-16", "no ", KafkaCapability::IdempotentProducer);
        return Outcome::Skipped(vec![format!(
            "K-16: no {}",
            KafkaCapability::IdempotentProducer.name()
        )]);
    }
    let r = fresh_suffix();
    let (on_topic, on_kt) = names(&r, "on");
    let (off_topic, off_kt) = names(&r, "off");
    b.create_topic(&on_kt, 1, &[]).await;
    b.create_topic(&off_kt, 1, &[]).await;
    let base = default_adapter(b).await;
    let (on, check) = b
        .adapter(&KafkaAdapter {
            idempotence: true,
            ..base.clone()
        })
        .await;
    let text = check.expect_err("K-16: the check fails under idempotence on");
    assert!(
        text.starts_with("Kafka: the broker did not grant an idempotent producer: ")
            && text.ends_with("set idempotence off to send without one"),
        "K-16: {text:?}"
    );
    let (repo, _clock) = crate::broker::repo();
    let row = write_one(
        &repo,
        event(&on_topic, "k", json!({"n": 16}))
            .build()
            .expect("valid"),
    )
    .await;
    let rep = cycle(&relay_for(&repo, on).build().expect("relay")).await;
    assert_eq!(rep.transient.len(), 1, "K-16 on: transient: {rep:?}");
    let stored = get(&repo, row.id).await;
    assert_eq!(stored.attempts_made, 0);
    let last = stored.last_error.unwrap_or_default();
    assert!(
        last.starts_with("Kafka: the broker did not grant an idempotent producer: ")
            && last.ends_with("set idempotence off to send without one"),
        "K-16 on: {last:?}"
    );
    assert!(b.read(&on_kt).await.is_empty(), "K-16 on: nothing stored");
    let (off, check) = b
        .adapter(&KafkaAdapter {
            idempotence: false,
            ..base
        })
        .await;
    check.expect("K-16 off: the check passes");
    let (repo, _clock) = crate::broker::repo();
    let row = write_one(
        &repo,
        event(&off_topic, "k", json!({"n": 16}))
            .build()
            .expect("valid"),
    )
    .await;
    let rep = cycle(&relay_for(&repo, off).build().expect("relay")).await;
    assert_eq!(rep.completed, vec![row.id], "K-16 off: completed: {rep:?}");
    b.delete_topic(&on_kt).await;
    b.delete_topic(&off_kt).await;
    Outcome::Passed
}

/// K-17 A republished event on Kafka: two records with the same `id` and `event_id`.
pub async fn k_17(b: &dyn KafkaUnderTest) -> Outcome {
    let r = fresh_suffix();
    let (topic, kt) = names(&r, "orders");
    b.create_topic(&kt, 1, &[]).await;
    let row = event(&topic, "k", json!({"n": 17}))
        .build()
        .expect("valid")
        .into_row(chrono::Utc::now());
    let m = Message::from_event(&row);
    let a = adapter(b, &default_adapter(b).await).await;
    a.publish(&m).await.expect("K-17: first publish");
    a.publish(&m).await.expect("K-17: second publish");
    let got = b.read(&kt).await;
    let id = row.id.hyphenated().to_string();
    assert_eq!(got.len(), 2, "K-17: two records");
    for m in &got {
        assert_eq!(m.header("id").as_deref(), Some(id.as_str()));
        assert_eq!(m.header("event_id").as_deref(), Some(id.as_str()));
    }
    b.delete_topic(&kt).await;
    Outcome::Passed
}

/// K-18 CloudEvents binary mode, Kafka case.
pub async fn k_18(b: &dyn KafkaUnderTest) -> Outcome {
    let r = fresh_suffix();
    let (topic, kt) = names(&r, "orders");
    b.create_topic(&kt, 1, &[]).await;
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
    let a = adapter(
        b,
        &KafkaAdapter {
            cloudevents_source: Some("/orders-service".into()),
            ..default_adapter(b).await
        },
    )
    .await;
    let rep = cycle(&relay_for(&repo, a).build().expect("relay")).await;
    assert_eq!(rep.completed, vec![row.id], "K-18: completed: {rep:?}");
    let got = b.read(&kt).await;
    assert_eq!(got.len(), 1);
    let m = &got[0];
    let id = row.id.hyphenated().to_string();
    let time = row
        .created_at
        .to_rfc3339_opts(txoutbox_core::broker::CREATED_AT_FORMAT, true);
    assert_eq!(
        m.key.as_deref(),
        Some(&b"acct 1"[..]),
        "K-18: key = partitionkey"
    );
    assert_eq!(m.json(), json!({"n": 18}), "K-18: the body is the payload");
    for (k, v) in [
        ("id", id.as_str()),
        ("event_id", id.as_str()),
        ("tenant", "acme"),
        ("traceparent", t),
        ("ce_specversion", "1.0"),
        ("ce_id", id.as_str()),
        ("ce_source", "/orders-service"),
        ("ce_type", "order créé"),
        ("ce_time", time.as_str()),
        ("ce_partitionkey", "acct 1"),
        ("ce_correlationid", "c-1"),
        ("content-type", "application/json"),
    ] {
        assert_eq!(m.header(k).as_deref(), Some(v), "K-18: header {k}");
    }
    assert_eq!(m.header("ce_causationid"), None);
    assert_eq!(m.header("ce_traceparent"), None);
    assert_eq!(get(&repo, row.id).await.status, Status::Completed);
    b.delete_topic(&kt).await;
    Outcome::Passed
}

/// Generates one `#[tokio::test]` per Kafka trial (`k_07` … `k_18`); a trial that skipped a
/// case prints `SKIPPED …` with the capability. `$b` is an expression evaluated per test whose
/// value implements [`KafkaUnderTest`].
#[macro_export]
macro_rules! kafka_suite {
    ($b:expr) => {
        $crate::kafka_suite!(@tests $b; k_07, k_09, k_10, k_11, k_14, k_15, k_16, k_17, k_18);
    };
    (@tests $b:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                let b = $b;
                match $crate::kafka::$name(&b).await {
                    $crate::kafka::Outcome::Passed => {}
                    $crate::kafka::Outcome::Skipped(cases) => {
                        $crate::kafka::report(&format!(
                            "{}: cases skipped for want of a capability: {cases:?}",
                            stringify!($name)
                        ));
                    }
                }
            }
        )*
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values of the Java client's `Utils.murmur2`.
    #[test]
    fn murmur2_matches_the_java_client() {
        assert_eq!(murmur2(b"21"), -973932308);
        assert_eq!(murmur2(b"foobar"), -790332482);
        assert_eq!(murmur2(b"a-little-bit-long-string"), -985981536);
        assert_eq!(murmur2(b"a-little-bit-longer-string"), -1486304829);
        assert_eq!(
            murmur2(b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8"),
            -58897971
        );
        assert_eq!(murmur2(b"abc"), 479470107);
    }
}
