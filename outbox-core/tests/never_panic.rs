//! Never panic, never pin a row: a panicking step or broker client fails its row as
//! a counted failure and the cycle goes on; the cycle-end hook runs on every path (R68); a
//! failed outcome commit is retried while the lease allows (R54, R55, R57).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::json;
use txoutbox_core::broker::{Ack, Broker, Message};
use txoutbox_core::clock::ManualClock;
use txoutbox_core::error::{BrokerError, RepositoryError, StepError};
use txoutbox_core::event::{NewEvent, OutboxEvent, Status, WorkerId};
use txoutbox_core::relay::{BreakerConfig, CycleReport, Relay};
use txoutbox_core::repository::{
    BlockedKey, Capabilities, FetchRequest, Fetched, OutboxRepository, Outcome, StatusCount,
    WrittenOutcome,
};
use txoutbox_core::scripted::{Action, ScriptedBroker};
use txoutbox_core::{CancellationToken, InMemoryRepository, PipelineStep, StepDecision};
use uuid::Uuid;

fn event(key: &str) -> NewEvent {
    NewEvent::builder()
        .event_type("test.event")
        .aggregate("agg", Uuid::new_v4())
        .topic("t")
        .partition_key(key)
        .payload_json(json!({ "key": key }))
        .build()
        .unwrap()
}

async fn put(repo: &InMemoryRepository, keys: &[&str]) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for k in keys {
        ids.push(
            repo.write_committed(vec![event(k)]).await.unwrap()[0]
                .event
                .id,
        );
    }
    ids
}

fn memory() -> InMemoryRepository {
    InMemoryRepository::new(Arc::new(ManualClock::starting_now()))
}

