//! The inbox store, written once over the driver layer ([`crate::driver::Driver`] and the
//! inbox's row shapes [`crate::driver::inbox::InboxRows`]): sqlx and diesel-async run the same
//! flow. [`PgInbox`] is the [`InboxRepository`] and
//! [`InboxBackend`]; [`PgInboxTx`] the runner's T and the processor's T_row, whose handle is
//! the driver's own transaction (R181).
//!
//! The fetch (R149, R150, R85) reads the heads of a window of the group's oldest fetchable rows
//! and the lines after them up to what the batch can take (statements `fetch_heads` and
//! `fetch_runs`), chooses heads and runs by the outbox's own rules ([`txoutbox_core::ordering`]
//! over the inbox view, [`txoutbox_core::inbox::ordering`]), row-locks the chosen run rows without
//! waiting (a row locked elsewhere cuts its run) and stamps the lease, in one short transaction:
//! its work is bounded by the batch, whatever the backlog. When the window hands out fewer heads
//! than the batch while the group has more fetchable rows than the window (a window full of rows
//! queued behind blocked heads, or of a few long lines), a bounded walk of the group's keys
//! (statement `fetch_walk`, the outbox fetch's path B) finds heads past it, from a cursor kept
//! per store so that every key's turn comes: that work too is bounded by the batch.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::limits;
use txoutbox_core::event::{Status, WorkerId, force_unlock_text};
use txoutbox_core::inbox::ordering as inbox_order;
use txoutbox_core::inbox::repository::{
    InboxBackend, InboxBlockedKey, InboxCapabilities, InboxFetchRequest, InboxFetched,
    InboxRepository, InboxStatusCount,
};
use txoutbox_core::inbox::{ConsumerGroup, InboxEvent};
use txoutbox_core::ordering;
use txoutbox_core::repository::{
    BLOCKED_WAITING_CAP, ParkedTarget, args, check_discard_reason, discard_text, not_parked,
};
use uuid::Uuid;

use crate::driver::inbox::{InboxDriver, InboxRawRow, InboxRows};
use crate::driver::{Bind, Connection, Driver};
use crate::inbox::sql::InboxStatements;
use crate::sql::{Layout, TableName, WalkCursor, micros};

mod faults;
mod fetch;
mod transaction;

#[cfg(not(feature = "test-hooks"))]
use faults::InboxFaults;
#[cfg(feature = "test-hooks")]
pub use faults::{BeforeBegin, InboxFaults};
pub use transaction::PgInboxTx;

/// How many rows one round of release_stale_locks releases (R63), and the round bound.
const STALE_BATCH: i64 = 1000;
const STALE_ROUNDS: usize = 1000;

/// The Postgres inbox over a driver `D`.
#[derive(Debug)]
pub struct PgInbox<D> {
    driver: D,
    stmts: Arc<InboxStatements>,
    faults: Arc<InboxFaults>,
    walk: WalkCursor,
}

impl<D: Clone> Clone for PgInbox<D> {
    fn clone(&self) -> Self {
        Self {
            driver: self.driver.clone(),
            stmts: self.stmts.clone(),
            faults: self.faults.clone(),
            walk: self.walk.clone(),
        }
    }
}

/// The rows for the rules of order and visibility: a row that does not decode keeps its place
/// (R106, [`InboxRawRow::into_ordering_view`]).
fn views(rows: Vec<InboxRawRow>) -> Vec<InboxEvent> {
    rows.into_iter()
        .map(InboxRawRow::into_ordering_view)
        .collect()
}

/// The row, decoded; one that does not decode is [`RepositoryError::Undecodable`], with its
/// status when that reads (the runner's R130).
fn decoded(r: InboxRawRow) -> Result<InboxEvent, RepositoryError> {
    let status = r.status.parse::<Status>().ok();
    r.decode().map_err(|u| RepositoryError::Undecodable {
        id: u.id,
        status,
        reason: u.reason,
    })
}

/// The first row, decoded ([`decoded`]).
fn one(rows: Vec<InboxRawRow>) -> Result<Option<InboxEvent>, RepositoryError> {
    rows.into_iter().next().map(decoded).transpose()
}

/// A stamped row as the fetch hands it out: decoded, or undecodable alone (R106).
fn fetched(r: InboxRawRow) -> InboxFetched {
    match r.decode() {
        Ok(e) => InboxFetched::Row(e),
        Err(u) => InboxFetched::Undecodable(u),
    }
}

