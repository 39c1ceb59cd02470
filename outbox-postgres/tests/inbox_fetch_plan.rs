//! The inbox fetch's plans are bounded by the batch whatever the planner's statistics say (R85,
//! R149): every statement of the processor's fetch, and the operator queries with a bound,
//! explained with `EXPLAIN (ANALYZE, FORMAT JSON)` under three states of the statistics and both
//! plan-cache modes, on the plain and the partitioned table: no sequential scan, no node that
//! reads more than [`NODE_BOUND`] rows, no scan that reads more than as many buffers (a btree
//! scan that passes over index entries outside its key shows only there), no sort on disk, and
//! each statement reads the table
//! through exactly the indexes it is written for: the window through `idx_<p>_pending_window`
//! (and `idx_<p>_locked_at` for expired leases), the earlier-row probes and the runs through
//! `idx_<p>_pending_key_order`, the oldest due age through `idx_<p>_pending_group`, the locks
//! and the lease stamp through the primary key, the key walk through `idx_<p>_pending_key_order`
//! (and the window index for the rows without partition_key). The plans are checked by
//! `txoutbox_testkit::plan`, shared with the outbox's `tests/fetch_plan.rs`.
//!
//! The statistics states (the table's autovacuum is off, so they stay as made):
//!
//! * `None`: a fresh table filled without `ANALYZE` (the state after the schema creation and a
//!   burst). Before the window index, the window read the group's whole backlog from
//!   `idx_<p>_pending_group` and sorted it, and every probe read it again: 111 to 542 ms a fetch
//!   at 20,000 rows (examples/BENCHMARKS.md, "Inbox");
//! * `Stale`: analysed when it held 1,000 completed rows (a quiet table), then filled;
//! * `Fresh`: analysed after the fill.
//!
//! The backlogs (group `g`, source `src`): a burst (20,000 pending rows over 1,000 keys, the
//! window answers) and a blocked key (a head waiting for its retry an hour later with 20,000 due
//! rows behind it, then 1,000 keys of one due row each: the window is full of rows that cannot
//! go, so the fetch finds no head in it and the overflow check sends the store to its key walk,
//! `fetch_walk`: its nodes read at most [`NODE_BOUND`] rows there too, and it finds a batch of
//! heads past the window, none of the blocked key).
//!
//! Not here: the fetch's lookups by id on the partitioned table (`try_lock`, `stamp`). Its
//! primary key is the ancestor's `(created_at, id)` and no index leads with id, so a lookup by
//! id alone reads the whole table. The row transaction's lookups (`lock_row_at`, `exists_at`,
//! `lock_row_run`, `write_at`) carry each row's created_at and are checked on both layouts by
//! `tests/inbox_row_plan.rs`.

use sqlx::{AssertSqlSafe, PgConnection, Row};
use txoutbox_conformance::inbox::InboxHarness;
use txoutbox_postgres::inbox::sql::{InboxStatements, prefix, window_index};
use txoutbox_postgres::sql::{Layout, TableName};
use txoutbox_testkit::inbox::PgInboxHarness;
use txoutbox_testkit::plan::{PlanCheck, Rules, Stats, exec, uuids};
use uuid::Uuid;

/// The backlog the statements run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Backlog {
    /// 20,000 pending rows over 1,000 keys.
    Burst,
    /// One key whose head waits for a retry an hour later, 20,000 due rows behind it, then
    /// 1,000 keys of one due row each (all newer).
    Blocked,
}

/// The batch of the fetches explained (the processor's default is 100; the finding of issue 21
/// was measured with 50).
const BATCH: i64 = 50;

/// The fetch window for [`BATCH`] (`txoutbox_postgres::sql::fetch_window`).
const WINDOW: i64 = 100;

/// The lease TTL, microseconds (300 s).
const LEASE_US: i64 = 300_000_000;

/// The key walk's bound for [`BATCH`] (`txoutbox_postgres::sql::fetch_walk_limit`): keys visited,
/// and rows without partition_key passed over.
const WALK: i64 = 200;

/// Rows per head the runs read (max_per_key 16).
const PER_KEY: i64 = 15;

/// No plan node may produce (or, for a scan, read and filter out) more rows than this, over all
/// its loops: 3 × the window, a fraction of the 20,000-row backlogs.
const NODE_BOUND: f64 = 3.0 * WINDOW as f64;

