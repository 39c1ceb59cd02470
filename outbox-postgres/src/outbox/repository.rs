//! The repository (relay and operator side), for every driver.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::{OutboxEvent, Status, WorkerId, force_unlock_text};
use txoutbox_core::repository::{
    BlockedKey, Capabilities, Delivery, DeliveryBound, EmptyDelivery, FetchRequest, Fetched,
    OutboxRepository, Outcome, OutcomeResult, ParkedTarget, STALE_LOCK_MAX_BATCHES, StatusCount,
    WrittenOutcome, args, check_discard_reason, discard_text, not_parked,
};
use uuid::Uuid;

use super::delivery::OpenDelivery;
use super::fetch::{self, fetch};
use super::writer::decoded;
use super::{PgConfig, Writer};
use crate::driver::outbox::{AppliedRow, OutboxDriver, OutboxRows};
use crate::driver::{Bind, Connection, finish};
use crate::shared::{self, OutcomeBinds};
use crate::sql::{
    self, BlockedKeysParams, FetchParams, Layout, Statements, TableName, Take, WalkCursor,
};

/// The repository (relay and operator side) of a driver `D`: `PgOutboxRepository` on sqlx,
/// `DieselOutboxRepository` on diesel-async. Cloning shares the pool. Create the schema first.
pub struct Repository<D> {
    pub(crate) driver: D,
    pub(crate) stmts: Arc<Statements>,
    pub(crate) cfg: PgConfig,
    cursor: WalkCursor,
    pub(crate) fail_next_commit: Arc<AtomicBool>,
}

impl<D: Clone> Clone for Repository<D> {
    fn clone(&self) -> Self {
        Self {
            driver: self.driver.clone(),
            stmts: self.stmts.clone(),
            cfg: self.cfg.clone(),
            cursor: self.cursor.clone(),
            fail_next_commit: self.fail_next_commit.clone(),
        }
    }
}

impl<D> std::fmt::Debug for Repository<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Repository")
            .field("table", &self.cfg.table)
            .field("layout", &self.cfg.layout)
            .field("batch_size", &self.cfg.batch_size)
            .finish()
    }
}

