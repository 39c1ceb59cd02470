//! The operator's commands.

use std::time::Duration;

use txoutbox_core::event::Status;
use txoutbox_core::repository::{
    DEFAULT_CLEANUP_MAX_ITERATIONS, ParkedTarget, check_backend_batch_size,
};
use uuid::Uuid;

use txoutbox_postgres::{Layout, TableKind};

use crate::DbArgs;
use crate::error::{CliError, Result, TableRole, code};
use crate::store::{self, StoreKind};

async fn open(db: &DbArgs) -> Result<store::Store> {
    store::open(&db.conn, &db.table, 4).await
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
    db.conn.require_direct("migrate")?;
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
    match db.conn.store {
        StoreKind::Sqlx => {
            let pool = store::connect_pool(&db.conn.database_url, 2).await?;
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
    let pool = store::connect_pool(&db.conn.database_url, 1).await?;
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
    store::connect_pool(&db.conn.database_url, 1).await?;
    // Over rustls when the URL asks for TLS (sslmode=require/verify-ca/verify-full).
    let conn = txoutbox_diesel::tls::establish(&db.conn.database_url)
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

// ---- Shared by the outbox and the inbox commands: argument checks, output, refusals. ----

/// Prints `value` as pretty JSON with `--json`, else the text `text` builds.
pub fn report<T: serde::Serialize>(json: bool, value: &T, text: impl FnOnce() -> String) {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(value).expect("output serializes")
        );
    } else {
        println!("{}", text());
    }
}

fn fmt_age(d: Option<Duration>) -> String {
    match d {
        Some(d) => format!("{:.1}s", d.as_secs_f64()),
        None => "-".into(),
    }
}

/// Rows per status, summed over topics or sources.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Totals {
    pub pending: i64,
    pub failed: i64,
    pub completed: i64,
}

impl Totals {
    pub fn sum(counts: impl IntoIterator<Item = (Status, i64)>) -> Self {
        let mut t = Totals::default();
        for (status, n) in counts {
            match status {
                Status::Pending => t.pending += n,
                Status::Failed => t.failed += n,
                Status::Completed => t.completed += n,
            }
        }
        t
    }
}

/// The text of `stats`: one line per (topic or source, status) under `scope` (`TOPIC`,
/// `SOURCE`), then the totals.
pub fn stats_text<'a>(
    title: &str,
    scope: &str,
    rows: impl IntoIterator<Item = (&'a str, Status, i64)>,
    totals: Totals,
    blocked_keys: usize,
    oldest: Option<Duration>,
) -> String {
    let mut out = format!("{title}\n{scope:<40} {:<10} {:>10}\n", "STATUS", "ROWS");
    for (name, status, n) in rows {
        out.push_str(&format!("{name:<40} {:<10} {n:>10}\n", status.as_str()));
    }
    out.push_str(&format!(
        "pending {}  failed {}  completed {}  blocked keys {blocked_keys}  oldest due {}",
        totals.pending,
        totals.failed,
        totals.completed,
        fmt_age(oldest)
    ));
    out
}

/// One blocked key as `blocked-keys` prints it (outbox: topic; inbox: source).
pub struct BlockedRow<'a> {
    pub scope: &'a str,
    pub key: &'a str,
    pub head: Uuid,
    pub attempts_made: i32,
    pub max_attempts: i32,
    pub next_try: chrono::DateTime<chrono::Utc>,
    pub locked_by: Option<&'a str>,
    pub waiting: i64,
    pub last_error: Option<&'a str>,
    /// Parked (R193): shown as `PARKED` in the HELD BY column.
    pub parked: bool,
}

/// The text of `blocked-keys`: a table under `scope` (`TOPIC`, `SOURCE`), or `none` when
/// there is no row.
pub fn blocked_text(scope: &str, rows: Vec<BlockedRow<'_>>, none: String) -> String {
    if rows.is_empty() {
        return none;
    }
    let mut out = format!(
        "{scope:<24} {:<24} {:<36} {:>8} {:<25} {:<20} {:>7}  LAST ERROR",
        "KEY", "HEAD", "ATTEMPTS", "NEXT TRY", "HELD BY", "WAITING"
    );
    for k in rows {
        out.push_str(&format!(
            "\n{:<24} {:<24} {:<36} {:>8} {:<25} {:<20} {:>7}  {}",
            k.scope,
            k.key,
            k.head,
            format!("{}/{}", k.attempts_made, k.max_attempts),
            k.next_try.format("%Y-%m-%d %H:%M:%S%.3f"),
            if k.parked {
                "PARKED"
            } else {
                k.locked_by.unwrap_or("-")
            },
            k.waiting,
            k.last_error.unwrap_or("").replace('\n', " ")
        ));
    }
    out
}

/// `--older-than` of `release-stale-locks`: at least 1 s (checked before connecting).
pub fn check_stale_age(older_than: Duration) -> Result<()> {
    txoutbox_core::repository::args::stale_timeout(older_than)
        .map(|_| ())
        .map_err(|e| CliError::usage(format!("--older-than: {e}")))
}

