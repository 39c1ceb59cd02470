//! The consumer runner (contract R113 to R132, R166, R167, R182): reads a subscription and
//! handles each delivery in one transaction with the handler's own writes.
//!
//! For each delivery ([`Runner::handle_delivery`]):
//!
//! 1. decode and validate (R114, R137 to R141); an invalid delivery is dead-lettered and
//!    terminated before any commit (R140); under at_most_once a valid one is committed first
//!    (R129);
//! 2. in one transaction T (R115, R116): the key lock of its inbox key, the landing (R107 to
//!    R111), the row's lock without waiting; a `completed` or `failed` row makes a `duplicate`,
//!    a row a fetch could not take now makes `landed` (R130), an expired lease is taken over;
//! 3. the handler run after a savepoint (R181), and the outcome by the policy (R125 to R129,
//!    [`crate::inbox::policy`]); T commits, then the delivery is committed (R131) or rewound
//!    (R127, R132);
//! 4. hooks after the commit (R171).
//!
//! [`Runner::run`] (with a cancellation token) is the loop: at most `concurrency` deliveries held, one at a time per inbox
//! key in delivery order (R166), pacing after read and persistence errors (R120), and the
//! shutdown of R167. Its submodule `run_loop` holds it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::backoff::{Backoff, RandomSource};
use crate::error::RepositoryError;
use crate::event::{Status, limits};
use crate::inbox::decode::{DecodeOptions, decode};
use crate::inbox::handler::{Failure, Handler, HandlerRun, RunResult, run_handler};
use crate::inbox::hooks::{self, InboxHooks};
use crate::inbox::logs;
use crate::inbox::model::{InboxEvent, InvalidMessage, NewInboxEvent};
use crate::inbox::ordering as inbox_order;
use crate::inbox::policy::{self, AncestorAckSettings, OnFailure, RewindDecision};
use crate::inbox::processor::{DEFAULT_HANDLER_TIMEOUT, DEFAULT_INBOX_POLL, Processor};
use crate::inbox::repository::{
    Guard, HandlerTx, InboxBackend, InboxTransaction, RowLock, RowWrite,
};
use crate::inbox::subscription::{InboxDelivery, Subscription};
use crate::repository::DEFAULT_LEASE_TTL;

mod batch;
pub(crate) use batch::is_deadlock;
mod builder;
#[cfg(test)]
mod consumer_tests;
pub mod duplicates;
pub mod run_loop;

pub use builder::{RunnerBuilder, RunnerConfig};

/// Default runner concurrency (R166, R183: deliveries held at once).
pub const DEFAULT_RUNNER_CONCURRENCY: usize = 64;
/// Default messages per transaction (R183).
pub const DEFAULT_MESSAGES_PER_TRANSACTION: usize = 16;
/// The most messages one transaction may carry (R183, R186: PostgreSQL's 64 cached
/// subtransaction ids).
pub const MAX_MESSAGES_PER_TRANSACTION: usize = 64;
/// Default commit timeout (R131).
pub const DEFAULT_COMMIT_TIMEOUT: Duration = Duration::from_secs(5);
/// The delay of a persistence or dead-letter rewind (R132, R140).
pub const PERSIST_REWIND: Duration = Duration::from_secs(1);

/// The outcome of one delivery (R122).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeliveryOutcome {
    /// A handler run completed the row.
    Completed,
    /// A handler run skipped it; the row is completed.
    Skipped,
    /// The row is stored or found pending and the handler did not run.
    Landed,
    /// A failure was written to the row (R126).
    Recorded,
    /// Nothing stored; the delivery goes back to the broker (R127).
    Rewound,
    /// The row was completed or failed (R109).
    Duplicate,
    /// Invalid (R139, R140).
    Invalid,
    /// The transaction failed (R132).
    PersistFailed,
}

