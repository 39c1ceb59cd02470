//! The conformance harness of the sqlx backend (feature `testing`): a fresh schema per trial,
//! so trials run in parallel, and the fixtures of the conformance harness.
//!
//! * [`PgFactory`] makes a [`PgHarness`] per trial: a schema `obx_<random>`, the outbox table
//!   in it (default name `outbox_events`, or another validated name), an `aggregates` table
//!   for the writers' application lock, and a small pool whose sessions run with
//!   `TimeZone = 'America/New_York'` (so the time-zone trap of R79 is exercised by every trial,
//!   and PG-09 checks it). The schema is dropped when the harness is dropped.
//! * `advance(d)` shifts every row's times back by d ([`crate::sql::Statements::shift_clock`]).
//! * `sql` runs a statement on the harness's pool, `{table}` replaced by the quoted qualified
//!   table name and `{schema}` by the quoted schema; statements that return rows (SELECT, WITH,
//!   or with RETURNING) come back as JSON objects, others run as a simple query and return none.
//! * To act as the *peer* backend of another harness (outbox-diesel's PG-06 and S-02), use
//!   [`PgHarness::attach`] on that harness's schema and table, then
//!   [`PgHarness::sqlx_repository`] and [`PgHarness::begin_tx`].
//!
//! The database URL comes from `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`); an unreachable database fails the trial.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use outbox_conformance::harness::{BackendKind, Factory, Harness, RowPatch, WriteTx};
use outbox_core::error::RepositoryError;
use outbox_core::event::NewEvent;
use outbox_core::repository::{OutboxRepository, WriteResult};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Postgres, Row, Transaction};
use uuid::Uuid;

use crate::sql::{self, Layout, Statements, TableName};
use crate::{PgConfig, PgOutboxRepository, PgOutboxWriter, create_schema, create_schema_with};

/// The default database URL of the tests.
pub const DEFAULT_DATABASE_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// `DATABASE_URL` or the default.
pub fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| DEFAULT_DATABASE_URL.to_owned())
}

/// A fresh schema name `obx_<12 hex>`.
pub fn fresh_schema_name() -> String {
    format!("obx_{}", &Uuid::new_v4().simple().to_string()[..12])
}

/// Connections the Postgres test harnesses of one test process hold at most at once, unless
/// `OUTBOX_TEST_PG_CONNECTIONS` says otherwise: the database's 100 are shared with other
/// clients (other test processes, other people), and trials running in parallel must not take
/// them all.
pub const DEFAULT_TEST_CONNECTIONS: u32 = 40;

/// How long a trial waits for its share of the budget, and for the database to accept a
/// connection, before it fails.
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(90);

fn budget() -> &'static (Arc<tokio::sync::Semaphore>, u32) {
    static BUDGET: std::sync::OnceLock<(Arc<tokio::sync::Semaphore>, u32)> =
        std::sync::OnceLock::new();
    BUDGET.get_or_init(|| {
        let n = std::env::var("OUTBOX_TEST_PG_CONNECTIONS")
            .ok()
            .and_then(|v| v.parse::<u32>().ok())
            .filter(|n| *n >= 1)
            .unwrap_or(DEFAULT_TEST_CONNECTIONS);
        (Arc::new(tokio::sync::Semaphore::new(n as usize)), n)
    })
}

/// A share of the process's connection budget ([`DEFAULT_TEST_CONNECTIONS`]), held by a
/// harness for as long as its pool lives; dropping it gives the share back.
#[derive(Debug)]
pub struct ConnectionShare(Option<tokio::sync::OwnedSemaphorePermit>);

impl ConnectionShare {
    /// Whether the share came out of the budget (false: granted over it after the wait).
    pub fn is_within_budget(&self) -> bool {
        self.0.is_some()
    }
}

/// Reserves `n` connections of the process's budget, waiting while other trials hold it. A
/// trial that takes a second share while holding one could wait for trials that wait for it, so
/// after [`CONNECT_PATIENCE`] the share is granted anyway (with a note on stderr): the budget
/// then stretches instead of the tests deadlocking. The semaphore is runtime-independent, so
/// trials on separate tokio runtimes share it.
pub async fn reserve_connections(n: u32) -> ConnectionShare {
    let (sem, total) = budget();
    let n = n.min(*total);
    match tokio::time::timeout(CONNECT_PATIENCE, sem.clone().acquire_many_owned(n)).await {
        Ok(Ok(p)) => ConnectionShare(Some(p)),
        _ => {
            eprintln!(
                "outbox test harness: waited {CONNECT_PATIENCE:?} for {n} of {total} test connections; going over the budget"
            );
            ConnectionShare(None)
        }
    }
}

/// Runs `connect` until it succeeds, waiting 20 ms doubling to 1 s between tries, for at most
/// [`CONNECT_PATIENCE`]: a database that is busy ("too many clients"), restarting or briefly
/// unreachable does not fail a trial. The last error is returned after that.
pub async fn connect_patiently<T, E, F, Fut>(mut connect: F) -> Result<T, E>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let deadline = tokio::time::Instant::now() + CONNECT_PATIENCE;
    let mut wait = Duration::from_millis(20);
    loop {
        match connect().await {
            Ok(v) => return Ok(v),
            Err(e) if tokio::time::Instant::now() + wait >= deadline => return Err(e),
            Err(_) => {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(1));
            }
        }
    }
}

/// A small pool for one trial: at most `max` connections, sessions in `America/New_York`.
/// Opening connections waits while the database has no free slot (sqlx retries "too many
/// clients" until the acquire timeout, [`CONNECT_PATIENCE`]). Take a [`reserve_connections`]
/// share of `max` first.
pub async fn trial_pool(url: &str, max: u32) -> PgPool {
    let opts: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .expect("DATABASE_URL is a valid postgres URL");
    PgPoolOptions::new()
        .after_connect(|conn, _meta| {
            Box::pin(async move {
                sqlx::query("SET TIME ZONE 'America/New_York'")
                    .execute(conn)
                    .await
                    .map(|_| ())
            })
        })
        .max_connections(max)
        .min_connections(0)
        .acquire_timeout(CONNECT_PATIENCE)
        .connect_with(opts)
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is unreachable: {e}"))
}

/// The pool size of one harness.
pub const HARNESS_CONNECTIONS: u32 = 8;

/// The share of the budget one harness pool reserves: what a trial's pool holds at its busiest
/// in the suite's scenarios (a writer transaction, a fetch or outcome write, a fixture
/// statement), not its cap. Scenarios that open more (stand tests) rely on connecting
/// patiently. With 4 test threads and up to 3 harnesses per test, 4 × 3 × 3 = 36 stays under
/// the default budget, so no trial waits forever on another.
pub const HARNESS_SHARE: u32 = 3;

/// Makes a fresh [`PgHarness`] per trial.
#[derive(Debug, Clone)]
pub struct PgFactory {
    url: String,
    table: String,
    ancestor: bool,
    layout: Layout,
}

impl Default for PgFactory {
    fn default() -> Self {
        Self::new()
    }
}

impl PgFactory {
    /// The default table name on `DATABASE_URL`.
    pub fn new() -> Self {
        Self {
            url: database_url(),
            table: sql::DEFAULT_TABLE.to_owned(),
            ancestor: false,
            layout: Layout::Plain,
        }
    }

    /// Each trial's table has the partitioned layout ([`create_schema_with`] with
    /// [`Layout::Partitioned`]), and the repository, its writer and `create_schema_for` use
    /// that layout.
    pub fn partitioned(mut self) -> Self {
        self.layout = Layout::Partitioned;
        self
    }

    /// Creates each trial's table with the ancestor's DDL exactly as the ancestor library created it (R78)
    /// writes it (`outbox_conformance::scenarios::pg::ANCESTOR_DDL`) instead of this crate's
    /// schema creation.
    pub fn ancestor_ddl(mut self) -> Self {
        self.ancestor = true;
        self
    }

