//! OP-09 on the sqlx store: the wake-up listener through PgBouncer in transaction mode
//! (`scripts/pgbouncer start`, `OUTBOX_TEST_POOLER_URL`, default 127.0.0.1:6432) finds LISTEN
//! silent, warns, sets `outbox_wakeup_listener_ok` to 0 and wakes the relays by fallback
//! polling; with a direct `listen_url` the gauge is 1 and nothing is logged (R195, R196).
//! The scenario is `txoutbox_testkit::pooler::op_09`.

use std::sync::Arc;

use futures::FutureExt;
use txoutbox_core::event::NewEvent;
use txoutbox_postgres::wake::WakeOptions;
use txoutbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, Pooler, WakeListener};
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
    let proxy = pooler_pool(&pooler_url(), 4).await;
    let table = h.table().clone();
    let repo = Arc::new(PgOutboxRepository::new(
        proxy.clone(),
        PgConfig::default()
            .table(table.clone())
            .pooler(Pooler::Transaction),
    ));
    let spawn = |direct: bool, wakers| {
        let (proxy, table) = (proxy.clone(), table.clone());
        async move {
            let mut options = WakeOptions::default().pooler(Pooler::Transaction);
            if direct {
                options = options.listen_url(database_url());
            }
            let l = WakeListener::spawn_with(&proxy, &table, wakers, options)
                .await
                .expect("LISTEN");
            let l = Arc::new(l);
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
    // No notification with the write: through the proxy it would reach whichever client holds
    // the server connection that LISTENed, not the listener (the probe shows it, below).
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
            sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(sql))
                .bind(id)
                .fetch_one(&direct)
                .await
                .unwrap()
        }
    };
    op_09(repo, spawn, write, status).await;
}
