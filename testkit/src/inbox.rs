//! The inbox conformance harness: a fresh schema per trial with the inbox
//! table (plain, or partitioned with a DEFAULT partition), an effects table for the handlers'
//! own writes, the test clock and the fixtures of scenarios.md section 19. The driver-neutral
//! parts ([`patch`], [`effects`]) serve outbox-diesel's harness too.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Postgres, Transaction};
use txoutbox_conformance::harness::BackendKind;
use txoutbox_conformance::inbox::broker_subs::OutageDatabase;
use txoutbox_conformance::inbox::{InboxFactory, InboxHarness, InboxPatch};
use txoutbox_core::clock::{Clock, ManualClock};
use txoutbox_core::inbox::HandlerError;
use uuid::Uuid;

use crate::{
    ConnectionShare, HARNESS_CONNECTIONS, HARNESS_SHARE, database_url, fresh_schema_name,
    reserve_connections, trial_pool,
};
use txoutbox_postgres::driver::Bind;
use txoutbox_postgres::driver::inbox::{nullable_text, nullable_timestamp};
use txoutbox_postgres::inbox::sql::{
    DEFAULT_INBOX_TABLE, DEFAULT_PARTITIONED_INBOX_TABLE, InboxStatements,
};
use txoutbox_postgres::inbox::{SqlxInbox, create_inbox_schema};
use txoutbox_postgres::sql::{Layout, TableName, micros};

/// The suite's `set`: an UPDATE of the patched columns of one row, `$1` the id.
pub fn patch(table: &TableName, id: Uuid, p: &InboxPatch) -> Option<(String, Vec<Bind>)> {
    let mut sets: Vec<String> = Vec::new();
    let mut binds = vec![Bind::Uuid(id)];
    // Nullable values are one-element arrays (see driver::inbox), so every value reads
    // `($n::type[])[1]` or `$n::type`.
    let mut set = |col: &str, cast: &str, b: Bind, binds: &mut Vec<Bind>| {
        let array = matches!(
            b,
            Bind::NullableTexts(_) | Bind::NullableTimestamps(_) | Bind::NullableInt8s(_)
        );
        binds.push(b);
        let n = binds.len();
        sets.push(if array {
            format!("{col} = (${n}::{cast}[])[1]")
        } else {
            format!("{col} = ${n}::{cast}")
        });
    };
    if let Some(v) = p.status {
        set(
            "status",
            "text",
            Bind::Text(v.as_str().to_owned()),
            &mut binds,
        );
    }
    if let Some(v) = p.attempts_made {
        set("attempts_made", "int4", Bind::Int4(v), &mut binds);
    }
    if let Some(v) = p.max_attempts {
        set("max_attempts", "int4", Bind::Int4(v), &mut binds);
    }
    if let Some(v) = &p.last_error {
        set(
            "last_error",
            "text",
            nullable_text(v.as_deref()),
            &mut binds,
        );
    }
    if let Some(v) = p.scheduled_at {
        set(
            "scheduled_at",
            "timestamptz",
            Bind::Timestamp(v),
            &mut binds,
        );
    }
    if let Some(v) = p.completed_at {
        set(
            "completed_at",
            "timestamptz",
            nullable_timestamp(v),
            &mut binds,
        );
    }
    if let Some(v) = &p.lock {
        let (by, at) = match v {
            Some((w, t)) => (Some(w.clone()), Some(*t)),
            None => (None, None),
        };
        set(
            "locked_by",
            "text",
            nullable_text(by.as_deref()),
            &mut binds,
        );
        set(
            "locked_at",
            "timestamptz",
            nullable_timestamp(at),
            &mut binds,
        );
    }
    if sets.is_empty() {
        return None;
    }
    Some((
        format!(
            "UPDATE {} SET {} WHERE id = $1::uuid",
            table.qualified(),
            sets.join(", ")
        ),
        binds,
    ))
}

/// The effects table of the suite's handlers (their own writes, R115): DDL, insert, read.
pub mod effects {
    /// `CREATE TABLE` of the effects in `schema`.
    pub fn ddl(schema: &str) -> String {
        format!(
            "CREATE TABLE IF NOT EXISTS \"{schema}\".inbox_effects (seq bigserial PRIMARY KEY, message_id text NOT NULL, key text, n int8 NOT NULL)"
        )
    }
    /// Insert one effect: `$1 text` message_id, `$2 text` key (or NULL), `$3 int8` n.
    pub fn insert(schema: &str) -> String {
        format!(
            "INSERT INTO \"{schema}\".inbox_effects (message_id, key, n) VALUES ($1::text, $2::text, $3::int8)"
        )
    }
    /// The committed effects' message ids in store order.
    pub fn select(schema: &str) -> String {
        format!("SELECT message_id FROM \"{schema}\".inbox_effects ORDER BY seq")
    }
    /// Ends the transaction's connection (the suite's `break_tx`).
    pub const BREAK: &str = "SELECT pg_terminate_backend(pg_backend_pid())";
}