/// Panics in `before_publish` for the rows of one partition key.
struct PanicsOn(&'static str);

#[async_trait]
impl PipelineStep for PanicsOn {
    async fn before_publish(&self, e: &OutboxEvent) -> Result<StepDecision, StepError> {
        if e.partition_key == self.0 {
            panic!("step exploded on {}", e.partition_key);
        }
        Ok(StepDecision::Continue)
    }
}

#[tokio::test]
async fn a_panic_in_before_publish_is_a_counted_failure_and_the_cycle_goes_on() {
    let repo = memory();
    let ids = put(&repo, &["bad", "good", "bad"]).await;
    let broker = ScriptedBroker::new();
    let relay = Relay::builder(Arc::new(repo.clone()), Arc::new(broker.clone()))
        .worker_id("w1")
        .max_per_key(4)
        .step(Arc::new(PanicsOn("bad")))
        .build()
        .unwrap();
    let report = relay.cycle(&CancellationToken::new()).await.unwrap();
    assert_eq!(report.completed, vec![ids[1]], "{report:?}");
    assert_eq!(report.counted.len(), 1, "{report:?}");
    assert_eq!(report.counted[0].id, ids[0]);
    assert_eq!(
        report.counted[0].error,
        "pipeline step panicked: step exploded on bad"
    );
    // The row behind the failed head is released untouched (R46), and nothing stays held.
    assert_eq!(report.released, vec![ids[2]]);
    assert!(!report.commit_failed);
    let head = repo.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(head.attempts_made, 1);
    assert_eq!(
        head.last_error.as_deref(),
        Some("pipeline step panicked: step exploded on bad")
    );
    assert_eq!(head.status, Status::Pending);
    for r in repo.rows() {
        assert!(r.locked_by.is_none(), "{} still held", r.id);
    }
    assert_eq!(broker.called_ids(), vec![ids[1]]);
}

/// A broker client that panics on the rows of one partition key and acknowledges the rest.
struct PanickingBroker(&'static str);

#[async_trait]
impl Broker for PanickingBroker {
    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        if m.partition_key == self.0 {
            panic!("client bug");
        }
        Ok(Ack::default())
    }
}

#[tokio::test]
async fn a_panicking_broker_client_fails_its_row_counted_and_the_cycle_goes_on() {
    let repo = memory();
    let ids = put(&repo, &["bad", "good"]).await;
    let relay = Relay::builder(Arc::new(repo.clone()), Arc::new(PanickingBroker("bad")))
        .worker_id("w1")
        .publish_concurrency(2)
        .build()
        .unwrap();
    let report = relay.cycle(&CancellationToken::new()).await.unwrap();
    assert_eq!(report.completed, vec![ids[1]], "{report:?}");
    assert_eq!(report.counted.len(), 1);
    assert_eq!(
        report.counted[0].error,
        "broker client panicked: client bug"
    );
    assert!(!report.broker_unreachable);
    for r in repo.rows() {
        assert!(r.locked_by.is_none(), "{} still held", r.id);
    }
}

/// Records every cycle-end report.
#[derive(Default)]
struct CycleEnds(Mutex<Vec<CycleReport>>);

#[async_trait]
impl PipelineStep for CycleEnds {
    async fn on_cycle_end(&self, r: &CycleReport) {
        self.0.lock().unwrap().push(r.clone());
    }
}

#[tokio::test]
async fn the_cycle_end_hook_runs_after_a_shutdown_before_the_fetch() {
    let ends = Arc::new(CycleEnds::default());
    let repo = memory();
    put(&repo, &["k"]).await;
    let relay = Relay::builder(Arc::new(repo), Arc::new(ScriptedBroker::new()))
        .worker_id("w1")
        .step(ends.clone())
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    stop.cancel();
    let report = relay.cycle(&stop).await.unwrap();
    assert!(report.fetched.is_empty());
    assert_eq!(*ends.0.lock().unwrap(), vec![report]);
}

#[tokio::test(start_paused = true)]
async fn the_cycle_end_hook_runs_when_the_breaker_opens_and_while_it_is_open() {
    let ends = Arc::new(CycleEnds::default());
    let repo = memory();
    put(&repo, &["k1", "k2"]).await;
    let broker = ScriptedBroker::new();
    broker.set_default(Action::Transient("down".into()));
    let relay = Relay::builder(Arc::new(repo), Arc::new(broker))
        .worker_id("w1")
        .breaker(BreakerConfig::new(1, 60.0).unwrap())
        .step(ends.clone())
        .build()
        .unwrap();
    let stop = CancellationToken::new();
    let opening = relay.cycle(&stop).await.unwrap();
    assert!(opening.breaker_open && opening.fetched.len() == 2);
    let while_open = relay.cycle(&stop).await.unwrap();
    assert!(while_open.breaker_open && while_open.fetched.is_empty());
    let seen = ends.0.lock().unwrap().clone();
    assert_eq!(seen, vec![opening, while_open]);
}

/// The in-memory backend with injectable fetch and outcome-write failures; everything else
/// delegates.
struct Faulty {
    inner: InMemoryRepository,
    fail_fetch: AtomicBool,
    /// Outcome writes that fail with `Unavailable` before one goes through.
    failing_writes: AtomicUsize,
    write_calls: AtomicUsize,
}

impl Faulty {
    fn new(inner: InMemoryRepository) -> Self {
        Self {
            inner,
            fail_fetch: AtomicBool::new(false),
            failing_writes: AtomicUsize::new(0),
            write_calls: AtomicUsize::new(0),
        }
    }
}

#[async_trait]
impl OutboxRepository for Faulty {
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
        if self.fail_fetch.load(Ordering::SeqCst) {
            return Err(RepositoryError::Unavailable {
                message: "injected fetch failure".into(),
            });
        }
        self.inner.fetch_and_lock(req).await
    }
    async fn write_outcomes(
        &self,
        worker: &WorkerId,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        self.write_calls.fetch_add(1, Ordering::SeqCst);
        let failing = self.failing_writes.load(Ordering::SeqCst);
        if failing > 0 {
            self.failing_writes.store(failing - 1, Ordering::SeqCst);
            return Err(RepositoryError::Unavailable {
                message: "injected: connection reset during the outcome commit".into(),
            });
        }
        self.inner.write_outcomes(worker, outcomes).await
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

#[tokio::test]
async fn the_cycle_end_hook_runs_after_a_failed_fetch() {
    let ends = Arc::new(CycleEnds::default());
    let repo = Arc::new(Faulty::new(memory()));
    repo.fail_fetch.store(true, Ordering::SeqCst);
    let relay = Relay::builder(repo, Arc::new(ScriptedBroker::new()))
        .worker_id("w1")
        .step(ends.clone())
        .build()
        .unwrap();
    assert!(relay.cycle(&CancellationToken::new()).await.is_err());
    assert_eq!(*ends.0.lock().unwrap(), vec![CycleReport::default()]);
}

fn retry_relay(repo: Arc<Faulty>, lease: Duration) -> Relay {
    Relay::builder(repo, Arc::new(ScriptedBroker::new()))
        .worker_id("w1")
        .lease_ttl(lease)
        .publish_timeout(Duration::from_secs(1))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_transiently_failed_outcome_commit_is_retried_and_the_rows_move_at_once() {
    let mem = memory();
    let ids = put(&mem, &["k1", "k2"]).await;
    let repo = Arc::new(Faulty::new(mem.clone()));
    repo.failing_writes.store(3, Ordering::SeqCst);
    let relay = retry_relay(repo.clone(), Duration::from_secs(300));
    let started = tokio::time::Instant::now();
    let report = relay.cycle(&CancellationToken::new()).await.unwrap();
    // Waits of 25, 50 and 100 ms, then the fourth try commits.
    assert_eq!(started.elapsed(), Duration::from_millis(175));
    assert!(!report.commit_failed, "{report:?}");
    assert_eq!(report.commit_retries, 3);
    assert_eq!(repo.write_calls.load(Ordering::SeqCst), 4);
    let mut completed = report.completed.clone();
    completed.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(completed, want);
    for id in ids {
        let r = mem.get(id).await.unwrap().unwrap();
        assert_eq!(r.status, Status::Completed);
        assert!(r.locked_by.is_none());
    }
}

#[tokio::test(start_paused = true)]
async fn outcome_commit_retries_stop_before_the_lease_ends_and_the_rows_wait_for_it() {
    let mem = memory();
    let ids = put(&mem, &["k1"]).await;
    let repo = Arc::new(Faulty::new(mem.clone()));
    repo.failing_writes.store(usize::MAX, Ordering::SeqCst);
    let relay = retry_relay(repo.clone(), Duration::from_secs(2));
    let started = tokio::time::Instant::now();
    let report = relay.cycle(&CancellationToken::new()).await.unwrap();
    assert!(report.commit_failed);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // 25 + 50 + 100 + 200 × 9 = 1975 ms; another 200 ms wait would pass the 2 s lease.
    assert_eq!(report.commit_retries, 12);
    assert_eq!(started.elapsed(), Duration::from_millis(1975));
    let r = mem.get(ids[0]).await.unwrap().unwrap();
    assert_eq!(
        r.locked_by.as_deref(),
        Some("w1"),
        "the row keeps its lease (R57)"
    );
    assert_eq!(r.status, Status::Pending);
}

#[tokio::test(start_paused = true)]
async fn an_outcome_commit_that_fails_for_another_reason_is_not_retried() {
    let mem = memory();
    put(&mem, &["k1"]).await;
    mem.fail_next_outcome_commit();
    let repo = Arc::new(Faulty::new(mem.clone()));
    let relay = retry_relay(repo.clone(), Duration::from_secs(300));
    let report = relay.cycle(&CancellationToken::new()).await.unwrap();
    assert!(report.commit_failed);
    assert_eq!(report.commit_retries, 0);
    assert_eq!(repo.write_calls.load(Ordering::SeqCst), 1);
}