impl<D> Repository<D> {
    /// A repository on `pool` (or any value the driver is built from) with these settings.
    pub fn new(pool: impl Into<D>, cfg: PgConfig) -> Self {
        Self {
            driver: pool.into(),
            stmts: Arc::new(Statements::with_layout(&cfg.table, cfg.layout).for_pooler(cfg.pooler)),
            cfg,
            cursor: WalkCursor::default(),
            fail_next_commit: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The driver (its pool).
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.cfg.table
    }

    /// The table's layout.
    pub fn layout(&self) -> Layout {
        self.cfg.layout
    }

    /// The statements in use.
    pub fn statements(&self) -> &Statements {
        &self.stmts
    }

    /// Test hook (cargo feature `test-hooks`, for tests only): the next outcome transaction runs
    /// its statements and then rolls back, and the outcome write returns an error (R57; P-06).
    #[cfg(feature = "test-hooks")]
    pub fn fail_next_outcome_commit(&self) {
        self.fail_next_commit.store(true, Ordering::SeqCst);
    }
}

/// The error of an injected outcome-commit failure ([`Repository::fail_next_outcome_commit`]).
pub(crate) fn injected() -> RepositoryError {
    RepositoryError::Other(
        "injected failure of the outcome commit (fail_next_outcome_commit)".into(),
    )
}

/// Runs the outcome statements (R54) on `c`: `complete` with `b.done`, `fail` with the failed
/// rows, and `release` (when given) with `b.released`; returns what each written row became.
pub(crate) async fn write_outcome_rows<C: OutboxRows + ?Sized>(
    c: &mut C,
    table: &TableName,
    [complete, fail, release]: [Option<&str>; 3],
    b: OutcomeBinds,
    worker: &str,
) -> Result<HashMap<Uuid, OutcomeResult>, RepositoryError> {
    let err = |e| C::map_err(table, e);
    let mut applied: Vec<AppliedRow> = Vec::new();
    if let Some(sql) = complete
        && !b.done.is_empty()
    {
        let binds = vec![Bind::Uuids(b.done), Bind::Text(worker.to_owned())];
        applied.extend(c.applied(sql, binds).await.map_err(err)?);
    }
    if let Some(sql) = fail
        && !b.fail_ids.is_empty()
    {
        let binds = vec![
            Bind::Uuids(b.fail_ids),
            Bind::Bools(b.fail_counted),
            Bind::Texts(b.fail_errors),
            Bind::NullableInt8s(b.fail_after_us),
            Bind::NullableTimestamps(b.fail_at),
            Bind::Text(worker.to_owned()),
            Bind::Bools(b.fail_park),
        ];
        applied.extend(c.applied(sql, binds).await.map_err(err)?);
    }
    if let Some(sql) = release
        && !b.released.is_empty()
    {
        let binds = vec![Bind::Uuids(b.released), Bind::Text(worker.to_owned())];
        applied.extend(c.applied(sql, binds).await.map_err(err)?);
    }
    let mut out = HashMap::with_capacity(applied.len());
    for a in applied {
        let status = a.status.parse::<Status>().map_err(|e| {
            RepositoryError::Other(format!("outcome write of {} returned {e}", a.id))
        })?;
        out.insert(
            a.id,
            OutcomeResult::Applied {
                status,
                attempts_made: a.attempts_made,
                scheduled_at: a.scheduled_at,
            },
        );
    }
    Ok(out)
}

impl<D: OutboxDriver> Repository<D> {
    /// The writer for this repository's table and layout (notification off; see
    /// [`Writer::notify`]).
    pub fn writer(&self) -> D::Writer {
        Writer::from_statements(self.stmts.clone()).into()
    }

    fn err(&self, e: <D::Conn as Connection>::Error) -> RepositoryError {
        <D::Conn as Connection>::map_err(&self.cfg.table, e)
    }

    async fn conn(&self) -> Result<D::Pooled, RepositoryError> {
        self.driver.acquire(&self.cfg.table).await
    }

    /// Runs a statement in autocommit; returns the rows it affected.
    async fn exec(&self, sql: &str, binds: Vec<Bind>) -> Result<u64, RepositoryError> {
        let mut c = self.conn().await?;
        c.execute(sql, binds).await.map_err(|e| self.err(e))
    }

    /// Redrive (`reason` none) or discard of the parked rows `target` selects (R192), in one
    /// transaction: the rows are read and row-locked, then written while still parked.
    async fn operate_parked(
        &self,
        target: &ParkedTarget,
        reason: Option<&str>,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        if let Some(r) = reason {
            check_discard_reason(r)?;
        }
        let mut tx = self.driver.begin(&self.cfg.table).await?;
        let result = self.operate_parked_in(&mut tx, target, reason).await;
        finish::<D, _>(&self.cfg.table, tx, result).await
    }

