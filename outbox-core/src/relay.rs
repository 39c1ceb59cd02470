//! The relay cycle (contract sections 6 to 8 and D3 to D6), in one place.
//!
//! One [`Relay::cycle`]:
//!
//! 1. reads the shutdown signal and the circuit breaker; either one stops the cycle before it
//!    fetches (R60, R62);
//! 2. **fetch-and-lock** in its own committed transaction (R76): heads of keys, extended into runs
//!    of up to `max_per_key` rows (R74);
//! 3. **publish** with no database transaction open: the runs of up to `publish_concurrency` keys
//!    at once, each key strictly one row after the other, waiting for each acknowledgement (R45,
//!    R75). Before each publish the relay checks the shutdown signal, the stop flag and the lease
//!    margin (R49), then runs the pipeline steps (R37). A rejection ends its key's run (R46); a
//!    transient failure or publish timeout ends its key's run and stops new publishes in the
//!    cycle, and the first unpublished row of every other key that had no failure is deferred
//!    (R47);
//! 4. **write outcomes** in one short transaction guarded by the worker (R54, R55); rows that
//!    were not processed are released untouched (R77). A transient failure of that transaction
//!    is retried on a fresh one, waiting 25 ms doubling to 200 ms, while the lease lasts; only
//!    then do the rows wait out their lease (R57);
//! 5. after the commit, the observers of the pipeline steps (R68, R83).
//!
//! [`Relay::run`] loops cycles: at once after a cycle that fetched rows and found the broker
//! reachable, else after the poll interval or a wake-up (R61); the loop lives in `relay/run_loop.rs`
//! (waits, outage back-off, which fetch errors end it).

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::{FutureExt, StreamExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::backoff::{Backoff, RandomSource, SeededRng, TRANSIENT_RETRY};
use crate::broker::{Broker, Message};
use crate::clock::{RelayClock, TokioClock};
use crate::error::{BrokerError, ConfigError, RepositoryError, StepError, ValidationError};
use crate::event::{Status, WorkerId, limits};
use crate::ordering::Key;
use crate::repository::{
    DEFAULT_LEASE_TTL, DEFAULT_MAX_PER_KEY, DeliveryBound, DeliveryMode, FetchFilter, FetchRequest,
    Fetched, OutboxRepository, Outcome, OutcomeKind, OutcomeResult, Retry, WrittenOutcome,
};
use crate::step::{ObservedOutcome, PipelineStep, StepDecision};

mod run_loop;

pub use run_loop::{
    DEFAULT_MAX_PERMANENT_FAILURES, DEFAULT_PROBE_INTERVAL, DEFAULT_REPOSITORY_BACKOFF,
    LoopBackoff, LoopControl, LoopHooks, PROBE_TIMEOUT, RECOMMENDED_OUTAGE_BACKOFF, RunOptions,
};

/// Default loop batch size (R61).
pub const DEFAULT_BATCH_SIZE: usize = 50;
/// Default publish concurrency (R75).
pub const DEFAULT_PUBLISH_CONCURRENCY: usize = 16;
/// Largest accepted publish concurrency: far above what any batch can use (one run per key in
/// flight), and far below the limit of the semaphore that enforces it.
pub const MAX_PUBLISH_CONCURRENCY: usize = 65_536;
/// Default publish timeout (R36).
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);
/// Default poll interval (R61).
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_secs(5);
/// First wait before retrying an outcome commit that failed transiently; it doubles up to
/// [`OUTCOME_RETRY_MAX_WAIT`], so the rows move again within that much of the database coming
/// back.
pub const OUTCOME_RETRY_FIRST_WAIT: Duration = Duration::from_millis(25);
/// Longest wait between two tries of an outcome commit.
pub const OUTCOME_RETRY_MAX_WAIT: Duration = Duration::from_millis(200);

/// Circuit breaker settings (R62).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BreakerConfig {
    failure_threshold: u32,
    recovery_timeout: Duration,
}

impl BreakerConfig {
    /// Threshold ≥ 1 (default 5), recovery 0 s to 365 days (default 60 s).
    pub fn new(failure_threshold: i64, recovery_timeout_seconds: f64) -> Result<Self, ConfigError> {
        if failure_threshold < 1 || failure_threshold > u32::MAX as i64 {
            return Err(ConfigError::new(format!(
                "failure_threshold must be >= 1, got {failure_threshold}"
            )));
        }
        if !recovery_timeout_seconds.is_finite() || recovery_timeout_seconds < 0.0 {
            return Err(ConfigError::new(format!(
                "recovery_timeout must be >= 0, got {recovery_timeout_seconds}"
            )));
        }
        if recovery_timeout_seconds > limits::SETTING_MAX_SECS as f64 {
            return Err(ConfigError::new(format!(
                "recovery_timeout must be at most {} s (365 days), got {recovery_timeout_seconds}",
                limits::SETTING_MAX_SECS
            )));
        }
        Ok(Self {
            failure_threshold: failure_threshold as u32,
            recovery_timeout: Duration::from_secs_f64(recovery_timeout_seconds),
        })
    }
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 5,
            recovery_timeout: Duration::from_secs(60),
        }
    }
}

/// A validated relay configuration. Defaults are the contract's (section 12).
#[derive(Debug, Clone)]
pub struct RelayConfig {
    worker_id: WorkerId,
    batch_size: usize,
    lease_ttl: Duration,
    max_per_key: usize,
    publish_concurrency: usize,
    publish_timeout: Duration,
    poll_interval: Duration,
    idle_backoff_max: Duration,
    backoff: Backoff,
    filter: FetchFilter,
    breaker: Option<BreakerConfig>,
    delivery: DeliveryMode,
}