    /// Another (bare) table name; it is placed in the trial's schema.
    pub fn with_table(mut self, table: &str) -> Self {
        self.table = table.to_owned();
        self
    }
}

#[async_trait]
impl Factory for PgFactory {
    async fn create(&self) -> Arc<dyn Harness> {
        if self.ancestor {
            Arc::new(PgHarness::create_ancestor(&self.url, &self.table).await)
        } else {
            Arc::new(PgHarness::create_with(&self.url, &self.table, self.layout).await)
        }
    }
}

/// One trial's store: a schema of its own with the outbox table.
pub struct PgHarness {
    url: String,
    pool: PgPool,
    schema: String,
    table: TableName,
    layout: Layout,
    stmts: Arc<Statements>,
    repo: Arc<PgOutboxRepository>,
    owns_schema: bool,
    /// The pool's share of the connection budget.
    _share: ConnectionShare,
}

impl std::fmt::Debug for PgHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgHarness")
            .field("schema", &self.schema)
            .field("table", &self.table)
            .finish()
    }
}

impl PgHarness {
    /// A fresh schema with the outbox table `table` (bare name) and the `aggregates` table.
    pub async fn create(url: &str, table: &str) -> Self {
        Self::create_with(url, table, Layout::Plain).await
    }

    /// [`PgHarness::create`] with the table in `layout`.
    pub async fn create_with(url: &str, table: &str, layout: Layout) -> Self {
        let schema = fresh_schema_name();
        let table = TableName::new(&format!("{schema}.{table}")).expect("valid table name");
        let share = reserve_connections(HARNESS_SHARE).await;
        let pool = trial_pool(url, HARNESS_CONNECTIONS).await;
        create_schema_with(&pool, &table, layout)
            .await
            .expect("schema creation");
        sqlx::query(AssertSqlSafe(sql::fixtures::create_aggregates(&schema)))
            .execute(&pool)
            .await
            .expect("aggregates table");
        Self::with_pool(url, pool, share, schema, table, true).with_layout(layout)
    }

    /// The same harness with the repository (and its writer) in `layout`.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self.repo = Arc::new(PgOutboxRepository::new(
            self.pool.clone(),
            PgConfig::default().table(self.table.clone()).layout(layout),
        ));
        self
    }

    /// The trial table's layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// A fresh schema whose outbox table is created with the ancestor's exact DDL (Appendix A).
    pub async fn create_ancestor(url: &str, table: &str) -> Self {
        let schema = fresh_schema_name();
        let table = TableName::new(&format!("{schema}.{table}")).expect("valid table name");
        let share = reserve_connections(HARNESS_SHARE).await;
        let pool = trial_pool(url, HARNESS_CONNECTIONS).await;
        sqlx::raw_sql(AssertSqlSafe(format!("CREATE SCHEMA \"{schema}\"")))
            .execute(&pool)
            .await
            .expect("create schema");
        let ddl = outbox_conformance::scenarios::pg::ancestor_ddl(&schema, table.table());
        sqlx::raw_sql(AssertSqlSafe(ddl))
            .execute(&pool)
            .await
            .expect("ancestor DDL");
        sqlx::query(AssertSqlSafe(sql::fixtures::create_aggregates(&schema)))
            .execute(&pool)
            .await
            .expect("aggregates table");
        Self::with_pool(url, pool, share, schema, table, true)
    }

    /// A harness on an existing table (created by someone else), for use as a peer backend.
    /// It does not drop the schema.
    pub async fn attach(url: &str, table: &TableName) -> Self {
        let schema = table.schema().unwrap_or("public").to_owned();
        let share = reserve_connections(HARNESS_SHARE).await;
        let pool = trial_pool(url, HARNESS_CONNECTIONS).await;
        sqlx::query(AssertSqlSafe(sql::fixtures::create_aggregates(&schema)))
            .execute(&pool)
            .await
            .expect("aggregates table");
        Self::with_pool(url, pool, share, schema, table.clone(), false)
    }

    /// An empty schema without any table (for scenarios that create tables themselves).
    /// Dropped with the harness.
    fn with_pool(
        url: &str,
        pool: PgPool,
        share: ConnectionShare,
        schema: String,
        table: TableName,
        owns: bool,
    ) -> Self {
        let repo = Arc::new(PgOutboxRepository::new(
            pool.clone(),
            PgConfig::default().table(table.clone()),
        ));
        Self {
            url: url.to_owned(),
            pool,
            schema,
            stmts: Arc::new(Statements::new(&table)),
            table,
            layout: Layout::Plain,
            repo,
            owns_schema: owns,
            _share: share,
        }
    }

    /// The sqlx repository of this trial.
    pub fn sqlx_repository(&self) -> Arc<PgOutboxRepository> {
        self.repo.clone()
    }

    /// The pool of this trial.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The trial's schema.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The trial's table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// Begins a writer transaction with the sqlx writer.
    pub async fn begin_tx(&self) -> Box<dyn WriteTx> {
        let tx = self.pool.begin().await.expect("begin");
        Box::new(SqlxWriteTx {
            tx: Some(tx),
            writer: self.repo.writer(),
            schema: self.schema.clone(),
        })
    }
}

impl Drop for PgHarness {
    fn drop(&mut self) {
        if !self.owns_schema {
            return;
        }
        let url = self.url.clone();
        let schema = self.schema.clone();
        // Runs on a thread of its own with its own runtime: Drop cannot await.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                if let Ok(mut c) = connect_patiently(|| sqlx::PgConnection::connect(&url)).await {
                    let _ = sqlx::query(AssertSqlSafe(sql::fixtures::drop_schema(&schema)))
                        .execute(&mut c)
                        .await;
                    let _ = c.close().await;
                }
            });
        })
        .join();
    }
}

/// A writer transaction of the sqlx backend (the suite's [`WriteTx`]).
pub struct SqlxWriteTx {
    tx: Option<Transaction<'static, Postgres>>,
    writer: PgOutboxWriter,
    schema: String,
}

impl SqlxWriteTx {
    /// Wraps an open transaction and a writer.
    pub fn new(tx: Transaction<'static, Postgres>, writer: PgOutboxWriter, schema: &str) -> Self {
        Self {
            tx: Some(tx),
            writer,
            schema: schema.to_owned(),
        }
    }

    fn tx(&mut self) -> &mut Transaction<'static, Postgres> {
        self.tx.as_mut().expect("transaction open")
    }
}

#[async_trait]
impl WriteTx for SqlxWriteTx {
    async fn write(&mut self, events: Vec<NewEvent>) -> Result<Vec<WriteResult>, RepositoryError> {
        let writer = self.writer.clone();
        writer.write(self.tx(), events).await
    }

    async fn lock_app(&mut self, name: &str) {
        let ensure = sql::fixtures::ensure_aggregate(&self.schema);
        let lock = sql::fixtures::lock_aggregate(&self.schema);
        let tx = self.tx();
        sqlx::query(AssertSqlSafe(ensure))
            .bind(name)
            .execute(&mut **tx)
            .await
            .expect("insert aggregate row");
        sqlx::query(AssertSqlSafe(lock))
            .bind(name)
            .fetch_one(&mut **tx)
            .await
            .expect("lock aggregate row");
    }

    async fn touch(&mut self) {
        sqlx::query("SELECT txid_current()")
            .execute(&mut **self.tx())
            .await
            .expect("touch");
    }

    async fn commit(mut self: Box<Self>) -> Result<(), RepositoryError> {
        let table = self.writer_table();
        self.tx
            .take()
            .expect("open")
            .commit()
            .await
            .map_err(|e| crate::driver::sqlx::map_err(&table, e))
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), RepositoryError> {
        let table = self.writer_table();
        self.tx
            .take()
            .expect("open")
            .rollback()
            .await
            .map_err(|e| crate::driver::sqlx::map_err(&table, e))
    }
}

