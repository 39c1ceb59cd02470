//! Relay metrics through the [`metrics`] facade (cargo feature `metrics`): a [`MetricsStep`]
//! observer for the relay and the backlog gauges ([`Backlog`]).
//!
//! Install any `metrics` recorder (for example `metrics-exporter-prometheus`; the
//! `outbox-relay` binary's `--metrics-addr` does); without one the calls do nothing. Every name
//! takes the optional prefix (R70: `^[a-zA-Z_][a-zA-Z0-9_]*$`, joined with `_`).
//!
//! Series named by Prometheus conventions:
//!
//! | name | kind | labels | recorded |
//! |---|---|---|---|
//! | `outbox_publish_outcomes_total` | counter | `outcome` | after the outcome commit, once per fetched row: `published` (acknowledged, completed), `retry` (counted failure, tried again later), `failed` (counted failure that spent the last attempt), `transient` (no attempt spent), `deferred` (broker found unreachable, schedule kept), `released` (not processed this cycle), `lease_lost` (taken over; nothing written) |
//! | `outbox_publish_duration_seconds` | histogram | | per acknowledged publish: the call to the broker until its acknowledgement |
//! | `outbox_write_to_ack_seconds` | histogram | | per acknowledged publish: from the row's `created_at` to the moment the relay observes the committed outcome (the acknowledgement plus the outcome commit) |
//! | `outbox_pending_events` | gauge | | by [`MetricsStep::record_backlog`]: pending rows |
//! | `outbox_blocked_keys` | gauge | | by [`MetricsStep::record_backlog`]: keys whose head waits for a retry or is held (R80) |
//! | `outbox_parked_keys` | gauge | | by [`MetricsStep::record_backlog`]: of the blocked keys, those whose head is parked (R193) |
//! | `outbox_parked_rows` | gauge | | by [`MetricsStep::record_backlog`]: parked rows, keyless rows included (R193) |
//! | `outbox_oldest_due_age_seconds` | gauge | | by [`MetricsStep::record_backlog`]: age of the oldest due row (0 when none) |
//!
//! The contract's series (R70, the ancestor's names, kept for existing dashboards):
//! `outbox_locked_batch_size` (gauge, after every fetch),
//! `outbox_events_published_total{event_type,status}` (`status` = `success`, `retry`, `failed`,
//! `transient`, `deferred`, `released`, `lease_lost`: like the ancestor's, it counts every
//! outcome, failures included; prefer `outbox_publish_outcomes_total`) and
//! `outbox_handler_duration_seconds{event_type}`.
//!
//! [`MetricsStep::update_backlog`] also logs, at warn, each key parked longer than
//! [`MetricsStep::park_alert_after`] (default [`DEFAULT_PARK_ALERT_AFTER`], 15 min; R193), once
//! per key per `MetricsStep` (a process runs one), by the step's clock.
//!
//! Histograms have no buckets of their own in the facade: set them in the exporter (the
//! binary's are in `examples/README.md`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use crate::clock::{Clock, SystemClock};
use crate::error::{ConfigError, RepositoryError};
use crate::event::Status;
use crate::relay::RowOutcome;
use crate::repository::{BlockedKey, OutboxRepository};

/// How long a key stays parked before it is logged at warn (R193).
pub const DEFAULT_PARK_ALERT_AFTER: Duration = Duration::from_secs(15 * 60);
use crate::step::{ObservedOutcome, PipelineStep};

/// The `outcome` label of `outbox_publish_outcomes_total`.
pub fn outcome_label(o: &RowOutcome) -> &'static str {
    match o {
        RowOutcome::Completed { .. } => "published",
        RowOutcome::Counted { terminal: true, .. } => "failed",
        RowOutcome::Counted { .. } => "retry",
        RowOutcome::Transient { .. } => "transient",
        RowOutcome::Deferred { .. } => "deferred",
        RowOutcome::Released => "released",
        RowOutcome::LeaseLost => "lease_lost",
    }
}

/// The `status` label of the contract's `outbox_events_published_total` (R70).
pub fn status_label(o: &RowOutcome) -> &'static str {
    match o {
        RowOutcome::Completed { .. } => "success",
        other => outcome_label(other),
    }
}