/// The longest publish timeout delivery in one transaction accepts: its transaction may stay
/// open for twice the publish timeout (R84), and a transaction open for more than about 20
/// minutes holds back vacuum and a connection for too long; use the lease mode instead.
pub const MAX_TRANSACTION_PUBLISH_TIMEOUT: Duration = Duration::from_secs(600);

/// The margin the server timeout of a delivery transaction adds for the outcome write (R84).
pub const TRANSACTION_OUTCOME_MARGIN: Duration = Duration::from_secs(1);

impl RelayConfig {
    /// The delivery mode (R76 lease, R84 transaction).
    pub fn delivery(&self) -> DeliveryMode {
        self.delivery
    }

    /// In transaction delivery: no publish starts later than one publish timeout after the
    /// fetch, every publish ends within a second one, so the transaction is idle at most
    /// 2 × publish timeout; the server ends it after 2 × publish timeout +
    /// [`TRANSACTION_OUTCOME_MARGIN`] of silence (R84, TX-03).
    pub fn delivery_bound(&self) -> DeliveryBound {
        DeliveryBound {
            server_timeout: self.publish_timeout * 2 + TRANSACTION_OUTCOME_MARGIN,
        }
    }

    /// The worker id.
    pub fn worker_id(&self) -> &WorkerId {
        &self.worker_id
    }
    /// Rows per fetch.
    pub fn batch_size(&self) -> usize {
        self.batch_size
    }
    /// Lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }
    /// Rows per key per fetch.
    pub fn max_per_key(&self) -> usize {
        self.max_per_key
    }
    /// Keys published at once.
    pub fn publish_concurrency(&self) -> usize {
        self.publish_concurrency
    }
    /// Publish timeout.
    pub fn publish_timeout(&self) -> Duration {
        self.publish_timeout
    }
    /// Poll interval.
    pub fn poll_interval(&self) -> Duration {
        self.poll_interval
    }
    /// Backoff.
    pub fn backoff(&self) -> Backoff {
        self.backoff
    }
    /// The longest idle wait of the loop (equal to the poll interval unless raised).
    pub fn idle_backoff_max(&self) -> Duration {
        self.idle_backoff_max
    }
}

/// Builds a [`Relay`]; [`build`](Self::build) validates every setting.
pub struct RelayBuilder {
    repo: Arc<dyn OutboxRepository>,
    broker: Arc<dyn Broker>,
    steps: Vec<Arc<dyn PipelineStep>>,
    worker_id: Option<String>,
    batch_size: usize,
    lease_ttl: Duration,
    max_per_key: usize,
    publish_concurrency: usize,
    publish_timeout: Duration,
    poll_interval: Duration,
    idle_backoff_max: Option<Duration>,
    backoff: Backoff,
    filter: FetchFilter,
    breaker: Option<BreakerConfig>,
    delivery: DeliveryMode,
    rng: Option<Box<dyn RandomSource>>,
    clock: Arc<dyn RelayClock>,
}

impl std::fmt::Debug for RelayBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayBuilder")
            .field("worker_id", &self.worker_id)
            .field("batch_size", &self.batch_size)
            .finish_non_exhaustive()
    }
}

impl RelayBuilder {
    /// The delivery mode (default [`DeliveryMode::Lease`]). [`DeliveryMode::Transaction`]
    /// needs a backend with [`Capabilities::transaction_delivery`](crate::repository::Capabilities)
    /// and a publish timeout of at most [`MAX_TRANSACTION_PUBLISH_TIMEOUT`].
    pub fn delivery(mut self, mode: DeliveryMode) -> Self {
        self.delivery = mode;
        self
    }

    /// The worker id (R10); a generated one when not set (R25).
    pub fn worker_id(mut self, id: impl Into<String>) -> Self {
        self.worker_id = Some(id.into());
        self
    }
    /// Rows per fetch (≥ 1; default 50).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }
    /// Lease TTL (> publish timeout, at most 365 days; default 300 s).
    pub fn lease_ttl(mut self, d: Duration) -> Self {
        self.lease_ttl = d;
        self
    }
    /// Rows per key per fetch (≥ 1; default 16; 1 = the ancestor's head-only fetch).
    pub fn max_per_key(mut self, n: usize) -> Self {
        self.max_per_key = n;
        self
    }
    /// Keys published at once (1 to [`MAX_PUBLISH_CONCURRENCY`]; default 16; 1 = sequential).
    pub fn publish_concurrency(mut self, n: usize) -> Self {
        self.publish_concurrency = n;
        self
    }
    /// Publish timeout (> 0, < lease TTL; default 30 s).
    pub fn publish_timeout(mut self, d: Duration) -> Self {
        self.publish_timeout = d;
        self
    }
    /// Poll interval of the loop (at most 365 days; default 5 s).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }
    /// Idle back-off of the loop: after each consecutive cycle that fetched nothing, the wait
    /// doubles from the poll interval up to this (default: the poll interval, i.e. off, which
    /// is the contract's R61 behaviour). A wake-up or a cycle with rows resets it.
    pub fn idle_backoff_max(mut self, d: Duration) -> Self {
        self.idle_backoff_max = Some(d);
        self
    }
    /// Backoff settings (default base 10 s, cap 3600 s, equal jitter).
    pub fn backoff(mut self, b: Backoff) -> Self {
        self.backoff = b;
        self
    }
    /// Fetch filters.
    pub fn filter(mut self, f: FetchFilter) -> Self {
        self.filter = f;
        self
    }
    /// Enables the circuit breaker.
    pub fn breaker(mut self, b: BreakerConfig) -> Self {
        self.breaker = Some(b);
        self
    }
    /// Adds a pipeline step (run in the order added).
    pub fn step(mut self, s: Arc<dyn PipelineStep>) -> Self {
        self.steps.push(s);
        self
    }
    /// The random source of the backoff.
    pub fn random_source(mut self, r: Box<dyn RandomSource>) -> Self {
        self.rng = Some(r);
        self
    }
    /// The relay's monotonic clock.
    pub fn clock(mut self, c: Arc<dyn RelayClock>) -> Self {
        self.clock = c;
        self
    }

