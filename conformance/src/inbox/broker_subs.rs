//! Inbox trials on a live broker through a real subscription (scenarios.md section 22, G, and
//! the broker-independent part of section 26, J), with the in-memory inbox.
//!
//! G-01 to G-06, G-08 and G-09 run here. G-07 (two processors keep key order) has no
//! subscription in it, so a broker adds nothing; it runs with the scripted subscription only.
//! Where a scenario's fixture has no broker command, the trial makes it from outside:
//! `duplicate(m1)` is m1 published again (G-02, G-04, G-05, G-06), `fail_commit` a commit the
//! trial's wrapper never sends to the broker (G-04), `kill` an aborted runner task (G-03,
//! G-08), `advance` the store's clock only (G-06's lease; the broker's redelivery times are
//! real).
//!
//! A broker crate implements [`SubscriptionUnderTest`] in its tests and invokes
//! [`crate::inbox_broker_suite!`], as [`crate::broker`] serves the outbox adapters. Each trial
//! gets a fresh stream or key prefix ([`SubscriptionUnderTest::trial`]); the runners run their
//! real loops ([`txoutbox_core::inbox::Runner::run`]) on tokio's real clock, since the broker
//! redelivers on its own.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde_json::json;
use tokio::task::JoinHandle;
use txoutbox_core::backoff::{Backoff, SeededRng};
use txoutbox_core::event::Status;
use txoutbox_core::inbox::memory::InMemoryInbox;
use txoutbox_core::inbox::repository::InboxRepository;
use txoutbox_core::inbox::{DeliveryOutcome as O, OnFailure, Runner, RunnerBuilder, Subscription};

use crate::inbox::ctx::{Recorder, g};
use crate::inbox::harness::InboxHarness;
use crate::inbox::memory::MemInboxHarness;
use crate::inbox::script::{Act, Gate, ScriptedHandler};

pub mod db_outage;
mod groups;
pub use db_outage::{DatabaseOutageFigures, DbFault, OutageDatabase, database_outage};
pub use groups::{g_02, g_04, g_05, g_06, g_08, g_09};

/// One fresh stream (NATS) or key prefix (Redis) of a trial.
#[async_trait]
pub trait SubscriptionTrial: Send + Sync {
    /// Publishes one message on topic `src`: `attrs` as NATS headers or Redis fields, `body`
    /// as the NATS body or the Redis `payload` field.
    async fn publish(&self, attrs: &[(&str, &str)], body: &str);
    /// A subscription of group `g` for runner `worker`, whose unended deliveries come back after
    /// `redeliver_after` (NATS ack_wait, Redis claim_idle).
    async fn subscription(&self, worker: &str, redeliver_after: Duration) -> Arc<dyn Subscription>;
    /// The earliest a killed runner's delivery may come back after the kill, for a
    /// subscription built with `redeliver_after`: half of it by default (NATS ack_wait, Redis
    /// claim_idle); zero on RabbitMQ, which returns it as soon as the connection closes (R178).
    fn redelivery_floor(&self, redeliver_after: Duration) -> Duration {
        redeliver_after / 2
    }
    /// Why, on this broker, a trial cannot make a key's second delivery reach a second runner
    /// while the first runner still runs the first, or none. G-02 and G-09 stage exactly that;
    /// on such a broker they print `SKIPPED … needs a second runner to get a key's delivery
    /// while the first runs` with this reason and check nothing (Kafka: a partition is read by
    /// one member at a time, R175, and J-21 covers its two runners; RabbitMQ: the broker pushes
    /// the copy into the first runner's prefetch window, and J-28 covers its two runners).
    fn no_second_reader_on_demand(&self) -> Option<&'static str> {
        None
    }
    /// Removes the trial's streams.
    async fn cleanup(&self);
}

/// A broker under test.
#[async_trait]
pub trait SubscriptionUnderTest: Send + Sync {
    /// A fresh, isolated trial.
    async fn trial(&self) -> Box<dyn SubscriptionTrial>;
}