/// The backlog figures the gauges show, from the repository's operator queries (R80).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    /// Pending rows.
    pub pending: u64,
    /// Keys whose head waits for a retry or is held under a live lease (up to the query's
    /// limit).
    pub blocked_keys: u64,
    /// Of those, keys whose head is parked (R193; `outbox_parked_keys`).
    pub parked_keys: u64,
    /// Parked rows, keyless rows included (R193; `outbox_parked_rows`).
    pub parked_rows: u64,
    /// Age of the oldest due row.
    pub oldest_due: Option<Duration>,
}

impl Backlog {
    /// Runs the four queries (`lease_ttl`: the relays' lease; blocked keys counted up to
    /// `blocked_limit`).
    pub async fn query(
        repo: &dyn OutboxRepository,
        lease_ttl: Duration,
        blocked_limit: usize,
    ) -> Result<Self, RepositoryError> {
        Ok(Self::query_keys(repo, lease_ttl, blocked_limit).await?.0)
    }

    /// [`query`](Self::query), with the blocked keys it read.
    async fn query_keys(
        repo: &dyn OutboxRepository,
        lease_ttl: Duration,
        blocked_limit: usize,
    ) -> Result<(Self, Vec<BlockedKey>), RepositoryError> {
        let counts = repo.counts().await?;
        let blocked = repo.blocked_keys(lease_ttl, blocked_limit).await?;
        let oldest_due = repo.oldest_due_age().await?;
        let parked_rows = repo.parked_rows().await?;
        let pending: i64 = counts
            .iter()
            .filter(|c| c.status == Status::Pending)
            .map(|c| c.count)
            .sum();
        let b = Self {
            pending: pending.max(0) as u64,
            blocked_keys: blocked.len() as u64,
            parked_keys: blocked.iter().filter(|b| b.parked).count() as u64,
            parked_rows,
            oldest_due,
        };
        Ok((b, blocked))
    }
}

/// The metrics observer. Add it to a relay with `RelayBuilder::step(Arc::new(step))`; cloning
/// shares the names and the keys already alerted (R193).
#[derive(Debug, Clone)]
pub struct MetricsStep {
    names: Arc<Names>,
    clock: Arc<dyn Clock>,
    park_alert_after: Duration,
    /// The keys (topic, partition key) already logged as parked too long (R193).
    alerted: Arc<Mutex<HashSet<(String, String)>>>,
}

#[derive(Debug)]
struct Names {
    outcomes: String,
    duration: String,
    write_to_ack: String,
    pending: String,
    blocked: String,
    parked: String,
    parked_rows: String,
    oldest: String,
    batch: String,
    published: String,
    handler: String,
}

impl Default for MetricsStep {
    fn default() -> Self {
        Self::named("")
    }
}

impl MetricsStep {
    /// Metrics without a prefix.
    pub fn new() -> Self {
        Self::default()
    }

