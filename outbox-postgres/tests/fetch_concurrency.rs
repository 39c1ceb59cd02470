//! Concurrent fetches take different heads (R20, R21, R85): a head another transaction has
//! row-locked is passed over for the next head, so the batch still fills, and the fetch never
//! waits; open fetches read disjoint windows; a fetch holds no lock per key it visits.

use std::time::Duration;

use txoutbox_core::event::{NewEvent, WorkerId};
use txoutbox_core::repository::{DeliveryBound, FetchRequest, OutboxRepository};
use txoutbox_postgres::PgOutboxWriter;
use txoutbox_postgres::driver::sqlx::fetch_rows;
use txoutbox_postgres::sql::WalkCursor;
use txoutbox_testkit::shapes::{self, Shape};
use txoutbox_testkit::{PgHarness, database_url};
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
async fn row_locked_heads_are_passed_over_and_the_batch_still_fills() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    // Write order a1, b1, c1, d1, a2: heads in head order are a1, b1, c1, d1.
    let a1 = write_one(&h, "a").await;
    let b1 = write_one(&h, "b").await;
    let c1 = write_one(&h, "c").await;
    let d1 = write_one(&h, "d").await;
    let _a2 = write_one(&h, "a").await;

    // a's and b's heads are row-locked by a transaction that has not committed (a fetch of a
    // relay in transaction delivery, or any other writer).
    let mut locker = h.pool().begin().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT id FROM {} WHERE id = ANY($1) FOR UPDATE",
        h.table().qualified()
    )))
    .bind(vec![a1, b1])
    .fetch_all(&mut *locker)
    .await
    .unwrap();

    let got = fetch_ids(&h, "w1", 2).await;
    locker.rollback().await.unwrap();
    assert_eq!(
        got,
        vec![c1, d1],
        "the two oldest heads that are free, not a fetch cut short by the busy ones, and never \
         a2 while a1 is held"
    );
    assert_eq!(
        fetch_ids(&h, "w2", 10).await,
        vec![a1, b1],
        "once released, a and b are heads again (c and d are leased to w1; a2 waits behind a1)"
    );
}

/// Two fetches in open delivery transactions at once (two relays in transaction delivery)
/// take disjoint, full batches: the second reads past the rows the first holds instead of
/// colliding with it (R85, PG-12).
#[tokio::test]
async fn two_open_fetches_take_disjoint_full_batches() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    let mut ids = Vec::new();
    for k in 0..12 {
        ids.push(write_one(&h, &format!("k{k}")).await);
    }
    let repo = h.sqlx_repository();
    let bound = DeliveryBound {
        server_timeout: Duration::from_secs(30),
    };
    let req =
        |worker: &'static str| FetchRequest::new(WorkerId::new(worker).unwrap(), 3).max_per_key(1);
    let (got1, d1) = repo.begin_delivery(&req("w1"), bound).await.unwrap();
    let (got2, d2) = tokio::time::timeout(
        Duration::from_secs(10),
        repo.begin_delivery(&req("w2"), bound),
    )
    .await
    .expect("never waits")
    .unwrap();
    let id = |r: &txoutbox_core::repository::Fetched| -> Uuid { r.id() };
    let (got1, got2): (Vec<Uuid>, Vec<Uuid>) =
        (got1.iter().map(id).collect(), got2.iter().map(id).collect());
    d1.rollback().await;
    d2.rollback().await;
    assert_eq!(got1, ids[0..3], "the first fetch takes the oldest heads");
    // A delivery transaction keeps only the rows it took (its window's row locks end with the
    // heads statement, which runs in its own transaction before the take), so the second takes
    // the next three heads: a full batch, disjoint, without waiting.
    assert_eq!(got2, ids[3..6], "the second fetch takes the next heads");
}

/// Regression (issue 11): the fetch took one advisory lock per key it visited, so a stuck key
/// with rows behind it plus many keys exhausted PostgreSQL's lock table. A fetch transaction
/// now holds no advisory lock and a constant number of other locks, whatever the number of keys
/// (R85): checked on a stuck key with 200 rows behind it plus 3,000 one-row keys, where the
/// earlier statement held 3,001 advisory locks.
#[tokio::test]
async fn a_fetch_holds_no_lock_per_visited_key() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    shapes::build(
        h.pool(),
        h.table(),
        Shape::Stuck {
            behind: 200,
            keys: 3_000,
        },
    )
    .await
    .unwrap();
    let repo = h.sqlx_repository();
    let stmts = repo.statements().clone();
    let req = FetchRequest::new(WorkerId::new("w1").unwrap(), 100).max_per_key(16);
    let p = txoutbox_postgres::sql::FetchParams::new(&req);
    let mut tx = h.pool().begin().await.unwrap();
    let rows = fetch_rows(&mut tx, &stmts, "w1", &p, &WalkCursor::default())
        .await
        .unwrap();
    let (advisory, total): (i64, i64) = sqlx::query_as(
        "SELECT count(*) FILTER (WHERE locktype = 'advisory'), count(*)
           FROM pg_locks WHERE pid = pg_backend_pid()",
    )
    .fetch_one(&mut *tx)
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    assert_eq!(rows.len(), 100, "a full batch of the one-row keys");
    assert_eq!(advisory, 0, "advisory locks held by the fetch");
    assert!(total < 64, "locks held by the fetch transaction: {total}");
}
