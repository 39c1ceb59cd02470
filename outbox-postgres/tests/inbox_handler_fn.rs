//! A closure handler ([`handler_fn`]) on the sqlx inbox: the closure borrows the sqlx
//! transaction ([`SqlxHandlerTx`]) across its awaits, its write commits with the row, and a
//! redelivery of the message is a duplicate that does not run it again.

use std::sync::Arc;

use serde_json::json;
use sqlx::{AssertSqlSafe, Row};
use txoutbox_core::clock::ManualClock;
use txoutbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use txoutbox_core::inbox::{DeliveryOutcome, HandlerOutcome, InboxEvent, Runner, handler_fn};
use txoutbox_postgres::sql::{Layout, TableName};
use txoutbox_postgres::{SqlxHandlerTx, SqlxInbox, create_inbox_schema};
use txoutbox_testkit::{
    HARNESS_SHARE, database_url, fresh_schema_name, reserve_connections, trial_pool,
};

#[derive(serde::Deserialize)]
struct Placed {
    order: String,
}

#[tokio::test]
async fn handler_fn_writes_through_the_sqlx_transaction_once() {
    let _share = reserve_connections(HARNESS_SHARE).await;
    let pool = trial_pool(&database_url(), 2).await;
    let schema = fresh_schema_name();
    let table = TableName::new(&format!("{schema}.inbox_events")).unwrap();
    create_inbox_schema(&pool, &table, Layout::Plain)
        .await
        .unwrap();
    let ledger = format!("{schema}.ledger");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {ledger} (message_id text PRIMARY KEY, order_id text NOT NULL)"
    )))
    .execute(&pool)
    .await
    .unwrap();

    let clock = Arc::new(ManualClock::starting_now());
    let sub = ScriptedSubscription::new(clock).for_group("g", ["src"]);
    let f = MessageFactory::new();
    let first = sub.push(f.nats(
        &[("event_id", "m1"), ("topic", "src")],
        &json!({ "order": "o-1" }).to_string(),
    ));
    sub.duplicate(first);
    let insert = format!("INSERT INTO {ledger} (message_id, order_id) VALUES ($1, $2)");
    let runner = Runner::for_subscription(
        SqlxInbox::sqlx(pool.clone(), &table, Layout::Plain),
        sub.clone(),
    )
    .handler(handler_fn(
        move |row: &InboxEvent, tx: &mut SqlxHandlerTx| {
            let insert = insert.clone();
            Box::pin(async move {
                let placed: Placed = row.payload_as()?;
                sqlx::query(AssertSqlSafe(insert))
                    .bind(&row.message_id)
                    .bind(&placed.order)
                    .execute(&mut **tx)
                    .await?;
                Ok(HandlerOutcome::completed())
            })
        },
    ))
    .process_stored(false)
    .build()
    .unwrap();

    let r = runner.handle_next().await.unwrap().unwrap();
    assert_eq!(r.outcome, DeliveryOutcome::Completed, "{:?}", r.error);
    let again = runner.handle_next().await.unwrap().unwrap();
    assert_eq!(again.outcome, DeliveryOutcome::Duplicate);
    let rows = sqlx::query(AssertSqlSafe(format!(
        "SELECT message_id, order_id FROM {ledger}"
    )))
    .fetch_all(&pool)
    .await
    .unwrap();
    let rows: Vec<(String, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(rows, vec![("m1".to_owned(), "o-1".to_owned())]);
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(&pool)
        .await
        .unwrap();
}