struct Bed {
    h: Arc<MemInboxHarness>,
    handler: Arc<ScriptedHandler<MemInboxHarness>>,
    rec: Arc<Recorder>,
    trial: Box<dyn SubscriptionTrial>,
}

struct Running {
    runner: Arc<Runner<InMemoryInbox>>,
    task: JoinHandle<()>,
}

impl Running {
    async fn stop(self) {
        self.runner.stop();
        let _ = self.task.await;
    }
    /// `kill`: the loop is dropped with its deliveries unended.
    fn kill(self) {
        self.task.abort();
    }
}

impl Bed {
    async fn new<S: SubscriptionUnderTest + ?Sized>(s: &S) -> Self {
        let h = Arc::new(MemInboxHarness::default());
        Self {
            handler: Arc::new(ScriptedHandler::new(h.clone())),
            h,
            rec: Arc::default(),
            trial: s.trial().await,
        }
    }

    async fn publish(&self, id: &str, key: &str, n: i64) {
        let body = json!({"key": key, "n": n}).to_string();
        self.trial
            .publish(
                &[
                    ("event_id", id),
                    ("topic", "src"),
                    ("event_type", "e"),
                    ("partition_key", key),
                ],
                &body,
            )
            .await;
    }

    async fn builder(
        &self,
        worker: &str,
        redeliver_after: Duration,
    ) -> RunnerBuilder<InMemoryInbox> {
        let sub = self.trial.subscription(worker, redeliver_after).await;
        self.builder_on(sub, worker)
    }

    fn builder_on(&self, sub: Arc<dyn Subscription>, worker: &str) -> RunnerBuilder<InMemoryInbox> {
        Runner::builder(self.h.backend(), sub, "g")
            .worker_id(worker)
            .handler(self.handler.clone())
            .process_stored(false)
            .sources(["src"])
            .messages_per_transaction(1)
            .concurrency(2)
            .hooks(self.rec.clone())
            .random_source(Box::new(SeededRng::new(7)))
    }

    fn run(&self, b: RunnerBuilder<InMemoryInbox>) -> Running {
        let runner = Arc::new(b.build().expect("runner builds"));
        runner.start();
        let r = runner.clone();
        let task = tokio::spawn(async move {
            r.run_until_stopped().await.expect("runner runs");
        });
        Running { runner, task }
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
}

/// G-01 on a broker: two runners of one group share its messages; each id's effect is written
/// once, and both runners handled some (R110, R119).
pub async fn g_01<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    b.handler.always(Act::Delay(Duration::from_millis(30)));
    let mut ids = Vec::new();
    for k in 0..4 {
        for n in 0..5 {
            let id = format!("m{k}-{n}");
            b.publish(&id, &format!("k{k}"), n).await;
            ids.push(id);
        }
    }
    let (r1, r2) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
    // Both subscriptions first (on Kafka both members then hold partitions), then both loops.
    let b1 = b
        .builder("w1", Duration::from_secs(30))
        .await
        .hooks(r1.clone());
    let b2 = b
        .builder("w2", Duration::from_secs(30))
        .await
        .hooks(r2.clone());
    let w1 = b.run(b1);
    let w2 = b.run(b2);
    b.wait_for("20 completions", Duration::from_secs(30), |b| {
        b.completed().len() >= 20
    })
    .await;
    w1.stop().await;
    w2.stop().await;
    let mut effects = b.h.effects().await;
    effects.sort();
    ids.sort();
    assert_eq!(effects, ids, "each message's effect exactly once");
    for id in &ids {
        let row =
            b.h.inbox
                .get_by_message_id(id, &g())
                .await
                .unwrap()
                .unwrap();
        assert_eq!(row.status, Status::Completed, "{id}");
    }
    let done = |r: &Recorder| {
        r.results()
            .iter()
            .filter(|x| x.outcome == O::Completed)
            .count()
    };
    assert!(
        done(&r1) > 0 && done(&r2) > 0,
        "each runner handled some: w1 {}, w2 {}",
        done(&r1),
        done(&r2)
    );
    b.trial.cleanup().await;
}