impl SqlxWriteTx {
    fn writer_table(&self) -> TableName {
        self.writer.table().clone()
    }
}

fn returns_rows(statement: &str) -> bool {
    let s = statement.trim_start().to_ascii_lowercase();
    s.starts_with("select")
        || s.starts_with("with")
        || s.starts_with("values")
        || s.starts_with("table")
        || s.contains(" returning ")
        || s.contains("\nreturning ")
}

#[async_trait]
impl Harness for PgHarness {
    fn kind(&self) -> BackendKind {
        BackendKind::Postgres
    }

    fn repository(&self) -> Arc<dyn OutboxRepository> {
        self.repo.clone()
    }

    async fn begin(&self) -> Box<dyn WriteTx> {
        self.begin_tx().await
    }

    async fn advance(&self, d: Duration) {
        sqlx::query(AssertSqlSafe(self.stmts.shift_clock.as_str()))
            .bind(sql::micros(d))
            .execute(&self.pool)
            .await
            .expect("advance: shift the table's times");
    }

    async fn set(&self, id: Uuid, p: RowPatch) {
        let mut sets: Vec<String> = Vec::new();
        let mut n = 1;
        let mut next = |col: &str, cast: &str, sets: &mut Vec<String>| {
            n += 1;
            sets.push(format!("{col} = ${n}::{cast}"));
        };
        // Bind order follows the order of `next` calls below.
        if p.status.is_some() {
            next("status", "text", &mut sets);
        }
        if p.attempts_made.is_some() {
            next("attempts_made", "int4", &mut sets);
        }
        if p.max_attempts.is_some() {
            next("max_attempts", "int4", &mut sets);
        }
        if p.last_error.is_some() {
            next("last_error", "text", &mut sets);
        }
        if p.scheduled_at.is_some() {
            next("scheduled_at", "timestamptz", &mut sets);
        }
        if p.completed_at.is_some() {
            next("completed_at", "timestamptz", &mut sets);
        }
        if p.lock.is_some() {
            next("locked_by", "text", &mut sets);
            next("locked_at", "timestamptz", &mut sets);
        }
        if sets.is_empty() {
            return;
        }
        let text = format!(
            "UPDATE {} SET {} WHERE id = $1::uuid",
            self.table.qualified(),
            sets.join(", ")
        );
        let mut q = sqlx::query(AssertSqlSafe(text)).bind(id);
        if let Some(v) = p.status {
            q = q.bind(v.as_str());
        }
        if let Some(v) = p.attempts_made {
            q = q.bind(v);
        }
        if let Some(v) = p.max_attempts {
            q = q.bind(v);
        }
        if let Some(v) = p.last_error {
            q = q.bind(v);
        }
        if let Some(v) = p.scheduled_at {
            q = q.bind(v);
        }
        if let Some(v) = p.completed_at {
            q = q.bind(v);
        }
        if let Some(v) = p.lock {
            q = q.bind(v.as_ref().map(|(w, _)| w.clone()));
            q = q.bind(v.map(|(_, t)| t));
        }
        let n = q.execute(&self.pool).await.expect("set").rows_affected();
        assert_eq!(n, 1, "set: no row {id}");
    }

    fn fail_next_outcome_commit(&self) {
        self.repo.fail_next_outcome_commit();
    }

    fn try_configure(
        &self,
        batch_size: usize,
        error_max_length: usize,
    ) -> Option<Result<(), String>> {
        Some(
            PgConfig::default()
                .batch_size(batch_size)
                .and_then(|c| c.error_max_length(error_max_length))
                .map(|_| ())
                .map_err(|e| e.to_string()),
        )
    }

    async fn create_schema_for(&self, table: &str) -> Option<Result<(), String>> {
        let t = match TableName::new(table) {
            Ok(t) => t,
            Err(e) => return Some(Err(e.to_string())),
        };
        Some(
            create_schema_with(&self.pool, &t, self.layout)
                .await
                .map_err(|e| e.to_string()),
        )
    }

    async fn sql(&self, statement: &str) -> Result<Vec<serde_json::Value>, String> {
        let text = statement
            .replace("{table}", &self.table.qualified())
            .replace("{schema}", &format!("\"{}\"", self.schema));
        if returns_rows(&text) {
            let wrapped = format!("WITH q__ AS ({text}) SELECT to_jsonb(q__) FROM q__");
            let rows = sqlx::query(AssertSqlSafe(wrapped))
                .fetch_all(&self.pool)
                .await
                .map_err(|e| e.to_string())?;
            rows.iter()
                .map(|r| {
                    r.try_get::<serde_json::Value, _>(0)
                        .map_err(|e| e.to_string())
                })
                .collect()
        } else {
            sqlx::raw_sql(AssertSqlSafe(text))
                .execute(&self.pool)
                .await
                .map_err(|e| e.to_string())?;
            Ok(Vec::new())
        }
    }
}

/// The backlog shapes of the fetch benchmark and the plan test (issue: "the fetch must stay
/// flat"), built with plain SQL in the given table.
pub mod shapes {
    use sqlx::AssertSqlSafe;
    use sqlx::postgres::PgPool;

    use crate::sql::TableName;