    /// Validates the settings and builds the relay.
    pub fn build(self) -> Result<Relay, ConfigError> {
        let worker_id = match self.worker_id {
            Some(w) => WorkerId::new(w).map_err(|e| ConfigError::new(e.to_string()))?,
            None => WorkerId::generate(),
        };
        if self.batch_size == 0 {
            return Err(ConfigError::new("batch_size must be >= 1, got 0"));
        }
        if self.max_per_key == 0 {
            return Err(ConfigError::new("max_per_key must be >= 1, got 0"));
        }
        if self.publish_concurrency == 0 || self.publish_concurrency > MAX_PUBLISH_CONCURRENCY {
            return Err(ConfigError::new(format!(
                "publish_concurrency must be between 1 and {MAX_PUBLISH_CONCURRENCY}, got {}",
                self.publish_concurrency
            )));
        }
        if self.publish_timeout.is_zero() {
            return Err(ConfigError::new("publish_timeout must be > 0"));
        }
        let max = Duration::from_secs(limits::SETTING_MAX_SECS);
        for (name, d) in [
            ("lease_ttl", self.lease_ttl),
            ("publish_timeout", self.publish_timeout),
            ("poll_interval", self.poll_interval),
            (
                "idle_backoff_max",
                self.idle_backoff_max.unwrap_or_default(),
            ),
        ] {
            if d > max {
                return Err(ConfigError::new(format!(
                    "{name} must be at most {} s (365 days), got {d:?}",
                    limits::SETTING_MAX_SECS
                )));
            }
        }
        if self.delivery == DeliveryMode::Transaction {
            if !self.repo.capabilities().transaction_delivery {
                return Err(ConfigError::new(format!(
                    "the {} backend does not support delivery in one transaction; use the lease mode",
                    self.repo.capabilities().name
                )));
            }
            if self.publish_timeout > MAX_TRANSACTION_PUBLISH_TIMEOUT {
                return Err(ConfigError::new(format!(
                    "publish_timeout ({:?}) is too long for delivery in one transaction: its transaction \
                     could stay open for 2 × that; use at most {:?}, or the lease mode",
                    self.publish_timeout, MAX_TRANSACTION_PUBLISH_TIMEOUT
                )));
            }
        }
        if self.lease_ttl <= self.publish_timeout {
            return Err(ConfigError::new(format!(
                "lease_ttl ({:?}) must exceed publish_timeout ({:?}), or a publish could outlive its lease",
                self.lease_ttl, self.publish_timeout
            )));
        }
        Ok(Relay {
            repo: self.repo,
            broker: self.broker,
            steps: self.steps,
            config: RelayConfig {
                worker_id,
                batch_size: self.batch_size,
                lease_ttl: self.lease_ttl,
                max_per_key: self.max_per_key,
                publish_concurrency: self.publish_concurrency,
                publish_timeout: self.publish_timeout,
                poll_interval: self.poll_interval,
                idle_backoff_max: self
                    .idle_backoff_max
                    .unwrap_or(self.poll_interval)
                    .max(self.poll_interval),
                backoff: self.backoff,
                filter: self.filter,
                breaker: self.breaker,
                delivery: self.delivery,
            },
            rng: Mutex::new(
                self.rng
                    .unwrap_or_else(|| Box::new(SeededRng::from_entropy())),
            ),
            clock: self.clock,
            breaker: Mutex::new(BreakerState::default()),
            wake: Arc::new(Notify::new()),
        })
    }
}

#[derive(Debug, Default)]
struct BreakerState {
    failures: u32,
    opened_at: Option<tokio::time::Instant>,
}

/// What happened to one fetched row in a cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowOutcome {
    /// Published and completed.
    Completed {
        /// Publish duration.
        duration: Duration,
    },
    /// Counted failure.
    Counted {
        /// The error.
        error: String,
        /// Next try as written (none if the commit failed).
        next_try: Option<DateTime<Utc>>,
        /// Whether the row became `failed`.
        terminal: bool,
    },
    /// Transient failure (no attempt).
    Transient {
        /// The error.
        error: String,
        /// Next try as written.
        next_try: Option<DateTime<Utc>>,
    },
    /// Deferred (no attempt, schedule kept).
    Deferred {
        /// The error.
        error: String,
    },
    /// Released untouched.
    Released,
    /// The guard failed; nothing written (R55).
    LeaseLost,
}

/// A failure in a report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureReport {
    /// Row id.
    pub id: Uuid,
    /// The error text.
    pub error: String,
    /// Next try, when written.
    pub next_try: Option<DateTime<Utc>>,
}

/// What one cycle did (R58).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CycleReport {
    /// Rows fetched, in fetch order.
    pub fetched: Vec<Uuid>,
    /// Completed rows, in publish order.
    pub completed: Vec<Uuid>,
    /// Counted failures.
    pub counted: Vec<FailureReport>,
    /// Transient failures.
    pub transient: Vec<FailureReport>,
    /// Deferred rows.
    pub deferred: Vec<FailureReport>,
    /// Rows released untouched.
    pub released: Vec<Uuid>,
    /// Rows whose lease was lost.
    pub lease_lost: Vec<Uuid>,
    /// Whether the outcome transaction failed (R57), after its retries.
    pub commit_failed: bool,
    /// How many times the outcome write was retried after a transient failure (0 when the
    /// first try went through).
    pub commit_retries: u32,
    /// Whether a transient failure or timeout stopped the cycle (R47).
    pub broker_unreachable: bool,
    /// Whether the circuit breaker is open after this cycle (or kept it from fetching).
    pub breaker_open: bool,
    /// Per-row outcomes in fetch order.
    pub outcomes: Vec<(Uuid, RowOutcome)>,
}

