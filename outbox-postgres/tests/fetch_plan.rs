//! The fetch's plan reads the outbox table through indexes only: no sequential scan of the
//! table in backlog shapes (a) and (d) of the issue (R33; "the fetch must stay flat").

use outbox_core::event::WorkerId;
use outbox_core::repository::FetchRequest;
use outbox_postgres::sql::FetchParams;
use outbox_postgres::testing::PgHarness;
use outbox_postgres::testing::shapes::{self, Shape};
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
            let row = sqlx::query(AssertSqlSafe(format!("EXPLAIN ({opts}) {}", stmts.fetch)))
                .bind("w1")
                .bind(p.limit)
                .bind(p.lease_us)
                .bind(p.max_per_key)
                .bind(p.topics.clone())
                .bind(p.aggregate_types.clone())
                .bind(p.aggregate_ids.clone())
                .bind(p.scan_limit)
                .fetch_one(&mut *tx)
                .await
                .expect("explain");
            tx.rollback().await.unwrap();
            let plan: serde_json::Value = row.try_get(0).unwrap();
            let mut found = Vec::new();
            seq_scans(&plan, "outbox_events", &mut found);
            assert!(
                found.is_empty(),
                "{shape:?}, max_per_key {per_key}, {opts}: {found:?}\n{plan:#}"
            );
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
