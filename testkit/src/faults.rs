//! Fault trials: a broker outage, database faults, a fetch terminated mid-statement.

use super::budget::*;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::AssertSqlSafe;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use txoutbox_core::event::NewEvent;
use txoutbox_core::repository::OutboxRepository;
use uuid::Uuid;

use txoutbox_postgres::sql::{Statements, TableName};
use txoutbox_postgres::{PgConfig, PgOutboxRepository, PgOutboxWriter, create_schema};

/// How a [`broker_outage_on_postgres`] trial takes the broker away.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BrokerFault {
    /// Connections are refused (nothing listens on the broker's port).
    Refuse,
    /// Connections stay open, new ones are accepted, and no byte gets through either way.
    BlackHole,
    /// Every connection, open or new, is reset (TCP RST) mid-stream.
    Reset,
}

/// A pipeline step for the fault trials: records each cycle's report with the time it ended,
/// and lets a trial wait for a condition over them (woken by every cycle's end, never by a
/// timer).
#[derive(Default)]
pub(super) struct CycleLog {
    cycles: std::sync::Mutex<Vec<(std::time::Instant, txoutbox_core::relay::CycleReport)>>,
    changed: tokio::sync::Notify,
}

#[async_trait]
impl txoutbox_core::step::PipelineStep for CycleLog {
    async fn on_cycle_end(&self, r: &txoutbox_core::relay::CycleReport) {
        self.cycles
            .lock()
            .expect("log")
            .push((std::time::Instant::now(), r.clone()));
        self.changed.notify_waiters();
    }
}

impl CycleLog {
    /// Rows completed so far.
    fn completed(&self) -> usize {
        let c = self.cycles.lock().expect("log");
        c.iter().map(|(_, r)| r.completed.len()).sum()
    }

    /// Every report so far.
    fn reports(&self) -> Vec<txoutbox_core::relay::CycleReport> {
        let c = self.cycles.lock().expect("log");
        c.iter().map(|(_, r)| r.clone()).collect()
    }

    /// Waits until `pred` holds over the log (or `within` passes); returns whether it did.
    async fn wait(&self, within: Duration, pred: impl Fn(&Self) -> bool) -> bool {
        tokio::time::timeout(within, async {
            loop {
                let n = self.changed.notified();
                if pred(self) {
                    return;
                }
                n.await;
            }
        })
        .await
        .is_ok()
    }
}

/// A fault trial's table: a fresh schema with the outbox table holding `rounds` × `keys` events
/// (keys `acct-0`, `acct-1`, …, one event per key per round, topic `orders`).
pub(super) struct FaultBacklog {
    schema: String,
    table: TableName,
    /// Each key's event ids in write order.
    written: std::collections::HashMap<String, Vec<Uuid>>,
}

impl FaultBacklog {
    async fn write(pool: &PgPool, keys: usize, rounds: usize) -> Self {
        let schema = fresh_schema_name();
        let table = TableName::new(&format!("{schema}.outbox_events")).expect("valid table name");
        create_schema(pool, &table)
            .await
            .expect("create the outbox table");
        let writer = PgOutboxWriter::new(&table);
        let mut written: std::collections::HashMap<String, Vec<Uuid>> = Default::default();
        let mut tx = pool.begin().await.expect("begin");
        for seq in 0..rounds {
            let events: Vec<NewEvent> = (0..keys)
                .map(|k| {
                    txoutbox_conformance::broker::e2e_event("orders", &format!("acct-{k}"), seq)
                })
                .collect();
            for r in writer.write(&mut tx, events).await.expect("write") {
                written
                    .entry(r.event.partition_key.clone())
                    .or_default()
                    .push(r.event.id);
            }
        }
        tx.commit().await.expect("commit");
        Self {
            schema,
            table,
            written,
        }
    }

    fn total(&self) -> usize {
        self.written.values().map(Vec::len).sum()
    }