    async fn operate_parked_in(
        &self,
        c: &mut D::Conn,
        target: &ParkedTarget,
        reason: Option<&str>,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let op = if reason.is_some() {
            "discard"
        } else {
            "redrive"
        };
        let (ids, topics, keys) = target.filters();
        let binds = vec![
            Bind::OptUuids(ids),
            Bind::OptTexts(topics),
            Bind::OptTexts(keys),
        ];
        let rows = c
            .events(&self.stmts.parked_rows, binds)
            .await
            .map_err(|e| self.err(e))?;
        if rows.is_empty()
            && let ParkedTarget::Id(id) = target
        {
            let found = c
                .events(&self.stmts.get, vec![Bind::Uuid(*id)])
                .await
                .map_err(|e| self.err(e))?;
            let state = found.first().map(|r| {
                (
                    r.status.parse().unwrap_or(Status::Failed),
                    r.attempts_made,
                    r.max_attempts,
                )
            });
            return Err(not_parked(*id, op, state));
        }
        let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
        if ids.is_empty() {
            return Ok(ids);
        }
        let binds = match reason {
            None => vec![Bind::Uuids(ids.clone())],
            Some(reason) => {
                let texts = rows
                    .iter()
                    .map(|r| {
                        discard_text(reason, r.last_error.as_deref(), self.cfg.error_max_length)
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                vec![Bind::Uuids(ids.clone()), Bind::Texts(texts)]
            }
        };
        let sql = if reason.is_some() {
            &self.stmts.discard
        } else {
            &self.stmts.redrive
        };
        let written = c.applied(sql, binds).await.map_err(|e| self.err(e))?;
        let written: std::collections::HashSet<Uuid> = written.iter().map(|a| a.id).collect();
        Ok(ids.into_iter().filter(|id| written.contains(id)).collect())
    }

    /// The parked gauges (R193): parked keys and parked rows (keyless rows included).
    pub async fn parked_stats(&self) -> Result<(i64, i64), RepositoryError> {
        let mut c = self.conn().await?;
        let rows = c
            .counts(&self.stmts.parked_stats)
            .await
            .map_err(|e| self.err(e))?;
        let get = |name: &str| rows.iter().find(|r| r.topic == name).map_or(0, |r| r.count);
        Ok((get("keys"), get("rows")))
    }

    async fn write_outcome_binds(
        &self,
        c: &mut D::Conn,
        worker: &WorkerId,
        b: OutcomeBinds,
    ) -> Result<HashMap<Uuid, OutcomeResult>, RepositoryError> {
        let s = &self.stmts;
        let sqls = [
            Some(s.complete.as_str()),
            Some(s.fail.as_str()),
            Some(s.release.as_str()),
        ];
        write_outcome_rows(c, &self.cfg.table, sqls, b, worker.as_str()).await
    }

    async fn write_outcomes_in(
        &self,
        c: &mut D::Conn,
        worker: &WorkerId,
        b: OutcomeBinds,
    ) -> Result<HashMap<Uuid, OutcomeResult>, RepositoryError> {
        let results = self.write_outcome_binds(c, worker, b).await?;
        if self.fail_next_commit.swap(false, Ordering::SeqCst) {
            // The statements ran; the caller rolls all of them back (R57).
            return Err(injected());
        }
        Ok(results)
    }

    async fn release_locks_in(
        &self,
        c: &mut D::Conn,
        ids: &[Uuid],
        worker: &WorkerId,
    ) -> Result<u64, RepositoryError> {
        let binds = vec![
            Bind::Uuids(ids.to_vec()),
            Bind::Text(worker.as_str().to_owned()),
        ];
        let n = c
            .execute(&self.stmts.release_locks, binds)
            .await
            .map_err(|e| self.err(e))?;
        if n != ids.len() as u64 {
            // Roll back: the bulk release changes nothing unless every id was held (R24).
            return Err(RepositoryError::ReleaseMismatch {
                changed: n,
                expected: ids.len() as u64,
            });
        }
        Ok(n)
    }
}

#[async_trait]
impl<D: OutboxDriver> OutboxRepository for Repository<D> {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: D::NAME,
            database_clock: true,
            undecodable_rows: true,
            transaction_delivery: true,
        }
    }

    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        let mut c = self.conn().await?;
        c.now(&self.stmts.now).await.map_err(|e| self.err(e))
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxEvent>, RepositoryError> {
        let mut c = self.conn().await?;
        let rows = c
            .events(&self.stmts.get, vec![Bind::Uuid(id)])
            .await
            .map_err(|e| self.err(e))?;
        rows.into_iter().next().map(decoded).transpose()
    }