/// What one delivery did (R122).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryResult {
    /// The message id, once decoded.
    pub message_id: Option<String>,
    /// The row, when one is stored.
    pub row_id: Option<Uuid>,
    /// The outcome.
    pub outcome: DeliveryOutcome,
    /// Whether the delivery was committed (and the broker confirmed it).
    pub committed: bool,
    /// Whether the commit failed or was not confirmed in time (R131).
    pub commit_failed: bool,
    /// The handler's status text.
    pub handler_status: Option<String>,
    /// The error text (failure, invalid reason, persistence cause).
    pub error: Option<String>,
    /// The next try written to the row.
    pub next_try: Option<DateTime<Utc>>,
    /// The rewind delay, when rewound.
    pub rewind_delay: Option<Duration>,
    /// A failure that R126's fresh transaction did not write because the row had changed.
    pub guard_failed: bool,
    /// Whether the row became `failed`.
    pub terminal: bool,
    /// The handler run's duration, when the handler ran.
    pub handler_duration: Option<Duration>,
    /// The row's event type, once decoded.
    pub event_type: Option<String>,
    /// The metric label of an invalid delivery (R139).
    pub invalid_label: Option<&'static str>,
}

impl DeliveryResult {
    fn new(outcome: DeliveryOutcome) -> Self {
        Self {
            message_id: None,
            row_id: None,
            outcome,
            committed: false,
            commit_failed: false,
            handler_status: None,
            error: None,
            next_try: None,
            rewind_delay: None,
            guard_failed: false,
            terminal: false,
            handler_duration: None,
            event_type: None,
            invalid_label: None,
        }
    }
}

/// The consumer runner of one group.
pub struct Runner<B: InboxBackend> {
    backend: B,
    subscription: Arc<dyn Subscription>,
    handler: Option<Arc<dyn Handler<HandlerTx<B>>>>,
    config: RunnerConfig,
    embedded: Option<Arc<Processor<B>>>,
    hooks: Vec<Arc<dyn InboxHooks>>,
    rng: Mutex<Box<dyn RandomSource>>,
    started: AtomicBool,
    stop: CancellationToken,
    warned_sources: Mutex<Vec<String>>,
    duplicates: duplicates::DuplicateShare,
}

impl<B: InboxBackend> std::fmt::Debug for Runner<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Runner")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// A failure of T before its outcome committed (R132).
struct Persist(RepositoryError);

impl From<RepositoryError> for Persist {
    fn from(e: RepositoryError) -> Self {
        Self(e)
    }
}

/// The landed row (a redelivery's stored row) does not decode: R116 does not allow a run, so
/// the runner does not run it and does not rewind the delivery. R106: "the runner leaves such a
/// row to the processor and commits the delivery (R130)"; R130: "when the landed row is
/// `completed` or `failed`, the delivery is a `duplicate`; when it is pending but R116 does not
/// allow a run (…, undecodable, R106), the delivery is `landed`. Either way the row keeps its
/// state and the delivery is committed under every policy." T wrote nothing (the landing
/// inserted nothing), so it is rolled back; the caller commits the delivery. Any other error is
/// a persistence error (R125).
async fn not_run_undecodable<T: InboxTransaction>(
    tx: T,
    e: RepositoryError,
) -> Result<DeliveryResult, Persist> {
    let RepositoryError::Undecodable { id, status, reason } = e else {
        tx.rollback().await;
        return Err(Persist(e));
    };
    tx.rollback().await;
    tracing::warn!(row_id = %id, reason = %reason,
        "a delivery's stored inbox row does not decode; left to the processor, delivery committed");
    let mut r = DeliveryResult::new(match status {
        Some(Status::Completed | Status::Failed) => DeliveryOutcome::Duplicate,
        _ => DeliveryOutcome::Landed,
    });
    r.row_id = Some(id);
    Ok(r)
}

impl<B: InboxBackend> Runner<B> {
    /// A builder with the defaults of section 27 that takes the consumer group and the topics
    /// from `subscription` ([`Subscription::group`], [`Subscription::topics`]), so that they
    /// are given once, in the subscription's config. `subscription` is the subscription itself
    /// or an `Arc` of it.
    pub fn for_subscription(
        backend: B,
        subscription: impl Subscription + 'static,
    ) -> RunnerBuilder<B> {
        Self::new_builder(backend, Arc::new(subscription), None)
    }

    /// A builder with the defaults of section 27, for group `group`. A subscription that names
    /// its group must name this one, or [`RunnerBuilder::build`] refuses;
    /// [`for_subscription`](Self::for_subscription) takes it from the subscription.
    pub fn builder(
        backend: B,
        subscription: Arc<dyn Subscription>,
        group: impl Into<String>,
    ) -> RunnerBuilder<B> {
        Self::new_builder(backend, subscription, Some(group.into()))
    }

