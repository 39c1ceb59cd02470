//! Fetch benchmark: builds each backlog shape (a)–(g) in a fresh schema and prints, for a batch
//! of 100 with max_per_key 1 and 16: the fetch's median server time (EXPLAIN ANALYZE
//! "Execution Time" of its two statements, summed), median wall time (both statements as the
//! repository sends them, client side), median shared buffers touched (a figure that, unlike
//! the times, does not depend on the machine's load), the advisory locks and all locks the
//! fetch transaction holds at its end, and the 1-minute load average. Each measured fetch runs
//! in a transaction that is rolled back, so the shape stays as built (the rolled-back lease
//! stamps leave dead index entries behind, so later runs read a little more than a fresh table).
//!
//! `cargo run --release -p txoutbox-postgres --example fetch_bench [runs]`
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`).

use std::time::Instant;

use sqlx::{AssertSqlSafe, Row};
use txoutbox_core::event::WorkerId;
use txoutbox_core::repository::FetchRequest;
use txoutbox_postgres::driver::sqlx::{bind_fetch_heads, bind_fetch_take, fetch_rows};
use txoutbox_postgres::sql::{FetchParams, HeadRows, WalkCursor};
use txoutbox_testkit::shapes::{self, Shape};
use txoutbox_testkit::{PgHarness, database_url};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The 1-minute load average (Linux), to print next to the figures: the machine is shared.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "unknown".to_owned())
}

#[tokio::main]
async fn main() {
    let runs: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(15);
    println!("load average at start: {}", load_average());
    println!(
        "shape | max_per_key | rows | server ms (median) | wall ms (median) | buffers (median) | advisory locks | locks | load"
    );
    for shape in Shape::ALL {
        let h = PgHarness::create(&database_url(), "outbox_events").await;
        let t0 = Instant::now();
        shapes::build(h.pool(), h.table(), shape)
            .await
            .expect("build shape");
        eprintln!(
            "built {} in {:.1} s",
            shape.describe(),
            t0.elapsed().as_secs_f64()
        );
        let stmts = h.sqlx_repository().statements().clone();
        for per_key in [1usize, 16] {
            let req = FetchRequest::new(WorkerId::new("bench").unwrap(), 100).max_per_key(per_key);
            let p = FetchParams::new(&req);
            let start = (String::new(), String::new());
            let (mut server, mut wall, mut buffers, mut rows, mut locks) =
                (Vec::new(), Vec::new(), Vec::new(), 0, (0, 0));
            for i in 0..runs + 2 {
                let mut tx = h.pool().begin().await.unwrap();
                let explain =
                    |t: &str| AssertSqlSafe(format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {t}"));
                let plan: serde_json::Value =
                    bind_fetch_heads(sqlx::query(explain(&stmts.fetch_heads)), &p, start.clone())
                        .fetch_one(&mut *tx)
                        .await
                        .unwrap()
                        .try_get(0)
                        .unwrap();
                let heads = HeadRows::new(
                    bind_fetch_heads(
                        sqlx::query(AssertSqlSafe(stmts.fetch_heads.clone())),
                        &p,
                        start.clone(),
                    )
                    .fetch_all(&mut *tx)
                    .await
                    .unwrap()
                    .iter()
                    .map(|r| (r.get(0), r.get(1), r.get(2))),
                );
                let plan2: serde_json::Value = bind_fetch_take(
                    sqlx::query(explain(&stmts.fetch_take)),
                    "bench",
                    &p,
                    heads.ids.clone(),
                )
                .fetch_one(&mut *tx)
                .await
                .unwrap()
                .try_get(0)
                .unwrap();
                tx.rollback().await.unwrap();
                let ms = plan[0]["Execution Time"].as_f64().unwrap()
                    + plan2[0]["Execution Time"].as_f64().unwrap();
                let blocks = |pl: &serde_json::Value| {
                    pl[0]["Plan"]["Shared Hit Blocks"].as_f64().unwrap()
                        + pl[0]["Plan"]["Shared Read Blocks"].as_f64().unwrap()
                };
                let blocks = blocks(&plan) + blocks(&plan2);
                let mut tx = h.pool().begin().await.unwrap();
                let t = Instant::now();
                let got = fetch_rows(&mut tx, &stmts, "bench", &p, &WalkCursor::default())
                    .await
                    .unwrap();
                let w = t.elapsed().as_secs_f64() * 1000.0;
                locks = sqlx::query_as(
                    "SELECT count(*) FILTER (WHERE locktype = 'advisory'), count(*) \
                     FROM pg_locks WHERE pid = pg_backend_pid()",
                )
                .fetch_one(&mut *tx)
                .await
                .unwrap();
                tx.rollback().await.unwrap();
                if i >= 2 {
                    // the first two runs warm the caches and the prepared statements
                    server.push(ms);
                    buffers.push(blocks);
                    wall.push(w);
                }
                rows = got.len();
            }
            let (advisory, all): (i64, i64) = locks;
            println!(
                "{} | {per_key} | {rows} | {:.2} | {:.2} | {:.0} | {advisory} | {all} | {}",
                shape.describe(),
                median(server),
                median(wall),
                median(buffers),
                load_average()
            );
        }
    }
}
