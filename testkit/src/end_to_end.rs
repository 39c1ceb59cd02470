//! End-to-end trials through a real broker, the wake-up probe and the outcome commit cut off.

use super::budget::*;
use super::harness::*;

use std::sync::Arc;
use std::time::Duration;

use sqlx::AssertSqlSafe;
use sqlx::postgres::PgPool;
use txoutbox_core::event::NewEvent;
use txoutbox_core::repository::OutboxRepository;
use uuid::Uuid;

use txoutbox_postgres::sql::TableName;
use txoutbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, create_schema};

/// End to end through a real broker: 4 keys × 15 events, each written by
/// [`PgOutboxWriter`] in its own committed transaction, plus one rolled-back write that must
/// never arrive, drained by the relay on [`PgOutboxRepository`] into a fresh trial of `broker`;
/// a consumer must read every event, in order per key, with its headers
/// ([`txoutbox_conformance::broker::drain_and_consume`]). Fresh schema, dropped afterwards.
pub async fn postgres_to_broker(broker: &dyn txoutbox_conformance::broker::BrokerUnderTest) {
    use txoutbox_conformance::broker::{TrialOptions, drain_and_consume, e2e_event};
    let _share = reserve_connections(4).await;
    let pool = trial_pool(&database_url(), 4).await;
    let schema = fresh_schema_name();
    let table = TableName::new(&format!("{schema}.outbox_events")).expect("valid table name");
    create_schema(&pool, &table)
        .await
        .expect("create the outbox table");
    let writer = PgOutboxWriter::new(&table);

    let mut written: std::collections::HashMap<String, Vec<Uuid>> = Default::default();
    for seq in 0..15 {
        for k in 0..4 {
            let key = format!("acct-{k}");
            let mut tx = pool.begin().await.expect("begin");
            let r = writer
                .write(&mut tx, vec![e2e_event("orders", &key, seq)])
                .await
                .expect("write");
            tx.commit().await.expect("commit");
            written.entry(key).or_default().push(r[0].event.id);
        }
    }
    // A rolled-back write never reaches the broker.
    let mut tx = pool.begin().await.expect("begin");
    writer
        .write(&mut tx, vec![e2e_event("orders", "acct-0", 99)])
        .await
        .expect("write");
    tx.rollback().await.expect("rollback");

    let repo = Arc::new(PgOutboxRepository::new(
        pool.clone(),
        PgConfig::default().table(table),
    ));
    let t = broker.trial(TrialOptions::default()).await;
    drain_and_consume(&*t, repo, "orders", &written).await;
    t.cleanup().await;
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA \"{schema}\" CASCADE")))
        .execute(&pool)
        .await
        .expect("drop the trial schema");
}

/// Counts the wake-up notifications (empty payload) a writer sends on a table's channel,
/// without waiting on a timer: [`WakeProbe::wakeups`] commits a marker notification and reads
/// until the marker arrives. PostgreSQL delivers a listener's notifications in commit order, so
/// every wake-up committed before the marker has been read by then, and a rolled-back
/// transaction's never arrives.
pub struct WakeProbe {
    listener: sqlx::postgres::PgListener,
    pool: PgPool,
    channel: String,
    marks: u64,
}

impl WakeProbe {
    /// LISTENs on `table`'s channel ([`TableName::notify_channel`]).
    pub async fn listen(pool: &PgPool, table: &TableName) -> Self {
        let channel = table.notify_channel();
        let mut listener = sqlx::postgres::PgListener::connect_with(pool)
            .await
            .expect("listener connects");
        listener.listen(&channel).await.expect("LISTEN");
        Self {
            listener,
            pool: pool.clone(),
            channel,
            marks: 0,
        }
    }

    /// The number of wake-ups committed since the last call (or since LISTEN).
    pub async fn wakeups(&mut self) -> usize {
        self.marks += 1;
        let mark = format!("probe-mark-{}", self.marks);
        sqlx::query("SELECT pg_notify($1, $2)")
            .bind(&self.channel)
            .bind(&mark)
            .execute(&self.pool)
            .await
            .expect("marker notify");
        let mut n = 0;
        loop {
            let got = tokio::time::timeout(Duration::from_secs(10), self.listener.recv())
                .await
                .expect("the marker notification arrives within 10 s")
                .expect("listener recv");
            match got.payload() {
                "" => n += 1,
                p if p == mark => return n,
                p => panic!("unexpected payload {p:?} on {}", self.channel),
            }
        }
    }
}

