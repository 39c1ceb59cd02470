//! The partitioned layout of the sqlx backend beyond the shared suite
//! (`tests/conformance_partitioned.rs`): the table's shape against Appendix A (the partitioned
//! form of PG-02), schema creation over an existing plain table (the partitioned form of
//! PG-10), concurrent writers of one idempotency key (R17), keys already stored twice, the
//! isolation levels, and partition maintenance. Each test works in a fresh schema.

use std::time::{Duration, Instant};

use chrono::{Datelike, Months, TimeZone, Utc};
use serde_json::json;
use sqlx::{AssertSqlSafe, PgPool, Row};
use txoutbox_core::event::NewEvent;
use txoutbox_core::repository::WriteResult;
use txoutbox_core::{OutboxRepository, RepositoryError};
use txoutbox_postgres::sql::partitioned::{self, MONTHS_AHEAD_MAX};
use txoutbox_postgres::{Error, Layout, PgOutboxWriter, TableName, create_schema_with};
use txoutbox_testkit::{PgHarness, database_url};
use uuid::Uuid;

async fn harness() -> PgHarness {
    PgHarness::create_with(&database_url(), "outbox_events", Layout::Partitioned).await
}

fn ev(key: &str, idem: Option<&str>, n: i64) -> NewEvent {
    let b = NewEvent::builder()
        .topic("orders")
        .partition_key(key)
        .event_type("order.placed")
        .payload_json(json!({ "n": n }))
        .aggregate("order", Uuid::new_v4());
    match idem {
        Some(k) => b.idempotency_key(k),
        None => b,
    }
    .build()
    .expect("valid event")
}

async fn count_where(pool: &PgPool, t: &TableName, cond: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE {cond}",
        t.qualified()
    )))
    .fetch_one(pool)
    .await
    .expect("count")
}

/// The bare name of the partition holding row `id`.
async fn partition_of(pool: &PgPool, t: &TableName, id: Uuid) -> String {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT c.relname::text FROM {} r JOIN pg_class c ON c.oid = r.tableoid WHERE r.id = $1",
        t.qualified()
    )))
    .bind(id)
    .fetch_one(pool)
    .await
    .expect("partition of row")
}

async fn partitions(pool: &PgPool, t: &TableName) -> Vec<String> {
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid \
         WHERE i.inhparent = '{}'::regclass ORDER BY 1",
        t.qualified()
    )))
    .fetch_all(pool)
    .await
    .expect("partitions")
}

/// Catalog rows of `rel` as text lines, the table name replaced by `<t>`.
async fn catalog(pool: &PgPool, schema: &str, table: &str, query: &str) -> Vec<String> {
    let rel = format!("'\"{schema}\".\"{table}\"'::regclass");
    let rows: Vec<String> = sqlx::query_scalar(AssertSqlSafe(query.replace("{rel}", &rel)))
        .fetch_all(pool)
        .await
        .expect("catalog query");
    let mut rows: Vec<String> = rows
        .into_iter()
        .map(|r| {
            r.replace(&format!("{schema}."), "<s>.")
                .replace(table, "<t>")
                .replace(" ON ONLY ", " ON ")
        })
        .collect();
    // Constraints and indexes sort by their derived names; columns keep their order.
    if !query.contains("attnum") {
        rows.sort();
    }
    rows
}

const COLUMNS_Q: &str = "SELECT a.attname || ' ' || format_type(a.atttypid, a.atttypmod) || ' ' || \
     a.attnotnull || ' ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '-') \
     FROM pg_attribute a LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum \
     WHERE a.attrelid = {rel} AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum";
const CONSTRAINTS_Q: &str = "SELECT conname || ' ' || pg_get_constraintdef(oid) FROM pg_constraint \
     WHERE conrelid = {rel} ORDER BY conname";
const INDEXES_Q: &str = "SELECT pg_get_indexdef(ix.indexrelid) FROM pg_index ix \
     JOIN pg_class i ON i.oid = ix.indexrelid WHERE ix.indrelid = {rel} ORDER BY i.relname";

