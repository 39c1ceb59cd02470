//! The operator's commands.

use std::time::Duration;

use txoutbox_core::event::Status;
use txoutbox_core::repository::{DEFAULT_CLEANUP_MAX_ITERATIONS, check_backend_batch_size};
use uuid::Uuid;

use txoutbox_postgres::{Layout, TableKind};

use crate::DbArgs;
use crate::error::{CliError, Result, code};
use crate::store::{self, StoreKind};

async fn open(db: &DbArgs) -> Result<store::Store> {
    store::open(&db.database_url, db.store, &db.table, 4).await
}

fn fmt_age(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.1}s", d.as_secs_f64()),
        None => "-".into(),
    }
}

/// `migrate --print-sql`: the statements of `migrate` (from `txoutbox_postgres::sql::ddl` or
/// `sql::partitioned::ddl`, the source the library's schema creation runs), each ended by `;`,
/// for a migrations folder. Connects to nothing.
pub fn print_sql(db: &DbArgs, partitioned: bool, months_ahead: u32) -> Result<()> {
    let t = &db.table;
    let (layout, stmts) = if partitioned {
        txoutbox_postgres::sql::partitioned::check_months_ahead(months_ahead)
            .map_err(|e| CliError::usage(format!("--months-ahead: {e}")))?;
        (
            "partitioned",
            txoutbox_postgres::sql::partitioned::ddl(t, months_ahead),
        )
    } else {
        ("plain", txoutbox_postgres::sql::ddl(t))
    };
    println!(
        "-- The outbox table {t} ({layout} layout), as `outbox-relay migrate` creates it ({} {}).
-- Every statement is idempotent.
",
        env!("CARGO_PKG_NAME"),
        env!("CARGO_PKG_VERSION")
    );
    if !partitioned {
        println!("{}", concurrently_note(t));
    }
    println!("{}", ddl_script(&stmts));
    Ok(())
}

/// For a large existing plain table: the indexes to build first with `CREATE INDEX
/// CONCURRENTLY` (which cannot run in a transaction), as comment lines, so the script itself
/// still runs as one migration.
pub fn concurrently_note(t: &txoutbox_postgres::TableName) -> String {
    let mut out = String::from(
        "-- On a large existing table, build these indexes first, each alone and outside a\n\
         -- transaction, so writers are not blocked (the statements below then find them):\n",
    );
    for s in txoutbox_postgres::sql::create_indexes_concurrently(t) {
        out.push_str(&format!("--   {s};\n"));
    }
    out
}

/// Statements joined as a script: each ended by `;` and a blank line.
pub fn ddl_script(stmts: &[String]) -> String {
    stmts
        .iter()
        .map(|s| format!("{s};\n"))
        .collect::<Vec<_>>()
        .join("\n")
}

pub async fn migrate(db: &DbArgs, partitioned: bool, months_ahead: u32) -> Result<()> {
    let layout = if partitioned {
        txoutbox_postgres::sql::partitioned::check_months_ahead(months_ahead)
            .map_err(|e| CliError::usage(format!("--months-ahead: {e}")))?;
        Layout::Partitioned
    } else {
        Layout::Plain
    };
    let t = &db.table;
    if partitioned {
        refuse_plain_table(db).await?;
    }
    match db.store {
        StoreKind::Sqlx => {
            let pool = store::connect_pool(&db.database_url, 2).await?;
            txoutbox_postgres::create_schema_with(&pool, t, layout)
                .await
                .map_err(|e| CliError::new(code::OTHER, e.to_string()))?;
            if partitioned {
                txoutbox_postgres::ensure_partitions(&pool, t, months_ahead)
                    .await
                    .map_err(|e| CliError::new(code::OTHER, e.to_string()))?;
            }
        }
        StoreKind::Diesel => migrate_diesel(db, layout, months_ahead).await?,
    }
    match layout {
        Layout::Plain => println!("outbox table {t} is ready"),
        Layout::Partitioned => println!(
            "outbox table {t} is ready (partitioned by created_at; monthly partitions through {months_ahead} months ahead)"
        ),
    }
    Ok(())
}