    /// Metrics whose names start with `prefix_` (the prefix must match
    /// `^[a-zA-Z_][a-zA-Z0-9_]*$`, R70).
    pub fn with_prefix(prefix: &str) -> Result<Self, ConfigError> {
        let mut chars = prefix.chars();
        let ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(ConfigError::new(format!(
                "invalid metrics prefix {prefix:?}: it must match ^[a-zA-Z_][a-zA-Z0-9_]*$ (R70)"
            )));
        }
        Ok(Self::named(&format!("{prefix}_")))
    }

    /// How long a key may stay parked before [`update_backlog`](Self::update_backlog) logs it
    /// at warn, once per key (R193; default [`DEFAULT_PARK_ALERT_AFTER`]). At least 1 s, else
    /// a [`ConfigError`].
    pub fn park_alert_after(mut self, d: Duration) -> Result<Self, ConfigError> {
        if d < Duration::from_secs(1) {
            return Err(ConfigError::new(format!(
                "park_alert_after {d:?} is too short: it must be at least 1s (R193)"
            )));
        }
        self.park_alert_after = d;
        Ok(self)
    }

    /// Logs at warn each of `blocked` parked for longer than
    /// [`park_alert_after`](Self::park_alert_after) by this step's clock, unless this step
    /// logged its key before; returns the keys (topic, partition key) logged now (R193).
    pub fn alert_parked(&self, blocked: &[BlockedKey]) -> Vec<(String, String)> {
        let now = self.clock.now();
        let mut alerted = self.alerted.lock().unwrap_or_else(|e| e.into_inner());
        let mut logged = Vec::new();
        for b in blocked.iter().filter(|b| b.parked) {
            let Some(at) = b.parked_at else { continue };
            let parked_for = (now - at).to_std().unwrap_or_default();
            if parked_for <= self.park_alert_after
                || !alerted.insert((b.topic.clone(), b.partition_key.clone()))
            {
                continue;
            }
            tracing::warn!(
                topic = %b.topic,
                partition_key = %b.partition_key,
                head_id = %b.head_id,
                parked_at = %at.to_rfc3339(),
                parked_for = ?parked_for,
                waiting = b.waiting,
                last_error = %b.last_error.as_deref().unwrap_or(""),
                "key parked for longer than park_alert_after: its rows wait behind a parked row; \
                 fix the cause, then `outbox-relay redrive` or `outbox-relay discard` it"
            );
            logged.push((b.topic.clone(), b.partition_key.clone()));
        }
        logged
    }

    /// The wall clock the write-to-ack lag is measured with (default: the system clock).
    pub fn clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    fn named(p: &str) -> Self {
        Self {
            names: Arc::new(Names {
                outcomes: format!("{p}outbox_publish_outcomes_total"),
                duration: format!("{p}outbox_publish_duration_seconds"),
                write_to_ack: format!("{p}outbox_write_to_ack_seconds"),
                pending: format!("{p}outbox_pending_events"),
                blocked: format!("{p}outbox_blocked_keys"),
                parked: format!("{p}outbox_parked_keys"),
                parked_rows: format!("{p}outbox_parked_rows"),
                oldest: format!("{p}outbox_oldest_due_age_seconds"),
                batch: format!("{p}outbox_locked_batch_size"),
                published: format!("{p}outbox_events_published_total"),
                handler: format!("{p}outbox_handler_duration_seconds"),
            }),
            clock: Arc::new(SystemClock),
            park_alert_after: DEFAULT_PARK_ALERT_AFTER,
            alerted: Arc::default(),
        }
    }

    /// The name of the outcome counter (with the prefix).
    pub fn outcomes_name(&self) -> &str {
        &self.names.outcomes
    }

    /// Sets the backlog gauges.
    pub fn record_backlog(&self, b: &Backlog) {
        metrics::gauge!(self.names.pending.clone()).set(b.pending as f64);
        metrics::gauge!(self.names.blocked.clone()).set(b.blocked_keys as f64);
        metrics::gauge!(self.names.parked.clone()).set(b.parked_keys as f64);
        metrics::gauge!(self.names.parked_rows.clone()).set(b.parked_rows as f64);
        metrics::gauge!(self.names.oldest.clone())
            .set(b.oldest_due.map_or(0.0, |d| d.as_secs_f64()));
    }

    /// Queries the backlog, sets the gauges and logs the keys parked too long
    /// ([`alert_parked`](Self::alert_parked)); returns the figures (for a summary line).
    pub async fn update_backlog(
        &self,
        repo: &dyn OutboxRepository,
        lease_ttl: Duration,
    ) -> Result<Backlog, RepositoryError> {
        let (b, blocked) = Backlog::query_keys(repo, lease_ttl, 10_000).await?;
        self.record_backlog(&b);
        self.alert_parked(&blocked);
        Ok(b)
    }
}

#[async_trait]
impl PipelineStep for MetricsStep {
    async fn on_fetch(&self, rows: usize) {
        metrics::gauge!(self.names.batch.clone()).set(rows as f64);
    }