/// The partitioned form of PG-02: the same columns (types, lengths, nullability, defaults) and
/// CHECK constraints as Appendix A; the primary key holds created_at; the same seven index
/// names and definitions, the idempotency-key one not unique, and the additions; RANGE on created_at with a
/// default partition and this month plus three.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_table_matches_appendix_a_but_for_the_keys() {
    let h = harness().await;
    let pool = h.pool();
    let s = h.schema().to_owned();
    let anc = "anc_events";
    for ddl in [
        txoutbox_conformance::scenarios::pg::ancestor_ddl(&s, anc),
        txoutbox_conformance::scenarios::pg::additions_ddl(&s, anc),
    ] {
        sqlx::raw_sql(AssertSqlSafe(ddl))
            .execute(pool)
            .await
            .expect("ancestor DDL and additions");
    }
    let t = h.table().table().to_owned();

    assert_eq!(
        catalog(pool, &s, &t, COLUMNS_Q).await,
        catalog(pool, &s, anc, COLUMNS_Q).await
    );
    let ours = catalog(pool, &s, &t, CONSTRAINTS_Q).await;
    let theirs = catalog(pool, &s, anc, CONSTRAINTS_Q).await;
    assert_eq!(ours.len(), 4);
    for (o, a) in ours.iter().zip(&theirs) {
        if o.starts_with("<t>_pkey") {
            assert_eq!(o, "<t>_pkey PRIMARY KEY (id, created_at)");
            assert_eq!(a, "<t>_pkey PRIMARY KEY (id)");
        } else {
            assert_eq!(o, a);
        }
    }
    let ours = catalog(pool, &s, &t, INDEXES_Q).await;
    let theirs = catalog(pool, &s, anc, INDEXES_Q).await;
    assert_eq!(ours.len(), 10, "{ours:?}");
    let mut expected: Vec<String> = theirs
        .iter()
        .map(|a| {
            if a.contains("_idempotency_key") {
                a.replace("CREATE UNIQUE INDEX", "CREATE INDEX")
            } else {
                a.replace("USING btree (id)", "USING btree (id, created_at)")
            }
        })
        .collect();
    expected.sort();
    assert_eq!(ours, expected);
    let key: String = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT pg_get_partkeydef('{}'::regclass)",
        h.table().qualified()
    )))
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(key, "RANGE (created_at)");

    let now: chrono::DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .fetch_one(pool)
        .await
        .unwrap();
    let first = Utc
        .with_ymd_and_hms(now.year(), now.month(), 1, 0, 0, 0)
        .unwrap();
    let mut want: Vec<String> = (0..=partitioned::DEFAULT_MONTHS_AHEAD)
        .map(|i| {
            let m = first + Months::new(i);
            partitioned::month_partition(h.table(), m.year(), m.month())
        })
        .collect();
    want.push(partitioned::default_partition(h.table()));
    want.sort();
    assert_eq!(partitions(pool, h.table()).await, want);
    // Every partition carries the ten indexes (the parked-row index of R193 the tenth).
    for p in &want {
        assert_eq!(catalog(pool, &s, p, INDEXES_Q).await.len(), 10, "{p}");
    }
}

/// The partitioned form of PG-10: schema creation is idempotent on a partitioned table and
/// refuses, changing nothing, an existing plain (ancestor) table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schema_creation_is_idempotent_and_refuses_a_plain_table() {
    let h = harness().await;
    let pool = h.pool();
    let s = h.schema().to_owned();
    let t = h.table().table().to_owned();
    let before = (
        catalog(pool, &s, &t, INDEXES_Q).await,
        partitions(pool, h.table()).await,
    );
    create_schema_with(pool, h.table(), Layout::Partitioned)
        .await
        .expect("second run");
    let after = (
        catalog(pool, &s, &t, INDEXES_Q).await,
        partitions(pool, h.table()).await,
    );
    assert_eq!(before, after);

    let anc = "anc_events";
    sqlx::raw_sql(AssertSqlSafe(
        txoutbox_conformance::scenarios::pg::ancestor_ddl(&s, anc),
    ))
    .execute(pool)
    .await
    .expect("ancestor DDL");
    let anc_t = TableName::new(&format!("{s}.{anc}")).unwrap();
    let idx_before = catalog(pool, &s, anc, INDEXES_Q).await;
    let err = create_schema_with(pool, &anc_t, Layout::Partitioned)
        .await
        .expect_err("a plain table is not converted");
    let msg = err.to_string();
    assert!(msg.contains("exists and is not partitioned"), "{msg}");
    assert_eq!(catalog(pool, &s, anc, INDEXES_Q).await, idx_before);
    let parts: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM pg_class WHERE relname = '{anc}_default'"
    )))
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(parts, 0);
}

/// Waits (polling, with a deadline) until a session of `pool`'s database waits for an
/// advisory lock.
async fn wait_for_advisory_waiter(pool: &PgPool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND pid IN (SELECT pid FROM pg_stat_activity WHERE datname = current_database())",
        )
        .fetch_one(pool)
        .await
        .unwrap();
        if n > 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the second writer never waited for the key's lock"
        );
        tokio::task::yield_now().await;
    }
}