/// `n` rows of group g, source src, row g on key `'k' || (g % keys)`, created_at = now() − 1
/// hour + g × 10 µs, all due; `status` and `completed_at` as given.
fn rows(t: &TableName, first: u64, n: u64, keys: u64, status: &str) -> String {
    let completed = if status == "completed" { "ts" } else { "NULL" };
    format!(
        "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, scheduled_at, \
         completed_at, created_at, updated_at, message_id, consumer_group, source, partition_key) \
         SELECT gen_random_uuid(), 'plan.event', '{{\"n\": 1}}', '{status}', 0, 6, ts, {completed}, \
                ts, ts, 'm' || g, 'g', 'src', 'k' || (g % {keys}) \
           FROM generate_series({first}, {last}) g, \
                LATERAL (SELECT now() - interval '1 hour' + g * interval '10 microseconds' AS ts) x",
        q = t.qualified(),
        last = first + n - 1,
    )
}

/// The blocked key's head (tried once, next try an hour later), created first.
fn blocked_head(t: &TableName) -> String {
    format!(
        "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, last_error, \
         scheduled_at, created_at, updated_at, message_id, consumer_group, source, partition_key) \
         VALUES (gen_random_uuid(), 'plan.event', '{{}}', 'pending', 1, 6, 'handler said no', \
                 now() + interval '1 hour', now() - interval '2 hours', now() - interval '2 hours', \
                 'stuck-head', 'g', 'src', 'stuck')",
        q = t.qualified()
    )
}

/// A fresh table in `layout` holding `backlog` with statistics `stats`.
async fn table_in(layout: Layout, stats: Stats, backlog: Backlog) -> PgInboxHarness {
    let h = PgInboxHarness::create(layout).await;
    let t = h.backend().statements().table.clone();
    let q = t.qualified();
    // The partitioned table's rows live in its DEFAULT partition, whose autovacuum counts.
    let heap = match layout {
        Layout::Plain => q.clone(),
        Layout::Partitioned => format!("\"{}\".\"{}_part\"", h.schema(), t.table()),
    };
    let mut script = vec![format!(
        "ALTER TABLE {heap} SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)"
    )];
    if stats == Stats::Stale {
        script.push(rows(&t, 1, 1_000, 1_000, "completed"));
        script.push(format!("ANALYZE {q}"));
    }
    match backlog {
        Backlog::Burst => script.push(rows(&t, 10_000, 20_000, 1_000, "pending")),
        Backlog::Blocked => {
            script.push(blocked_head(&t));
            script
                .push(rows(&t, 10_000, 20_000, 1, "pending").replace("'k' || (g % 1)", "'stuck'"));
            script.push(rows(&t, 30_000, 1_000, 1_000, "pending"));
        }
    }
    if stats == Stats::Fresh {
        script.push(format!("ANALYZE {q}"));
    }
    for s in script {
        sqlx::raw_sql(AssertSqlSafe(s))
            .execute(h.pool())
            .await
            .expect("fill");
    }
    h
}

/// The heads' parameters as literals: group, sources, lease, key order, batch, window.
fn heads_args() -> Vec<String> {
    vec![
        "'g'".into(),
        "NULL::text[]".into(),
        LEASE_US.to_string(),
        "1".into(),
        BATCH.to_string(),
        WINDOW.to_string(),
    ]
}

/// The key walk's parameters as literals: group, sources, lease, heads wanted (a batch: the
/// blocked window gives none), walk limit, cursor (the first key), rows passed over.
fn walk_args() -> Vec<String> {
    vec![
        "'g'".into(),
        "NULL::text[]".into(),
        LEASE_US.to_string(),
        BATCH.to_string(),
        WALK.to_string(),
        "''".into(),
        "''".into(),
        WALK.to_string(),
    ]
}

/// The partition keys of the rows the key walk returns from the first key, in its order.
async fn walked_keys(conn: &mut PgConnection, s: &InboxStatements) -> Vec<Option<String>> {
    sqlx::query(AssertSqlSafe(s.fetch_walk.clone()))
        .bind("g")
        .bind(None::<Vec<String>>)
        .bind(LEASE_US)
        .bind(BATCH)
        .bind(WALK)
        .bind("")
        .bind("")
        .bind(WALK)
        .fetch_all(&mut *conn)
        .await
        .expect("walk")
        .iter()
        .map(|r| r.get("partition_key"))
        .collect()
}

/// A head as the store reads it: id, source, partition key, created_at (as text, exact).
struct Head {
    id: Uuid,
    source: String,
    key: String,
    created_at: String,
}

/// The heads the fetch would take now, as the store reads them.
async fn heads(conn: &mut PgConnection, s: &InboxStatements) -> Vec<Head> {
    let ids: Vec<Uuid> = sqlx::query(AssertSqlSafe(s.fetch_heads.clone()))
        .bind("g")
        .bind(None::<Vec<String>>)
        .bind(LEASE_US)
        .bind(1i32)
        .bind(BATCH)
        .bind(WINDOW)
        .fetch_all(&mut *conn)
        .await
        .expect("heads")
        .iter()
        .map(|r| r.get("id"))
        .collect();
    rows_by_id(conn, &s.table, &ids).await
}