/// G-03 on a broker (and the "killed runner" test of issue 22): a delivery left unended by a
/// killed runner is handled by another runner of the group once the broker gives it back
/// (ack_wait on NATS, claim_idle on Redis); the killed run left no row and no effect
/// (R115, R119, R134, R136, R142).
pub async fn g_03<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    let gate = Gate::new();
    b.handler
        .script("m1", vec![Act::Gate(gate.clone()), Act::Write]);
    b.publish("m1", "k", 0).await;
    let redeliver = Duration::from_secs(2);
    let w1 = b.run(b.builder("w1", redeliver).await);
    tokio::time::timeout(Duration::from_secs(10), gate.reached(1))
        .await
        .expect("w1 starts m1");
    w1.kill();
    let killed_at = tokio::time::Instant::now();
    assert!(
        b.h.inbox
            .get_by_message_id("m1", &g())
            .await
            .unwrap()
            .is_none()
    );
    assert!(b.h.effects().await.is_empty());
    let w2 = b.run(b.builder("w2", redeliver).await);
    b.wait_for("m1 completed by w2", Duration::from_secs(15), |b| {
        b.completed() == vec!["m1".to_string()]
    })
    .await;
    assert!(
        killed_at.elapsed() >= b.trial.redelivery_floor(redeliver),
        "the message came back before the broker's redelivery time"
    );
    w2.stop().await;
    assert_eq!(b.handler.runs_of("m1"), 2);
    assert_eq!(b.h.effects().await, vec!["m1"]);
    b.trial.cleanup().await;
}

/// A message whose handler always fails becomes `failed` after its budget (on_failure rewind,
/// max_attempts 3: two rewinds, then the third delivery is recorded terminal, R128), and never
/// blocks other keys: the messages of another key complete meanwhile. While it is rewound it
/// has no row (R127), so it is not in blocked_keys then; once `failed` it is out of line, so
/// neither blocked_keys lists its key nor does it hold a later message of that key (R145, R161).
/// On Kafka, which refuses the rewind policy (R175), the failures are recorded instead and the
/// embedded processor runs the row again until the same budget is spent (R126).
pub async fn poison_blocks_only_its_key<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    b.handler.script(
        "bad",
        vec![
            Act::Fail("boom".into()),
            Act::Fail("boom".into()),
            Act::Fail("boom".into()),
            Act::Fail("boom".into()),
        ],
    );
    b.publish("bad", "k1", 0).await;
    for n in 0..3 {
        b.publish(&format!("other{n}"), "k2", n).await;
    }
    let sub = b.trial.subscription("w1", Duration::from_secs(30)).await;
    // Kafka refuses the rewind policy (R175): there the failure is recorded and the embedded
    // processor tries the row again until its budget is spent.
    let rewinds = sub.capabilities().rewind;
    let builder = b
        .builder_on(sub, "w1")
        .max_attempts(3)
        .backoff(Backoff::new(0.2, 0.4).expect("backoff"));
    let w1 = b.run(if rewinds {
        builder.on_failure(OnFailure::Rewind)
    } else {
        builder.on_failure(OnFailure::Record).process_stored(true)
    });
    if rewinds {
        b.wait_for("bad terminal", Duration::from_secs(20), |b| {
            b.rec.results().iter().any(|r| r.terminal)
        })
        .await;
    } else {
        // The rows' clock stands still: it is moved on until the retries came due.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while b.handler.runs_of("bad") < 3 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "bad ran {} times",
                b.handler.runs_of("bad")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
            b.h.advance(Duration::from_millis(500)).await;
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while b
            .h
            .inbox
            .get_by_message_id("bad", &g())
            .await
            .unwrap()
            .map(|r| r.status)
            != Some(Status::Failed)
        {
            assert!(tokio::time::Instant::now() < deadline, "bad is not failed");
            tokio::time::sleep(Duration::from_millis(20)).await;
            b.h.advance(Duration::from_millis(500)).await;
        }
    }
    b.wait_for("other keys completed", Duration::from_secs(10), |b| {
        b.completed()
            .iter()
            .filter(|m| m.starts_with("other"))
            .count()
            == 3
    })
    .await;
    b.publish("next", "k1", 1).await;
    b.wait_for("next landed", Duration::from_secs(10), |b| {
        b.rec
            .results()
            .iter()
            .any(|r| r.message_id.as_deref() == Some("next"))
    })
    .await;
    w1.stop().await;
    let bad =
        b.h.inbox
            .get_by_message_id("bad", &g())
            .await
            .unwrap()
            .unwrap();
    assert_eq!((bad.status, bad.attempts_made), (Status::Failed, 3));
    assert_eq!(b.handler.runs_of("bad"), 3, "three deliveries, three runs");
    let next =
        b.h.inbox
            .get_by_message_id("next", &g())
            .await
            .unwrap()
            .unwrap();
    assert_eq!(
        next.status,
        Status::Completed,
        "a failed row is out of line"
    );
    assert_eq!(b.handler.runs_of("next"), 1);
    let blocked =
        b.h.inbox
            .blocked_keys(&g(), Duration::from_secs(300), 10)
            .await
            .unwrap();
    assert!(blocked.is_empty(), "{blocked:?}");
    let mut effects = b.h.effects().await;
    effects.sort();
    assert_eq!(effects, vec!["next", "other0", "other1", "other2"]);
    b.trial.cleanup().await;
}

