//! The diesel backend's own checks: migrations, the checked-in `table!` schema against the
//! database, the writer's transaction guard, and error mapping.

use txoutbox_testkit::diesel as common;

use common::{Count, Name, connect};
use diesel::sql_types::Text;
use diesel::{QueryDsl, Queryable, Selectable, SelectableHelper};
use diesel_async::{AsyncConnection, RunQueryDsl, SimpleAsyncConnection};
use txoutbox_core::RepositoryError;
use txoutbox_core::event::NewEvent;
use txoutbox_core::repository::OutboxRepository;
use txoutbox_diesel::error::map_diesel;
use txoutbox_diesel::schema::outbox_events;
use txoutbox_diesel::{
    DieselConfig, DieselOutboxRepository, OutboxMigrations, PoolSettings, TableName, WriteError,
    build_pool, run_migrations,
};
use txoutbox_postgres::sql;
use txoutbox_testkit::{database_url, fresh_schema_name};
use uuid::Uuid;

/// Every column of the checked-in `table!`, with the Rust types the backend decodes them into.
#[derive(Queryable, Selectable)]
#[diesel(table_name = outbox_events)]
#[diesel(check_for_backend(diesel::pg::Pg))]
#[allow(dead_code)]
struct TypedRow {
    id: Uuid,
    event_type: String,
    payload: serde_json::Value,
    headers: Option<serde_json::Value>,
    trace_id: Option<String>,
    idempotency_key: Option<String>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
    schema_version: Option<String>,
    status: String,
    attempts_made: i32,
    max_attempts: i32,
    last_error: Option<String>,
    scheduled_at: chrono::DateTime<chrono::Utc>,
    completed_at: Option<chrono::DateTime<chrono::Utc>>,
    locked_at: Option<chrono::DateTime<chrono::Utc>>,
    locked_by: Option<String>,
    created_at: chrono::DateTime<chrono::Utc>,
    updated_at: Option<chrono::DateTime<chrono::Utc>>,
    aggregate_type: String,
    aggregate_id: Uuid,
    topic: String,
    partition_key: String,
}

async fn drop_schema(schema: &str) {
    connect()
        .await
        .batch_execute(&txoutbox_testkit::fixtures::drop_schema(schema))
        .await
        .expect("drop schema");
}