async fn write_in(
    pool: &PgPool,
    w: &PgOutboxWriter,
    events: Vec<NewEvent>,
) -> (sqlx::Transaction<'static, sqlx::Postgres>, Vec<WriteResult>) {
    let mut tx = pool.begin().await.unwrap();
    let r = w.write(&mut tx, events).await.expect("write");
    (tx, r)
}

/// R17 on the partitioned table: a second transaction writing the same idempotency key waits
/// for the first; after the first commits it returns the first's row (inserted = false) and
/// the table holds one row; after a rollback instead, it inserts its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_of_one_key_end_with_one_row() {
    let h = harness().await;
    let pool = h.pool().clone();
    let w = h.sqlx_repository().writer();
    assert_eq!(w.layout(), Layout::Partitioned);
    for commit_first in [true, false] {
        let key = format!("ik-{commit_first}");
        let (t1, r1) = write_in(&pool, &w, vec![ev("k", Some(&key), 1)]).await;
        assert!(r1[0].inserted);
        let second = {
            let (pool, w, key) = (pool.clone(), w.clone(), key.clone());
            tokio::spawn(async move {
                let (tx, r) = write_in(&pool, &w, vec![ev("k", Some(&key), 2)]).await;
                tx.commit().await.unwrap();
                r
            })
        };
        wait_for_advisory_waiter(&pool).await;
        assert!(!second.is_finished(), "the second writer did not wait");
        if commit_first {
            t1.commit().await.unwrap();
        } else {
            t1.rollback().await.unwrap();
        }
        let r2 = second.await.unwrap();
        let cond = format!("idempotency_key = '{key}'");
        assert_eq!(count_where(&pool, h.table(), &cond).await, 1);
        if commit_first {
            assert!(!r2[0].inserted);
            assert_eq!(r2[0].event.id, r1[0].event.id);
            assert_eq!(r2[0].event.payload, json!({"n": 1}));
        } else {
            assert!(r2[0].inserted);
            assert_ne!(r2[0].event.id, r1[0].event.id);
            assert_eq!(r2[0].event.payload, json!({"n": 2}));
        }
    }
}

/// Under SERIALIZABLE the database aborts one of two writers of a key whose snapshots overlap:
/// still one row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serializable_writers_of_one_key_end_with_one_row() {
    let h = harness().await;
    let pool = h.pool().clone();
    let w = h.sqlx_repository().writer();
    let begin = |pool: PgPool| async move {
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE")
            .execute(&mut *tx)
            .await
            .unwrap();
        // Takes the snapshot now, before the other writer commits.
        sqlx::query("SELECT 1").execute(&mut *tx).await.unwrap();
        tx
    };
    let mut t1 = begin(pool.clone()).await;
    let t2 = begin(pool.clone()).await;
    w.write(&mut t1, vec![ev("k", Some("ik"), 1)])
        .await
        .expect("first write");
    let second = {
        let w = w.clone();
        tokio::spawn(async move {
            let mut t2 = t2;
            let r = w.write(&mut t2, vec![ev("k", Some("ik"), 2)]).await?;
            t2.commit()
                .await
                .map_err(|e| txoutbox_postgres::driver::sqlx::map_err(&TableName::default(), e))?;
            Ok::<_, RepositoryError>(r)
        })
    };
    wait_for_advisory_waiter(&pool).await;
    t1.commit().await.unwrap();
    match second.await.unwrap() {
        Err(e) => assert!(e.is_transient(), "{e}"),
        Ok(r) => assert!(!r[0].inserted, "{r:?}"),
    }
    assert_eq!(
        count_where(&pool, h.table(), "idempotency_key = 'ik'").await,
        1
    );
}

/// Under REPEATABLE READ a write with idempotency keys is refused (its snapshot could miss a
/// concurrent writer's row); one without keys goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeatable_read_refuses_keys() {
    let h = harness().await;
    let w = h.sqlx_repository().writer();
    let mut tx = h.pool().begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        .execute(&mut *tx)
        .await
        .unwrap();
    let r = w
        .write(&mut tx, vec![ev("k", None, 1)])
        .await
        .expect("no key");
    assert!(r[0].inserted);
    let e = w
        .write(&mut tx, vec![ev("k", Some("ik"), 2)])
        .await
        .expect_err("refused");
    assert!(e.to_string().contains("REPEATABLE READ"), "{e}");
    tx.commit().await.unwrap();
    assert_eq!(count_where(h.pool(), h.table(), "true").await, 1);
}

