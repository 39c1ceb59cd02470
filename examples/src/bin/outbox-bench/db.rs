//! Fresh schema per run, bulk preload, store construction, and the plain-SQL reference drain.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Connection, Row};
use txoutbox_core::OutboxRepository;
use txoutbox_postgres::sql::{self, FetchParams, Statements, TableName};
use txoutbox_postgres::{PgConfig, PgOutboxRepository};

use crate::{BenchError, Shape, StoreKind};

/// A fresh schema `bench_<pid>_<n>` holding the outbox table, dropped by [`Fresh::drop`].
pub struct Fresh {
    pub pool: PgPool,
    pub table: TableName,
}

pub async fn pool(url: &str, max: u32) -> Result<PgPool, BenchError> {
    pool_with(url, max, true).await
}

/// [`pool`], pinging each connection on acquire (`test_before_acquire`, sqlx's default) only
/// when `ping`.
pub async fn pool_with(url: &str, max: u32, ping: bool) -> Result<PgPool, BenchError> {
    PgPoolOptions::new()
        .max_connections(max)
        .test_before_acquire(ping)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .map_err(|e| BenchError(format!("could not connect to PostgreSQL at {url}: {e}")))
}

fn db(during: &'static str) -> impl Fn(sqlx::Error) -> BenchError {
    move |e| BenchError(format!("PostgreSQL error during {during}: {e}"))
}

/// How the table is prepared, and so what the planner's statistics say when the drain starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Stats {
    /// The rows bulk-loaded into the bare table, then the store's schema creation (indexes
    /// built over the rows) and `VACUUM ANALYZE`: the drain benchmark's table.
    Vacuum,
    /// The schema first (as `outbox-relay migrate`), then the rows, then `ANALYZE`.
    Analyzed,
    /// The schema first, then the rows, never analysed: a fresh table after a burst.
    None,
    /// The schema first, 1,000 completed rows, `ANALYZE` (a quiet table), then the rows: the
    /// statistics of a table before a broker outage or a traffic burst.
    Stale,
}

/// Creates the table and preloads the shape in bulk, its statistics as `stats` says. With
/// [`Stats::Vacuum`] the rows go into the bare table and the store's own schema creation (which
/// adds Appendix A's indexes and the additions, R79) and `VACUUM ANALYZE` follow; otherwise the
/// schema comes first and the table's autovacuum is turned off, so the statistics stay as made
/// for the whole drain.
///
/// Every row is pending and due; created_at grows with the generator index, so each key's write
/// order is defined. The payload carries `seq` (the generator index) for the order check.
pub async fn prepare(
    url: &str,
    run_tag: &str,
    shape: &Shape,
    store: StoreKind,
    max_conns: u32,
    stats: Stats,
) -> Result<Fresh, BenchError> {
    let pool = pool(url, max_conns).await?;
    let table = TableName::new(&format!("{run_tag}.outbox_events"))
        .map_err(|e| BenchError(format!("table name: {e}")))?;
    let q = table.qualified();
    sqlx::query(AssertSqlSafe(format!(
        "DROP SCHEMA IF EXISTS \"{run_tag}\" CASCADE"
    )))
    .execute(&pool)
    .await
    .map_err(db("schema drop"))?;
    let exec = |s: String, during: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query(AssertSqlSafe(s))
                .execute(&pool)
                .await
                .map_err(db(during))
        }
    };
    if stats == Stats::Vacuum {
        // The DDL of the library, indexes held back until the rows are in (bulk-load practice).
        for s in sql::ddl(&table)
            .into_iter()
            .filter(|s| !s.contains(" INDEX "))
        {
            exec(s, "table creation").await?;
        }
    } else {
        create_schema(store, url, &pool, &table).await?;
        exec(
            format!("ALTER TABLE {q} SET (autovacuum_enabled = false)"),
            "table settings",
        )
        .await?;
    }
    if stats == Stats::Stale {
        exec(
            format!(
                "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts,
                        scheduled_at, completed_at, created_at, updated_at, aggregate_type,
                        aggregate_id, topic, partition_key)
                 SELECT gen_random_uuid(), 'bench.quiet', '{{}}', 'completed', 0, 3, x.ts, x.ts,
                        x.ts, x.ts, 'bench', gen_random_uuid(), 'bench', 'quiet' || (g % 100)
                   FROM generate_series(1, 1000) g,
                        LATERAL (SELECT now() - INTERVAL '2 days' + g * INTERVAL '1 second' AS ts) x"
            ),
            "quiet rows",
        )
        .await?;
        exec(format!("ANALYZE {q}"), "analyze").await?;
    }
    // Normal rows at base + 2g µs, hot rows at base + 2j + 1 µs: disjoint, ordered per key.
    let insert = |from: &str, key: &str| {
        format!(
            "INSERT INTO {q} (id, event_type, payload, headers, status, attempts_made, max_attempts,
                    scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic,
                    partition_key)
             SELECT gen_random_uuid(), 'bench.created',
                    jsonb_build_object('seq', g, 'amount', g % 1000, 'note', 'outbox benchmark event'),
                    NULL, 'pending', 0, 3, x.ts, x.ts, x.ts, 'bench', md5({key})::uuid, 'bench', {key}
               FROM {from},
                    LATERAL (SELECT (now() - INTERVAL '1 day') + ({ts}) * INTERVAL '1 microsecond' AS ts) x",
            ts = if key.contains("hot") { "2 * g + 1" } else { "2 * g" },
        )
    };
    if shape.events > 0 {
        sqlx::query(AssertSqlSafe(insert(
            "generate_series(0, $1::int8 - 1) g",
            "'k' || (g % $2::int8)",
        )))
        .bind(shape.events as i64)
        .bind(shape.keys.max(1) as i64)
        .execute(&pool)
        .await
        .map_err(db("preload"))?;
    }
    if shape.hot_events > 0 {
        sqlx::query(AssertSqlSafe(insert(
            "generate_series(0, $1::int8 - 1) g",
            "'hot'::text",
        )))
        .bind(shape.hot_events as i64)
        .execute(&pool)
        .await
        .map_err(db("preload"))?;
    }
    match stats {
        Stats::Vacuum => {
            create_schema(store, url, &pool, &table).await?;
            exec(format!("VACUUM ANALYZE {q}"), "vacuum").await?;
        }
        Stats::Analyzed => {
            exec(format!("ANALYZE {q}"), "analyze").await?;
        }
        Stats::None | Stats::Stale => {}
    }
    Ok(Fresh { pool, table })
}

