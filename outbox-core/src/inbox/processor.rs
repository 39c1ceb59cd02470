//! The inbox processor (contract R148 to R159): fetches stored pending rows of one group and
//! runs the handler on them, one transaction per row.
//!
//! One [`Processor::cycle`]:
//!
//! 1. reads the shutdown signal; a set signal stops the cycle before it fetches (R159);
//! 2. fetch-and-lock of the group's heads and runs (R149, R150) in its own committed
//!    transaction;
//! 3. runs the keys, up to `handler_concurrency` at once, each key's rows one after the other in
//!    write order (R151). Before each run it reads the shutdown signal and the lease margin
//!    (R153); each run is [`Processor::run_row`]: T_row row-locks the row, checks it is pending
//!    and held by this worker (else lease lost, R156), completes a row whose sibling completed
//!    (R164), runs the handler after a savepoint (R181), writes the outcome (R154) and commits.
//!    A row the fetch could not decode is failed alone instead, counted, in a T_row of its own
//!    with last_error `undecodable row: …` and no handler run (R106). A failed run releases the
//!    rows behind it untouched (R151);
//! 4. releases the rows it did not run (R77); hooks run after each commit (R158).
//!
//! With `rows_per_transaction` above 1 (the default is 16, R183), step 3 runs the keys in
//! transactions T_b of several rows instead, each holding whole keys, up to
//! `handler_concurrency` T_b at once (R189; `processor/batch.rs`): the rows' guards first, a savepoint per
//! run (R186), one commit; a T_b that cannot finish as a batch hands its rows to the T_row path
//! above, at once. With 1, step 3 is exactly as written above.
//!
//! [`Processor::run`] loops cycles: at once after a cycle that fetched rows and had a run that
//! did not fail transient or not counted, else after the poll interval (R159, D39).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff::{Backoff, RandomSource, SeededRng};
use crate::breaker::{Breaker, BreakerConfig};
use crate::clock::{RelayClock, TokioClock};
use crate::error::{ConfigError, RepositoryError};
use crate::event::{Status, WorkerId};
use crate::inbox::handler::{FailureClass, Handler, RunResult, run_handler};
use crate::inbox::hooks::{self, InboxHooks};
use crate::inbox::logs;
use crate::inbox::model::{ConsumerGroup, InboxEvent};
use crate::inbox::policy;
use crate::inbox::repository::{
    DEFAULT_INBOX_MAX_PER_KEY, Guard, HandlerTx, InboxBackend, InboxFetchRequest, InboxFetched,
    InboxTransaction, RowWrite, UndecodableInboxRow,
};
use crate::repository::{DEFAULT_LEASE_TTL, OnExhausted};

/// Default processor batch size (R159).
pub const DEFAULT_INBOX_BATCH: usize = 50;
/// Default poll interval (R159).
pub const DEFAULT_INBOX_POLL: Duration = Duration::from_secs(5);
/// Default handler concurrency (R151).
pub const DEFAULT_HANDLER_CONCURRENCY: usize = 16;
/// Default handler timeout (R165).
pub const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);
/// Default rows per processor transaction (R183).
pub const DEFAULT_ROWS_PER_TRANSACTION: usize = 16;
/// The most rows a processor transaction may hold (R183, R186: PostgreSQL keeps 64
/// subtransaction ids per transaction in shared memory, one savepoint per run).
pub const MAX_ROWS_PER_TRANSACTION: usize = 64;

mod batch;

/// What happened to one fetched row (R157).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowReport {
    /// Completed by a handler run.
    Completed {
        /// The handler's status text.
        status: Option<String>,
    },
    /// Skipped by the handler; the row is completed (R155).
    Skipped {
        /// The reason.
        reason: String,
    },
    /// Completed without a run: a sibling completed it (R164).
    Duplicate {
        /// `duplicate_sibling`.
        reason: String,
    },
    /// A counted failure.
    Counted {
        /// The error.
        error: String,
        /// The next try as written.
        next_try: DateTime<Utc>,
        /// Whether the row became `failed`.
        terminal: bool,
    },
    /// A transient or not-counted failure.
    NotCounted {
        /// The error.
        error: String,
        /// The next try as written.
        next_try: DateTime<Utc>,
    },
    /// Released untouched (shutdown, lease margin, or behind a failure of its key).
    Released,
    /// The guard failed: not run, not written (R156).
    LeaseLost,
    /// T_row failed to commit: nothing of it applies (R156).
    CommitFailed {
        /// The error.
        error: String,
    },
}

