//! The conformance harness of the diesel backend (outbox-diesel's tests): a fresh schema per trial, created with this
//! crate's diesel migrations; the sqlx backend of outbox-postgres attached to the same table as
//! the peer (PG-06, S-02).

use std::sync::Arc;
use std::time::Duration;

use crate::{
    CONNECT_PATIENCE, ConnectionShare, HARNESS_CONNECTIONS, HARNESS_SHARE, PgHarness,
    connect_patiently, database_url, fresh_schema_name, reserve_connections,
};
use async_trait::async_trait;
use diesel::sql_types::{BigInt, Int4, Nullable, Text, Timestamptz};
use diesel_async::{
    AnsiTransactionManager, AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection,
    TransactionManager,
};
use txoutbox_conformance::harness::{BackendKind, Factory, Harness, RowPatch, WriteTx};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::NewEvent;
use txoutbox_core::repository::{OutboxRepository, WriteResult};
use txoutbox_diesel::error::map_diesel;
use txoutbox_diesel::{
    DieselConfig, DieselOutboxRepository, DieselOutboxWriter, Layout, PgPool, PooledConnection,
    TableName, run_migrations_with,
};
use txoutbox_postgres::sql::{self, Statements};
use uuid::Uuid;

/// `url` with every session in `America/New_York`, so the time-zone trap of R79 is exercised by
/// every trial (PG-09), as in the sqlx harness.
pub fn url_in_new_york(url: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}options=-c%20TimeZone%3DAmerica%2FNew_York")
}

/// A deadpool of at most `max` diesel-async connections like `txoutbox_diesel::build_pool`'s, except that a
/// new connection is opened patiently ([`connect_patiently`]): a database with no free slot
/// ("too many clients") makes a trial wait instead of fail.
pub fn patient_pool(url: &str, max: usize) -> PgPool {
    use diesel_async::pooled_connection::{AsyncDieselConnectionManager, ManagerConfig};
    use futures::FutureExt;
    let mut config = ManagerConfig::default();
    config.custom_setup = Box::new(|url| {
        let url = url.to_owned();
        // The library's own setup (in a transaction: safe through a transaction-pooling proxy).
        async move { connect_patiently(|| txoutbox_diesel::tls::establish(&url)).await }.boxed()
    });
    // As the library's pool: the recycle check on the simple protocol (safe through a proxy).
    config.recycling_method =
        diesel_async::pooled_connection::RecyclingMethod::CustomFunction(Box::new(|c| {
            Box::pin(async move {
                diesel_async::SimpleAsyncConnection::batch_execute(c, "SELECT 1").await
            })
        }));
    let manager = AsyncDieselConnectionManager::<AsyncPgConnection>::new_with_config(url, config);
    PgPool::builder(manager)
        .max_size(max)
        .wait_timeout(Some(CONNECT_PATIENCE))
        .create_timeout(Some(CONNECT_PATIENCE + Duration::from_secs(5)))
        .recycle_timeout(Some(Duration::from_secs(10)))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .expect("pool")
}

/// Makes a fresh [`DieselHarness`] per trial.
#[derive(Debug, Clone)]
pub struct DieselFactory {
    url: String,
    layout: Layout,
    through_pooler: bool,
}

impl Default for DieselFactory {
    fn default() -> Self {
        Self::new()
    }
}

impl DieselFactory {
    /// On `DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/test`).
    pub fn new() -> Self {
        Self {
            url: database_url(),
            layout: Layout::Plain,
            through_pooler: false,
        }
    }

    /// Each trial's repository and writer transactions go through the transaction-pooling
    /// proxy at `crate::pooler_url()` with `Pooler::Transaction` (R194, OP-08); the
    /// migrations, fixtures and the sqlx peer stay on the direct URL.
    pub fn through_pooler(mut self) -> Self {
        self.through_pooler = true;
        self
    }

    /// Each trial's table has the partitioned layout (created by the partitioned migration);
    /// both repositories, their writers and `create_schema_for` use it.
    pub fn partitioned() -> Self {
        Self {
            layout: Layout::Partitioned,
            ..Self::new()
        }
    }
}

