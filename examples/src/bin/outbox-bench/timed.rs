//! Decorators for the profile and the order check: [`Timed`] (a repository that times its
//! fetch and outcome write), [`TimedBroker`] (sums publish time) and [`OrderCheck`] (a broker
//! that checks every key's publishes arrive in write order).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::event::{OutboxEvent, WorkerId};
use txoutbox_core::repository::{
    BlockedKey, Capabilities, FetchRequest, Fetched, Outcome, StatusCount, WrittenOutcome,
};
use txoutbox_core::{Ack, Broker, BrokerError, Message, OutboxRepository, RepositoryError};
use uuid::Uuid;

/// Nanosecond sums of the phases, shared by every decorator of one run.
#[derive(Debug, Default)]
pub struct Phases {
    pub fetch_ns: AtomicU64,
    pub fetches: AtomicU64,
    pub write_ns: AtomicU64,
    pub writes: AtomicU64,
    pub publish_ns: AtomicU64,
    pub publishes: AtomicU64,
    pub cycle_ns: AtomicU64,
}

fn add(a: &AtomicU64, d: Duration) {
    a.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
}

impl Phases {
    pub fn add_cycle(&self, d: Duration) {
        add(&self.cycle_ns, d);
    }

    /// The breakdown as JSON: milliseconds per cycle of each phase (publish = the time between
    /// the fetch's return and the outcome write's start: the relay's own work plus the broker).
    pub fn json(&self, cycles: usize) -> serde_json::Value {
        let ms = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 / 1e6;
        let per = |v: f64| {
            if cycles == 0 {
                0.0
            } else {
                (v / cycles as f64 * 1000.0).round() / 1000.0
            }
        };
        let (f, w, c, p) = (
            ms(&self.fetch_ns),
            ms(&self.write_ns),
            ms(&self.cycle_ns),
            ms(&self.publish_ns),
        );
        serde_json::json!({
            "cycle_ms": per(c),
            "fetch_ms": per(f),
            "publish_phase_ms": per(c - f - w),
            "broker_publish_ms_sum": per(p),
            "write_ms": per(w),
            "fetch_calls": self.fetches.load(Ordering::Relaxed),
            "write_calls": self.writes.load(Ordering::Relaxed),
        })
    }
}

/// A repository that times `fetch_and_lock` and `write_outcomes` and delegates everything.
pub struct Timed {
    inner: Arc<dyn OutboxRepository>,
    phases: Arc<Phases>,
}

impl Timed {
    pub fn new(inner: Arc<dyn OutboxRepository>, phases: Arc<Phases>) -> Self {
        Self { inner, phases }
    }
}

#[async_trait]
impl OutboxRepository for Timed {
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        self.inner.now().await
    }
    async fn get(&self, id: Uuid) -> Result<Option<OutboxEvent>, RepositoryError> {
        self.inner.get(id).await
    }
    async fn fetch_and_lock(&self, req: &FetchRequest) -> Result<Vec<Fetched>, RepositoryError> {
        let t = Instant::now();
        let r = self.inner.fetch_and_lock(req).await;
        add(&self.phases.fetch_ns, t.elapsed());
        self.phases.fetches.fetch_add(1, Ordering::Relaxed);
        r
    }
    async fn begin_delivery(
        &self,
        req: &FetchRequest,
        bound: txoutbox_core::DeliveryBound,
    ) -> Result<(Vec<Fetched>, Box<dyn txoutbox_core::Delivery>), RepositoryError> {
        // The delivery's commit (its outcome write) is not timed separately.
        let t = Instant::now();
        let r = self.inner.begin_delivery(req, bound).await;
        add(&self.phases.fetch_ns, t.elapsed());
        self.phases.fetches.fetch_add(1, Ordering::Relaxed);
        r
    }
    async fn write_outcomes(
        &self,
        worker: &WorkerId,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        let t = Instant::now();
        let r = self.inner.write_outcomes(worker, outcomes).await;
        add(&self.phases.write_ns, t.elapsed());
        self.phases.writes.fetch_add(1, Ordering::Relaxed);
        r
    }
    async fn refresh_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        self.inner.refresh_lock(id, worker).await
    }
    async fn release_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        self.inner.release_lock(id, worker).await
    }
    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError> {
        self.inner.release_locks(ids, worker).await
    }
    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError> {
        self.inner.release_stale_locks(timeout).await
    }
    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError> {
        self.inner.requeue_failed(id).await
    }
    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError> {
        self.inner
            .delete_old_completed(retention_days, batch_size)
            .await
    }
    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError> {
        self.inner.force_unlock(id, reason).await
    }
    async fn blocked_keys(
        &self,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<BlockedKey>, RepositoryError> {
        self.inner.blocked_keys(lease_ttl, limit).await
    }
    async fn counts(&self) -> Result<Vec<StatusCount>, RepositoryError> {
        self.inner.counts().await
    }
    async fn oldest_due_age(&self) -> Result<Option<Duration>, RepositoryError> {
        self.inner.oldest_due_age().await
    }
    async fn parked_rows(&self) -> Result<u64, RepositoryError> {
        self.inner.parked_rows().await
    }
}

/// A broker that sums the time of its inner broker's publishes.
pub struct TimedBroker {
    pub inner: Arc<dyn Broker>,
    pub phases: Arc<Phases>,
}

#[async_trait]
impl Broker for TimedBroker {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let t = Instant::now();
        let r = self.inner.publish(m).await;
        add(&self.phases.publish_ns, t.elapsed());
        self.phases.publishes.fetch_add(1, Ordering::Relaxed);
        r
    }
}

/// A broker that checks, per partition key, that the payload's `seq` (the preload's generator
/// index, which grows with created_at) only grows, then hands the message on.
pub struct OrderCheck {
    pub inner: Arc<dyn Broker>,
    last: Mutex<HashMap<String, i64>>,
    pub violations: AtomicU64,
    pub checked: AtomicU64,
}

impl OrderCheck {
    pub fn new(inner: Arc<dyn Broker>) -> Self {
        Self {
            inner,
            last: Mutex::new(HashMap::new()),
            violations: AtomicU64::new(0),
            checked: AtomicU64::new(0),
        }
    }
}

#[async_trait]
impl Broker for OrderCheck {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let seq = m.payload()["seq"].as_i64().unwrap_or(-1);
        {
            let mut last = self.last.lock().expect("order map poisoned");
            let prev = last.insert(m.partition_key.clone(), seq);
            if prev.is_some_and(|p| p >= seq) {
                self.violations.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.checked.fetch_add(1, Ordering::Relaxed);
        self.inner.publish(m).await
    }
}