/// The driver's error mapped for the table. An error of SQLSTATE class 22 or 23 is the
/// database refusing the message (R132): [`RepositoryError::Constraint`] with the text
/// `{SQLSTATE}: {message}`, which the runner dead-letters. A missing table or column is
/// [`RepositoryError::Schema`] with the inbox's hint (`create_inbox_schema`, R197), not the
/// outbox's that the driver's mapping gives.
fn mapped<C: InboxRows>(table: &TableName) -> impl Fn(C::Error) -> RepositoryError + '_ {
    move |e| {
        let server =
            |e: &C::Error| C::server_message(e).map_or_else(|| e.to_string(), str::to_owned);
        match C::sqlstate(&e) {
            Some(code) if crate::sql::refuses_message(&code) => RepositoryError::Constraint {
                message: format!("{code}: {}", server(&e)),
            },
            code => {
                let code = code.map(|c| format!(" (SQLSTATE {c})")).unwrap_or_default();
                let message = server(&e);
                match C::map_err(table, e) {
                    RepositoryError::Schema(_) => RepositoryError::Schema(format!(
                        "{message}{code}; {}",
                        crate::sql::missing_table_hint(table, crate::sql::TableRole::Inbox)
                    )),
                    other => other,
                }
            }
        }
    }
}

impl<D: Driver> PgInbox<D>
where
    D::Conn: InboxRows,
{
    /// The store on `table` in `layout`.
    pub fn new(driver: D, table: &TableName, layout: Layout) -> Self {
        Self {
            driver,
            stmts: Arc::new(InboxStatements::new(table, layout)),
            faults: Arc::default(),
            walk: WalkCursor::default(),
        }
    }

    /// The store with `pooler` (R194, default [`crate::sql::Pooler::None`]): under
    /// [`crate::sql::Pooler::Transaction`] no statement is prepared beyond its transaction and
    /// every statement runs inside one, for a transaction-pooling proxy in front of PostgreSQL.
    pub fn with_pooler(mut self, pooler: crate::sql::Pooler) -> Self {
        self.stmts = Arc::new(InboxStatements::clone(&self.stmts).for_pooler(pooler));
        self
    }

    /// The statements.
    pub fn statements(&self) -> &InboxStatements {
        &self.stmts
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The test hooks (cargo feature `test-hooks`, for tests only).
    #[cfg(feature = "test-hooks")]
    pub fn faults(&self) -> &InboxFaults {
        &self.faults
    }

    /// The parked gauges of a group (R193): parked keys and parked rows (keyless included).
    pub async fn parked_stats(&self, group: &ConsumerGroup) -> Result<(i64, i64), RepositoryError> {
        let group = group.clone();
        self.in_tx(|mut tx, s| {
            Box::pin(async move {
                let g = [Bind::Text(String::from(group.as_str()))];
                let keys = tx.int8(&s.parked_keys, &g).await?.unwrap_or(0);
                let rows = tx.int8(&s.parked_stats, &g).await?.unwrap_or(0);
                Ok((keys, rows))
            })
        })
        .await
    }

    /// Redrive (`reason` none) or discard of the parked rows of `group` that `target` selects
    /// (R192), in one transaction: read and row-locked, then written.
    async fn operate_parked(
        &self,
        group: &ConsumerGroup,
        target: &ParkedTarget,
        reason: Option<&str>,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let group = group.clone();
        let target = target.clone();
        let reason = reason.map(str::to_owned);
        self.in_tx(|mut tx, s| {
            Box::pin(async move {
                let op = if reason.is_some() {
                    "discard"
                } else {
                    "redrive"
                };
                let (ids, sources, keys) = target.filters();
                let rows = tx
                    .rows(
                        &s.parked_rows,
                        &[
                            Bind::Text(String::from(group.as_str())),
                            Bind::OptUuids(ids),
                            Bind::OptTexts(sources),
                            Bind::OptTexts(keys),
                        ],
                    )
                    .await?;
                if rows.is_empty()
                    && let ParkedTarget::Id(id) = target
                {
                    let found = tx.rows(&s.get, &[Bind::Uuid(id)]).await?;
                    let state = found
                        .first()
                        .filter(|r| r.consumer_group == group.as_str())
                        .map(|r| {
                            (
                                r.status.parse().unwrap_or(Status::Failed),
                                r.attempts_made,
                                r.max_attempts,
                            )
                        });
                    return Err(not_parked(id, op, state));
                }
                let ids: Vec<Uuid> = rows.iter().map(|r| r.id).collect();
                if ids.is_empty() {
                    return Ok(ids);
                }
                let n = match &reason {
                    None => tx.execute(&s.redrive, &[Bind::Uuids(ids.clone())]).await?,
                    Some(reason) => {
                        let texts = rows
                            .iter()
                            .map(|r| {
                                discard_text(
                                    reason,
                                    r.last_error.as_deref(),
                                    limits::DEFAULT_ERROR_MAX_LENGTH,
                                )
                            })
                            .collect::<Result<Vec<_>, _>>()?;
                        tx.execute(&s.discard, &[Bind::Uuids(ids.clone()), Bind::Texts(texts)])
                            .await?
                    }
                };
                // The rows are row-locked by parked_rows in this transaction: each is written.
                if n != ids.len() as u64 {
                    return Err(RepositoryError::Other(format!(
                        "{op} wrote {n} of {} parked rows; rolled back, nothing changed",
                        ids.len()
                    )));
                }
                Ok(ids)
            })
        })
        .await
    }

    /// Runs `f` in a transaction of its own: committed when it succeeds, else rolled back.
    async fn in_tx<T: Send>(
        &self,
        f: impl for<'a> FnOnce(
            Conn<'a, D>,
            &'a InboxStatements,
        )
            -> Pin<Box<dyn Future<Output = Result<T, RepositoryError>> + Send + 'a>>
        + Send,
    ) -> Result<T, RepositoryError> {
        let table = &self.stmts.table;
        let mut tx = self.driver.begin(table).await?;
        let r = f(Conn { c: &mut *tx, table }, &self.stmts).await;
        crate::driver::finish::<D, T>(table, tx, r).await
    }
}