/// A key already stored twice (rows written without the locks): a write of it returns the
/// oldest row and inserts nothing; a repeated id (no key) returns the stored row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_stored_twice_return_the_oldest_row_and_ids_dedupe() {
    let h = harness().await;
    let pool = h.pool();
    let (old, new) = (Uuid::new_v4(), Uuid::new_v4());
    for (id, age) in [(new, "1 minute"), (old, "2 minutes")] {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {} (id, event_type, payload, status, attempts_made, max_attempts, \
             scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, \
             partition_key, idempotency_key) VALUES ($1, 'x', '{{\"n\": 0}}', 'pending', 0, 6, \
             now(), now() - interval '{age}', now(), 'agg', gen_random_uuid(), 'orders', 'k', 'dup')",
            h.table().qualified()
        )))
        .bind(id)
        .execute(pool)
        .await
        .unwrap();
    }
    let w = h.sqlx_repository().writer();
    let (tx, r) = write_in(pool, &w, vec![ev("k", Some("dup"), 1)]).await;
    tx.commit().await.unwrap();
    assert!(!r[0].inserted);
    assert_eq!(r[0].event.id, old);

    let e = ev("k", None, 5);
    let (tx, first) = write_in(pool, &w, vec![e.clone()]).await;
    tx.commit().await.unwrap();
    let (tx, again) = write_in(pool, &w, vec![e]).await;
    tx.commit().await.unwrap();
    assert!(first[0].inserted);
    assert!(!again[0].inserted);
    assert_eq!(again[0].event.id, first[0].event.id);
    assert_eq!(count_where(pool, h.table(), "true").await, 3);
}

/// Rows land in the partition of their month; ensure_partitions adds months ahead
/// idempotently, refuses a bad count, and fails with a clear error, creating nothing, when the
/// default partition already holds rows of a month it would create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensure_partitions_adds_months_and_refuses_default_conflicts() {
    let h = harness().await;
    let pool = h.pool();
    let t = h.table();
    let repo = h.sqlx_repository();
    let w = repo.writer();
    let (tx, r) = write_in(pool, &w, vec![ev("k", None, 1)]).await;
    tx.commit().await.unwrap();
    let now = repo.now().await.unwrap();
    let first = Utc
        .with_ymd_and_hms(now.year(), now.month(), 1, 0, 0, 0)
        .unwrap();
    let month = |i: u32| {
        let m = first + Months::new(i);
        partitioned::month_partition(t, m.year(), m.month())
    };
    assert_eq!(partition_of(pool, t, r[0].event.id).await, month(0));

    repo.ensure_partitions(6).await.expect("six months ahead");
    repo.ensure_partitions(6).await.expect("idempotent");
    let parts = partitions(pool, t).await;
    assert_eq!(parts.len(), 1 + 7, "{parts:?}");
    assert!(parts.contains(&month(6)));
    assert!(!parts.contains(&month(7)));

    // A row of month +8 lands in the default partition; creating month +8 must then fail.
    let at = first + Months::new(8) + chrono::Duration::days(3);
    let stray = Uuid::new_v4();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (id, event_type, payload, status, attempts_made, max_attempts, \
         scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, \
         partition_key) VALUES ($1, 'x', '{{\"n\": 0}}', 'pending', 0, 6, $2, $2, $2, 'agg', \
         gen_random_uuid(), 'orders', 'k')",
        t.qualified()
    )))
    .bind(stray)
    .bind(at)
    .execute(pool)
    .await
    .unwrap();
    assert_eq!(
        partition_of(pool, t, stray).await,
        partitioned::default_partition(t)
    );
    let err = repo
        .ensure_partitions(9)
        .await
        .expect_err("month +8 conflicts with the default partition");
    let msg = err.to_string();
    assert!(matches!(err, Error::Database { .. }), "{err:?}");
    assert!(msg.contains(&month(8)), "{msg}");
    assert!(msg.contains("default partition"), "{msg}");
    assert!(msg.contains("1 rows"), "{msg}");
    // Nothing was created, not even month +7 before it.
    assert_eq!(partitions(pool, t).await, parts);

    let err = repo
        .ensure_partitions(MONTHS_AHEAD_MAX + 1)
        .await
        .expect_err("too many months");
    assert!(matches!(err, Error::Partitions(_)), "{err:?}");

    // Moving the row out lets the partition be created; the row stays readable.
    sqlx::query(AssertSqlSafe(format!(
        "DELETE FROM {} WHERE id = $1",
        t.qualified()
    )))
    .bind(stray)
    .execute(pool)
    .await
    .unwrap();
    repo.ensure_partitions(9).await.expect("no conflict now");
    assert_eq!(partitions(pool, t).await.len(), 1 + 10);
    let row = sqlx::query(AssertSqlSafe(format!(
        "SELECT count(*) AS n FROM {}",
        t.qualified()
    )))
    .fetch_one(pool)
    .await
    .unwrap();
    assert_eq!(row.get::<i64, _>("n"), 1);
}
