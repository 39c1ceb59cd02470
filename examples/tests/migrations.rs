//! `outbox-relay migrate --print-sql`: the exact DDL of `migrate` (from
//! `txoutbox_postgres::sql::ddl` / `sql::partitioned::ddl`), printed without a database, that a
//! team commits as a sqlx migration.

mod common;

use std::str::FromStr;
use std::time::Duration;

use common::{Db, command, relay, wait};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use txoutbox_postgres::TableName;

async fn print_sql(args: &[&str]) -> common::Out {
    let mut a = vec!["migrate", "--print-sql"];
    a.extend_from_slice(args);
    let mut c = command(&a);
    c.env_remove("DATABASE_URL");
    wait(c.spawn().unwrap(), Duration::from_secs(30)).await
}

/// Each statement appears in the script, in order, ended by `;`.
fn assert_in_order(script: &str, stmts: &[String]) {
    let mut at = 0;
    for s in stmts {
        let want = format!("{s};");
        let i = script[at..]
            .find(&want)
            .unwrap_or_else(|| panic!("missing or out of order:\n{want}\nin:\n{script}"));
        at += i + want.len();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn print_sql_is_the_ddl_of_migrate_and_runs_as_a_sqlx_migration() {
    let db = Db::fresh().await;
    let out = print_sql(&["--table", &db.table_arg()]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_in_order(&out.stdout, &txoutbox_postgres::sql::ddl(&db.table));
    assert!(
        out.stdout.contains("CREATE TABLE IF NOT EXISTS"),
        "{}",
        out.stdout
    );
    // The CONCURRENTLY forms for a large existing table, as comments.
    for s in txoutbox_postgres::sql::create_indexes_concurrently(&db.table) {
        assert!(s.contains("CONCURRENTLY"), "{s}");
        assert!(out.stdout.contains(&format!("--   {s};")), "{}", out.stdout);
    }

    // Saved in a migrations folder and run by sqlx's migrator, as an application would.
    let dir = std::env::temp_dir().join(format!("outbox-migrations-{}", common::suffix()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("20260101000000_outbox.sql"), &out.stdout).unwrap();
    db.exec(&format!("CREATE SCHEMA \"{}\"", db.schema)).await;
    let opts = PgConnectOptions::from_str(&common::database_url())
        .unwrap()
        .options([("search_path", db.schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(opts)
        .await
        .unwrap();
    let migrator = sqlx::migrate::Migrator::new(dir.as_path()).await.unwrap();
    migrator
        .run(&pool)
        .await
        .expect("the script runs as a migration");
    migrator
        .run(&pool)
        .await
        .expect("and again (nothing to do)");
    pool.close().await;
    std::fs::remove_dir_all(&dir).ok();
    let indexes = db
        .scalar_i64(&format!(
            "SELECT count(*) FROM pg_indexes WHERE schemaname = '{}' AND tablename = 'outbox_events'",
            db.schema
        ))
        .await;
    assert_eq!(
        indexes, 10,
        "the primary key, the seven indexes, the addition and the parked-row index (R193)"
    );

    // The table works with the relay, and `migrate` finds nothing to add.
    let t = db.table_arg();
    let out = relay(&["migrate", "--table", &t]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let out = relay(&["stats", "--table", &t]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn print_sql_partitioned_is_the_partitioned_ddl() {
    let db = Db::fresh().await;
    let out = print_sql(&[
        "--table",
        &db.table_arg(),
        "--partitioned",
        "--months-ahead",
        "2",
    ])
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert_in_order(
        &out.stdout,
        &txoutbox_postgres::sql::partitioned::ddl(&db.table, 2),
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(out.stdout.clone()))
        .execute(&db.pool)
        .await
        .expect("the partitioned script runs");
    let kind = db
        .scalar_i64(&format!(
            "SELECT count(*) FROM pg_class WHERE oid = to_regclass('{}') AND relkind = 'p'",
            db.table.dotted()
        ))
        .await;
    assert_eq!(kind, 1);
    db.drop_schema().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn print_sql_refuses_bad_names_and_settings_without_a_database() {
    for (args, needle) in [
        (&["--table", "Bad-Name"][..], "table"),
        (&["--partitioned", "--months-ahead", "121"], "months"),
    ] {
        let out = print_sql(args).await;
        assert_eq!(out.code, 2, "{args:?}: {}", out.stderr);
        assert!(out.stdout.is_empty(), "{}", out.stdout);
        assert!(
            out.stderr.to_lowercase().contains(needle),
            "{args:?}: {}",
            out.stderr
        );
    }
    // The name printed is the one asked for.
    let t = TableName::new("app.my_outbox").unwrap();
    let out = print_sql(&["--table", "app.my_outbox"]).await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    assert!(out.stdout.contains(&t.qualified()), "{}", out.stdout);
}
