//! One transaction per batch of deliveries (batches.md: R184 to R188), written once over the
//! [`InboxTransaction`] primitives for every backend.
//!
//! A batch is the valid deliveries the loop had ready for a free transaction (R184; the loop,
//! [`super::run_loop`], forms them). [`Runner::handle_batch`] opens one transaction T and in it:
//!
//! 1. with key order on, the key locks of the batch's distinct inbox keys in ascending order of
//!    the 64-bit hash that names each lock ([`InboxTransaction::lock_keys`]);
//! 2. the landing of every distinct dedup key in one call, in ascending order of
//!    (message_id, consumer_group) ([`InboxTransaction::land`]);
//! 3. row by row, in delivery order, R116's decision: a key that a batch row before it still
//!    holds (recorded, rewound, not run) makes the row `landed`; otherwise the row lock, the
//!    row's state and the probe of earlier rows of its key, as T sees the table (a batch row
//!    that completed, was skipped or `failed` no longer holds its key); then the run, under a
//!    savepoint of its own (the *savepoint per run* form of R186: a failed run is undone
//!    alone), and its outcome write;
//! 4. one commit; then the deliveries are ended: committed (R131), or rewound where R127 says so.
//!
//! Whatever else goes wrong (a landing or an outcome refused, a deadlock, a lost connection, a
//! savepoint that cannot be rolled back, a failed commit) rolls T back and hands every delivery
//! of the batch to the one-message path of Part II ([`Runner::handle_keeping`]), at once and in
//! delivery order: batches.md's principle. Under at_most_once nothing runs again (R186): each
//! delivery, committed before T, is `persist_failed`.
//!
//! R187: no run starts in T once one handler timeout has passed since its first run started;
//! the rows not run stay landed and their deliveries go, still held, into the next transaction.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use crate::error::RepositoryError;
use crate::event::Status;
use crate::inbox::handler::{RunResult, run_handler};
use crate::inbox::hooks::{self, FallbackReason, TransactionReport, TransactionSide};
use crate::inbox::logs;
use crate::inbox::model::{InboxKey, NewInboxEvent};
use crate::inbox::ordering as inbox_order;
use crate::inbox::policy::{self, OnFailure, RewindDecision};
use crate::inbox::repository::{InboxBackend, InboxTransaction, RowLock, RowWrite};
use crate::inbox::subscription::InboxDelivery;

use super::{DeliveryOutcome, DeliveryResult, Runner};

/// What a batch did to one delivery: its result, and whether the loop keeps it (a persistence
/// error of the one-message path, [`super::run_loop`]'s module docs).
pub(crate) type Ended = (DeliveryResult, bool);

/// Why T could not finish as a batch, and the error.
struct Fallback(FallbackReason, RepositoryError);

/// Classifies a failure of T (batches.md's principle, R190's reasons).
fn classify(e: RepositoryError) -> Fallback {
    let reason = match &e {
        RepositoryError::Constraint { .. } | RepositoryError::Undecodable { .. } => {
            FallbackReason::Refused
        }
        e if is_deadlock(&e.to_string()) => FallbackReason::Deadlock,
        _ => FallbackReason::Connection,
    };
    Fallback(reason, e)
}

/// Whether an error's text is a deadlock or a serialization failure (SQLSTATE 40P01, 40001): a
/// handler's statement that hit one inside a batch is no handler failure (R186).
pub(crate) fn is_deadlock(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("deadlock detected")
        || t.contains("40p01")
        || t.contains("40001")
        || t.contains("could not serialize access")
}

/// One delivery of T.
struct Item<'d> {
    d: &'d InboxDelivery,
    event: NewInboxEvent,
    result: DeliveryResult,
    /// The delivery is rewound after T commits (R127).
    rewind: Option<Duration>,
    /// Not run by R187: carried into the next transaction, still held.
    carried: bool,
    /// The row before a failure that made it `failed`, and the failure (R158's hook).
    terminal: Option<(crate::inbox::model::InboxEvent, String)>,
    /// A failed run's text and, when it was written to the row, what R197's line needs:
    /// logged once T committed.
    failure: Option<(String, Option<Written>)>,
}

