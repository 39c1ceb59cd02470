//! Z-07: the two Postgres backends share an inbox table (R172): rows landed through
//! outbox-postgres (sqlx) are run by outbox-diesel's processor and the reverse, and a message
//! one backend completed is a duplicate for the other's runner.

mod common;

use std::sync::Arc;

use async_trait::async_trait;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use outbox_core::CancellationToken;
use outbox_core::clock::{Clock, ManualClock};
use outbox_core::inbox::repository::{InboxBackend, InboxTransaction};
use outbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use outbox_core::inbox::{
    DeliveryOutcome, Handler, HandlerError, HandlerOutcome, InboxEvent, NewInboxEvent, Processor,
    RowReport, Runner,
};
use outbox_diesel::Layout;
use outbox_diesel::inbox::diesel_inbox;
use outbox_postgres::inbox::SqlxHandlerTx;
use outbox_postgres::inbox::testing::{PgInboxHarness, effects, trial_table};
use outbox_postgres::sqlx;
use outbox_postgres::testing::database_url;
use serde_json::json;

use common::{patient_pool, url_in_new_york};

struct DieselEffect(String);

#[async_trait]
impl Handler<AsyncPgConnection> for DieselEffect {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut AsyncPgConnection,
    ) -> Result<HandlerOutcome, HandlerError> {
        diesel::sql_query(effects::insert(&self.0))
            .bind::<Text, _>(&row.message_id)
            .bind::<Nullable<Text>, _>(row.partition_key.as_deref())
            .bind::<BigInt, _>(0)
            .execute(tx)
            .await
            .map_err(HandlerError::new)?;
        Ok(HandlerOutcome::completed())
    }
}

struct SqlxEffect(String);

#[async_trait]
impl Handler<SqlxHandlerTx> for SqlxEffect {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut SqlxHandlerTx,
    ) -> Result<HandlerOutcome, HandlerError> {
        sqlx::query(sqlx::AssertSqlSafe(effects::insert(&self.0)))
            .bind(&row.message_id)
            .bind(row.partition_key.as_deref())
            .bind(0_i64)
            .execute(&mut **tx)
            .await
            .map_err(HandlerError::new)?;
        Ok(HandlerOutcome::completed())
    }
}

fn ev(id: &str) -> NewInboxEvent {
    NewInboxEvent::builder()
        .message_id(id)
        .consumer_group("g")
        .source("src")
        .event_type("e")
        .partition_key("k")
        .payload_json(json!({"n": 1}))
        .build()
        .expect("valid")
}

async fn land<B: InboxBackend>(b: &B, id: &str) -> InboxEvent {
    let mut tx = b.begin().await.unwrap();
    let l = tx.land(vec![ev(id)]).await.unwrap();
    tx.commit().await.unwrap();
    l[0].row.clone()
}

async fn effects_of(h: &PgInboxHarness) -> Vec<String> {
    sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(effects::select(h.schema())))
        .fetch_all(h.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_07() {
    for layout in [Layout::Plain, Layout::Partitioned] {
        let h = PgInboxHarness::create(layout).await;
        let table = trial_table(h.schema(), layout);
        let sqlx_inbox = outbox_postgres::inbox::SqlxInbox::sqlx(h.pool().clone(), &table, layout);
        let diesel = diesel_inbox(
            patient_pool(&url_in_new_york(&database_url()), 4),
            &table,
            layout,
        );
        let schema = h.schema().to_owned();
        // Landed with sqlx, run by diesel's processor.
        let m1 = land(&sqlx_inbox, "m1").await;
        let m2 = land(&sqlx_inbox, "m2").await;
        let dp = Processor::builder(diesel.clone(), "g", Arc::new(DieselEffect(schema.clone())))
            .worker_id("p-diesel")
            .build()
            .unwrap();
        let rep = dp.cycle(&CancellationToken::new()).await.unwrap();
        assert_eq!(
            rep.of(m1.id),
            Some(&RowReport::Completed { status: None }),
            "{layout:?}"
        );
        // One key: m2 runs after m1 in the same cycle (max_per_key 16).
        assert_eq!(
            rep.of(m2.id),
            Some(&RowReport::Completed { status: None }),
            "{layout:?}"
        );
        // Landed with diesel, run by the sqlx processor.
        let m3 = land(&diesel, "m3").await;
        let sp = Processor::builder(
            sqlx_inbox.clone(),
            "g",
            Arc::new(SqlxEffect(schema.clone())),
        )
        .worker_id("p-sqlx")
        .build()
        .unwrap();
        let rep = sp.cycle(&CancellationToken::new()).await.unwrap();
        assert_eq!(
            rep.of(m3.id),
            Some(&RowReport::Completed { status: None }),
            "{layout:?}"
        );
        assert_eq!(effects_of(&h).await, vec!["m1", "m2", "m3"], "{layout:?}");
        // A message diesel completed is a duplicate for the sqlx runner, and the reverse.
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::starting_now());
        let msgs = MessageFactory::new();
        let sub = ScriptedSubscription::new(clock);
        for id in ["m1", "m3"] {
            sub.push(msgs.nats(
                &[
                    ("event_id", id),
                    ("topic", "src"),
                    ("event_type", "e"),
                    ("partition_key", "k"),
                ],
                "{\"n\": 1}",
            ));
        }
        let sr = Runner::builder(sqlx_inbox.clone(), Arc::new(sub.clone()), "g")
            .handler(Arc::new(SqlxEffect(schema.clone())))
            .worker_id("r-sqlx")
            .concurrency(1)
            .process_stored(false)
            .build()
            .unwrap();
        let r = sr.handle_next().await.unwrap().unwrap();
        assert_eq!((r.outcome, r.committed), (DeliveryOutcome::Duplicate, true));
        let dr = Runner::builder(diesel.clone(), Arc::new(sub.clone()), "g")
            .handler(Arc::new(DieselEffect(schema.clone())))
            .worker_id("r-diesel")
            .concurrency(1)
            .process_stored(false)
            .build()
            .unwrap();
        let r = dr.handle_next().await.unwrap().unwrap();
        assert_eq!((r.outcome, r.committed), (DeliveryOutcome::Duplicate, true));
        assert_eq!(effects_of(&h).await, vec!["m1", "m2", "m3"], "{layout:?}");
    }
}
