//! The inbox conformance harness of the diesel-async store: a fresh schema per trial with the
//! inbox table (plain, or partitioned with a DEFAULT partition) and the effects table, created
//! through diesel; the fixtures (`set`, `advance`, effects) share their SQL with the sqlx
//! harness ([`crate::inbox`]).

use std::sync::Arc;
use std::time::Duration;

use crate::fixtures;
use crate::inbox::{
    TrialFactory, TrialHarness, effects, json_rows, patch, plain_sql, trial_setup, trial_table,
};
use crate::{
    ConnectionShare, HARNESS_CONNECTIONS, HARNESS_SHARE, connect_patiently, database_url,
    fresh_schema_name, reserve_connections,
};
use async_trait::async_trait;
use diesel::QueryableByName;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use txoutbox_conformance::harness::BackendKind;
use txoutbox_conformance::inbox::{InboxHarness, InboxPatch};
use txoutbox_core::clock::{Clock, ManualClock};
use txoutbox_core::inbox::HandlerError;
use txoutbox_diesel::driver::Diesel;
use txoutbox_diesel::inbox::{DieselInbox, create_inbox_schema, diesel_inbox};
use txoutbox_diesel::{Layout, PgPool};
use txoutbox_postgres::driver::{Bind, Connection};
use txoutbox_postgres::inbox::sql::InboxStatements;
use txoutbox_postgres::sql::micros;
use uuid::Uuid;

use super::{patient_pool, url_in_new_york};

/// Makes a fresh [`DieselInboxHarness`] per trial.
pub type DieselInboxFactory = TrialFactory<DieselInboxHarness>;

#[async_trait]
impl TrialHarness for DieselInboxHarness {
    /// Only [`crate::inbox::PgInboxFactory`] offers `through_pooler`, so `through_pooler` is
    /// never set here.
    async fn create_trial(layout: Layout, past_only: bool, through_pooler: bool) -> Self {
        debug_assert!(
            !through_pooler,
            "the diesel inbox harness has no pooler mode"
        );
        Self::create(layout, past_only).await
    }
}

/// One trial's diesel inbox in a schema of its own (dropped with the harness).
pub struct DieselInboxHarness {
    url: String,
    schema: String,
    pool: PgPool,
    inbox: DieselInbox,
    stmts: Arc<InboxStatements>,
    clock: ManualClock,
    _share: ConnectionShare,
}

#[derive(QueryableByName)]
struct JsonText {
    #[diesel(sql_type = Nullable<Text>)]
    v: Option<String>,
}

#[derive(QueryableByName)]
struct MessageId {
    #[diesel(sql_type = Text)]
    message_id: String,
}

impl DieselInboxHarness {
    /// A fresh schema with the inbox table in `layout`.
    pub async fn create(layout: Layout, past_only: bool) -> Self {
        let url = database_url();
        let schema = fresh_schema_name();
        let table = trial_table(&schema, layout);
        let share = reserve_connections(HARNESS_SHARE).await;
        let mut conn = connect_patiently(|| AsyncPgConnection::establish(&url))
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL at {url} is unreachable: {e}"));
        create_inbox_schema(&mut conn, &table, layout)
            .await
            .expect("inbox schema creation");
        for s in trial_setup(&schema, &table, layout, past_only) {
            conn.batch_execute(&s).await.expect("trial setup");
        }
        drop(conn);
        let pool = patient_pool(&url_in_new_york(&url), HARNESS_CONNECTIONS as usize);
        Self {
            inbox: diesel_inbox(pool.clone(), &table, layout),
            stmts: Arc::new(InboxStatements::new(&table, layout)),
            url,
            schema,
            pool,
            clock: ManualClock::starting_now(),
            _share: share,
        }
    }

    async fn run(&self, sql: &str, binds: Vec<Bind>) -> u64 {
        let mut c = self.pool.get().await.expect("pool");
        Connection::execute(&mut Diesel(&mut *c), sql, binds)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

impl Drop for DieselInboxHarness {
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
                if let Ok(mut c) = connect_patiently(|| AsyncPgConnection::establish(&url)).await {
                    let _ = c.batch_execute(&fixtures::drop_schema(&schema)).await;
                }
            });
        })
        .join();
    }
}

#[async_trait]
impl InboxHarness for DieselInboxHarness {
    type Backend = DieselInbox;
    fn kind(&self) -> BackendKind {
        BackendKind::Postgres
    }
    fn backend(&self) -> DieselInbox {
        self.inbox.clone()
    }
    fn clock(&self) -> Arc<dyn Clock> {
        Arc::new(self.clock.clone())
    }
    async fn advance(&self, d: Duration) {
        self.run(&self.stmts.shift_clock, vec![Bind::Int8(micros(d))])
            .await;
        self.clock
            .set(self.clock.now() + chrono::Duration::from_std(d).expect("duration"));
    }
    async fn set(&self, id: Uuid, p: InboxPatch) {
        let Some((sql, binds)) = patch(&self.stmts.table, id, &p) else {
            return;
        };
        assert_eq!(self.run(&sql, binds).await, 1, "set: no inbox row {id}");
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
        let mut c = self.pool.get().await.expect("pool");
        let rows: Vec<MessageId> = diesel::sql_query(effects::select(&self.schema))
            .load(&mut *c)
            .await
            .expect("effects");
        rows.into_iter().map(|r| r.message_id).collect()
    }
    async fn write_effect(
        &self,
        tx: &mut AsyncPgConnection,
        message_id: &str,
        key: Option<&str>,
        n: i64,
    ) -> Result<(), HandlerError> {
        diesel::sql_query(effects::insert(&self.schema))
            .bind::<Text, _>(message_id)
            .bind::<Nullable<Text>, _>(key)
            .bind::<BigInt, _>(n)
            .execute(tx)
            .await
            .map(|_| ())
            .map_err(HandlerError::new)
    }
    async fn break_tx(&self, tx: &mut AsyncPgConnection) {
        let _ = diesel::sql_query(effects::BREAK).execute(tx).await;
    }
    async fn sql_in(&self, tx: &mut AsyncPgConnection, text: &str) -> Result<(), HandlerError> {
        tx.batch_execute(text).await.map_err(HandlerError::new)
    }
    async fn sql(&self, text: &str) -> Vec<serde_json::Value> {
        let (sql, query) = plain_sql(&self.stmts.table, &self.schema, text);
        let mut c = self.pool.get().await.expect("pool");
        if query {
            let r: JsonText = diesel::sql_query(sql.clone())
                .get_result(&mut *c)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            json_rows(r.v)
        } else {
            c.batch_execute(&sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
            Vec::new()
        }
    }
}
