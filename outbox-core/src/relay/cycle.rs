//! One cycle (see the relay module docs): the fetch, the runs by key published at once, the
//! decision for the rows not processed, the outcome write and its retry, the observers.

use std::collections::{HashMap, HashSet};
use std::panic::AssertUnwindSafe;
use std::sync::Mutex;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::RepositoryError;
use crate::event::Status;
use crate::ordering::Key;
use crate::repository::{
    DeliveryMode, FetchRequest, Fetched, Outcome, OutcomeKind, OutcomeResult, WrittenOutcome,
};
use crate::step::ObservedOutcome;

use super::Relay;
use super::config::{OUTCOME_RETRY_FIRST_WAIT, OUTCOME_RETRY_MAX_WAIT};
use crate::report::{CycleReport, FailureReport, RowOutcome};

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Stop {
    Unreachable(String),
    Other,
}

#[derive(Default)]
pub(super) struct CycleState {
    pub(super) stop: Option<Stop>,
    pub(super) decided: HashMap<Uuid, (OutcomeKind, Option<Duration>)>,
    pub(super) failed_keys: HashSet<Key>,
    pub(super) completion_order: Vec<Uuid>,
}

impl Relay {
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

        let (outcomes, durations) = decide_rest(&rows, &state);
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

        let (terminal, parked) = record_outcomes(
            &mut report,
            &rows,
            &outcomes,
            &written,
            &durations,
            &state.completion_order,
        );
        report.breaker_open = self.breaker_is_open();

        if !report.commit_failed {
            self.observe(&report, &rows, &terminal, &parked).await;
        }
        Ok(report)
    }

    /// The observers of the pipeline steps, after the outcome commit (R68, R83): each row's
    /// outcome, then each terminal failure, then each park (R193: a park is logged at error and
    /// calls `on_parked`, never `on_terminal_failure`).
    async fn observe(
        &self,
        report: &CycleReport,
        rows: &[Fetched],
        terminal: &[(Uuid, String)],
        parked: &[(Uuid, String)],
    ) {
        let by_id: HashMap<Uuid, &Fetched> = rows.iter().map(|r| (r.id(), r)).collect();
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
        for (id, error) in terminal {
            if let Some(event) = by_id.get(id).and_then(|f| f.row()) {
                for s in &self.steps {
                    guard_hook("on_terminal_failure", s.on_terminal_failure(event, error)).await;
                }
            }
        }
        for (id, error) in parked {
            if let Some(event) = by_id.get(id).and_then(|f| f.row()) {
                for s in &self.steps {
                    guard_hook("on_parked", s.on_parked(event, error)).await;
                }
            }
        }
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
}

/// The outcome of every fetched row, in fetch order: what its run decided, else (R47, R77)
/// deferred for the first unpublished row of each key that had no failure when the broker
/// was found unreachable, released otherwise; and the publish durations.
fn decide_rest(rows: &[Fetched], state: &CycleState) -> (Vec<Outcome>, HashMap<Uuid, Duration>) {
    let mut outcomes = Vec::with_capacity(rows.len());
    let mut durations = HashMap::new();
    let mut deferred_keys = HashSet::new();
    for r in rows {
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
                    if !state.failed_keys.contains(&r.key()) && deferred_keys.insert(r.key()) =>
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
    (outcomes, durations)
}

/// Rows with the error that ended them (terminal failures, parks).
type RowErrors = Vec<(Uuid, String)>;

/// Fills the report from the outcomes and what the write reported per row (R58): the lists by
/// kind, completions in publish order, every row's outcome in fetch order. Returns the rows
/// that became `failed`, with their error, for the terminal-failure observers, and the rows
/// that were parked (R191: still `pending`, attempts_made at max_attempts), logged at error
/// here, for the `on_parked` observers.
fn record_outcomes(
    report: &mut CycleReport,
    rows: &[Fetched],
    outcomes: &[Outcome],
    written: &HashMap<Uuid, OutcomeResult>,
    durations: &HashMap<Uuid, Duration>,
    completion_order: &[Uuid],
) -> (RowErrors, RowErrors) {
    let max_attempts: HashMap<Uuid, i32> = rows
        .iter()
        .filter_map(Fetched::row)
        .map(|e| (e.id, e.max_attempts))
        .collect();
    let mut parked: Vec<(Uuid, String)> = Vec::new();
    let mut order: Vec<Uuid> = completion_order.to_vec();
    let completed_set: HashSet<Uuid> = order.iter().copied().collect();
    order.extend(
        rows.iter()
            .map(Fetched::id)
            .filter(|id| !completed_set.contains(id)),
    );
    let mut terminal: Vec<(Uuid, String)> = Vec::new();
    let mut row_outcomes: HashMap<Uuid, RowOutcome> = HashMap::new();
    for o in outcomes {
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
                    if let Some(OutcomeResult::Applied {
                        status,
                        attempts_made,
                        ..
                    }) = res
                        && max_attempts.get(&o.id).is_some_and(|&max| {
                            crate::repository::is_parked(*status, *attempts_made, max)
                        })
                    {
                        tracing::error!(
                            id = %o.id,
                            attempts_made,
                            error = %error,
                            "outbox row parked: its key waits behind it; fix the cause, then \
                             redrive or discard it with `outbox-relay redrive|discard`"
                        );
                        parked.push((o.id, error.clone()));
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
    (terminal, parked)
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

async fn guard_hook(name: &'static str, f: impl std::future::Future<Output = ()>) {
    if AssertUnwindSafe(f).catch_unwind().await.is_err() {
        tracing::error!(
            hook = name,
            "a pipeline step panicked in an observer; ignored"
        );
    }
}