/// An invalid message on a broker is dead-lettered and ended; the next message goes on
/// (R139, R140).
pub async fn invalid_is_dead_lettered<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    b.trial
        .publish(&[("event_id", "bad"), ("topic", "src")], "not json")
        .await;
    b.publish("good", "k", 0).await;
    let w1 = b.run(b.builder("w1", Duration::from_secs(30)).await);
    b.wait_for("good completed", Duration::from_secs(10), |b| {
        b.completed() == vec!["good".to_string()]
    })
    .await;
    w1.stop().await;
    let inv: Vec<_> = b
        .rec
        .results()
        .into_iter()
        .filter(|r| r.outcome == O::Invalid)
        .collect();
    assert_eq!(inv.len(), 1, "{inv:?}");
    assert_eq!(
        inv[0].error.as_deref(),
        Some("invalid message: body is not JSON")
    );
    assert!(
        b.h.inbox
            .get_by_message_id("bad", &g())
            .await
            .unwrap()
            .is_none()
    );
    b.trial.cleanup().await;
}

/// What a [`Spy`] saw: each delivery (position, delivery number, when) and each touch of a
/// delivery through its ack handle (operation, when).
#[derive(Default)]
struct Seen {
    deliveries: std::sync::Mutex<Vec<(String, u32, tokio::time::Instant)>>,
    acks: std::sync::Mutex<Vec<(&'static str, tokio::time::Instant)>>,
    /// How many of the next commits are lost: not sent to the broker, reported as a
    /// transient failure (G-04's `fail_commit`).
    lose_commits: std::sync::atomic::AtomicUsize,
}

/// A subscription that records what it hands out and how its deliveries are ended.
struct Spy {
    inner: Arc<dyn Subscription>,
    seen: Arc<Seen>,
}

struct SpyAck {
    inner: Arc<dyn txoutbox_core::inbox::AckHandle>,
    seen: Arc<Seen>,
}

impl SpyAck {
    fn note(&self, op: &'static str) {
        self.seen
            .acks
            .lock()
            .expect("poisoned")
            .push((op, tokio::time::Instant::now()));
    }
}

#[async_trait]
impl txoutbox_core::inbox::AckHandle for SpyAck {
    async fn commit(&self) -> Result<(), txoutbox_core::inbox::SubscriptionError> {
        use std::sync::atomic::Ordering::SeqCst;
        let lose = self
            .seen
            .lose_commits
            .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            self.note("lost commit");
            return Err(txoutbox_core::inbox::SubscriptionError::transient(
                "the acknowledgement was lost (the trial's fail_commit)",
            ));
        }
        let r = self.inner.commit().await;
        self.note("commit");
        r
    }
    async fn rewind(&self, delay: Duration) -> Result<(), txoutbox_core::inbox::SubscriptionError> {
        let r = self.inner.rewind(delay).await;
        self.note("rewind");
        r
    }
    async fn term(&self, reason: &str) -> Result<(), txoutbox_core::inbox::SubscriptionError> {
        let r = self.inner.term(reason).await;
        self.note("term");
        r
    }
    async fn renew(&self) -> Result<(), txoutbox_core::inbox::SubscriptionError> {
        let r = self.inner.renew().await;
        self.note("renew");
        r
    }
    async fn dead_letter(
        &self,
        reason: &str,
        group: &str,
    ) -> Result<(), txoutbox_core::inbox::SubscriptionError> {
        self.inner.dead_letter(reason, group).await
    }
    fn rewind_has_room(&self) -> bool {
        self.inner.rewind_has_room()
    }
}

