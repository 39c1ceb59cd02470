//! End-to-end trials on a live broker: the outbox relay publishes through the real adapter, an
//! inbox runner reads the same broker through the real subscription (scenarios.md J-14, J-15
//! in section 26 and SI-03 in section 29). Both stores are in memory on the real clock.
//!
//! # How a broker crate runs them
//!
//! A broker crate implements [`EndToEndUnderTest`] in one of its test files: each call of
//! [`EndToEndUnderTest::trial`] makes a fresh stream (NATS), key prefix (Redis), topic set
//! (Kafka) or exchange and queues (RabbitMQ), and returns an [`EndToEndTrial`] that hands out
//! the outbox adapter publishing there and inbox subscriptions of group `g` reading it back.
//! Then it invokes the macro:
//!
//! ```text
//! struct MyBroker;
//! #[async_trait::async_trait]
//! impl txoutbox_conformance::inbox::end_to_end::EndToEndUnderTest for MyBroker {
//!     fn kind(&self) -> txoutbox_conformance::broker::BrokerKind { BrokerKind::Kafka }
//!     async fn trial(&self) -> Box<dyn EndToEndTrial> { /* fresh topics, adapter, … */ }
//! }
//! txoutbox_conformance::inbox_end_to_end_suite!(MyBroker);
//! ```
//!
//! which generates `j_14`, `j_15`, `si_03_a` and `si_03_b`. [`BrokerKind`] decides what J-15
//! expects: one delivery where the broker drops a republished event id (NATS), two otherwise.
//! Each trial calls [`EndToEndTrial::cleanup`] at its end.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use serde_json::json;
use tokio::task::JoinHandle;
use txoutbox_core::backoff::{Backoff, RandomSource, SeededRng};
use txoutbox_core::broker::{Ack, Broker, Message};
use txoutbox_core::clock::SystemClock;
use txoutbox_core::error::BrokerError;
use txoutbox_core::event::{NewEvent, Status};
use txoutbox_core::inbox::memory::{InMemoryInbox, MemInboxTx};
use txoutbox_core::inbox::repository::InboxRepository;
use txoutbox_core::inbox::{
    DeliveryOutcome as O, Handler, HandlerError, HandlerOutcome, InboxEvent, OnFailure, Runner,
    Subscription,
};
use txoutbox_core::relay::Relay;
use txoutbox_core::{CancellationToken, InMemoryRepository};
use uuid::Uuid;

use crate::broker::BrokerKind;
use crate::inbox::ctx::{Recorder, g};

/// One fresh stream, key prefix or topic set, with both halves attached to it.
#[async_trait]
pub trait EndToEndTrial: Send + Sync {
    /// The outbox adapter: publishes each topic where [`subscription`](Self::subscription)
    /// reads it.
    fn adapter(&self) -> Arc<dyn Broker>;
    /// Another adapter like [`adapter`](Self::adapter) with a connection of its own, as a
    /// second relay process would have.
    async fn another_adapter(&self) -> Arc<dyn Broker>;
    /// An inbox subscription of group `g` for runner `worker` over `topics`, whose unended
    /// deliveries come back after `redeliver_after` (NATS ack_wait, Redis claim_idle, or the
    /// broker's equivalent).
    async fn subscription(
        &self,
        worker: &str,
        topics: &[&str],
        redeliver_after: Duration,
    ) -> Arc<dyn Subscription>;
    /// Removes what the trial created.
    async fn cleanup(&self);
}

/// A live broker under the end-to-end trials.
#[async_trait]
pub trait EndToEndUnderTest: Send + Sync {
    /// Which broker (J-15's expectation).
    fn kind(&self) -> BrokerKind;
    /// A fresh, isolated trial. Panics when the broker cannot be reached (a trial fails, never
    /// skips).
    async fn trial(&self) -> Box<dyn EndToEndTrial>;
}

/// The consumer's handler of these trials: writes one effect `{message_id, key, seq}` in the
/// inbox transaction. With a seeded source it fails as SI-01 says: `fail("boom")` (after
/// writing its effect, which the rollback undoes) with probability 0.05, `transient("down")`
/// with 0.03.
struct EffectHandler {
    rng: Option<Mutex<StdRng>>,
    runs: AtomicUsize,
    fails: AtomicUsize,
    transients: AtomicUsize,
}