    fn new_builder(
        backend: B,
        subscription: Arc<dyn Subscription>,
        group: Option<String>,
    ) -> RunnerBuilder<B> {
        RunnerBuilder {
            backend,
            subscription,
            handler: None,
            group,
            worker: None,
            on_failure: None,
            at_most_once: None,
            ancestor: AncestorAckSettings::default(),
            max_attempts: limits::DEFAULT_MAX_ATTEMPTS as u32,
            handler_timeout: DEFAULT_HANDLER_TIMEOUT,
            backoff: Backoff::default(),
            key_order: true,
            concurrency: DEFAULT_RUNNER_CONCURRENCY,
            messages_per_transaction: DEFAULT_MESSAGES_PER_TRANSACTION,
            lease_ttl: DEFAULT_LEASE_TTL,
            commit_timeout: DEFAULT_COMMIT_TIMEOUT,
            require_message_id: false,
            sources: None,
            topics: None,
            process_stored: None,
            processor_poll: DEFAULT_INBOX_POLL,
            hooks: Vec::new(),
            rng: None,
            breaker: None,
            on_exhausted: crate::repository::OnExhausted::Release,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &RunnerConfig {
        &self.config
    }

    /// The embedded processor (R121), when process_stored is on.
    pub fn embedded_processor(&self) -> Option<&Processor<B>> {
        self.embedded.as_deref()
    }

    /// Reads at most one delivery without waiting and handles it; none when the subscription
    /// had nothing to give.
    pub async fn handle_next(
        &self,
    ) -> Result<Option<DeliveryResult>, crate::inbox::subscription::SubscriptionError> {
        let mut d = self.subscription.next(1, Duration::ZERO).await?;
        match d.pop() {
            Some(d) => Ok(Some(self.handle_delivery(d).await)),
            None => Ok(None),
        }
    }

    /// Decodes a delivery (R114, R137 to R139).
    pub fn decode(&self, d: &InboxDelivery) -> Result<NewInboxEvent, InvalidMessage> {
        decode(
            &d.message,
            &self.config.group,
            DecodeOptions {
                require_message_id: self.config.require_message_id,
                max_attempts: self.config.landing_max_attempts(),
            },
        )
    }

    /// Handles one delivery to its end (see the module docs), then runs the hooks.
    pub async fn handle_delivery(&self, d: InboxDelivery) -> DeliveryResult {
        let result = self.handle_inner(&d, false).await;
        self.after(&result);
        result
    }

    /// [`handle_delivery`](Self::handle_delivery) for the loop: a persistence error does not
    /// rewind the delivery (R132) but leaves it to the caller, which keeps it and tries it again
    /// once the database answers (`run_loop`'s module docs). The result says so:
    /// `persist_failed`, neither committed nor rewound.
    pub(crate) async fn handle_keeping(&self, d: &InboxDelivery) -> DeliveryResult {
        let result = self.handle_inner(d, true).await;
        self.after(&result);
        result
    }

    fn after(&self, result: &DeliveryResult) {
        if result.outcome == DeliveryOutcome::PersistFailed {
            hooks::each(&self.hooks, |h| h.on_persist_failure(result));
        } else {
            hooks::each(&self.hooks, |h| h.on_delivery(result));
        }
    }

    async fn commit_delivery(&self, d: &InboxDelivery, r: &mut DeliveryResult) {
        match tokio::time::timeout(self.config.commit_timeout, d.ack.commit()).await {
            Ok(Ok(())) => r.committed = true,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "inbox commit failed; the broker delivers the message again");
                r.commit_failed = true;
            }
            Err(_) => {
                tracing::warn!("inbox commit was not confirmed within commit_timeout");
                r.commit_failed = true;
            }
        }
    }

    async fn rewind(&self, d: &InboxDelivery, delay: Duration, r: &mut DeliveryResult) {
        r.rewind_delay = Some(delay);
        if let Err(e) = d.ack.rewind(delay).await {
            tracing::warn!(error = %e, "inbox rewind failed; the broker redelivers by its own rules");
        }
    }

