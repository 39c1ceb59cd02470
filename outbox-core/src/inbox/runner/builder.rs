//! The runner's configuration and its builder (the defaults of section 27, R166's concurrency,
//! the policy of R123 to R129).

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backoff::{Backoff, RandomSource, SeededRng};
use crate::error::ConfigError;
use crate::event::WorkerId;
use crate::inbox::handler::Handler;
use crate::inbox::hooks::InboxHooks;
use crate::inbox::model::ConsumerGroup;
use crate::inbox::policy::{self, AncestorAckSettings, FailurePolicy, OnFailure};
use crate::inbox::processor::{Processor, check_timeouts};
use crate::inbox::repository::{HandlerTx, InboxBackend};
use crate::inbox::subscription::{RunnerSettings, Subscription};
use crate::repository::OnExhausted;

use super::{MAX_MESSAGES_PER_TRANSACTION, Runner, duplicates};

/// A validated runner configuration (defaults of section 27).
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    pub(crate) group: ConsumerGroup,
    pub(crate) worker: WorkerId,
    pub(crate) policy: FailurePolicy,
    pub(crate) max_attempts: u32,
    pub(crate) handler_timeout: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) key_order: bool,
    pub(crate) concurrency: usize,
    pub(crate) messages_per_transaction: usize,
    pub(crate) lease_ttl: Duration,
    pub(crate) commit_timeout: Duration,
    pub(crate) require_message_id: bool,
    pub(crate) sources: Vec<String>,
    pub(crate) process_stored: bool,
    pub(crate) breaker: Option<crate::breaker::BreakerConfig>,
    pub(crate) on_exhausted: OnExhausted,
}

impl RunnerConfig {
    /// The group.
    pub fn group(&self) -> &ConsumerGroup {
        &self.group
    }
    /// The worker id.
    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }
    /// The resolved policy.
    pub fn policy(&self) -> FailurePolicy {
        self.policy
    }
    /// Deliveries held at once (R166, R183).
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }
    /// Messages per transaction (R183; 1 is Part II's one message per transaction).
    pub fn messages_per_transaction(&self) -> usize {
        self.messages_per_transaction
    }
    /// max_attempts rows are landed with (R103).
    pub fn landing_max_attempts(&self) -> u32 {
        if self.policy.at_most_once {
            1
        } else {
            self.max_attempts
        }
    }
}

/// Builds a [`Runner`].
pub struct RunnerBuilder<B: InboxBackend> {
    pub(super) backend: B,
    pub(super) subscription: Arc<dyn Subscription>,
    pub(super) handler: Option<Arc<dyn Handler<HandlerTx<B>>>>,
    pub(super) group: Option<String>,
    pub(super) worker: Option<String>,
    pub(super) on_failure: Option<OnFailure>,
    pub(super) at_most_once: Option<bool>,
    pub(super) ancestor: AncestorAckSettings,
    pub(super) max_attempts: u32,
    pub(super) handler_timeout: Duration,
    pub(super) backoff: Backoff,
    pub(super) key_order: bool,
    pub(super) concurrency: usize,
    pub(super) messages_per_transaction: usize,
    pub(super) lease_ttl: Duration,
    pub(super) commit_timeout: Duration,
    pub(super) require_message_id: bool,
    pub(super) sources: Option<Vec<String>>,
    pub(super) topics: Option<Vec<String>>,
    pub(super) process_stored: Option<bool>,
    pub(super) processor_poll: Duration,
    pub(super) hooks: Vec<Arc<dyn InboxHooks>>,
    pub(super) rng: Option<Box<dyn RandomSource>>,
    pub(super) breaker: Option<crate::breaker::BreakerConfig>,
    pub(super) on_exhausted: OnExhausted,
}

impl<B: InboxBackend> RunnerBuilder<B> {
    /// Enables the circuit breaker of R62 for handler runs (R120): it opens after
    /// `failure_threshold` consecutive failed runs of any class and half-opens after
    /// `recovery_timeout_seconds`. The values are checked as the relay's
    /// ([`crate::relay::BreakerConfig::new`]).
    pub fn breaker(
        mut self,
        failure_threshold: i64,
        recovery_timeout_seconds: f64,
    ) -> Result<Self, ConfigError> {
        self.breaker = Some(crate::breaker::BreakerConfig::new(
            failure_threshold,
            recovery_timeout_seconds,
        )?);
        Ok(self)
    }