    /// The rows not completed or still held: (id, status, locked_by).
    async fn left(&self, pool: &PgPool) -> Vec<(Uuid, String, Option<String>)> {
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT id, status, locked_by FROM {} WHERE status <> 'completed' OR locked_by IS NOT NULL",
            self.table.qualified()
        )))
        .fetch_all(pool)
        .await
        .expect("rows left")
    }

    /// Checks the first acknowledged publish of each event: every event once, per key in write
    /// order. Returns how many publishes repeated an event already published.
    fn check_first_publishes(&self, calls: &[txoutbox_core::scripted::Call]) -> usize {
        let first = txoutbox_conformance::broker::FirstDeliveries::of(
            calls
                .iter()
                .filter(|c| c.result.as_ref().is_some_and(Result::is_ok))
                .map(|c| (c.partition_key.clone(), c.event_id)),
        );
        assert_eq!(
            first.distinct,
            self.total(),
            "faults: every event was published"
        );
        assert_eq!(
            first.per_key, self.written,
            "faults: per key, first publishes in write order"
        );
        first.repeated
    }

    async fn drop_schema(self, pool: &PgPool) {
        sqlx::query(AssertSqlSafe(format!(
            "DROP SCHEMA \"{}\" CASCADE",
            self.schema
        )))
        .execute(pool)
        .await
        .expect("drop the trial schema");
    }
}

/// A broker wrapper that records when each publish was acknowledged (its `publish` returned
/// `Ok`), for the fault trials' time to the first publish.
pub(super) struct AckTimes {
    inner: Arc<dyn txoutbox_core::Broker>,
    acks: Arc<std::sync::Mutex<Vec<std::time::Instant>>>,
}

#[async_trait]
impl txoutbox_core::Broker for AckTimes {
    async fn publish(
        &self,
        m: &txoutbox_core::Message,
    ) -> Result<txoutbox_core::Ack, txoutbox_core::BrokerError> {
        let r = self.inner.publish(m).await;
        if r.is_ok() {
            self.acks
                .lock()
                .expect("acks")
                .push(std::time::Instant::now());
        }
        r
    }

    fn messaging_system(&self) -> &'static str {
        self.inner.messaging_system()
    }

    fn destination_name(&self, m: &txoutbox_core::Message) -> String {
        self.inner.destination_name(m)
    }

    fn reconnects(&self) -> Option<txoutbox_core::broker::ReconnectWatch> {
        self.inner.reconnects()
    }

    async fn probe(&self) -> txoutbox_core::broker::Probe {
        self.inner.probe().await
    }
}

/// The reference figures: omni-box 0.3.1 (the ancestor) measured during a 10 s broker outage with
/// three relays, counted from PostgreSQL's WAL: 46,060 row updates on NATS, 55,426 on Redis.
/// The target is at most 10 % of it.
pub const REFERENCE_OUTAGE_ROW_UPDATES: [(txoutbox_conformance::broker::BrokerKind, usize); 2] = [
    (txoutbox_conformance::broker::BrokerKind::Nats, 46_060),
    (txoutbox_conformance::broker::BrokerKind::Redis, 55_426),
];

/// What a [`broker_outage_on_postgres`] trial measured.
#[derive(Debug, Clone)]
pub struct OutageFigures {
    /// Relays (each a [`Relay::run_with`](txoutbox_core::relay::Relay::run_with) loop with its
    /// own broker connection, as separate processes would have).
    pub relays: usize,
    /// Cycles of all relays that fetched (rows or none) while the broker was away.
    pub cycles_during: usize,
    /// Rows the relays fetched while the broker was away.
    pub rows_fetched_during: usize,
    /// Row updates of the outbox table while the broker was away, counted by PostgreSQL (a
    /// statement trigger with a transition table logs each UPDATE's row count with
    /// `clock_timestamp()`), not by the relay: in the lease mode each fetched row is updated
    /// for its lease and again for its release; in transaction delivery only completions and
    /// counted failures are written.
    pub row_writes_during: i64,
    /// The ancestor's row updates in the same outage ([`REFERENCE_OUTAGE_ROW_UPDATES`]).
    pub ancestor_row_writes: usize,
    /// From the broker answering again to the first acknowledged publish (an adapter's
    /// `publish` returning `Ok`).
    pub first_publish_after: Duration,
    /// From the broker answering again to the end of the first cycle with an acknowledged
    /// publish (that cycle may still wait for a publish sent into the fault).
    pub first_cycle_after: Duration,
    /// How long the broker was away.
    pub outage: Duration,
}