impl RowReport {
    fn failed_uncounted(&self) -> bool {
        matches!(self, RowReport::NotCounted { .. })
    }
    fn was_run(&self) -> bool {
        !matches!(
            self,
            RowReport::Released | RowReport::LeaseLost | RowReport::Duplicate { .. }
        )
    }
    /// Whether the row's run failed, of any class.
    pub fn is_failure(&self) -> bool {
        matches!(
            self,
            RowReport::Counted { .. } | RowReport::NotCounted { .. }
        )
    }
}

/// What one cycle did (R157).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InboxCycleReport {
    /// Rows fetched, in fetch order.
    pub fetched: Vec<Uuid>,
    /// Per row, in fetch order.
    pub outcomes: Vec<(Uuid, RowReport)>,
    /// The rows of each processor transaction T_b that committed (R189), in commit order; empty
    /// with `rows_per_transaction` 1, where every row has a T_row of its own (BT-11 counts
    /// these).
    pub transactions: Vec<Vec<Uuid>>,
}

impl InboxCycleReport {
    /// The report of one row.
    pub fn of(&self, id: Uuid) -> Option<&RowReport> {
        self.outcomes.iter().find(|(i, _)| *i == id).map(|(_, r)| r)
    }
    /// Rows completed by a run, a skip or as duplicates.
    pub fn completed(&self) -> Vec<Uuid> {
        self.outcomes
            .iter()
            .filter(|(_, r)| {
                matches!(
                    r,
                    RowReport::Completed { .. }
                        | RowReport::Skipped { .. }
                        | RowReport::Duplicate { .. }
                )
            })
            .map(|(i, _)| *i)
            .collect()
    }
    /// Rows released untouched.
    pub fn released(&self) -> Vec<Uuid> {
        self.outcomes
            .iter()
            .filter(|(_, r)| *r == RowReport::Released)
            .map(|(i, _)| *i)
            .collect()
    }
}

/// A validated processor configuration (defaults of section 27).
#[derive(Debug, Clone)]
pub struct ProcessorConfig {
    pub(crate) group: ConsumerGroup,
    pub(crate) worker: WorkerId,
    pub(crate) sources: Option<Vec<String>>,
    pub(crate) batch_size: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) lease_ttl: Duration,
    pub(crate) max_per_key: usize,
    pub(crate) handler_concurrency: usize,
    pub(crate) handler_timeout: Duration,
    pub(crate) backoff: Backoff,
    pub(crate) key_order: bool,
    pub(crate) on_exhausted: OnExhausted,
    pub(crate) rows_per_transaction: usize,
}

impl ProcessorConfig {
    /// Rows per transaction (R183).
    pub fn rows_per_transaction(&self) -> usize {
        self.rows_per_transaction
    }
    /// The group.
    pub fn group(&self) -> &ConsumerGroup {
        &self.group
    }
    /// The worker id.
    pub fn worker(&self) -> &WorkerId {
        &self.worker
    }
}

/// Checks the handler timeout and the lease margin (R153, R165).
pub(crate) fn check_timeouts(
    handler_timeout: Duration,
    lease_ttl: Duration,
) -> Result<(), ConfigError> {
    if handler_timeout.is_zero() {
        return Err(ConfigError::new("handler_timeout must be positive"));
    }
    if lease_ttl <= handler_timeout {
        return Err(ConfigError::new(format!(
            "lease_ttl ({} s) must exceed handler_timeout ({} s), so that a run can finish within its lease (R153)",
            lease_ttl.as_secs_f64(),
            handler_timeout.as_secs_f64()
        )));
    }
    Ok(())
}

