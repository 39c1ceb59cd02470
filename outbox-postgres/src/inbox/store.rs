//! The inbox store, written once over the driver layer ([`crate::driver::Driver`] and the
//! inbox's row shapes [`crate::driver::inbox::InboxRows`]): sqlx and diesel-async run the same
//! flow. [`PgInbox`] is the [`InboxRepository`] and
//! [`InboxBackend`]; [`PgInboxTx`] the runner's T and the processor's T_row, whose handle is
//! the driver's own transaction (R181).
//!
//! The fetch (R149, R150, R85) reads the heads of a window of the group's oldest fetchable rows
//! and the lines after them up to what the batch can take (statements `fetch_heads` and
//! `fetch_runs`), chooses heads and runs by the outbox's own rules ([`outbox_core::ordering`]
//! over the inbox view, [`outbox_core::inbox::ordering`]), row-locks the chosen run rows without
//! waiting (a row locked elsewhere cuts its run) and stamps the lease, in one short transaction:
//! its work is bounded by the batch, whatever the backlog. When the window hands out fewer heads
//! than the batch while the group has more fetchable rows than the window (a window full of rows
//! queued behind blocked heads, or of a few long lines), a bounded walk of the group's keys
//! (statement `fetch_walk`, the outbox fetch's path B) finds heads past it, from a cursor kept
//! per store so that every key's turn comes: that work too is bounded by the batch.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use outbox_core::error::RepositoryError;
use outbox_core::event::{Status, WorkerId, force_unlock_text, limits, normalize_error};
use outbox_core::inbox::ordering as inbox_order;
use outbox_core::inbox::repository::{
    Guard, InboxBackend, InboxBlockedKey, InboxCapabilities, InboxFetchRequest, InboxFetched,
    InboxRepository, InboxStatusCount, InboxTransaction, Landed, RowLock, RowWrite, WrittenState,
};
use outbox_core::inbox::{ConsumerGroup, InboxEvent, InboxKey, NewInboxEvent};
use outbox_core::ordering;
use outbox_core::repository::{BLOCKED_WAITING_CAP, FetchFilter, Retry, args};
use uuid::Uuid;

use crate::driver::inbox::{
    InboxDriver, InboxRawRow, InboxRows, nullable_int8, nullable_text, nullable_timestamp,
};
use crate::driver::{Bind, Connection, Driver};
use crate::inbox::sql::InboxStatements;
use crate::sql::{Layout, TableName, WalkCursor, fetch_walk_limit, fetch_window, micros};

/// How many rows one round of release_stale_locks releases (R63), and the round bound.
const STALE_BATCH: i64 = 1000;
const STALE_ROUNDS: usize = 1000;

/// A future run before the next transaction begins (the suite's `before_next_begin`).
pub type BeforeBegin = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Test hooks of the store (scenarios.md section 19's `fail_next_row_commit`, `db_down`,
/// `before_fresh_write`); inert unless a test sets them.
#[derive(Default)]
pub struct InboxFaults {
    fail_next_commit: AtomicBool,
    down: AtomicBool,
    before_next_begin: Mutex<Option<BeforeBegin>>,
}

impl std::fmt::Debug for InboxFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxFaults")
            .field("fail_next_commit", &self.fail_next_commit)
            .field("down", &self.down)
            .finish()
    }
}

