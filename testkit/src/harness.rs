//! The harness of the sqlx backend: [`PgFactory`], [`PgHarness`], its write transaction.

use super::budget::*;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, Connection, Postgres, Row, Transaction};
use txoutbox_conformance::harness::{BackendKind, Factory, Harness, RowPatch, WriteTx};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::NewEvent;
use txoutbox_core::repository::{OutboxRepository, WriteResult};
use uuid::Uuid;

use txoutbox_postgres::sql::{self, Layout, Statements, TableName};
use txoutbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, Pooler, create_schema_with};

/// Makes a fresh [`PgHarness`] per trial.
#[derive(Debug, Clone)]
pub struct PgFactory {
    url: String,
    table: String,
    ancestor: bool,
    layout: Layout,
    pooler_url: Option<String>,
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
            pooler_url: None,
        }
    }

    /// The repository and the writer transactions of each trial go through the
    /// transaction-pooling proxy at `url` with [`Pooler::Transaction`] (R194, OP-08); the
    /// schema, the fixtures and the inspections stay on the direct URL.
    pub fn through_pooler(mut self, url: &str) -> Self {
        self.pooler_url = Some(url.to_owned());
        self
    }

    /// Each trial's table has the partitioned layout ([`create_schema_with`] with
    /// [`Layout::Partitioned`]), and the repository, its writer and `create_schema_for` use
    /// that layout.
    pub fn partitioned(mut self) -> Self {
        self.layout = Layout::Partitioned;
        self
    }

    /// Creates each trial's table with the ancestor's DDL exactly as the ancestor library created it (R78)
    /// writes it (`txoutbox_conformance::scenarios::pg::ANCESTOR_DDL`) instead of this crate's
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
        let h = if self.ancestor {
            PgHarness::create_ancestor(&self.url, &self.table).await
        } else {
            PgHarness::create_with(&self.url, &self.table, self.layout).await
        };
        match &self.pooler_url {
            Some(url) => Arc::new(h.through_pooler(url).await),
            None => Arc::new(h),
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
    /// The pool through a transaction-pooling proxy the repository and the writer
    /// transactions use ([`PgHarness::through_pooler`]), if any.
    proxy: Option<PgPool>,
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
        sqlx::query(AssertSqlSafe(crate::fixtures::create_aggregates(&schema)))
            .execute(&pool)
            .await
            .expect("aggregates table");
        Self::with_pool(url, pool, share, schema, table, true).with_layout(layout)
    }

    /// The same harness with the repository (and its writer) in `layout`.
    pub fn with_layout(mut self, layout: Layout) -> Self {
        self.layout = layout;
        self.rebuild_repo();
        self
    }

    /// The same harness with its repository and writer transactions through the
    /// transaction-pooling proxy at `url` in [`Pooler::Transaction`] (R194, OP-08). The pool
    /// takes [`HARNESS_CONNECTIONS`] client connections of the proxy; the proxy's own pool
    /// (PgBouncer's `default_pool_size`) bounds the server connections.
    pub async fn through_pooler(mut self, url: &str) -> Self {
        self.proxy = Some(pooler_pool(url, HARNESS_CONNECTIONS).await);
        self.rebuild_repo();
        self
    }

    fn rebuild_repo(&mut self) {
        let cfg = PgConfig::default()
            .table(self.table.clone())
            .layout(self.layout);
        self.repo = Arc::new(match &self.proxy {
            Some(p) => PgOutboxRepository::new(p.clone(), cfg.pooler(Pooler::Transaction)),
            None => PgOutboxRepository::new(self.pool.clone(), cfg),
        });
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
        let ddl = txoutbox_conformance::scenarios::pg::ancestor_ddl(&schema, table.table());
        sqlx::raw_sql(AssertSqlSafe(ddl))
            .execute(&pool)
            .await
            .expect("ancestor DDL");
        sqlx::query(AssertSqlSafe(crate::fixtures::create_aggregates(&schema)))
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
        sqlx::query(AssertSqlSafe(crate::fixtures::create_aggregates(&schema)))
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
            proxy: None,
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
        let tx = self
            .proxy
            .as_ref()
            .unwrap_or(&self.pool)
            .begin()
            .await
            .expect("begin");
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
                    let _ = sqlx::query(AssertSqlSafe(crate::fixtures::drop_schema(&schema)))
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
        let ensure = crate::fixtures::ensure_aggregate(&self.schema);
        let lock = crate::fixtures::lock_aggregate(&self.schema);
        let tx = self.tx();
        // Unnamed, so that they also run through a transaction-pooling proxy (OP-08).
        sqlx::query(AssertSqlSafe(ensure))
            .bind(name)
            .persistent(false)
            .execute(&mut **tx)
            .await
            .expect("insert aggregate row");
        sqlx::query(AssertSqlSafe(lock))
            .bind(name)
            .persistent(false)
            .fetch_one(&mut **tx)
            .await
            .expect("lock aggregate row");
    }

    async fn touch(&mut self) {
        sqlx::query("SELECT txid_current()")
            .persistent(false)
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
            .map_err(|e| txoutbox_postgres::driver::sqlx::map_err(&table, e))
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), RepositoryError> {
        let table = self.writer_table();
        self.tx
            .take()
            .expect("open")
            .rollback()
            .await
            .map_err(|e| txoutbox_postgres::driver::sqlx::map_err(&table, e))
    }
}

impl SqlxWriteTx {
    fn writer_table(&self) -> TableName {
        self.writer.table().clone()
    }
}

pub(super) fn returns_rows(statement: &str) -> bool {
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