/// Builds a [`Processor`].
pub struct ProcessorBuilder<B: InboxBackend> {
    backend: B,
    handler: Arc<dyn Handler<HandlerTx<B>>>,
    group: String,
    worker: Option<String>,
    sources: Option<Vec<String>>,
    batch_size: usize,
    poll_interval: Duration,
    lease_ttl: Duration,
    max_per_key: usize,
    handler_concurrency: usize,
    handler_timeout: Duration,
    backoff: Backoff,
    key_order: bool,
    hooks: Vec<Arc<dyn InboxHooks>>,
    rng: Option<Box<dyn RandomSource>>,
    clock: Arc<dyn RelayClock>,
    breaker: Option<BreakerConfig>,
    on_exhausted: OnExhausted,
    rows_per_transaction: usize,
}

impl<B: InboxBackend> ProcessorBuilder<B> {
    /// Rows per transaction T_b (R183, R189; 1 to 64, default 16): the rows of one fetch are
    /// handled in transactions of at most this many rows, each holding whole keys, with a
    /// savepoint per run (R186). With 1 every row has a T_row of its own (R152) exactly as
    /// before.
    pub fn rows_per_transaction(mut self, n: usize) -> Self {
        self.rows_per_transaction = n;
        self
    }
    /// Enables the circuit breaker of R62 (R158): it opens after `failure_threshold`
    /// consecutive failed handler runs, counted or not, and keeps cycles from fetching until
    /// `recovery_timeout_seconds` passed; values are checked as the relay's.
    pub fn breaker(
        mut self,
        failure_threshold: i64,
        recovery_timeout_seconds: f64,
    ) -> Result<Self, ConfigError> {
        self.breaker = Some(BreakerConfig::new(
            failure_threshold,
            recovery_timeout_seconds,
        )?);
        Ok(self)
    }

    /// The worker id (R10; default generated, R25).
    pub fn worker_id(mut self, w: impl Into<String>) -> Self {
        self.worker = Some(w.into());
        self
    }
    /// Only rows of these sources (the ancestor's `filter_sources`, R148).
    pub fn sources<S: Into<String>>(mut self, s: impl IntoIterator<Item = S>) -> Self {
        self.sources = Some(s.into_iter().map(Into::into).collect());
        self
    }
    /// Batch size (≥ 1, default 50).
    pub fn batch_size(mut self, n: usize) -> Self {
        self.batch_size = n;
        self
    }
    /// Poll interval (default 5 s).
    pub fn poll_interval(mut self, d: Duration) -> Self {
        self.poll_interval = d;
        self
    }
    /// The group's lease TTL (default 300 s, > handler timeout).
    pub fn lease_ttl(mut self, d: Duration) -> Self {
        self.lease_ttl = d;
        self
    }
    /// Rows per key per fetch (≥ 1, default 16).
    pub fn max_per_key(mut self, n: usize) -> Self {
        self.max_per_key = n;
        self
    }
    /// Handler runs at once (≥ 1, default 16).
    pub fn handler_concurrency(mut self, n: usize) -> Self {
        self.handler_concurrency = n;
        self
    }
    /// Handler timeout (> 0, default 30 s).
    pub fn handler_timeout(mut self, d: Duration) -> Self {
        self.handler_timeout = d;
        self
    }
    /// Backoff of counted failures (R39).
    pub fn backoff(mut self, b: Backoff) -> Self {
        self.backoff = b;
        self
    }
    /// Per-key order (default true, R147).
    pub fn key_order(mut self, on: bool) -> Self {
        self.key_order = on;
        self
    }
    /// What the failure that spends a row's last attempt writes (R191, D41; default
    /// [`OnExhausted::Release`]): with [`OnExhausted::Park`] the row stays pending and holds
    /// its key until an operator redrives or discards it (R192).
    pub fn on_exhausted(mut self, o: OnExhausted) -> Self {
        self.on_exhausted = o;
        self
    }
    /// Adds hooks.
    pub fn hooks(mut self, h: Arc<dyn InboxHooks>) -> Self {
        self.hooks.push(h);
        self
    }
    /// The random source of the backoff.
    pub fn random_source(mut self, r: Box<dyn RandomSource>) -> Self {
        self.rng = Some(r);
        self
    }
    /// The monotonic clock of the lease margin (R153).
    pub fn clock(mut self, c: Arc<dyn RelayClock>) -> Self {
        self.clock = c;
        self
    }