impl InboxFaults {
    /// The next T or T_row fails when it commits (it is rolled back instead).
    pub fn fail_next_commit(&self) {
        self.fail_next_commit.store(true, Ordering::SeqCst);
    }
    /// Every new transaction fails to begin (`true`), or no longer does.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }
    /// Runs `f` just before the next transaction begins.
    pub fn before_next_begin(&self, f: BeforeBegin) {
        *self.before_next_begin.lock().expect("poisoned") = Some(f);
    }
}

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
/// `{SQLSTATE}: {message}`, which the runner dead-letters.
fn mapped<C: InboxRows>(table: &TableName) -> impl Fn(C::Error) -> RepositoryError + '_ {
    move |e| match C::sqlstate(&e) {
        Some(code) if code.starts_with("22") || code.starts_with("23") => {
            RepositoryError::Constraint {
                message: format!(
                    "{code}: {}",
                    C::server_message(&e).map_or_else(|| e.to_string(), str::to_owned)
                ),
            }
        }
        _ => C::map_err(table, e),
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

    /// The statements.
    pub fn statements(&self) -> &InboxStatements {
        &self.stmts
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The test hooks.
    pub fn faults(&self) -> &InboxFaults {
        &self.faults
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

/// The fetch (R149, R150, R85), its parts run in the fetch's transaction; each returns the ids
/// to stamp, in return order (R22), every one row-locked by this transaction.
impl<D: Driver> Conn<'_, D>
where
    D::Conn: InboxRows,
{
    /// The bounded fetch: the heads of a window of the group's oldest fetchable rows
    /// (`fetch_heads`) and, when the window may have missed heads, those of a bounded key walk
    /// ([`walk_heads`](Self::walk_heads)), each keyed head's line after it up to what the batch can take
    /// (`fetch_runs`), the batch chosen by the outbox's rules ([`choose`]) over these rows, and
    /// the chosen run rows row-locked without waiting; a run is cut before a row another
    /// transaction holds (R28), and nothing past the batch is locked but the window. A head that
    /// does not decode is taken alone: it fails before its key's next row could run (R106). Its work
    /// is bounded by the batch: the window (twice the batch), at most a batch of LIMIT 1 probes,
    /// the walk's bounded descents, and a batch of line reads of at most max_per_key − 1 rows.
    async fn fetch_windowed(
        &mut self,
        s: &InboxStatements,
        req: &InboxFetchRequest,
        now: DateTime<Utc>,
        cursor: &WalkCursor,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let group = String::from(req.group.as_str());
        let mut heads = self
            .rows(
                &s.fetch_heads,
                &[
                    Bind::Text(group.clone()),
                    Bind::OptTexts(req.sources.clone()),
                    Bind::Int8(micros(req.lease_ttl)),
                    Bind::Int4(i32::from(req.key_order)),
                    Bind::Int8(i64::try_from(req.limit).unwrap_or(i64::MAX)),
                    Bind::Int8(fetch_window(req.limit)),
                ],
            )
            .await?;
        if heads.len() < req.limit && req.key_order && self.window_overflows(s, req).await? {
            let more = self.walk_heads(s, req, now, &heads, cursor).await?;
            heads.extend(more);
        }
        if heads.is_empty() {
            return Ok(Vec::new());
        }
        let undecodable: HashSet<Uuid> = heads
            .iter()
            .filter(|h| h.problem().is_some())
            .map(|h| h.id)
            .collect();
        let heads = views(heads);
        let head_ids: HashSet<Uuid> = heads.iter().map(|h| h.id).collect();
        let keyed: Vec<&InboxEvent> = heads
            .iter()
            .filter(|h| req.key_order && h.partition_key.is_some() && !undecodable.contains(&h.id))
            .collect();
        let per_key = (req.max_per_key.max(1) - 1).min(req.limit.saturating_sub(heads.len()));
        let mut rows = heads.clone();
        if per_key > 0 && !keyed.is_empty() {
            rows.extend(views(
                self.rows(
                    &s.fetch_runs,
                    &[
                        Bind::Text(group),
                        Bind::Texts(keyed.iter().map(|h| h.source.clone()).collect()),
                        Bind::Texts(
                            keyed
                                .iter()
                                .map(|h| h.partition_key.clone().unwrap_or_default())
                                .collect(),
                        ),
                        Bind::NullableTimestamps(
                            keyed.iter().map(|h| Some(h.created_at)).collect(),
                        ),
                        Bind::Uuids(keyed.iter().map(|h| h.id).collect()),
                        Bind::Int8(i64::try_from(per_key).unwrap_or(i64::MAX)),
                    ],
                )
                .await?,
            ));
        }
        let ids = choose(&rows, now, req);
        let run_ids: Vec<Uuid> = ids
            .iter()
            .filter(|id| !head_ids.contains(id))
            .copied()
            .collect();
        if run_ids.is_empty() {
            return Ok(ids);
        }
        let locked: HashSet<Uuid> = self
            .rows(&s.try_lock, &[Bind::Uuids(run_ids.clone())])
            .await?
            .into_iter()
            .map(|r| r.id)
            .collect();
        if locked.len() == run_ids.len() {
            return Ok(ids);
        }
        mark_held(&mut rows, &run_ids, &locked, now);
        // Runs cut before the rows held elsewhere; a run the cut would lengthen beyond what was
        // locked keeps what was locked (a prefix of it).
        Ok(choose(&rows, now, req)
            .into_iter()
            .filter(|id| head_ids.contains(id) || locked.contains(id))
            .collect())
    }

    /// Whether the group has more fetchable rows than the window read: only then can a head
    /// lie outside it (R20).
    async fn window_overflows(
        &mut self,
        s: &InboxStatements,
        req: &InboxFetchRequest,
    ) -> Result<bool, RepositoryError> {
        let n = self
            .int8(
                &s.window_overflow,
                &[
                    Bind::Text(String::from(req.group.as_str())),
                    Bind::OptTexts(req.sources.clone()),
                    Bind::Int8(micros(req.lease_ttl)),
                    Bind::Int8(fetch_window(req.limit)),
                ],
            )
            .await?;
        Ok(n == Some(1))
    }

    /// The heads past the window (the outbox fetch's path B for the inbox key, statement
    /// `fetch_walk`): a walk of the group's keyed lines from the store's cursor, one index
    /// descent per key, stopped after as many fetchable heads as the batch still wants or
    /// [`fetch_walk_limit`] keys, and the rows without partition_key (each a head) among the
    /// group's oldest unlocked fetchable rows, as many as the walk limit. The cursor moves to the
    /// walk's last key, so walk after walk goes round every key (R20). The candidates not
    /// already the window's heads are taken in head order, up to what the batch still wants, and
    /// row-locked without waiting: one held elsewhere is dropped (its key is held), and each
    /// taken row is judged again on its latest version. Work bounded by the batch, never by the
    /// backlog (R85).
    async fn walk_heads(
        &mut self,
        s: &InboxStatements,
        req: &InboxFetchRequest,
        now: DateTime<Utc>,
        window_heads: &[InboxRawRow],
        cursor: &WalkCursor,
    ) -> Result<Vec<InboxRawRow>, RepositoryError> {
        let want = req.limit.saturating_sub(window_heads.len());
        let limit = fetch_walk_limit(req.limit);
        let (from_source, from_key) = cursor.get();
        let rows = self
            .rows(
                &s.fetch_walk,
                &[
                    Bind::Text(String::from(req.group.as_str())),
                    Bind::OptTexts(req.sources.clone()),
                    Bind::Int8(micros(req.lease_ttl)),
                    Bind::Int8(i64::try_from(want).unwrap_or(i64::MAX)),
                    Bind::Int8(limit),
                    Bind::Text(from_source),
                    Bind::Text(from_key),
                    Bind::Int8(limit),
                ],
            )
            .await?;
        cursor.advance(rows.iter().rev().find_map(|r| {
            r.partition_key
                .as_ref()
                .map(|k| (r.source.clone(), k.clone()))
        }));
        let known: HashSet<Uuid> = window_heads.iter().map(|h| h.id).collect();
        let head = |r: &InboxRawRow| {
            let v = r.clone().into_ordering_view();
            inbox_order::fetchable(&v, now, req.lease_ttl) && req.matches(&v)
        };
        let mut seen = HashSet::new();
        let mut candidates: Vec<InboxRawRow> = rows
            .into_iter()
            .filter(|r| !known.contains(&r.id) && seen.insert(r.id) && head(r))
            .collect();
        candidates.sort_by_key(|r| (r.scheduled_at, r.created_at, r.id));
        candidates.truncate(want);
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let order: Vec<Uuid> = candidates.iter().map(|r| r.id).collect();
        let mut locked: HashMap<Uuid, InboxRawRow> = self
            .rows(&s.try_lock, &[Bind::Uuids(order.clone())])
            .await?
            .into_iter()
            .map(|r| (r.id, r))
            .collect();
        Ok(order
            .iter()
            .filter_map(|id| locked.remove(id))
            .filter(|r| head(r))
            .collect())
    }
}

/// Marks the rows of `tried` that this transaction could not row-lock as held (in line for
/// their key, not fetchable), so that [`choose`] skips them and cuts their runs.
fn mark_held(rows: &mut [InboxEvent], tried: &[Uuid], locked: &HashSet<Uuid>, now: DateTime<Utc>) {
    for r in rows.iter_mut() {
        if tried.contains(&r.id) && !locked.contains(&r.id) {
            r.locked_at = Some(now);
            r.locked_by = Some("(row-locked)".into());
        }
    }
}

/// The outbox view of the rows, chosen by the outbox's rules (R149, R150).
fn choose(rows: &[InboxEvent], now: DateTime<Utc>, req: &InboxFetchRequest) -> Vec<Uuid> {
    let views: Vec<_> = rows
        .iter()
        .map(|r| inbox_order::view(r, req.key_order))
        .collect();
    ordering::select(
        views.iter(),
        now,
        req.limit,
        req.lease_ttl,
        req.max_per_key,
        &FetchFilter::none(),
    )
    .into_iter()
    .map(|v| v.id)
    .collect()
}

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
        let hook = self
            .faults
            .before_next_begin
            .lock()
            .expect("poisoned")
            .take();
        if let Some(f) = hook {
            f.await;
        }
        if self.faults.down.load(Ordering::SeqCst) {
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
        })
    }
}