    /// A backlog shape.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Shape {
        /// (a) 20,000 pending over 1,000 keys.
        A,
        /// (b) 100,000 pending, one row per key.
        B,
        /// (c) one key with 100,000 pending (written first) plus 1,000 other keys (5 rows each).
        C,
        /// (d) (a) plus 3,000,000 completed rows.
        D,
        /// (e) (a) with 10% of the rows locked by a crashed worker whose lease expired.
        E,
        /// (f) one key whose head waits for a retry an hour later with 10,000 rows behind it,
        /// plus 100,000 keys of one due row each, all newer.
        F,
        /// (g) 100 keys like (f)'s with 1,000 rows behind each, plus 10,000 keys of one row.
        G,
        /// One key `stuck` whose head waits for a retry an hour later (attempts_made 1) with
        /// `behind` due rows behind it, then `keys` keys of one due row each, all newer (the
        /// shape of PG-11, at a size a test picks).
        Stuck {
            /// Rows behind the blocked head.
            behind: u64,
            /// One-row keys written after them.
            keys: u64,
        },
    }

    impl Shape {
        /// All shapes.
        pub const ALL: [Shape; 7] = [
            Shape::A,
            Shape::B,
            Shape::C,
            Shape::D,
            Shape::E,
            Shape::F,
            Shape::G,
        ];

        /// A one-line description.
        pub fn describe(self) -> &'static str {
            match self {
                Shape::A => "(a) 20,000 pending over 1,000 keys",
                Shape::B => "(b) 100,000 pending, one per key",
                Shape::C => "(c) one key with 100,000 pending + 1,000 other keys",
                Shape::D => "(d) (a) + 3,000,000 completed",
                Shape::E => "(e) (a) with 10% held by a crashed worker (lease expired)",
                Shape::F => "(f) a blocked key with 10,000 behind + 100,000 one-row keys",
                Shape::G => "(g) 100 blocked keys with 1,000 behind each + 10,000 one-row keys",
                Shape::Stuck { .. } => "a blocked key with rows behind + one-row keys",
            }
        }
    }

    /// `n` rows: key of row g is `key_expr` (SQL over g), created_at = base + g ms, all due.
    fn insert(t: &TableName, n: u64, key_expr: &str, status: &str, base: &str) -> String {
        let completed = if status == "completed" {
            "ts + interval '1 second'"
        } else {
            "NULL"
        };
        format!(
            "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, scheduled_at, \
             completed_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
             SELECT gen_random_uuid(), 'bench.event', '{{\"n\": 1}}', '{status}', 0, 6, ts, {completed}, ts, ts, \
                    'agg', gen_random_uuid(), 'bench', {key_expr} \
               FROM generate_series(1, {n}) g, \
                    LATERAL (SELECT now() - interval '{base}' + g * interval '1 millisecond' AS ts) x",
            q = t.qualified()
        )
    }

    /// `n` heads blocked by a counted failure (attempts_made 1, last_error set, next try an
    /// hour after now), key of row g = `key_expr`, created_at = base + g ms.
    fn insert_blocked(t: &TableName, n: u64, key_expr: &str, base: &str) -> String {
        format!(
            "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, last_error, \
             scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
             SELECT gen_random_uuid(), 'bench.event', '{{\"n\": 1}}', 'pending', 1, 6, 'broker said no', \
                    now() + interval '1 hour', ts, ts, 'agg', gen_random_uuid(), 'bench', {key_expr} \
               FROM generate_series(1, {n}) g, \
                    LATERAL (SELECT now() - interval '{base}' + g * interval '1 millisecond' AS ts) x",
            q = t.qualified()
        )
    }

    /// Fills the (empty) table with `shape` and analyzes it.
    pub async fn build(pool: &PgPool, t: &TableName, shape: Shape) -> Result<(), sqlx::Error> {
        let mut stmts = Vec::new();
        let a = || {
            insert(
                t,
                20_000,
                "'k' || (hashint4(g::int4) & 1023) % 1000",
                "pending",
                "1 hour",
            )
        };
        match shape {
            Shape::A => stmts.push(a()),
            Shape::B => stmts.push(insert(t, 100_000, "'k' || g", "pending", "1 hour")),
            Shape::C => {
                stmts.push(insert(t, 100_000, "'hot'", "pending", "3 hours"));
                stmts.push(insert(t, 5_000, "'k' || (g % 1000)", "pending", "1 hour"));
            }
            Shape::D => {
                stmts.push(insert(
                    t,
                    3_000_000,
                    "'k' || (g % 1000)",
                    "completed",
                    "40 days",
                ));
                stmts.push(a());
            }
            Shape::E => {
                stmts.push(a());
                stmts.push(format!(
                    "UPDATE {q} SET locked_at = now() - interval '10 minutes', locked_by = 'crashed-relay' \
                     WHERE hashint4(extract(epoch FROM created_at)::int4 # hashtext(id::text)) % 10 = 0",
                    q = t.qualified()
                ));
            }
            Shape::F => {
                stmts.push(insert_blocked(t, 1, "'stuck'", "5 hours"));
                stmts.push(insert(t, 10_000, "'stuck'", "pending", "4 hours"));
                stmts.push(insert(t, 100_000, "'k' || g", "pending", "1 hour"));
            }
            Shape::G => {
                stmts.push(insert_blocked(t, 100, "'stuck' || g", "5 hours"));
                stmts.push(insert(
                    t,
                    100_000,
                    "'stuck' || (g % 100 + 1)",
                    "pending",
                    "4 hours",
                ));
                stmts.push(insert(t, 10_000, "'k' || g", "pending", "1 hour"));
            }
            Shape::Stuck { behind, keys } => {
                stmts.push(insert_blocked(t, 1, "'stuck'", "5 hours"));
                stmts.push(insert(t, behind, "'stuck'", "pending", "4 hours"));
                stmts.push(insert(t, keys, "'k' || g", "pending", "1 hour"));
            }
        }
        stmts.push(format!("ANALYZE {}", t.qualified()));
        for s in stmts {
            sqlx::raw_sql(AssertSqlSafe(s)).execute(pool).await?;
        }
        Ok(())
    }
}

/// End to end through a real broker (issue 5): 4 keys × 15 events, each written by
/// [`PgOutboxWriter`] in its own committed transaction, plus one rolled-back write that must
/// never arrive, drained by the relay on [`PgOutboxRepository`] into a fresh trial of `broker`;
/// a consumer must read every event, in order per key, with its headers
/// ([`outbox_conformance::broker::drain_and_consume`]). Fresh schema, dropped afterwards.
pub async fn postgres_to_broker(broker: &dyn outbox_conformance::broker::BrokerUnderTest) {
    use outbox_conformance::broker::{TrialOptions, drain_and_consume, e2e_event};
    let _share = reserve_connections(4).await;
    let pool = trial_pool(&database_url(), 4).await;
    let schema = fresh_schema_name();
    let table = TableName::new(&format!("{schema}.outbox_events")).expect("valid table name");
    create_schema(&pool, &table)
        .await
        .expect("create the outbox table");
    let writer = PgOutboxWriter::new(&table);

    let mut written: std::collections::HashMap<String, Vec<Uuid>> = Default::default();
    for seq in 0..15 {
        for k in 0..4 {
            let key = format!("acct-{k}");
            let mut tx = pool.begin().await.expect("begin");
            let r = writer
                .write(&mut tx, vec![e2e_event("orders", &key, seq)])
                .await
                .expect("write");
            tx.commit().await.expect("commit");
            written.entry(key).or_default().push(r[0].event.id);
        }
    }
    // A rolled-back write never reaches the broker.
    let mut tx = pool.begin().await.expect("begin");
    writer
        .write(&mut tx, vec![e2e_event("orders", "acct-0", 99)])
        .await
        .expect("write");
    tx.rollback().await.expect("rollback");

    let repo = Arc::new(PgOutboxRepository::new(
        pool.clone(),
        PgConfig::default().table(table),
    ));
    let t = broker.trial(TrialOptions::default()).await;
    drain_and_consume(&*t, repo, "orders", &written).await;
    t.cleanup().await;
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(&pool)
        .await
        .expect("drop the trial schema");
}

/// Counts the wake-up notifications (empty payload) a writer sends on a table's channel,
/// without waiting on a timer: [`WakeProbe::wakeups`] commits a marker notification and reads
/// until the marker arrives. PostgreSQL delivers a listener's notifications in commit order, so
/// every wake-up committed before the marker has been read by then, and a rolled-back
/// transaction's never arrives.
pub struct WakeProbe {
    listener: sqlx::postgres::PgListener,
    pool: PgPool,
    channel: String,
    marks: u64,
}

impl WakeProbe {
    /// LISTENs on `table`'s channel ([`TableName::notify_channel`]).
    pub async fn listen(pool: &PgPool, table: &TableName) -> Self {
        let channel = table.notify_channel();
        let mut listener = sqlx::postgres::PgListener::connect_with(pool)
            .await
            .expect("listener connects");
        listener.listen(&channel).await.expect("LISTEN");
        Self {
            listener,
            pool: pool.clone(),
            channel,
            marks: 0,
        }
    }

    /// The number of wake-ups committed since the last call (or since LISTEN).
    pub async fn wakeups(&mut self) -> usize {
        self.marks += 1;
        let mark = format!("probe-mark-{}", self.marks);
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(&self.channel)
            .bind(&mark)
            .execute(&self.pool)
            .await
            .expect("marker notify");
        let mut n = 0;
        loop {
            let got = tokio::time::timeout(Duration::from_secs(10), self.listener.recv())
                .await
                .expect("the marker notification arrives within 10 s")
                .expect("listener recv");
            match got.payload() {
                "" => n += 1,
                p if p == mark => return n,
                p => panic!("unexpected payload {p:?} on {}", self.channel),
            }
        }
    }
}