/// `migrate --partitioned` on an existing table that is not partitioned: exit 1, nothing
/// changed (the schema creation would refuse it too, as a failure).
async fn refuse_plain_table(db: &DbArgs) -> Result<()> {
    let pool = store::connect_pool(&db.database_url, 1).await?;
    let kind = txoutbox_postgres::table_kind(&pool, &db.table)
        .await
        .map_err(|e| CliError::new(code::DATABASE, format!("checking table {}: {e}", db.table)))?;
    match kind {
        TableKind::Missing | TableKind::Partitioned => Ok(()),
        TableKind::Plain | TableKind::Other(_) => Err(CliError::new(
            code::REFUSED,
            format!(
                "the outbox table {} exists and is not partitioned; --partitioned never converts a table: migrate it without --partitioned, or pick another --table for the partitioned one",
                db.table
            ),
        )),
    }
}

#[cfg(feature = "diesel")]
async fn migrate_diesel(db: &DbArgs, layout: Layout, months_ahead: u32) -> Result<()> {
    let fail = |e: String| CliError::new(code::OTHER, e);
    // Checks the URL and the connection first, for the same messages and exit codes as sqlx.
    store::connect_pool(&db.database_url, 1).await?;
    // Over rustls when the URL asks for TLS (sslmode=require/verify-ca/verify-full).
    let conn = txoutbox_diesel::tls::establish(&db.database_url)
        .await
        .map_err(|e| fail(format!("could not connect: {e}")))?;
    let mut conn = txoutbox_diesel::run_migrations_with(conn, &db.table, layout)
        .await
        .map_err(|e| fail(e.to_string()))?;
    // The migration runs once per table; the coming months are added on every run.
    if layout == Layout::Partitioned {
        txoutbox_diesel::ensure_partitions(&mut conn, &db.table, months_ahead)
            .await
            .map_err(|e| fail(e.to_string()))?;
    }
    Ok(())
}

#[cfg(not(feature = "diesel"))]
async fn migrate_diesel(_db: &DbArgs, _layout: Layout, _months_ahead: u32) -> Result<()> {
    Err(store::not_compiled())
}

#[derive(serde::Serialize)]
struct StatsOut {
    table: String,
    counts: Vec<txoutbox_core::repository::StatusCount>,
    pending: i64,
    failed: i64,
    completed: i64,
    blocked_keys: usize,
    oldest_due_age_seconds: Option<f64>,
}

pub async fn stats(db: &DbArgs, json: bool, lease: Duration) -> Result<()> {
    let s = open(db).await?;
    let t = s.table.to_string();
    let e = |e| CliError::repo(&t, e);
    let counts = s.repo.counts().await.map_err(e)?;
    let blocked = s.repo.blocked_keys(lease, 10_000).await.map_err(e)?;
    let oldest = s.repo.oldest_due_age().await.map_err(e)?;
    let sum = |st: Status| -> i64 {
        counts
            .iter()
            .filter(|c| c.status == st)
            .map(|c| c.count)
            .sum()
    };
    let out = StatsOut {
        table: t.clone(),
        pending: sum(Status::Pending),
        failed: sum(Status::Failed),
        completed: sum(Status::Completed),
        blocked_keys: blocked.len(),
        oldest_due_age_seconds: oldest.map(|d| d.as_secs_f64()),
        counts,
    };
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&out).expect("stats serialize")
        );
        return Ok(());
    }
    println!("table {}", out.table);
    println!("{:<40} {:<10} {:>10}", "TOPIC", "STATUS", "ROWS");
    for c in &out.counts {
        println!("{:<40} {:<10} {:>10}", c.topic, c.status.as_str(), c.count);
    }
    println!(
        "pending {}  failed {}  completed {}  blocked keys {}  oldest due {}",
        out.pending,
        out.failed,
        out.completed,
        out.blocked_keys,
        fmt_age(oldest)
    );
    Ok(())
}