/// `--older-than` and `--batch-size` of `cleanup`: the retention in whole days (checked
/// before connecting).
pub fn retention_days(older_than: Duration, batch_size: usize) -> Result<u32> {
    let secs = older_than.as_secs_f64();
    if secs < 86_400.0 || secs % 86_400.0 != 0.0 {
        return Err(CliError::usage(format!(
            "--older-than must be a whole number of days, at least 1d (retention is kept in days), got {secs}s; e.g. --older-than 7d"
        )));
    }
    check_backend_batch_size(batch_size)
        .map_err(|e| CliError::usage(format!("--batch-size: {e}")))?;
    u32::try_from((secs / 86_400.0) as u64).map_err(|_| CliError::usage("--older-than is too long"))
}

/// `--reason` of `force-unlock` (checked before connecting, so a bad reason never reaches the
/// database).
pub fn check_reason(reason: &str) -> Result<()> {
    txoutbox_core::event::force_unlock_text(reason)
        .map(|_| ())
        .map_err(|e| CliError::usage(format!("--reason: {e}")))
}

/// The refusal of a requeue by id that moved nothing: the row is unknown (`None`) or in
/// `status`.
pub fn not_requeued(role: TableRole, table: &str, id: Uuid, status: Option<Status>) -> CliError {
    let why = match status {
        None => format!("no {} {id} in {table}", role.row()),
        Some(st) => format!(
            "{} {id} is {}, not failed; only failed rows can be requeued",
            role.row(),
            st.as_str()
        ),
    };
    CliError::refused(format!("{why}; nothing changed"))
}

/// What `requeue-failed` prints with `--json`.
#[derive(serde::Serialize)]
pub struct RequeuedOut {
    pub table: String,
    pub requeued: Vec<Uuid>,
}

/// What `release-stale-locks` prints with `--json`.
#[derive(serde::Serialize)]
pub struct ReleasedOut {
    pub table: String,
    pub released: u64,
}

/// What `cleanup` prints with `--json`.
#[derive(serde::Serialize)]
pub struct DeletedOut {
    pub table: String,
    pub deleted: u64,
    pub older_than_days: u32,
}

/// What `force-unlock` prints with `--json`.
#[derive(serde::Serialize)]
pub struct UnlockedOut {
    pub table: String,
    pub force_unlocked: Uuid,
}

// ---- The outbox commands. ----

#[derive(serde::Serialize)]
struct StatsOut {
    table: String,
    counts: Vec<txoutbox_core::repository::StatusCount>,
    #[serde(flatten)]
    totals: Totals,
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
    let out = StatsOut {
        table: t.clone(),
        totals: Totals::sum(counts.iter().map(|c| (c.status, c.count))),
        blocked_keys: blocked.len(),
        oldest_due_age_seconds: oldest.map(|d| d.as_secs_f64()),
        counts,
    };
    report(json, &out, || {
        stats_text(
            &format!("table {}", out.table),
            "TOPIC",
            out.counts
                .iter()
                .map(|c| (c.topic.as_str(), c.status, c.count)),
            out.totals,
            out.blocked_keys,
            oldest,
        )
    });
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
    report(json, &keys, || {
        let rows = keys
            .iter()
            .map(|k| BlockedRow {
                scope: &k.topic,
                key: &k.partition_key,
                head: k.head_id,
                attempts_made: k.attempts_made,
                max_attempts: k.max_attempts,
                next_try: k.next_try,
                locked_by: k.locked_by.as_deref(),
                waiting: k.waiting,
                last_error: k.last_error.as_deref(),
                parked: k.parked,
            })
            .collect();
        blocked_text("TOPIC", rows, format!("no blocked keys in {t}"))
    });
    Ok(())
}