/// Issue 14, an outcome commit cut off mid-way: the relay on `repo` (either Postgres backend,
/// on `h`'s table) publishes two rows; before it writes their outcomes a second connection
/// row-locks one of them, so the outcome transaction waits; that waiting backend is then ended
/// with `pg_terminate_backend` (what a database restart does to it) and the lock let go. The
/// relay must retry the outcome write on a fresh connection: the cycle reports no commit
/// failure, at least one retry, both rows completed and unheld. Returns the time from the
/// termination to the end of the cycle (the target: under 1 s).
pub async fn outcome_commit_survives_termination(
    repo: Arc<dyn OutboxRepository>,
    h: &PgHarness,
) -> Duration {
    use outbox_core::CancellationToken;
    use outbox_core::relay::Relay;
    use outbox_core::scripted::{Action, Gate, ScriptedBroker};
    let events = ["k1", "k2"]
        .iter()
        .map(|k| {
            NewEvent::builder()
                .event_type("test.event")
                .aggregate("agg", Uuid::new_v4())
                .topic("t")
                .partition_key(*k)
                .payload_json(serde_json::json!({ "k": k }))
                .build()
                .expect("valid event")
        })
        .collect();
    let mut tx = h.begin_tx().await;
    let ids: Vec<Uuid> = tx
        .write(events)
        .await
        .expect("write")
        .iter()
        .map(|r| r.event.id)
        .collect();
    tx.commit().await.expect("commit");

    let broker = ScriptedBroker::new();
    let gate = Gate::new();
    broker.set_default(Action::Gate(gate.clone()));
    let relay = Relay::builder(repo, Arc::new(broker.clone()))
        .worker_id("w1")
        .publish_concurrency(2)
        .build()
        .expect("relay");
    let cycle = tokio::spawn(async move { relay.cycle(&CancellationToken::new()).await });
    broker.wait_for_calls(|c| c.len() == 2).await;

    // Both rows are published and waiting at the gate; the fetch has committed. Row-lock one.
    let mut locker = h.pool().begin().await.expect("begin the locker");
    let locker_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *locker)
        .await
        .expect("pid");
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id FROM {} WHERE id = $1 FOR UPDATE",
        h.table().qualified()
    )))
    .bind(ids[0])
    .execute(&mut *locker)
    .await
    .expect("row lock");
    gate.open();

    // The relay's outcome transaction now waits for the locker. No event announces that a
    // backend started waiting for a lock, so this polls the server's view, bounded.
    let mut victim = None;
    for _ in 0..2000 {
        victim = sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1",
        )
        .bind(locker_pid)
        .fetch_optional(h.pool())
        .await
        .expect("pg_stat_activity");
        if victim.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let victim = victim.expect("the outcome transaction never waited for the row lock");
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(victim)
        .fetch_one(h.pool())
        .await
        .expect("pg_terminate_backend");
    assert!(terminated, "backend {victim} was not terminated");
    let cut = std::time::Instant::now();
    locker.rollback().await.expect("release the row lock");

    let report = cycle.await.expect("cycle task").expect("cycle");
    let took = cut.elapsed();
    assert!(!report.commit_failed, "{report:?}");
    assert!(report.commit_retries >= 1, "{report:?}");
    let mut completed = report.completed.clone();
    completed.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(completed, want, "{report:?}");
    for id in &ids {
        let row: (String, Option<String>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, locked_by FROM {} WHERE id = $1",
            h.table().qualified()
        )))
        .bind(id)
        .fetch_one(h.pool())
        .await
        .expect("row");
        assert_eq!(row, ("completed".to_owned(), None), "row {id}");
    }
    took
}

/// How a [`broker_outage_on_postgres`] trial takes the broker away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerFault {
    /// Connections are refused (nothing listens on the broker's port).
    Refuse,
    /// Connections stay open, new ones are accepted, and no byte gets through either way.
    BlackHole,
    /// Every connection, open or new, is reset (TCP RST) mid-stream.
    Reset,
}

/// A pipeline step for the fault trials: records each cycle's report with the time it ended,
/// and lets a trial wait for a condition over them (woken by every cycle's end, never by a
/// timer).
#[derive(Default)]
struct CycleLog {
    cycles: std::sync::Mutex<Vec<(std::time::Instant, outbox_core::relay::CycleReport)>>,
    changed: tokio::sync::Notify,
}

#[async_trait]
impl outbox_core::step::PipelineStep for CycleLog {
    async fn on_cycle_end(&self, r: &outbox_core::relay::CycleReport) {
        self.cycles
            .lock()
            .expect("log")
            .push((std::time::Instant::now(), r.clone()));
        self.changed.notify_waiters();
    }
}

impl CycleLog {
    /// Rows completed so far.
    fn completed(&self) -> usize {
        let c = self.cycles.lock().expect("log");
        c.iter().map(|(_, r)| r.completed.len()).sum()
    }

    /// Every report so far.
    fn reports(&self) -> Vec<outbox_core::relay::CycleReport> {
        let c = self.cycles.lock().expect("log");
        c.iter().map(|(_, r)| r.clone()).collect()
    }

    /// Waits until `pred` holds over the log (or `within` passes); returns whether it did.
    async fn wait(&self, within: Duration, pred: impl Fn(&Self) -> bool) -> bool {
        tokio::time::timeout(within, async {
            loop {
                let n = self.changed.notified();
                if pred(self) {
                    return;
                }
                n.await;
            }
        })
        .await
        .is_ok()
    }
}

/// A fault trial's table: a fresh schema with the outbox table holding `rounds` × `keys` events
/// (keys `acct-0`, `acct-1`, …, one event per key per round, topic `orders`).
struct FaultBacklog {
    schema: String,
    table: TableName,
    /// Each key's event ids in write order.
    written: std::collections::HashMap<String, Vec<Uuid>>,
}

impl FaultBacklog {
    async fn write(pool: &PgPool, keys: usize, rounds: usize) -> Self {
        let schema = fresh_schema_name();
        let table = TableName::new(&format!("{schema}.outbox_events")).expect("valid table name");
        create_schema(pool, &table)
            .await
            .expect("create the outbox table");
        let writer = PgOutboxWriter::new(&table);
        let mut written: std::collections::HashMap<String, Vec<Uuid>> = Default::default();
        let mut tx = pool.begin().await.expect("begin");
        for seq in 0..rounds {
            let events: Vec<NewEvent> = (0..keys)
                .map(|k| outbox_conformance::broker::e2e_event("orders", &format!("acct-{k}"), seq))
                .collect();
            for r in writer.write(&mut tx, events).await.expect("write") {
                written
                    .entry(r.event.partition_key.clone())
                    .or_default()
                    .push(r.event.id);
            }
        }
        tx.commit().await.expect("commit");
        Self {
            schema,
            table,
            written,
        }
    }

    fn total(&self) -> usize {
        self.written.values().map(Vec::len).sum()
    }

    /// The rows not completed or still held: (id, status, locked_by).
    async fn left(&self, pool: &PgPool) -> Vec<(Uuid, String, Option<String>)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, status, locked_by FROM {} WHERE status <> 'completed' OR locked_by IS NOT NULL",
            self.table.qualified()
        )))
        .fetch_all(pool)
        .await
        .expect("rows left")
    }

    /// Checks the first acknowledged publish of each event: every event once, per key in write
    /// order. Returns how many publishes repeated an event already published.
    fn check_first_publishes(&self, calls: &[outbox_core::scripted::Call]) -> usize {
        let first = outbox_conformance::broker::FirstDeliveries::of(
            calls
                .iter()
                .filter(|c| c.result.as_ref().is_some_and(Result::is_ok))
                .map(|c| (c.partition_key.clone(), c.event_id)),
        );
        assert_eq!(
            first.distinct,
            self.total(),
            "faults: every event was published"
        );
        assert_eq!(
            first.per_key, self.written,
            "faults: per key, first publishes in write order"
        );
        first.repeated
    }

    async fn drop_schema(self, pool: &PgPool) {
        sqlx::query(AssertSqlSafe(format!(
            "DROP SCHEMA \"{}\" CASCADE",
            self.schema
        )))
        .execute(pool)
        .await
        .expect("drop the trial schema");
    }
}

/// A broker wrapper that records when each publish was acknowledged (its `publish` returned
/// `Ok`), for the fault trials' time to the first publish.
struct AckTimes {
    inner: Arc<dyn outbox_core::Broker>,
    acks: Arc<std::sync::Mutex<Vec<std::time::Instant>>>,
}