/// One open inbox transaction over a driver transaction `T`.
///
/// Its round trips are counted (issue 21's benchmarks): the runner's landing of a new message
/// is one statement (`land_run.sql`: the insert, the earlier probe, the handler timeout), the
/// row it inserted is not locked or read again, the savepoint is not released by a statement
/// of its own (the commit releases it, R181 step 3) and the statement timeout is put back by
/// the outcome write (`write.sql`'s `$6`, R181 step 4).
pub struct PgInboxTx<D: Driver> {
    tx: D::Tx,
    stmts: Arc<InboxStatements>,
    faults: Arc<InboxFaults>,
    /// The statement_timeout before the handler's was set, to put back (R181 step 4).
    timeout_before: Option<String>,
    /// The handler timeout in whole milliseconds ([`InboxTransaction::plan_handler_timeout`]).
    planned_timeout: Option<String>,
    /// Whether the handler timeout was set ahead, before the savepoint, by `land_run` or
    /// `lock_row_run` (a rollback to the savepoint then keeps it).
    timeout_early: bool,
    /// A statement_timeout the next write puts back.
    restore: Option<String>,
    /// The handler timeout of the run in progress (set by [`InboxTransaction::savepoint`]).
    run_timeout: Option<Duration>,
    /// The row `land_run` inserted in this transaction, as inserted, and whether an earlier row
    /// of its key was in line then; cleared by a write.
    inserted: Option<(InboxEvent, bool)>,
    /// created_at of the rows this transaction read decoded or was given (a guard): with the
    /// id, the primary key of both layouts, by which its by-id statements find them (on the
    /// partitioned table a lookup by id alone reads every partition).
    known: HashMap<Uuid, DateTime<Utc>>,
}

