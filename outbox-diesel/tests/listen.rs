//! The relays' wake-up listener of the diesel backend (`txoutbox_diesel::WakeListener`, on
//! diesel-async's notification stream): a committed notifying write wakes it; a terminated
//! listening connection is replaced, and the relays are woken once when it is back.

use txoutbox_testkit::diesel as common;

use std::sync::Arc;
use std::time::Duration;

use diesel::sql_types::{Bool, Text};
use diesel_async::{AsyncConnection, RunQueryDsl};
use tokio::sync::Notify;
use txoutbox_core::event::NewEvent;
use txoutbox_diesel::{WakeListener, WriteError};
use txoutbox_testkit::database_url;
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

#[derive(diesel::QueryableByName)]
struct Terminated {
    #[diesel(sql_type = Bool)]
    t: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_wakes_and_a_terminated_listener_reconnects_and_wakes() {
    let h = common::DieselHarness::create(&database_url()).await;
    let waker = Arc::new(Notify::new());
    let listener = WakeListener::spawn(&database_url(), h.table(), vec![waker.clone()])
        .await
        .expect("LISTEN");
    let writer = h.diesel_repository().writer().notify(true);
    let write = || async {
        let mut conn = h.pool().get().await.unwrap();
        let w = writer.clone();
        conn.transaction(async |c| {
            w.write(c, vec![event()]).await?;
            Ok::<_, WriteError>(())
        })
        .await
        .unwrap();
    };

    write().await;
    woken(&waker, "a committed write").await;

    let mut conn = h.pool().get().await.unwrap();
    let terminated: Vec<Terminated> = diesel::sql_query(
        "SELECT pg_terminate_backend(pid) AS t FROM pg_stat_activity \
         WHERE pid <> pg_backend_pid() AND query LIKE 'LISTEN %' AND position($1 in query) > 0",
    )
    .bind::<Text, _>(listener.channel())
    .load(&mut conn)
    .await
    .unwrap();
    drop(conn);
    assert_eq!(
        terminated.iter().map(|r| r.t).collect::<Vec<_>>(),
        [true],
        "one listening connection terminated"
    );
    woken(&waker, "the listener's reconnection").await;

    write().await;
    woken(&waker, "a write after the reconnection").await;
    drop(listener);
}
