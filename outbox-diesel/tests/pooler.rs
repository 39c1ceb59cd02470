//! OP-09 on the diesel-async store: the wake-up listener through PgBouncer in transaction mode
//! (`scripts/pgbouncer start`, `OUTBOX_TEST_POOLER_URL`, default 127.0.0.1:6432) finds LISTEN
//! silent, warns, sets `outbox_wakeup_listener_ok` to 0 and wakes the relays by fallback
//! polling; with a direct `listen_url` the gauge is 1 and nothing is logged (R195, R196). The
//! scenario is `txoutbox_testkit::pooler::op_09`; the schema comes from the sqlx harness.

use std::sync::Arc;

use futures::FutureExt;
use txoutbox_core::event::NewEvent;
use txoutbox_diesel::{
    DieselConfig, DieselOutboxRepository, PoolSettings, WakeListener, build_pool,
};
use txoutbox_postgres::wake::WakeOptions;
use txoutbox_postgres::{PgOutboxWriter, Pooler};
use txoutbox_testkit::pooler::{Op09Listener, op_09};
use txoutbox_testkit::{PgHarness, database_url, pooler_pool, pooler_url};
use uuid::Uuid;

fn event() -> NewEvent {
    NewEvent::builder()
        .event_type("t.happened")
        .aggregate("thing", Uuid::new_v4())
        .topic("things")
        .partition_key("k")
        .payload_json(serde_json::json!({ "k": 1 }))
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn op_09_a_silent_listen() {
    let h = PgHarness::create(&database_url(), "outbox_events").await;
    let table = h.table().clone();
    let pool = build_pool(&pooler_url(), &PoolSettings::default().max_size(4).unwrap()).unwrap();
    let repo = Arc::new(DieselOutboxRepository::new(
        pool.clone(),
        DieselConfig::default()
            .table(table.clone())
            .pooler(Pooler::Transaction),
    ));
    let spawn = |direct: bool, wakers| {
        let (pool, table) = (pool.clone(), table.clone());
        async move {
            let url = if direct { database_url() } else { pooler_url() };
            let options = WakeOptions::default()
                .pooler(Pooler::Transaction)
                .listen_url(url);
            let l = Arc::new(
                WakeListener::spawn_with(&pool, &table, wakers, options)
                    .await
                    .expect("LISTEN"),
            );
            Op09Listener {
                channel: l.channel().to_owned(),
                ok: Box::new({
                    let l = l.clone();
                    move || l.listener_ok()
                }),
                keep: Box::new(l),
            }
        }
        .boxed()
    };
    let proxy = pooler_pool(&pooler_url(), 2).await;
    let writer = PgOutboxWriter::new(&table).pooler(Pooler::Transaction);
    let write = || async {
        let mut tx = proxy.begin().await.unwrap();
        let r = writer.write(&mut tx, vec![event()]).await.unwrap();
        tx.commit().await.unwrap();
        r[0].event.id
    };
    let (direct, qualified) = (h.pool().clone(), table.qualified());
    let status = |id: Uuid| {
        let (direct, sql) = (
            direct.clone(),
            format!("SELECT status FROM {qualified} WHERE id = $1"),
        );
        async move {
            txoutbox_postgres::sqlx::query_scalar::<_, String>(
                txoutbox_postgres::sqlx::AssertSqlSafe(sql),
            )
            .bind(id)
            .fetch_one(&direct)
            .await
            .unwrap()
        }
    };
    op_09(repo, spawn, write, status).await;
}