/// The store's own schema creation for `table`.
async fn create_schema(
    store: StoreKind,
    url: &str,
    pool: &PgPool,
    table: &TableName,
) -> Result<(), BenchError> {
    match store {
        StoreKind::Sqlx => txoutbox_postgres::create_schema(pool, table)
            .await
            .map_err(|e| BenchError(format!("create_schema: {e}"))),
        StoreKind::Diesel => diesel_schema(url, table).await,
    }
}

#[cfg(feature = "diesel")]
async fn diesel_schema(url: &str, table: &TableName) -> Result<(), BenchError> {
    use diesel_async::AsyncConnection;
    let mut conn = diesel_async::AsyncPgConnection::establish(url)
        .await
        .map_err(|e| BenchError(format!("diesel connect: {e}")))?;
    txoutbox_diesel::create_schema(&mut conn, table)
        .await
        .map_err(|e| BenchError(format!("diesel create_schema: {e}")))
}

#[cfg(not(feature = "diesel"))]
async fn diesel_schema(_url: &str, _table: &TableName) -> Result<(), BenchError> {
    Err(BenchError(
        "--store diesel needs the diesel feature: cargo build --release -p txoutbox-examples --features diesel".into(),
    ))
}

impl Fresh {
    /// Rows not completed (0 after a full drain).
    pub async fn not_completed(&self) -> Result<i64, BenchError> {
        sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE status <> 'completed'",
            self.table.qualified()
        )))
        .fetch_one(&self.pool)
        .await
        .map_err(db("final count"))
    }

    pub async fn drop(self) {
        if let Some(s) = self.table.schema() {
            let _ = sqlx::query(AssertSqlSafe(format!(
                "DROP SCHEMA IF EXISTS \"{s}\" CASCADE"
            )))
            .execute(&self.pool)
            .await;
        }
        self.pool.close().await;
    }
}

/// One repository per relay on a shared pool (a relay holds one connection at a time).
pub async fn repository(
    store: StoreKind,
    url: &str,
    fresh: &Fresh,
    pool_size: u32,
) -> Result<Arc<dyn OutboxRepository>, BenchError> {
    Ok(match store {
        StoreKind::Sqlx => Arc::new(PgOutboxRepository::new(
            pool(url, pool_size).await?,
            PgConfig::default().table(fresh.table.clone()),
        )),
        StoreKind::Diesel => diesel_repo(url, &fresh.table, pool_size)?,
    })
}