/// A connection with its table, whose statements return repository errors.
struct Conn<'a, D: Driver> {
    c: &'a mut D::Conn,
    table: &'a TableName,
}

impl<D: Driver> Conn<'_, D>
where
    D::Conn: InboxRows,
{
    async fn rows(
        &mut self,
        sql: &str,
        binds: &[Bind],
    ) -> Result<Vec<InboxRawRow>, RepositoryError> {
        self.c
            .inbox_rows(sql, binds.to_vec())
            .await
            .map_err(mapped::<D::Conn>(self.table))
    }
    async fn execute(&mut self, sql: &str, binds: &[Bind]) -> Result<u64, RepositoryError> {
        self.c
            .execute(sql, binds.to_vec())
            .await
            .map_err(mapped::<D::Conn>(self.table))
    }
    async fn int8(&mut self, sql: &str, binds: &[Bind]) -> Result<Option<i64>, RepositoryError> {
        self.c
            .inbox_int8(sql, binds.to_vec())
            .await
            .map_err(mapped::<D::Conn>(self.table))
    }
    async fn text(&mut self, sql: &str, binds: &[Bind]) -> Result<Option<String>, RepositoryError> {
        self.c
            .inbox_text(sql, binds.to_vec())
            .await
            .map_err(mapped::<D::Conn>(self.table))
    }
    async fn now(&mut self, sql: &str) -> Result<DateTime<Utc>, RepositoryError> {
        self.c
            .inbox_now(sql)
            .await
            .map_err(mapped::<D::Conn>(self.table))
    }
    async fn counts(
        &mut self,
        sql: &str,
        binds: &[Bind],
    ) -> Result<Vec<(String, String, i64)>, RepositoryError> {
        self.c
            .inbox_counts(sql, binds.to_vec())
            .await
            .map_err(mapped::<D::Conn>(self.table))
    }
}

impl<D: Driver> PgInbox<D> where D::Conn: InboxRows {}