impl<D: Driver> std::fmt::Debug for PgInboxTx<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgInboxTx")
            .field("table", &self.stmts.table)
            .finish()
    }
}

fn error_text(e: &str) -> String {
    normalize_error(
        &e.replace('\0', "\u{FFFD}"),
        limits::DEFAULT_ERROR_MAX_LENGTH,
    )
}

/// The handler timeout as R181 sets it: whole milliseconds rounded up, at least 1 (0 would turn
/// the bound off).
/// Below this handler timeout, the statement_timeout goes back in a statement of its own right
/// after the run, before the outcome write (R181 step 4), instead of inside that write (which
/// then runs under the handler's timeout): a short handler timeout must not cancel the outcome
/// write of a run that ended in time, which would leave the message unhandled for good.
const SHORT_HANDLER_TIMEOUT: Duration = Duration::from_secs(5);

fn timeout_ms(timeout: Duration) -> String {
    timeout.as_micros().div_ceil(1000).max(1).to_string()
}

fn retry_binds(retry: &Retry) -> (Bind, Bind) {
    match retry {
        Retry::Keep => (nullable_int8(None), nullable_timestamp(None)),
        Retry::After(d) => (nullable_int8(Some(micros(*d))), nullable_timestamp(None)),
        Retry::At(t) => (nullable_int8(None), nullable_timestamp(Some(*t))),
    }
}

