//! The relay's settings: [`RelayBuilder`] validates them into a [`RelayConfig`] (contract
//! section 12).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;

use crate::backoff::{Backoff, RandomSource, SeededRng};
use crate::breaker::Breaker;
use crate::broker::Broker;
use crate::clock::{RelayClock, TokioClock};
use crate::error::{ConfigError, ValidationError};
use crate::event::{WorkerId, limits};
use crate::repository::{
    DEFAULT_LEASE_TTL, DEFAULT_MAX_PER_KEY, DeliveryBound, DeliveryMode, FetchFilter, OnExhausted,
    OutboxRepository,
};
use crate::step::PipelineStep;

use super::{BreakerConfig, Relay};

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

/// A validated relay configuration. Defaults are the contract's (section 12).
#[derive(Debug, Clone)]
pub struct RelayConfig {
    pub(super) worker_id: WorkerId,
    pub(super) batch_size: usize,
    pub(super) lease_ttl: Duration,
    pub(super) max_per_key: usize,
    pub(super) publish_concurrency: usize,
    pub(super) publish_timeout: Duration,
    pub(super) poll_interval: Duration,
    pub(super) idle_backoff_max: Duration,
    pub(super) backoff: Backoff,
    pub(super) filter: FetchFilter,
    pub(super) delivery: DeliveryMode,
    pub(super) on_exhausted: OnExhausted,
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

    /// What the failure that spends a row's last attempt writes (R191).
    pub fn on_exhausted(&self) -> OnExhausted {
        self.on_exhausted
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
    on_exhausted: OnExhausted,
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

    /// What the failure that spends a row's last attempt writes (R191, D41; default
    /// [`OnExhausted::Release`], R38). [`OnExhausted::Park`] keeps the row pending so it holds
    /// its key until an operator redrives or discards it (R192).
    pub fn on_exhausted(mut self, o: OnExhausted) -> Self {
        self.on_exhausted = o;
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
                delivery: self.delivery,
                on_exhausted: self.on_exhausted,
            },
            rng: Mutex::new(
                self.rng
                    .unwrap_or_else(|| Box::new(SeededRng::from_entropy())),
            ),
            clock: self.clock,
            breaker: Mutex::new(self.breaker.map(Breaker::new)),
            wake: Arc::new(Notify::new()),
        })
    }
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
            on_exhausted: OnExhausted::Release,
            rng: None,
            clock: Arc::new(TokioClock),
        }
    }
}

/// Kept for API symmetry: a validation error as a configuration error.
impl From<ValidationError> for ConfigError {
    fn from(e: ValidationError) -> Self {
        ConfigError(e.to_string())
    }
}