#[async_trait]
impl outbox_core::Broker for AckTimes {
    async fn publish(
        &self,
        m: &outbox_core::Message,
    ) -> Result<outbox_core::Ack, outbox_core::BrokerError> {
        let r = self.inner.publish(m).await;
        if r.is_ok() {
            self.acks
                .lock()
                .expect("acks")
                .push(std::time::Instant::now());
        }
        r
    }

    fn messaging_system(&self) -> &'static str {
        self.inner.messaging_system()
    }

    fn destination_name(&self, m: &outbox_core::Message) -> String {
        self.inner.destination_name(m)
    }

    fn reconnects(&self) -> Option<outbox_core::broker::ReconnectWatch> {
        self.inner.reconnects()
    }

    async fn probe(&self) -> outbox_core::broker::Probe {
        self.inner.probe().await
    }
}

/// Issue 14's measurement of omni-box 0.3.1 (the ancestor) during a 10 s broker outage with
/// three relays, counted from PostgreSQL's WAL: 46,060 row updates on NATS, 55,426 on Redis.
/// The target is at most 10 % of it.
pub const ANCESTOR_OUTAGE_ROW_UPDATES: [(outbox_conformance::broker::BrokerKind, usize); 2] = [
    (outbox_conformance::broker::BrokerKind::Nats, 46_060),
    (outbox_conformance::broker::BrokerKind::Redis, 55_426),
];

/// What a [`broker_outage_on_postgres`] trial measured.
#[derive(Debug, Clone)]
pub struct OutageFigures {
    /// Relays (each a [`Relay::run_with`](outbox_core::relay::Relay::run_with) loop with its
    /// own broker connection, as separate processes would have).
    pub relays: usize,
    /// Cycles of all relays that fetched (rows or none) while the broker was away.
    pub cycles_during: usize,
    /// Rows the relays fetched while the broker was away.
    pub rows_fetched_during: usize,
    /// Row updates of the outbox table while the broker was away, counted by PostgreSQL (a
    /// statement trigger with a transition table logs each UPDATE's row count with
    /// `clock_timestamp()`), not by the relay: in the lease mode each fetched row is updated
    /// for its lease and again for its release; in transaction delivery only completions and
    /// counted failures are written.
    pub row_writes_during: i64,
    /// The ancestor's row updates in the same outage ([`ANCESTOR_OUTAGE_ROW_UPDATES`]).
    pub ancestor_row_writes: usize,
    /// From the broker answering again to the first acknowledged publish (an adapter's
    /// `publish` returning `Ok`).
    pub first_publish_after: Duration,
    /// From the broker answering again to the end of the first cycle with an acknowledged
    /// publish (that cycle may still wait for a publish sent into the fault).
    pub first_cycle_after: Duration,
    /// How long the broker was away.
    pub outage: Duration,
}

impl std::fmt::Display for OutageFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "outage {:.1?}, {} relays: {} cycles, {} rows fetched, {} row updates during it ({:.1} % of the ancestor's {}); first publish {:?} (end of its cycle {:?}) after the broker answered again",
            self.outage,
            self.relays,
            self.cycles_during,
            self.rows_fetched_during,
            self.row_writes_during,
            100.0 * self.row_writes_during as f64 / self.ancestor_row_writes as f64,
            self.ancestor_row_writes,
            self.first_publish_after,
            self.first_cycle_after
        )
    }
}

/// Issue 14's fault suite, broker side, in the setting: three relay loops
/// ([`outbox_core::relay::Relay::run_with`] with
/// [`RECOMMENDED_OUTAGE_BACKOFF`](outbox_core::relay::RECOMMENDED_OUTAGE_BACKOFF), the outage
/// back-off `outbox-relay` runs with) on PostgreSQL (the sqlx backend, a fresh schema) drain
/// 40 keys × 25 events into `b`, each relay through its own adapter connection to one
/// [`outbox_conformance::broker::LoopbackProxy`]. After 100 rows went out the proxy takes the
/// broker away (`fault`) for `outage`, then brings it back. Checks that every event arrives,
/// that per key first deliveries are in write order, and that every row ends completed and
/// released; returns the figures of the outage. Batch 50, publish timeout 2 s (the adapter's
/// own 1 s), poll interval 1 s, `delivery` mode.
pub async fn broker_outage_on_postgres(
    b: &dyn outbox_conformance::broker::BrokerUnderTest,
    fault: BrokerFault,
    outage: Duration,
    delivery: outbox_core::repository::DeliveryMode,
) -> OutageFigures {
    use outbox_conformance::broker::{FirstDeliveries, LoopbackProxy, TrialOptions};
    use outbox_core::CancellationToken;
    use outbox_core::relay::{CycleReport, RECOMMENDED_OUTAGE_BACKOFF, Relay, RunOptions};

    const RELAYS: usize = 3;

    let _share = reserve_connections(6).await;
    let pool = trial_pool(&database_url(), 6).await;
    let backlog = FaultBacklog::write(&pool, 40, 25).await;
    let (schema, table, total) = (&backlog.schema, backlog.table.clone(), backlog.total());
    // PostgreSQL counts the table's row updates, with the time of each statement.
    for ddl in [
        format!(
            "CREATE TABLE \"{schema}\".row_updates (at timestamptz NOT NULL DEFAULT clock_timestamp(), n bigint NOT NULL)"
        ),
        format!(
            "CREATE FUNCTION \"{schema}\".count_row_updates() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN INSERT INTO \"{schema}\".row_updates (n) SELECT count(*) FROM changed; RETURN NULL; END $$"
        ),
        format!(
            "CREATE TRIGGER count_row_updates AFTER UPDATE ON {} REFERENCING NEW TABLE AS changed \
             FOR EACH STATEMENT EXECUTE FUNCTION \"{schema}\".count_row_updates()",
            table.qualified()
        ),
    ] {
        sqlx::query(AssertSqlSafe(ddl))
            .execute(&pool)
            .await
            .expect("the row-update counter");
    }

    let proxy = LoopbackProxy::start(b.server_addr()).await;
    let t = b
        .trial(TrialOptions {
            connect_to: Some(proxy.addr()),
            adapter_timeout: Duration::from_secs(1),
        })
        .await;
    let log = Arc::new(CycleLog::default());
    let acks = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut relays = Vec::new();
    for i in 0..RELAYS {
        let broker = Arc::new(AckTimes {
            inner: if i == 0 {
                t.broker()
            } else {
                t.another_adapter().await
            },
            acks: acks.clone(),
        });
        relays.push(Arc::new(
            Relay::builder(
                Arc::new(PgOutboxRepository::new(
                    pool.clone(),
                    PgConfig::default().table(table.clone()),
                )),
                broker,
            )
            .worker_id(format!("faults-{i}"))
            .batch_size(50)
            .publish_timeout(Duration::from_secs(2))
            .poll_interval(Duration::from_secs(1))
            .delivery(delivery)
            .step(log.clone())
            .build()
            .expect("relay"),
        ));
    }
    let stop = CancellationToken::new();
    let tasks: Vec<_> = relays
        .iter()
        .map(|relay| {
            let (relay, stop) = (relay.clone(), stop.clone());
            tokio::spawn(async move {
                relay
                    .run_with(
                        stop,
                        RunOptions::new().outage_backoff(RECOMMENDED_OUTAGE_BACKOFF),
                    )
                    .await
            })
        })
        .collect();

    assert!(
        log.wait(Duration::from_secs(30), |l| l.completed() >= 100)
            .await,
        "faults: 100 rows were not published within 30 s"
    );
    let db_now = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT clock_timestamp()")
            .fetch_one(&pool)
            .await
            .expect("the database clock")
    };
    match fault {
        BrokerFault::Refuse => proxy.close().await,
        BrokerFault::BlackHole => proxy.stall(),
        BrokerFault::Reset => proxy.reset(),
    }
    let down = std::time::Instant::now();
    let db_down = db_now().await;
    let cycles_before = log.cycles.lock().expect("log").len();
    // The outage lasts what it lasts: this wait is the fault, not a wait for state.
    tokio::time::sleep(outage).await;
    let db_up = db_now().await;
    match fault {
        BrokerFault::Refuse => proxy.reopen().await,
        BrokerFault::BlackHole => proxy.resume(),
        BrokerFault::Reset => proxy.stop_resetting(),
    }
    let up = std::time::Instant::now();
    let (cycles_during, rows_fetched_during) = {
        let c = log.cycles.lock().expect("log");
        let during: Vec<&CycleReport> = c[cycles_before..]
            .iter()
            .filter(|(at, _)| *at <= up)
            .map(|(_, r)| r)
            .collect();
        (
            during.iter().filter(|r| !r.breaker_open).count(),
            during.iter().map(|r| r.fetched.len()).sum::<usize>(),
        )
    };
    let first_after = |l: &CycleLog| {
        l.cycles
            .lock()
            .expect("log")
            .iter()
            .find(|(at, r)| *at > up && !r.completed.is_empty())
            .map(|(at, _)| *at)
    };
    assert!(
        log.wait(Duration::from_secs(60), |l| first_after(l).is_some())
            .await,
        "faults: nothing was published within 60 s after the broker came back"
    );
    let first = first_after(&log).expect("checked");
    assert!(
        log.wait(Duration::from_secs(120), |l| l.completed() >= total)
            .await,
        "faults: the drain did not finish within 120 s after the broker came back ({} of {total})",
        log.completed()
    );
    stop.cancel();
    for (relay, task) in relays.iter().zip(tasks) {
        relay.waker().notify_one();
        task.await.expect("relay task").expect("relay loop");
    }
    let row_writes_during: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(sum(n), 0)::bigint FROM \"{schema}\".row_updates WHERE at >= $1 AND at < $2"
    )))
    .bind(db_down)
    .bind(db_up)
    .fetch_one(&pool)
    .await
    .expect("count the row updates");

    let delivered = FirstDeliveries::of_received(&t.read("orders").await);
    assert_eq!(delivered.distinct, total, "faults: every event arrived");
    assert_eq!(
        delivered.per_key, backlog.written,
        "faults: per key, first deliveries in write order"
    );
    let left = backlog.left(&pool).await;
    assert!(
        left.is_empty(),
        "faults: every row completed and released: {left:?}"
    );
    t.cleanup().await;
    proxy.shutdown().await;
    backlog.drop_schema(&pool).await;
    let ancestor_row_writes = ANCESTOR_OUTAGE_ROW_UPDATES
        .iter()
        .find(|(k, _)| *k == b.kind())
        .map_or(0, |(_, n)| *n);
    OutageFigures {
        relays: RELAYS,
        cycles_during,
        rows_fetched_during,
        row_writes_during,
        ancestor_row_writes,
        first_publish_after: acks
            .lock()
            .expect("acks")
            .iter()
            .filter(|at| **at > up)
            .min()
            .expect("a publish after the outage")
            .saturating_duration_since(up),
        first_cycle_after: first.saturating_duration_since(up),
        outage: up.saturating_duration_since(down),
    }
}