impl EffectHandler {
    fn new(seed: Option<u64>) -> Arc<Self> {
        Arc::new(Self {
            rng: seed.map(|s| Mutex::new(StdRng::seed_from_u64(s))),
            runs: AtomicUsize::new(0),
            fails: AtomicUsize::new(0),
            transients: AtomicUsize::new(0),
        })
    }
}

#[async_trait]
impl Handler<MemInboxTx> for EffectHandler {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut MemInboxTx,
    ) -> Result<HandlerOutcome, HandlerError> {
        self.runs.fetch_add(1, Ordering::SeqCst);
        let x: f64 = match &self.rng {
            Some(r) => r.lock().expect("poisoned").random(),
            None => 1.0,
        };
        if x < 0.03 {
            self.transients.fetch_add(1, Ordering::SeqCst);
            return Err(HandlerError::transient("down"));
        }
        tx.record(json!({
            "message_id": row.message_id,
            "key": row.partition_key,
            "seq": row.payload.get("seq"),
        }));
        if x < 0.08 {
            self.fails.fetch_add(1, Ordering::SeqCst);
            return Err(HandlerError::new("boom"));
        }
        Ok(HandlerOutcome::completed())
    }
}

/// The adapter wrapped as SI-03 says: each publish is refused with probability 0.05 or fails
/// transiently with 0.03 before it reaches the broker.
struct Flaky {
    inner: Arc<dyn Broker>,
    rng: Mutex<SeededRng>,
    refused: Arc<AtomicUsize>,
    transient: Arc<AtomicUsize>,
}

#[async_trait]
impl Broker for Flaky {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let u = self.rng.lock().expect("poisoned").unit();
        if u < 0.05 {
            self.refused.fetch_add(1, Ordering::SeqCst);
            return Err(BrokerError::rejected("refused by the trial (SI-03)"));
        }
        if u < 0.08 {
            self.transient.fetch_add(1, Ordering::SeqCst);
            return Err(BrokerError::transient("unreachable (SI-03)"));
        }
        self.inner.publish(m).await
    }
}

/// Both stores and the hooks of one trial.
struct Sides {
    outbox: InMemoryRepository,
    inbox: InMemoryInbox,
    rec: Arc<Recorder>,
}

impl Sides {
    fn new() -> Self {
        Self {
            outbox: InMemoryRepository::new(Arc::new(SystemClock)),
            inbox: InMemoryInbox::new(Arc::new(SystemClock)),
            rec: Arc::default(),
        }
    }

