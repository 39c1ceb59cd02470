//! Fetch benchmark: builds each backlog shape of the issue in a fresh schema and prints the
//! fetch's median server time (EXPLAIN ANALYZE "Execution Time"), median wall time (the
//! statement as the repository sends it, client side) and median shared buffers touched (a
//! figure that, unlike the times, does not depend on the machine's load), for a batch of 100
//! with max_per_key 1 and 16, with the 1-minute load average. Each measured fetch runs in a
//! transaction that is rolled back, so the shape stays as built (the rolled-back lease stamps
//! leave dead index entries behind, so later runs read a little more than a fresh table).
//!
//! `cargo run --release -p outbox-postgres --features testing --example fetch_bench [runs]`
//! (`DATABASE_URL`, default `postgres://postgres@127.0.0.1:5432/test`).

use std::time::Instant;

use outbox_core::event::WorkerId;
use outbox_core::repository::FetchRequest;
use outbox_postgres::bind_fetch;
use outbox_postgres::sql::FetchParams;
use outbox_postgres::testing::shapes::{self, Shape};
use outbox_postgres::testing::{PgHarness, database_url};
use sqlx::{AssertSqlSafe, Row};

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
        "shape | max_per_key | rows | server ms (median) | wall ms (median) | buffers (median) | load"
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
        let fetch = h.sqlx_repository().statements().fetch.clone();
        for per_key in [1usize, 16] {
            let req = FetchRequest::new(WorkerId::new("bench").unwrap(), 100).max_per_key(per_key);
            let p = FetchParams::new(&req);
            let q = |text: String| bind_fetch(sqlx::query(AssertSqlSafe(text)), "bench", p.clone());
            let (mut server, mut wall, mut buffers, mut rows) =
                (Vec::new(), Vec::new(), Vec::new(), 0);
            for i in 0..runs + 2 {
                let mut tx = h.pool().begin().await.unwrap();
                let r = q(format!("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {fetch}"))
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                tx.rollback().await.unwrap();
                let plan: serde_json::Value = r.try_get(0).unwrap();
                let ms = plan[0]["Execution Time"].as_f64().unwrap();
                let top = &plan[0]["Plan"];
                let blocks = top["Shared Hit Blocks"].as_f64().unwrap()
                    + top["Shared Read Blocks"].as_f64().unwrap();
                let mut tx = h.pool().begin().await.unwrap();
                let t = Instant::now();
                let got = q(fetch.clone()).fetch_all(&mut *tx).await.unwrap();
                let w = t.elapsed().as_secs_f64() * 1000.0;
                tx.rollback().await.unwrap();
                if i >= 2 {
                    // the first two runs warm the caches and the prepared statement
                    server.push(ms);
                    buffers.push(blocks);
                    wall.push(w);
                }
                rows = got.len();
            }
            println!(
                "{} | {per_key} | {rows} | {:.2} | {:.2} | {:.0} | {}",
                shape.describe(),
                median(server),
                median(wall),
                median(buffers),
                load_average()
            );
        }
    }
}