    /// The handler; without one every delivery is landed for a processor (R121, R125). A
    /// [`Handler`] implementation, a closure made one by
    /// [`handler_fn`](crate::inbox::handler_fn), or an `Arc` of either.
    pub fn handler(mut self, h: impl Handler<HandlerTx<B>> + 'static) -> Self {
        self.handler = Some(Arc::new(h));
        self
    }
    /// The consumer group, where the subscription does not name it (the scripted one). A
    /// subscription that names one ([`Subscription::group`]) gives it already: a group given
    /// here as well must be the same, or [`build`](Self::build) refuses.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.group = Some(group.into());
        self
    }
    /// The worker id (R10; at most 253 characters with process_stored, R121).
    pub fn worker_id(mut self, w: impl Into<String>) -> Self {
        self.worker = Some(w.into());
        self
    }
    /// Who retries a failed run (R123; default record).
    pub fn on_failure(mut self, p: OnFailure) -> Self {
        self.on_failure = Some(p);
        self
    }
    /// What the failure that spends a row's last attempt writes, for the failures the runner
    /// records (R126, R128, R154) and its embedded processor's (R121) (R191, D41; default
    /// [`OnExhausted::Release`]). Under at_most_once a failure always writes `failed` (R129).
    pub fn on_exhausted(mut self, o: OnExhausted) -> Self {
        self.on_exhausted = o;
        self
    }
    /// Commit before handling (R129).
    pub fn at_most_once(mut self, on: bool) -> Self {
        self.at_most_once = Some(on);
        self
    }
    /// The ancestor's ack settings, as aliases (R123).
    pub fn ancestor_ack_settings(mut self, a: AncestorAckSettings) -> Self {
        self.ancestor = a;
        self
    }
    /// max_attempts of landed rows (0 means 6, R103).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }
    /// Handler timeout (> 0, default 30 s, R165).
    pub fn handler_timeout(mut self, d: Duration) -> Self {
        self.handler_timeout = d;
        self
    }
    /// Backoff (R39, R127).
    pub fn backoff(mut self, b: Backoff) -> Self {
        self.backoff = b;
        self
    }
    /// Per-key order (default true, R147).
    pub fn key_order(mut self, on: bool) -> Self {
        self.key_order = on;
        self
    }
    /// Deliveries held at once (≥ 1 and ≥ `messages_per_transaction`, default 64, R166, R183):
    /// a runner has up to ⌊concurrency / messages_per_transaction⌋ transactions in flight.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n;
        self
    }
    /// Messages per transaction (1 to 64, default 16, R183): the runner lands, runs and
    /// completes up to this many ready deliveries in one transaction, each run under a savepoint
    /// of its own (R185, R186). 1 keeps Part II's one message per transaction word for word.
    pub fn messages_per_transaction(mut self, n: usize) -> Self {
        self.messages_per_transaction = n;
        self
    }
    /// The group's lease TTL (default 300 s, R116).
    pub fn lease_ttl(mut self, d: Duration) -> Self {
        self.lease_ttl = d;
        self
    }
    /// Commit timeout (> 0, default 5 s, R131).
    pub fn commit_timeout(mut self, d: Duration) -> Self {
        self.commit_timeout = d;
        self
    }
    /// Messages without an id are invalid (R138).
    pub fn require_message_id(mut self, on: bool) -> Self {
        self.require_message_id = on;
        self
    }
    /// The topics the runner reads (they are the default sources, R121), where the
    /// subscription does not give them ([`Subscription::topics`]); topics given here as well
    /// must be the subscription's, or [`build`](Self::build) refuses.
    pub fn topics<S: Into<String>>(mut self, t: impl IntoIterator<Item = S>) -> Self {
        self.topics = Some(t.into_iter().map(Into::into).collect());
        self
    }
    /// The embedded processor's sources (R121; default the topics).
    pub fn sources<S: Into<String>>(mut self, s: impl IntoIterator<Item = S>) -> Self {
        self.sources = Some(s.into_iter().map(Into::into).collect());
        self
    }
    /// Run an embedded processor (default true with a handler, R121).
    pub fn process_stored(mut self, on: bool) -> Self {
        self.process_stored = Some(on);
        self
    }
    /// The embedded processor's poll interval (default 5 s).
    pub fn processor_poll_interval(mut self, d: Duration) -> Self {
        self.processor_poll = d;
        self
    }
    /// Adds hooks (R171); the embedded processor gets them too.
    pub fn hooks(mut self, h: Arc<dyn InboxHooks>) -> Self {
        self.hooks.push(h);
        self
    }
    /// The random source of the backoff.
    pub fn random_source(mut self, r: Box<dyn RandomSource>) -> Self {
        self.rng = Some(r);
        self
    }

    /// Validates and builds (F-18). The group and the topics are the subscription's where it
    /// names them ([`Subscription::group`], [`Subscription::topics`]); given to the builder as
    /// well and different, they are refused with an error that names both values.
    pub fn build(self) -> Result<Runner<B>, ConfigError> {
        let policy = policy::resolve(self.on_failure, self.at_most_once, self.ancestor)?;
        let caps = self.subscription.capabilities();
        let group_name = one_group(self.group.as_deref(), self.subscription.group(), caps.name)?;
        let topics = one_topic_list(self.topics, self.subscription.topics(), caps.name)?;
        let rewinds = policy.on_failure == OnFailure::Rewind && !policy.at_most_once;
        if rewinds && !caps.rewind {
            return Err(ConfigError::new(match caps.rewind_refusal {
                Some(text) => text.to_owned(),
                None => format!(
                    "on_failure = rewind is not possible on {}: it cannot rewind one message (use record)",
                    caps.name
                ),
            }));
        }
        let group = ConsumerGroup::new(&group_name)?;
        let worker = match self.worker {
            Some(w) => WorkerId::new(w).map_err(|e| ConfigError::new(e.to_string()))?,
            None => WorkerId::generate(),
        };
        if self.concurrency == 0 {
            return Err(ConfigError::new("concurrency must be at least 1"));
        }
        if !(1..=MAX_MESSAGES_PER_TRANSACTION).contains(&self.messages_per_transaction) {
            return Err(ConfigError::new(format!(
                "messages_per_transaction must be between 1 and {MAX_MESSAGES_PER_TRANSACTION} \
                 (got {}): PostgreSQL keeps at most 64 subtransactions of a transaction in \
                 shared memory (R183, R186)",
                self.messages_per_transaction
            )));
        }
        if self.concurrency < self.messages_per_transaction {
            return Err(ConfigError::new(format!(
                "concurrency ({}) is below messages_per_transaction ({}): the runner could never \
                 hold a full batch; raise concurrency or lower messages_per_transaction (R183)",
                self.concurrency, self.messages_per_transaction
            )));
        }
        if self.commit_timeout.is_zero() {
            return Err(ConfigError::new("commit_timeout must be positive"));
        }
        if self.handler_timeout.is_zero() {
            return Err(ConfigError::new("handler_timeout must be positive"));
        }
        // The runner's settings, given once: the subscription takes what it needs (R136's
        // bound, R133's max_deliver check).
        let mut settings = RunnerSettings::new(self.concurrency).at_most_once(policy.at_most_once);
        if rewinds {
            settings = settings.rewinding(if self.max_attempts == 0 {
                6
            } else {
                self.max_attempts
            });
        }
        self.subscription
            .configure(&settings)
            .map_err(|e| ConfigError::new(format!("the {} subscription: {e}", caps.name)))?;
        let process_stored = self.process_stored.unwrap_or(true) && self.handler.is_some();
        let sources = self.sources.unwrap_or(topics);
        let mut embedded = None;
        if process_stored {
            check_timeouts(self.handler_timeout, self.lease_ttl)?;
            if sources.is_empty() {
                return Err(ConfigError::new(format!(
                    "sources must be set for the embedded processor: the {} subscription names \
                     no topics, so give the rows' sources with .sources([...]) (or .topics([...])), \
                     or turn it off with .process_stored(false) where other processors serve the \
                     group (R121)",
                    caps.name
                )));
            }
            let pw = format!("{worker}/p");
            WorkerId::new(&pw).map_err(|e| ConfigError::new(e.to_string()))?;
            let mut b = Processor::builder(
                self.backend.clone(),
                group.as_str(),
                self.handler
                    .clone()
                    .expect("process_stored needs a handler"),
            )
            .worker_id(pw)
            .sources(sources.clone())
            .lease_ttl(self.lease_ttl)
            .handler_timeout(self.handler_timeout)
            .backoff(self.backoff)
            .key_order(self.key_order)
            .on_exhausted(self.on_exhausted)
            .poll_interval(self.processor_poll);
            for h in &self.hooks {
                b = b.hooks(h.clone());
            }
            embedded = Some(b.build()?);
        }
        Ok(Runner {
            backend: self.backend,
            subscription: self.subscription,
            handler: self.handler,
            config: RunnerConfig {
                group,
                worker,
                policy,
                max_attempts: self.max_attempts,
                handler_timeout: self.handler_timeout,
                backoff: self.backoff,
                key_order: self.key_order,
                concurrency: self.concurrency,
                messages_per_transaction: self.messages_per_transaction,
                lease_ttl: self.lease_ttl,
                commit_timeout: self.commit_timeout,
                require_message_id: self.require_message_id,
                sources,
                process_stored,
                breaker: self.breaker,
                on_exhausted: self.on_exhausted,
            },
            embedded: embedded.map(Arc::new),
            hooks: self.hooks,
            rng: Mutex::new(
                self.rng
                    .unwrap_or_else(|| Box::new(SeededRng::from_entropy())),
            ),
            started: AtomicBool::new(false),
            stop: CancellationToken::new(),
            warned_sources: Mutex::new(Vec::new()),
            duplicates: duplicates::DuplicateShare::default(),
        })
    }
}