impl std::fmt::Display for OutageFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "outage {:.1?}, {} relays: {} cycles, {} rows fetched, {} row updates during it ({:.1} % of the ancestor's {}); first publish {:?} (end of its cycle {:?}) after the broker answered again",
            self.outage,
            self.relays,
            self.cycles_during,
            self.rows_fetched_during,
            self.row_writes_during,
            100.0 * self.row_writes_during as f64 / self.ancestor_row_writes as f64,
            self.ancestor_row_writes,
            self.first_publish_after,
            self.first_cycle_after
        )
    }
}

/// The fault suite, broker side, in the measured setting: three relay loops
/// ([`txoutbox_core::relay::Relay::run_with`] with
/// [`RECOMMENDED_OUTAGE_BACKOFF`](txoutbox_core::relay::RECOMMENDED_OUTAGE_BACKOFF), the outage
/// back-off `outbox-relay` runs with) on PostgreSQL (the sqlx backend, a fresh schema) drain
/// 40 keys × 25 events into `b`, each relay through its own adapter connection to one
/// [`txoutbox_conformance::broker::LoopbackProxy`]. After 100 rows went out the proxy takes the
/// broker away (`fault`) for `outage`, then brings it back. Checks that every event arrives,
/// that per key first deliveries are in write order, and that every row ends completed and
/// released; returns the figures of the outage. Batch 50, publish timeout 2 s (the adapter's
/// own 1 s), poll interval 1 s, `delivery` mode.
pub async fn broker_outage_on_postgres(
    b: &dyn txoutbox_conformance::broker::BrokerUnderTest,
    fault: BrokerFault,
    outage: Duration,
    delivery: txoutbox_core::repository::DeliveryMode,
) -> OutageFigures {
    use txoutbox_conformance::broker::{FirstDeliveries, LoopbackProxy, TrialOptions};
    use txoutbox_core::CancellationToken;
    use txoutbox_core::relay::{CycleReport, RECOMMENDED_OUTAGE_BACKOFF, Relay, RunOptions};

    const RELAYS: usize = 3;

    let _share = reserve_connections(6).await;
    let pool = trial_pool(&database_url(), 6).await;
    let backlog = FaultBacklog::write(&pool, 40, 25).await;
    let (schema, table, total) = (&backlog.schema, backlog.table.clone(), backlog.total());
    // PostgreSQL counts the table's row updates, with the time of each statement.
    for ddl in [
        format!(
            "CREATE TABLE \"{schema}\".row_updates (at timestamptz NOT NULL DEFAULT clock_timestamp(), n bigint NOT NULL)"
        ),
        format!(
            "CREATE FUNCTION \"{schema}\".count_row_updates() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN INSERT INTO \"{schema}\".row_updates (n) SELECT count(*) FROM changed; RETURN NULL; END $$"
        ),
        format!(
            "CREATE TRIGGER count_row_updates AFTER UPDATE ON {} REFERENCING NEW TABLE AS changed \
             FOR EACH STATEMENT EXECUTE FUNCTION \"{schema}\".count_row_updates()",
            table.qualified()
        ),
    ] {
        sqlx::query(AssertSqlSafe(ddl))
            .execute(&pool)
            .await
            .expect("the row-update counter");
    }

    let proxy = LoopbackProxy::start(b.server_addr()).await;
    let t = b
        .trial(TrialOptions {
            connect_to: Some(proxy.addr()),
            adapter_timeout: Duration::from_secs(1),
        })
        .await;
    let log = Arc::new(CycleLog::default());
    let acks = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut relays = Vec::new();
    for i in 0..RELAYS {
        let broker = Arc::new(AckTimes {
            inner: if i == 0 {
                t.broker()
            } else {
                t.another_adapter().await
            },
            acks: acks.clone(),
        });
        relays.push(Arc::new(
            Relay::builder(
                Arc::new(PgOutboxRepository::new(
                    pool.clone(),
                    PgConfig::default().table(table.clone()),
                )),
                broker,
            )
            .worker_id(format!("faults-{i}"))
            .batch_size(50)
            .publish_timeout(Duration::from_secs(2))
            .poll_interval(Duration::from_secs(1))
            .delivery(delivery)
            .step(log.clone())
            .build()
            .expect("relay"),
        ));
    }
    let stop = CancellationToken::new();
    let tasks: Vec<_> = relays
        .iter()
        .map(|relay| {
            let (relay, stop) = (relay.clone(), stop.clone());
            tokio::spawn(async move {
                relay
                    .run_with(
                        stop,
                        RunOptions::new().outage_backoff(RECOMMENDED_OUTAGE_BACKOFF),
                    )
                    .await
            })
        })
        .collect();

    assert!(
        log.wait(Duration::from_secs(30), |l| l.completed() >= 100)
            .await,
        "faults: 100 rows were not published within 30 s"
    );
    let db_now = || async {
        sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>("SELECT clock_timestamp()")
            .fetch_one(&pool)
            .await
            .expect("the database clock")
    };
    match fault {
        BrokerFault::Refuse => proxy.close().await,
        BrokerFault::BlackHole => proxy.stall(),
        BrokerFault::Reset => proxy.reset(),
    }
    let down = std::time::Instant::now();
    let db_down = db_now().await;
    let cycles_before = log.cycles.lock().expect("log").len();
    // The outage lasts what it lasts: this wait is the fault, not a wait for state.
    tokio::time::sleep(outage).await;
    let db_up = db_now().await;
    match fault {
        BrokerFault::Refuse => proxy.reopen().await,
        BrokerFault::BlackHole => proxy.resume(),
        BrokerFault::Reset => proxy.stop_resetting(),
    }
    let up = std::time::Instant::now();
    let (cycles_during, rows_fetched_during) = {
        let c = log.cycles.lock().expect("log");
        let during: Vec<&CycleReport> = c[cycles_before..]
            .iter()
            .filter(|(at, _)| *at <= up)
            .map(|(_, r)| r)
            .collect();
        (
            during.iter().filter(|r| !r.breaker_open).count(),
            during.iter().map(|r| r.fetched.len()).sum::<usize>(),
        )
    };
    let first_after = |l: &CycleLog| {
        l.cycles
            .lock()
            .expect("log")
            .iter()
            .find(|(at, r)| *at > up && !r.completed.is_empty())
            .map(|(at, _)| *at)
    };
    assert!(
        log.wait(Duration::from_secs(60), |l| first_after(l).is_some())
            .await,
        "faults: nothing was published within 60 s after the broker came back"
    );
    let first = first_after(&log).expect("checked");
    assert!(
        log.wait(Duration::from_secs(120), |l| l.completed() >= total)
            .await,
        "faults: the drain did not finish within 120 s after the broker came back ({} of {total})",
        log.completed()
    );
    stop.cancel();
    for (relay, task) in relays.iter().zip(tasks) {
        relay.waker().notify_one();
        task.await.expect("relay task").expect("relay loop");
    }
    let row_writes_during: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT coalesce(sum(n), 0)::bigint FROM \"{schema}\".row_updates WHERE at >= $1 AND at < $2"
    )))
    .bind(db_down)
    .bind(db_up)
    .fetch_one(&pool)
    .await
    .expect("count the row updates");

    let delivered = FirstDeliveries::of_received(&t.read("orders").await);
    assert_eq!(delivered.distinct, total, "faults: every event arrived");
    assert_eq!(
        delivered.per_key, backlog.written,
        "faults: per key, first deliveries in write order"
    );
    let left = backlog.left(&pool).await;
    assert!(
        left.is_empty(),
        "faults: every row completed and released: {left:?}"
    );
    t.cleanup().await;
    proxy.shutdown().await;
    backlog.drop_schema(&pool).await;
    let ancestor_row_writes = REFERENCE_OUTAGE_ROW_UPDATES
        .iter()
        .find(|(k, _)| *k == b.kind())
        .map_or(0, |(_, n)| *n);
    OutageFigures {
        relays: RELAYS,
        cycles_during,
        rows_fetched_during,
        row_writes_during,
        ancestor_row_writes,
        first_publish_after: acks
            .lock()
            .expect("acks")
            .iter()
            .filter(|at| **at > up)
            .min()
            .expect("a publish after the outage")
            .saturating_duration_since(up),
        first_cycle_after: first.saturating_duration_since(up),
        outage: up.saturating_duration_since(down),
    }
}

