//! Processor transactions of several rows (R189, R186's savepoint form): the rows of one fetch
//! in transactions T_b of at most `rows_per_transaction` rows, each holding whole keys.
//!
//! One T_b, in this order: R152's guard of all its rows at once
//! ([`InboxTransaction::guard_held`], `FOR UPDATE SKIP LOCKED`; a row that fails it is lease
//! lost alone); on a table that can hold siblings the dedup advisory locks of all its rows in
//! hash order ([`InboxTransaction::lock_dedup_keys`]); then per row in fetch order: the
//! shutdown signal, the breaker and R153's lease margin (the batch's elapsed time counted, since
//! the margin runs from the fetch), R164's sibling check, the run with a savepoint of its own
//! ([`run_handler`], R181, R186), the outcome write of a failure; the completions of the runs
//! that succeeded or skipped, and of rows whose sibling completed, in one write before the
//! commit ([`InboxTransaction::complete_rows`]). A row behind a row of its key that failed
//! or was not run is released untouched (R151, R77). The commit; then the hooks (R158) and the
//! breaker, which count only outcomes that committed (R190).
//!
//! By the principle of batches.md, anything but an ordinary failed run (a statement of T_b
//! refused, a savepoint that cannot be rolled back, a lost connection, a failed commit) rolls
//! T_b back and hands every row of it again, at once, to the one-row path
//! ([`Processor::run_row`] per row, under R152's guard), whose behaviour the suite proves.
//!
//! A key with a row the fetch could not decode (R106) goes the one-row path whole: such a row
//! is failed alone in a T_row of its own (Y-16). A key with more rows than
//! `rows_per_transaction` (`max_per_key` above it) has transactions of its own, one after the
//! other; a later one is released untouched once an earlier one stopped the key.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use super::{Processor, RowReport, outcome_report};
use crate::inbox::handler::run_handler;
use crate::inbox::hooks::{self, FallbackReason, TransactionReport, TransactionSide};
use crate::inbox::model::InboxEvent;
use crate::inbox::repository::{InboxBackend, InboxFetched, InboxTransaction};

/// What one job of a cycle does, run up to `handler_concurrency` at once.
pub(super) enum Job {
    /// One key on the one-row path (it holds an undecodable row).
    Rows(Vec<InboxFetched>),
    /// Transactions run one after the other; each holds whole keys (or a part of one long
    /// key, the parts in order).
    Batches(Vec<Vec<Vec<InboxEvent>>>),
}

/// What a job did: every row's report, and the rows of each T_b that committed.
pub(super) struct JobResult {
    pub(super) reports: Vec<(Uuid, RowReport)>,
    pub(super) transactions: Vec<Vec<Uuid>>,
}

/// Packs the fetch's keys (in fetch order, each key's rows in write order) into jobs: keys of
/// at most `n` rows are packed whole, in fetch order, into transactions of at most `n` rows; a
/// longer key is cut into transactions of `n` of its own, run in order; a key with an
/// undecodable row goes the one-row path.
pub(super) fn plan(runs: Vec<Vec<InboxFetched>>, n: usize) -> Vec<Job> {
    let mut jobs = Vec::new();
    let mut current: Vec<Vec<InboxEvent>> = Vec::new();
    let mut size = 0;
    for run in runs {
        if run.iter().any(|r| r.row().is_none()) {
            jobs.push(Job::Rows(run));
            continue;
        }
        let rows: Vec<InboxEvent> = run
            .into_iter()
            .filter_map(|r| match r {
                InboxFetched::Row(r) => Some(r),
                InboxFetched::Undecodable(_) => None,
            })
            .collect();
        if rows.len() > n {
            let parts = rows.chunks(n).map(|c| vec![c.to_vec()]).collect();
            jobs.push(Job::Batches(parts));
            continue;
        }
        if size + rows.len() > n {
            jobs.push(Job::Batches(vec![std::mem::take(&mut current)]));
            size = 0;
        }
        size += rows.len();
        current.push(rows);
    }
    if !current.is_empty() {
        jobs.push(Job::Batches(vec![current]));
    }
    jobs
}