/// A failure written to a row in T: the row before the write, whether the write spent an
/// attempt, and whether it parked the row (R191).
struct Written {
    before: crate::inbox::model::InboxEvent,
    counted: bool,
    parked: bool,
}

impl<B: InboxBackend> Runner<B> {
    /// Handles a batch of deliveries of free keys to their ends (module docs); the results come
    /// in delivery order. A batch of one is Part II's path.
    pub(crate) async fn handle_batch(&self, ds: &[InboxDelivery]) -> Vec<Ended> {
        let mut out: Vec<Option<Ended>> = vec![None; ds.len()];
        let mut todo: Vec<(usize, NewInboxEvent)> = Vec::with_capacity(ds.len());
        let at_most_once = self.config.policy.at_most_once;
        for (i, d) in ds.iter().enumerate() {
            match self.decode(d) {
                // R184: an invalid delivery never enters a batch (R140).
                Err(inv) => {
                    let r = self.invalid(d, inv).await;
                    self.after(&r);
                    out[i] = Some((r, false));
                }
                Ok(event) if at_most_once => {
                    // R129, R186: only deliveries whose commit the broker confirmed enter T.
                    let mut r = DeliveryResult::new(DeliveryOutcome::Landed);
                    self.commit_delivery(d, &mut r).await;
                    if r.committed {
                        todo.push((i, event));
                    } else {
                        r.message_id = Some(event.message_id().to_owned());
                        r.outcome = DeliveryOutcome::Rewound;
                        r.error = Some(
                            "the commit before handling failed (at_most_once); the message was \
                             not handled"
                                .into(),
                        );
                        self.after(&r);
                        out[i] = Some((r, false));
                    }
                }
                Ok(event) => todo.push((i, event)),
            }
        }
        let mut carried_round = false;
        while !todo.is_empty() {
            if todo.len() == 1 && !at_most_once {
                let (i, _) = todo.remove(0);
                let started = tokio::time::Instant::now();
                let r = self.handle_keeping(&ds[i]).await;
                self.report(1, started.elapsed(), None);
                let kept = kept(&r);
                out[i] = Some((r, kept));
                break;
            }
            let started = tokio::time::Instant::now();
            let items: Vec<Item<'_>> = todo
                .iter()
                .map(|(i, e)| Item {
                    d: &ds[*i],
                    event: e.clone(),
                    result: DeliveryResult::new(DeliveryOutcome::Landed),
                    rewind: None,
                    carried: carried_round,
                    terminal: None,
                    failure: None,
                })
                .collect();
            match self.transact_batch(items).await {
                Ok(items) => {
                    self.report(todo.len(), started.elapsed(), None);
                    let mut carried = Vec::new();
                    for ((i, e), mut it) in todo.drain(..).zip(items) {
                        if it.carried {
                            carried.push((i, e));
                            continue;
                        }
                        self.end(&mut it).await;
                        self.after(&it.result);
                        out[i] = Some((it.result, false));
                    }
                    todo = carried;
                    carried_round = true;
                }
                Err(Fallback(reason, e)) => {
                    tracing::warn!(error = %e, reason = reason.as_str(), messages = todo.len(),
                        "a batch transaction failed; its messages go one per transaction");
                    self.report(todo.len(), started.elapsed(), Some(reason));
                    self.fall_back(ds, std::mem::take(&mut todo), &e, &mut out)
                        .await;
                }
            }
        }
        out.into_iter()
            .map(|e| e.expect("every delivery of a batch ends"))
            .collect()
    }

