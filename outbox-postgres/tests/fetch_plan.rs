//! The fetch's plans read the outbox table through indexes only: no sequential scan of the
//! table in backlog shapes (a), (d) and (f) (R33, R85); every statement on the relay's path has
//! a plan bounded by the batch whatever the planner's statistics say (none, stale, fresh; custom
//! and generic plans), its lookups by id through the primary key; and the rows it returns are
//! heads of the plain head rule on random tables, in head order, through both paths (the
//! oldest heads exactly when path A answers alone; R20 lets the key walk take others).

use sqlx::{AssertSqlSafe, Row};
use txoutbox_core::event::WorkerId;
use txoutbox_core::repository::FetchRequest;
use txoutbox_postgres::driver::sqlx::{bind_fetch_heads, bind_fetch_take, fetch_rows};
use txoutbox_postgres::sql::{FetchParams, HeadRows, TableName, WalkCursor};
use txoutbox_testkit::PgHarness;
use txoutbox_testkit::shapes::{self, Shape};

fn seq_scans(plan: &serde_json::Value, table: &str, out: &mut Vec<String>) {
    match plan {
        serde_json::Value::Object(m) => {
            if m.get("Node Type").and_then(|v| v.as_str()) == Some("Seq Scan")
                && m.get("Relation Name").and_then(|v| v.as_str()) == Some(table)
            {
                out.push(format!("Seq Scan on {table} (alias {:?})", m.get("Alias")));
            }
            for v in m.values() {
                seq_scans(v, table, out);
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| seq_scans(v, table, out)),
        _ => {}
    }
}

async fn check(shape: Shape) {
    let h = PgHarness::create(&txoutbox_testkit::database_url(), "outbox_events").await;
    shapes::build(h.pool(), h.table(), shape)
        .await
        .expect("build shape");
    let stmts = h.sqlx_repository().statements().clone();
    for per_key in [1usize, 16] {
        let req = FetchRequest::new(WorkerId::new("w1").unwrap(), 100).max_per_key(per_key);
        let p = FetchParams::new(&req);
        for analyze in [false, true] {
            let opts = if analyze {
                "ANALYZE, FORMAT JSON"
            } else {
                "FORMAT JSON"
            };
            let mut tx = h.pool().begin().await.unwrap();
            let explain = |text: &str| AssertSqlSafe(format!("EXPLAIN ({opts}) {text}"));
            let heads_plan: serde_json::Value = bind_fetch_heads(
                sqlx::query(explain(&stmts.fetch_heads)),
                &p,
                (String::new(), String::new()),
            )
            .fetch_one(&mut *tx)
            .await
            .expect("explain heads")
            .try_get(0)
            .unwrap();
            let heads = HeadRows::new(
                bind_fetch_heads(
                    sqlx::query(AssertSqlSafe(stmts.fetch_heads.clone())),
                    &p,
                    (String::new(), String::new()),
                )
                .fetch_all(&mut *tx)
                .await
                .expect("heads")
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2))),
            );
            assert!(!heads.ids.is_empty(), "{shape:?}: no heads");
            let take_plan: serde_json::Value = bind_fetch_take(
                sqlx::query(explain(&stmts.fetch_take)),
                "w1",
                &p,
                heads.ids.clone(),
            )
            .fetch_one(&mut *tx)
            .await
            .expect("explain take")
            .try_get(0)
            .unwrap();
            tx.rollback().await.unwrap();
            for plan in [heads_plan, take_plan] {
                let mut found = Vec::new();
                seq_scans(&plan, "outbox_events", &mut found);
                assert!(
                    found.is_empty(),
                    "{shape:?}, max_per_key {per_key}, {opts}: {found:?}\n{plan:#}"
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_seq_scan_in_shape_a() {
    check(Shape::A).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_seq_scan_in_shape_d() {
    check(Shape::D).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_seq_scan_in_shape_f() {
    check(Shape::F).await;
}

/// Random rows over few keys and few distinct created_at values (so keys have ties), in every
/// state that matters to the head rule: completed, failed, retry pending (last_error set) due
/// or not, never-tried future, held with a live lease, held with an expired lease, exhausted.
fn random_rows(t: &TableName, seed: u32) -> String {
    format!(
        "SELECT setseed({s});
TRUNCATE {q};
INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, last_error,
                 scheduled_at, completed_at, locked_at, locked_by, created_at, updated_at,
                 aggregate_type, aggregate_id, topic, partition_key)
SELECT gen_random_uuid(), 'e', '{{}}', x.st, y.att, 3, x.le, x.sch,
       CASE WHEN x.st = 'completed' THEN now() END, x.lk,
       CASE WHEN x.lk IS NOT NULL THEN 'w' END, x.cr, x.cr, 'agg', gen_random_uuid(),
       't' || (random() * 2)::int, 'k' || (random() * 8)::int
  FROM (SELECT g,
               now() - interval '1 hour' + ((random() * 6)::int) * interval '1 second' AS cr,
               CASE WHEN random() < 0.1 THEN 'completed'
                    WHEN random() < 0.05 THEN 'failed' ELSE 'pending' END AS st,
               CASE WHEN random() < 0.1 THEN 3 ELSE (random() * 2)::int END AS att0,
               CASE WHEN random() < 0.2 THEN 'err' END AS le,
               CASE WHEN random() < 0.2 THEN now() + interval '1 hour'
                    ELSE now() - interval '2 hours' + random() * interval '2 hours' END AS sch,
               CASE WHEN random() < 0.1 THEN now() - interval '10 minutes'
                    WHEN random() < 0.1 THEN now() - interval '1 minute' END AS lk
          FROM generate_series(1, 60) g) x,
       LATERAL (SELECT CASE WHEN x.st = 'failed' THEN 3 WHEN x.att0 >= 3 THEN 2
                            ELSE x.att0 END AS att) y",
        s = f64::from(seed % 1000) / 1000.0,
        q = t.qualified()
    )
}

/// The head rule written as plainly as possible (contract R27–R29, lease 300 s): the
/// fetchable rows with no earlier in-line row of their key, in head order.
fn naive_heads(t: &TableName) -> String {
    format!(
        "SELECT h.id FROM {q} h
          WHERE h.status = 'pending' AND h.scheduled_at <= now()
            AND h.attempts_made < h.max_attempts
            AND (h.locked_at IS NULL OR h.locked_at < now() - interval '300 seconds')
            AND NOT EXISTS (
                SELECT 1 FROM {q} e
                 WHERE e.status = 'pending' AND e.topic = h.topic
                   AND e.partition_key = h.partition_key
                   AND (e.created_at, e.id) < (h.created_at, h.id)
                   AND (e.scheduled_at <= now() OR e.last_error IS NOT NULL
                        OR e.locked_at IS NOT NULL))
          ORDER BY h.scheduled_at, h.created_at, h.id",
        q = t.qualified()
    )
}

/// With max_per_key 1 every row the fetch returns is a head of the plain definition, in head
/// order, and it returns min(batch, heads) of them, on random tables with ties in created_at;
/// when path A (the window) answers alone, exactly the oldest heads. Both paths are exercised
/// (`walked` counts the fetches where the key walk ran).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fetched_heads_follow_the_head_rule_on_random_tables() {
    let h = PgHarness::create(&txoutbox_testkit::database_url(), "outbox_events").await;
    let stmts = h.sqlx_repository().statements().clone();
    let t = h.table().clone();
    let (mut compared, mut walked) = (0, 0);
    for seed in 1..=60u32 {
        for batch in [1usize, 3, 6] {
            sqlx::raw_sql(AssertSqlSafe(random_rows(&t, seed * 7 + batch as u32)))
                .execute(h.pool())
                .await
                .expect("random rows");
            let all: Vec<uuid::Uuid> = sqlx::query_scalar(AssertSqlSafe(naive_heads(&t)))
                .fetch_all(h.pool())
                .await
                .expect("naive heads");
            let req = FetchRequest::new(WorkerId::new("w1").unwrap(), batch).max_per_key(1);
            let mut p = FetchParams::new(&req);
            p.window = 2 * batch as i64;
            let cursor = WalkCursor::default();
            let mut tx = h.pool().begin().await.unwrap();
            let got: Vec<uuid::Uuid> = fetch_rows(&mut tx, &stmts, "w1", &p, &cursor)
                .await
                .expect("fetch")
                .iter()
                .map(|r| r.id())
                .collect();
            tx.rollback().await.unwrap();
            assert_eq!(
                got.len(),
                batch.min(all.len()),
                "seed {seed}, batch {batch}"
            );
            let positions: Vec<usize> = got
                .iter()
                .map(|id| {
                    all.iter()
                        .position(|a| a == id)
                        .unwrap_or_else(|| panic!("seed {seed}, batch {batch}: {id} is not a head"))
                })
                .collect();
            assert!(
                positions.windows(2).all(|w| w[0] < w[1]),
                "seed {seed}, batch {batch}: not in head order: {positions:?}"
            );
            if cursor.get() == (String::new(), String::new()) {
                assert_eq!(got, all[..got.len()], "seed {seed}, batch {batch}: path A");
            } else {
                walked += 1;
            }
            compared += 1;
        }
    }
    assert_eq!(compared, 180);
    assert!(
        walked > 0 && walked < 180,
        "both paths ran: walked {walked} of 180"
    );
}

mod plan_stability {
    //! Every statement on the relay's path, explained with `EXPLAIN (ANALYZE, FORMAT JSON)` under
    //! three states of the planner's statistics and both plan-cache modes, has a plan bounded by
    //! the batch: no sequential scan of the table, no node that reads or sorts the backlog, no sort
    //! spilled to disk, and every lookup by id through the primary key.
    //!
    //! The statistics states (the table's autovacuum is off, so they stay as made):
    //!
    //! * `None`: a fresh table filled without `ANALYZE` (the state after `migrate` and a burst);
    //! * `Stale`: analysed when it held 1,000 completed rows (a quiet table), then grown to
    //!   200,000 rows, 199,000 of them pending (the state after a broker outage or a traffic burst);
    //! * `Fresh`: analysed after the fill.
    //!
    //! The backlogs: a burst (10 pending rows per key over 11,000 keys, path A answers) and a
    //! blocked key (a head waiting for its retry with 20,000 due rows behind it, then one-row keys:
    //! the window is full of rows that cannot go, so the key walk, path B, answers).
    //!
    //! The plans are checked by `txoutbox_testkit::plan` (shared with the inbox's
    //! `tests/inbox_fetch_plan.rs`).
    //!
    //! The statements run as the relay runs them, in one transaction per state: the heads, the
    //! take of each delivery mode, the outcome writes of each delivery mode, the release, the
    //! oldest due age, the stale-lock release and the cleanup; each `EXPLAIN ANALYZE` of a write is rolled back
    //! to a savepoint, so the next statement sees the rows the relay would see.

    use sqlx::{AssertSqlSafe, PgConnection, Row};
    use txoutbox_core::event::WorkerId;
    use txoutbox_core::repository::FetchRequest;
    use txoutbox_postgres::driver::sqlx::{bind_fetch_heads, bind_fetch_take};
    use txoutbox_postgres::sql::{FetchParams, HeadRows, Statements, TableName};
    use txoutbox_testkit::PgHarness;
    use txoutbox_testkit::plan::{PlanCheck, Rules, Stats, exec, uuids};
    use uuid::Uuid;

    /// The backlog the statements run on.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Backlog {
        /// 10 pending rows per key over 11,000 keys (110,000; 199,000 in the stale state).
        Burst,
        /// One key whose head waits for a retry an hour later, 20,000 due rows behind it, then
        /// 20,000 keys of one due row each (all newer).
        Blocked,
    }

    /// The batch of the fetches explained.
    const BATCH: usize = 100;

    /// No plan node may produce (or, for a scan, read and filter out) more rows than this, over all
    /// its loops: 10 × the batch, a fraction of every backlog here (≥ 40,000 rows).
    const NODE_BOUND: f64 = 10.0 * BATCH as f64;

    /// `n` pending rows, row g on key `'k' || (g % keys)`, created_at = now() − 1 hour + g × 10 µs,
    /// all due; `status` and `completed_at` as given.
    fn rows(t: &TableName, first: u64, n: u64, keys: u64, status: &str) -> String {
        let completed = if status == "completed" { "ts" } else { "NULL" };
        format!(
            "INSERT INTO {q} (id, event_type, payload, status, attempts_made, max_attempts, scheduled_at, \
             completed_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
             SELECT gen_random_uuid(), 'plan.event', '{{\"n\": 1}}', '{status}', 0, 6, ts, {completed}, ts, ts, \
                    'agg', gen_random_uuid(), 'plan', 'k' || (g % {keys}) \
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
             scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
             VALUES (gen_random_uuid(), 'plan.event', '{{}}', 'pending', 1, 6, 'broker said no', \
                     now() + interval '1 hour', now() - interval '2 hours', now() - interval '2 hours', \
                     'agg', gen_random_uuid(), 'plan', 'stuck')",
            q = t.qualified()
        )
    }

    /// A fresh table holding `backlog` with statistics `stats`.
    async fn table_in(stats: Stats, backlog: Backlog) -> PgHarness {
        let h = PgHarness::create(&txoutbox_testkit::database_url(), "outbox_events").await;
        let t = h.table().clone();
        let q = t.qualified();
        let mut script = vec![format!(
            "ALTER TABLE {q} SET (autovacuum_enabled = false, toast.autovacuum_enabled = false)"
        )];
        if stats == Stats::Stale {
            script.push(rows(&t, 1, 1_000, 1_000, "completed"));
            script.push(format!("ANALYZE {q}"));
        }
        match backlog {
            Backlog::Burst => {
                let n = if stats == Stats::Stale {
                    199_000
                } else {
                    110_000
                };
                script.push(rows(&t, 10_000, n, 11_000, "pending"));
            }
            Backlog::Blocked => {
                script.push(blocked_head(&t));
                script.push(
                    rows(&t, 10_000, 20_000, 1, "pending").replace("'k' || (g % 1)", "'stuck'"),
                );
                script.push(rows(&t, 30_000, 20_000, 1_000_000, "pending"));
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

    /// The parameters of the heads statement as literals (`bind_fetch_heads`' order).
    fn heads_args(p: &FetchParams) -> Vec<String> {
        let mut v = vec![p.limit.to_string(), p.lease_us.to_string()];
        v.extend(["NULL::text[]", "NULL::text[]", "NULL::uuid[]"].map(String::from));
        v.extend([p.window.to_string(), p.walk_limit.to_string()]);
        v.extend(["''".into(), "''".into()]);
        v
    }

    /// The parameters of a take statement as literals (`bind_fetch_take`' order).
    /// The take's arguments; the transaction take's `$9` (its idle bound) when `text` is it.
    fn take_args(text: &str, p: &FetchParams, ids: &[Uuid]) -> Vec<String> {
        let mut v = vec!["'w1'".into(), p.limit.to_string(), p.lease_us.to_string()];
        v.push(p.max_per_key.to_string());
        v.extend(["NULL::text[]", "NULL::text[]", "NULL::uuid[]"].map(String::from));
        v.push(uuids(ids));
        if is_transaction_take(text) {
            v.push(format!("'{IDLE_BOUND_MS}'"));
        }
        v
    }

    /// The transaction take's idle bound in the checks, in milliseconds.
    const IDLE_BOUND_MS: &str = "30000";

    /// Whether `text` is the transaction delivery's take, which has a `$9`.
    fn is_transaction_take(text: &str) -> bool {
        text.contains("idle_in_transaction_session_timeout")
    }

    /// The heads the fetch would take now, as the relay reads them.
    async fn heads(conn: &mut PgConnection, s: &Statements, p: &FetchParams) -> Vec<Uuid> {
        let rows = bind_fetch_heads(
            sqlx::query(AssertSqlSafe(s.fetch_heads.clone())),
            p,
            (String::new(), String::new()),
        )
        .fetch_all(&mut *conn)
        .await
        .expect("heads");
        HeadRows::new(rows.iter().map(|r| (r.get(0), r.get(1), r.get(2)))).ids
    }

    /// The ids a take returns, run for real.
    async fn take(
        conn: &mut PgConnection,
        text: &str,
        p: &FetchParams,
        ids: Vec<Uuid>,
    ) -> Vec<Uuid> {
        let mut q = bind_fetch_take(sqlx::query(AssertSqlSafe(text.to_owned())), "w1", p, ids);
        if is_transaction_take(text) {
            q = q.bind(IDLE_BOUND_MS);
        }
        q.fetch_all(&mut *conn)
            .await
            .expect("take")
            .iter()
            .map(|r| r.get::<Uuid, _>("id"))
            .collect()
    }

    /// Every relay-path statement in every plan-cache mode, on `backlog` with `stats`.
    async fn check(stats: Stats, backlog: Backlog) {
        let h = table_in(stats, backlog).await;
        let t = h.table().clone();
        let s = h.sqlx_repository().statements().clone();
        let req = FetchRequest::new(WorkerId::new("w1").unwrap(), BATCH);
        let p = FetchParams::new(&req);
        let mut bad = Vec::new();
        for mode in ["force_custom_plan", "force_generic_plan"] {
            let ctx = format!("{stats:?} {backlog:?} {mode}");
            let mut tx = h.pool().begin().await.unwrap();
            let plans = PlanCheck::load(&mut tx, &t, NODE_BOUND).await;
            exec(&mut tx, &format!("SET LOCAL plan_cache_mode = {mode}")).await;
            exec(&mut tx, "SAVEPOINT start").await;
            let rules = Rules::common;
            let lookups = |statement| Rules {
                statement,
                by_id: &["hl", "lk", "t"],
                uses: &[],
            };
            for (name, text) in [
                ("fetch_heads", &s.fetch_heads),
                ("fetch_heads_autocommit", &s.fetch_heads_autocommit),
            ] {
                bad.extend(
                    plans
                        .explain(&mut tx, rules(name), text, &heads_args(&p), &ctx)
                        .await,
                );
                exec(&mut tx, "ROLLBACK TO SAVEPOINT start").await;
            }
            let ids = heads(&mut tx, &s, &p).await;
            assert!(ids.len() >= BATCH / 2, "{ctx}: only {} heads", ids.len());
            for (name, text) in [
                ("fetch_take", &s.fetch_take),
                ("fetch_take_transaction", &s.fetch_take_transaction),
            ] {
                exec(&mut tx, "SAVEPOINT take").await;
                bad.extend(
                    plans
                        .explain(
                            &mut tx,
                            lookups(name),
                            text,
                            &take_args(text, &p, &ids),
                            &ctx,
                        )
                        .await,
                );
                exec(&mut tx, "ROLLBACK TO SAVEPOINT take").await;
            }
            // The outcome writes of each delivery mode, on the rows its take returns.
            for (take_text, complete, fail) in [
                (&s.fetch_take, ("complete", &s.complete), ("fail", &s.fail)),
                (
                    &s.fetch_take_transaction,
                    ("complete_in_delivery", &s.complete_in_delivery),
                    ("fail_in_delivery", &s.fail_in_delivery),
                ),
            ] {
                exec(&mut tx, "SAVEPOINT delivery").await;
                let taken = take(&mut tx, take_text, &p, ids.clone()).await;
                assert!(taken.len() >= BATCH / 2, "{ctx}: took {}", taken.len());
                let n = taken.len();
                for (name, text, params) in [
                    (complete.0, complete.1, 2),
                    (fail.0, fail.1, 7),
                    ("release", &s.release, 2),
                ] {
                    exec(&mut tx, "SAVEPOINT outcome").await;
                    let args: Vec<String> = if params == 2 {
                        vec![uuids(&taken), "'w1'".into()]
                    } else {
                        vec![
                            uuids(&taken),
                            format!("array_fill(true, ARRAY[{n}])"),
                            format!("array_fill('broker said no'::text, ARRAY[{n}])"),
                            format!("array_fill(1000000::int8, ARRAY[{n}])"),
                            format!("array_fill(NULL::timestamptz, ARRAY[{n}])"),
                            "'w1'".into(),
                            // R191: release, the default (a park writes the same rows).
                            format!("array_fill(false, ARRAY[{n}])"),
                        ]
                    };
                    bad.extend(
                        plans
                            .explain(&mut tx, lookups(name), text, &args, &ctx)
                            .await,
                    );
                    exec(&mut tx, "ROLLBACK TO SAVEPOINT outcome").await;
                }
                bad.extend(
                    plans
                        .explain(
                            &mut tx,
                            rules("oldest_due_age"),
                            &s.oldest_due_age,
                            &[],
                            &ctx,
                        )
                        .await,
                );
                for (name, text) in [
                    ("release_stale", &s.release_stale),
                    ("delete_old_completed", &s.delete_old_completed),
                ] {
                    bad.extend(
                        plans
                            .explain(
                                &mut tx,
                                lookups(name),
                                text,
                                &["0".into(), "1000".into()],
                                &ctx,
                            )
                            .await,
                    );
                }
                exec(&mut tx, "ROLLBACK TO SAVEPOINT delivery").await;
            }
            tx.rollback().await.unwrap();
        }
        assert!(bad.is_empty(), "{}", bad.join("\n"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plans_are_bounded_without_statistics() {
        check(Stats::None, Backlog::Burst).await;
        check(Stats::None, Backlog::Blocked).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plans_are_bounded_with_stale_statistics() {
        check(Stats::Stale, Backlog::Burst).await;
        check(Stats::Stale, Backlog::Blocked).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn plans_are_bounded_with_fresh_statistics() {
        check(Stats::Fresh, Backlog::Burst).await;
        check(Stats::Fresh, Backlog::Blocked).await;
    }
}
