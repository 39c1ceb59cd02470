//! The diesel backend's partitioned layout beyond the shared suite
//! (`tests/conformance_partitioned.rs`): the partitioned migration (recorded once, under its own
//! version; refused over a plain table), `ensure_partitions`, one idempotency key written
//! concurrently by the diesel and the sqlx writer (R17), and the REPEATABLE READ refusal.

use txoutbox_testkit::diesel as common;

use std::time::{Duration, Instant};

use common::{Count, Name, connect, event};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use txoutbox_conformance::harness::Harness;
use txoutbox_core::RepositoryError;
use txoutbox_diesel::{
    DieselOutboxWriter, Error, Layout, OutboxMigrations, TableName, WriteError, ensure_partitions,
    run_migrations, run_migrations_with,
};
use txoutbox_testkit::{database_url, fresh_schema_name};

async fn count(conn: &mut AsyncPgConnection, q: &str) -> i64 {
    diesel::sql_query(q)
        .get_result::<Count>(conn)
        .await
        .unwrap_or_else(|e| panic!("{q}: {e}"))
        .n
}

/// The partitioned migration creates a partitioned table with the default partition and this
/// month plus three, is recorded as `outbox_<t>_p0001` and runs once; it refuses an existing
/// plain table; `ensure_partitions` adds months and reports a default-partition conflict.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_migration_and_partition_maintenance() {
    let schema = fresh_schema_name();
    let table = TableName::new(&format!("{schema}.outbox_events")).unwrap();
    let conn = run_migrations_with(connect().await, &table, Layout::Partitioned)
        .await
        .expect("partitioned migration");
    let mut conn = run_migrations_with(conn, &table, Layout::Partitioned)
        .await
        .expect("second run");
    let versions = common::migration_versions(&mut conn, &schema).await;
    assert_eq!(
        versions,
        vec![
            OutboxMigrations::with_layout(&table, Layout::Partitioned).version(),
            OutboxMigrations::with_layout(&table, Layout::Partitioned).additions_version(),
            OutboxMigrations::with_layout(&table, Layout::Partitioned).parked_version(),
        ]
    );
    let parts = format!(
        "SELECT count(*) AS n FROM pg_inherits WHERE inhparent = '{}'::regclass",
        table.qualified()
    );
    let kind: Name = diesel::sql_query(format!(
        "SELECT relkind::text AS name FROM pg_class WHERE oid = '{}'::regclass",
        table.qualified()
    ))
    .get_result(&mut conn)
    .await
    .unwrap();
    assert_eq!(kind.name, "p");
    assert_eq!(count(&mut conn, &parts).await, 1 + 4);

    ensure_partitions(&mut conn, &table, 6)
        .await
        .expect("ahead");
    assert_eq!(count(&mut conn, &parts).await, 1 + 7);

    // A row eight months ahead goes to the default partition; month +8 can then not be made.
    diesel::sql_query(format!(
        "INSERT INTO {} (id, event_type, payload, status, attempts_made, max_attempts, \
         scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
         SELECT gen_random_uuid(), 'x', '{{\"n\": 0}}', 'pending', 0, 6, ts, ts, ts, 'agg', \
         gen_random_uuid(), 't', 'k' FROM (SELECT (date_trunc('month', now() AT TIME ZONE 'UTC') \
         + interval '8 months 3 days') AT TIME ZONE 'UTC' AS ts) x",
        table.qualified()
    ))
    .execute(&mut conn)
    .await
    .unwrap();
    let err = ensure_partitions(&mut conn, &table, 8)
        .await
        .expect_err("default partition conflict");
    assert!(matches!(err, Error::Partitions { .. }), "{err:?}");
    assert!(
        err.to_string()
            .contains("outbox_events_default already holds 1 rows of that range"),
        "{err}"
    );
    assert_eq!(count(&mut conn, &parts).await, 1 + 7, "nothing created");

    // The partitioned layout never converts a plain table.
    let plain = TableName::new(&format!("{schema}.plain_events")).unwrap();
    let conn = run_migrations(conn, &plain).await.expect("plain migration");
    let Err(err) = run_migrations_with(conn, &plain, Layout::Partitioned).await else {
        panic!("a plain table is refused");
    };
    assert!(err.to_string().contains("is not partitioned"), "{err}");

    let mut c = connect().await;
    diesel::sql_query(txoutbox_testkit::fixtures::drop_schema(&schema))
        .execute(&mut c)
        .await
        .unwrap();
}

async fn wait_for_advisory_waiter(conn: &mut AsyncPgConnection) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = count(
            conn,
            "SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND pid IN (SELECT pid FROM pg_stat_activity WHERE datname = current_database())",
        )
        .await;
        if n > 0 {
            return;
        }
        assert!(Instant::now() < deadline, "no writer waited for the key");
        tokio::task::yield_now().await;
    }
}

/// R17 across backends on one partitioned table: the diesel writer holds key `ik` in an open
/// transaction, the sqlx writer of `ik` waits for it and then returns its row; one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diesel_and_sqlx_writers_of_one_key_serialize() {
    let h = common::DieselHarness::create_with(&database_url(), Layout::Partitioned).await;
    let mut t1 = h.begin_diesel().await;
    use txoutbox_conformance::harness::WriteTx;
    let r1 = t1.write(vec![event("k", Some("ik"))]).await.unwrap();
    assert!(r1[0].inserted);
    let peer_tx = h.peer().begin_tx().await;
    let second = tokio::spawn(async move {
        let mut t2 = peer_tx;
        let r = t2.write(vec![event("k", Some("ik"))]).await.unwrap();
        t2.commit().await.unwrap();
        r
    });
    let mut probe = connect().await;
    wait_for_advisory_waiter(&mut probe).await;
    assert!(!second.is_finished());
    Box::new(t1).commit().await.unwrap();
    let r2 = second.await.unwrap();
    assert!(!r2[0].inserted);
    assert_eq!(r2[0].event.id, r1[0].event.id);
    let rows = h
        .sql("SELECT count(*) AS n FROM {table} WHERE idempotency_key = 'ik'")
        .await
        .unwrap();
    assert_eq!(rows[0]["n"], 1);
}

/// The diesel writer refuses idempotency keys on the partitioned table under REPEATABLE READ.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diesel_writer_refuses_keys_under_repeatable_read() {
    let h = common::DieselHarness::create_with(&database_url(), Layout::Partitioned).await;
    let w = DieselOutboxWriter::with_layout(h.table(), Layout::Partitioned);
    assert_eq!(w.layout(), Layout::Partitioned);
    let mut conn = h.pool().get().await.unwrap();
    let r: Result<(), WriteError> = conn
        .build_transaction()
        .repeatable_read()
        .run(async |c| {
            w.write(c, vec![event("k", Some("ik"))]).await?;
            Ok(())
        })
        .await;
    let e = RepositoryError::from(r.expect_err("refused"));
    assert!(e.to_string().contains("REPEATABLE READ"), "{e}");
    let rows = h.sql("SELECT count(*) AS n FROM {table}").await.unwrap();
    assert_eq!(rows[0]["n"], 0);
}