    /// Validates and builds.
    pub fn build(self) -> Result<Processor<B>, ConfigError> {
        let group = ConsumerGroup::new(&self.group)?;
        let worker = match self.worker {
            Some(w) => WorkerId::new(w).map_err(|e| ConfigError::new(e.to_string()))?,
            None => WorkerId::generate(),
        };
        if self.batch_size == 0 {
            return Err(ConfigError::new("batch_size must be at least 1"));
        }
        if self.max_per_key == 0 {
            return Err(ConfigError::new("max_per_key must be at least 1"));
        }
        if self.handler_concurrency == 0 {
            return Err(ConfigError::new("handler_concurrency must be at least 1"));
        }
        if !(1..=MAX_ROWS_PER_TRANSACTION).contains(&self.rows_per_transaction) {
            return Err(ConfigError::new(format!(
                "rows_per_transaction must be between 1 and {MAX_ROWS_PER_TRANSACTION} (R183), got {}; use 1 for one row per transaction",
                self.rows_per_transaction
            )));
        }
        check_timeouts(self.handler_timeout, self.lease_ttl)?;
        Ok(Processor {
            backend: self.backend,
            handler: self.handler,
            config: ProcessorConfig {
                group,
                worker,
                sources: self.sources,
                batch_size: self.batch_size,
                poll_interval: self.poll_interval,
                lease_ttl: self.lease_ttl,
                max_per_key: self.max_per_key,
                handler_concurrency: self.handler_concurrency,
                handler_timeout: self.handler_timeout,
                backoff: self.backoff,
                key_order: self.key_order,
                on_exhausted: self.on_exhausted,
                rows_per_transaction: self.rows_per_transaction,
            },
            hooks: self.hooks,
            rng: Mutex::new(
                self.rng
                    .unwrap_or_else(|| Box::new(SeededRng::from_entropy())),
            ),
            clock: self.clock,
            breaker: Mutex::new(self.breaker.map(Breaker::new)),
        })
    }
}

/// The inbox processor of one group.
pub struct Processor<B: InboxBackend> {
    backend: B,
    handler: Arc<dyn Handler<HandlerTx<B>>>,
    config: ProcessorConfig,
    hooks: Vec<Arc<dyn InboxHooks>>,
    rng: Mutex<Box<dyn RandomSource>>,
    clock: Arc<dyn RelayClock>,
    /// The circuit breaker of handler runs (R158), when configured.
    breaker: Mutex<Option<Breaker>>,
}