#[cfg(feature = "diesel")]
fn diesel_repo(
    url: &str,
    table: &TableName,
    pool_size: u32,
) -> Result<Arc<dyn OutboxRepository>, BenchError> {
    let settings = txoutbox_diesel::PoolSettings::default()
        .max_size(pool_size as usize)
        .map_err(|e| BenchError(e.to_string()))?;
    let pool = txoutbox_diesel::build_pool(url, &settings)
        .map_err(|e| BenchError(format!("diesel pool: {e}")))?;
    Ok(Arc::new(txoutbox_diesel::DieselOutboxRepository::new(
        pool,
        txoutbox_diesel::DieselConfig::default().table(table.clone()),
    )))
}

#[cfg(not(feature = "diesel"))]
fn diesel_repo(
    _url: &str,
    _table: &TableName,
    _pool_size: u32,
) -> Result<Arc<dyn OutboxRepository>, BenchError> {
    Err(BenchError("--store diesel needs the diesel feature".into()))
}

/// What a plain-SQL drain measured.
#[derive(Debug, Default, Clone)]
pub struct SqlDrain {
    pub events: usize,
    pub cycles: usize,
    pub seconds: f64,
    /// Per-statement wall time sums in seconds (begin, fetch, write, commit), when profiled.
    pub phases: [f64; 4],
}

/// The ceiling: an unordered queue drained with plain SQL by `conns` connections, each cycle
/// `BEGIN; SELECT … LIMIT batch FOR UPDATE SKIP LOCKED; UPDATE … completed; COMMIT`. The fetch
/// reads the library's columns through its own partial index on status/scheduled_at
/// (`idx_<t>_pending_fetch`); the table and its indexes are the library's.
pub async fn reference_drain(
    fresh: &Fresh,
    url: &str,
    conns: usize,
    batch: usize,
) -> Result<SqlDrain, BenchError> {
    let t = fresh.table.qualified();
    let fetch = format!(
        "SELECT {} FROM {t}
          WHERE status = 'pending' AND locked_at IS NULL AND attempts_made < max_attempts
            AND scheduled_at <= now()
          ORDER BY scheduled_at
          LIMIT $1
          FOR UPDATE SKIP LOCKED",
        sql::column_list("")
    );
    let mark = format!(
        "UPDATE {t} SET status = 'completed', completed_at = now(), updated_at = now()
          WHERE id = ANY($1::uuid[])"
    );
    sql_drain(url, conns, batch, fetch, mark, false).await
}

/// The ceiling of any relay that stamps a lease (R19) and publishes with no transaction open
/// (R76), without ordering: per cycle `BEGIN; UPDATE … SET locked_at, locked_by, updated_at
/// WHERE id IN (SELECT … LIMIT batch FOR UPDATE SKIP LOCKED) RETURNING …; COMMIT`, then
/// `BEGIN; UPDATE … completed WHERE locked_by = worker; COMMIT`: the reference plus the second
/// row write and the second commit the lease costs.
pub async fn lease_reference_drain(
    fresh: &Fresh,
    url: &str,
    conns: usize,
    batch: usize,
) -> Result<SqlDrain, BenchError> {
    let t = fresh.table.qualified();
    let fetch = format!(
        "UPDATE {t} t SET locked_at = now(), locked_by = 'bench-lease', updated_at = now()
          WHERE t.id IN (
            SELECT id FROM {t}
             WHERE status = 'pending' AND locked_at IS NULL AND attempts_made < max_attempts
               AND scheduled_at <= now()
             ORDER BY scheduled_at
             LIMIT $1
             FOR UPDATE SKIP LOCKED)
          RETURNING {}",
        sql::column_list("t")
    );
    let mark = format!(
        "UPDATE {t} SET status = 'completed', completed_at = now(), locked_at = NULL,
                locked_by = NULL, updated_at = now()
          WHERE id = ANY($1::uuid[]) AND status = 'pending' AND locked_by = 'bench-lease'"
    );
    sql_drain(url, conns, batch, fetch, mark, true).await
}