    async fn on_outcome(&self, o: &ObservedOutcome<'_>) {
        let n = &self.names;
        metrics::counter!(n.outcomes.clone(), "outcome" => outcome_label(o.outcome)).increment(1);
        let event_type = o.event.event_type.clone();
        metrics::counter!(
            n.published.clone(),
            "event_type" => event_type.clone(),
            "status" => status_label(o.outcome)
        )
        .increment(1);
        if let (RowOutcome::Completed { .. }, Some(d)) = (o.outcome, o.duration) {
            metrics::histogram!(n.duration.clone()).record(d.as_secs_f64());
            metrics::histogram!(n.handler.clone(), "event_type" => event_type)
                .record(d.as_secs_f64());
            let lag = (self.clock.now() - o.event.created_at)
                .to_std()
                .unwrap_or_default();
            metrics::histogram!(n.write_to_ack.clone()).record(lag.as_secs_f64());
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicU64, Ordering};

    use metrics::{
        Counter, CounterFn, Gauge, GaugeFn, Histogram, HistogramFn, Key, KeyName, Metadata,
        Recorder, SharedString, Unit,
    };
    use uuid::Uuid;

    use super::*;
    use crate::memory::InMemoryRepository;
    use crate::scripted::{Action, ScriptedBroker};
    use crate::{CancellationToken, NewEvent, Relay};

    /// Every series as `name{label=value,...}` → counter total, last gauge value, or histogram
    /// observations.
    #[derive(Default)]
    pub(crate) struct Rec(Mutex<BTreeMap<String, Arc<Cell>>>);

    #[derive(Default)]
    pub(crate) struct Cell {
        pub(crate) counter: AtomicU64,
        pub(crate) gauge: Mutex<f64>,
        pub(crate) observations: Mutex<Vec<f64>>,
    }

    impl CounterFn for Cell {
        fn increment(&self, v: u64) {
            self.counter.fetch_add(v, Ordering::SeqCst);
        }
        fn absolute(&self, v: u64) {
            self.counter.store(v, Ordering::SeqCst);
        }
    }
    impl GaugeFn for Cell {
        fn increment(&self, v: f64) {
            *self.gauge.lock().unwrap() += v;
        }
        fn decrement(&self, v: f64) {
            *self.gauge.lock().unwrap() -= v;
        }
        fn set(&self, v: f64) {
            *self.gauge.lock().unwrap() = v;
        }
    }
    impl HistogramFn for Cell {
        fn record(&self, v: f64) {
            self.observations.lock().unwrap().push(v);
        }
    }

    impl Rec {
        fn cell(&self, key: &Key) -> Arc<Cell> {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            let id = format!("{}{{{}}}", key.name(), labels.join(","));
            self.0.lock().unwrap().entry(id).or_default().clone()
        }
        pub(crate) fn get(&self, id: &str) -> Arc<Cell> {
            self.0
                .lock()
                .unwrap()
                .get(id)
                .unwrap_or_else(|| panic!("no series {id}: {:?}", self.ids()))
                .clone()
        }
        fn ids(&self) -> Vec<String> {
            self.0.lock().unwrap().keys().cloned().collect()
        }
    }

    impl Recorder for Rec {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(self.cell(key))
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(self.cell(key))
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::from_arc(self.cell(key))
        }
    }

    fn event(key: &str) -> NewEvent {
        NewEvent::builder()
            .event_type("thing.done")
            .aggregate("thing", Uuid::new_v4())
            .topic("things")
            .partition_key(key)
            .payload_json(serde_json::json!({ "k": key }))
            .max_attempts(1)
            .build()
            .unwrap()
    }