/// The measured outage: 10 s.
pub const MEASURED_OUTAGE: Duration = Duration::from_secs(10);

/// [`broker_outage_on_postgres`] for [`MEASURED_OUTAGE`], printed, and held to the
/// targets: at most 10 % of the ancestor's row updates and cycles during the outage (its cycles
/// taken as its row updates over 2 per row of a 50-row batch), in transaction delivery no
/// writes but the completions of the cycles in flight when the broker went away, and a publish
/// within 5 s after the broker answers again (the target is 1 s, printed; this bound only
/// catches a relay that waits for its back-off timer, up to 30 s, instead of the broker).
pub async fn broker_outage_recovers_within_bounds(
    b: &dyn txoutbox_conformance::broker::BrokerUnderTest,
    fault: BrokerFault,
    delivery: txoutbox_core::repository::DeliveryMode,
) -> OutageFigures {
    let f = broker_outage_on_postgres(b, fault, MEASURED_OUTAGE, delivery).await;
    println!("faults {:?} {fault:?} {delivery:?}: {f}", b.kind());
    let ancestor_cycles = f.ancestor_row_writes / (2 * 50);
    assert!(
        f.row_writes_during * 10 <= f.ancestor_row_writes as i64,
        "more than 10 % of the ancestor's row updates: {f}"
    );
    assert!(
        f.cycles_during * 10 <= ancestor_cycles,
        "more than 10 % of the ancestor's {ancestor_cycles} cycles: {f}"
    );
    if delivery == txoutbox_core::repository::DeliveryMode::Transaction {
        assert!(
            f.row_writes_during <= (f.relays * 50) as i64,
            "transaction delivery writes nothing during an outage: {f}"
        );
    }
    assert!(
        f.first_publish_after < Duration::from_secs(5),
        "no publish within 5 s after the broker came back: {f}"
    );
    f
}