/// The relay: one worker running cycles against a repository and a broker.
pub struct Relay {
    repo: Arc<dyn OutboxRepository>,
    broker: Arc<dyn Broker>,
    steps: Vec<Arc<dyn PipelineStep>>,
    config: RelayConfig,
    rng: Mutex<Box<dyn RandomSource>>,
    clock: Arc<dyn RelayClock>,
    breaker: Mutex<BreakerState>,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Stop {
    Unreachable(String),
    Other,
}

#[derive(Default)]
struct CycleState {
    stop: Option<Stop>,
    decided: HashMap<Uuid, (OutcomeKind, Option<Duration>)>,
    failed_keys: HashSet<Key>,
    completion_order: Vec<Uuid>,
}

fn timeout_text(t: Duration) -> String {
    let s = format!("{}", t.as_secs_f64());
    let s = if s.contains('.') { s } else { format!("{s}.0") };
    format!("Publish timed out after {s}s")
}

impl Relay {
    /// Starts a builder with the contract's defaults.
    pub fn builder(repo: Arc<dyn OutboxRepository>, broker: Arc<dyn Broker>) -> RelayBuilder {
        RelayBuilder {
            repo,
            broker,
            steps: Vec::new(),
            worker_id: None,
            batch_size: DEFAULT_BATCH_SIZE,
            lease_ttl: DEFAULT_LEASE_TTL,
            max_per_key: DEFAULT_MAX_PER_KEY,
            publish_concurrency: DEFAULT_PUBLISH_CONCURRENCY,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
            poll_interval: DEFAULT_POLL_INTERVAL,
            idle_backoff_max: None,
            backoff: Backoff::default(),
            filter: FetchFilter::default(),
            breaker: None,
            delivery: DeliveryMode::Lease,
            rng: None,
            clock: Arc::new(TokioClock),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RelayConfig {
        &self.config
    }

    /// A handle that wakes a waiting loop (for LISTEN/NOTIFY or an in-process writer).
    pub fn waker(&self) -> Arc<Notify> {
        self.wake.clone()
    }

    fn retry_for_counted(
        &self,
        row_created: Option<DateTime<Utc>>,
        attempts: i32,
        explicit: Option<DateTime<Utc>>,
    ) -> Retry {
        if let Some(t) = explicit.and_then(|t| valid_explicit(t, row_created)) {
            return Retry::At(t);
        }
        let mut rng = self.rng.lock().expect("rng poisoned");
        match self
            .config
            .backoff
            .delay(attempts.max(0) as u32, rng.as_mut())
        {
            Some(d) => Retry::After(d),
            None => Retry::Keep,
        }
    }

    fn breaker_allows_fetch(&self) -> bool {
        let Some(cfg) = self.config.breaker else {
            return true;
        };
        let st = self.breaker.lock().expect("breaker poisoned");
        match st.opened_at {
            None => true,
            Some(at) => self.clock.now().saturating_duration_since(at) >= cfg.recovery_timeout,
        }
    }

    /// Records a publish result in the breaker; true when it (re)opened.
    fn breaker_record(&self, success: bool) -> bool {
        let Some(cfg) = self.config.breaker else {
            return false;
        };
        let mut st = self.breaker.lock().expect("breaker poisoned");
        if success {
            st.failures = 0;
            st.opened_at = None;
            false
        } else {
            st.failures = st.failures.saturating_add(1);
            if st.failures >= cfg.failure_threshold {
                st.opened_at = Some(self.clock.now());
                true
            } else {
                false
            }
        }
    }

    fn breaker_is_open(&self) -> bool {
        self.config.breaker.is_some()
            && self
                .breaker
                .lock()
                .expect("breaker poisoned")
                .opened_at
                .is_some()
    }

    /// Runs one cycle (see the module docs). An error means the fetch failed; nothing is held.
    ///
    /// The cycle-end hook runs on every path (R68): after a full cycle, and with an empty report
    /// when the shutdown signal or an open breaker kept the cycle from fetching
    /// (`breaker_open` set) or the fetch failed.
    pub async fn cycle(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<CycleReport, RepositoryError> {
        let result = self.cycle_inner(shutdown).await;
        let empty = CycleReport::default();
        let report = match &result {
            Ok(r) => r,
            Err(_) => &empty,
        };
        for s in &self.steps {
            guard_hook("on_cycle_end", s.on_cycle_end(report)).await;
        }
        result
    }

    async fn cycle_inner(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<CycleReport, RepositoryError> {
        let mut report = CycleReport::default();
        if shutdown.is_cancelled() {
            return Ok(report);
        }
        if !self.breaker_allows_fetch() {
            report.breaker_open = true;
            return Ok(report);
        }
        let req = FetchRequest {
            worker: self.config.worker_id.clone(),
            limit: self.config.batch_size,
            lease_ttl: self.config.lease_ttl,
            max_per_key: self.config.max_per_key,
            filter: self.config.filter.clone(),
        };
        let fetch_started = self.clock.now();
        let (rows, delivery) = match self.config.delivery {
            DeliveryMode::Lease => (self.repo.fetch_and_lock(&req).await?, None),
            DeliveryMode::Transaction => {
                let (rows, d) = self
                    .repo
                    .begin_delivery(&req, self.config.delivery_bound())
                    .await?;
                (rows, Some(d))
            }
        };
        report.fetched = rows.iter().map(Fetched::id).collect();
        for s in &self.steps {
            guard_hook("on_fetch", s.on_fetch(rows.len())).await;
        }
        if rows.is_empty() {
            return Ok(report);
        }

        let runs = group_runs(&rows);

        let state = Mutex::new(CycleState::default());
        // No publish starts unless it can end before this (R49; in transaction delivery, R84:
        // none starts later than one publish timeout after the fetch). The builder bounds both
        // durations (365 days); a deadline past the clock's range would mean no publish may
        // start, which releases the rows instead of panicking.
        let lease_deadline = match self.config.delivery {
            DeliveryMode::Lease => fetch_started.checked_add(self.config.lease_ttl),
            DeliveryMode::Transaction => fetch_started.checked_add(self.config.publish_timeout * 2),
        }
        .unwrap_or(fetch_started);
        // Every key's run is a future; a FIFO semaphore lets `publish_concurrency` of them
        // publish at once, in head order (R75).
        let permits = tokio::sync::Semaphore::new(self.config.publish_concurrency);
        runs.iter()
            .map(|(key, run)| {
                let (permits, state) = (&permits, &state);
                async move {
                    let _permit = permits.acquire().await.expect("semaphore never closed");
                    self.publish_run(key, run, shutdown, lease_deadline, state)
                        .await;
                }
            })
            .collect::<futures::stream::FuturesUnordered<_>>()
            .collect::<Vec<()>>()
            .await;
        let state = state.into_inner().expect("cycle state poisoned");

        // Decide the rows not processed (R47, R77).
        let mut outcomes = Vec::with_capacity(rows.len());
        let mut durations = HashMap::new();
        let mut deferred_keys = HashSet::new();
        for r in &rows {
            let id = r.id();
            let kind = match state.decided.get(&id) {
                Some((k, d)) => {
                    if let Some(d) = d {
                        durations.insert(id, *d);
                    }
                    k.clone()
                }
                None => match &state.stop {
                    Some(Stop::Unreachable(text))
                        if !state.failed_keys.contains(&r.key())
                            && deferred_keys.insert(r.key()) =>
                    {
                        OutcomeKind::Deferred {
                            error: text.clone(),
                        }
                    }
                    _ => OutcomeKind::Released,
                },
            };
            outcomes.push(Outcome { id, kind });
        }
        report.broker_unreachable = matches!(state.stop, Some(Stop::Unreachable(_)));

        let (written, retries) = match delivery {
            None => {
                self.write_outcomes_retrying(&outcomes, lease_deadline, shutdown)
                    .await
            }
            // The delivery's transaction is gone when its commit fails: nothing to retry.
            Some(d) => (d.commit(&outcomes).await, 0),
        };
        report.commit_retries = retries;
        let written: HashMap<Uuid, OutcomeResult> = match written {
            Ok(w) => w.into_iter().map(|w| (w.id, w.result)).collect(),
            Err(e) => {
                match self.config.delivery {
                    DeliveryMode::Lease => {
                        tracing::error!(error = %e, worker = %self.config.worker_id, retries,
                        "outcome commit failed; the rows stay locked until their lease expires and will be published again")
                    }
                    DeliveryMode::Transaction => {
                        tracing::error!(error = %e, worker = %self.config.worker_id,
                        "outcome commit failed; the transaction rolled back, the rows are free at once and will be published again")
                    }
                }
                report.commit_failed = true;
                HashMap::new()
            }
        };

        let by_id: HashMap<Uuid, &Fetched> = rows.iter().map(|r| (r.id(), r)).collect();
        let mut order: Vec<Uuid> = state.completion_order.clone();
        let completed_set: HashSet<Uuid> = order.iter().copied().collect();
        order.extend(
            rows.iter()
                .map(Fetched::id)
                .filter(|id| !completed_set.contains(id)),
        );
        let mut terminal: Vec<(Uuid, String)> = Vec::new();
        let mut row_outcomes: HashMap<Uuid, RowOutcome> = HashMap::new();
        for o in &outcomes {
            let res = written.get(&o.id);
            let next_try = match res {
                Some(OutcomeResult::Applied { scheduled_at, .. }) => Some(*scheduled_at),
                _ => None,
            };
            let ro = if matches!(res, Some(OutcomeResult::LeaseLost)) {
                report.lease_lost.push(o.id);
                RowOutcome::LeaseLost
            } else {
                match &o.kind {
                    OutcomeKind::Completed => RowOutcome::Completed {
                        duration: durations.get(&o.id).copied().unwrap_or_default(),
                    },
                    OutcomeKind::Counted { error, .. } => {
                        let is_terminal = matches!(
                            res,
                            Some(OutcomeResult::Applied {
                                status: Status::Failed,
                                ..
                            })
                        );
                        if is_terminal {
                            terminal.push((o.id, error.clone()));
                        }
                        report.counted.push(FailureReport {
                            id: o.id,
                            error: error.clone(),
                            next_try,
                        });
                        RowOutcome::Counted {
                            error: error.clone(),
                            next_try,
                            terminal: is_terminal,
                        }
                    }
                    OutcomeKind::Transient { error, .. } => {
                        report.transient.push(FailureReport {
                            id: o.id,
                            error: error.clone(),
                            next_try,
                        });
                        RowOutcome::Transient {
                            error: error.clone(),
                            next_try,
                        }
                    }
                    OutcomeKind::Deferred { error } => {
                        report.deferred.push(FailureReport {
                            id: o.id,
                            error: error.clone(),
                            next_try: None,
                        });
                        RowOutcome::Deferred {
                            error: error.clone(),
                        }
                    }
                    OutcomeKind::Released => {
                        report.released.push(o.id);
                        RowOutcome::Released
                    }
                }
            };
            row_outcomes.insert(o.id, ro);
        }
        report.completed = order
            .iter()
            .filter(|id| matches!(row_outcomes.get(id), Some(RowOutcome::Completed { .. })))
            .copied()
            .collect();
        report.outcomes = rows
            .iter()
            .map(|r| {
                (
                    r.id(),
                    row_outcomes.remove(&r.id()).unwrap_or(RowOutcome::Released),
                )
            })
            .collect();
        report.breaker_open = self.breaker_is_open();

        if !report.commit_failed {
            for (id, ro) in &report.outcomes {
                let Some(event) = by_id.get(id).and_then(|f| f.row()) else {
                    continue;
                };
                let duration = match ro {
                    RowOutcome::Completed { duration } => Some(*duration),
                    _ => None,
                };
                let observed = ObservedOutcome {
                    event,
                    outcome: ro,
                    duration,
                };
                for s in &self.steps {
                    guard_hook("on_outcome", s.on_outcome(&observed)).await;
                }
            }
            for (id, error) in &terminal {
                if let Some(event) = by_id.get(id).and_then(|f| f.row()) {
                    for s in &self.steps {
                        guard_hook("on_terminal_failure", s.on_terminal_failure(event, error))
                            .await;
                    }
                }
            }
        }
        Ok(report)
    }

    /// Writes the outcomes (R54); a transient failure (a lost connection, a restarting
    /// database) is retried with a short doubling wait while the rows' lease lasts and the relay
    /// is not shutting down. Each try is a new transaction on whatever connection the backend
    /// hands out, and every write is guarded by `locked_by` (R54, R55), so a retry never
    /// overwrites a row another relay took meanwhile: it reports it lease lost. (A commit
    /// whose answer was lost but which went through is reported lease lost by the retry too:
    /// the rows are written, just not by the retry.) Returns the result and the number of
    /// retries.
    async fn write_outcomes_retrying(
        &self,
        outcomes: &[Outcome],
        lease_deadline: tokio::time::Instant,
        shutdown: &CancellationToken,
    ) -> (Result<Vec<WrittenOutcome>, RepositoryError>, u32) {
        let mut wait = OUTCOME_RETRY_FIRST_WAIT;
        let mut retries = 0u32;
        loop {
            let e = match self
                .repo
                .write_outcomes(&self.config.worker_id, outcomes)
                .await
            {
                Ok(w) => return (Ok(w), retries),
                Err(e) => e,
            };
            let left = lease_deadline.saturating_duration_since(self.clock.now());
            if !e.is_transient() || left <= wait || shutdown.is_cancelled() {
                return (Err(e), retries);
            }
            tracing::warn!(error = %e, worker = %self.config.worker_id, retry_in = ?wait,
                "outcome commit failed; retrying on a fresh transaction while the lease lasts");
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => return (Err(e), retries),
            }
            retries += 1;
            wait = (wait * 2).min(OUTCOME_RETRY_MAX_WAIT);
        }
    }

    async fn publish_run(
        &self,
        key: &Key,
        run: &[&Fetched],
        shutdown: &CancellationToken,
        lease_deadline: tokio::time::Instant,
        state: &Mutex<CycleState>,
    ) {
        let decide = |id: Uuid, kind: OutcomeKind, d: Option<Duration>| {
            let mut st = state.lock().expect("cycle state poisoned");
            if matches!(kind, OutcomeKind::Completed) {
                st.completion_order.push(id);
            } else {
                st.failed_keys.insert(key.clone());
            }
            st.decided.insert(id, (kind, d));
        };
        let stop = |s: Stop| {
            let mut st = state.lock().expect("cycle state poisoned");
            if st.stop.is_none()
                || matches!(s, Stop::Unreachable(_)) && st.stop == Some(Stop::Other)
            {
                st.stop = Some(s);
            }
        };
        for fetched in run {
            if state.lock().expect("cycle state poisoned").stop.is_some() || shutdown.is_cancelled()
            {
                return;
            }
            let now = self.clock.now();
            if lease_deadline.saturating_duration_since(now) < self.config.publish_timeout {
                tracing::debug!(id = %fetched.id(), "lease too short to start a publish; released");
                return;
            }
            let row = match fetched {
                Fetched::Undecodable(u) => {
                    let retry = self.retry_for_counted(None, u.attempts_made, None);
                    decide(
                        u.id,
                        OutcomeKind::Counted {
                            error: format!("undecodable row: {}", u.reason),
                            retry,
                        },
                        None,
                    );
                    return;
                }
                Fetched::Row(e) => e,
            };
            // Pipeline steps before the publish (R37).
            // A step that panics fails the row as a counted failure whose last_error is the
            // panic message, like a step error; the cycle goes on.
            let mut verdict = Ok(StepDecision::Continue);
            for s in &self.steps {
                verdict = match AssertUnwindSafe(s.before_publish(row)).catch_unwind().await {
                    Ok(v) => v,
                    Err(payload) => {
                        let text = panic_text(payload.as_ref());
                        tracing::error!(id = %row.id, panic = %text, "a pipeline step panicked in before_publish; the row fails as a counted failure");
                        Err(StepError::counted(format!(
                            "pipeline step panicked: {text}"
                        )))
                    }
                };
                if !matches!(verdict, Ok(StepDecision::Continue)) {
                    break;
                }
            }
            match verdict {
                Ok(StepDecision::Continue) => {}
                Ok(StepDecision::StopCycle) => {
                    stop(Stop::Other);
                    return;
                }
                Ok(StepDecision::Fail {
                    error,
                    counted: true,
                    retry_at,
                }) => {
                    let retry =
                        self.retry_for_counted(Some(row.created_at), row.attempts_made, retry_at);
                    decide(row.id, OutcomeKind::Counted { error, retry }, None);
                    return;
                }
                Ok(StepDecision::Fail {
                    error,
                    counted: false,
                    retry_at,
                }) => {
                    let retry = retry_at
                        .and_then(|t| valid_explicit(t, Some(row.created_at)))
                        .map_or(Retry::Keep, Retry::At);
                    decide(row.id, OutcomeKind::Transient { error, retry }, None);
                    return;
                }
                Err(e) if e.transient => {
                    decide(
                        row.id,
                        OutcomeKind::Transient {
                            error: e.message.clone(),
                            retry: Retry::After(TRANSIENT_RETRY),
                        },
                        None,
                    );
                    stop(Stop::Unreachable(e.message));
                    return;
                }
                Err(e) => {
                    let retry =
                        self.retry_for_counted(Some(row.created_at), row.attempts_made, None);
                    decide(
                        row.id,
                        OutcomeKind::Counted {
                            error: e.to_string(),
                            retry,
                        },
                        None,
                    );
                    return;
                }
            }
            // The publish (R45, R36).
            let msg = Message::from_event(row);
            // OpenTelemetry messaging attributes, and the trace context stored with the row
            // (see `crate::trace`), recorded on the span as `messaging.traceparent`.
            let span = tracing::info_span!(
                "process",
                otel.name = %format_args!("process {}", row.event_type),
                otel.kind = "producer",
                messaging.system = self.broker.messaging_system(),
                messaging.destination.name = %self.broker.destination_name(&msg),
                messaging.message.id = %row.id,
                messaging.operation.type = "send",
                messaging.traceparent = msg.traceparent().unwrap_or(""),
                event.id = %row.id,
                "event.type" = %row.event_type,
                worker.id = %self.config.worker_id,
                event.trace_id = row.trace_id.as_deref().unwrap_or(""),
                error = tracing::field::Empty,
            );
            #[cfg(feature = "opentelemetry")]
            if let Some(tp) = msg
                .traceparent()
                .and_then(|t| crate::trace::TraceParent::parse(t).ok())
            {
                use tracing_opentelemetry::OpenTelemetrySpanExt;
                span.add_link(crate::trace::span_context(&tp));
            }
            let started = self.clock.now();
            // A broker client that panics is a refusal of this row (counted), not the end of
            // the cycle.
            let publish = AssertUnwindSafe(self.broker.publish(&msg))
                .catch_unwind()
                .map(|r| {
                    r.unwrap_or_else(|payload| {
                        Err(BrokerError::Rejected(format!(
                            "broker client panicked: {}",
                            panic_text(payload.as_ref())
                        )))
                    })
                });
            let result = tokio::time::timeout(self.config.publish_timeout, publish)
                .instrument(span.clone())
                .await;
            let elapsed = self.clock.now().saturating_duration_since(started);
            let text = match result {
                Ok(Ok(_ack)) => {
                    self.breaker_record(true);
                    decide(row.id, OutcomeKind::Completed, Some(elapsed));
                    continue;
                }
                Ok(Err(BrokerError::Rejected(text))) => {
                    span.record("error", true);
                    tracing::warn!(parent: &span, error = %text, "publish rejected (counted)");
                    let retry =
                        self.retry_for_counted(Some(row.created_at), row.attempts_made, None);
                    decide(row.id, OutcomeKind::Counted { error: text, retry }, None);
                    if self.breaker_record(false) {
                        stop(Stop::Other);
                    }
                    return;
                }
                Ok(Err(BrokerError::Transient(text))) => text,
                Err(_elapsed) => timeout_text(self.config.publish_timeout),
            };
            span.record("error", true);
            tracing::warn!(parent: &span, error = %text, "broker unreachable (not counted)");
            decide(
                row.id,
                OutcomeKind::Transient {
                    error: text.clone(),
                    retry: Retry::After(TRANSIENT_RETRY),
                },
                None,
            );
            stop(Stop::Unreachable(text));
            if self.breaker_record(false) {
                stop(Stop::Other);
            }
            return;
        }
    }
}

/// The rows of a fetch as runs by key: keys in order of their first row, each key's rows in
/// write order `(created_at, id)`, whatever positions the backend returned them in (R22, R45;
/// A backend returns them so already; grouping and sorting here keeps a backend that
/// interleaves keys from getting two rows of one key published at once or out of order. An
/// undecodable row has no created_at: it sorts first in its key, so it fails before any of its
/// key's rows is published and the rest of the run is released (R46, R82).
fn group_runs(rows: &[Fetched]) -> Vec<(Key, Vec<&Fetched>)> {
    let mut runs: Vec<(Key, Vec<&Fetched>)> = Vec::new();
    let mut index: HashMap<Key, usize> = HashMap::new();
    for r in rows {
        let k = r.key();
        match index.get(&k) {
            Some(&i) => runs[i].1.push(r),
            None => {
                index.insert(k.clone(), runs.len());
                runs.push((k, vec![r]));
            }
        }
    }
    for (_, run) in &mut runs {
        run.sort_by_key(|f| f.row().map(crate::ordering::write_order));
    }
    runs
}

/// The text of a panic payload (a `&str` or `String` message, else a placeholder).
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_owned()
    }
}

/// An explicit retry time is valid within [created_at, created_at + 365 days] (R44).
fn valid_explicit(t: DateTime<Utc>, created: Option<DateTime<Utc>>) -> Option<DateTime<Utc>> {
    let Some(c) = created else { return Some(t) };
    let latest = c
        .checked_add_signed(chrono::Duration::seconds(limits::SCHEDULE_MAX_AHEAD_SECS))
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    if t < c || t > latest {
        tracing::warn!(retry_at = %t, created_at = %c, "explicit retry time outside [created_at, created_at + 365 days]; using the backoff instead");
        None
    } else {
        Some(t)
    }
}

async fn guard_hook(name: &'static str, f: impl std::future::Future<Output = ()>) {
    if AssertUnwindSafe(f).catch_unwind().await.is_err() {
        tracing::error!(
            hook = name,
            "a pipeline step panicked in an observer; ignored"
        );
    }
}

/// Kept for API symmetry: a validation error as a configuration error.
impl From<ValidationError> for ConfigError {
    fn from(e: ValidationError) -> Self {
        ConfigError(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::memory::InMemoryRepository;
    use crate::scripted::ScriptedBroker;
    use crate::step::PipelineStep;

    fn builder() -> RelayBuilder {
        let repo = Arc::new(InMemoryRepository::new(Arc::new(
            ManualClock::starting_now(),
        )));
        Relay::builder(repo, Arc::new(ScriptedBroker::new())).worker_id("w1")
    }

    /// The configuration reports every setting as built.
    #[test]
    fn config_reports_the_settings_it_was_built_with() {
        let backoff = Backoff::new(2.0, 50.0).unwrap();
        let relay = builder()
            .delivery(DeliveryMode::Transaction)
            .batch_size(7)
            .lease_ttl(Duration::from_secs(120))
            .max_per_key(3)
            .publish_concurrency(5)
            .publish_timeout(Duration::from_secs(4))
            .poll_interval(Duration::from_secs(2))
            .idle_backoff_max(Duration::from_secs(9))
            .backoff(backoff)
            .build()
            .unwrap();
        let c = relay.config();
        assert_eq!(c.delivery(), DeliveryMode::Transaction);
        assert_eq!(c.worker_id().as_str(), "w1");
        assert_eq!(c.batch_size(), 7);
        assert_eq!(c.lease_ttl(), Duration::from_secs(120));
        assert_eq!(c.max_per_key(), 3);
        assert_eq!(c.publish_concurrency(), 5);
        assert_eq!(c.publish_timeout(), Duration::from_secs(4));
        assert_eq!(c.poll_interval(), Duration::from_secs(2));
        assert_eq!(c.idle_backoff_max(), Duration::from_secs(9));
        assert_eq!(c.backoff(), backoff);
        // A delivery transaction may be idle for 2 × the publish timeout (R84).
        assert_eq!(
            c.delivery_bound().server_timeout,
            Duration::from_secs(2 * 4) + TRANSACTION_OUTCOME_MARGIN
        );
    }

    /// The builder's upper limits are inclusive: 365 days for the durations, and
    /// [`MAX_TRANSACTION_PUBLISH_TIMEOUT`] for the publish timeout in transaction delivery only.
    #[test]
    fn builder_limits_are_inclusive() {
        let year = Duration::from_secs(limits::SETTING_MAX_SECS);
        let over = year + Duration::from_secs(1);
        assert!(builder().lease_ttl(year).build().is_ok());
        assert!(builder().lease_ttl(over).build().is_err());
        assert!(builder().poll_interval(year).build().is_ok());
        assert!(builder().poll_interval(over).build().is_err());
        assert!(builder().idle_backoff_max(year).build().is_ok());
        assert!(builder().idle_backoff_max(over).build().is_err());
        let tx = |t: Duration, mode: DeliveryMode| {
            builder()
                .delivery(mode)
                .publish_timeout(t)
                .lease_ttl(t + Duration::from_secs(1))
                .build()
        };
        let max = MAX_TRANSACTION_PUBLISH_TIMEOUT;
        let above = max + Duration::from_secs(1);
        assert!(tx(max, DeliveryMode::Transaction).is_ok());
        assert!(tx(above, DeliveryMode::Transaction).is_err());
        assert!(tx(above, DeliveryMode::Lease).is_ok());
    }

    struct FetchTimes(Arc<Mutex<Vec<tokio::time::Instant>>>);

    #[async_trait::async_trait]
    impl PipelineStep for FetchTimes {
        async fn on_fetch(&self, _rows: usize) {
            self.0.lock().unwrap().push(tokio::time::Instant::now());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn idle_backoff_doubles_up_to_its_max_and_a_wake_resets_it() {
        let repo = Arc::new(InMemoryRepository::new(Arc::new(
            ManualClock::starting_now(),
        )));
        let times = Arc::new(Mutex::new(Vec::new()));
        let relay = Arc::new(
            Relay::builder(repo, Arc::new(ScriptedBroker::new()))
                .worker_id("w1")
                .poll_interval(Duration::from_secs(1))
                .idle_backoff_max(Duration::from_secs(4))
                .step(Arc::new(FetchTimes(times.clone())))
                .build()
                .unwrap(),
        );
        let t0 = tokio::time::Instant::now();
        let stop = CancellationToken::new();
        let task = tokio::spawn({
            let (relay, stop) = (relay.clone(), stop.clone());
            async move { relay.run(stop).await }
        });
        tokio::time::sleep(Duration::from_millis(15_500)).await;
        relay.waker().notify_one();
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        stop.cancel();
        task.await.unwrap().unwrap();
        let secs: Vec<f64> = times
            .lock()
            .unwrap()
            .iter()
            .map(|t| (*t - t0).as_secs_f64())
            .collect();
        // Waits 1, 2, 4, 4, 4 → fetches at 0, 1, 3, 7, 11, 15; the wake at 15.5 fetches at once,
        // then the wait is back to 1 s.
        let want = [0.0, 1.0, 3.0, 7.0, 11.0, 15.0, 15.5, 16.5];
        assert_eq!(secs.len(), want.len(), "{secs:?}");
        for (got, want) in secs.iter().zip(want) {
            assert!((got - want).abs() < 0.01, "{secs:?}");
        }
    }
}