    #[test]
    fn outcomes_are_counted_by_label_and_the_histograms_and_gauges_are_set() {
        let rec = Rec::default();
        metrics::with_local_recorder(&rec, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let repo = InMemoryRepository::default();
                    // a: acknowledged; b: refused on its only attempt (failed); c: transient.
                    let ids: Vec<Uuid> = repo
                        .write_committed(vec![event("a"), event("b"), event("c")])
                        .await
                        .unwrap()
                        .iter()
                        .map(|w| w.event.id)
                        .collect();
                    let broker = ScriptedBroker::new();
                    broker.script(ids[1], [Action::Reject("no".into())]);
                    broker.script(ids[2], [Action::Transient("down".into())]);
                    let step = MetricsStep::with_prefix("svc").unwrap();
                    let relay = Relay::builder(Arc::new(repo.clone()), Arc::new(broker))
                        .publish_concurrency(1)
                        .step(Arc::new(step.clone()))
                        .build()
                        .unwrap();
                    relay.cycle(&CancellationToken::new()).await.unwrap();
                    step.update_backlog(&repo, Duration::from_secs(300))
                        .await
                        .unwrap();
                });
        });
        let total = |id: &str| rec.get(id).counter.load(Ordering::SeqCst);
        assert_eq!(
            total("svc_outbox_publish_outcomes_total{outcome=published}"),
            1
        );
        assert_eq!(
            total("svc_outbox_publish_outcomes_total{outcome=failed}"),
            1
        );
        assert_eq!(
            total("svc_outbox_publish_outcomes_total{outcome=transient}"),
            1
        );
        assert_eq!(
            total("svc_outbox_events_published_total{event_type=thing.done,status=success}"),
            1
        );
        let obs = |id: &str| rec.get(id).observations.lock().unwrap().clone();
        assert_eq!(obs("svc_outbox_publish_duration_seconds{}").len(), 1);
        assert_eq!(obs("svc_outbox_write_to_ack_seconds{}").len(), 1);
        assert!(obs("svc_outbox_write_to_ack_seconds{}")[0] >= 0.0);
        assert_eq!(
            obs("svc_outbox_handler_duration_seconds{event_type=thing.done}").len(),
            1
        );
        let gauge = |id: &str| *rec.get(id).gauge.lock().unwrap();
        assert_eq!(gauge("svc_outbox_locked_batch_size{}"), 3.0);
        // c is pending (transient, retried later) and blocks its key.
        assert_eq!(gauge("svc_outbox_pending_events{}"), 1.0);
        assert_eq!(gauge("svc_outbox_blocked_keys{}"), 1.0);
        // c waits for a retry: blocked, not parked.
        assert_eq!(gauge("svc_outbox_parked_keys{}"), 0.0);
        assert_eq!(gauge("svc_outbox_parked_rows{}"), 0.0);
        assert_eq!(gauge("svc_outbox_oldest_due_age_seconds{}"), 0.0);
        assert!(MetricsStep::with_prefix("1x").is_err());
    }

    /// R193: under `on_exhausted = park`, two rows of two keys refused on their only attempt
    /// are counted by `outbox_parked_keys` and `outbox_parked_rows` (and stay pending).
    #[test]
    fn a_park_sets_the_parked_gauges() {
        let rec = Rec::default();
        metrics::with_local_recorder(&rec, || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let repo = InMemoryRepository::default();
                    let ids: Vec<Uuid> = repo
                        .write_committed(vec![event("a"), event("b")])
                        .await
                        .unwrap()
                        .iter()
                        .map(|w| w.event.id)
                        .collect();
                    let broker = ScriptedBroker::new();
                    broker.script(ids[0], [Action::Reject("no".into())]);
                    broker.script(ids[1], [Action::Reject("no".into())]);
                    let step = MetricsStep::new();
                    let relay = Relay::builder(Arc::new(repo.clone()), Arc::new(broker))
                        .on_exhausted(crate::repository::OnExhausted::Park)
                        .step(Arc::new(step.clone()))
                        .build()
                        .unwrap();
                    relay.cycle(&CancellationToken::new()).await.unwrap();
                    let b = step
                        .update_backlog(&repo, Duration::from_secs(300))
                        .await
                        .unwrap();
                    assert_eq!((b.parked_keys, b.parked_rows), (2, 2), "{b:?}");
                });
        });
        let gauge = |id: &str| *rec.get(id).gauge.lock().unwrap();
        assert_eq!(gauge("outbox_parked_keys{}"), 2.0);
        assert_eq!(gauge("outbox_parked_rows{}"), 2.0);
        assert_eq!(gauge("outbox_pending_events{}"), 2.0);
    }

    /// R193: a key parked longer than park_alert_after is logged once per key, by the step's
    /// clock; park_alert_after below 1 s is refused.
    #[tokio::test]
    async fn a_key_parked_too_long_is_alerted_once() {
        let clock = Arc::new(crate::clock::ManualClock::starting_now());
        let repo = InMemoryRepository::new(clock.clone());
        let id = repo.write_committed(vec![event("a")]).await.unwrap()[0]
            .event
            .id;
        let broker = ScriptedBroker::new();
        broker.script(id, [Action::Reject("no".into())]);
        let relay = Relay::builder(Arc::new(repo.clone()), Arc::new(broker))
            .on_exhausted(crate::repository::OnExhausted::Park)
            .build()
            .unwrap();
        relay.cycle(&CancellationToken::new()).await.unwrap();
        assert!(
            MetricsStep::new()
                .park_alert_after(Duration::from_millis(999))
                .is_err()
        );
        let step = MetricsStep::new()
            .clock(clock.clone())
            .park_alert_after(Duration::from_secs(60))
            .unwrap();
        let blocked = || async {
            repo.blocked_keys(Duration::from_secs(300), 10)
                .await
                .unwrap()
        };
        clock.advance(Duration::from_secs(59));
        assert!(step.alert_parked(&blocked().await).is_empty(), "not yet");
        clock.advance(Duration::from_secs(2));
        assert_eq!(
            step.alert_parked(&blocked().await),
            vec![("things".to_owned(), "a".to_owned())]
        );
        clock.advance(Duration::from_secs(3600));
        assert!(
            step.alert_parked(&blocked().await).is_empty(),
            "once per key"
        );
        let b = step
            .update_backlog(&repo, Duration::from_secs(300))
            .await
            .unwrap();
        assert_eq!(b.parked_keys, 1);
    }
}
