//! End to end: events written to PostgreSQL through outbox-postgres (each in the writer's own
//! transaction) are drained by the relay into NATS JetStream; a consumer reads every event, in
//! order per key, with its headers. `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) and `NATS_URL`; a fresh schema and stream.

mod common;

use std::collections::HashMap;

use common::*;
use outbox_conformance::broker::{drain_and_consume, e2e_event};
use outbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, TableName, create_schema};
use sqlx::postgres::PgPoolOptions;

fn database_url() -> String {
    std::env::var("DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_to_nats() {
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect(&database_url())
        .await
        .unwrap_or_else(|e| panic!("PostgreSQL at {} is unreachable: {e}", database_url()));
    let schema = format!("obx_{}", fresh_suffix());
    let table = TableName::new(&format!("{schema}.outbox_events")).expect("valid table name");
    create_schema(&pool, &table)
        .await
        .expect("create the outbox table");
    let writer = PgOutboxWriter::new(&table);

    let mut written: HashMap<String, Vec<uuid::Uuid>> = HashMap::new();
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

    let repo = std::sync::Arc::new(PgOutboxRepository::new(
        pool.clone(),
        PgConfig::default().table(table),
    ));
    let t = Nats.trial(TrialOptions::default()).await;
    drain_and_consume(&*t, repo, "orders", &written).await;
    t.cleanup().await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "DROP SCHEMA \"{schema}\" CASCADE"
    )))
    .execute(&pool)
    .await
    .expect("drop the trial schema");
}
