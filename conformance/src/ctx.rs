//! The scenario toolkit: a trial's harness, scripted broker, relay clock and helpers that turn
//! the suite's conventions into code.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;
use txoutbox_core::CancellationToken;
use txoutbox_core::backoff::{Backoff, SeededRng};
use txoutbox_core::clock::ManualRelayClock;
use txoutbox_core::event::{EventBuilder, NewEvent, OutboxEvent, Status, WorkerId};
use txoutbox_core::relay::{BreakerConfig, CycleReport, Relay};
use txoutbox_core::repository::{
    FetchFilter, FetchRequest, Fetched, OutboxRepository, WriteResult,
};
use txoutbox_core::scripted::ScriptedBroker;
use txoutbox_core::step::PipelineStep;
use uuid::Uuid;

use crate::harness::{Factory, Harness, RowPatch, WriteTx};

/// Relay settings of a cycle; defaults are the suite's conventions.
#[derive(Clone)]
pub struct Cfg {
    /// Worker id.
    pub worker: String,
    /// Batch size (100).
    pub batch: usize,
    /// Lease TTL (300 s).
    pub lease: Duration,
    /// Backoff base (10 s).
    pub base: f64,
    /// Backoff cap (3600 s).
    pub cap: f64,
    /// max_per_key (1).
    pub max_per_key: usize,
    /// publish_concurrency (1).
    pub concurrency: usize,
    /// Publish timeout (30 s).
    pub timeout: Duration,
    /// Filters.
    pub filter: FetchFilter,
    /// Circuit breaker.
    pub breaker: Option<BreakerConfig>,
    /// Pipeline steps.
    pub steps: Vec<Arc<dyn PipelineStep>>,
    /// Use the peer backend's repository.
    pub peer: bool,
    /// The delivery mode; `None` takes the harness's ([`Harness::delivery`]).
    pub delivery: Option<txoutbox_core::DeliveryMode>,
    /// on_exhausted (release, R191).
    pub exhausted: txoutbox_core::repository::OnExhausted,
}

impl Default for Cfg {
    fn default() -> Self {
        Self {
            worker: "w1".into(),
            batch: 100,
            lease: Duration::from_secs(300),
            base: 10.0,
            cap: 3600.0,
            max_per_key: 1,
            concurrency: 1,
            timeout: Duration::from_secs(30),
            filter: FetchFilter::default(),
            breaker: None,
            steps: Vec::new(),
            delivery: None,
            peer: false,
            exhausted: txoutbox_core::repository::OnExhausted::Release,
        }
    }
}

impl Cfg {
    /// Another worker.
    pub fn worker(mut self, w: &str) -> Self {
        self.worker = w.into();
        self
    }
    /// Batch size.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n;
        self
    }
    /// max_per_key.
    pub fn per_key(mut self, n: usize) -> Self {
        self.max_per_key = n;
        self
    }
    /// publish_concurrency.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }
    /// Backoff base.
    pub fn base(mut self, b: f64) -> Self {
        self.base = b;
        self
    }
    /// Publish timeout.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }
    /// Filter.
    pub fn filter(mut self, f: FetchFilter) -> Self {
        self.filter = f;
        self
    }
    /// Adds a step.
    pub fn step(mut self, s: Arc<dyn PipelineStep>) -> Self {
        self.steps.push(s);
        self
    }
}

/// One trial: a fresh store, a scripted broker, a relay clock.
pub struct Ctx {
    /// The store under test.
    pub h: Arc<dyn Harness>,
    /// The scripted broker every relay of this trial publishes to.
    pub broker: ScriptedBroker,
    /// The relays' monotonic clock.
    pub relay_clock: ManualRelayClock,
    /// The shutdown signal cycles read.
    pub shutdown: CancellationToken,
    seq: std::sync::atomic::AtomicUsize,
    advanced: std::sync::Mutex<Duration>,
}

/// The sends and the report of one cycle.
#[derive(Debug)]
pub struct Cycle {
    /// The report.
    pub report: CycleReport,
    /// The messages the broker accepted during the cycle, in order.
    pub sent: Vec<Uuid>,
    /// Database now just before the cycle.
    pub t0: DateTime<Utc>,
    /// Database now just after the cycle.
    pub t1: DateTime<Utc>,
}

impl Ctx {
    /// A fresh trial.
    pub async fn new(f: &dyn Factory) -> Self {
        Self {
            h: f.create().await,
            broker: ScriptedBroker::new(),
            relay_clock: ManualRelayClock::new(),
            shutdown: CancellationToken::new(),
            seq: Default::default(),
            advanced: Default::default(),
        }
    }