/// Whether a row's report lets the rows of its key behind it run (R151).
fn goes_on(r: &RowReport) -> bool {
    matches!(
        r,
        RowReport::Completed { .. } | RowReport::Skipped { .. } | RowReport::Duplicate { .. }
    )
}

/// One row's entry in T_b until the commit: its report, the row as locked, the run's time.
struct Entry {
    id: Uuid,
    report: RowReport,
    row: Option<InboxEvent>,
    duration: Option<Duration>,
}

/// Why T_b could not finish as a batch (batches.md's principle), as R190 counts it.
struct Fallback(FallbackReason);

impl<B: InboxBackend> Processor<B> {
    pub(super) async fn run_job(
        &self,
        job: Job,
        shutdown: &CancellationToken,
        fetched_at: tokio::time::Instant,
    ) -> JobResult {
        let mut out = JobResult {
            reports: Vec::new(),
            transactions: Vec::new(),
        };
        match job {
            Job::Rows(run) => out.reports = self.run_key(run, shutdown, fetched_at).await,
            Job::Batches(parts) => {
                let mut stopped = false;
                for keys in parts {
                    if stopped {
                        out.reports
                            .extend(keys.iter().flatten().map(|r| (r.id, RowReport::Released)));
                        continue;
                    }
                    let (reports, committed) = self.run_batch(keys, shutdown, fetched_at).await;
                    // Parts of one long key: a part that did not end well stops the key.
                    stopped = reports.last().is_some_and(|(_, r)| !goes_on(r));
                    if let Some(ids) = committed {
                        out.transactions.push(ids);
                    }
                    out.reports.extend(reports);
                }
            }
        }
        out
    }

    /// One T_b over `keys` (see the module docs): every row's report and, when T_b committed,
    /// its rows.
    async fn run_batch(
        &self,
        keys: Vec<Vec<InboxEvent>>,
        shutdown: &CancellationToken,
        fetched_at: tokio::time::Instant,
    ) -> (Vec<(Uuid, RowReport)>, Option<Vec<Uuid>>) {
        let started = tokio::time::Instant::now();
        let rows = keys.iter().map(Vec::len).sum::<usize>();
        let result = self.try_batch(&keys, shutdown, fetched_at).await;
        // R190: every T_b, committed or fallen back.
        let t = TransactionReport {
            side: TransactionSide::Processor,
            messages: rows,
            elapsed: started.elapsed(),
            fallback: result.as_ref().err().map(|f| f.0),
        };
        hooks::each(&self.hooks, |h| h.on_transaction(&t));
        match result {
            Ok((entries, ids)) => {
                let mut out = Vec::with_capacity(entries.len());
                for e in entries {
                    if e.row.is_some() || e.report == RowReport::LeaseLost {
                        self.row_hooks(e.id, &e.report, e.row.as_ref(), e.duration);
                    }
                    if e.row.is_some() && e.duration.is_some() {
                        self.breaker_record(&e.report);
                    }
                    out.push((e.id, e.report));
                }
                (out, Some(ids))
            }
            Err(Fallback(_)) => {
                // Every row again, at once, each in a T_row of its own under R152's guard;
                // the keys one after the other, each key's rows in order (run_key).
                let mut out = Vec::new();
                for key in keys {
                    let run = key.into_iter().map(InboxFetched::Row).collect();
                    out.extend(self.run_key(run, shutdown, fetched_at).await);
                }
                (out, None)
            }
        }
    }