#[async_trait]
impl Factory for DieselFactory {
    async fn create(&self) -> Arc<dyn Harness> {
        let h = DieselHarness::create_with(&self.url, self.layout).await;
        Arc::new(if self.through_pooler {
            h.through_pooler()
        } else {
            h
        })
    }
}

/// One trial: schema `obx_<random>` with `outbox_events` (created by `run_migrations`) and
/// `aggregates`; a diesel pool; the sqlx backend attached as the peer. Dropping it drops the
/// schema.
pub struct DieselHarness {
    url: String,
    schema: String,
    table: TableName,
    layout: Layout,
    stmts: Arc<Statements>,
    pool: PgPool,
    /// The pool through a transaction-pooling proxy the repository and the writer
    /// transactions use, if any (OP-08).
    proxy: Option<PgPool>,
    repo: Arc<DieselOutboxRepository>,
    peer: PgHarness,
    /// The pool's share of the process's test connection budget.
    _share: ConnectionShare,
}

impl DieselHarness {
    /// A fresh trial on `url`.
    pub async fn create(url: &str) -> Self {
        Self::create_with(url, Layout::Plain).await
    }

    /// A fresh trial on `url` whose table has `layout`.
    pub async fn create_with(url: &str, layout: Layout) -> Self {
        let schema = fresh_schema_name();
        let table = TableName::new(&format!("{schema}.{}", sql::DEFAULT_TABLE)).expect("valid");
        let share = reserve_connections(HARNESS_SHARE).await;
        let conn = connect_patiently(|| AsyncPgConnection::establish(url))
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {url} is unreachable: {e}"));
        let mut conn = run_migrations_with(conn, &table, layout)
            .await
            .expect("diesel migrations");
        conn.batch_execute(&crate::fixtures::create_aggregates(&schema))
            .await
            .expect("aggregates table");
        drop(conn);
        let pool = patient_pool(&url_in_new_york(url), HARNESS_CONNECTIONS as usize);
        let repo = Arc::new(DieselOutboxRepository::new(
            pool.clone(),
            DieselConfig::default().table(table.clone()).layout(layout),
        ));
        let peer = PgHarness::attach(url, &table).await.with_layout(layout);
        Self {
            url: url.to_owned(),
            schema,
            stmts: Arc::new(Statements::new(&table)),
            table,
            layout,
            pool,
            proxy: None,
            repo,
            peer,
            _share: share,
        }
    }

    /// The same trial with its repository and writer transactions through the
    /// transaction-pooling proxy (OP-08).
    pub fn through_pooler(mut self) -> Self {
        let proxy = patient_pool(&crate::pooler_url(), HARNESS_CONNECTIONS as usize);
        self.repo = Arc::new(DieselOutboxRepository::new(
            proxy.clone(),
            DieselConfig::default()
                .table(self.table.clone())
                .layout(self.layout)
                .pooler(txoutbox_postgres::Pooler::Transaction),
        ));
        self.proxy = Some(proxy);
        self
    }

    /// The diesel repository.
    pub fn diesel_repository(&self) -> Arc<DieselOutboxRepository> {
        self.repo.clone()
    }

    /// The table.
    pub fn table(&self) -> &TableName {
        &self.table
    }

    /// The diesel pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The sqlx peer harness on the same table.
    pub fn peer(&self) -> &PgHarness {
        &self.peer
    }

    /// Begins a diesel writer transaction.
    pub async fn begin_diesel(&self) -> DieselWriteTx {
        let pool = self.proxy.as_ref().unwrap_or(&self.pool);
        let mut conn = pool.get().await.expect("pooled connection");
        AnsiTransactionManager::begin_transaction(&mut *conn)
            .await
            .expect("begin");
        DieselWriteTx {
            conn: Some(conn),
            writer: self.repo.writer(),
            schema: self.schema.clone(),
        }
    }
}

impl Drop for DieselHarness {
    fn drop(&mut self) {
        let url = self.url.clone();
        let drop_sql = crate::fixtures::drop_schema(&self.schema);
        // Drop cannot await: a thread of its own with its own runtime.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                if let Ok(mut c) = connect_patiently(|| AsyncPgConnection::establish(&url)).await {
                    let _ = c.batch_execute(&drop_sql).await;
                }
            });
        })
        .join();
    }
}