/// Issue 14's outage: 10 s.
pub const MEASURED_OUTAGE: Duration = Duration::from_secs(10);

/// [`broker_outage_on_postgres`] for [`MEASURED_OUTAGE`], printed, and held to the issue's
/// targets: at most 10 % of the ancestor's row updates and cycles during the outage (its cycles
/// taken as its row updates over 2 per row of a 50-row batch), in transaction delivery no
/// writes but the completions of the cycles in flight when the broker went away, and a publish
/// within 5 s after the broker answers again (the target is 1 s, printed; this bound only
/// catches a relay that waits for its back-off timer, up to 30 s, instead of the broker).
pub async fn broker_outage_recovers_within_bounds(
    b: &dyn outbox_conformance::broker::BrokerUnderTest,
    fault: BrokerFault,
    delivery: outbox_core::repository::DeliveryMode,
) -> OutageFigures {
    let f = broker_outage_on_postgres(b, fault, MEASURED_OUTAGE, delivery).await;
    println!("faults {:?} {fault:?} {delivery:?}: {f}", b.kind());
    let ancestor_cycles = f.ancestor_row_writes / (2 * 50);
    assert!(
        f.row_writes_during * 10 <= f.ancestor_row_writes as i64,
        "more than 10 % of the ancestor's row updates: {f}"
    );
    assert!(
        f.cycles_during * 10 <= ancestor_cycles,
        "more than 10 % of the ancestor's {ancestor_cycles} cycles: {f}"
    );
    if delivery == outbox_core::repository::DeliveryMode::Transaction {
        assert!(
            f.row_writes_during <= (f.relays * 50) as i64,
            "transaction delivery writes nothing during an outage: {f}"
        );
    }
    assert!(
        f.first_publish_after < Duration::from_secs(5),
        "no publish within 5 s after the broker came back: {f}"
    );
    f
}

/// What a [`database_faults_drain`] trial measured.
#[derive(Debug, Clone)]
pub struct DatabaseFaultFigures {
    /// Backends of the relay ended by `pg_terminate_backend` during the fault.
    pub terminated: usize,
    /// Cycles that fetched nothing or whose fetch failed (the cycle-end hook sees both as an
    /// empty report).
    pub empty_cycles: usize,
    /// Outcome writes retried after a transient failure (sum of `commit_retries`).
    pub commit_retries: u32,
    /// Outcome writes that failed for good (their rows waited for the lease).
    pub commit_failures: usize,
    /// Publishes of an event id that had been published before (at least once delivery).
    pub repeated_publishes: usize,
    /// From the end of the fault to the last row completed.
    pub drain_after: Duration,
    /// Whether a pinned snapshot (an open REPEATABLE READ transaction elsewhere) held back
    /// vacuum during the whole drain.
    pub pinned: bool,
    /// The whole drain.
    pub drain: Duration,
}