    async fn fetch_and_lock(&self, req: &FetchRequest) -> Result<Vec<Fetched>, RepositoryError> {
        req.validate()?;
        let p = FetchParams::new(req);
        // Its own transaction, committed at once (R76).
        let mut tx = self.driver.begin(&self.cfg.table).await?;
        let rows = fetch(&mut *tx, &self.stmts, req.worker.as_str(), &p, &self.cursor)
            .await
            .map_err(|e| self.err(e));
        finish::<D, _>(&self.cfg.table, tx, rows).await
    }

    async fn begin_delivery(
        &self,
        req: &FetchRequest,
        bound: DeliveryBound,
    ) -> Result<(Vec<Fetched>, Box<dyn Delivery>), RepositoryError> {
        req.validate()?;
        let p = FetchParams::new(req);
        let timeout = bound.server_timeout.as_millis().max(1).to_string();
        let table = &self.cfg.table;
        for attempt in 1..=sql::FETCH_ATTEMPTS {
            // The heads statement in autocommit, its own transaction: the window's row locks
            // end with it, so the delivery transaction holds only the rows it takes.
            let mut c = self.conn().await?;
            let ids = fetch::heads(
                &mut *c,
                &self.stmts.fetch_heads_autocommit,
                &p,
                &self.cursor,
            )
            .await
            .map_err(|e| self.err(e))?;
            if ids.is_empty() {
                return Ok((Vec::new(), Box::new(EmptyDelivery)));
            }
            // The delivery transaction (R84) on the same connection: the take, which sets the
            // server's idle bound, is its first statement, and it stays open across the cycle.
            let mut tx = D::begin_on(table, c).await?;
            let taken = fetch::take(
                &mut *tx,
                &self.stmts,
                Take::Transaction,
                req.worker.as_str(),
                &p,
                ids,
                Some(timeout.clone()),
            )
            .await
            .map_err(|e| self.err(e));
            let rows = match taken {
                Ok(rows) => rows,
                Err(e) => return finish::<D, _>(table, tx, Err(e)).await,
            };
            if rows.is_empty() {
                // Nothing held: end the transaction now; another relay took every candidate
                // between the two statements, so look again (a new snapshot), a bounded number
                // of times.
                D::commit(table, tx).await?;
                if attempt == sql::FETCH_ATTEMPTS {
                    break;
                }
                continue;
            }
            let delivery = OpenDelivery {
                tx: Some(tx),
                repo: self.clone(),
                worker: req.worker.clone(),
                fetched: shared::fetched_state(&rows),
            };
            return Ok((rows, Box::new(delivery)));
        }
        Ok((Vec::new(), Box::new(EmptyDelivery)))
    }

    async fn write_outcomes(
        &self,
        worker: &WorkerId,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        // One transaction, one statement per outcome kind (R54). When the outcomes need one
        // statement (every row completed, the common cycle), that statement in autocommit is
        // that one transaction: no BEGIN and COMMIT round trips. The test hook that fails the
        // commit after the statements ran needs the explicit transaction.
        let b = OutcomeBinds::new(outcomes, self.cfg.error_max_length);
        let statements = [
            !b.done.is_empty(),
            !b.fail_ids.is_empty(),
            !b.released.is_empty(),
        ]
        .into_iter()
        .filter(|&needed| needed)
        .count();
        if statements <= 1 && !self.fail_next_commit.load(Ordering::SeqCst) {
            let mut c = self.conn().await?;
            let results = self.write_outcome_binds(&mut c, worker, b).await?;
            return Ok(shared::written_outcomes(outcomes, &results));
        }
        let mut tx = self.driver.begin(&self.cfg.table).await?;
        let results = self.write_outcomes_in(&mut tx, worker, b).await;
        let results = finish::<D, _>(&self.cfg.table, tx, results).await?;
        Ok(shared::written_outcomes(outcomes, &results))
    }