    async fn try_batch(
        &self,
        keys: &[Vec<InboxEvent>],
        shutdown: &CancellationToken,
        fetched_at: tokio::time::Instant,
    ) -> Result<(Vec<Entry>, Vec<Uuid>), Fallback> {
        let worker = &self.config.worker;
        let mut tx = self
            .backend
            .begin()
            .await
            .map_err(|e| fallback("begin", &e))?;
        tx.plan_handler_timeout(self.config.handler_timeout);
        let pks: Vec<_> = keys
            .iter()
            .flatten()
            .map(|r| (r.id, r.created_at))
            .collect();
        let held = match tx.guard_held(&pks, worker).await {
            Ok(h) => h,
            Err(e) => return Err(rolled_back(tx, "guard", &e).await),
        };
        let mut held: HashMap<Uuid, InboxEvent> =
            held.into_iter().flatten().map(|r| (r.id, r)).collect();
        let siblings = self.backend.capabilities().siblings;
        if siblings {
            let dedup: Vec<(String, String)> = held
                .values()
                .map(|r| (r.message_id.clone(), r.consumer_group.clone()))
                .collect();
            if let Err(e) = tx.lock_dedup_keys(&dedup).await {
                return Err(rolled_back(tx, "dedup locks", &e).await);
            }
        }
        let mut entries = Vec::with_capacity(pks.len());
        // The rows to complete, in one write before the commit (R154, R189), and their dedup
        // keys.
        let mut completions: Vec<Uuid> = Vec::new();
        let mut done: HashSet<(String, String)> = HashSet::new();
        for key in keys {
            let mut stop = false;
            for r in key {
                let id = r.id;
                let left = self
                    .config
                    .lease_ttl
                    .saturating_sub(self.clock.now().saturating_duration_since(fetched_at));
                if stop
                    || shutdown.is_cancelled()
                    || !self.breaker_allows()
                    || left < self.config.handler_timeout
                {
                    entries.push(Entry {
                        id,
                        report: RowReport::Released,
                        row: None,
                        duration: None,
                    });
                    continue;
                }
                let Some(row) = held.remove(&id) else {
                    // Not locked or not held by this worker: lease lost, this row alone; the
                    // rows behind it are released (R151).
                    entries.push(Entry {
                        id,
                        report: RowReport::LeaseLost,
                        row: None,
                        duration: None,
                    });
                    stop = true;
                    continue;
                };
                let dedup = (row.message_id.clone(), row.consumer_group.clone());
                if siblings {
                    // A sibling completed in this T_b (its completion written at the end) or
                    // before it (R164).
                    let sibling = if done.contains(&dedup) {
                        Ok(true)
                    } else {
                        tx.completed_sibling(&row).await
                    };
                    match sibling {
                        Ok(true) => {
                            completions.push(id);
                            entries.push(Entry {
                                id,
                                report: RowReport::Duplicate {
                                    reason: "duplicate_sibling".into(),
                                },
                                row: Some(row),
                                duration: None,
                            });
                            continue;
                        }
                        Ok(false) => {}
                        Err(e) => return Err(rolled_back(tx, "sibling check", &e).await),
                    }
                }
                let span = crate::inbox::spans::handler_span(&row, worker);
                let run = match tracing::Instrument::instrument(
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
                    Err(e) => return Err(rolled_back(tx, "savepoint", &e).await),
                };
                crate::inbox::spans::record_result(&span, &run.result);
                if !run.usable {
                    // The savepoint could not be rolled back (or released): T_b is gone.
                    tx.rollback().await;
                    tracing::warn!(
                        "a run left its processor transaction unusable; every row of it goes one per transaction"
                    );
                    return Err(Fallback(FallbackReason::Connection));
                }
                let report = if run.result.is_failure() {
                    let write = self.outcome_write(&run.result, &row);
                    match tx.write(id, write).await {
                        Ok(written) => outcome_report(run.result, &written),
                        Err(e) => return Err(rolled_back(tx, "outcome write", &e).await),
                    }
                } else {
                    // A success or a skip: completed with the others before the commit.
                    completions.push(id);
                    done.insert(dedup);
                    outcome_report(run.result, &row)
                };
                stop = !goes_on(&report);
                entries.push(Entry {
                    id,
                    report,
                    row: Some(row),
                    duration: Some(run.duration),
                });
            }
        }
        if !completions.is_empty()
            && let Err(e) = tx.complete_rows(&completions).await
        {
            return Err(rolled_back(tx, "completions", &e).await);
        }
        if let Err(e) = tx.commit().await {
            return Err(fallback("commit", &e));
        }
        let ids = entries.iter().map(|e| e.id).collect();
        Ok((entries, ids))
    }
}