/// The library's own fetch and completion statements ([`Statements::fetch_heads`] and
/// [`Statements::fetch_take`],
/// [`Statements::complete`]) run by hand as the lease relay runs them (the fetch in a
/// transaction, the completion in autocommit) with a timer around every round trip: where the
/// relay's database time goes, statement by statement.
pub async fn statement_profile(
    fresh: &Fresh,
    url: &str,
    batch: usize,
    max_per_key: usize,
) -> Result<SqlDrain, BenchError> {
    let stmts = Statements::new(&fresh.table);
    let pool = pool(url, 1).await?;
    let mut conn = pool.acquire().await.map_err(db("acquire"))?;
    let req = txoutbox_core::FetchRequest::new(
        txoutbox_core::WorkerId::new("bench-profile").expect("valid worker id"),
        batch,
    )
    .max_per_key(max_per_key);
    let p = FetchParams::new(&req);
    let cursor = sql::WalkCursor::default();
    let mut out = SqlDrain::default();
    let started = Instant::now();
    loop {
        let t0 = Instant::now();
        let mut tx = conn.begin().await.map_err(db("begin"))?;
        let t1 = Instant::now();
        let rows = txoutbox_postgres::driver::sqlx::fetch_rows(
            &mut tx,
            &stmts,
            "bench-profile",
            &p,
            &cursor,
        )
        .await
        .map_err(db("fetch"))?;
        let t2 = Instant::now();
        tx.commit().await.map_err(db("commit"))?;
        let t3 = Instant::now();
        if rows.is_empty() {
            break;
        }
        let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.id()).collect();
        // As the relay writes a cycle of completions: one statement in autocommit (its commit
        // inside the statement's time).
        let t4 = Instant::now();
        sqlx::query(AssertSqlSafe(stmts.complete.as_str()))
            .bind(&ids)
            .bind("bench-profile")
            .fetch_all(&mut *conn)
            .await
            .map_err(db("complete"))?;
        let t5 = Instant::now();
        let t6 = t5;
        out.phases[0] += (t1 - t0 + (t4 - t3)).as_secs_f64();
        out.phases[1] += (t2 - t1).as_secs_f64();
        out.phases[2] += (t5 - t4).as_secs_f64();
        out.phases[3] += (t3 - t2 + (t6 - t5)).as_secs_f64();
        out.events += ids.len();
        out.cycles += 1;
    }
    out.seconds = started.elapsed().as_secs_f64();
    drop(conn);
    pool.close().await;
    Ok(out)
}

/// Drains the table with plain SQL on `conns` connections: `fetch` (`$1` batch) then `mark`
/// (`$1` ids) in one transaction per cycle, or, with `two_transactions`, each in its own (the
/// lease-reference mode).
async fn sql_drain(
    url: &str,
    conns: usize,
    batch: usize,
    fetch: String,
    mark: String,
    two_transactions: bool,
) -> Result<SqlDrain, BenchError> {
    let what = if two_transactions {
        "lease reference"
    } else {
        "reference"
    };
    let pool = pool(url, conns as u32).await?;
    // Open every connection before the clock starts.
    let mut held = Vec::new();
    for _ in 0..conns {
        held.push(pool.acquire().await.map_err(db("acquire"))?);
    }
    let events = Arc::new(AtomicUsize::new(0));
    let cycles = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for mut conn in held {
        let (fetch, mark) = (fetch.clone(), mark.clone());
        let (events, cycles) = (events.clone(), cycles.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let mut tx = conn.begin().await.map_err(db("begin"))?;
                let rows = sqlx::query(AssertSqlSafe(fetch.as_str()))
                    .bind(batch as i64)
                    .fetch_all(&mut *tx)
                    .await
                    .map_err(db(if two_transactions {
                        "lease fetch"
                    } else {
                        "reference fetch"
                    }))?;
                if rows.is_empty() {
                    tx.commit().await.map_err(db("commit"))?;
                    return Ok::<(), BenchError>(());
                }
                if two_transactions {
                    // The lease commits on its own (R76); the mark is a second transaction.
                    tx.commit().await.map_err(db("commit"))?;
                    tx = conn.begin().await.map_err(db("begin"))?;
                }
                let ids: Vec<uuid::Uuid> = rows.iter().map(|r| r.get(0)).collect();
                sqlx::query(AssertSqlSafe(mark.as_str()))
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await
                    .map_err(db(if two_transactions {
                        "lease mark"
                    } else {
                        "reference mark"
                    }))?;
                tx.commit().await.map_err(db("commit"))?;
                events.fetch_add(ids.len(), Ordering::Relaxed);
                cycles.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    for t in tasks {
        t.await
            .map_err(|e| BenchError(format!("{what} task: {e}")))??;
    }
    let seconds = started.elapsed().as_secs_f64();
    pool.close().await;
    Ok(SqlDrain {
        events: events.load(Ordering::Relaxed),
        cycles: cycles.load(Ordering::Relaxed),
        seconds,
        phases: [0.0; 4],
    })
}