#[async_trait]
impl Subscription for Spy {
    fn capabilities(&self) -> txoutbox_core::inbox::subscription::SubscriptionCapabilities {
        self.inner.capabilities()
    }
    fn configure(&self, settings: &txoutbox_core::inbox::RunnerSettings) -> Result<(), String> {
        self.inner.configure(settings)
    }
    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<txoutbox_core::inbox::InboxDelivery>, txoutbox_core::inbox::SubscriptionError>
    {
        let mut v = self.inner.next(max, wait).await?;
        let now = tokio::time::Instant::now();
        for d in &mut v {
            self.seen.deliveries.lock().expect("poisoned").push((
                d.message.position(),
                d.delivery_number,
                now,
            ));
            d.ack = Arc::new(SpyAck {
                inner: d.ack.clone(),
                seen: self.seen.clone(),
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

impl Bed {
    /// A builder whose subscription is watched by the returned [`Seen`].
    async fn spied(
        &self,
        worker: &str,
        redeliver_after: Duration,
    ) -> (RunnerBuilder<InMemoryInbox>, Arc<Seen>) {
        let seen = Arc::new(Seen::default());
        let sub: Arc<dyn Subscription> = Arc::new(Spy {
            inner: self.trial.subscription(worker, redeliver_after).await,
            seen: seen.clone(),
        });
        let b = Runner::builder(self.h.backend(), sub, "g")
            .worker_id(worker)
            .handler(self.handler.clone())
            .process_stored(false)
            .sources(["src"])
            .messages_per_transaction(1)
            .concurrency(2)
            .hooks(self.rec.clone())
            .random_source(Box::new(SeededRng::new(7)));
        (b, seen)
    }
}

/// J-02 (NATS) and J-09 (Redis): with on_failure rewind a failed run rewinds its delivery
/// (nak with a delay on NATS; on Redis the entry stays pending and is claimed again); it comes
/// back no sooner than 0.5 s after the rewind and within 2 s (backoff base 1 s, cap 8 s), with
/// delivery number 2, and then completes (R127, R134, R136).
pub async fn rewind_is_redelivered_later<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    b.handler
        .script("m1", vec![Act::Fail("x".into()), Act::Write]);
    b.publish("m1", "k", 0).await;
    let (builder, seen) = b.spied("w1", Duration::from_secs(30)).await;
    let w1 = b.run(
        builder
            .on_failure(OnFailure::Rewind)
            .backoff(Backoff::new(1.0, 8.0).expect("backoff")),
    );
    b.wait_for("m1 completed", Duration::from_secs(10), |b| {
        b.completed() == vec!["m1".to_string()]
    })
    .await;
    w1.stop().await;
    let deliveries = seen.deliveries.lock().expect("poisoned").clone();
    let acks = seen.acks.lock().expect("poisoned").clone();
    assert_eq!(deliveries.len(), 2, "{deliveries:?}");
    assert_eq!(
        deliveries[0].0, deliveries[1].0,
        "the same message came back"
    );
    assert_eq!((deliveries[0].1, deliveries[1].1), (1, 2));
    let rewound = acks
        .iter()
        .find(|(op, _)| *op == "rewind")
        .map(|(_, t)| *t)
        .expect("the first run rewound its delivery");
    let after = deliveries[1].2.duration_since(rewound);
    assert!(
        after >= Duration::from_millis(500) && after <= Duration::from_secs(2),
        "redelivered {after:?} after the rewind"
    );
    assert!(acks.iter().any(|(op, _)| *op == "commit"));
    assert_eq!(b.handler.runs_of("m1"), 2);
    assert_eq!(
        b.h.effects().await,
        vec!["m1"],
        "the failed run's effect was rolled back"
    );
    let row =
        b.h.inbox
            .get_by_message_id("m1", &g())
            .await
            .unwrap()
            .unwrap();
    assert_eq!(row.status, Status::Completed);
    b.trial.cleanup().await;
}

/// J-38, R136's bound on every broker, given once: the runner's concurrency (1 here, and no
/// bound in the subscription's config) is the number of rewinds that may wait in the process.
/// Under `on_failure = rewind` with a handler that always fails, the first of two deliveries
/// (different keys) is rewound; the second is recorded in its row and committed where the
/// subscription holds its rewinds in the process (`held` true: Redis, RabbitMQ, the in-process
/// transport), and rewound where the broker holds them itself (NATS' nak with a delay): there
/// nothing waits in the process, so the bound holds with room to spare (R126, R136).
pub async fn rewinds_bounded_by_the_runner_concurrency<S: SubscriptionUnderTest + ?Sized>(
    s: &S,
    held: bool,
) {
    let b = Bed::new(s).await;
    b.handler.always(Act::Fail("boom".into()));
    b.publish("m1", "k1", 0).await;
    b.publish("m2", "k2", 0).await;
    let sub = b.trial.subscription("w1", Duration::from_secs(30)).await;
    let r = b
        .builder_on(sub.clone(), "w1")
        .concurrency(1)
        .on_failure(OnFailure::Rewind)
        .backoff(Backoff::new(5.0, 8.0).expect("backoff"))
        .build()
        .expect("runner builds");
    let mut results = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while results.len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "two deliveries within 10 s: {results:?}"
        );
        match r.handle_next().await.expect("a read") {
            Some(d) => results.push(d),
            None => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    assert_eq!(results[0].outcome, O::Rewound, "{results:?}");
    if held {
        assert_eq!(
            (results[1].outcome, results[1].committed),
            (O::Recorded, true),
            "one rewind waits, the runner's concurrency: the second failure is recorded: {results:?}"
        );
        let recorded =
            b.h.inbox
                .get_by_message_id(results[1].message_id.as_deref().expect("an id"), &g())
                .await
                .unwrap();
        assert!(recorded.is_some(), "the failure is recorded in its row");
    } else {
        assert_eq!(
            results[1].outcome,
            O::Rewound,
            "the broker holds its rewinds: {results:?}"
        );
    }
    sub.close().await;
    b.trial.cleanup().await;
}

/// J-04 (NATS) and J-10 (Redis): runner w1 starts a message and is killed; w2 gets it again
/// with delivery number 2 no sooner than `redeliver` after w1 last touched it (its delivery or
/// its last renewal; 0.2 s allowed for the round trip) and within `within` of the kill, and
/// completes it; one effect (R119, R134, R136).
pub async fn killed_runner_message_comes_back<S: SubscriptionUnderTest + ?Sized>(
    s: &S,
    redeliver: Duration,
    within: Duration,
) {
    let b = Bed::new(s).await;
    let gate = Gate::new();
    b.handler
        .script("m1", vec![Act::Gate(gate.clone()), Act::Write]);
    b.publish("m1", "k", 0).await;
    let (builder, seen1) = b.spied("w1", redeliver).await;
    let w1 = b.run(builder);
    tokio::time::timeout(Duration::from_secs(10), gate.reached(1))
        .await
        .expect("w1 starts m1");
    // Let w1 renew at least once before it dies.
    tokio::time::sleep(redeliver).await;
    w1.kill();
    let killed_at = tokio::time::Instant::now();
    let (builder, seen2) = b.spied("w2", redeliver).await;
    let w2 = b.run(builder);
    b.wait_for("m1 completed by w2", within + Duration::from_secs(5), |b| {
        b.completed() == vec!["m1".to_string()]
    })
    .await;
    w2.stop().await;
    let last_touch = {
        let d = seen1.deliveries.lock().expect("poisoned");
        let a = seen1.acks.lock().expect("poisoned");
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(a.iter().any(|(op, _)| *op == "renew"), "w1 renewed: {a:?}");
        a.iter()
            .filter(|(op, _)| *op == "renew")
            .map(|(_, t)| *t)
            .chain(std::iter::once(d[0].2))
            .max()
            .expect("a touch")
    };
    let d2 = seen2.deliveries.lock().expect("poisoned").clone();
    assert_eq!(d2.len(), 1, "{d2:?}");
    assert_eq!(d2[0].1, 2, "delivery number on w2");
    let gap = d2[0].2.duration_since(last_touch);
    assert!(
        gap + Duration::from_millis(200) >= redeliver,
        "w2 got it {gap:?} after w1's last renewal"
    );
    let since_kill = d2[0].2.duration_since(killed_at);
    assert!(
        since_kill <= within,
        "w2 got it {since_kill:?} after the kill"
    );
    assert_eq!(b.handler.runs_of("m1"), 2);
    assert_eq!(b.h.effects().await, vec!["m1"]);
    b.trial.cleanup().await;
}

/// J-05 (NATS, ack_wait 1 s) and J-11 (Redis, claim_idle 1 s): a run of 3 s keeps its delivery
/// by renewals while a second runner of the group runs: one delivery in all (no redelivery),
/// one run, completed (R134, R136).
pub async fn renewal_keeps_slow_run<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    b.handler
        .script("m1", vec![Act::Delay(Duration::from_secs(3))]);
    b.publish("m1", "k", 0).await;
    let redeliver = Duration::from_secs(1);
    let (builder, seen1) = b.spied("w1", redeliver).await;
    let w1 = b.run(builder);
    b.wait_for("w1 holds m1", Duration::from_secs(10), |_| {
        !seen1.deliveries.lock().expect("poisoned").is_empty()
    })
    .await;
    let (builder, seen2) = b.spied("w2", redeliver).await;
    let w2 = b.run(builder);
    b.wait_for("m1 completed", Duration::from_secs(10), |b| {
        b.completed() == vec!["m1".to_string()]
    })
    .await;
    // Past one more redelivery time: nothing comes back.
    tokio::time::sleep(redeliver * 2).await;
    w1.stop().await;
    w2.stop().await;
    let d1 = seen1.deliveries.lock().expect("poisoned").clone();
    let d2 = seen2.deliveries.lock().expect("poisoned").clone();
    assert_eq!(d1.len(), 1, "w1: {d1:?}");
    assert_eq!(d1[0].1, 1);
    assert!(d2.is_empty(), "w2 never got it: {d2:?}");
    assert_eq!(b.handler.runs_of("m1"), 1);
    assert_eq!(b.h.effects().await, vec!["m1"]);
    b.trial.cleanup().await;
}

/// Generates one `#[tokio::test]` per broker inbox trial; EXPR implements
/// [`SubscriptionUnderTest`].
#[macro_export]
macro_rules! inbox_broker_suite {
    ($f:expr) => {
        $crate::inbox_broker_suite!(@tests $f; g_01, g_02, g_03, g_04, g_05, g_06, g_08,
            g_09, poison_blocks_only_its_key, invalid_is_dead_lettered);
    };
    (@tests $f:expr; $($name:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                $crate::inbox::broker_subs::$name(&$f).await;
            }
        )*
    };
}