fn fallback(what: &str, e: &crate::error::RepositoryError) -> Fallback {
    tracing::warn!(error = %e, step = what, "a processor transaction failed; every row of it goes one per transaction (R189)");
    let reason = match e {
        _ if what == "commit" => FallbackReason::Commit,
        crate::error::RepositoryError::Constraint { .. } => FallbackReason::Refused,
        e if crate::inbox::runner::is_deadlock(&e.to_string()) => FallbackReason::Deadlock,
        _ => FallbackReason::Connection,
    };
    Fallback(reason)
}

async fn rolled_back<T: InboxTransaction>(
    tx: T,
    what: &str,
    e: &crate::error::RepositoryError,
) -> Fallback {
    tx.rollback().await;
    fallback(what, e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inbox::model::NewInboxEvent;

    fn row(key: &str, n: usize) -> InboxFetched {
        let e = NewInboxEvent::builder()
            .event_type("t")
            .message_id(format!("{key}-{n}"))
            .consumer_group("g")
            .source("s")
            .partition_key(key)
            .payload_json(serde_json::json!({"n": n}))
            .build()
            .unwrap();
        InboxFetched::Row(e.into_row(chrono::Utc::now()))
    }

    fn key(k: &str, n: usize) -> Vec<InboxFetched> {
        (0..n).map(|i| row(k, i)).collect()
    }

    fn shape(jobs: &[Job]) -> Vec<Vec<Vec<usize>>> {
        jobs.iter()
            .map(|j| match j {
                Job::Rows(r) => vec![vec![r.len()]],
                Job::Batches(b) => b.iter().map(|t| t.iter().map(Vec::len).collect()).collect(),
            })
            .collect()
    }

    struct Noop;

    #[async_trait::async_trait]
    impl crate::inbox::Handler<crate::inbox::memory::MemInboxTx> for Noop {
        async fn handle(
            &self,
            _row: &InboxEvent,
            _tx: &mut crate::inbox::memory::MemInboxTx,
        ) -> Result<crate::inbox::HandlerOutcome, crate::inbox::HandlerError> {
            Ok(crate::inbox::HandlerOutcome::completed())
        }
    }

    #[test]
    fn rows_per_transaction_is_1_to_64_default_16() {
        let inbox = crate::inbox::memory::InMemoryInbox::new(std::sync::Arc::new(
            crate::clock::SystemClock,
        ));
        let b = || Processor::builder(inbox.clone(), "g", std::sync::Arc::new(Noop));
        assert_eq!(b().build().unwrap().config().rows_per_transaction(), 16);
        for n in [1, 64] {
            let p = b().rows_per_transaction(n).build().unwrap();
            assert_eq!(p.config().rows_per_transaction(), n);
        }
        for n in [0, 65] {
            let e = b().rows_per_transaction(n).build().unwrap_err().to_string();
            assert!(e.contains("between 1 and 64"), "{e}");
        }
    }

    #[test]
    fn keys_are_packed_whole_in_fetch_order() {
        let jobs = plan(
            vec![key("a", 10), key("b", 5), key("c", 2), key("d", 1)],
            16,
        );
        assert_eq!(shape(&jobs), vec![vec![vec![10, 5]], vec![vec![2, 1]]]);
    }

    #[test]
    fn a_long_key_has_transactions_of_its_own() {
        let jobs = plan(vec![key("a", 3), key("b", 9), key("c", 1)], 4);
        assert_eq!(
            shape(&jobs),
            vec![vec![vec![4], vec![4], vec![1]], vec![vec![3, 1]]]
        );
    }
}