    /// The committed effects as (message id, key, seq), in store order.
    fn effects(&self) -> Vec<(String, String, i64)> {
        self.inbox
            .records()
            .into_iter()
            .map(|v| {
                (
                    v["message_id"].as_str().unwrap_or_default().to_owned(),
                    v["key"].as_str().unwrap_or_default().to_owned(),
                    v["seq"].as_i64().unwrap_or(-1),
                )
            })
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

    fn results_of(&self, message_id: &str) -> Vec<O> {
        self.rec
            .results()
            .into_iter()
            .filter(|r| r.message_id.as_deref() == Some(message_id))
            .map(|r| r.outcome)
            .collect()
    }
}

struct Running {
    runner: Arc<Runner<InMemoryInbox>>,
    task: JoinHandle<()>,
}

impl Running {
    fn spawn(runner: Runner<InMemoryInbox>) -> Self {
        let runner = Arc::new(runner);
        runner.start();
        let r = runner.clone();
        let task = tokio::spawn(async move {
            r.run_until_stopped().await.expect("runner runs");
        });
        Self { runner, task }
    }
    async fn stop(self) {
        self.runner.stop();
        let _ = self.task.await;
    }
}

fn event(topic: &str, key: &str, seq: usize) -> txoutbox_core::EventBuilder {
    NewEvent::builder()
        .event_type("acct.changed")
        .aggregate("acct", Uuid::nil())
        .topic(topic)
        .partition_key(key)
        .payload_json(json!({"key": key, "seq": seq}))
}

fn one_relay(repo: &InMemoryRepository, broker: Arc<dyn Broker>) -> Relay {
    Relay::builder(Arc::new(repo.clone()), broker)
        .worker_id("r1")
        .build()
        .expect("relay")
}

/// J-14: an outbox event with headers, trace_id, schema_version, topic `orders` and key
/// `acct-1` goes through one relay cycle over the real adapter and one inbox runner on the
/// same broker; the row's message_id is the event id, its source `orders`, and its
/// event_type, partition_key, trace_id, schema_version, headers (exactly) and payload equal the
/// event's (R50, R137, R141).
pub async fn j_14<S: EndToEndUnderTest + ?Sized>(s: &S) {
    let t = s.trial().await;
    let sides = Sides::new();
    let written = sides
        .outbox
        .write_committed(vec![
            event("orders", "acct-1", 0)
                .header("tenant", "acme")
                .header(
                    "traceparent",
                    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                )
                .trace_id("tr-1")
                .schema_version("1.0.0")
                .build()
                .expect("valid event"),
        ])
        .await
        .expect("write");
    let ev = written.into_iter().next().expect("one row").event;
    let relay = one_relay(&sides.outbox, t.adapter());
    let report = relay
        .cycle(&CancellationToken::new())
        .await
        .expect("relay cycle");
    assert_eq!(report.completed, vec![ev.id], "J-14: published: {report:?}");
    let sub = t
        .subscription("w1", &["orders"], Duration::from_secs(30))
        .await;
    let runner = Running::spawn(
        Runner::builder(sides.inbox.clone(), sub, "g")
            .worker_id("w1")
            .handler(EffectHandler::new(None))
            .topics(["orders"])
            .process_stored(false)
            .messages_per_transaction(1)
            .concurrency(1)
            .hooks(sides.rec.clone())
            .build()
            .expect("runner"),
    );
    let id = ev.id.hyphenated().to_string();
    sides
        .wait_for("the event handled", Duration::from_secs(15), |s| {
            !s.results_of(&id).is_empty()
        })
        .await;
    runner.stop().await;
    assert_eq!(sides.results_of(&id), vec![O::Completed]);
    let row = sides
        .inbox
        .get_by_message_id(&id, &g())
        .await
        .expect("read")
        .expect("J-14: a row whose message_id is the event id");
    assert_eq!(row.status, Status::Completed);
    assert_eq!(row.source, "orders");
    assert_eq!(row.event_type, ev.event_type);
    assert_eq!(row.partition_key.as_deref(), Some("acct-1"));
    assert_eq!(row.trace_id.as_deref(), Some("tr-1"));
    assert_eq!(row.schema_version.as_deref(), Some("1.0.0"));
    assert_eq!(
        row.headers, ev.headers,
        "J-14: the headers equal the event's exactly"
    );
    assert_eq!(row.payload, ev.payload);
    t.cleanup().await;
}

/// J-15: one outbox event is published twice within 10 s (a relay cycle, then the adapter
/// again, as a relay whose commit was lost would); then a marker event of the same key. Once
/// the marker is handled, every earlier delivery has been: NATS (which drops the republished
/// id) made one delivery, other brokers two, the second a duplicate; one row, one effect
/// (R53, R109).
pub async fn j_15<S: EndToEndUnderTest + ?Sized>(s: &S) {
    let t = s.trial().await;
    let sides = Sides::new();
    let rows = sides
        .outbox
        .write_committed(vec![
            event("orders", "acct-1", 0).build().expect("valid"),
            event("orders", "acct-1", 1).build().expect("valid"),
        ])
        .await
        .expect("write");
    let (ev, marker) = (rows[0].event.clone(), rows[1].event.clone());
    let adapter = t.adapter();
    let relay = Relay::builder(Arc::new(sides.outbox.clone()), adapter.clone())
        .worker_id("r1")
        .max_per_key(1)
        .build()
        .expect("relay");
    let r = relay.cycle(&CancellationToken::new()).await.expect("cycle");
    assert_eq!(r.completed, vec![ev.id], "{r:?}");
    let first_at = tokio::time::Instant::now();
    let ack = adapter
        .publish(&Message::from_event(&ev))
        .await
        .expect("J-15: the republish is accepted");
    assert!(first_at.elapsed() < Duration::from_secs(10));
    assert_eq!(
        ack.duplicate,
        s.kind().drops_republished_ids(),
        "J-15: the broker's duplicate flag"
    );
    let r = relay.cycle(&CancellationToken::new()).await.expect("cycle");
    assert_eq!(r.completed, vec![marker.id], "{r:?}");
    let sub = t
        .subscription("w1", &["orders"], Duration::from_secs(30))
        .await;
    let runner = Running::spawn(
        Runner::builder(sides.inbox.clone(), sub, "g")
            .worker_id("w1")
            .handler(EffectHandler::new(None))
            .topics(["orders"])
            .process_stored(false)
            .messages_per_transaction(1)
            .concurrency(1)
            .hooks(sides.rec.clone())
            .build()
            .expect("runner"),
    );
    let (id, marker_id) = (
        ev.id.hyphenated().to_string(),
        marker.id.hyphenated().to_string(),
    );
    sides
        .wait_for("the marker handled", Duration::from_secs(15), |s| {
            !s.results_of(&marker_id).is_empty()
        })
        .await;
    runner.stop().await;
    let expected = if s.kind().drops_republished_ids() {
        vec![O::Completed]
    } else {
        vec![O::Completed, O::Duplicate]
    };
    assert_eq!(sides.results_of(&id), expected, "J-15 on {:?}", s.kind());
    let rows: Vec<_> = sides
        .inbox
        .rows()
        .into_iter()
        .filter(|r| r.message_id == id)
        .collect();
    assert_eq!(rows.len(), 1, "J-15: one row");
    let effects: Vec<_> = sides.effects().into_iter().filter(|e| e.0 == id).collect();
    assert_eq!(effects.len(), 1, "J-15: one effect");
    t.cleanup().await;
}

/// SI-03's size: S-01's plan.
const KEYS: usize = 25;
const PER_KEY: usize = 24;
/// SI-03's bound.
const BOUND: Duration = Duration::from_secs(180);

/// SI-03 (a): S-01's plan (25 keys × 24 events, seeded) written into the outbox by two
/// serialized writers; two relays (max_per_key 5, publish_concurrency 4) over the real adapter
/// wrapped to refuse 5 % and fail 3 % of publishes transiently; one inbox runner (concurrency
/// 4, on_failure record, process_stored true, handler failures as SI-01); backoff 0.2 s to 2 s
/// on both sides; the real clock; bounded by 180 s. Expected: 600 inbox rows, all completed;
/// each event id's effect once; per key the effects in write order (R53, R119, R134, R136,
/// R144).
pub async fn si_03_a<S: EndToEndUnderTest + ?Sized>(s: &S) {
    si_03(s, false).await;
}

/// SI-03 (b): as (a), with the runner killed (its task aborted, its deliveries unended, its
/// open transactions dropped) and restarted twice at random moments. Expected: each event id's
/// effect once, 0 failed rows; the report prints the keys whose effects are out of write order
/// (R146 (c)).
pub async fn si_03_b<S: EndToEndUnderTest + ?Sized>(s: &S) {
    si_03(s, true).await;
}

async fn si_03<S: EndToEndUnderTest + ?Sized>(s: &S, kills: bool) {
    let name = if kills { "SI-03 (b)" } else { "SI-03 (a)" };
    let seed: u64 = std::env::var("INBOX_STAND_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_261_202);
    println!("{name} on {:?}: seed {seed} (INBOX_STAND_SEED)", s.kind());
    let mut rng = StdRng::seed_from_u64(seed);
    let t = s.trial().await;
    let sides = Sides::new();
    let topic = "acct";
    // S-01's plan: the keys' slots shuffled, then numbered per key.
    let mut plan: Vec<(String, usize)> = (0..KEYS)
        .flat_map(|k| (0..PER_KEY).map(move |_| (format!("acct-{k:02}"), 0)))
        .collect();
    plan.shuffle(&mut rng);
    let mut next: HashMap<String, usize> = HashMap::new();
    for (k, n) in plan.iter_mut() {
        let c = next.entry(k.clone()).or_default();
        *n = *c;
        *c += 1;
    }
    let started = tokio::time::Instant::now();
    let refused = Arc::new(AtomicUsize::new(0));
    let transient = Arc::new(AtomicUsize::new(0));
    let shutdown = CancellationToken::new();
    let mut relays = Vec::new();
    for i in 0..2u64 {
        let inner = if i == 0 {
            t.adapter()
        } else {
            t.another_adapter().await
        };
        let relay = Relay::builder(
            Arc::new(sides.outbox.clone()),
            Arc::new(Flaky {
                inner,
                rng: Mutex::new(SeededRng::new(seed ^ (0x5eed + i))),
                refused: refused.clone(),
                transient: transient.clone(),
            }),
        )
        .worker_id(format!("r{}", i + 1))
        .max_per_key(5)
        .publish_concurrency(4)
        .backoff(Backoff::new(0.2, 2.0).expect("backoff"))
        .poll_interval(Duration::from_millis(50))
        .idle_backoff_max(Duration::from_millis(200))
        .random_source(Box::new(SeededRng::new(seed.wrapping_add(i))))
        .build()
        .expect("relay");
        let stop = shutdown.clone();
        relays.push(tokio::spawn(async move {
            relay.run(stop).await.expect("relay runs");
        }));
    }
    // Two writers take the plan's events in turn; holding the cursor while writing serializes
    // them, so each key's events are committed in seq order.
    let cursor = Arc::new(tokio::sync::Mutex::new(0usize));
    let plan = Arc::new(plan);
    let written: Arc<Mutex<HashMap<String, Vec<Uuid>>>> = Arc::default();
    let mut writers = Vec::new();
    for w in 0..2u64 {
        let (cursor, plan, written, repo) = (
            cursor.clone(),
            plan.clone(),
            written.clone(),
            sides.outbox.clone(),
        );
        writers.push(tokio::spawn(async move {
            let mut wrng = StdRng::seed_from_u64(seed.wrapping_mul(31).wrapping_add(w));
            loop {
                {
                    let mut cur = cursor.lock().await;
                    let Some((k, n)) = plan.get(*cur).cloned() else {
                        break;
                    };
                    *cur += 1;
                    let rows = repo
                        .write_committed(vec![event(topic, &k, n).build().expect("valid")])
                        .await
                        .expect("write");
                    written
                        .lock()
                        .expect("poisoned")
                        .entry(k)
                        .or_default()
                        .push(rows[0].event.id);
                }
                tokio::time::sleep(Duration::from_millis(wrng.random_range(0..=4))).await;
            }
        }));
    }
    let handler = EffectHandler::new(Some(seed ^ 0xfa11));
    let redeliver = Duration::from_secs(2);
    let build = |sub: Arc<dyn Subscription>| {
        Runner::builder(sides.inbox.clone(), sub, "g")
            .worker_id("w1")
            .handler(handler.clone())
            .topics([topic])
            .on_failure(OnFailure::Record)
            .process_stored(true)
            .processor_poll_interval(Duration::from_millis(100))
            .messages_per_transaction(1)
            .concurrency(4)
            .backoff(Backoff::new(0.2, 2.0).expect("backoff"))
            .handler_timeout(Duration::from_secs(2))
            .lease_ttl(Duration::from_secs(5))
            .hooks(sides.rec.clone())
            .random_source(Box::new(SeededRng::new(seed.wrapping_add(7))))
            .build()
            .expect("runner")
    };
    let mut runner = Running::spawn(build(t.subscription("w1", &[topic], redeliver).await));
    let total = KEYS * PER_KEY;
    let mut kill_times = Vec::new();
    if kills {
        for _ in 0..2 {
            let after = Duration::from_millis(rng.random_range(300..2_000));
            tokio::time::sleep(after).await;
            // kill: the task is aborted with its deliveries unended.
            runner.task.abort();
            let _ = runner.task.await;
            let done = sides
                .inbox
                .rows()
                .iter()
                .filter(|r| r.status == Status::Completed)
                .count();
            kill_times.push((started.elapsed(), done));
            runner = Running::spawn(build(t.subscription("w1", &[topic], redeliver).await));
        }
    }
    let settled = |s: &Sides| {
        let out = s.outbox.rows();
        let inb = s.inbox.rows();
        out.len() == total
            && out
                .iter()
                .all(|r| matches!(r.status, Status::Completed | Status::Failed))
            && inb.len() == total
            && inb
                .iter()
                .all(|r| matches!(r.status, Status::Completed | Status::Failed))
    };
    let deadline = started + BOUND;
    while !settled(&sides) {
        if tokio::time::Instant::now() >= deadline {
            let out = sides.outbox.rows();
            let inb = sides.inbox.rows();
            panic!(
                "{name}: not settled within {BOUND:?}: outbox {} rows, {} completed; inbox {} rows, {} completed",
                out.len(),
                out.iter().filter(|r| r.status == Status::Completed).count(),
                inb.len(),
                inb.iter().filter(|r| r.status == Status::Completed).count()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = started.elapsed();
    runner.stop().await;
    shutdown.cancel();
    for r in relays {
        r.await.expect("relay task");
    }
    for w in writers {
        w.await.expect("writer task");
    }
    let written = written.lock().expect("poisoned").clone();
    let outbox_failed = sides
        .outbox
        .rows()
        .iter()
        .filter(|r| r.status == Status::Failed)
        .count();
    let rows = sides.inbox.rows();
    let failed = rows.iter().filter(|r| r.status == Status::Failed).count();
    let effects = sides.effects();
    // Per key, the seqs of its effects in store order.
    let mut per_key: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (_, k, n) in &effects {
        per_key.entry(k.clone()).or_default().push(*n);
    }
    let out_of_order: Vec<&String> = per_key
        .iter()
        .filter(|(_, ns)| ns.windows(2).any(|w| w[0] > w[1]))
        .map(|(k, _)| k)
        .collect();
    let results = sides.rec.results();
    let count = |o: O| results.iter().filter(|r| r.outcome == o).count();
    println!(
        "{name} on {:?}: settled in {:.1} s; {} events; publishes refused {}, failed transiently {}; \
         outbox failed rows {outbox_failed}; handler runs {}, failures {}, transient {}; \
         deliveries {} (completed {}, recorded {}, duplicate {}, landed {}); inbox rows {}, failed {failed}; \
         kills (at, inbox rows completed) {kill_times:?}; keys out of order {}",
        s.kind(),
        elapsed.as_secs_f64(),
        total,
        refused.load(Ordering::SeqCst),
        transient.load(Ordering::SeqCst),
        handler.runs.load(Ordering::SeqCst),
        handler.fails.load(Ordering::SeqCst),
        handler.transients.load(Ordering::SeqCst),
        results.len(),
        count(O::Completed),
        count(O::Recorded),
        count(O::Duplicate),
        count(O::Landed),
        rows.len(),
        out_of_order.len(),
    );
    assert_eq!(outbox_failed, 0, "{name}: every outbox row published");
    let ids: HashSet<String> = written
        .values()
        .flatten()
        .map(|id| id.hyphenated().to_string())
        .collect();
    assert_eq!(ids.len(), total);
    let mut effect_ids: Vec<&String> = effects.iter().map(|e| &e.0).collect();
    effect_ids.sort();
    let distinct: HashSet<String> = effect_ids.iter().map(|s| (*s).clone()).collect();
    assert_eq!(
        effect_ids.len(),
        distinct.len(),
        "{name}: no event's effect twice"
    );
    assert_eq!(distinct, ids, "{name}: every event's effect");
    assert_eq!(failed, 0, "{name}: 0 failed inbox rows");
    assert_eq!(rows.len(), total, "{name}: one inbox row per event");
    if !kills {
        assert!(
            rows.iter().all(|r| r.status == Status::Completed),
            "{name}: every inbox row completed"
        );
        assert!(
            out_of_order.is_empty(),
            "{name}: effects in write order per key; out of order: {out_of_order:?}"
        );
    }
    // The effects' seqs per key are the written ones.
    for (k, ids_of_key) in &written {
        assert_eq!(
            per_key.get(k).map_or(0, Vec::len),
            ids_of_key.len(),
            "{name}: key {k}"
        );
    }
    t.cleanup().await;
}

/// Generates one `#[tokio::test]` per end-to-end trial (J-14, J-15, SI-03 (a) and (b)); EXPR
/// implements [`EndToEndUnderTest`].
#[macro_export]
macro_rules! inbox_end_to_end_suite {
    ($f:expr) => {
        $crate::inbox_end_to_end_suite!(@tests $f; j_14, j_15, si_03_a, si_03_b);
    };
    (@tests $f:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::inbox::end_to_end::$name(&$f).await;
            }
        )*
    };
}