/// An outcome commit cut off mid-way: the relay on `repo` (either Postgres backend,
/// on `h`'s table) publishes two rows; before it writes their outcomes a second connection
/// row-locks one of them, so the outcome transaction waits; that waiting backend is then ended
/// with `pg_terminate_backend` (what a database restart does to it) and the lock let go. The
/// relay must retry the outcome write on a fresh connection: the cycle reports no commit
/// failure, at least one retry, both rows completed and unheld. Returns the time from the
/// termination to the end of the cycle (the target: under 1 s).
pub async fn outcome_commit_survives_termination(
    repo: Arc<dyn OutboxRepository>,
    h: &PgHarness,
) -> Duration {
    use txoutbox_core::CancellationToken;
    use txoutbox_core::relay::Relay;
    use txoutbox_core::scripted::{Action, Gate, ScriptedBroker};
    let events = ["k1", "k2"]
        .iter()
        .map(|k| {
            NewEvent::builder()
                .event_type("test.event")
                .aggregate("agg", Uuid::new_v4())
                .topic("t")
                .partition_key(*k)
                .payload_json(serde_json::json!({ "k": k }))
                .build()
                .expect("valid event")
        })
        .collect();
    let mut tx = h.begin_tx().await;
    let ids: Vec<Uuid> = tx
        .write(events)
        .await
        .expect("write")
        .iter()
        .map(|r| r.event.id)
        .collect();
    tx.commit().await.expect("commit");

    let broker = ScriptedBroker::new();
    let gate = Gate::new();
    broker.set_default(Action::Gate(gate.clone()));
    let relay = Relay::builder(repo, Arc::new(broker.clone()))
        .worker_id("w1")
        .publish_concurrency(2)
        .build()
        .expect("relay");
    let cycle = tokio::spawn(async move { relay.cycle(&CancellationToken::new()).await });
    broker.wait_for_calls(|c| c.len() == 2).await;

    // Both rows are published and waiting at the gate; the fetch has committed. Row-lock one.
    let mut locker = h.pool().begin().await.expect("begin the locker");
    let locker_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *locker)
        .await
        .expect("pid");
    sqlx::query(AssertSqlSafe(format!(
        "SELECT id FROM {} WHERE id = $1 FOR UPDATE",
        h.table().qualified()
    )))
    .bind(ids[0])
    .execute(&mut *locker)
    .await
    .expect("row lock");
    gate.open();

    // The relay's outcome transaction now waits for the locker. No event announces that a
    // backend started waiting for a lock, so this polls the server's view, bounded.
    let mut victim = None;
    for _ in 0..2000 {
        victim = sqlx::query_scalar::<_, i32>(
            "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid)) LIMIT 1",
        )
        .bind(locker_pid)
        .fetch_optional(h.pool())
        .await
        .expect("pg_stat_activity");
        if victim.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let victim = victim.expect("the outcome transaction never waited for the row lock");
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(victim)
        .fetch_one(h.pool())
        .await
        .expect("pg_terminate_backend");
    assert!(terminated, "backend {victim} was not terminated");
    let cut = std::time::Instant::now();
    locker.rollback().await.expect("release the row lock");

    let report = cycle.await.expect("cycle task").expect("cycle");
    let took = cut.elapsed();
    assert!(!report.commit_failed, "{report:?}");
    assert!(report.commit_retries >= 1, "{report:?}");
    let mut completed = report.completed.clone();
    completed.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(completed, want, "{report:?}");
    for id in &ids {
        let row: (String, Option<String>) = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT status, locked_by FROM {} WHERE id = $1",
            h.table().qualified()
        )))
        .bind(id)
        .fetch_one(h.pool())
        .await
        .expect("row");
        assert_eq!(row, ("completed".to_owned(), None), "row {id}");
    }
    took
}