pub async fn requeue_failed(
    db: &DbArgs,
    id: Option<Uuid>,
    topic: Option<String>,
    key: Option<String>,
    json: bool,
) -> Result<()> {
    let s = open(db).await?;
    let t = s.table.to_string();
    let e = |e| CliError::repo(&t, e);
    if let Some(id) = id {
        if s.repo.requeue_failed(id).await.map_err(e)? {
            let out = RequeuedOut {
                table: t.clone(),
                requeued: vec![id],
            };
            report(json, &out, || format!("requeued {id}"));
            return Ok(());
        }
        let status = s.repo.get(id).await.map_err(e)?.map(|row| row.status);
        return Err(not_requeued(TableRole::Outbox, &t, id, status));
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
    let mut requeued = Vec::with_capacity(ids.len());
    for id in ids {
        if s.repo.requeue_failed(id).await.map_err(e)? {
            requeued.push(id);
        }
    }
    let out = RequeuedOut {
        table: t.clone(),
        requeued,
    };
    report(json, &out, || {
        format!("requeued {} failed rows for {what}", out.requeued.len())
    });
    Ok(())
}

/// What `redrive` prints with `--json`.
#[derive(serde::Serialize)]
pub struct RedrivenOut {
    pub table: String,
    pub redriven: Vec<Uuid>,
}

/// What `discard` prints with `--json`.
#[derive(serde::Serialize)]
pub struct DiscardedOut {
    pub table: String,
    pub discarded: Vec<Uuid>,
    pub reason: String,
}

/// The rows of `redrive` and `discard` (R192): one id, every parked row of a key (topic or
/// source, and partition key), or of a topic (source). clap makes the id exclusive and the key
/// need its topic.
pub fn parked_target(
    id: Option<Uuid>,
    topic: Option<String>,
    key: Option<String>,
) -> Result<(ParkedTarget, String)> {
    match (id, topic, key) {
        (Some(id), None, None) => Ok((ParkedTarget::Id(id), format!("row {id}"))),
        (None, Some(t), Some(k)) => Ok((
            ParkedTarget::Key {
                topic: t.clone(),
                partition_key: k.clone(),
            },
            format!("topic {t:?}, key {k:?}"),
        )),
        (None, Some(t), None) => Ok((ParkedTarget::Topic(t.clone()), format!("topic {t:?}"))),
        _ => Err(CliError::usage(
            "give a row id, or --topic (and --key for one key of it)",
        )),
    }
}

/// The refusal of a redrive or discard by key or topic that found no parked row.
pub fn nothing_parked(op: &str, what: &str, table: &str) -> CliError {
    CliError::refused(format!(
        "{op}: no parked rows for {what} in {table}; nothing changed"
    ))
}

/// Checks a discard reason before connecting (1 to 255 characters after trimming).
pub fn check_discard(reason: &str) -> Result<()> {
    txoutbox_core::repository::check_discard_reason(reason)
        .map_err(|e| CliError::usage(format!("--reason: {e}")))
}

pub async fn redrive(
    db: &DbArgs,
    id: Option<Uuid>,
    topic: Option<String>,
    key: Option<String>,
    json: bool,
) -> Result<()> {
    let (target, what) = parked_target(id, topic, key)?;
    let s = open(db).await?;
    let t = s.table.to_string();
    let ids = s
        .repo
        .redrive(&target)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    if ids.is_empty() {
        return Err(nothing_parked("redrive", &what, &t));
    }
    let out = RedrivenOut {
        table: t,
        redriven: ids,
    };
    report(json, &out, || {
        format!(
            "redrove {} parked rows of {what}; each is due now, ahead of its key's later rows",
            out.redriven.len()
        )
    });
    Ok(())
}

pub async fn discard(
    db: &DbArgs,
    id: Option<Uuid>,
    topic: Option<String>,
    key: Option<String>,
    reason: &str,
    json: bool,
) -> Result<()> {
    let (target, what) = parked_target(id, topic, key)?;
    check_discard(reason)?;
    let s = open(db).await?;
    let t = s.table.to_string();
    let ids = s
        .repo
        .discard(&target, reason)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    if ids.is_empty() {
        return Err(nothing_parked("discard", &what, &t));
    }
    let out = DiscardedOut {
        table: t,
        discarded: ids,
        reason: reason.trim().to_owned(),
    };
    report(json, &out, || {
        format!(
            "discarded {} parked rows of {what} (now failed); their keys go on without them",
            out.discarded.len()
        )
    });
    Ok(())
}

pub async fn release_stale_locks(db: &DbArgs, older_than: Duration, json: bool) -> Result<()> {
    check_stale_age(older_than)?;
    let s = open(db).await?;
    let t = s.table.to_string();
    let n = s
        .repo
        .release_stale_locks(older_than)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    let out = ReleasedOut {
        table: t,
        released: n,
    };
    report(json, &out, || format!("released {n} stale locks"));
    Ok(())
}

pub async fn cleanup(
    db: &DbArgs,
    older_than: Duration,
    batch_size: usize,
    json: bool,
) -> Result<()> {
    let days = retention_days(older_than, batch_size)?;
    let s = open(db).await?;
    let t = s.table.to_string();
    let n = s
        .repo
        .cleanup_old_events(days, batch_size, DEFAULT_CLEANUP_MAX_ITERATIONS)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    let out = DeletedOut {
        table: t,
        deleted: n,
        older_than_days: days,
    };
    report(json, &out, || {
        format!("deleted {n} completed rows older than {days} days")
    });
    Ok(())
}

pub async fn force_unlock(db: &DbArgs, id: Uuid, reason: &str, json: bool) -> Result<()> {
    check_reason(reason)?;
    let s = open(db).await?;
    let t = s.table.to_string();
    s.repo
        .force_unlock(id, reason)
        .await
        .map_err(|e| CliError::repo(&t, e))?;
    let out = UnlockedOut {
        table: t,
        force_unlocked: id,
    };
    report(json, &out, || format!("force-unlocked {id}"));
    Ok(())
}