/// The runner's group: the subscription's or the builder's, and the same when both give one.
fn one_group(
    builder: Option<&str>,
    subscription: Option<&str>,
    kind: &str,
) -> Result<String, ConfigError> {
    match (builder, subscription) {
        (Some(b), Some(s)) if b != s => Err(ConfigError::new(format!(
            "the runner's consumer group {b:?} differs from the {kind} subscription's group {s:?}: \
             they must be one group (one inbox line, one broker consumer); give the group once, \
             in the subscription's config, and build the runner with \
             Runner::for_subscription(backend, subscription)"
        ))),
        (Some(g), _) | (None, Some(g)) => Ok(g.to_owned()),
        (None, None) => Err(ConfigError::new(format!(
            "no consumer group: the {kind} subscription does not name one; give it with \
             .group(\"...\") or Runner::builder(backend, subscription, group)"
        ))),
    }
}

/// The runner's topics: the subscription's or the builder's, and the same (in any order) when
/// both give them.
fn one_topic_list(
    builder: Option<Vec<String>>,
    subscription: Option<&[String]>,
    kind: &str,
) -> Result<Vec<String>, ConfigError> {
    match (builder, subscription) {
        (Some(b), Some(s)) => {
            fn set(v: &[String]) -> std::collections::BTreeSet<&String> {
                v.iter().collect()
            }
            if set(&b) != set(s) {
                return Err(ConfigError::new(format!(
                    "the runner's topics {b:?} differ from the {kind} subscription's topics {s:?}: \
                     the topics are what the subscription reads and the embedded processor's \
                     default sources (R121); give them once, in the subscription's config (drop \
                     .topics(...) from the runner), and set .sources([...]) for other sources"
                )));
            }
            Ok(b)
        }
        (Some(t), None) => Ok(t),
        (None, Some(t)) => Ok(t.to_vec()),
        (None, None) => Ok(Vec::new()),
    }
}
