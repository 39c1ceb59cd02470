//! The fetch's plans read the outbox table through indexes only: no sequential scan of the
//! table in backlog shapes (a), (d) and (f) (R33, R85); and the rows it returns are heads of the
//! plain head rule on random tables, in head order, through both paths (the oldest heads
//! exactly when path A answers alone; R20 lets the key walk take others).

use outbox_core::event::WorkerId;
use outbox_core::repository::FetchRequest;
use outbox_postgres::sql::{FetchParams, HeadRows, TableName, WalkCursor};
use outbox_postgres::testing::PgHarness;
use outbox_postgres::testing::shapes::{self, Shape};
use outbox_postgres::{bind_fetch_heads, bind_fetch_take, fetch_rows};
use sqlx::{AssertSqlSafe, Row};

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
    let h = PgHarness::create(&outbox_postgres::testing::database_url(), "outbox_events").await;
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
    let h = PgHarness::create(&outbox_postgres::testing::database_url(), "outbox_events").await;
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
            let got: Vec<uuid::Uuid> = fetch_rows(
                &mut tx,
                &stmts,
                outbox_postgres::sql::Take::Lease,
                "w1",
                &p,
                &cursor,
            )
            .await
            .expect("fetch")
            .iter()
            .map(|r| r.try_get("id").unwrap())
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
