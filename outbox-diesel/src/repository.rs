//! The repository (relay and operator side) over a deadpool pool of diesel-async connections.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use diesel::sql_types::{Array, BigInt, Bool, Int4, Nullable, Text, Timestamptz};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, RunQueryDsl, TransactionManager,
};
use outbox_core::RepositoryError;
use outbox_core::event::{OutboxEvent, WorkerId, force_unlock_text};
use outbox_core::repository::{
    BlockedKey, Capabilities, DEFAULT_BACKEND_BATCH_SIZE, Delivery, DeliveryBound, EmptyDelivery,
    FetchRequest, Fetched, OutboxRepository, Outcome, OutcomeResult, STALE_LOCK_MAX_BATCHES,
    StatusCount, WrittenOutcome, args, check_backend_batch_size,
};
use outbox_postgres::shared;
use outbox_postgres::sql::{
    self, BlockedKeysParams, FetchParams, HeadRows, Layout, Statements, TableName, Take, WalkCursor,
};
use uuid::Uuid;

use crate::error::{Error, map_diesel, map_pool};
use crate::pool::{PgPool, PooledConnection};
use crate::prepared::Prepared;
use crate::row::{
    AgeRow, AppliedRow, BlockedRow, CountRow, FetchedRow, HeadRow, NowRow, OutboxRow,
};
use crate::writer::DieselOutboxWriter;

type SqlUuid = diesel::sql_types::Uuid;

/// Settings of the diesel backend.
#[derive(Debug, Clone)]
pub struct DieselConfig {
    table: TableName,
    layout: Layout,
    batch_size: usize,
    error_max_length: usize,
}

impl Default for DieselConfig {
    fn default() -> Self {
        Self {
            table: TableName::default(),
            layout: Layout::Plain,
            batch_size: DEFAULT_BACKEND_BATCH_SIZE,
            error_max_length: outbox_core::event::limits::DEFAULT_ERROR_MAX_LENGTH,
        }
    }
}

impl DieselConfig {
    /// The table name, `table` or `schema.table`, validated (R78).
    pub fn table_name(mut self, name: &str) -> Result<Self, Error> {
        self.table = TableName::new(name)?;
        Ok(self)
    }

    /// An already validated table name.
    pub fn table(mut self, table: TableName) -> Self {
        self.table = table;
        self
    }

    /// The table's layout (default [`Layout::Plain`]); it must match how the table was created
    /// ([`crate::run_migrations_with`]). The repository's writer writes with it.
    pub fn layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self
    }

    /// The configured layout.
    pub fn layout_ref(&self) -> Layout {
        self.layout
    }

    /// Maintenance batch size (R63): 1 to 10,000, default 1000.
    pub fn batch_size(mut self, n: usize) -> Result<Self, Error> {
        self.batch_size = check_backend_batch_size(n).map_err(|e| Error::Config(e.to_string()))?;
        Ok(self)
    }

    /// last_error limit in bytes (R9): 16 to 2,000 (the size of the `last_error` column), default
    /// 2,000; a larger value is a configuration error.
    pub fn error_max_length(mut self, n: usize) -> Result<Self, Error> {
        self.error_max_length = outbox_core::event::check_error_max_length(n)
            .map_err(|e| Error::Config(e.to_string()))?;
        Ok(self)
    }

    /// The configured table.
    pub fn table_ref(&self) -> &TableName {
        &self.table
    }
}

/// The diesel-async repository on a deadpool pool. Cloning shares the pool.
#[derive(Clone)]
pub struct DieselOutboxRepository {
    pool: PgPool,
    stmts: Arc<Statements>,
    cfg: DieselConfig,
    cursor: WalkCursor,
    fail_next_commit: Arc<AtomicBool>,
}

impl std::fmt::Debug for DieselOutboxRepository {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DieselOutboxRepository")
            .field("table", &self.cfg.table)
            .field("batch_size", &self.cfg.batch_size)
            .field("pool", &self.pool.status())
            .finish()
    }
}

/// Errors inside a transaction closure: diesel's, or ours (which roll back too).
enum TxError {
    Db(diesel::result::Error),
    Repo(RepositoryError),
}

impl From<diesel::result::Error> for TxError {
    fn from(e: diesel::result::Error) -> Self {
        TxError::Db(e)
    }
}