    /// Whether the backend's "now" is an injected clock ([`Capabilities::database_clock`]
    /// false, R72): it stands still unless the trial advances it, so waits measured on it are
    /// exact, and [`advance`](Self::advance) moves that clock instead of shifting the rows back.
    /// A database clock runs on during a cycle.
    ///
    /// [`Capabilities::database_clock`]: txoutbox_core::repository::Capabilities::database_clock
    pub fn clock_stands_still(&self) -> bool {
        !self.repo().capabilities().database_clock
    }

    /// The repository under test.
    pub fn repo(&self) -> Arc<dyn OutboxRepository> {
        self.h.repository()
    }

    /// A base event on topic `t` and this partition key with payload `{"n": i}` (i counts per trial).
    pub fn ev(&self, key: &str) -> EventBuilder {
        let n = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        NewEvent::builder()
            .event_type("test.event")
            .aggregate("agg", Uuid::new_v4())
            .topic("t")
            .partition_key(key)
            .payload_json(json!({ "n": n }))
    }

    /// Builds and writes one event in its own committed transaction; returns its id.
    pub async fn put(&self, b: EventBuilder) -> Uuid {
        self.write(vec![b.build().expect("valid event")]).await[0]
            .event
            .id
    }

    /// Writes base events on these keys, each in its own committed transaction.
    pub async fn puts(&self, keys: &[&str]) -> Vec<Uuid> {
        let mut v = Vec::new();
        for k in keys {
            v.push(self.put(self.ev(k)).await);
        }
        v
    }

    /// Writes events in one committed transaction, one call.
    pub async fn write(&self, events: Vec<NewEvent>) -> Vec<WriteResult> {
        let mut tx = self.h.begin().await;
        let r = tx.write(events).await.expect("write");
        tx.commit().await.expect("commit");
        r
    }

    /// Begins a writer transaction.
    pub async fn begin(&self) -> Box<dyn WriteTx> {
        self.h.begin().await
    }

    /// A stored row.
    pub async fn get(&self, id: Uuid) -> OutboxEvent {
        self.repo()
            .get(id)
            .await
            .expect("get")
            .unwrap_or_else(|| panic!("no row {id}"))
    }

    /// Rows in the table, every status.
    pub async fn total_rows(&self) -> i64 {
        self.repo()
            .counts()
            .await
            .expect("counts")
            .iter()
            .map(|s| s.count)
            .sum()
    }

    /// The backend clock.
    pub async fn now(&self) -> DateTime<Utc> {
        self.repo().now().await.expect("now")
    }

    /// Moves the backend clock and the relay clock forward.
    pub async fn advance(&self, d: Duration) {
        self.h.advance(d).await;
        self.relay_clock.advance(d);
        *self.advanced.lock().expect("poisoned") += d;
    }

    /// The total time advanced so far in this trial.
    pub fn advanced(&self) -> Duration {
        *self.advanced.lock().expect("poisoned")
    }

    /// Trial time: the backend's now plus everything advanced. On a backend whose advance moves
    /// its clock ([`clock_stands_still`](Self::clock_stands_still)) the backend's now already
    /// holds the advances, so the time is returned as it is.
    pub fn shifted(&self, t: DateTime<Utc>) -> DateTime<Utc> {
        if self.clock_stands_still() {
            t
        } else {
            t + chrono::Duration::from_std(self.advanced()).expect("duration")
        }
    }

    /// Moves time to a row's next try.
    pub async fn advance_to(&self, id: Uuid) {
        let r = self.get(id).await;
        let now = self.now().await;
        if r.scheduled_at > now {
            let d = (r.scheduled_at - now).to_std().expect("positive") + Duration::from_millis(1);
            self.advance(d).await;
        }
    }

    /// Changes a row directly.
    pub async fn set(&self, id: Uuid, p: RowPatch) {
        self.h.set(id, p).await;
    }

    /// Builds a relay with these settings.
    pub fn relay(&self, cfg: &Cfg) -> Relay {
        let repo = if cfg.peer {
            self.h.peer_repository()
        } else {
            self.repo()
        };
        self.relay_on(repo, cfg)
    }