    async fn handle_inner(&self, d: &InboxDelivery, keep_on_persist: bool) -> DeliveryResult {
        let event = match self.decode(d) {
            Ok(e) => e,
            Err(inv) => return self.invalid(d, inv).await,
        };
        let at_most_once = self.config.policy.at_most_once;
        let mut pre_committed = DeliveryResult::new(DeliveryOutcome::Landed);
        if at_most_once {
            self.commit_delivery(d, &mut pre_committed).await;
            if !pre_committed.committed {
                let mut r = pre_committed;
                r.message_id = Some(event.message_id().to_owned());
                r.outcome = DeliveryOutcome::Rewound;
                r.error = Some(
                    "the commit before handling failed (at_most_once); the message was not handled"
                        .into(),
                );
                return r;
            }
        }
        loop {
            match self.transact(d, &event).await {
                Ok(mut r) => {
                    self.duplicates
                        .record(matches!(r.outcome, DeliveryOutcome::Duplicate));
                    r.message_id = Some(event.message_id().to_owned());
                    r.event_type
                        .get_or_insert_with(|| event.event_type().to_owned());
                    if at_most_once {
                        r.committed = true;
                    } else if !matches!(r.outcome, DeliveryOutcome::Rewound) {
                        self.commit_delivery(d, &mut r).await;
                    }
                    return r;
                }
                Err(Persist(RepositoryError::Constraint { message })) => {
                    // R132: the database refuses this message (SQLSTATE class 22 or 23);
                    // trying again changes nothing, so it is dead-lettered.
                    let inv = InvalidMessage::new(
                        crate::inbox::model::InvalidLabel::DbRefused,
                        format!("database refused the message: {message}"),
                    );
                    let mut r = self.invalid_copy(d, inv, !at_most_once).await;
                    r.message_id = Some(event.message_id().to_owned());
                    r.committed = at_most_once;
                    return r;
                }
                Err(Persist(e)) => {
                    logs::unlandable(self.config.group.as_str(), &event, &e);
                    let mut r = DeliveryResult::new(DeliveryOutcome::PersistFailed);
                    r.message_id = Some(event.message_id().to_owned());
                    r.event_type = Some(event.event_type().to_owned());
                    r.error = Some(e.to_string());
                    if at_most_once {
                        r.committed = true;
                        return r;
                    }
                    if d.is_last() && !self.stop.is_cancelled() {
                        // R182: never give a last delivery back without a row; try again in
                        // place, each failed try counted.
                        if self.pause_unless_stopped(PERSIST_REWIND).await {
                            self.after(&r);
                            continue;
                        }
                    }
                    if d.is_last() {
                        tracing::error!(message_id = event.message_id(), position = %d.message.position(), error = %e,
                            "a last delivery has no row and is left unended at shutdown");
                        return r;
                    }
                    if keep_on_persist {
                        return r;
                    }
                    let delay = self.capped(PERSIST_REWIND);
                    self.rewind(d, delay, &mut r).await;
                    return r;
                }
            }
        }
    }

    /// Waits `d` unless the runner stops first; true when the wait ran out.
    async fn pause_unless_stopped(&self, d: Duration) -> bool {
        tokio::select! {
            _ = self.stop.cancelled() => false,
            _ = tokio::time::sleep(d) => true,
        }
    }

    fn capped(&self, d: Duration) -> Duration {
        d.min(Duration::from_secs_f64(self.config.backoff.cap_seconds()))
    }

    async fn invalid(&self, d: &InboxDelivery, inv: InvalidMessage) -> DeliveryResult {
        self.invalid_copy(d, inv, true).await
    }