impl<B: InboxBackend> std::fmt::Debug for Processor<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Processor")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<B: InboxBackend> Processor<B> {
    /// A builder with the defaults of section 27.
    pub fn builder(
        backend: B,
        group: impl Into<String>,
        handler: Arc<dyn Handler<HandlerTx<B>>>,
    ) -> ProcessorBuilder<B> {
        ProcessorBuilder {
            backend,
            handler,
            group: group.into(),
            worker: None,
            sources: None,
            batch_size: DEFAULT_INBOX_BATCH,
            poll_interval: DEFAULT_INBOX_POLL,
            lease_ttl: DEFAULT_LEASE_TTL,
            max_per_key: DEFAULT_INBOX_MAX_PER_KEY,
            handler_concurrency: DEFAULT_HANDLER_CONCURRENCY,
            handler_timeout: DEFAULT_HANDLER_TIMEOUT,
            backoff: Backoff::default(),
            key_order: true,
            hooks: Vec::new(),
            rng: None,
            clock: Arc::new(TokioClock),
            breaker: None,
            on_exhausted: OnExhausted::Release,
            rows_per_transaction: DEFAULT_ROWS_PER_TRANSACTION,
        }
    }

    fn breaker_allows(&self) -> bool {
        let b = self.breaker.lock().expect("breaker poisoned");
        b.as_ref().is_none_or(|b| b.allows(self.clock.now()))
    }

    /// A failed run (of any class) counts; a completed or skipped one closes the breaker; any
    /// other report (released, lease lost, duplicate, commit failed) leaves it as it is.
    fn breaker_record(&self, report: &RowReport) {
        let mut b = self.breaker.lock().expect("breaker poisoned");
        let Some(b) = b.as_mut() else {
            return;
        };
        if report.is_failure() {
            b.failure(self.clock.now());
        } else if matches!(
            report,
            RowReport::Completed { .. } | RowReport::Skipped { .. }
        ) {
            b.success();
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ProcessorConfig {
        &self.config
    }

    fn request(&self) -> InboxFetchRequest {
        InboxFetchRequest {
            worker: self.config.worker.clone(),
            group: self.config.group.clone(),
            sources: self.config.sources.clone(),
            limit: self.config.batch_size,
            lease_ttl: self.config.lease_ttl,
            max_per_key: self.config.max_per_key,
            key_order: self.config.key_order,
        }
    }

    /// Runs one cycle (see the module docs). An error means the fetch failed; nothing is held.
    pub async fn cycle(
        &self,
        shutdown: &CancellationToken,
    ) -> Result<InboxCycleReport, RepositoryError> {
        let mut report = InboxCycleReport::default();
        if shutdown.is_cancelled() || !self.breaker_allows() {
            return Ok(report);
        }
        let rows = self.backend.fetch_and_lock(&self.request()).await?;
        let fetched_at = self.clock.now();
        report.fetched = rows.iter().map(InboxFetched::id).collect();
        hooks::each(&self.hooks, |h| h.on_fetch(rows.len()));
        // Runs of one key, in fetch order (rows come grouped by key).
        let mut runs: Vec<Vec<InboxFetched>> = Vec::new();
        let mut index: HashMap<(String, String), usize> = HashMap::new();
        for r in rows {
            let k = r.run_key(self.config.key_order);
            match index.get(&k) {
                Some(&i) => runs[i].push(r),
                None => {
                    index.insert(k, runs.len());
                    runs.push(vec![r]);
                }
            }
        }
        let results: Vec<Vec<(Uuid, RowReport)>> = if self.config.rows_per_transaction == 1 {
            futures::stream::iter(runs)
                .map(|run| self.run_key(run, shutdown, fetched_at))
                .buffer_unordered(self.config.handler_concurrency)
                .collect()
                .await
        } else {
            let jobs = batch::plan(runs, self.config.rows_per_transaction);
            let done: Vec<batch::JobResult> = futures::stream::iter(jobs)
                .map(|job| self.run_job(job, shutdown, fetched_at))
                .buffer_unordered(self.config.handler_concurrency)
                .collect()
                .await;
            let mut out = Vec::with_capacity(done.len());
            for d in done {
                report.transactions.extend(d.transactions);
                out.push(d.reports);
            }
            out
        };
        let mut by_id: HashMap<Uuid, RowReport> = results.into_iter().flatten().collect();
        let released: Vec<Uuid> = by_id
            .iter()
            .filter(|(_, r)| **r == RowReport::Released)
            .map(|(i, _)| *i)
            .collect();
        if !released.is_empty()
            && let Err(e) = self
                .backend
                .release_locks(&released, &self.config.worker)
                .await
        {
            tracing::warn!(error = %e, "releasing untouched inbox rows failed; they wait out their lease");
        }
        report.outcomes = report
            .fetched
            .iter()
            .map(|id| (*id, by_id.remove(id).unwrap_or(RowReport::Released)))
            .collect();
        Ok(report)
    }

    async fn run_key(
        &self,
        run: Vec<InboxFetched>,
        shutdown: &CancellationToken,
        fetched_at: tokio::time::Instant,
    ) -> Vec<(Uuid, RowReport)> {
        let mut out = Vec::with_capacity(run.len());
        let mut stop = false;
        for row in run {
            let id = row.id();
            let left = self
                .config
                .lease_ttl
                .saturating_sub(self.clock.now().saturating_duration_since(fetched_at));
            if stop
                || shutdown.is_cancelled()
                || !self.breaker_allows()
                || left < self.config.handler_timeout
            {
                out.push((id, RowReport::Released));
                continue;
            }
            let r = match &row {
                InboxFetched::Row(r) => {
                    let r = self.run_row(id, r.created_at).await;
                    self.breaker_record(&r);
                    r
                }
                // Not a handler run: the breaker does not count it.
                InboxFetched::Undecodable(u) => self.fail_undecodable(u).await,
            };
            stop = !matches!(
                r,
                RowReport::Completed { .. }
                    | RowReport::Skipped { .. }
                    | RowReport::Duplicate { .. }
            );
            out.push((id, r));
        }
        out
    }

    /// Fails a held row that cannot be decoded (R106), in a T_row of its own: a counted failure
    /// with last_error `undecodable row: {reason}` and the backoff's next try, written only while
    /// this worker holds the row (else lease lost, R156), without a handler run. The row hook
    /// sees it without an event type; the terminal-failure hook, which takes the row, is not
    /// called (as the relay does for an undecodable outbox row). Checked by Y-16.
    async fn fail_undecodable(&self, u: &UndecodableInboxRow) -> RowReport {
        tracing::warn!(id = %u.id, reason = %u.reason, "an inbox row cannot be decoded; it fails without a handler run (R106)");
        let error = format!("undecodable row: {}", u.reason);
        let retry = {
            let mut rng = self.rng.lock().expect("rng poisoned");
            policy::backoff_retry(u.attempts_made, &self.config.backoff, rng.as_mut())
        };
        let report = match self.backend.begin().await {
            Err(e) => RowReport::CommitFailed {
                error: e.to_string(),
            },
            Ok(mut tx) => match tx
                .fail_undecodable(
                    u.id,
                    &self.config.worker,
                    &error,
                    retry,
                    self.config.on_exhausted,
                )
                .await
            {
                Ok(Some(w)) => {
                    let report = RowReport::Counted {
                        error: w.last_error.unwrap_or_default(),
                        next_try: w.scheduled_at,
                        terminal: w.status == Status::Failed,
                    };
                    commit(tx, report).await
                }
                Ok(None) => {
                    tx.rollback().await;
                    RowReport::LeaseLost
                }
                Err(e) => {
                    tx.rollback().await;
                    RowReport::CommitFailed {
                        error: e.to_string(),
                    }
                }
            },
        };
        hooks::each(&self.hooks, |h| h.on_row(u.id, None, &report, None));
        report
    }

    /// Runs one row this worker holds in its own transaction T_row (R152): the guard, the
    /// sibling check (R164), the handler run (R181), the outcome write (R154), the commit, then
    /// the hooks (R158). `created_at` is the row's: with the id, the primary key of both
    /// Postgres layouts, by which T_row finds it. Checked by Y-02, Y-11, Y-12, Y-15, G-06.
    pub async fn run_row(&self, id: Uuid, created_at: DateTime<Utc>) -> RowReport {
        let report = self.run_row_inner(id, created_at).await;
        self.row_hooks(id, &report.0, report.1.as_ref(), report.2);
        report.0
    }

    async fn run_row_inner(
        &self,
        id: Uuid,
        created_at: DateTime<Utc>,
    ) -> (RowReport, Option<InboxEvent>, Option<Duration>) {
        let guard = Guard::HeldBy {
            id,
            created_at,
            worker: self.config.worker.clone(),
        };
        let mut tx = match self.backend.begin().await {
            Ok(tx) => tx,
            Err(e) => {
                return (
                    RowReport::CommitFailed {
                        error: e.to_string(),
                    },
                    None,
                    None,
                );
            }
        };
        tx.plan_handler_timeout(self.config.handler_timeout);
        let row = match tx.guard(&guard).await {
            Ok(Some(r)) => r,
            Ok(None) => {
                tx.rollback().await;
                return (RowReport::LeaseLost, None, None);
            }
            Err(e) => {
                tx.rollback().await;
                return (
                    RowReport::CommitFailed {
                        error: e.to_string(),
                    },
                    None,
                    None,
                );
            }
        };
        if self.backend.capabilities().siblings {
            match tx.completed_sibling(&row).await {
                Ok(true) => {
                    let r = match tx.write(id, RowWrite::Complete).await {
                        Ok(_) => {
                            commit(
                                tx,
                                RowReport::Duplicate {
                                    reason: "duplicate_sibling".into(),
                                },
                            )
                            .await
                        }
                        Err(e) => RowReport::CommitFailed {
                            error: e.to_string(),
                        },
                    };
                    return (r, Some(row), None);
                }
                Ok(false) => {}
                Err(e) => {
                    tx.rollback().await;
                    return (
                        RowReport::CommitFailed {
                            error: e.to_string(),
                        },
                        Some(row),
                        None,
                    );
                }
            }
        }
        let span = crate::inbox::spans::handler_span(&row, &self.config.worker);
        let run = {
            let _enter = span.enter();
            drop(_enter);
            match tracing::Instrument::instrument(
                run_handler(
                    &mut tx,
                    self.handler.as_ref(),
                    &row,
                    self.config.handler_timeout,
                ),
                span.clone(),
            )
            .await
            {
                Ok(run) => run,
                Err(e) => {
                    tx.rollback().await;
                    return (
                        RowReport::CommitFailed {
                            error: e.to_string(),
                        },
                        Some(row),
                        None,
                    );
                }
            }
        };
        crate::inbox::spans::record_result(&span, &run.result);
        let write = self.outcome_write(&run.result, &row);
        if !run.usable && !run.result.is_failure() {
            // The run succeeded but T_row broke before its outcome could commit with its
            // writes (a connection lost after the handler returned): the writes are gone with
            // the rollback, so the row must run again, not be completed without them. As a
            // failed commit (Y-11), the row stays leased until its lease ends (Y-21, R119).
            tx.rollback().await;
            return (
                RowReport::CommitFailed {
                    error: "the handler succeeded but its transaction broke before the outcome \
                            was written; its writes were rolled back and the row runs again"
                        .into(),
                },
                Some(row),
                Some(run.duration),
            );
        }
        if !run.usable {
            tx.rollback().await;
            tx = match self.backend.begin().await {
                Ok(tx) => tx,
                Err(e) => {
                    return (
                        RowReport::CommitFailed {
                            error: e.to_string(),
                        },
                        Some(row),
                        Some(run.duration),
                    );
                }
            };
            match tx.guard(&guard).await {
                Ok(Some(_)) => {}
                Ok(None) => {
                    tx.rollback().await;
                    return (RowReport::LeaseLost, Some(row), Some(run.duration));
                }
                Err(e) => {
                    tx.rollback().await;
                    return (
                        RowReport::CommitFailed {
                            error: e.to_string(),
                        },
                        Some(row),
                        Some(run.duration),
                    );
                }
            }
        }
        let written = match tx.write(id, write).await {
            Ok(w) => w,
            Err(e) => {
                tx.rollback().await;
                return (
                    RowReport::CommitFailed {
                        error: e.to_string(),
                    },
                    Some(row),
                    Some(run.duration),
                );
            }
        };
        let report = outcome_report(run.result, &written);
        (commit(tx, report).await, Some(row), Some(run.duration))
    }

    /// The outcome write of a run (R154): a completion for a success or a skip, else the
    /// failure's write by its class and the backoff (R38, R43, R44).
    fn outcome_write(&self, result: &RunResult, row: &InboxEvent) -> RowWrite {
        match result {
            RunResult::Completed { .. } | RunResult::Skipped { .. } => RowWrite::Complete,
            RunResult::Failed(f) => {
                let mut rng = self.rng.lock().expect("rng poisoned");
                policy::record_write(
                    f,
                    row.attempts_made,
                    row.created_at,
                    &self.config.backoff,
                    rng.as_mut(),
                    false,
                    self.config.on_exhausted,
                )
            }
        }
    }

    /// The hooks of one row after its transaction ended (R158): the row hook, and the
    /// terminal-failure hook of a row the outcome made `failed`.
    fn row_hooks(
        &self,
        id: Uuid,
        report: &RowReport,
        row: Option<&InboxEvent>,
        duration: Option<Duration>,
    ) {
        if let Some(before) = row {
            let failed = match report {
                RowReport::Counted {
                    error,
                    next_try,
                    terminal,
                } => Some((true, error, *next_try, *terminal)),
                RowReport::NotCounted { error, next_try } => Some((false, error, *next_try, false)),
                _ => None,
            };
            if let Some((counted, error, next_try, terminal)) = failed {
                let parked = parked_by(counted, terminal, before);
                logs::recorded(&logs::Recorded {
                    by: logs::Recorder::Processor,
                    group: self.config.group.as_str(),
                    row: before,
                    counted,
                    next_try,
                    terminal,
                    parked,
                    error,
                });
                if parked {
                    hooks::each(&self.hooks, |h| h.on_parked(before, error));
                }
            }
        }
        let event_type = row.map(|r| r.event_type.as_str());
        hooks::each(&self.hooks, |h| h.on_row(id, event_type, report, duration));
        if let (
            RowReport::Counted {
                terminal: true,
                error,
                ..
            },
            Some(before),
        ) = (report, row)
        {
            hooks::each(&self.hooks, |h| h.on_terminal_failure(before, error));
        }
    }

    /// Runs cycles until `shutdown` is set (R159): at once after a cycle with a run that did
    /// not fail transient or not counted, else after the poll interval. A fetch that fails
    /// transiently is retried after the poll interval; one that fails in a way retrying cannot
    /// fix, five times in a row, ends the loop with [`ProcessorError::Repository`].
    pub async fn run(&self, shutdown: CancellationToken) -> Result<(), ProcessorError> {
        let mut permanent = 0u32;
        loop {
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let wait = match self.cycle(&shutdown).await {
                Ok(r) => {
                    permanent = 0;
                    let runs: Vec<_> = r.outcomes.iter().filter(|(_, o)| o.was_run()).collect();
                    runs.is_empty() && r.fetched.is_empty()
                        || (!runs.is_empty() && runs.iter().all(|(_, o)| o.failed_uncounted()))
                }
                Err(e) => {
                    if !e.is_transient() {
                        permanent += 1;
                        if permanent >= crate::relay::DEFAULT_MAX_PERMANENT_FAILURES {
                            return Err(ProcessorError::Repository {
                                tries: permanent,
                                source: e,
                            });
                        }
                    }
                    tracing::warn!(error = %e, "inbox fetch failed; retrying after the poll interval");
                    true
                }
            };
            if wait {
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(self.config.poll_interval) => {}
                }
            }
        }
    }
}