/// What a [`database_faults_drain`] trial measured.
#[derive(Debug, Clone)]
pub struct DatabaseFaultFigures {
    /// Backends of the relay ended by `pg_terminate_backend` during the fault.
    pub terminated: usize,
    /// Cycles that fetched nothing or whose fetch failed (the cycle-end hook sees both as an
    /// empty report).
    pub empty_cycles: usize,
    /// Outcome writes retried after a transient failure (sum of `commit_retries`).
    pub commit_retries: u32,
    /// Outcome writes that failed for good (their rows waited for the lease).
    pub commit_failures: usize,
    /// Publishes of an event id that had been published before (at least once delivery).
    pub repeated_publishes: usize,
    /// From the end of the fault to the last row completed.
    pub drain_after: Duration,
    /// Whether a pinned snapshot (an open REPEATABLE READ transaction elsewhere) held back
    /// vacuum during the whole drain.
    pub pinned: bool,
    /// The whole drain.
    pub drain: Duration,
}

/// The fault suite, database side: a relay loop on PostgreSQL (the sqlx backend, its own
/// pool with application name `outbox-faults-<schema>`) drains 8 keys × 40 events to a
/// scripted broker (1 ms per publish). For the first `fault` of the drain every backend of the
/// relay's pool is ended with `pg_terminate_backend` every 50 ms, so fetches, publishes' outcome
/// writes and idle connections are cut wherever they are. With `pin`, a REPEATABLE READ
/// transaction on another connection holds its snapshot (and so vacuum) for the whole drain.
/// Checks that every event is published, first publishes per key in write order, and every row
/// ends completed and released; returns the figures.
pub async fn database_faults_drain(fault: Duration, pin: bool) -> DatabaseFaultFigures {
    use txoutbox_core::CancellationToken;
    use txoutbox_core::relay::Relay;
    use txoutbox_core::scripted::{Action, ScriptedBroker};

    let _share = reserve_connections(8).await;
    let url = database_url();
    let admin = trial_pool(&url, 3).await;
    let backlog = FaultBacklog::write(&admin, 8, 40).await;
    let (schema, table, total) = (&backlog.schema, backlog.table.clone(), backlog.total());

    let mut pinned = None;
    if pin {
        let mut c = admin.begin().await.expect("begin the pin");
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *c)
            .await
            .expect("repeatable read");
        sqlx::query("SELECT txid_current()")
            .execute(&mut *c)
            .await
            .expect("take the snapshot");
        pinned = Some(c);
    }

    let app = format!("outbox-faults-{schema}");
    let opts: PgConnectOptions = url
        .parse::<PgConnectOptions>()
        .expect("DATABASE_URL is a valid postgres URL")
        .application_name(&app);
    let relay_pool = PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(CONNECT_PATIENCE)
        .connect_lazy_with(opts);
    let broker = ScriptedBroker::new();
    broker.set_default(Action::Delay(Duration::from_millis(1)));
    let log = Arc::new(CycleLog::default());
    let relay = Arc::new(
        Relay::builder(
            Arc::new(PgOutboxRepository::new(
                relay_pool.clone(),
                PgConfig::default().table(table.clone()),
            )),
            Arc::new(broker.clone()),
        )
        .worker_id("faults-db")
        .batch_size(20)
        .max_per_key(4)
        .lease_ttl(Duration::from_secs(5))
        .publish_timeout(Duration::from_secs(1))
        .poll_interval(Duration::from_millis(200))
        .step(log.clone())
        .build()
        .expect("relay"),
    );
    let started = std::time::Instant::now();
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    // The fault: end every backend of the relay's pool every 50 ms.
    let mut terminated = 0usize;
    let fault_ends = std::time::Instant::now() + fault;
    while std::time::Instant::now() < fault_ends {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = $1",
        )
        .bind(&app)
        .fetch_one(&admin)
        .await
        .expect("pg_terminate_backend");
        terminated += n as usize;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let fault_end = std::time::Instant::now();

    let finished = log
        .wait(Duration::from_secs(120), |l| l.completed() >= total)
        .await;
    let drained = std::time::Instant::now();
    stop.cancel();
    relay.waker().notify_one();
    task.await.expect("relay task").expect("relay loop");
    if let Some(c) = pinned.take() {
        c.rollback().await.expect("end the pin");
    }
    let left = backlog.left(&admin).await;
    assert!(
        finished && left.is_empty(),
        "faults: the drain did not finish within 120 s after the fault: {left:?}"
    );
    let repeated = backlog.check_first_publishes(&broker.calls());

    let reports = log.reports();
    relay_pool.close().await;
    backlog.drop_schema(&admin).await;
    DatabaseFaultFigures {
        terminated,
        empty_cycles: reports
            .iter()
            .filter(|r| r.fetched.is_empty() && !r.breaker_open)
            .count(),
        commit_retries: reports.iter().map(|r| r.commit_retries).sum(),
        commit_failures: reports.iter().filter(|r| r.commit_failed).count(),
        repeated_publishes: repeated,
        drain_after: drained.saturating_duration_since(fault_end),
        pinned: pin,
        drain: drained.saturating_duration_since(started),
    }
}