    /// R140: the dead-letter copy, then (with `terminate`) the term; a failed copy rewinds the
    /// delivery 1.0 s, or is tried again in place on a last delivery (R182).
    async fn invalid_copy(
        &self,
        d: &InboxDelivery,
        inv: InvalidMessage,
        terminate: bool,
    ) -> DeliveryResult {
        let reason = inv.to_string();
        let mut r = DeliveryResult::new(DeliveryOutcome::Invalid);
        r.invalid_label = Some(inv.label.as_str());
        r.error = Some(reason.clone());
        loop {
            match d.ack.dead_letter(&reason, self.config.group.as_str()).await {
                Ok(()) if !terminate => return r,
                Ok(()) => {
                    if let Err(e) = d.ack.term(&reason).await {
                        tracing::warn!(error = %e, "terminating an invalid delivery failed");
                    }
                    return r;
                }
                Err(e) if d.is_last() && !self.stop.is_cancelled() => {
                    tracing::warn!(error = %e, "dead-letter copy failed on a last delivery; trying again in 1 s");
                    if !self.pause_unless_stopped(PERSIST_REWIND).await {
                        tracing::error!(position = %d.message.position(), "a last invalid delivery has no dead-letter copy and is left unended at shutdown");
                        return r;
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "dead-letter copy failed; rewinding the delivery");
                    if terminate {
                        self.rewind(d, PERSIST_REWIND, &mut r).await;
                    }
                    return r;
                }
            }
        }
    }