/// The suite's plain SQL (`InboxHarness::sql`) ready to run: `{table}` and `{schema}`
/// replaced; a query (SELECT, WITH, or with RETURNING) wrapped so that it returns its rows as
/// one JSON array text in a column `v`. Returns the text and whether it is such a query.
pub fn plain_sql(table: &TableName, schema: &str, text: &str) -> (String, bool) {
    let t = text
        .replace("{table}", &table.qualified())
        .replace("{schema}", &format!("\"{schema}\""));
    let head = t.trim_start().to_ascii_uppercase();
    let query =
        head.starts_with("SELECT") || head.starts_with("WITH") || head.contains("RETURNING");
    if query {
        (
            format!(
                "WITH q AS ({t}) SELECT COALESCE(json_agg(row_to_json(q)), '[]'::json)::text AS v FROM q"
            ),
            true,
        )
    } else {
        (t, false)
    }
}

/// The rows of a [`plain_sql`] query's JSON text.
pub fn json_rows(text: Option<String>) -> Vec<serde_json::Value> {
    match text.map(|t| serde_json::from_str(&t).expect("json_agg returns JSON")) {
        Some(serde_json::Value::Array(rows)) => rows,
        _ => Vec::new(),
    }
}

/// The table of a trial: the default name for the layout, in `schema`.
pub fn trial_table(schema: &str, layout: Layout) -> TableName {
    let t = match layout {
        Layout::Plain => DEFAULT_INBOX_TABLE,
        Layout::Partitioned => DEFAULT_PARTITIONED_INBOX_TABLE,
    };
    TableName::new(&format!("{schema}.{t}")).expect("valid table name")
}

/// The statements that set up a trial's schema after the inbox DDL: the DEFAULT partition of
/// a partitioned table (or, with `past_only`, one partition for January 2000 only, so that a
/// landing now is refused with SQLSTATE 23514: E-14) and the effects table.
pub fn trial_setup(
    schema: &str,
    table: &TableName,
    layout: Layout,
    past_only: bool,
) -> Vec<String> {
    let mut v = Vec::new();
    if layout == Layout::Partitioned {
        let bounds = if past_only {
            "FOR VALUES FROM ('2000-01-01 00:00:00+00') TO ('2000-02-01 00:00:00+00')"
        } else {
            "DEFAULT"
        };
        v.push(format!(
            "CREATE TABLE IF NOT EXISTS \"{schema}\".\"{}_part\" PARTITION OF {} {bounds}",
            table.table(),
            table.qualified()
        ));
    }
    v.push(effects::ddl(schema));
    v
}

/// An inbox harness a [`TrialFactory`] can make: a fresh schema with the inbox table in
/// `layout`, `past_only` as [`trial_setup`] says.
#[async_trait]
pub trait TrialHarness: InboxHarness + Sized + 'static {
    /// One trial's harness.
    async fn create_trial(layout: Layout, past_only: bool, through_pooler: bool) -> Self;
}

/// Makes a fresh harness `H` per trial, on the plain table, the partitioned table, or the
/// partitioned table with a past partition only; the same three trials for every store
/// ([`PgInboxFactory`], and outbox-diesel's through the `diesel` feature).
pub struct TrialFactory<H> {
    layout: Layout,
    past_only: bool,
    through_pooler: bool,
    harness: std::marker::PhantomData<fn() -> H>,
}

impl<H> Clone for TrialFactory<H> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<H> Copy for TrialFactory<H> {}
impl<H> std::fmt::Debug for TrialFactory<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TrialFactory")
            .field("layout", &self.layout)
            .field("past_only", &self.past_only)
            .field("through_pooler", &self.through_pooler)
            .finish()
    }
}

impl<H> TrialFactory<H> {
    fn of(layout: Layout, past_only: bool) -> Self {
        Self {
            layout,
            past_only,
            through_pooler: false,
            harness: std::marker::PhantomData,
        }
    }
    /// Trials on the plain table.
    pub fn plain() -> Self {
        Self::of(Layout::Plain, false)
    }
    /// Trials on the partitioned table (one DEFAULT partition).
    pub fn partitioned() -> Self {
        Self::of(Layout::Partitioned, false)
    }
    /// Trials on the partitioned table with one partition for a past month only (E-14).
    pub fn past_partition_only() -> Self {
        Self::of(Layout::Partitioned, true)
    }
}