pub async fn blocked_keys(db: &DbArgs, json: bool, limit: usize, lease: Duration) -> Result<()> {
    let s = open(db).await?;
    let t = s.table.to_string();
    let keys = s
        .repo
        .blocked_keys(lease, limit)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&keys).expect("keys serialize")
        );
        return Ok(());
    }
    if keys.is_empty() {
        println!("no blocked keys in {t}");
        return Ok(());
    }
    println!(
        "{:<24} {:<24} {:<36} {:>8} {:<25} {:<20} {:>7}  LAST ERROR",
        "TOPIC", "KEY", "HEAD", "ATTEMPTS", "NEXT TRY", "HELD BY", "WAITING"
    );
    for k in keys {
        println!(
            "{:<24} {:<24} {:<36} {:>8} {:<25} {:<20} {:>7}  {}",
            k.topic,
            k.partition_key,
            k.head_id,
            format!("{}/{}", k.attempts_made, k.max_attempts),
            k.next_try.format("%Y-%m-%d %H:%M:%S%.3f"),
            k.locked_by.as_deref().unwrap_or("-"),
            k.waiting,
            k.last_error.as_deref().unwrap_or("").replace('\n', " ")
        );
    }
    Ok(())
}

pub async fn requeue_failed(
    db: &DbArgs,
    id: Option<Uuid>,
    topic: Option<String>,
    key: Option<String>,
) -> Result<()> {
    let s = open(db).await?;
    let t = s.table.to_string();
    let e = |e| CliError::repo(&t, e);
    if let Some(id) = id {
        if s.repo.requeue_failed(id).await.map_err(e)? {
            println!("requeued {id}");
            return Ok(());
        }
        let why = match s.repo.get(id).await.map_err(e)? {
            None => format!("no event {id} in {t}"),
            Some(row) => format!(
                "event {id} is {}, not failed; only failed rows can be requeued",
                row.status.as_str()
            ),
        };
        return Err(CliError::refused(format!("{why}; nothing changed")));
    }
    // The ids of the failed rows of a topic and/or key (on the chosen store); each goes through
    // the repository's requeue, which only moves rows that are still failed.
    let ids = s.failed_ids(topic.as_deref(), key.as_deref()).await?;
    let what = match (&topic, &key) {
        (Some(tp), Some(k)) => format!("topic {tp:?} and key {k:?}"),
        (Some(tp), None) => format!("topic {tp:?}"),
        (None, Some(k)) => format!("key {k:?}"),
        (None, None) => unreachable!("clap requires one of id, --topic, --key"),
    };
    if ids.is_empty() {
        return Err(CliError::refused(format!(
            "no failed rows for {what} in {t}; nothing changed"
        )));
    }
    let mut n = 0;
    for id in &ids {
        if s.repo.requeue_failed(*id).await.map_err(e)? {
            n += 1;
        }
    }
    println!("requeued {n} failed rows for {what}");
    Ok(())
}

pub async fn release_stale_locks(db: &DbArgs, older_than: Duration) -> Result<()> {
    txoutbox_core::repository::args::stale_timeout(older_than)
        .map_err(|e| CliError::usage(format!("--older-than: {e}")))?;
    let s = open(db).await?;
    let t = s.table.to_string();
    let n = s
        .repo
        .release_stale_locks(older_than)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    println!("released {n} stale locks");
    Ok(())
}

pub async fn cleanup(db: &DbArgs, older_than: Duration, batch_size: usize) -> Result<()> {
    let secs = older_than.as_secs_f64();
    if secs < 86_400.0 || secs % 86_400.0 != 0.0 {
        return Err(CliError::usage(format!(
            "--older-than must be a whole number of days, at least 1d (retention is kept in days), got {secs}s; e.g. --older-than 7d"
        )));
    }
    check_backend_batch_size(batch_size)
        .map_err(|e| CliError::usage(format!("--batch-size: {e}")))?;
    let days = u32::try_from((secs / 86_400.0) as u64)
        .map_err(|_| CliError::usage("--older-than is too long"))?;
    let s = open(db).await?;
    let t = s.table.to_string();
    let n = s
        .repo
        .cleanup_old_events(days, batch_size, DEFAULT_CLEANUP_MAX_ITERATIONS)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    println!("deleted {n} completed rows older than {days} days");
    Ok(())
}

pub async fn force_unlock(db: &DbArgs, id: Uuid, reason: &str) -> Result<()> {
    // Checked before connecting, so a bad reason never reaches the database.
    txoutbox_core::event::force_unlock_text(reason)
        .map_err(|e| CliError::usage(format!("--reason: {e}")))?;
    let s = open(db).await?;
    let t = s.table.to_string();
    s.repo
        .force_unlock(id, reason)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    println!("force-unlocked {id}");
    Ok(())
}