    /// T: key lock, landing, row lock, the run and its outcome, commit (R115, R116).
    async fn transact(
        &self,
        d: &InboxDelivery,
        event: &NewInboxEvent,
    ) -> Result<DeliveryResult, Persist> {
        if self.duplicates.likely()
            && let Some(r) = self.duplicate_probe(event).await
        {
            return Ok(r);
        }
        let mut tx = self.backend.begin().await?;
        if self.handler.is_some() {
            tx.plan_handler_timeout(self.config.handler_timeout);
        }
        let key = event.key().filter(|_| self.config.key_order);
        if let Some(k) = &key {
            tx.lock_key(k).await?;
        }
        let landed = match tx.land(vec![event.clone()]).await {
            Ok(mut l) => l.remove(0),
            Err(e) => return not_run_undecodable(tx, e).await,
        };
        let inserted = landed.inserted;
        let mut r = DeliveryResult::new(DeliveryOutcome::Landed);
        r.row_id = Some(landed.row.id);
        r.event_type = Some(landed.row.event_type.clone());
        let row = match tx.lock_row(landed.row.id).await {
            Ok(RowLock::Locked(row)) => row,
            Ok(RowLock::Busy | RowLock::Missing) => {
                tx.commit().await?;
                return Ok(r);
            }
            Err(e) => return not_run_undecodable(tx, e).await,
        };
        if matches!(row.status, Status::Completed | Status::Failed) {
            tx.commit().await?;
            r.outcome = DeliveryOutcome::Duplicate;
            return Ok(r);
        }
        let Some(handler) = self.handler.clone() else {
            tx.commit().await?;
            self.warn_unserved(&row);
            return Ok(r);
        };
        // A row this T inserted is pending, without attempts or lease, and due at its own
        // created_at (R105), read at the insert: a fetch could take it (R116) by the row alone,
        // at its scheduled_at, without a clock read of its own. Any other row is judged at the
        // backend's now (R72).
        let now = if inserted {
            None
        } else {
            Some(self.backend.now().await?)
        };
        let runnable =
            inbox_order::fetchable(&row, now.unwrap_or(row.scheduled_at), self.config.lease_ttl)
                && !(key.is_some() && tx.earlier_in_line(&row).await?);
        if !runnable {
            tx.commit().await?;
            return Ok(r);
        }
        let mut row = row;
        if row.locked_at.is_some() {
            // An expired lease: taken over (R116, D17).
            row = tx.write(row.id, RowWrite::ClearLease).await?;
        }
        let span = crate::inbox::spans::handler_span(&row, &self.config.worker);
        let run: HandlerRun = tracing::Instrument::instrument(
            run_handler(&mut tx, handler.as_ref(), &row, self.config.handler_timeout),
            span.clone(),
        )
        .await?;
        crate::inbox::spans::record_result(&span, &run.result);
        r.handler_duration = Some(run.duration);
        r.handler_status = run.result.status().map(str::to_owned);
        let failure = match &run.result {
            RunResult::Completed { .. } | RunResult::Skipped { .. } if !run.usable => {
                // The run succeeded but T broke before its outcome could commit with its
                // writes: they are gone with the rollback, so the message is not handled; it
                // goes back as a persistence failure and runs again (F-27, R119).
                tx.rollback().await;
                return Err(Persist(RepositoryError::Unavailable {
                    message: "the handler succeeded but its transaction broke before the \
                              outcome was written; its writes were rolled back"
                        .into(),
                }));
            }
            RunResult::Completed { .. } | RunResult::Skipped { .. } => {
                tx.write(row.id, RowWrite::Complete).await?;
                tx.commit().await?;
                r.outcome = if matches!(run.result, RunResult::Completed { .. }) {
                    DeliveryOutcome::Completed
                } else {
                    DeliveryOutcome::Skipped
                };
                return Ok(r);
            }
            RunResult::Failed(f) => f.clone(),
        };
        r.error = Some(failure.error.clone());
        let write = if self.config.policy.at_most_once {
            self.record_write(&failure, &row, true)
        } else {
            match self.config.policy.on_failure {
                OnFailure::Record => self.record_write(&failure, &row, false),
                OnFailure::Rewind => {
                    let now = match now {
                        Some(now) => now,
                        None => self.backend.now().await?,
                    };
                    let decision = {
                        let mut rng = self.rng.lock().expect("rng poisoned");
                        policy::rewind_decision(
                            &failure,
                            d.delivery_number,
                            row.max_attempts,
                            d.is_last(),
                            inserted,
                            now,
                            &self.config.backoff,
                            rng.as_mut(),
                        )
                    };
                    match decision {
                        // R136: no room for one more waiting rewind: the failure is recorded.
                        RewindDecision::Rewind(_) if !d.ack.rewind_has_room() => {
                            self.record_write(&failure, &row, false)
                        }
                        RewindDecision::Rewind(delay) => {
                            tx.rollback().await;
                            logs::rewound(
                                self.config.group.as_str(),
                                event,
                                d.delivery_number,
                                delay,
                                &failure.error,
                            );
                            r.outcome = DeliveryOutcome::Rewound;
                            r.row_id = None;
                            self.rewind(d, delay, &mut r).await;
                            return Ok(r);
                        }
                        RewindDecision::Record => self.record_write(&failure, &row, false),
                        RewindDecision::Terminal => RowWrite::Terminal {
                            error: failure.error.clone(),
                            exhausted: self.config.on_exhausted,
                        },
                    }
                }
            }
        };
        r.outcome = DeliveryOutcome::Recorded;
        let written = if run.usable {
            let w = tx.write(row.id, write).await?;
            tx.commit().await?;
            Some(w)
        } else {
            tx.rollback().await;
            self.fresh_write(event, &row, inserted, write, &failure)
                .await?
        };
        match written {
            Some(w) => {
                r.next_try = Some(w.scheduled_at);
                r.terminal = w.status == Status::Failed;
                let parked =
                    crate::repository::is_parked(w.status, w.attempts_made, w.max_attempts);
                logs::recorded(&logs::Recorded {
                    by: logs::Recorder::Runner,
                    group: self.config.group.as_str(),
                    row: &row,
                    counted: w.attempts_made > row.attempts_made,
                    next_try: w.scheduled_at,
                    terminal: r.terminal,
                    parked,
                    error: &failure.error,
                });
                if r.terminal {
                    hooks::each(&self.hooks, |h| h.on_terminal_failure(&row, &failure.error));
                }
                if parked {
                    hooks::each(&self.hooks, |h| h.on_parked(&row, &failure.error));
                }
            }
            None => {
                r.guard_failed = true;
                let now_row = self
                    .backend
                    .get_by_message_id(event.message_id(), &self.config.group)
                    .await
                    .ok()
                    .flatten();
                r.row_id = now_row.as_ref().map(|x| x.id);
                r.outcome = match now_row.map(|x| x.status) {
                    Some(Status::Completed | Status::Failed) => DeliveryOutcome::Duplicate,
                    _ => DeliveryOutcome::Landed,
                };
            }
        }
        Ok(r)
    }

    /// The duplicate probe of [`duplicates`]: the dedup key's row read in autocommit; a
    /// `completed` or `failed` one answers the delivery as `duplicate` without T (R109, R130).
    /// None (take T) when the row is pending, missing or cannot be read.
    async fn duplicate_probe(&self, event: &NewInboxEvent) -> Option<DeliveryResult> {
        let row = self
            .backend
            .get_by_message_id(event.message_id(), &self.config.group)
            .await
            .ok()??;
        if !matches!(row.status, Status::Completed | Status::Failed) {
            return None;
        }
        let mut r = DeliveryResult::new(DeliveryOutcome::Duplicate);
        r.row_id = Some(row.id);
        r.event_type = Some(row.event_type);
        Some(r)
    }

