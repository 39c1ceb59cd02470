//! The sqlx writer takes the caller's transaction and refuses a connection in autocommit (R12).

use txoutbox_core::event::NewEvent;
use txoutbox_core::repository::OutboxRepository;
use txoutbox_postgres::PgOutboxWriter;
use txoutbox_testkit::{PgHarness, database_url};
use uuid::Uuid;

fn event(key: &str) -> NewEvent {
    NewEvent::builder()
        .event_type("t.happened")
        .aggregate("thing", Uuid::new_v4())
        .topic("things")
        .partition_key(key)
        .payload_json(serde_json::json!({ "k": key }))
        .build()
        .unwrap()
}

#[tokio::test]
async fn the_writer_refuses_a_connection_in_autocommit_and_writes_nothing() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    let writer = PgOutboxWriter::new(h.table());
    let mut conn = h.pool().acquire().await.unwrap();
    let err = writer.write(&mut conn, vec![event("k")]).await.unwrap_err();
    let text = err.to_string();
    assert!(text.contains("open transaction"), "{text}");
    assert!(text.contains("autocommit"), "{text}");
    assert!(text.contains("pool.begin()"), "{text}");
    // Also with no events: the misuse is reported whatever the call carries.
    assert!(writer.write(&mut conn, Vec::new()).await.is_err());
    drop(conn);
    assert!(
        h.sqlx_repository().counts().await.unwrap().is_empty(),
        "nothing was written"
    );

    // The same writer inside a transaction writes, and the row is there after commit.
    let mut tx = h.pool().begin().await.unwrap();
    let r = writer.write(&mut tx, vec![event("k")]).await.unwrap();
    assert!(r[0].inserted);
    tx.commit().await.unwrap();
    let counts = h.sqlx_repository().counts().await.unwrap();
    assert_eq!(counts.iter().map(|c| c.count).sum::<i64>(), 1);
}