/// What a [`fetch_terminated_mid_statement`] trial measured.
#[derive(Debug, Clone)]
pub struct MidFetchFigures {
    /// The delivery mode of the relay.
    pub delivery: txoutbox_core::repository::DeliveryMode,
    /// The statement the relay's backend was running when it was ended (its first 60 bytes).
    pub statement: String,
    /// From the end of the fault (the backend ended and the table free again) to the end of the
    /// first cycle with an acknowledged publish.
    pub first_publish_after: Duration,
    /// From the end of the fault to the last row completed.
    pub drain_after: Duration,
}

/// The fault suite: the relay's connection terminated mid-fetch, deterministically. A
/// relay loop on PostgreSQL (sqlx backend, its own pool with application name
/// `outbox-midfetch-<schema>`, `delivery` mode) starts while another transaction holds the
/// outbox table in ACCESS EXCLUSIVE mode, so its first fetch statement waits on that lock. Once
/// `pg_stat_activity` shows the relay's backend waiting in `fetch_heads`, the backend is ended
/// with `pg_terminate_backend` and the lock released. Checks that the relay fetches again on a
/// fresh connection and drains 8 keys × 10 events to a scripted broker, first publishes per
/// key in write order, every row completed and released; returns the figures.
pub async fn fetch_terminated_mid_statement(
    delivery: txoutbox_core::repository::DeliveryMode,
) -> MidFetchFigures {
    fetch_terminated_mid_statement_with(delivery, |url, table| {
        let pool = PgPoolOptions::new()
            .max_connections(2)
            .acquire_timeout(CONNECT_PATIENCE)
            .connect_lazy(url)
            .expect("DATABASE_URL is a valid postgres URL");
        Arc::new(PgOutboxRepository::new(
            pool,
            PgConfig::default().table(table.clone()),
        ))
    })
    .await
}