#[async_trait]
impl<D: Driver> InboxRepository for PgInbox<D>
where
    D::Conn: InboxRows,
{
    fn capabilities(&self) -> InboxCapabilities {
        InboxCapabilities {
            name: D::NAME,
            database_clock: true,
            siblings: self.stmts.layout == Layout::Partitioned,
            undecodable_rows: true,
        }
    }

    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        // One statement in autocommit: one round trip, not three.
        let table = &self.stmts.table;
        let mut c = self.driver.acquire(table).await?;
        Conn::<D> { c: &mut *c, table }.now(&self.stmts.now).await
    }

    async fn get(&self, id: Uuid) -> Result<Option<InboxEvent>, RepositoryError> {
        self.in_tx(|mut tx, s| {
            Box::pin(async move { one(tx.rows(&s.get, &[Bind::Uuid(id)]).await?) })
        })
        .await
    }

    async fn get_by_message_id(
        &self,
        message_id: &str,
        group: &ConsumerGroup,
    ) -> Result<Option<InboxEvent>, RepositoryError> {
        let binds = [
            Bind::Text(String::from(message_id)),
            Bind::Text(String::from(group.as_str())),
        ];
        // One statement in autocommit (its own snapshot): one round trip, not three; the
        // runner's duplicate probe reads here (runner/duplicates.rs).
        let table = &self.stmts.table;
        let mut c = self.driver.acquire(table).await?;
        one(Conn::<D> { c: &mut *c, table }
            .rows(&self.stmts.by_message_id, &binds)
            .await?)
    }

    async fn fetch_and_lock(
        &self,
        req: &InboxFetchRequest,
    ) -> Result<Vec<InboxFetched>, RepositoryError> {
        req.validate()?;
        let req = req.clone();
        let walk = self.walk.clone();
        self.in_tx(|mut tx, s| {
            Box::pin(async move {
                let now = tx.now(&s.now).await?;
                let ids = tx.fetch_windowed(s, &req, now, &walk).await?;
                if ids.is_empty() {
                    return Ok(Vec::new());
                }
                let stamped = tx
                    .rows(
                        &s.stamp,
                        &[
                            Bind::Uuids(ids.clone()),
                            Bind::Text(String::from(req.worker.as_str())),
                        ],
                    )
                    .await?;
                let mut by_id: HashMap<Uuid, InboxFetched> =
                    stamped.into_iter().map(|r| (r.id, fetched(r))).collect();
                Ok(ids.iter().filter_map(|id| by_id.remove(id)).collect())
            })
        })
        .await
    }

    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError> {
        let binds = [
            Bind::Uuids(ids.to_vec()),
            Bind::Text(String::from(worker.as_str())),
        ];
        self.in_tx(|mut tx, s| Box::pin(async move { tx.execute(&s.release_locks, &binds).await }))
            .await
    }

    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError> {
        self.in_tx(|mut tx, s| {
            Box::pin(async move { Ok(tx.execute(&s.requeue, &[Bind::Uuid(id)]).await? == 1) })
        })
        .await
    }

    async fn redrive(
        &self,
        group: &ConsumerGroup,
        target: &ParkedTarget,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        self.operate_parked(group, target, None).await
    }

    async fn discard(
        &self,
        group: &ConsumerGroup,
        target: &ParkedTarget,
        reason: &str,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        check_discard_reason(reason)?;
        self.operate_parked(group, target, Some(reason)).await
    }

    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError> {
        args::stale_timeout(timeout)?;
        let mut total = 0;
        for _ in 0..STALE_ROUNDS {
            let binds = [Bind::Int8(micros(timeout)), Bind::Int8(STALE_BATCH)];
            let n = self
                .in_tx(|mut tx, s| {
                    Box::pin(async move { tx.execute(&s.release_stale, &binds).await })
                })
                .await?;
            total += n;
            if n < STALE_BATCH as u64 {
                break;
            }
        }
        Ok(total)
    }

    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError> {
        let text = force_unlock_text(reason)?;
        let binds = [Bind::Uuid(id), Bind::Text(text)];
        let n = self
            .in_tx(|mut tx, s| Box::pin(async move { tx.execute(&s.force_unlock, &binds).await }))
            .await?;
        if n == 0 {
            return Err(RepositoryError::NotLocked(id));
        }
        Ok(())
    }

    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError> {
        args::cleanup(retention_days, batch_size)?;
        let binds = [
            Bind::Int4(i32::try_from(retention_days).unwrap_or(i32::MAX)),
            Bind::Int8(i64::try_from(batch_size).unwrap_or(i64::MAX)),
        ];
        self.in_tx(|mut tx, s| {
            Box::pin(async move { tx.execute(&s.delete_old_completed, &binds).await })
        })
        .await
    }

    async fn parked_counts(&self, group: &ConsumerGroup) -> Result<(u64, u64), RepositoryError> {
        let (keys, rows) = PgInbox::parked_stats(self, group).await?;
        Ok((keys.max(0) as u64, rows.max(0) as u64))
    }

    async fn blocked_keys(
        &self,
        group: &ConsumerGroup,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<InboxBlockedKey>, RepositoryError> {
        let group = group.clone();
        self.in_tx(|mut tx, s| {
            Box::pin(async move {
                let now = tx.now(&s.now).await?;
                let rows = views(
                    tx.rows(
                        &s.in_line_rows,
                        &[
                            Bind::Text(String::from(group.as_str())),
                            Bind::OptTexts(None),
                        ],
                    )
                    .await?,
                );
                let keyed: Vec<&InboxEvent> =
                    rows.iter().filter(|r| r.partition_key.is_some()).collect();
                let views: Vec<_> = keyed.iter().map(|r| inbox_order::view(r, true)).collect();
                let mut heads: Vec<&InboxEvent> = ordering::lines(views.iter(), now)
                    .into_values()
                    .filter(|line| ordering::head_is_blocked(line[0], now, lease_ttl))
                    .filter_map(|line| keyed.iter().find(|r| r.id == line[0].id).copied())
                    .collect();
                heads.sort_by_key(|h| (h.created_at, h.id));
                heads.truncate(limit);
                let mut out = Vec::with_capacity(heads.len());
                for h in heads {
                    let waiting = tx
                        .int8(
                            &s.waiting,
                            &[
                                Bind::Text(String::from(h.consumer_group.as_str())),
                                Bind::Text(String::from(h.source.as_str())),
                                Bind::Text(h.partition_key.clone().unwrap_or_default()),
                                Bind::Timestamp(h.created_at),
                                Bind::Uuid(h.id),
                                Bind::Int8(BLOCKED_WAITING_CAP),
                            ],
                        )
                        .await?
                        .unwrap_or(0);
                    out.push(InboxBlockedKey {
                        source: h.source.clone(),
                        partition_key: h.partition_key.clone().unwrap_or_default(),
                        head_id: h.id,
                        message_id: h.message_id.clone(),
                        attempts_made: h.attempts_made,
                        max_attempts: h.max_attempts,
                        last_error: h.last_error.clone(),
                        next_try: h.scheduled_at,
                        locked_by: h.locked_by.clone(),
                        locked_at: h.locked_at,
                        parked: h.attempts_made >= h.max_attempts,
                        parked_at: (h.attempts_made >= h.max_attempts)
                            .then_some(h.updated_at)
                            .flatten(),
                        waiting,
                    });
                }
                Ok(out)
            })
        })
        .await
    }

    async fn counts(
        &self,
        group: &ConsumerGroup,
    ) -> Result<Vec<InboxStatusCount>, RepositoryError> {
        let group = group.clone();
        let rows = self
            .in_tx(|mut tx, s| {
                let binds = [Bind::Text(String::from(group.as_str()))];
                Box::pin(async move { tx.counts(&s.counts, &binds).await })
            })
            .await?;
        let mut out = rows
            .into_iter()
            .map(|(source, status, count)| {
                let status: Status = status.parse().map_err(|_| {
                    RepositoryError::Other(format!(
                        "counts: status {status:?} is not one of the three"
                    ))
                })?;
                Ok(InboxStatusCount {
                    consumer_group: group.as_str().to_owned(),
                    source,
                    status,
                    count,
                })
            })
            .collect::<Result<Vec<_>, RepositoryError>>()?;
        out.sort();
        Ok(out)
    }

    async fn oldest_due_age(
        &self,
        group: &ConsumerGroup,
    ) -> Result<Option<Duration>, RepositoryError> {
        let binds = [Bind::Text(String::from(group.as_str()))];
        let us = self
            .in_tx(|mut tx, s| Box::pin(async move { tx.int8(&s.oldest_due_age, &binds).await }))
            .await?;
        Ok(us.map(|us| Duration::from_micros(u64::try_from(us).unwrap_or(0))))
    }
}

#[async_trait]
impl<D: InboxDriver> InboxBackend for PgInbox<D> {
    type Tx = PgInboxTx<D>;

    async fn begin(&self) -> Result<Self::Tx, RepositoryError> {
        self.faults.before_begin().await;
        if self.faults.down() {
            return Err(RepositoryError::Unavailable {
                message: "the database is down (the test hook db_down)".into(),
            });
        }
        Ok(PgInboxTx {
            tx: self.driver.begin(&self.stmts.table).await?,
            stmts: self.stmts.clone(),
            faults: self.faults.clone(),
            timeout_before: None,
            planned_timeout: None,
            timeout_early: false,
            restore: None,
            run_timeout: None,
            inserted: None,
            known: HashMap::new(),
            planned_long: false,
            batch: false,
        })
    }
}