    async fn refresh_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        let binds = vec![Bind::Uuid(id), Bind::Text(worker.as_str().to_owned())];
        Ok(self.exec(&self.stmts.refresh_lock, binds).await? == 1)
    }

    async fn release_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        let binds = vec![Bind::Uuid(id), Bind::Text(worker.as_str().to_owned())];
        Ok(self.exec(&self.stmts.release_lock, binds).await? == 1)
    }

    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError> {
        let mut tx = self.driver.begin(&self.cfg.table).await?;
        let n = self.release_locks_in(&mut tx, ids, worker).await;
        finish::<D, _>(&self.cfg.table, tx, n).await
    }

    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError> {
        args::stale_timeout(timeout)?;
        let batch = self.cfg.batch_size as i64;
        let mut c = self.conn().await?;
        let mut total = 0;
        for _ in 0..STALE_LOCK_MAX_BATCHES {
            let binds = vec![Bind::Int8(sql::micros(timeout)), Bind::Int8(batch)];
            let n = c
                .execute(&self.stmts.release_stale, binds)
                .await
                .map_err(|e| self.err(e))?;
            total += n;
            if n < batch as u64 {
                break;
            }
        }
        Ok(total)
    }

    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError> {
        Ok(self.exec(&self.stmts.requeue, vec![Bind::Uuid(id)]).await? == 1)
    }

    async fn redrive(&self, target: &ParkedTarget) -> Result<Vec<Uuid>, RepositoryError> {
        self.operate_parked(target, None).await
    }

    async fn discard(
        &self,
        target: &ParkedTarget,
        reason: &str,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        self.operate_parked(target, Some(reason)).await
    }

    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError> {
        args::cleanup(retention_days, batch_size)?;
        let binds = vec![
            Bind::Int4(i32::try_from(retention_days).unwrap_or(i32::MAX)),
            Bind::Int8(i64::try_from(batch_size).unwrap_or(i64::MAX)),
        ];
        self.exec(&self.stmts.delete_old_completed, binds).await
    }

    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError> {
        let text = force_unlock_text(reason)?;
        let n = self
            .exec(
                &self.stmts.force_unlock,
                vec![Bind::Uuid(id), Bind::Text(text)],
            )
            .await?;
        if n == 0 {
            return Err(RepositoryError::NotLocked(id));
        }
        Ok(())
    }

    async fn blocked_keys(
        &self,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<BlockedKey>, RepositoryError> {
        let b = BlockedKeysParams::new(lease_ttl, limit);
        let binds = vec![
            Bind::Int8(b.lease_us),
            Bind::Int8(b.limit),
            Bind::Int8(b.candidates),
            Bind::Int8(b.waiting_cap),
        ];
        let mut c = self.conn().await?;
        c.blocked(&self.stmts.blocked_keys, binds)
            .await
            .map_err(|e| self.err(e))
    }

    async fn counts(&self) -> Result<Vec<StatusCount>, RepositoryError> {
        let mut c = self.conn().await?;
        let rows = c
            .counts(&self.stmts.counts)
            .await
            .map_err(|e| self.err(e))?;
        let mut out: Vec<StatusCount> = rows
            .into_iter()
            .filter_map(|r| {
                // A status this library never writes (R2) is not countable as one of the three.
                Some(StatusCount {
                    status: r.status.parse::<Status>().ok()?,
                    topic: r.topic,
                    count: r.count,
                })
            })
            .collect();
        out.sort();
        Ok(out)
    }

    async fn parked_rows(&self) -> Result<u64, RepositoryError> {
        Ok(self.parked_stats().await?.1.max(0) as u64)
    }

    async fn oldest_due_age(&self) -> Result<Option<Duration>, RepositoryError> {
        let mut c = self.conn().await?;
        let us = c
            .age_us(&self.stmts.oldest_due_age)
            .await
            .map_err(|e| self.err(e))?;
        Ok(us.map(|u| Duration::from_micros(u.max(0) as u64)))
    }
}