impl TrialFactory<PgInboxHarness> {
    /// Each trial's store (the runner's and the processor's statements, the handlers'
    /// transactions) goes through the transaction-pooling proxy at [`crate::pooler_url`] with
    /// `Pooler::Transaction` (R194, OP-08); the schema, the fixtures and the inspections stay
    /// on the direct URL.
    pub fn through_pooler(mut self) -> Self {
        self.through_pooler = true;
        self
    }
}

#[async_trait]
impl<H: TrialHarness> InboxFactory for TrialFactory<H> {
    type Harness = H;
    async fn create(&self) -> Arc<H> {
        Arc::new(H::create_trial(self.layout, self.past_only, self.through_pooler).await)
    }
}

/// Makes a fresh [`PgInboxHarness`] per trial.
pub type PgInboxFactory = TrialFactory<PgInboxHarness>;

#[async_trait]
impl TrialHarness for PgInboxHarness {
    async fn create_trial(layout: Layout, past_only: bool, through_pooler: bool) -> Self {
        let h = Self::create_with(layout, past_only).await;
        if through_pooler {
            h.through_pooler(&crate::pooler_url()).await
        } else {
            h
        }
    }
}

/// One trial's sqlx inbox in a schema of its own (dropped with the harness).
pub struct PgInboxHarness {
    url: String,
    pool: PgPool,
    schema: String,
    inbox: SqlxInbox,
    stmts: Arc<InboxStatements>,
    clock: ManualClock,
    _share: ConnectionShare,
}

impl std::fmt::Debug for PgInboxHarness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgInboxHarness")
            .field("schema", &self.schema)
            .finish()
    }
}

impl PgInboxHarness {
    /// A fresh schema with the inbox table in `layout`.
    pub async fn create(layout: Layout) -> Self {
        Self::create_with(layout, false).await
    }

    /// [`PgInboxHarness::create`]; `past_only` as [`trial_setup`].
    pub async fn create_with(layout: Layout, past_only: bool) -> Self {
        let url = database_url();
        let schema = fresh_schema_name();
        let table = trial_table(&schema, layout);
        let share = reserve_connections(HARNESS_SHARE).await;
        let pool = trial_pool(&url, HARNESS_CONNECTIONS).await;
        create_inbox_schema(&pool, &table, layout)
            .await
            .expect("inbox schema creation");
        for s in trial_setup(&schema, &table, layout, past_only) {
            sqlx::raw_sql(AssertSqlSafe(s))
                .execute(&pool)
                .await
                .expect("trial setup");
        }
        let inbox = SqlxInbox::sqlx(pool.clone(), &table, layout);
        Self {
            url,
            stmts: Arc::new(InboxStatements::new(&table, layout)),
            pool,
            schema,
            inbox,
            clock: ManualClock::starting_now(),
            _share: share,
        }
    }

    /// The same harness with its store through the transaction-pooling proxy at `url` in
    /// `Pooler::Transaction` (R194, OP-08).
    pub async fn through_pooler(mut self, url: &str) -> Self {
        let proxy = crate::pooler_pool(url, HARNESS_CONNECTIONS).await;
        self.inbox = SqlxInbox::sqlx(proxy, &self.stmts.table, self.stmts.layout)
            .with_pooler(txoutbox_postgres::Pooler::Transaction);
        self
    }

    /// The trial's pool.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// The trial's schema.
    pub fn schema(&self) -> &str {
        &self.schema
    }
}

impl Drop for PgInboxHarness {
    fn drop(&mut self) {
        let url = self.url.clone();
        let schema = self.schema.clone();
        // Drop cannot await: a thread of its own with its own runtime.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                use sqlx::Connection;
                let connect = || sqlx::PgConnection::connect(&url);
                if let Ok(mut c) = crate::connect_patiently(connect).await {
                    let drop = crate::fixtures::drop_schema(&schema);
                    let _ = sqlx::query(AssertSqlSafe(drop)).execute(&mut c).await;
                    let _ = c.close().await;
                }
            });
        })
        .join();
    }
}