/// The rows of `ids` in write order (a test read: the primary key of the plain table, the
/// partitioned one's scan is the test's own).
async fn rows_by_id(conn: &mut PgConnection, t: &TableName, ids: &[Uuid]) -> Vec<Head> {
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id, source::text, partition_key::text, created_at::text AS c FROM {} \
          WHERE id = ANY($1) ORDER BY created_at, id",
        t.qualified()
    )))
    .bind(ids)
    .fetch_all(&mut *conn)
    .await
    .expect("rows by id")
    .iter()
    .map(|r| Head {
        id: r.get(0),
        source: r.get(1),
        key: r.get(2),
        created_at: r.get(3),
    })
    .collect()
}

/// A `text[]` literal.
fn texts(v: &[&str]) -> String {
    let q: Vec<String> = v.iter().map(|s| format!("'{s}'")).collect();
    format!("ARRAY[{}]::text[]", q.join(", "))
}

/// `fetch_runs`' parameters for `heads` as literals.
fn runs_args(heads: &[Head]) -> Vec<String> {
    let stamps: Vec<String> = heads
        .iter()
        .map(|h| format!("'{}'::timestamptz", h.created_at))
        .collect();
    vec![
        "'g'".into(),
        texts(&heads.iter().map(|h| h.source.as_str()).collect::<Vec<_>>()),
        texts(&heads.iter().map(|h| h.key.as_str()).collect::<Vec<_>>()),
        format!("ARRAY[{}]::timestamptz[]", stamps.join(", ")),
        uuids(&heads.iter().map(|h| h.id).collect::<Vec<_>>()),
        PER_KEY.to_string(),
    ]
}

/// One row's key and position as literals (`earlier`'s parameters, `waiting`'s first five).
fn row_args(r: &Head) -> Vec<String> {
    vec![
        "'g'".into(),
        format!("'{}'", r.source),
        format!("'{}'", r.key),
        format!("'{}'::timestamptz", r.created_at),
        format!("'{}'::uuid", r.id),
    ]
}

/// A row behind its key's head: the latest row of the first head's key (burst), or the
/// blocked key's latest row.
async fn row_behind(conn: &mut PgConnection, t: &TableName, key: &str) -> Head {
    let id: Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT id FROM {} WHERE partition_key = $1 ORDER BY created_at DESC LIMIT 1",
        t.qualified()
    )))
    .bind(key)
    .fetch_one(&mut *conn)
    .await
    .expect("a row behind");
    rows_by_id(conn, t, &[id]).await.remove(0)
}

/// The rules of a statement that reads the table through `uses`.
fn reads<'a>(statement: &'a str, uses: &'a [&'a str]) -> Rules<'a> {
    Rules {
        statement,
        by_id: &[],
        uses,
    }
}