impl DieselOutboxRepository {
    /// A repository on `pool` with these settings. Run the migrations first
    /// ([`crate::run_migrations`]).
    pub fn new(pool: PgPool, cfg: DieselConfig) -> Self {
        Self {
            pool,
            stmts: Arc::new(Statements::with_layout(&cfg.table, cfg.layout)),
            cfg,
            cursor: WalkCursor::default(),
            fail_next_commit: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The writer for this repository's table and layout.
    pub fn writer(&self) -> DieselOutboxWriter {
        DieselOutboxWriter::from_statements(self.stmts.clone())
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.cfg.table
    }

    /// Test hook (cargo feature `testing`): the next outcome transaction runs its statements and
    /// then rolls back, and `write_outcomes` returns an error (R57; P-06).
    #[cfg(feature = "testing")]
    pub fn fail_next_outcome_commit(&self) {
        self.fail_next_commit.store(true, Ordering::SeqCst);
    }

    fn err(&self, e: diesel::result::Error) -> RepositoryError {
        map_diesel(&self.cfg.table, e)
    }

    fn tx_err(&self, e: TxError) -> RepositoryError {
        match e {
            TxError::Db(d) => self.err(d),
            TxError::Repo(r) => r,
        }
    }

    async fn conn(&self) -> Result<PooledConnection, RepositoryError> {
        self.pool.get().await.map_err(map_pool)
    }

    /// Runs a statement taking `($1 uuid, $2 text)` and returns the affected-row count.
    async fn exec_id_worker(
        &self,
        sql: &str,
        id: Uuid,
        worker: &WorkerId,
    ) -> Result<usize, RepositoryError> {
        let mut conn = self.conn().await?;
        diesel::sql_query(sql)
            .bind::<SqlUuid, _>(id)
            .bind::<Text, _>(worker.as_str())
            .execute(&mut conn)
            .await
            .map_err(|e| self.err(e))
    }
}

async fn load_applied(
    q: diesel::query_builder::BoxedSqlQuery<'_, diesel::pg::Pg, diesel::query_builder::SqlQuery>,
    conn: &mut AsyncPgConnection,
    out: &mut Vec<AppliedRow>,
) -> Result<(), diesel::result::Error> {
    out.extend(Prepared(q).load::<AppliedRow>(conn).await?);
    Ok(())
}

#[async_trait]
impl OutboxRepository for DieselOutboxRepository {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "postgres-diesel",
            database_clock: true,
            undecodable_rows: true,
            transaction_delivery: true,
        }
    }

    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        let mut conn = self.conn().await?;
        // The shared text is `SELECT now()`, whose column PostgreSQL names `now`.
        let r: NowRow = diesel::sql_query(self.stmts.now.as_str())
            .get_result(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(r.now)
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxEvent>, RepositoryError> {
        let mut conn = self.conn().await?;
        let rows: Vec<OutboxRow> = diesel::sql_query(self.stmts.get.as_str())
            .bind::<SqlUuid, _>(id)
            .load(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        rows.into_iter()
            .next()
            .map(OutboxRow::into_event)
            .transpose()
    }

    async fn fetch_and_lock(&self, req: &FetchRequest) -> Result<Vec<Fetched>, RepositoryError> {
        req.validate()?;
        let p = FetchParams::new(req);
        let worker = req.worker.as_str().to_owned();
        let mut conn = self.conn().await?;
        // Its own transaction, committed at once (R76).
        let rows: Vec<FetchedRow> = conn
            .transaction(async |c| {
                fetch_in(c, &self.stmts, Take::Lease, worker, &p, &self.cursor).await
            })
            .await
            .map_err(|e| self.err(e))?;
        Ok(rows.into_iter().map(|r| r.0).collect())
    }

    async fn begin_delivery(
        &self,
        req: &FetchRequest,
        bound: DeliveryBound,
    ) -> Result<(Vec<Fetched>, Box<dyn Delivery>), RepositoryError> {
        req.validate()?;
        let p = FetchParams::new(req);
        let mut conn = self.conn().await?;
        // The transaction stays open across the cycle (R84), so it is driven by hand rather
        // than by a `transaction` closure; dropping the delivery closes the connection, which
        // rolls it back.
        AnsiTransactionManager::begin_transaction(&mut *conn)
            .await
            .map_err(|e| self.err(e))?;
        let mut d = DieselDelivery {
            conn: Some(conn),
            repo: self.clone(),
            worker: req.worker.as_str().to_owned(),
            fetched: HashMap::new(),
        };
        let c = d.conn.as_mut().expect("just set");
        Prepared(
            diesel::sql_query(self.stmts.delivery_begin.as_str())
                .into_boxed()
                .bind::<Text, _>(bound.server_timeout.as_millis().max(1).to_string()),
        )
        .execute(&mut **c)
        .await
        .map_err(|e| self.err(e))?;
        let rows = fetch_in(
            c,
            &self.stmts,
            Take::Transaction,
            d.worker.clone(),
            &p,
            &self.cursor,
        )
        .await
        .map_err(|e| self.err(e))?;
        let rows: Vec<Fetched> = rows.into_iter().map(|r| r.0).collect();
        if rows.is_empty() {
            // Nothing held: end the transaction now and hand the connection back to the pool.
            let c = d.conn.as_mut().expect("still held");
            AnsiTransactionManager::commit_transaction(&mut **c)
                .await
                .map_err(|e| self.err(e))?;
            drop(d.conn.take());
            return Ok((rows, Box::new(EmptyDelivery)));
        }
        d.fetched = shared::fetched_state(&rows);
        Ok((rows, Box::new(d)))
    }

    async fn write_outcomes(
        &self,
        worker: &WorkerId,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        let b = shared::OutcomeBinds::new(outcomes, self.cfg.error_max_length);
        let w = worker.as_str().to_owned();
        let stmts = self.stmts.clone();
        let fail_flag = self.fail_next_commit.clone();
        let mut conn = self.conn().await?;
        // One transaction, one statement per outcome kind (R54).
        let applied: Vec<AppliedRow> = conn
            .transaction(async |c| {
                let mut applied = Vec::new();
                if !b.done.is_empty() {
                    let q = diesel::sql_query(stmts.complete.as_str())
                        .into_boxed()
                        .bind::<Array<SqlUuid>, _>(b.done)
                        .bind::<Text, _>(w.clone());
                    load_applied(q, c, &mut applied).await?;
                }
                if !b.fail_ids.is_empty() {
                    let q = diesel::sql_query(stmts.fail.as_str())
                        .into_boxed()
                        .bind::<Array<SqlUuid>, _>(b.fail_ids)
                        .bind::<Array<Bool>, _>(b.fail_counted)
                        .bind::<Array<Text>, _>(b.fail_errors)
                        .bind::<Array<Nullable<BigInt>>, _>(b.fail_after_us)
                        .bind::<Array<Nullable<Timestamptz>>, _>(b.fail_at)
                        .bind::<Text, _>(w.clone());
                    load_applied(q, c, &mut applied).await?;
                }
                if !b.released.is_empty() {
                    let q = diesel::sql_query(stmts.release.as_str())
                        .into_boxed()
                        .bind::<Array<SqlUuid>, _>(b.released)
                        .bind::<Text, _>(w.clone());
                    load_applied(q, c, &mut applied).await?;
                }
                if fail_flag.swap(false, Ordering::SeqCst) {
                    // The statements ran; returning an error rolls all of them back (R57).
                    return Err(TxError::Repo(RepositoryError::Other(
                        "injected failure of the outcome commit (fail_next_outcome_commit)".into(),
                    )));
                }
                Ok(applied)
            })
            .await
            .map_err(|e| self.tx_err(e))?;
        let mut results: HashMap<Uuid, OutcomeResult> = HashMap::with_capacity(applied.len());
        for a in applied {
            let (id, r) = a.result()?;
            results.insert(id, r);
        }
        Ok(shared::written_outcomes(outcomes, &results))
    }

    async fn refresh_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        Ok(self
            .exec_id_worker(&self.stmts.refresh_lock, id, worker)
            .await?
            == 1)
    }

    async fn release_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        Ok(self
            .exec_id_worker(&self.stmts.release_lock, id, worker)
            .await?
            == 1)
    }

    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError> {
        let expected = ids.len() as u64;
        let ids = ids.to_vec();
        let w = worker.as_str().to_owned();
        let sql = self.stmts.release_locks.as_str();
        let mut conn = self.conn().await?;
        conn.transaction(async |c| {
            let n = diesel::sql_query(sql)
                .bind::<Array<SqlUuid>, _>(ids)
                .bind::<Text, _>(w)
                .execute(c)
                .await? as u64;
            if n != expected {
                // Roll back: the bulk release changes nothing unless every id was held (R24).
                return Err(TxError::Repo(RepositoryError::ReleaseMismatch {
                    changed: n,
                    expected,
                }));
            }
            Ok(n)
        })
        .await
        .map_err(|e| self.tx_err(e))
    }

    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError> {
        args::stale_timeout(timeout)?;
        let batch = self.cfg.batch_size as i64;
        let mut conn = self.conn().await?;
        let mut total = 0u64;
        for _ in 0..STALE_LOCK_MAX_BATCHES {
            let n = diesel::sql_query(self.stmts.release_stale.as_str())
                .bind::<BigInt, _>(sql::micros(timeout))
                .bind::<BigInt, _>(batch)
                .execute(&mut conn)
                .await
                .map_err(|e| self.err(e))? as u64;
            total += n;
            if n < batch as u64 {
                break;
            }
        }
        Ok(total)
    }

    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError> {
        let mut conn = self.conn().await?;
        let n = diesel::sql_query(self.stmts.requeue.as_str())
            .bind::<SqlUuid, _>(id)
            .execute(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(n == 1)
    }

    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError> {
        args::cleanup(retention_days, batch_size)?;
        let mut conn = self.conn().await?;
        let n = diesel::sql_query(self.stmts.delete_old_completed.as_str())
            .bind::<Int4, _>(i32::try_from(retention_days).unwrap_or(i32::MAX))
            .bind::<BigInt, _>(i64::try_from(batch_size).unwrap_or(i64::MAX))
            .execute(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(n as u64)
    }

    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError> {
        let text = force_unlock_text(reason)?;
        let mut conn = self.conn().await?;
        let n = diesel::sql_query(self.stmts.force_unlock.as_str())
            .bind::<SqlUuid, _>(id)
            .bind::<Text, _>(text)
            .execute(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
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
        let mut conn = self.conn().await?;
        let b = BlockedKeysParams::new(lease_ttl, limit);
        let rows: Vec<BlockedRow> = diesel::sql_query(self.stmts.blocked_keys.as_str())
            .bind::<BigInt, _>(b.lease_us)
            .bind::<BigInt, _>(b.limit)
            .bind::<BigInt, _>(b.candidates)
            .bind::<BigInt, _>(b.waiting_cap)
            .load(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(rows.into_iter().map(BlockedKey::from).collect())
    }

    async fn counts(&self) -> Result<Vec<StatusCount>, RepositoryError> {
        let mut conn = self.conn().await?;
        let rows: Vec<CountRow> = diesel::sql_query(self.stmts.counts.as_str())
            .load(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        let mut out: Vec<StatusCount> = rows.into_iter().filter_map(CountRow::into_count).collect();
        out.sort();
        Ok(out)
    }

    async fn oldest_due_age(&self) -> Result<Option<Duration>, RepositoryError> {
        let mut conn = self.conn().await?;
        let r: AgeRow = diesel::sql_query(self.stmts.oldest_due_age.as_str())
            .get_result(&mut conn)
            .await
            .map_err(|e| self.err(e))?;
        Ok(r.age_us.map(|u| Duration::from_micros(u.max(0) as u64)))
    }
}

/// The two fetch statements on `c`, inside the caller's transaction: the heads
/// (`fetch_heads`, from `cursor`, which it advances), then `take` (`fetch_take` or
/// `fetch_take_transaction`), both prepared once per connection.
pub(crate) async fn fetch_in(
    c: &mut AsyncPgConnection,
    stmts: &Statements,
    take: Take,
    worker: String,
    p: &FetchParams,
    cursor: &WalkCursor,
) -> Result<Vec<FetchedRow>, diesel::result::Error> {
    // As outbox_postgres::fetch_rows: a delivery transaction releases its window's row locks
    // before the take, and a fetch whose candidates were all taken by others looks again, a
    // bounded number of times.
    let release_window = take == Take::Transaction;
    let take = stmts.take(take);
    for attempt in 1..=sql::FETCH_ATTEMPTS {
        if release_window {
            diesel::sql_query(stmts.window_savepoint.as_str())
                .execute(c)
                .await?;
        }
        let (ct, ck) = cursor.get();
        let heads: Vec<HeadRow> = Prepared(
            diesel::sql_query(stmts.fetch_heads.as_str())
                .into_boxed()
                .bind::<BigInt, _>(p.limit)
                .bind::<BigInt, _>(p.lease_us)
                .bind::<Nullable<Array<Text>>, _>(p.topics.clone())
                .bind::<Nullable<Array<Text>>, _>(p.aggregate_types.clone())
                .bind::<Nullable<Array<SqlUuid>>, _>(p.aggregate_ids.clone())
                .bind::<BigInt, _>(p.window)
                .bind::<BigInt, _>(p.walk_limit)
                .bind::<Text, _>(ct)
                .bind::<Text, _>(ck),
        )
        .load(c)
        .await?;
        let heads = HeadRows::new(
            heads
                .into_iter()
                .map(|h| (h.head_id, h.topic, h.partition_key)),
        );
        cursor.advance(heads.walked_to);
        if release_window {
            diesel::sql_query(stmts.window_release.as_str())
                .execute(c)
                .await?;
        }
        if heads.ids.is_empty() {
            return Ok(Vec::new());
        }
        let rows: Vec<FetchedRow> = Prepared(
            diesel::sql_query(take)
                .into_boxed()
                .bind::<Text, _>(worker.clone())
                .bind::<BigInt, _>(p.limit)
                .bind::<BigInt, _>(p.lease_us)
                .bind::<BigInt, _>(p.max_per_key)
                .bind::<Nullable<Array<Text>>, _>(p.topics.clone())
                .bind::<Nullable<Array<Text>>, _>(p.aggregate_types.clone())
                .bind::<Nullable<Array<SqlUuid>>, _>(p.aggregate_ids.clone())
                .bind::<Array<SqlUuid>, _>(heads.ids),
        )
        .load(c)
        .await?;
        if !rows.is_empty() || attempt == sql::FETCH_ATTEMPTS {
            return Ok(rows);
        }
    }
    Ok(Vec::new())
}

/// An open delivery transaction of the diesel backend (R84). Dropping it without a commit
/// detaches its connection from the pool and closes it, which rolls the transaction back.
struct DieselDelivery {
    conn: Option<PooledConnection>,
    repo: DieselOutboxRepository,
    worker: String,
    fetched: HashMap<Uuid, OutcomeResult>,
}

impl Drop for DieselDelivery {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            // Never hand a connection with an open transaction back to the pool.
            drop(deadpool::managed::Object::take(conn));
        }
    }
}

#[async_trait]
impl Delivery for DieselDelivery {
    async fn commit(
        mut self: Box<Self>,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        let repo = self.repo.clone();
        let b = shared::OutcomeBinds::new(
            &shared::delivery_writes(outcomes),
            repo.cfg.error_max_length,
        );
        let w = self.worker.clone();
        let c = self.conn.as_mut().expect("a delivery commits once");
        let mut applied = Vec::new();
        if !b.done.is_empty() {
            let q = diesel::sql_query(repo.stmts.complete_in_delivery.as_str())
                .into_boxed()
                .bind::<Array<SqlUuid>, _>(b.done)
                .bind::<Text, _>(w.clone());
            load_applied(q, c, &mut applied)
                .await
                .map_err(|e| repo.err(e))?;
        }
        if !b.fail_ids.is_empty() {
            let q = diesel::sql_query(repo.stmts.fail_in_delivery.as_str())
                .into_boxed()
                .bind::<Array<SqlUuid>, _>(b.fail_ids)
                .bind::<Array<Bool>, _>(b.fail_counted)
                .bind::<Array<Text>, _>(b.fail_errors)
                .bind::<Array<Nullable<BigInt>>, _>(b.fail_after_us)
                .bind::<Array<Nullable<Timestamptz>>, _>(b.fail_at)
                .bind::<Text, _>(w);
            load_applied(q, c, &mut applied)
                .await
                .map_err(|e| repo.err(e))?;
        }
        if repo.fail_next_commit.swap(false, Ordering::SeqCst) {
            // Roll back now, so the rows are free before this returns (TX-02); if that fails,
            // dropping self closes the connection, which rolls back too.
            if AnsiTransactionManager::rollback_transaction(&mut **c)
                .await
                .is_ok()
            {
                drop(self.conn.take());
            }
            return Err(RepositoryError::Other(
                "injected failure of the outcome commit (fail_next_outcome_commit)".into(),
            ));
        }
        AnsiTransactionManager::commit_transaction(&mut **c)
            .await
            .map_err(|e| repo.err(e))?;
        // Committed: the connection goes back to the pool.
        drop(self.conn.take());
        let mut results: HashMap<Uuid, OutcomeResult> = HashMap::with_capacity(applied.len());
        for a in applied {
            let (id, r) = a.result()?;
            results.insert(id, r);
        }
        Ok(shared::delivery_outcomes(outcomes, &results, &self.fetched))
    }

    async fn rollback(mut self: Box<Self>) {
        if let Some(c) = self.conn.as_mut()
            && AnsiTransactionManager::rollback_transaction(&mut **c)
                .await
                .is_ok()
        {
            drop(self.conn.take());
        }
    }
}