#[async_trait]
impl InboxHarness for PgInboxHarness {
    type Backend = SqlxInbox;
    fn kind(&self) -> BackendKind {
        BackendKind::Postgres
    }
    fn backend(&self) -> SqlxInbox {
        self.inbox.clone()
    }
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(self.clock.clone())
    }
    async fn advance(&self, d: Duration) {
        sqlx::query(AssertSqlSafe(self.stmts.shift_clock.as_str()))
            .bind(micros(d))
            .execute(&self.pool)
            .await
            .expect("advance: shift the table's times");
        self.clock
            .set(self.clock.now() + chrono::Duration::from_std(d).expect("duration"));
    }
    async fn set(&self, id: Uuid, p: InboxPatch) {
        let Some((sql, binds)) = patch(&self.stmts.table, id, &p) else {
            return;
        };
        let n = txoutbox_postgres::driver::sqlx::bind_all(sqlx::query(AssertSqlSafe(sql)), binds)
            .execute(&self.pool)
            .await
            .expect("set")
            .rows_affected();
        assert_eq!(n, 1, "set: no inbox row {id}");
    }
    fn fail_next_row_commit(&self) {
        self.inbox.faults().fail_next_commit();
    }
    fn set_db_down(&self, down: bool) {
        self.inbox.faults().set_down(down);
    }
    fn before_next_begin(
        &self,
        f: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
    ) {
        self.inbox.faults().before_next_begin(f);
    }
    async fn effects(&self) -> Vec<String> {
        sqlx::query_scalar::<_, String>(AssertSqlSafe(effects::select(&self.schema)))
            .fetch_all(&self.pool)
            .await
            .expect("effects")
    }
    async fn write_effect(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        message_id: &str,
        key: Option<&str>,
        n: i64,
    ) -> Result<(), HandlerError> {
        // Unnamed, so that it also runs through a transaction-pooling proxy (OP-08).
        sqlx::query(AssertSqlSafe(effects::insert(&self.schema)))
            .bind(message_id)
            .bind(key)
            .bind(n)
            .persistent(false)
            .execute(&mut **tx)
            .await
            .map(|_| ())
            .map_err(HandlerError::new)
    }
    async fn break_tx(&self, tx: &mut Transaction<'static, Postgres>) {
        let _ = sqlx::query(effects::BREAK)
            .persistent(false)
            .execute(&mut **tx)
            .await;
    }
    async fn sql_in(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        text: &str,
    ) -> Result<(), HandlerError> {
        sqlx::raw_sql(AssertSqlSafe(text.to_owned()))
            .execute(&mut **tx)
            .await
            .map(|_| ())
            .map_err(HandlerError::new)
    }
    async fn sql(&self, text: &str) -> Vec<serde_json::Value> {
        let (sql, query) = plain_sql(&self.stmts.table, &self.schema, text);
        if query {
            let v: Option<String> = sqlx::query_scalar(AssertSqlSafe(sql.clone()))
                .fetch_one(&self.pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            json_rows(v)
        } else {
            sqlx::raw_sql(AssertSqlSafe(sql.clone()))
                .execute(&self.pool)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            Vec::new()
        }
    }
}

/// Connections of a [`PgOutageInbox`]'s pool through the trial's forwarder.
pub const OUTAGE_POOL: u32 = 8;

/// The PostgreSQL side of the broker crates' database outage trial
/// ([`txoutbox_conformance::inbox::broker_subs::database_outage`]): each inbox is a fresh schema
/// (a [`PgInboxHarness`], dropped with this value) whose runner pool connects through the trial's
/// forwarder, so that the trial can cut PostgreSQL without touching the server. The pool waits
/// at most 2 s for a connection, as a deployment's would be bounded.
#[derive(Default)]
pub struct PgOutageInbox {
    kept: std::sync::Mutex<Vec<(PgInboxHarness, ConnectionShare, PgPool)>>,
}

impl std::fmt::Debug for PgOutageInbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOutageInbox").finish_non_exhaustive()
    }
}

#[async_trait]
impl OutageDatabase for PgOutageInbox {
    type Backend = SqlxInbox;

    fn server(&self) -> String {
        let o: PgConnectOptions = database_url()
            .parse()
            .expect("DATABASE_URL is a valid postgres URL");
        format!("{}:{}", o.get_host(), o.get_port())
    }

    async fn inbox(&self, through: std::net::SocketAddr) -> SqlxInbox {
        let h = PgInboxHarness::create(Layout::Plain).await;
        let share = reserve_connections(OUTAGE_POOL).await;
        let opts: PgConnectOptions = database_url()
            .parse::<PgConnectOptions>()
            .expect("DATABASE_URL is a valid postgres URL")
            .host(&through.ip().to_string())
            .port(through.port());
        let pool = PgPoolOptions::new()
            .max_connections(OUTAGE_POOL)
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(opts);
        let inbox = SqlxInbox::sqlx(
            pool.clone(),
            &trial_table(h.schema(), Layout::Plain),
            Layout::Plain,
        );
        self.kept.lock().expect("poisoned").push((h, share, pool));
        inbox
    }
}
