//! Concurrent fetches take different heads (R20, R21): a key another fetch has claimed, or a
//! head another transaction has row-locked, is passed over for the next head, so the batch
//! still fills, and the fetch never waits.

use std::time::Duration;

use outbox_core::event::{NewEvent, WorkerId};
use outbox_core::repository::{FetchRequest, OutboxRepository};
use outbox_postgres::PgOutboxWriter;
use outbox_postgres::sql::fetch_claim_class;
use outbox_postgres::testing::{PgHarness, database_url};
use uuid::Uuid;

async fn write_one(h: &PgHarness, key: &str) -> Uuid {
    let e = NewEvent::builder()
        .event_type("t.happened")
        .aggregate("thing", Uuid::new_v4())
        .topic("things")
        .partition_key(key)
        .payload_json(serde_json::json!({ "k": key }))
        .build()
        .unwrap();
    let id = e.id();
    let mut tx = h.pool().begin().await.unwrap();
    PgOutboxWriter::new(h.table())
        .write(&mut tx, vec![e])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    id
}

async fn fetch_ids(h: &PgHarness, worker: &str, limit: usize) -> Vec<Uuid> {
    let req = FetchRequest::new(WorkerId::new(worker).unwrap(), limit).max_per_key(1);
    let rows = tokio::time::timeout(
        Duration::from_secs(10),
        h.sqlx_repository().fetch_and_lock(&req),
    )
    .await
    .expect("the fetch must skip locked rows, never wait for them")
    .unwrap();
    rows.iter().map(|r| r.id()).collect()
}

#[tokio::test]
async fn a_claimed_key_and_a_row_locked_head_are_passed_over_and_the_batch_still_fills() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    // Write order a1, b1, c1, d1, a2: heads in head order are a1, b1, c1, d1.
    let a1 = write_one(&h, "a").await;
    let b1 = write_one(&h, "b").await;
    let c1 = write_one(&h, "c").await;
    let d1 = write_one(&h, "d").await;
    let _a2 = write_one(&h, "a").await;

    // Another fetch is choosing key a right now: it holds a's claim (the expression of
    // `Statements::fetch`'s claim) in an open transaction.
    let mut claimer = h.pool().begin().await.unwrap();
    let got: bool =
        sqlx::query_scalar("SELECT pg_try_advisory_xact_lock($1, hashtext($2 || chr(31) || $3))")
            .bind(fetch_claim_class(h.table()))
            .bind("things")
            .bind("a")
            .fetch_one(&mut *claimer)
            .await
            .unwrap();
    assert!(got);
    // And b's head is row-locked by a transaction that has not committed.
    let mut locker = h.pool().begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {} WHERE id = $1 FOR UPDATE",
        h.table().qualified()
    )))
    .bind(b1)
    .fetch_one(&mut *locker)
    .await
    .unwrap();

    assert_eq!(
        fetch_ids(&h, "w1", 2).await,
        vec![c1, d1],
        "the two oldest heads that are free, not a fetch cut short by the busy ones"
    );

    claimer.rollback().await.unwrap();
    locker.rollback().await.unwrap();
    assert_eq!(
        fetch_ids(&h, "w2", 10).await,
        vec![a1, b1],
        "once released, a and b are heads again (c and d are leased to w1; a2 waits behind a1)"
    );
}