    /// Builds a relay with these settings on a given repository (say, a wrapper around the
    /// one under test).
    pub fn relay_on(&self, repo: Arc<dyn OutboxRepository>, cfg: &Cfg) -> Relay {
        let mut b = Relay::builder(repo, Arc::new(self.broker.clone()))
            .worker_id(cfg.worker.clone())
            .batch_size(cfg.batch)
            .lease_ttl(cfg.lease)
            .max_per_key(cfg.max_per_key)
            .publish_concurrency(cfg.concurrency)
            .publish_timeout(cfg.timeout)
            .backoff(Backoff::new(cfg.base, cfg.cap).expect("backoff"))
            .filter(cfg.filter.clone())
            .random_source(Box::new(SeededRng::new(7)))
            .clock(Arc::new(self.relay_clock.clone()))
            .delivery(cfg.delivery.unwrap_or_else(|| self.h.delivery()))
            .on_exhausted(cfg.exhausted);
        if let Some(br) = cfg.breaker {
            b = b.breaker(br);
        }
        for s in &cfg.steps {
            b = b.step(s.clone());
        }
        b.build().expect("relay config")
    }

    /// Runs one cycle of a relay.
    pub async fn run(&self, relay: &Relay) -> Cycle {
        let before = self.broker.accepted().len();
        let t0 = self.now().await;
        let report = relay.cycle(&self.shutdown).await.expect("cycle");
        let t1 = self.now().await;
        let sent = self.broker.accepted_ids()[before..].to_vec();
        Cycle {
            report,
            sent,
            t0,
            t1,
        }
    }

    /// Builds a relay and runs one cycle.
    pub async fn cycle(&self, cfg: &Cfg) -> Cycle {
        let relay = self.relay(cfg);
        self.run(&relay).await
    }

    /// One cycle with the default settings.
    pub async fn cycle1(&self) -> Cycle {
        self.cycle(&Cfg::default()).await
    }

    /// fetch_and_lock with a worker, batch and max_per_key; returns ids.
    pub async fn fetch(&self, worker: &str, batch: usize, per_key: usize) -> Vec<Uuid> {
        let req =
            FetchRequest::new(WorkerId::new(worker).expect("worker"), batch).max_per_key(per_key);
        self.repo()
            .fetch_and_lock(&req)
            .await
            .expect("fetch")
            .iter()
            .map(Fetched::id)
            .collect()
    }

    /// Releases every held row (fixture).
    pub async fn release_all(&self, ids: &[Uuid]) {
        for id in ids {
            self.set(
                *id,
                RowPatch {
                    lock: Some(None),
                    ..RowPatch::default()
                },
            )
            .await;
        }
    }

    /// Asserts `next − now ∈ [a, b]` seconds, using [t0, t1] of the cycle on database clocks.
    pub fn assert_next_try_within(&self, c: &Cycle, next: DateTime<Utc>, a: f64, b: f64) {
        let lo = c.t0 + chrono::Duration::milliseconds((a * 1000.0) as i64);
        let hi = c.t1 + chrono::Duration::milliseconds((b * 1000.0) as i64);
        assert!(
            next >= lo - chrono::Duration::milliseconds(1)
                && next <= hi + chrono::Duration::milliseconds(1),
            "next try {next} not within [{lo}, {hi}] ([{a}, {b}] s after the cycle)"
        );
    }

    /// Asserts next try = now + d within the cycle's [t0, t1].
    pub fn assert_next_try_after(&self, c: &Cycle, next: DateTime<Utc>, d: f64) {
        self.assert_next_try_within(c, next, d, d);
    }

    /// Asserts the row is untouched relative to `before`: same status, attempts, schedule and
    /// last_error, and not held.
    pub async fn assert_untouched(&self, before: &OutboxEvent) {
        let now = self.get(before.id).await;
        assert_eq!(now.status, before.status, "status of {}", before.id);
        assert_eq!(
            now.attempts_made, before.attempts_made,
            "attempts of {}",
            before.id
        );
        assert_eq!(
            now.scheduled_at, before.scheduled_at,
            "scheduled_at of {}",
            before.id
        );
        assert_eq!(
            now.last_error, before.last_error,
            "last_error of {}",
            before.id
        );
        assert!(
            now.locked_at.is_none() && now.locked_by.is_none(),
            "{} still held",
            before.id
        );
    }

    /// Asserts a row's status and attempts.
    pub async fn assert_state(&self, id: Uuid, status: Status, attempts: i32) {
        let r = self.get(id).await;
        assert_eq!(
            (r.status, r.attempts_made),
            (status, attempts),
            "state of {id}"
        );
    }
}