    /// Batches.md's principle: every message of the rolled-back batch goes the one-message
    /// path, in delivery order; under at_most_once nothing runs again (R186). Once one of them
    /// meets a persistence error the rest are kept untried, for the loop's wait (R132).
    async fn fall_back(
        &self,
        ds: &[InboxDelivery],
        todo: Vec<(usize, NewInboxEvent)>,
        cause: &RepositoryError,
        out: &mut [Option<Ended>],
    ) {
        let mut stalled = false;
        for (i, event) in todo {
            if self.config.policy.at_most_once || stalled {
                let mut r = DeliveryResult::new(DeliveryOutcome::PersistFailed);
                r.message_id = Some(event.message_id().to_owned());
                r.event_type = Some(event.event_type().to_owned());
                r.error = Some(cause.to_string());
                if self.config.policy.at_most_once {
                    r.committed = true;
                    self.after(&r);
                    out[i] = Some((r, false));
                } else {
                    out[i] = Some((r, true));
                }
                continue;
            }
            let started = tokio::time::Instant::now();
            let r = self.handle_keeping(&ds[i]).await;
            self.report(1, started.elapsed(), None);
            let k = kept(&r);
            stalled = k;
            out[i] = Some((r, k));
        }
    }

    fn report(&self, messages: usize, elapsed: Duration, fallback: Option<FallbackReason>) {
        let t = TransactionReport {
            side: TransactionSide::Runner,
            messages,
            elapsed,
            fallback,
        };
        hooks::each(&self.hooks, |h| h.on_transaction(&t));
    }

    /// Ends a delivery after T committed: a rewind (R127), or the commit (R131); under
    /// at_most_once it was committed before T.
    async fn end(&self, it: &mut Item<'_>) {
        if let Some(delay) = it.rewind {
            if let Some((error, _)) = &it.failure {
                logs::rewound(
                    self.config.group.as_str(),
                    &it.event,
                    it.d.delivery_number,
                    delay,
                    error,
                );
            }
            self.rewind(it.d, delay, &mut it.result).await;
        } else if self.config.policy.at_most_once {
            it.result.committed = true;
        } else {
            self.commit_delivery(it.d, &mut it.result).await;
        }
    }

