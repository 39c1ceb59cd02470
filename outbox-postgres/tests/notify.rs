//! The writer's wake-up notification: sent in the caller's transaction, delivered at commit,
//! never for a rollback, never when nothing was inserted, and only when asked for.

use txoutbox_core::event::NewEvent;
use txoutbox_postgres::PgOutboxWriter;
use txoutbox_testkit::{PgHarness, WakeProbe, database_url};
use uuid::Uuid;

fn event(key: &str, idem: Option<&str>) -> NewEvent {
    let b = NewEvent::builder()
        .event_type("t.happened")
        .aggregate("thing", Uuid::new_v4())
        .topic("things")
        .partition_key(key)
        .payload_json(serde_json::json!({ "k": key }));
    match idem {
        Some(k) => b.idempotency_key(k),
        None => b,
    }
    .build()
    .unwrap()
}

#[tokio::test]
async fn the_writer_notifies_at_commit_only_when_it_inserted_and_was_asked_to() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    let mut probe = WakeProbe::listen(h.pool(), h.table()).await;
    let notifying = PgOutboxWriter::new(h.table()).notify(true);
    let silent = PgOutboxWriter::new(h.table());
    assert!(notifying.notifies() && !silent.notifies());

    // Rolled back: never delivered.
    let mut tx = h.pool().begin().await.unwrap();
    notifying
        .write(&mut tx, vec![event("a", None)])
        .await
        .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(
        probe.wakeups().await,
        0,
        "a rolled-back write must not wake relays"
    );

    // Committed: one wake-up per transaction, however many events.
    let mut tx = h.pool().begin().await.unwrap();
    notifying
        .write(&mut tx, vec![event("a", Some("idem-1")), event("b", None)])
        .await
        .unwrap();
    notifying
        .write(&mut tx, vec![event("c", None)])
        .await
        .unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        probe.wakeups().await,
        1,
        "PostgreSQL folds one transaction's wake-ups"
    );

    // Nothing inserted (the idempotency key exists): nothing to wake for.
    let mut tx = h.pool().begin().await.unwrap();
    let r = notifying
        .write(&mut tx, vec![event("a", Some("idem-1"))])
        .await
        .unwrap();
    assert!(!r[0].inserted);
    tx.commit().await.unwrap();
    assert_eq!(
        probe.wakeups().await,
        0,
        "a write that inserted nothing must not notify"
    );

    // Notification off: the write commits silently.
    let mut tx = h.pool().begin().await.unwrap();
    silent.write(&mut tx, vec![event("d", None)]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(
        probe.wakeups().await,
        0,
        "notify(false) is the default and sends nothing"
    );
}