impl<D: Driver> PgInboxTx<D>
where
    D::Conn: InboxRows,
{
    /// R181 step 4 ahead of the outcome write when the run's handler timeout is short
    /// ([`SHORT_HANDLER_TIMEOUT`]): the timeout to put back goes back now, in a statement of its
    /// own, so the outcome write does not run under the handler's timeout.
    async fn restore_if_short(&mut self) -> Result<(), RepositoryError> {
        if self
            .run_timeout
            .take()
            .is_some_and(|t| t < SHORT_HANDLER_TIMEOUT)
            && let Some(before) = self.restore.take()
        {
            let s = self.stmts.clone();
            self.c()
                .text(&s.statement_timeout, &[Bind::Text(before)])
                .await?;
        }
        Ok(())
    }

    fn c(&mut self) -> Conn<'_, D> {
        Conn {
            c: &mut *self.tx,
            table: &self.stmts.table,
        }
    }

    /// The statement `write` (R126, R128, R154): the row as written, undecoded.
    async fn write_raw(
        &mut self,
        id: Uuid,
        write: &RowWrite,
    ) -> Result<InboxRawRow, RepositoryError> {
        let s = self.stmts.clone();
        let (kind, error, (after, at)) = match write {
            RowWrite::Complete => ("complete", None, retry_binds(&Retry::Keep)),
            RowWrite::Counted { error, retry } => {
                ("counted", Some(error_text(error)), retry_binds(retry))
            }
            RowWrite::NotCounted { error, retry } => {
                ("not_counted", Some(error_text(error)), retry_binds(retry))
            }
            RowWrite::Terminal { error } => (
                "terminal",
                Some(error_text(error)),
                retry_binds(&Retry::Keep),
            ),
            RowWrite::ClearLease => ("clear_lease", None, retry_binds(&Retry::Keep)),
        };
        // The row is written: what `land_run` returned of it no longer stands.
        self.inserted = None;
        let binds = [
            Bind::Uuid(id),
            Bind::Text(String::from(kind)),
            nullable_text(error.as_deref()),
            after,
            at,
            // R181 step 4: the timeout goes back for the commit that follows.
            nullable_text(self.restore.take().as_deref()),
        ];
        let rows = match self.known.get(&id) {
            Some(at) => {
                let mut binds = binds.to_vec();
                binds.push(Bind::Timestamp(*at));
                self.c().rows(&s.write_at, &binds).await?
            }
            None => self.c().rows(&s.write, &binds).await?,
        };
        rows.into_iter()
            .next()
            .ok_or_else(|| RepositoryError::Other(format!("inbox row {id} does not exist")))
    }

    /// Lands one event ([`InboxTransaction::land`]); the row's created_at is known after.
    async fn land_one(&mut self, e: &NewInboxEvent) -> Result<Landed, RepositoryError> {
        let l = self.land_event(e).await?;
        self.known.insert(l.row.id, l.row.created_at);
        Ok(l)
    }

    async fn land_event(&mut self, e: &NewInboxEvent) -> Result<Landed, RepositoryError> {
        let s = self.stmts.clone();
        let key = [
            Bind::Text(String::from(e.message_id())),
            Bind::Text(String::from(e.consumer_group())),
        ];
        if s.layout == Layout::Partitioned {
            // A dedup key already stored needs no insert, so nothing to serialize: its row is
            // returned without the advisory lock, and a processor's T_row that holds the lock
            // while its handler runs (R152) is not waited for; the row lock that follows skips
            // that row (R116 step 3; G-05).
            if let Some(row) = one(self.c().rows(&s.by_message_id, &key).await?)? {
                return Ok(Landed {
                    row,
                    inserted: false,
                });
            }
            // R111: the dedup key's advisory lock, then the rows of the key.
            self.c().execute(&s.dedup_lock, &key).await?;
            if let Some(row) = one(self.c().rows(&s.by_message_id, &key).await?)? {
                return Ok(Landed {
                    row,
                    inserted: false,
                });
            }
        }
        let payload = serde_json::Value::Object(e.payload().clone()).to_string();
        let headers = e
            .headers()
            .map(|h| serde_json::to_string(h).expect("a string map serializes"));
        let row = e.clone().into_row(DateTime::<Utc>::MIN_UTC);
        let binds = [
            Bind::Uuid(e.id()),
            Bind::Text(String::from(e.event_type())),
            Bind::Text(payload),
            nullable_text(headers.as_deref()),
            nullable_text(row.trace_id.as_deref()),
            nullable_text(row.correlation_id.as_deref()),
            nullable_text(row.causation_id.as_deref()),
            nullable_text(row.schema_version.as_deref()),
            Bind::Int4(e.max_attempts()),
            Bind::Text(String::from(e.message_id())),
            Bind::Text(String::from(e.consumer_group())),
            Bind::Text(String::from(e.source())),
            nullable_text(e.partition_key()),
            nullable_text(self.planned_timeout.as_deref()),
        ];
        if let Some(raw) = self.c().rows(&s.land_run, &binds).await?.into_iter().next() {
            let earlier = raw.earlier.unwrap_or(false);
            if let Some(before) = raw.timeout_before.clone() {
                // land_run set the handler timeout (R181 step 1, ahead of the savepoint).
                self.timeout_before = Some(before);
                self.timeout_early = true;
            }
            let row = decoded(raw)?;
            self.inserted = Some((row.clone(), earlier));
            return Ok(Landed {
                row,
                inserted: true,
            });
        }
        match one(self.c().rows(&s.by_message_id, &key).await?)? {
            Some(row) => Ok(Landed {
                row,
                inserted: false,
            }),
            None => Err(RepositoryError::Other(format!(
                "landing message {} of group {} inserted nothing and found no row (an id conflict?)",
                e.message_id(),
                e.consumer_group()
            ))),
        }
    }
}