/// [`fetch_terminated_mid_statement`] with the relay's repository made by `make_repo` from a
/// database URL that carries the trial's `application_name` (how the trial finds the relay's
/// backends) and the table: for other backends (outbox-diesel runs it with its own).
pub async fn fetch_terminated_mid_statement_with(
    delivery: txoutbox_core::repository::DeliveryMode,
    make_repo: impl FnOnce(&str, &TableName) -> Arc<dyn OutboxRepository>,
) -> MidFetchFigures {
    use txoutbox_core::CancellationToken;
    use txoutbox_core::relay::Relay;
    use txoutbox_core::scripted::ScriptedBroker;

    let _share = reserve_connections(6).await;
    let url = database_url();
    let admin = trial_pool(&url, 3).await;
    let backlog = FaultBacklog::write(&admin, 8, 10).await;
    let (schema, table, total) = (&backlog.schema, backlog.table.clone(), backlog.total());

    // The table is locked before the relay starts: its first fetch statement waits.
    let mut lock = admin.begin().await.expect("begin the lock");
    sqlx::query(AssertSqlSafe(format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        table.qualified()
    )))
    .execute(&mut *lock)
    .await
    .expect("lock the table");

    let app = format!("outbox-midfetch-{schema}");
    let sep = if url.contains('?') { '&' } else { '?' };
    let repo = make_repo(&format!("{url}{sep}application_name={app}"), &table);
    let broker = ScriptedBroker::new();
    let log = Arc::new(CycleLog::default());
    let relay = Arc::new(
        Relay::builder(repo, Arc::new(broker.clone()))
            .worker_id("mid-fetch")
            .batch_size(20)
            .max_per_key(4)
            .lease_ttl(Duration::from_secs(30))
            .publish_timeout(Duration::from_secs(1))
            .poll_interval(Duration::from_millis(200))
            .delivery(delivery)
            .step(log.clone())
            .build()
            .expect("relay"),
    );
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });

    // Find the relay's backend waiting on the lock (polled: the catalog has no event for it).
    let waiting = async {
        loop {
            let row: Option<(i32, String)> = sqlx::query_as(
                "SELECT pid, query FROM pg_stat_activity \
                 WHERE application_name = $1 AND state = 'active' AND wait_event_type = 'Lock'",
            )
            .bind(&app)
            .fetch_optional(&admin)
            .await
            .expect("pg_stat_activity");
            if let Some(r) = row {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let (pid, query) = tokio::time::timeout(Duration::from_secs(30), waiting)
        .await
        .expect("the relay's fetch waits on the table lock within 30 s");
    let fetch_heads = Statements::new(&table).fetch_heads;
    // pg_stat_activity keeps the first track_activity_query_size bytes of the statement.
    assert!(
        query.len() >= 200 && fetch_heads.starts_with(query.trim_end()),
        "faults: the relay's backend waits in the fetch's first statement, not in {query:?}"
    );
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(&admin)
        .await
        .expect("pg_terminate_backend");
    assert!(ended, "faults: the relay's backend was ended");
    lock.commit().await.expect("release the table");
    let fault_end = std::time::Instant::now();

    let first_after = |l: &CycleLog| {
        l.cycles
            .lock()
            .expect("log")
            .iter()
            .find(|(at, r)| *at > fault_end && !r.completed.is_empty())
            .map(|(at, _)| *at)
    };
    assert!(
        log.wait(Duration::from_secs(60), |l| first_after(l).is_some()
            && l.completed() >= total)
            .await,
        "faults: the relay did not drain within 60 s after its fetch was cut ({} of {total})",
        log.completed()
    );
    let drained = std::time::Instant::now();
    let first = first_after(&log).expect("checked");
    stop.cancel();
    relay.waker().notify_one();
    task.await.expect("relay task").expect("relay loop");

    backlog.check_first_publishes(&broker.calls());
    let left = backlog.left(&admin).await;
    assert!(
        left.is_empty(),
        "faults: every row completed and released: {left:?}"
    );
    drop(relay);
    backlog.drop_schema(&admin).await;
    MidFetchFigures {
        delivery,
        statement: query.chars().take(60).collect(),
        first_publish_after: first.saturating_duration_since(fault_end),
        drain_after: drained.saturating_duration_since(fault_end),
    }
}