    fn record_write(&self, f: &Failure, row: &InboxEvent, at_most_once: bool) -> RowWrite {
        let mut rng = self.rng.lock().expect("rng poisoned");
        policy::record_write(
            f,
            row.attempts_made,
            row.created_at,
            &self.config.backoff,
            rng.as_mut(),
            at_most_once,
            self.config.on_exhausted,
        )
    }

    /// R126's fresh transaction after T became unusable: the same locks, the guard, the write.
    async fn fresh_write(
        &self,
        event: &NewInboxEvent,
        row: &InboxEvent,
        inserted: bool,
        write: RowWrite,
        _failure: &Failure,
    ) -> Result<Option<InboxEvent>, Persist> {
        let mut tx = self.backend.begin().await?;
        if let Some(k) = event.key().filter(|_| self.config.key_order) {
            tx.lock_key(&k).await?;
        }
        let guard = if inserted {
            Guard::Reland(event.clone())
        } else {
            Guard::Unchanged {
                id: row.id,
                created_at: row.created_at,
                attempts_made: row.attempts_made,
                scheduled_at: row.scheduled_at,
                lease_ttl: self.config.lease_ttl,
            }
        };
        match tx.guard(&guard).await? {
            Some(found) => {
                let w = tx.write(found.id, write).await?;
                tx.commit().await?;
                Ok(Some(w))
            }
            None => {
                tx.rollback().await;
                Ok(None)
            }
        }
    }

    fn warn_unserved(&self, row: &InboxEvent) {
        if !self.config.process_stored || self.config.sources.contains(&row.source) {
            return;
        }
        let mut w = self.warned_sources.lock().expect("poisoned");
        if !w.contains(&row.source) {
            w.push(row.source.clone());
            tracing::warn!(source = %row.source, "a landed row's source is not among the runner's sources; another processor must run it");
        }
    }

    /// Lands a last delivery pending without a handler run, in a transaction of its own, and
    /// commits it (R182 at shutdown). Returns the result.
    async fn land_only(&self, d: &InboxDelivery) -> DeliveryResult {
        let event = match self.decode(d) {
            Ok(e) => e,
            Err(inv) => return self.invalid(d, inv).await,
        };
        let mut r = DeliveryResult::new(DeliveryOutcome::Landed);
        r.message_id = Some(event.message_id().to_owned());
        let res: Result<Uuid, RepositoryError> = async {
            let mut tx = self.backend.begin().await?;
            if let Some(k) = event.key().filter(|_| self.config.key_order) {
                tx.lock_key(&k).await?;
            }
            let l = match tx.land(vec![event.clone()]).await {
                Ok(mut l) => l.remove(0),
                // The stored row does not decode: the message has its row, left to the
                // processor (R106, R130), so the delivery is committed as landed.
                Err(RepositoryError::Undecodable { id, .. }) => {
                    tx.rollback().await;
                    return Ok(id);
                }
                Err(e) => return Err(e),
            };
            tx.commit().await?;
            Ok(l.row.id)
        }
        .await;
        match res {
            Ok(id) => {
                r.row_id = Some(id);
                self.commit_delivery(d, &mut r).await;
            }
            Err(e) => {
                r.outcome = DeliveryOutcome::PersistFailed;
                r.error = Some(e.to_string());
                tracing::error!(message_id = event.message_id(), position = %d.message.position(), "a last delivery has no row and is left unended at shutdown");
            }
        }
        r
    }

    /// Marks the runner started (R120); idempotent. The low-level form, with
    /// [`run_until_stopped`](Self::run_until_stopped) and [`stop`](Self::stop):
    /// [`run`](Self::run) with a cancellation token does all three.
    pub fn start(&self) {
        self.started.store(true, Ordering::SeqCst);
    }

    /// Asks the loop to stop (R167); idempotent. The low-level form: cancelling the token given
    /// to [`run`](Self::run) does it.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}