/// Why [`Processor::run`] stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ProcessorError {
    /// The fetch failed in a way retrying cannot fix, `tries` times in a row.
    #[error(
        "the inbox processor stopped after {tries} failed fetches in a row: {source}; retrying cannot fix this: check that the inbox table exists (create it with create_inbox_schema, or run the inbox migrations) and that the database user may read and update it"
    )]
    Repository {
        /// Consecutive failed fetches.
        tries: u32,
        /// The last error.
        #[source]
        source: RepositoryError,
    },
}

/// The report of a run whose outcome was written as `written` (R157).
fn outcome_report(result: RunResult, written: &InboxEvent) -> RowReport {
    match result {
        RunResult::Completed { status } => RowReport::Completed { status },
        RunResult::Skipped { reason, .. } => RowReport::Skipped { reason },
        RunResult::Failed(f) => match f.class {
            FailureClass::Counted { .. } => RowReport::Counted {
                error: written.last_error.clone().unwrap_or_default(),
                next_try: written.scheduled_at,
                terminal: written.status == Status::Failed,
            },
            _ => RowReport::NotCounted {
                error: written.last_error.clone().unwrap_or_default(),
                next_try: written.scheduled_at,
            },
        },
    }
}

async fn commit<T: InboxTransaction>(tx: T, report: RowReport) -> RowReport {
    match tx.commit().await {
        Ok(()) => report,
        Err(e) => RowReport::CommitFailed {
            error: e.to_string(),
        },
    }
}

/// Whether a failure written to `before` parked it (R191): a counted failure spending its last
/// attempt that did not make it `failed` (which `on_exhausted = park` is the only way to).
fn parked_by(counted: bool, terminal: bool, before: &InboxEvent) -> bool {
    counted && !terminal && before.attempts_made.saturating_add(1) >= before.max_attempts
}
