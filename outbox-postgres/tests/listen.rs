//! The relays' wake-up listener (`txoutbox_postgres::WakeListener`): a committed notifying write
//! wakes it; a terminated listening connection is replaced, and the relays are woken once when
//! it is back (notifications sent meanwhile were lost).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use txoutbox_core::event::NewEvent;
use txoutbox_postgres::{PgOutboxWriter, WakeListener};
use txoutbox_testkit::{PgHarness, database_url};
use uuid::Uuid;

fn event() -> NewEvent {
    NewEvent::builder()
        .event_type("t.happened")
        .aggregate("thing", Uuid::new_v4())
        .topic("things")
        .partition_key("k")
        .payload_json(serde_json::json!({ "k": 1 }))
        .build()
        .unwrap()
}

async fn woken(n: &Notify, what: &str) {
    tokio::time::timeout(Duration::from_secs(10), n.notified())
        .await
        .unwrap_or_else(|_| panic!("not woken within 10 s: {what}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_wakes_and_a_terminated_listener_reconnects_and_wakes() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    let waker = Arc::new(Notify::new());
    let listener = WakeListener::spawn(h.pool(), h.table(), vec![waker.clone()])
        .await
        .expect("LISTEN");
    let writer = PgOutboxWriter::new(h.table()).notify(true);
    let write = || async {
        let mut tx = h.pool().begin().await.unwrap();
        writer.write(&mut tx, vec![event()]).await.unwrap();
        tx.commit().await.unwrap();
    };

    write().await;
    woken(&waker, "a committed write").await;

    let terminated: Vec<bool> = sqlx::query_scalar(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE pid <> pg_backend_pid() AND query LIKE 'LISTEN %' AND position($1 in query) > 0",
    )
    .bind(listener.channel())
    .fetch_all(h.pool())
    .await
    .unwrap();
    assert_eq!(terminated, [true], "one listening connection terminated");
    woken(&waker, "the listener's reconnection").await;

    // Listening again: the next write wakes too.
    write().await;
    woken(&waker, "a write after the reconnection").await;
    drop(listener);
}