/// Issue 14's fault suite, database side: a relay loop on PostgreSQL (the sqlx backend, its own
/// pool with application name `outbox-faults-<schema>`) drains 8 keys × 40 events to a
/// scripted broker (1 ms per publish). For the first `fault` of the drain every backend of the
/// relay's pool is ended with `pg_terminate_backend` every 50 ms, so fetches, publishes' outcome
/// writes and idle connections are cut wherever they are. With `pin`, a REPEATABLE READ
/// transaction on another connection holds its snapshot (and so vacuum) for the whole drain.
/// Checks that every event is published, first publishes per key in write order, and every row
/// ends completed and released; returns the figures.
pub async fn database_faults_drain(fault: Duration, pin: bool) -> DatabaseFaultFigures {
    use outbox_core::CancellationToken;
    use outbox_core::relay::Relay;
    use outbox_core::scripted::{Action, ScriptedBroker};

    let _share = reserve_connections(8).await;
    let url = database_url();
    let admin = trial_pool(&url, 3).await;
    let backlog = FaultBacklog::write(&admin, 8, 40).await;
    let (schema, table, total) = (&backlog.schema, backlog.table.clone(), backlog.total());

    let mut pinned = None;
    if pin {
        let mut c = admin.begin().await.expect("begin the pin");
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *c)
            .await
            .expect("repeatable read");
        sqlx::query("SELECT txid_current()")
            .execute(&mut *c)
            .await
            .expect("take the snapshot");
        pinned = Some(c);
    }

    let app = format!("outbox-faults-{schema}");
    let opts: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .expect("DATABASE_URL is a valid postgres URL")
        .application_name(&app);
    let relay_pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(CONNECT_PATIENCE)
        .connect_lazy_with(opts);
    let broker = ScriptedBroker::new();
    broker.set_default(Action::Delay(Duration::from_millis(1)));
    let log = Arc::new(CycleLog::default());
    let relay = Arc::new(
        Relay::builder(
            Arc::new(PgOutboxRepository::new(
                relay_pool.clone(),
                PgConfig::default().table(table.clone()),
            )),
            Arc::new(broker.clone()),
        )
        .worker_id("faults-db")
        .batch_size(20)
        .max_per_key(4)
        .lease_ttl(Duration::from_secs(5))
        .publish_timeout(Duration::from_secs(1))
        .poll_interval(Duration::from_millis(200))
        .step(log.clone())
        .build()
        .expect("relay"),
    );
    let started = std::time::Instant::now();
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    // The fault: end every backend of the relay's pool every 50 ms.
    let mut terminated = 0usize;
    let fault_ends = std::time::Instant::now() + fault;
    while std::time::Instant::now() < fault_ends {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = $1",
        )
        .bind(&app)
        .fetch_one(&admin)
        .await
        .expect("pg_terminate_backend");
        terminated += n as usize;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fault_end = std::time::Instant::now();

    let finished = log
        .wait(Duration::from_secs(120), |l| l.completed() >= total)
        .await;
    let drained = std::time::Instant::now();
    stop.cancel();
    relay.waker().notify_one();
    task.await.expect("relay task").expect("relay loop");
    if let Some(c) = pinned.take() {
        c.rollback().await.expect("end the pin");
    }
    let left = backlog.left(&admin).await;
    assert!(
        finished && left.is_empty(),
        "faults: the drain did not finish within 120 s after the fault: {left:?}"
    );
    let repeated = backlog.check_first_publishes(&broker.calls());

    let reports = log.reports();
    relay_pool.close().await;
    backlog.drop_schema(&admin).await;
    DatabaseFaultFigures {
        terminated,
        empty_cycles: reports
            .iter()
            .filter(|r| r.fetched.is_empty() && !r.breaker_open)
            .count(),
        commit_retries: reports.iter().map(|r| r.commit_retries).sum(),
        commit_failures: reports.iter().filter(|r| r.commit_failed).count(),
        repeated_publishes: repeated,
        drain_after: drained.saturating_duration_since(fault_end),
        pinned: pin,
        drain: drained.saturating_duration_since(started),
    }
}

/// What a [`fetch_terminated_mid_statement`] trial measured.
#[derive(Debug, Clone)]
pub struct MidFetchFigures {
    /// The delivery mode of the relay.
    pub delivery: outbox_core::repository::DeliveryMode,
    /// The statement the relay's backend was running when it was ended (its first 60 bytes).
    pub statement: String,
    /// From the end of the fault (the backend ended and the table free again) to the end of the
    /// first cycle with an acknowledged publish.
    pub first_publish_after: Duration,
    /// From the end of the fault to the last row completed.
    pub drain_after: Duration,
}

/// Issue 14's fault suite: the relay's connection terminated mid-fetch, deterministically. A
/// relay loop on PostgreSQL (sqlx backend, its own pool with application name
/// `outbox-midfetch-<schema>`, `delivery` mode) starts while another transaction holds the
/// outbox table in ACCESS EXCLUSIVE mode, so its first fetch statement waits on that lock. Once
/// `pg_stat_activity` shows the relay's backend waiting in `fetch_heads`, the backend is ended
/// with `pg_terminate_backend` and the lock released. Checks that the relay fetches again on a
/// fresh connection and drains 8 keys × 10 events to a scripted broker, first publishes per
/// key in write order, every row completed and released; returns the figures.
pub async fn fetch_terminated_mid_statement(
    delivery: outbox_core::repository::DeliveryMode,
) -> MidFetchFigures {
    fetch_terminated_mid_statement_with(delivery, |url, table| {
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(CONNECT_PATIENCE)
            .connect_lazy(url)
            .expect("DATABASE_URL is a valid postgres URL");
        Arc::new(PgOutboxRepository::new(
            pool,
            PgConfig::default().table(table.clone()),
        ))
    })
    .await
}

/// [`fetch_terminated_mid_statement`] with the relay's repository made by `make_repo` from a
/// database URL that carries the trial's `application_name` (how the trial finds the relay's
/// backends) and the table: for other backends (outbox-diesel runs it with its own).
pub async fn fetch_terminated_mid_statement_with(
    delivery: outbox_core::repository::DeliveryMode,
    make_repo: impl FnOnce(&str, &TableName) -> Arc<dyn OutboxRepository>,
) -> MidFetchFigures {
    use outbox_core::CancellationToken;
    use outbox_core::relay::Relay;
    use outbox_core::scripted::ScriptedBroker;

    let _share = reserve_connections(6).await;
    let url = database_url();
    let admin = trial_pool(&url, 3).await;
    let backlog = FaultBacklog::write(&admin, 8, 10).await;
    let (schema, table, total) = (&backlog.schema, backlog.table.clone(), backlog.total());

    // The table is locked before the relay starts: its first fetch statement waits.
    let mut lock = admin.begin().await.expect("begin the lock");
    sqlx::query(AssertSqlSafe(format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        table.qualified()
    )))
    .execute(&mut *lock)
    .await
    .expect("lock the table");

    let app = format!("outbox-midfetch-{schema}");
    let sep = if url.contains('?') { '&' } else { '?' };
    let repo = make_repo(&format!("{url}{sep}application_name={app}"), &table);
    let broker = ScriptedBroker::new();
    let log = Arc::new(CycleLog::default());
    let relay = Arc::new(
        Relay::builder(repo, Arc::new(broker.clone()))
            .worker_id("mid-fetch")
            .batch_size(20)
            .max_per_key(4)
            .lease_ttl(Duration::from_secs(30))
            .publish_timeout(Duration::from_secs(1))
            .poll_interval(Duration::from_millis(200))
            .delivery(delivery)
            .step(log.clone())
            .build()
            .expect("relay"),
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    // Find the relay's backend waiting on the lock (polled: the catalog has no event for it).
    let waiting = async {
        loop {
            let row: Option<(i32, String)> = sqlx::query_as(
                "SELECT pid, query FROM pg_stat_activity \
                 WHERE application_name = $1 AND state = 'active' AND wait_event_type = 'Lock'",
            )
            .bind(&app)
            .fetch_optional(&admin)
            .await
            .expect("pg_stat_activity");
            if let Some(r) = row {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let (pid, query) = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the relay's fetch waits on the table lock within 30 s");
    let fetch_heads = Statements::new(&table).fetch_heads;
    // pg_stat_activity keeps the first track_activity_query_size bytes of the statement.
    assert!(
        query.len() >= 200 && fetch_heads.starts_with(query.trim_end()),
        "faults: the relay's backend waits in the fetch's first statement, not in {query:?}"
    );
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&admin)
        .await
        .expect("pg_terminate_backend");
    assert!(ended, "faults: the relay's backend was ended");
    lock.commit().await.expect("release the table");
    let fault_end = std::time::Instant::now();

    let first_after = |l: &CycleLog| {
        l.cycles
            .lock()
            .expect("log")
            .iter()
            .find(|(at, r)| *at > fault_end && !r.completed.is_empty())
            .map(|(at, _)| *at)
    };
    assert!(
        log.wait(Duration::from_secs(60), |l| first_after(l).is_some()
            && l.completed() >= total)
            .await,
        "faults: the relay did not drain within 60 s after its fetch was cut ({} of {total})",
        log.completed()
    );
    let drained = std::time::Instant::now();
    let first = first_after(&log).expect("checked");
    stop.cancel();
    relay.waker().notify_one();
    task.await.expect("relay task").expect("relay loop");

    backlog.check_first_publishes(&broker.calls());
    let left = backlog.left(&admin).await;
    assert!(
        left.is_empty(),
        "faults: every row completed and released: {left:?}"
    );
    drop(relay);
    backlog.drop_schema(&admin).await;
    MidFetchFigures {
        delivery,
        statement: query.chars().take(60).collect(),
        first_publish_after: first.saturating_duration_since(fault_end),
        drain_after: drained.saturating_duration_since(fault_end),
    }
}