/// Every bounded statement of the fetch and the bounded operator queries, in every plan-cache
/// mode, on `backlog` with `stats` in `layout`.
async fn check(layout: Layout, stats: Stats, backlog: Backlog) -> Vec<String> {
    let h = table_in(layout, stats, backlog).await;
    let s = h.backend().statements().clone();
    let t = s.table.clone();
    let p = prefix(&t);
    let window = window_index(&t);
    let key_order = format!("idx_{p}_pending_key_order");
    let locked = format!("idx_{p}_locked_at");
    let group = format!("idx_{p}_pending_group");
    let pkey = format!("{}_pkey", t.table());
    let mut bad = Vec::new();
    for mode in ["force_custom_plan", "force_generic_plan"] {
        let ctx = format!("{layout:?} {stats:?} {backlog:?} {mode}");
        let mut tx = h.pool().begin().await.unwrap();
        let mut plans = PlanCheck::load(&mut tx, &t, NODE_BOUND).await;
        plans.block_bound = Some(NODE_BOUND);
        exec(&mut tx, &format!("SET LOCAL plan_cache_mode = {mode}")).await;
        exec(&mut tx, "SAVEPOINT start").await;
        bad.extend(
            plans
                .explain(
                    &mut tx,
                    reads(
                        "fetch_heads",
                        &[window.as_str(), locked.as_str(), key_order.as_str()],
                    ),
                    &s.fetch_heads,
                    &heads_args(),
                    &ctx,
                )
                .await,
        );
        exec(&mut tx, "ROLLBACK TO SAVEPOINT start").await;
        bad.extend(
            plans
                .explain(
                    &mut tx,
                    reads("window_overflow", &[window.as_str(), locked.as_str()]),
                    &s.window_overflow,
                    &[
                        "'g'".into(),
                        "NULL::text[]".into(),
                        LEASE_US.to_string(),
                        WINDOW.to_string(),
                    ],
                    &ctx,
                )
                .await,
        );
        exec(&mut tx, "SAVEPOINT walk").await;
        bad.extend(
            plans
                .explain(
                    &mut tx,
                    reads("fetch_walk", &[key_order.as_str(), window.as_str()]),
                    &s.fetch_walk,
                    &walk_args(),
                    &ctx,
                )
                .await,
        );
        exec(&mut tx, "ROLLBACK TO SAVEPOINT walk").await;
        if backlog == Backlog::Blocked {
            // The walk finds a batch of heads past the blocked window, one per key, none of the
            // blocked key's (its first in-line row waits an hour).
            let keys = walked_keys(&mut tx, &s).await;
            let mut distinct = keys.clone();
            distinct.sort();
            distinct.dedup();
            assert!(
                keys.len() == BATCH as usize
                    && distinct.len() == keys.len()
                    && keys
                        .iter()
                        .all(|k| k.as_deref().is_some_and(|k| k != "stuck")),
                "{ctx}: the walk's heads {keys:?}"
            );
        }
        let hs = heads(&mut tx, &s).await;
        let behind_key = match backlog {
            Backlog::Burst => {
                assert_eq!(hs.len(), BATCH as usize, "{ctx}: heads");
                hs[0].key.clone()
            }
            Backlog::Blocked => {
                assert!(hs.is_empty(), "{ctx}: a head in a blocked window");
                "stuck".to_owned()
            }
        };
        if !hs.is_empty() {
            bad.extend(
                plans
                    .explain(
                        &mut tx,
                        reads("fetch_runs", &[key_order.as_str()]),
                        &s.fetch_runs,
                        &runs_args(&hs[..10]),
                        &ctx,
                    )
                    .await,
            );
        }
        let behind = row_behind(&mut tx, &t, &behind_key).await;
        bad.extend(
            plans
                .explain(
                    &mut tx,
                    reads("earlier", &[key_order.as_str()]),
                    &s.earlier,
                    &row_args(&behind),
                    &ctx,
                )
                .await,
        );
        // `waiting` counts the rows behind a head: the first head, or the blocked key's head
        // (its line is the 20,000 rows behind it).
        let head = match hs.first() {
            Some(h0) => rows_by_id(&mut tx, &t, &[h0.id]).await,
            None => {
                let id: Uuid = sqlx::query_scalar(AssertSqlSafe(format!(
                    "SELECT id FROM {} WHERE message_id = 'stuck-head'",
                    t.qualified()
                )))
                .fetch_one(&mut *tx)
                .await
                .expect("the blocked head");
                rows_by_id(&mut tx, &t, &[id]).await
            }
        };
        let mut first = row_args(&head[0]);
        // The cap: the store passes BLOCKED_WAITING_CAP (10,000); the read stops at the cap.
        first.push(WINDOW.to_string());
        bad.extend(
            plans
                .explain(
                    &mut tx,
                    reads("waiting", &[key_order.as_str()]),
                    &s.waiting,
                    &first,
                    &ctx,
                )
                .await,
        );
        bad.extend(
            plans
                .explain(
                    &mut tx,
                    reads("oldest_due_age", &[group.as_str()]),
                    &s.oldest_due_age,
                    &["'g'".into()],
                    &ctx,
                )
                .await,
        );
        if layout == Layout::Plain && !hs.is_empty() {
            let ids: Vec<Uuid> = hs.iter().map(|h| h.id).collect();
            for (name, text, args) in [
                ("try_lock", &s.try_lock, vec![uuids(&ids)]),
                ("stamp", &s.stamp, vec![uuids(&ids), "'p1'".into()]),
            ] {
                exec(&mut tx, "SAVEPOINT lock").await;
                bad.extend(
                    plans
                        .explain(
                            &mut tx,
                            Rules {
                                statement: name,
                                by_id: &[t.table(), "t"],
                                uses: &[pkey.as_str()],
                            },
                            text,
                            &args,
                            &ctx,
                        )
                        .await,
                );
                exec(&mut tx, "ROLLBACK TO SAVEPOINT lock").await;
            }
        }
        tx.rollback().await.unwrap();
    }
    bad
}

async fn check_all(stats: Stats) {
    let mut bad = Vec::new();
    for layout in [Layout::Plain, Layout::Partitioned] {
        for backlog in [Backlog::Burst, Backlog::Blocked] {
            bad.extend(check(layout, stats, backlog).await);
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_are_bounded_without_statistics() {
    check_all(Stats::None).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_are_bounded_with_stale_statistics() {
    check_all(Stats::Stale).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_are_bounded_with_fresh_statistics() {
    check_all(Stats::Fresh).await;
}