impl<D: InboxDriver> PgInboxTx<D> {
    /// R152's guard: the row locked, pending and held by `worker`.
    async fn guard_held(
        &mut self,
        id: Uuid,
        worker: &WorkerId,
    ) -> Result<Option<InboxEvent>, RepositoryError> {
        Ok(match self.lock_row(id).await? {
            RowLock::Locked(r)
                if r.status == Status::Pending
                    && r.locked_by.as_deref() == Some(worker.as_str()) =>
            {
                Some(r)
            }
            _ => None,
        })
    }
}

#[async_trait]
impl<D: InboxDriver> InboxTransaction for PgInboxTx<D> {
    type Handle = D::Handle;

    fn handle(&mut self) -> &mut D::Handle {
        D::handle(&mut self.tx)
    }

    fn plan_handler_timeout(&mut self, timeout: Duration) {
        self.planned_timeout = Some(timeout_ms(timeout));
    }

    async fn lock_key(&mut self, key: &InboxKey) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        let binds = [
            Bind::Text(String::from(key.consumer_group.as_str())),
            Bind::Text(String::from(key.source.as_str())),
            Bind::Text(String::from(key.partition_key.as_str())),
        ];
        self.c().execute(&s.key_lock, &binds).await?;
        Ok(())
    }

    async fn land(&mut self, events: Vec<NewInboxEvent>) -> Result<Vec<Landed>, RepositoryError> {
        let mut out = Vec::with_capacity(events.len());
        for e in &events {
            out.push(self.land_one(e).await?);
        }
        Ok(out)
    }

    async fn lock_row(&mut self, id: Uuid) -> Result<RowLock, RepositoryError> {
        if let Some((row, _)) = self.inserted.as_ref().filter(|(r, _)| r.id == id) {
            // R116 step 3: this transaction inserted the row and holds it; no other
            // transaction sees it before T commits, and nothing wrote it since (a write clears
            // `inserted`), so it stands as land_run returned it.
            return Ok(RowLock::Locked(row.clone()));
        }
        let s = self.stmts.clone();
        // By the primary key (created_at, id) when this transaction knows the row's created_at
        // (it landed or read it, or a guard named it), else by id alone.
        let (lock, exists, binds) = match self.known.get(&id) {
            Some(at) => (
                &s.lock_row_at,
                &s.exists_at,
                vec![Bind::Uuid(id), Bind::Timestamp(*at)],
            ),
            None => (&s.lock_row, &s.exists, vec![Bind::Uuid(id)]),
        };
        if let Some(r) = one(self.c().rows(lock, &binds).await?)? {
            self.known.insert(r.id, r.created_at);
            return Ok(RowLock::Locked(r));
        }
        Ok(match self.c().int8(exists, &binds).await? {
            Some(n) if n > 0 => RowLock::Busy,
            _ => RowLock::Missing,
        })
    }

    async fn earlier_in_line(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError> {
        let Some(pk) = row.partition_key.as_deref() else {
            return Ok(false);
        };
        if let Some((_, earlier)) = self.inserted.as_ref().filter(|(r, _)| r.id == row.id) {
            // land_run's probe, read after the key lock in this transaction (R116, R145).
            return Ok(*earlier);
        }
        let s = self.stmts.clone();
        let binds = [
            Bind::Text(String::from(row.consumer_group.as_str())),
            Bind::Text(String::from(row.source.as_str())),
            Bind::Text(String::from(pk)),
            Bind::Timestamp(row.created_at),
            Bind::Uuid(row.id),
        ];
        Ok(self.c().int8(&s.earlier, &binds).await?.unwrap_or(0) > 0)
    }

    async fn completed_sibling(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError> {
        if self.stmts.layout != Layout::Partitioned {
            // The unique index rules siblings out on the plain table (R164).
            return Ok(false);
        }
        let s = self.stmts.clone();
        let key = [
            Bind::Text(String::from(row.message_id.as_str())),
            Bind::Text(String::from(row.consumer_group.as_str())),
        ];
        self.c().execute(&s.dedup_lock, &key).await?;
        let binds = [key[0].clone(), key[1].clone(), Bind::Uuid(row.id)];
        Ok(self
            .c()
            .int8(&s.completed_sibling, &binds)
            .await?
            .unwrap_or(0)
            > 0)
    }

    async fn savepoint(&mut self, timeout: Duration) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        self.c().execute(&s.savepoint, &[]).await?;
        self.run_timeout = Some(timeout);
        let ms = timeout_ms(timeout);
        if self.timeout_early && self.planned_timeout.as_deref() == Some(ms.as_str()) {
            // R181 step 1: land_run or lock_row_run set this very timeout in T's previous
            // statement, and no statement has run since but the savepoint's.
            return Ok(());
        }
        let before = self
            .c()
            .text(&s.statement_timeout, &[Bind::Text(ms)])
            .await?;
        if !self.timeout_early {
            self.timeout_before = before;
        }
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), RepositoryError> {
        // R181 step 3 without a round trip: the savepoint stays until the commit, which
        // releases it with T (a released and an unreleased savepoint commit the same writes;
        // nothing rolls back to it after a success). The timeout goes back with the outcome
        // write (R181 step 4, write.sql's $6).
        self.restore = self.timeout_before.take();
        self.restore_if_short().await
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        self.c().execute(&s.rollback_to_savepoint, &[]).await?;
        if self.timeout_early {
            // Set before the savepoint, the timeout survives the rollback: the outcome write
            // puts it back (R181 step 4).
            self.restore = self.timeout_before.take();
            self.restore_if_short().await?;
        } else {
            // Set after the savepoint, the rollback undid it.
            self.timeout_before = None;
        }
        Ok(())
    }

    async fn write(&mut self, id: Uuid, write: RowWrite) -> Result<InboxEvent, RepositoryError> {
        decoded(self.write_raw(id, &write).await?)
    }

    async fn guard(&mut self, guard: &Guard) -> Result<Option<InboxEvent>, RepositoryError> {
        let s = self.stmts.clone();
        match guard {
            Guard::Reland(e) => {
                let l = self.land_one(e).await?;
                Ok(l.inserted.then_some(l.row))
            }
            Guard::Unchanged {
                id,
                created_at,
                attempts_made,
                scheduled_at,
                lease_ttl,
            } => {
                self.known.insert(*id, *created_at);
                let now = self.c().now(&s.now).await?;
                Ok(match self.lock_row(*id).await? {
                    RowLock::Locked(r)
                        if r.status == Status::Pending
                            && (r.locked_at.is_none()
                                || inbox_order::lease_expired(&r, now, *lease_ttl))
                            && r.attempts_made == *attempts_made
                            && r.scheduled_at == *scheduled_at =>
                    {
                        Some(r)
                    }
                    _ => None,
                })
            }
            Guard::HeldBy {
                id,
                created_at,
                worker,
            } if s.layout == Layout::Plain => {
                self.known.insert(*id, *created_at);
                let Some(ms) = self.planned_timeout.clone() else {
                    return self.guard_held(*id, worker).await;
                };
                // R152's guard and R181 step 1 in one round trip (lock_row_run.sql).
                let binds = [
                    Bind::Uuid(*id),
                    Bind::Text(ms),
                    Bind::Timestamp(*created_at),
                ];
                let Some(raw) = self
                    .c()
                    .rows(&s.lock_row_run, &binds)
                    .await?
                    .into_iter()
                    .next()
                else {
                    return Ok(None);
                };
                self.timeout_before = raw.timeout_before.clone();
                self.timeout_early = self.timeout_before.is_some();
                let r = decoded(raw)?;
                Ok(
                    (r.status == Status::Pending
                        && r.locked_by.as_deref() == Some(worker.as_str()))
                    .then_some(r),
                )
            }
            Guard::HeldBy {
                id,
                created_at,
                worker,
            } => {
                self.known.insert(*id, *created_at);
                self.guard_held(*id, worker).await
            }
        }
    }

    /// Reads the row undecoded: the guard on its raw status and lease, then the write, whose
    /// returned row is read for its state only (R106; Y-16).
    async fn fail_undecodable(
        &mut self,
        id: Uuid,
        worker: &WorkerId,
        error: &str,
        retry: Retry,
    ) -> Result<Option<WrittenState>, RepositoryError> {
        let s = self.stmts.clone();
        let held = self
            .c()
            .rows(&s.lock_row, &[Bind::Uuid(id)])
            .await?
            .into_iter()
            .next()
            .is_some_and(|r| {
                r.status == Status::Pending.as_str()
                    && r.locked_by.as_deref() == Some(worker.as_str())
            });
        if !held {
            return Ok(None);
        }
        let error = error.to_owned();
        let w = self
            .write_raw(id, &RowWrite::Counted { error, retry })
            .await?;
        let status = w.status.parse().map_err(|_| {
            RepositoryError::Other(format!(
                "inbox row {id}: status {:?} is not one of the three",
                w.status
            ))
        })?;
        Ok(Some(WrittenState {
            status,
            attempts_made: w.attempts_made,
            last_error: w.last_error,
            scheduled_at: w.scheduled_at,
        }))
    }

    async fn commit(self) -> Result<(), RepositoryError> {
        let table = self.stmts.table.clone();
        if self.faults.fail_next_commit.swap(false, Ordering::SeqCst) {
            let _ = D::rollback(&table, self.tx).await;
            return Err(RepositoryError::Unavailable {
                message: "injected failure of the commit (fail_next_row_commit)".into(),
            });
        }
        D::commit(&table, self.tx).await
    }

    async fn rollback(self) {
        let _ = D::rollback(&self.stmts.table, self.tx).await;
    }
}