fn event(key: &str) -> NewEvent {
    common::event(key, None)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_once_per_table_and_restore_search_path() {
    let schema = fresh_schema_name();
    let table = TableName::new(&format!("{schema}.outbox_events")).unwrap();
    let other = TableName::new(&format!("{schema}.other_outbox")).unwrap();
    let mut conn = connect().await;
    let before: Name = diesel::sql_query("SELECT current_setting('search_path') AS name")
        .get_result(&mut conn)
        .await
        .unwrap();
    let conn = run_migrations(conn, &table).await.expect("first run");
    let conn = run_migrations(conn, &table)
        .await
        .expect("second run is a no-op");
    let mut conn = run_migrations(conn, &other).await.expect("another table");
    let after: Name = diesel::sql_query("SELECT current_setting('search_path') AS name")
        .get_result(&mut conn)
        .await
        .unwrap();
    assert_eq!(after.name, before.name, "search_path restored");
    let versions = common::migration_versions(&mut conn, &schema).await;
    assert_eq!(
        versions,
        vec![
            OutboxMigrations::new(&other).version(),
            OutboxMigrations::new(&other).additions_version(),
            OutboxMigrations::new(&other).parked_version(),
            OutboxMigrations::new(&table).version(),
            OutboxMigrations::new(&table).additions_version(),
            OutboxMigrations::new(&table).parked_version(),
        ]
    );
    // The indexes the shared DDL defines are all there, for both tables (R33, R78).
    for t in [&table, &other] {
        let found: Vec<Name> = diesel::sql_query(
            "SELECT indexname::text AS name FROM pg_indexes WHERE schemaname = $1 AND tablename = $2 ORDER BY 1",
        )
        .bind::<Text, _>(&schema)
        .bind::<Text, _>(t.table())
        .load(&mut conn)
        .await
        .unwrap();
        let mut want: Vec<String> = sql::indexes(t)
            .into_iter()
            .chain(sql::additions(t))
            .map(|i| i.name)
            .collect();
        want.push(format!("{}_pkey", t.table()));
        want.sort();
        assert_eq!(found.into_iter().map(|n| n.name).collect::<Vec<_>>(), want);
    }
    drop(conn);
    drop_schema(&schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migration_script_is_the_shared_ddl() {
    let t = TableName::new("ops.my_outbox").unwrap();
    let script = OutboxMigrations::new(&t).up_sql();
    for stmt in sql::ddl(&t) {
        assert!(script.contains(&stmt), "missing: {stmt}");
    }
    assert!(script.starts_with(
        "SELECT pg_advisory_xact_lock(hashtext('outbox-schema:ops.my_outbox'::text))"
    ));
}

/// The checked-in `table!` reads a row the shared insert wrote, column for column, with the
/// catalog's column order equal to the shared column list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_schema_matches_the_database() {
    let h = common::DieselHarness::create(&database_url()).await;
    let schema = h.table().schema().unwrap().to_owned();
    let mut conn = connect().await;
    let cols: Vec<Name> = diesel::sql_query(
        "SELECT column_name::text AS name FROM information_schema.columns
          WHERE table_schema = $1 AND table_name = 'outbox_events' ORDER BY ordinal_position",
    )
    .bind::<Text, _>(&schema)
    .load(&mut conn)
    .await
    .unwrap();
    assert_eq!(
        cols.into_iter().map(|c| c.name).collect::<Vec<_>>(),
        sql::COLUMNS.to_vec()
    );

    let writer = h.diesel_repository().writer();
    let e = event("k");
    let id = e.id();
    let mut pooled = h.pool().get().await.unwrap();
    pooled
        .transaction(async |c| {
            writer.write(c, vec![e]).await?;
            Ok::<_, WriteError>(())
        })
        .await
        .expect("write in a transaction");
    // diesel's typed DSL on the checked-in table, with search_path at the trial's schema.
    conn.batch_execute(&format!("SET search_path TO \"{schema}\""))
        .await
        .unwrap();
    let (got_id, status, attempts, max, topic): (Uuid, String, i32, i32, String) =
        outbox_events::table
            .select((
                outbox_events::id,
                outbox_events::status,
                outbox_events::attempts_made,
                outbox_events::max_attempts,
                outbox_events::topic,
            ))
            .first(&mut conn)
            .await
            .expect("typed select");
    assert_eq!(
        (got_id, status.as_str(), attempts, max, topic.as_str()),
        (id, "pending", 0, 6, "t")
    );
    let all: Vec<TypedRow> = outbox_events::table
        .select(TypedRow::as_select())
        .load(&mut conn)
        .await
        .expect("every column decodes with the table! types");
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].payload, serde_json::json!({"n": 1}));
    assert_eq!(all[0].id, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_writer_refuses_to_write_outside_a_transaction() {
    let h = common::DieselHarness::create(&database_url()).await;
    let repo = h.diesel_repository();
    let mut conn = h.pool().get().await.unwrap();
    let err = repo
        .writer()
        .write(&mut conn, vec![event("k")])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("open transaction"), "{err}");
    assert!(repo.counts().await.unwrap().is_empty(), "nothing written");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_diesel_transaction_writes_nothing() {
    let h = common::DieselHarness::create(&database_url()).await;
    let repo = h.diesel_repository();
    let writer = repo.writer();
    let e = event("k");
    let id = e.id();
    let mut conn = h.pool().get().await.unwrap();
    let r: Result<(), WriteError> = conn
        .transaction(async |c| {
            let w = writer.write(c, vec![e]).await?;
            assert!(w[0].inserted);
            Err(WriteError::Diesel(
                diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;
    assert!(r.is_err());
    assert!(repo.get(id).await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constraint_violations_name_the_rule() {
    let h = common::DieselHarness::create(&database_url()).await;
    let repo = h.diesel_repository();
    let e = event("k");
    let id = e.id();
    let mut conn = h.pool().get().await.unwrap();
    conn.transaction(async |c| {
        repo.writer()
            .write(c, vec![e])
            .await
            .map_err(WriteError::from)
    })
    .await
    .unwrap();
    let err = diesel::sql_query(format!(
        "UPDATE {} SET locked_by = 'w1' WHERE id = $1",
        h.table().qualified()
    ))
    .bind::<diesel::sql_types::Uuid, _>(id)
    .execute(&mut conn)
    .await
    .unwrap_err();
    match map_diesel(h.table(), err) {
        RepositoryError::Constraint { message } => {
            assert!(
                message.contains("ck_outbox_events_lock_consistency"),
                "{message}"
            );
            assert!(
                message.contains("locked_at and locked_by are both set or both null"),
                "{message}"
            );
        }
        other => panic!("expected a constraint error, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_database_is_transient_and_a_missing_table_is_a_schema_error() {
    let pool = build_pool(
        "postgres://postgres@127.0.0.1:1/test",
        &PoolSettings::default(),
    )
    .unwrap();
    let repo = DieselOutboxRepository::new(pool, DieselConfig::default());
    let err = repo.now().await.unwrap_err();
    assert!(err.is_transient(), "{err:?}");

    let pool = build_pool(&database_url(), &PoolSettings::default()).unwrap();
    let missing = format!("{}.outbox_events", fresh_schema_name());
    let repo =
        DieselOutboxRepository::new(pool, DieselConfig::default().table_name(&missing).unwrap());
    match repo.get(Uuid::new_v4()).await.unwrap_err() {
        RepositoryError::Schema(m) => assert!(m.contains("migrations"), "{m}"),
        other => panic!("expected a schema error, got {other:?}"),
    }
}

#[test]
fn table_names_are_validated_before_sql() {
    assert!(
        DieselConfig::default()
            .table_name("ops.outbox_events")
            .is_ok()
    );
    for bad in ["Outbox", "a-b", "x\"; drop table y; --", &"a".repeat(32)] {
        assert!(DieselConfig::default().table_name(bad).is_err(), "{bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_diesel_writer_notifies_at_commit_only_when_asked_and_inserting() {
    let h = common::DieselHarness::create(&database_url()).await;
    let mut probe = txoutbox_testkit::WakeProbe::listen(h.peer().pool(), h.table()).await;
    let repo = h.diesel_repository();
    let notifying = repo.writer().notify(true);
    assert!(notifying.notifies() && !repo.writer().notifies());
    let mut conn = h.pool().get().await.unwrap();

    let w = notifying.clone();
    let r: Result<(), WriteError> = conn
        .transaction(async |c| {
            w.write(c, vec![event("a")]).await?;
            Err(WriteError::Diesel(
                diesel::result::Error::RollbackTransaction,
            ))
        })
        .await;
    assert!(r.is_err());
    assert_eq!(
        probe.wakeups().await,
        0,
        "a rolled-back write must not wake relays"
    );

    let w = notifying.clone();
    conn.transaction(async |c| {
        w.write(c, vec![event("a"), event("b")]).await?;
        Ok::<_, WriteError>(())
    })
    .await
    .unwrap();
    assert_eq!(
        probe.wakeups().await,
        1,
        "one wake-up per committed transaction"
    );

    let w = repo.writer();
    conn.transaction(async |c| {
        w.write(c, vec![event("c")]).await?;
        Ok::<_, WriteError>(())
    })
    .await
    .unwrap();
    assert_eq!(probe.wakeups().await, 0, "notify is off by default");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_statements_are_prepared_once_per_connection() {
    let h = common::DieselHarness::create(&database_url()).await;
    // A pool of one connection, so every call below runs on the same session.
    let pool = build_pool(
        &database_url(),
        &PoolSettings::default().max_size(1).unwrap(),
    )
    .unwrap();
    let repo = DieselOutboxRepository::new(
        pool.clone(),
        DieselConfig::default().table(h.table().clone()),
    );
    let req = txoutbox_core::repository::FetchRequest::new(
        txoutbox_core::event::WorkerId::new("w1").unwrap(),
        10,
    );
    for _ in 0..3 {
        let mut conn = pool.get().await.unwrap();
        conn.transaction(async |c| {
            repo.writer().write(c, vec![event("k")]).await?;
            Ok::<_, WriteError>(())
        })
        .await
        .unwrap();
        drop(conn);
        repo.fetch_and_lock(&req).await.unwrap();
    }
    let mut conn = pool.get().await.unwrap();
    let count = |needle: &'static str| {
        diesel::sql_query(
            "SELECT count(*) AS n FROM pg_prepared_statements WHERE strpos(statement, $1) > 0",
        )
        .bind::<Text, _>(needle)
    };
    // The fetch's two statements (fetch_heads.sql, fetch_take.sql).
    for needle in ["win_u AS MATERIALIZED", "taken AS MATERIALIZED"] {
        let fetches: Count = count(needle).get_result(&mut conn).await.unwrap();
        assert_eq!(
            fetches.n, 1,
            "the fetch statement with {needle:?} is prepared once and reused, not re-planned per call"
        );
    }
    let inserts: Count = count("INSERT INTO").get_result(&mut conn).await.unwrap();
    assert_eq!(
        inserts.n, 1,
        "the writer's insert is prepared once and reused"
    );
}