    /// T of a batch (module docs). Every error is the fallback's; T is rolled back by its drop.
    async fn transact_batch<'d>(
        &self,
        mut items: Vec<Item<'d>>,
    ) -> Result<Vec<Item<'d>>, Fallback> {
        let mut tx = self.backend.begin().await.map_err(classify)?;
        // Step 1: the key locks, in hash order.
        if self.config.key_order {
            let mut keys: Vec<InboxKey> = Vec::new();
            for it in &items {
                if let Some(k) = it.event.key()
                    && !keys.contains(&k)
                {
                    keys.push(k);
                }
            }
            if !keys.is_empty() {
                tx.lock_keys(&keys).await.map_err(classify)?;
            }
        }
        // Step 2: one landing call for the distinct dedup keys.
        let mut dedup: Vec<(String, String)> = Vec::new();
        let mut events: Vec<NewInboxEvent> = Vec::new();
        let mut first_of: HashMap<(String, String), usize> = HashMap::new();
        for (n, it) in items.iter().enumerate() {
            let k = dedup_key(&it.event);
            if !first_of.contains_key(&k) {
                first_of.insert(k.clone(), n);
                dedup.push(k);
                events.push(it.event.clone());
            }
        }
        // In delivery order: the stores give each landing its own write time (created_at,
        // R105), so landing order is the rows' order per key. Two batches that share a dedup
        // key share its inbox key, whose lock (step 1) orders them before either lands.
        let landed = tx.land(events).await.map_err(classify)?;
        let rows: HashMap<(String, String), _> = dedup.into_iter().zip(landed).collect();
        // Step 3: row by row, in delivery order.
        let key_order = self.config.key_order;
        let mut held: HashSet<InboxKey> = HashSet::new();
        let mut first_run: Option<tokio::time::Instant> = None;
        // Per dedup key, the outcome of its first delivery in T.
        let mut decided: HashMap<(String, String), DeliveryOutcome> = HashMap::new();
        let handler = self.handler.clone();
        let mut out_of_time = false;
        for n in 0..items.len() {
            if out_of_time {
                // R187: the rest waits, landed, for the next transaction.
                items[n].carried = true;
                continue;
            }
            let key = items[n].event.key().filter(|_| key_order);
            let dk = dedup_key(&items[n].event);
            let l = rows
                .get(&dk)
                .expect("every dedup key of the batch landed")
                .clone();
            let first_rewound = items[first_of[&dk]].rewind.is_some();
            // A row an earlier transaction of this batch landed and left untouched (R187's
            // carried rows) is due at its own created_at, as one this T inserted.
            let fresh = (l.inserted && first_of[&dk] == n) || items[n].carried;
            items[n].carried = false;
            let message_id = items[n].event.message_id().to_owned();
            let r = &mut items[n].result;
            r.message_id = Some(message_id);
            r.row_id = Some(l.row.id);
            r.event_type = Some(l.row.event_type.clone());
            let hold = |held: &mut HashSet<InboxKey>| {
                if let Some(k) = &key {
                    held.insert(k.clone());
                }
            };
            if let Some(prev) = decided.get(&dk) {
                // R184: a second delivery of one message in the batch.
                r.outcome = match prev {
                    DeliveryOutcome::Completed
                    | DeliveryOutcome::Skipped
                    | DeliveryOutcome::Duplicate => DeliveryOutcome::Duplicate,
                    _ => DeliveryOutcome::Landed,
                };
                if first_rewound {
                    r.row_id = None;
                }
                continue;
            }
            let inserted = l.inserted && first_of[&dk] == n;
            if key.as_ref().is_some_and(|k| held.contains(k)) {
                // A batch row before it still holds its key (R145): landed, not run.
                decided.insert(dk, DeliveryOutcome::Landed);
                continue;
            }
            let row = match tx.lock_row(l.row.id).await.map_err(classify)? {
                RowLock::Locked(row) => row,
                RowLock::Busy | RowLock::Missing => {
                    hold(&mut held);
                    decided.insert(dk, DeliveryOutcome::Landed);
                    continue;
                }
            };
            if matches!(row.status, Status::Completed | Status::Failed) {
                r.outcome = DeliveryOutcome::Duplicate;
                decided.insert(dk, DeliveryOutcome::Duplicate);
                continue;
            }
            let Some(handler) = handler.clone() else {
                self.warn_unserved(&row);
                hold(&mut held);
                decided.insert(dk, DeliveryOutcome::Landed);
                continue;
            };
            let untouched = row.attempts_made == 0
                && row.locked_at.is_none()
                && row.last_error.is_none()
                && row.scheduled_at == row.created_at;
            let now = if fresh && untouched {
                None
            } else {
                Some(self.backend.now().await.map_err(classify)?)
            };
            let runnable = inbox_order::fetchable(
                &row,
                now.unwrap_or(row.scheduled_at),
                self.config.lease_ttl,
            ) && !(key.is_some()
                && tx.earlier_in_line(&row).await.map_err(classify)?);
            if !runnable {
                hold(&mut held);
                decided.insert(dk, DeliveryOutcome::Landed);
                continue;
            }
            // R187: no run starts once one handler timeout has passed since the first.
            if first_run.is_some_and(|t| t.elapsed() >= self.config.handler_timeout) {
                items[n].carried = true;
                out_of_time = true;
                continue;
            }
            first_run.get_or_insert_with(tokio::time::Instant::now);
            let mut row = row;
            if row.locked_at.is_some() {
                // An expired lease: taken over (R116, D17).
                row = tx
                    .write(row.id, RowWrite::ClearLease)
                    .await
                    .map_err(classify)?;
            }
            let span = crate::inbox::spans::handler_span(&row, &self.config.worker);
            let run = tracing::Instrument::instrument(
                run_handler(&mut tx, handler.as_ref(), &row, self.config.handler_timeout),
                span.clone(),
            )
            .await
            .map_err(classify)?;
            crate::inbox::spans::record_result(&span, &run.result);
            let r = &mut items[n].result;
            r.handler_duration = Some(run.duration);
            r.handler_status = run.result.status().map(str::to_owned);
            if !run.usable {
                // R186: a savepoint that cannot be rolled back (or released) breaks T.
                return Err(Fallback(
                    FallbackReason::Connection,
                    RepositoryError::Unavailable {
                        message: "a handler run left the batch transaction unusable".into(),
                    },
                ));
            }
            let failure = match &run.result {
                RunResult::Completed { .. } | RunResult::Skipped { .. } => {
                    tx.write(row.id, RowWrite::Complete)
                        .await
                        .map_err(classify)?;
                    r.outcome = if matches!(run.result, RunResult::Completed { .. }) {
                        DeliveryOutcome::Completed
                    } else {
                        DeliveryOutcome::Skipped
                    };
                    decided.insert(dk, r.outcome);
                    continue;
                }
                RunResult::Failed(f) => f.clone(),
            };
            if is_deadlock(&failure.error) {
                // R186: a deadlock or serialization failure is no handler failure.
                return Err(Fallback(
                    FallbackReason::Deadlock,
                    RepositoryError::Unavailable {
                        message: failure.error.clone(),
                    },
                ));
            }
            r.error = Some(failure.error.clone());
            let d = items[n].d;
            let write = if self.config.policy.at_most_once {
                self.record_write(&failure, &row, true)
            } else {
                match self.config.policy.on_failure {
                    OnFailure::Record => self.record_write(&failure, &row, false),
                    OnFailure::Rewind => {
                        let now = match now {
                            Some(now) => now,
                            None => self.backend.now().await.map_err(classify)?,
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
                            RewindDecision::Rewind(_) if !d.ack.rewind_has_room() => {
                                self.record_write(&failure, &row, false)
                            }
                            RewindDecision::Rewind(delay) => {
                                // R185: the row T inserted for it is deleted in T; the
                                // delivery is rewound after T commits.
                                tx.forget_landed(row.id).await.map_err(classify)?;
                                let r = &mut items[n].result;
                                r.outcome = DeliveryOutcome::Rewound;
                                r.row_id = None;
                                items[n].rewind = Some(delay);
                                items[n].failure = Some((failure.error.clone(), None));
                                hold(&mut held);
                                decided.insert(dk, DeliveryOutcome::Rewound);
                                continue;
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
            let w = tx.write(row.id, write).await.map_err(classify)?;
            items[n].failure = Some((
                failure.error.clone(),
                Some(Written {
                    before: row.clone(),
                    counted: w.attempts_made > row.attempts_made,
                    parked: crate::repository::is_parked(w.status, w.attempts_made, w.max_attempts),
                }),
            ));
            let r = &mut items[n].result;
            r.outcome = DeliveryOutcome::Recorded;
            r.next_try = Some(w.scheduled_at);
            r.terminal = w.status == Status::Failed;
            if r.terminal {
                items[n].terminal = Some((row, failure.error));
            } else {
                hold(&mut held);
            }
            decided.insert(dk, DeliveryOutcome::Recorded);
        }
        // Steps 4 and 5: one commit (R188: a failed commit is a persistence error of the
        // batch, and the batch falls back).
        tx.commit()
            .await
            .map_err(|e| Fallback(FallbackReason::Commit, e))?;
        for it in &items {
            self.duplicates
                .record(matches!(it.result.outcome, DeliveryOutcome::Duplicate));
            if let (Some((error, Some(w))), Some(next_try)) = (&it.failure, it.result.next_try) {
                logs::recorded(&logs::Recorded {
                    by: logs::Recorder::Runner,
                    group: self.config.group.as_str(),
                    row: &w.before,
                    counted: w.counted,
                    next_try,
                    terminal: it.result.terminal,
                    parked: w.parked,
                    error,
                });
                if w.parked {
                    hooks::each(&self.hooks, |h| h.on_parked(&w.before, error));
                }
            }
            if let Some((row, err)) = &it.terminal {
                hooks::each(&self.hooks, |h| h.on_terminal_failure(row, err));
            }
        }
        Ok(items)
    }
}

fn dedup_key(e: &NewInboxEvent) -> (String, String) {
    (e.message_id().to_owned(), e.consumer_group().to_owned())
}

/// Whether the loop keeps a delivery the one-message path left unended (a persistence error).
pub(crate) fn kept(r: &DeliveryResult) -> bool {
    r.outcome == DeliveryOutcome::PersistFailed && !r.committed && r.rewind_delay.is_none()
}