/// A writer transaction on a pooled diesel connection. The suite needs begin and commit as
/// separate calls, so it drives diesel-async's transaction manager directly; applications use
/// `conn.transaction(async |conn| …)`, which does the same.
pub struct DieselWriteTx {
    conn: Option<PooledConnection>,
    writer: DieselOutboxWriter,
    schema: String,
}

impl DieselWriteTx {
    fn conn(&mut self) -> &mut AsyncPgConnection {
        self.conn.as_mut().expect("transaction open")
    }
}

impl Drop for DieselWriteTx {
    fn drop(&mut self) {
        // Left open (a panicking test): never hand a connection inside a transaction back to
        // the pool; detach and close it, which rolls the transaction back.
        if let Some(c) = self.conn.take() {
            drop(diesel_async::pooled_connection::deadpool::Object::take(c));
        }
    }
}

#[async_trait]
impl WriteTx for DieselWriteTx {
    async fn write(&mut self, events: Vec<NewEvent>) -> Result<Vec<WriteResult>, RepositoryError> {
        let writer = self.writer.clone();
        writer.write(self.conn(), events).await
    }

    async fn lock_app(&mut self, name: &str) {
        let ensure = crate::fixtures::ensure_aggregate(&self.schema);
        let lock = crate::fixtures::lock_aggregate(&self.schema);
        let c = self.conn();
        diesel::sql_query(ensure)
            .bind::<Text, _>(name)
            .execute(c)
            .await
            .expect("insert aggregate row");
        let n = diesel::sql_query(lock)
            .bind::<Text, _>(name)
            .execute(c)
            .await
            .expect("lock aggregate row");
        assert_eq!(n, 1, "aggregate row {name} locked");
    }

    async fn touch(&mut self) {
        self.conn()
            .batch_execute("SELECT txid_current()")
            .await
            .expect("touch");
    }

    async fn commit(mut self: Box<Self>) -> Result<(), RepositoryError> {
        let table = self.writer.table().clone();
        let mut conn = self.conn.take().expect("open");
        AnsiTransactionManager::commit_transaction(&mut *conn)
            .await
            .map_err(|e| map_diesel(&table, e))
    }

    async fn rollback(mut self: Box<Self>) -> Result<(), RepositoryError> {
        let table = self.writer.table().clone();
        let mut conn = self.conn.take().expect("open");
        AnsiTransactionManager::rollback_transaction(&mut *conn)
            .await
            .map_err(|e| map_diesel(&table, e))
    }
}

#[async_trait]
impl Harness for DieselHarness {
    fn kind(&self) -> BackendKind {
        BackendKind::Postgres
    }

    fn repository(&self) -> Arc<dyn OutboxRepository> {
        self.repo.clone()
    }

    fn peer_repository(&self) -> Arc<dyn OutboxRepository> {
        self.peer.sqlx_repository()
    }

    async fn begin(&self) -> Box<dyn WriteTx> {
        Box::new(self.begin_diesel().await)
    }

    async fn begin_peer(&self) -> Box<dyn WriteTx> {
        self.peer.begin_tx().await
    }

    async fn advance(&self, d: Duration) {
        let mut conn = self.pool.get().await.expect("pooled connection");
        diesel::sql_query(self.stmts.shift_clock.as_str())
            .bind::<BigInt, _>(sql::micros(d))
            .execute(&mut conn)
            .await
            .expect("advance: shift the table's times");
    }

    async fn set(&self, id: Uuid, p: RowPatch) {
        let mut sets: Vec<String> = Vec::new();
        let mut n = 1;
        let mut col = |name: &str, cast: &str| {
            n += 1;
            sets.push(format!("{name} = ${n}::{cast}"));
        };
        // Binds below follow this order.
        if p.status.is_some() {
            col("status", "text");
        }
        if p.attempts_made.is_some() {
            col("attempts_made", "int4");
        }
        if p.max_attempts.is_some() {
            col("max_attempts", "int4");
        }
        if p.last_error.is_some() {
            col("last_error", "text");
        }
        if p.scheduled_at.is_some() {
            col("scheduled_at", "timestamptz");
        }
        if p.completed_at.is_some() {
            col("completed_at", "timestamptz");
        }
        if p.lock.is_some() {
            col("locked_by", "text");
            col("locked_at", "timestamptz");
        }
        if sets.is_empty() {
            return;
        }
        let text = format!(
            "UPDATE {} SET {} WHERE id = $1::uuid",
            self.table.qualified(),
            sets.join(", ")
        );
        let mut q = diesel::sql_query(text)
            .into_boxed()
            .bind::<diesel::sql_types::Uuid, _>(id);
        if let Some(v) = p.status {
            q = q.bind::<Text, _>(v.as_str());
        }
        if let Some(v) = p.attempts_made {
            q = q.bind::<Int4, _>(v);
        }
        if let Some(v) = p.max_attempts {
            q = q.bind::<Int4, _>(v);
        }
        if let Some(v) = p.last_error {
            q = q.bind::<Nullable<Text>, _>(v);
        }
        if let Some(v) = p.scheduled_at {
            q = q.bind::<Timestamptz, _>(v);
        }
        if let Some(v) = p.completed_at {
            q = q.bind::<Nullable<Timestamptz>, _>(v);
        }
        if let Some(v) = p.lock {
            q = q.bind::<Nullable<Text>, _>(v.as_ref().map(|(w, _)| w.clone()));
            q = q.bind::<Nullable<Timestamptz>, _>(v.map(|(_, t)| t));
        }
        let mut conn = self.pool.get().await.expect("pooled connection");
        let n = q.execute(&mut conn).await.expect("set");
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
            DieselConfig::default()
                .batch_size(batch_size)
                .and_then(|c| c.error_max_length(error_max_length))
                .map(|_| ())
                .map_err(|e| e.to_string()),
        )
    }

    async fn create_schema_for(&self, table: &str) -> Option<Result<(), String>> {
        // This backend's table-name setting and its schema creation: the diesel migrations.
        let t = match DieselConfig::default().table_name(table) {
            Ok(c) => c.table_ref().clone(),
            Err(e) => return Some(Err(e.to_string())),
        };
        let conn = match connect_patiently(|| AsyncPgConnection::establish(&self.url)).await {
            Ok(c) => c,
            Err(e) => return Some(Err(e.to_string())),
        };
        Some(
            run_migrations_with(conn, &t, self.layout)
                .await
                .map(drop)
                .map_err(|e| e.to_string()),
        )
    }

    async fn sql(&self, statement: &str) -> Result<Vec<serde_json::Value>, String> {
        // Arbitrary statements returning arbitrary rows as JSON: the attached sqlx harness does
        // that on its own pool, on the same schema and table.
        self.peer.sql(statement).await
    }
}

/// One `count(*) AS n` row.
#[derive(diesel::QueryableByName)]
pub struct Count {
    /// The count.
    #[diesel(sql_type = BigInt)]
    pub n: i64,
}

/// One text column `name`.
#[derive(diesel::QueryableByName)]
pub struct Name {
    /// The name.
    #[diesel(sql_type = Text)]
    pub name: String,
}

/// A plain connection to the test database; panics when it is unreachable.
pub async fn connect() -> AsyncPgConnection {
    let url = database_url();
    connect_patiently(|| AsyncPgConnection::establish(&url))
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {url} is unreachable: {e}"))
}

/// A valid event of key `key` on topic `t`, with an idempotency key when given.
pub fn event(key: &str, idem: Option<&str>) -> NewEvent {
    let b = NewEvent::builder()
        .event_type("test.event")
        .aggregate("agg", Uuid::new_v4())
        .topic("t")
        .partition_key(key)
        .payload_json(serde_json::json!({"n": 1}));
    match idem {
        Some(k) => b.idempotency_key(k),
        None => b,
    }
    .build()
    .unwrap()
}

/// The diesel migration versions recorded in `schema`, in order.
pub async fn migration_versions(conn: &mut AsyncPgConnection, schema: &str) -> Vec<String> {
    let rows: Vec<Name> = diesel::sql_query(format!(
        "SELECT version::text AS name FROM \"{schema}\".__diesel_schema_migrations ORDER BY 1"
    ))
    .load(conn)
    .await
    .expect("migration versions");
    rows.into_iter().map(|v| v.name).collect()
}
pub mod inbox;
