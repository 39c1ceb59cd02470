//! The inbox benchmarks (issues 21 and 22): `outbox-bench inbox`.
//!
//! Every shape measures the library and its plain-SQL (or raw broker) reference in the same
//! run, in a fresh schema `ibench_<pid>_<nanos>` (and a fresh stream or key prefix for the
//! brokers) removed at the end, and prints one JSON line per shape and run, then a table of
//! medians and ratios against the targets:
//!
//! * `land`: the runner (`txoutbox_core::inbox::Runner`, the sqlx store) handling deliveries of
//!   the scripted subscription, a handler writing one row of its own, against plain SQL doing
//!   `INSERT … ON CONFLICT DO NOTHING`, the handler's insert and the completion in one
//!   transaction per message on as many connections as the runner's concurrency, and against
//!   the batched plain SQL of batches.md (target 0.7 × of it): per transaction `--ref-batch`
//!   (50) messages landed by one multi-row `INSERT … ON CONFLICT DO NOTHING`, each handler's
//!   insert as a statement of its own, one completion `UPDATE`, one commit;
//! * `drain`: the processor (`txoutbox_core::inbox::Processor`) draining stored rows with
//!   handler_concurrency C, once per `rows_per_transaction` of the sweep (`--per-transaction`,
//!   default 1, 4, 16, 64; R183, R189), against two plain-SQL references on C connections: the
//!   batched one (target 0.7 ×, batches.md): per transaction fetch and lock up to
//!   `--ref-batch` (50) due rows (`FOR UPDATE SKIP LOCKED`), each handler's insert as a
//!   statement of its own, one completion `UPDATE`, one commit; and beside it the one-row one,
//!   what R152 does per row: fetch and lock one due row, the handler's insert, the completion,
//!   one commit;
//! * `duplicates`: the same deliveries again after `land`, every one a redelivery of a completed
//!   message, against the same `INSERT … ON CONFLICT DO NOTHING` alone per message on C
//!   connections (target 0.9 ×);
//! * `nats`, `redis` (see `inbox_brokers`): the runner on the broker's subscription against the
//!   raw consume with a confirmed ack per message (target 0.6 ×), and against the scripted
//!   subscription with the same message count in the same run.
//!
//! The scripted subscription is fed by a window of 4 × C messages (a broker hands out what it
//! has; pushing every message at once would time the scripted queue's scans, not the inbox).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use clap::{Args, ValueEnum};
use serde_json::{Value, json};
use sqlx::postgres::PgPool;
use sqlx::{AssertSqlSafe, Connection};
use tokio::sync::Notify;
use txoutbox_core::SystemClock;
use txoutbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use txoutbox_core::inbox::{
    BrokerMessage, DeliveryOutcome, DeliveryResult, Handler, HandlerError, HandlerOutcome,
    InboxEvent, InboxHooks, Processor, RowReport, Runner, Subscription,
};
use txoutbox_postgres::inbox::{SqlxHandlerTx, SqlxInbox, create_inbox_schema};
use txoutbox_postgres::{Layout, TableName};
use uuid::Uuid;

use crate::{BenchError, Conn};

/// The consumer group and source of every shape.
pub const GROUP: &str = "g";
pub const SOURCE: &str = "src";

/// A shape of `outbox-bench inbox`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, ValueEnum)]
pub enum InboxShape {
    /// Land and handle through the runner from the scripted subscription.
    Land,
    /// The processor draining stored rows.
    Drain,
    /// Redeliveries of completed messages.
    Duplicates,
    /// The runner on NATS JetStream (feature `nats`).
    Nats,
    /// The runner on Redis Streams (feature `redis`).
    Redis,
}

impl InboxShape {
    fn name(self) -> &'static str {
        match self {
            Self::Land => "land",
            Self::Drain => "drain",
            Self::Duplicates => "duplicates",
            Self::Nats => "nats",
            Self::Redis => "redis",
        }
    }

    fn target(self) -> f64 {
        match self {
            Self::Land | Self::Drain => 0.7,
            Self::Duplicates => 0.9,
            Self::Nats | Self::Redis => 0.6,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct InboxArgs {
    /// The shapes to run, in this order within each run (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "land,drain,duplicates"
    )]
    pub shapes: Vec<InboxShape>,
    /// Deliveries of `land` (and redeliveries of `duplicates`).
    #[arg(long, default_value_t = 10_000)]
    pub messages: usize,
    /// Stored rows `drain` drains.
    #[arg(long, default_value_t = 20_000)]
    pub rows: usize,
    /// Messages of `nats` and `redis`.
    #[arg(long, default_value_t = 20_000)]
    pub broker_messages: usize,
    /// Inbox keys (message i goes to key i mod keys).
    #[arg(long, default_value_t = 1_000)]
    pub keys: usize,
    /// The runner's concurrency, the processor's handler_concurrency and the references'
    /// connections (or acks in flight).
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// The sweep of rows per transaction (R183): `drain` runs the processor once per value as
    /// its `rows_per_transaction` (comma-separated, each 1 to 64).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    pub per_transaction: Vec<usize>,
    /// The processor's batch_size in `drain` (its fetch limit, R159; the library default is 50).
    #[arg(long, default_value_t = 50)]
    pub drain_batch: usize,
    /// Messages (rows) per transaction of the batched plain-SQL references.
    #[arg(long, default_value_t = 50)]
    pub ref_batch: usize,
    /// Repetitions; the library goes first in odd runs and the reference in even ones.
    #[arg(long, default_value_t = 1)]
    pub runs: usize,
    /// Keep sqlx's `test_before_acquire` on the library's pool: a ping, one more round trip,
    /// on every acquire (each transaction and autocommit read). Off by default, as the
    /// references hold their connections for the whole run and ping none.
    #[arg(long)]
    pub pool_ping: bool,
    #[command(flatten)]
    pub conn: Conn,
}

/// What one shape measured: the library's and the reference's rate (messages or rows per
/// second) and anything else worth printing.
#[derive(Default)]
pub struct Measured {
    pub library: f64,
    /// The reference the ratio and the target are taken against.
    pub reference: f64,
    pub extra: Value,
    /// The library's setting in a sweep (`rows_per_transaction=16`), empty outside one.
    pub label: String,
    /// The one-message-per-transaction reference of the same run, where the target's
    /// reference is the batched one.
    pub reference_one: Option<f64>,
}

fn db(during: &'static str) -> impl Fn(sqlx::Error) -> BenchError {
    move |e| BenchError(format!("PostgreSQL error during {during}: {e}"))
}

/// A fresh schema with two inbox tables (`lib` for the library, `ref` for the reference) and
/// an effect table for each; dropped by [`Bed::drop`].
pub struct Bed {
    pub pool: PgPool,
    pub schema: String,
    pub lib: TableName,
    pub reference: TableName,
}

pub fn run_tag(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{prefix}_{}_{nanos}", std::process::id())
}

impl Bed {
    pub async fn create(conn: &Conn, pool_size: u32) -> Result<Self, BenchError> {
        let pool = crate::db::pool(&conn.database_url, pool_size).await?;
        let schema = run_tag("ibench");
        let table = |t: &str| {
            TableName::new(&format!("{schema}.{t}"))
                .map_err(|e| BenchError(format!("table name: {e}")))
        };
        let bed = Self {
            lib: table("lib")?,
            reference: table("ref")?,
            schema: schema.clone(),
            pool,
        };
        for t in [&bed.lib, &bed.reference] {
            create_inbox_schema(&bed.pool, t, Layout::Plain)
                .await
                .map_err(|e| BenchError(format!("inbox schema creation: {e}")))?;
            sqlx::query(AssertSqlSafe(format!(
                "CREATE TABLE {} (id bigserial PRIMARY KEY, message_id text NOT NULL, \
                 created_at timestamptz NOT NULL DEFAULT now())",
                effects(t)
            )))
            .execute(&bed.pool)
            .await
            .map_err(db("effect table creation"))?;
        }
        Ok(bed)
    }

    /// The library's store on a pool of its own of `size` connections, pinging each connection
    /// on acquire when `ping` (sqlx's default, `--pool-ping`).
    pub async fn store(
        &self,
        conn: &Conn,
        size: u32,
        ping: bool,
    ) -> Result<(SqlxInbox, PgPool), BenchError> {
        let pool = crate::db::pool_with(&conn.database_url, size, ping).await?;
        Ok((
            SqlxInbox::sqlx(pool.clone(), &self.lib, Layout::Plain),
            pool,
        ))
    }

    pub async fn count(&self, sql: String) -> Result<i64, BenchError> {
        sqlx::query_scalar(AssertSqlSafe(sql))
            .fetch_one(&self.pool)
            .await
            .map_err(db("a count"))
    }

    /// Rows of `t` completed and effects written.
    pub async fn done(&self, t: &TableName) -> Result<(i64, i64), BenchError> {
        let completed = self
            .count(format!(
                "SELECT count(*) FROM {} WHERE status = 'completed'",
                t.qualified()
            ))
            .await?;
        let effects = self
            .count(format!("SELECT count(*) FROM {}", effects(t)))
            .await?;
        Ok((completed, effects))
    }

    /// Empties inbox table `t` and its effect table.
    pub async fn truncate(&self, t: &TableName) -> Result<(), BenchError> {
        sqlx::query(AssertSqlSafe(format!(
            "TRUNCATE {}, {}",
            t.qualified(),
            effects(t)
        )))
        .execute(&self.pool)
        .await
        .map_err(db("TRUNCATE"))?;
        Ok(())
    }

    pub async fn analyze(&self) -> Result<(), BenchError> {
        for t in [&self.lib, &self.reference] {
            for q in [t.qualified(), effects(t)] {
                sqlx::query(AssertSqlSafe(format!("ANALYZE {q}")))
                    .execute(&self.pool)
                    .await
                    .map_err(db("ANALYZE"))?;
            }
        }
        Ok(())
    }

    pub async fn drop(self) {
        let _ = sqlx::query(AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS \"{}\" CASCADE",
            self.schema
        )))
        .execute(&self.pool)
        .await;
        self.pool.close().await;
    }
}

/// The effect table beside inbox table `t`.
pub fn effects(t: &TableName) -> String {
    format!(
        "\"{}\".\"{}_effects\"",
        t.schema().unwrap_or("public"),
        t.table()
    )
}

/// The handler of every shape: one row of its own in the effect table, in the inbox's
/// transaction.
pub struct WriteOne {
    sql: String,
}

impl WriteOne {
    pub fn new(t: &TableName) -> Arc<Self> {
        Arc::new(Self {
            sql: format!("INSERT INTO {} (message_id) VALUES ($1)", effects(t)),
        })
    }
}

#[async_trait]
impl Handler<SqlxHandlerTx> for WriteOne {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut SqlxHandlerTx,
    ) -> Result<HandlerOutcome, HandlerError> {
        sqlx::query(AssertSqlSafe(self.sql.clone()))
            .bind(&row.message_id)
            .execute(&mut **tx)
            .await?;
        Ok(HandlerOutcome::completed())
    }
}

/// Counts the deliveries and rows that ended, wakes a waiter at each.
#[derive(Default)]
pub struct Ended {
    pub completed: AtomicUsize,
    pub duplicates: AtomicUsize,
    pub other: AtomicUsize,
    pub changed: Notify,
}

impl Ended {
    pub fn total(&self) -> usize {
        self.completed.load(Ordering::SeqCst)
            + self.duplicates.load(Ordering::SeqCst)
            + self.other.load(Ordering::SeqCst)
    }

    /// Waits until `n` ended, or fails after `limit`.
    pub async fn wait(&self, n: usize, limit: Duration) -> Result<(), BenchError> {
        let deadline = Instant::now() + limit;
        loop {
            let woken = self.changed.notified();
            if self.total() >= n {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(BenchError(format!(
                    "only {} of {n} ended within {limit:?} ({} completed, {} duplicates, {} other)",
                    self.total(),
                    self.completed.load(Ordering::SeqCst),
                    self.duplicates.load(Ordering::SeqCst),
                    self.other.load(Ordering::SeqCst),
                )));
            }
            let _ = tokio::time::timeout(Duration::from_millis(200), woken).await;
        }
    }

    pub fn json(&self) -> Value {
        json!({
            "completed": self.completed.load(Ordering::SeqCst),
            "duplicates": self.duplicates.load(Ordering::SeqCst),
            "other": self.other.load(Ordering::SeqCst),
        })
    }
}

impl InboxHooks for Ended {
    fn on_delivery(&self, r: &DeliveryResult) {
        let c = match (r.outcome, r.committed) {
            (DeliveryOutcome::Completed, true) => &self.completed,
            (DeliveryOutcome::Duplicate, true) => &self.duplicates,
            _ => &self.other,
        };
        c.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    fn on_persist_failure(&self, _r: &DeliveryResult) {
        self.other.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }

    fn on_row(
        &self,
        _id: Uuid,
        _event_type: Option<&str>,
        report: &RowReport,
        _d: Option<Duration>,
    ) {
        let c = match report {
            RowReport::Completed { .. } => &self.completed,
            _ => &self.other,
        };
        c.fetch_add(1, Ordering::SeqCst);
        self.changed.notify_waiters();
    }
}

/// Message i: `m{i}` on key `k{i mod keys}`, topic `src`, event type `bench`.
pub fn attrs(i: usize, keys: usize) -> (String, String) {
    (format!("m{i}"), format!("k{}", i % keys.max(1)))
}

pub fn body(i: usize) -> String {
    json!({"seq": i, "note": "inbox benchmark message"}).to_string()
}

/// A runner on `sub` over the library's store, handler [`WriteOne`], counting into `ended`.
pub fn runner(
    store: SqlxInbox,
    sub: Arc<dyn Subscription>,
    lib: &TableName,
    concurrency: usize,
    ended: Arc<Ended>,
) -> Result<Arc<Runner<SqlxInbox>>, BenchError> {
    let r = Runner::builder(store, sub, GROUP)
        .worker_id("bench")
        .handler(WriteOne::new(lib))
        .process_stored(false)
        .sources([SOURCE])
        .concurrency(concurrency)
        .hooks(ended)
        .build()
        .map_err(|e| BenchError(format!("runner: {e}")))?;
    Ok(Arc::new(r))
}

/// Runs `runner` until `n` deliveries ended; returns the seconds from start to the last.
pub async fn run_until(
    runner: Arc<Runner<SqlxInbox>>,
    ended: &Ended,
    n: usize,
) -> Result<f64, BenchError> {
    let started = Instant::now();
    runner.start();
    let r = runner.clone();
    let task = tokio::spawn(async move { r.run_until_stopped().await });
    let res = ended.wait(n, Duration::from_secs(600)).await;
    let secs = started.elapsed().as_secs_f64();
    runner.stop();
    let _ = task.await;
    res.map(|()| secs)
}

/// Land (or redeliver) `n` messages through the runner from the scripted subscription, fed by
/// a window of 4 × concurrency; returns the seconds.
async fn scripted_runner(
    store: SqlxInbox,
    lib: &TableName,
    n: usize,
    keys: usize,
    concurrency: usize,
) -> Result<(f64, Arc<Ended>), BenchError> {
    let sub = ScriptedSubscription::new(Arc::new(SystemClock));
    let ended = Arc::new(Ended::default());
    let runner = runner(
        store,
        Arc::new(sub.clone()),
        lib,
        concurrency,
        ended.clone(),
    )?;
    let window = 4 * concurrency.max(1);
    let factory = MessageFactory::new();
    let msg = |i: usize| -> BrokerMessage {
        let (id, key) = attrs(i, keys);
        factory.nats(
            &[
                ("event_id", id.as_str()),
                ("topic", SOURCE),
                ("event_type", "bench"),
                ("partition_key", key.as_str()),
            ],
            &body(i),
        )
    };
    let first = window.min(n);
    for i in 0..first {
        sub.push(msg(i));
    }
    let feeder = {
        let ended = ended.clone();
        let msgs: Vec<BrokerMessage> = (first..n).map(msg).collect();
        let sub = sub.clone();
        tokio::spawn(async move {
            for (pushed, m) in (first..).zip(msgs) {
                loop {
                    let woken = ended.changed.notified();
                    if pushed < ended.total() + window {
                        break;
                    }
                    let _ = tokio::time::timeout(Duration::from_millis(50), woken).await;
                }
                sub.push(m);
            }
        })
    };
    let secs = run_until(runner, &ended, n).await;
    feeder.abort();
    Ok((secs?, ended))
}

fn ref_land_sql(t: &TableName) -> String {
    format!(
        "INSERT INTO {} (id, event_type, payload, status, attempts_made, max_attempts, \
         scheduled_at, created_at, updated_at, message_id, consumer_group, source, partition_key) \
         VALUES ($1, 'bench', $2::text::jsonb, 'pending', 0, 10, now(), now(), now(), $3, '{GROUP}', \
         '{SOURCE}', $4) ON CONFLICT DO NOTHING RETURNING id",
        t.qualified()
    )
}

fn ref_complete_sql(t: &TableName) -> String {
    format!(
        "UPDATE {} SET status = 'completed', completed_at = now(), updated_at = now() \
         WHERE id = $1",
        t.qualified()
    )
}

fn ref_complete_many_sql(t: &TableName) -> String {
    format!(
        "UPDATE {} SET status = 'completed', completed_at = now(), updated_at = now() \
         WHERE id = ANY($1::uuid[])",
        t.qualified()
    )
}

/// Runs `work(i)` for i in 0..n on `c` connections of a pool of their own; returns the
/// seconds.
async fn on_connections<F>(conn: &Conn, c: usize, n: usize, work: F) -> Result<f64, BenchError>
where
    F: for<'a> Fn(
            &'a mut sqlx::PgConnection,
            usize,
        ) -> futures::future::BoxFuture<'a, Result<(), sqlx::Error>>
        + Send
        + Sync
        + 'static,
{
    let pool = crate::db::pool(&conn.database_url, c as u32).await?;
    let mut held = Vec::new();
    for _ in 0..c {
        held.push(pool.acquire().await.map_err(db("connecting"))?);
    }
    let next = Arc::new(AtomicUsize::new(0));
    let work = Arc::new(work);
    let started = Instant::now();
    let tasks: Vec<_> = held
        .into_iter()
        .map(|mut cn| {
            let next = next.clone();
            let work = work.clone();
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        return Ok::<(), sqlx::Error>(());
                    }
                    work(&mut cn, i).await?;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await
            .map_err(|e| BenchError(format!("reference task: {e}")))?
            .map_err(db("the reference"))?;
    }
    let secs = started.elapsed().as_secs_f64();
    pool.close().await;
    Ok(secs)
}

/// The reference of `land`: per message one transaction with the landing, the handler's
/// insert and the completion.
async fn reference_land(
    bed: &Bed,
    conn: &Conn,
    n: usize,
    keys: usize,
    c: usize,
) -> Result<f64, BenchError> {
    let land = Arc::new(ref_land_sql(&bed.reference));
    let effect = Arc::new(format!(
        "INSERT INTO {} (message_id) VALUES ($1)",
        effects(&bed.reference)
    ));
    let complete = Arc::new(ref_complete_sql(&bed.reference));
    on_connections(conn, c, n, move |cn, i| {
        let (land, effect, complete) = (land.clone(), effect.clone(), complete.clone());
        Box::pin(async move {
            let (id, key) = attrs(i, keys);
            let mut tx = cn.begin().await?;
            let row: Option<Uuid> = sqlx::query_scalar(AssertSqlSafe(land.to_string()))
                .bind(Uuid::now_v7())
                .bind(body(i))
                .bind(&id)
                .bind(&key)
                .fetch_optional(&mut *tx)
                .await?;
            if let Some(row) = row {
                sqlx::query(AssertSqlSafe(effect.to_string()))
                    .bind(&id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(AssertSqlSafe(complete.to_string()))
                    .bind(row)
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await
        })
    })
    .await
}

/// The batched reference of `land` (batches.md): per transaction `batch` messages landed by
/// one multi-row `INSERT … ON CONFLICT DO NOTHING`, each handler's insert as a statement of its
/// own, one completion `UPDATE` of the rows it inserted, one commit; on `c` connections.
async fn reference_land_batched(
    bed: &Bed,
    conn: &Conn,
    n: usize,
    keys: usize,
    c: usize,
    batch: usize,
) -> Result<f64, BenchError> {
    let t = &bed.reference;
    let land = Arc::new(format!(
        "INSERT INTO {} (id, event_type, payload, status, attempts_made, max_attempts, \
         scheduled_at, created_at, updated_at, message_id, consumer_group, source, partition_key) \
         SELECT u.id, 'bench', u.p::jsonb, 'pending', 0, 10, now(), now(), now(), u.m, '{GROUP}', \
                '{SOURCE}', u.k \
           FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[]) \
                WITH ORDINALITY AS u(id, p, m, k, o) ORDER BY u.o \
         ON CONFLICT DO NOTHING RETURNING id, message_id",
        t.qualified()
    ));
    let effect = Arc::new(format!(
        "INSERT INTO {} (message_id) VALUES ($1)",
        effects(t)
    ));
    let complete = Arc::new(ref_complete_many_sql(t));
    let batch = batch.max(1);
    on_connections(conn, c, n.div_ceil(batch), move |cn, j| {
        let (land, effect, complete) = (land.clone(), effect.clone(), complete.clone());
        Box::pin(async move {
            let (mut ids, mut bodies, mut mids, mut ks) = (vec![], vec![], vec![], vec![]);
            for i in j * batch..((j + 1) * batch).min(n) {
                let (id, key) = attrs(i, keys);
                ids.push(Uuid::now_v7());
                bodies.push(body(i));
                mids.push(id);
                ks.push(key);
            }
            let mut tx = cn.begin().await?;
            let rows: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(land.to_string()))
                .bind(&ids)
                .bind(&bodies)
                .bind(&mids)
                .bind(&ks)
                .fetch_all(&mut *tx)
                .await?;
            for (_, message_id) in &rows {
                sqlx::query(AssertSqlSafe(effect.to_string()))
                    .bind(message_id)
                    .execute(&mut *tx)
                    .await?;
            }
            let done: Vec<Uuid> = rows.into_iter().map(|(id, _)| id).collect();
            sqlx::query(AssertSqlSafe(complete.to_string()))
                .bind(&done)
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        })
    })
    .await
}

/// The reference of `duplicates`: the same `INSERT … ON CONFLICT DO NOTHING` alone per message.
async fn reference_duplicates(
    bed: &Bed,
    conn: &Conn,
    n: usize,
    keys: usize,
    c: usize,
) -> Result<(f64, usize), BenchError> {
    let land = Arc::new(ref_land_sql(&bed.reference));
    let inserted = Arc::new(AtomicUsize::new(0));
    let ins = inserted.clone();
    let secs = on_connections(conn, c, n, move |cn, i| {
        let (land, ins) = (land.clone(), ins.clone());
        Box::pin(async move {
            let (id, key) = attrs(i, keys);
            let row: Option<Uuid> = sqlx::query_scalar(AssertSqlSafe(land.to_string()))
                .bind(Uuid::now_v7())
                .bind(body(i))
                .bind(&id)
                .bind(&key)
                .fetch_optional(&mut *cn)
                .await?;
            if row.is_some() {
                ins.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        })
    })
    .await?;
    Ok((secs, inserted.load(Ordering::SeqCst)))
}

/// `land` and (when `with_duplicates`) `duplicates`, on one bed.
async fn land_and_duplicates(
    a: &InboxArgs,
    lib_first: bool,
    with_land: bool,
    with_duplicates: bool,
) -> Result<Vec<(InboxShape, Measured)>, BenchError> {
    let c = a.concurrency;
    let bed = Bed::create(&a.conn, 2).await?;
    let res = async {
        let mut out = Vec::new();
        let (store, store_pool) = bed.store(&a.conn, (c + 4) as u32, a.pool_ping).await?;
        let (lib_secs, ref_secs, ended) = if lib_first {
            let (l, e) = scripted_runner(store.clone(), &bed.lib, a.messages, a.keys, c).await?;
            let r = reference_land(&bed, &a.conn, a.messages, a.keys, c).await?;
            (l, r, e)
        } else {
            let r = reference_land(&bed, &a.conn, a.messages, a.keys, c).await?;
            let (l, e) = scripted_runner(store.clone(), &bed.lib, a.messages, a.keys, c).await?;
            (l, r, e)
        };
        let lib_done = bed.done(&bed.lib).await?;
        let ref_done = bed.done(&bed.reference).await?;
        check(a.messages, lib_done, "land (library)")?;
        check(a.messages, ref_done, "land (reference)")?;
        if with_land {
            // The batched reference on the same table after the one above: the rows it lands
            // are new (their message ids follow the first run's), so the table's size matches
            // what the duplicates below see.
            bed.truncate(&bed.reference).await?;
            let batched_secs =
                reference_land_batched(&bed, &a.conn, a.messages, a.keys, c, a.ref_batch).await?;
            check(
                a.messages,
                bed.done(&bed.reference).await?,
                "land (batched reference)",
            )?;
            out.push((
                InboxShape::Land,
                Measured {
                    library: a.messages as f64 / lib_secs,
                    reference: a.messages as f64 / batched_secs,
                    reference_one: Some(a.messages as f64 / ref_secs),
                    extra: json!({"messages": a.messages, "keys": a.keys, "concurrency": c,
                        "library_s": lib_secs, "reference_s": batched_secs,
                        "reference_one_s": ref_secs, "ref_batch": a.ref_batch,
                        "ended": ended.json()}),
                    label: String::new(),
                },
            ));
        }
        if with_duplicates {
            bed.analyze().await?;
            let run_lib = || scripted_runner(store.clone(), &bed.lib, a.messages, a.keys, c);
            let ((lib_secs, ended), (ref_secs, inserted)) = if lib_first {
                let l = run_lib().await?;
                (
                    l,
                    reference_duplicates(&bed, &a.conn, a.messages, a.keys, c).await?,
                )
            } else {
                let r = reference_duplicates(&bed, &a.conn, a.messages, a.keys, c).await?;
                (run_lib().await?, r)
            };
            if ended.duplicates.load(Ordering::SeqCst) != a.messages || inserted != 0 {
                return Err(BenchError(format!(
                    "duplicates: expected {} duplicates and no insert, got {} and {inserted}",
                    a.messages,
                    ended.json()
                )));
            }
            check(
                a.messages,
                bed.done(&bed.lib).await?,
                "duplicates (library)",
            )?;
            out.push((
                InboxShape::Duplicates,
                Measured {
                    library: a.messages as f64 / lib_secs,
                    reference: a.messages as f64 / ref_secs,
                    extra: json!({"messages": a.messages, "keys": a.keys, "concurrency": c,
                        "library_s": lib_secs, "reference_s": ref_secs}),
                    ..Measured::default()
                },
            ));
        }
        store_pool.close().await;
        Ok(out)
    }
    .await;
    bed.drop().await;
    res
}

/// Fails unless `n` rows completed with `n` effects.
pub fn check(n: usize, (completed, effects): (i64, i64), what: &str) -> Result<(), BenchError> {
    if completed != n as i64 || effects != n as i64 {
        return Err(BenchError(format!(
            "{what}: expected {n} completed rows and effects, found {completed} and {effects}"
        )));
    }
    Ok(())
}

/// Stores `rows` pending due rows over `keys` keys in `t` (created_at grows with i).
async fn preload(bed: &Bed, t: &TableName, rows: usize, keys: usize) -> Result<(), BenchError> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {} (id, event_type, payload, status, attempts_made, max_attempts, \
         scheduled_at, created_at, updated_at, message_id, consumer_group, source, partition_key) \
         SELECT gen_random_uuid(), 'bench', jsonb_build_object('seq', i), 'pending', 0, 10, \
                ts, ts, ts, 'm' || i, '{GROUP}', '{SOURCE}', 'k' || (i % $2) \
           FROM generate_series(0, $1 - 1) AS i, \
                LATERAL (SELECT now() - interval '1 hour' + i * interval '1 microsecond' AS ts) AS c",
        t.qualified()
    )))
    .bind(rows as i64)
    .bind(keys.max(1) as i64)
    .execute(&bed.pool)
    .await
    .map_err(db("the preload"))?;
    Ok(())
}

async fn drain_library(
    bed: &Bed,
    a: &InboxArgs,
    rows_per_transaction: usize,
) -> Result<(f64, Value), BenchError> {
    let c = a.concurrency;
    let (store, pool) = bed.store(&a.conn, (c + 4) as u32, a.pool_ping).await?;
    let ended = Arc::new(Ended::default());
    let p = Processor::builder(store, GROUP, WriteOne::new(&bed.lib))
        .worker_id("bench")
        .handler_concurrency(c)
        .rows_per_transaction(rows_per_transaction)
        .batch_size(a.drain_batch)
        .hooks(ended.clone())
        .build()
        .map_err(|e| BenchError(format!("processor: {e}")))?;
    let p = Arc::new(p);
    let stop = txoutbox_core::CancellationToken::new();
    let started = Instant::now();
    let task = {
        let (p, stop) = (p.clone(), stop.clone());
        tokio::spawn(async move { p.run(stop).await })
    };
    let res = ended.wait(a.rows, Duration::from_secs(600)).await;
    let secs = started.elapsed().as_secs_f64();
    stop.cancel();
    let _ = task.await;
    pool.close().await;
    res?;
    Ok((secs, ended.json()))
}

/// The reference of `drain`: per row on C connections, one transaction that fetches and locks
/// one due row, writes the handler's row and completes it.
async fn drain_reference(bed: &Bed, a: &InboxArgs) -> Result<f64, BenchError> {
    let t = &bed.reference;
    let fetch = Arc::new(format!(
        "SELECT id, message_id FROM {} WHERE consumer_group = '{GROUP}' AND status = 'pending' \
         AND scheduled_at <= now() ORDER BY scheduled_at LIMIT 1 FOR UPDATE SKIP LOCKED",
        t.qualified()
    ));
    let effect = Arc::new(format!(
        "INSERT INTO {} (message_id) VALUES ($1)",
        effects(t)
    ));
    let complete = Arc::new(ref_complete_sql(t));
    // One work item per row; a worker that finds no row ends its item (all rows are due).
    on_connections(&a.conn, a.concurrency, a.rows, move |cn, _| {
        let (fetch, effect, complete) = (fetch.clone(), effect.clone(), complete.clone());
        Box::pin(async move {
            loop {
                let mut tx = cn.begin().await?;
                let row: Option<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(fetch.to_string()))
                    .fetch_optional(&mut *tx)
                    .await?;
                let Some((id, message_id)) = row else {
                    // Every other row is locked by another worker: try again.
                    tx.commit().await?;
                    tokio::task::yield_now().await;
                    continue;
                };
                sqlx::query(AssertSqlSafe(effect.to_string()))
                    .bind(&message_id)
                    .execute(&mut *tx)
                    .await?;
                sqlx::query(AssertSqlSafe(complete.to_string()))
                    .bind(id)
                    .execute(&mut *tx)
                    .await?;
                return tx.commit().await;
            }
        })
    })
    .await
}

/// The batched reference of `drain` (batches.md): on C connections, each transaction fetches
/// and locks up to `batch` due rows (`FOR UPDATE SKIP LOCKED`), writes each handler's row as a
/// statement of its own, completes them in one `UPDATE` and commits; a connection stops at a
/// fetch that finds nothing (every row left is locked by another connection, which finishes
/// it).
async fn drain_reference_batched(bed: &Bed, a: &InboxArgs) -> Result<f64, BenchError> {
    let t = &bed.reference;
    let fetch = Arc::new(format!(
        "SELECT id, message_id FROM {} WHERE consumer_group = '{GROUP}' AND status = 'pending' \
         AND scheduled_at <= now() ORDER BY scheduled_at LIMIT $1 FOR UPDATE SKIP LOCKED",
        t.qualified()
    ));
    let effect = Arc::new(format!(
        "INSERT INTO {} (message_id) VALUES ($1)",
        effects(t)
    ));
    let complete = Arc::new(ref_complete_many_sql(t));
    let batch = a.ref_batch.max(1) as i64;
    on_connections(&a.conn, a.concurrency, a.concurrency, move |cn, _| {
        let (fetch, effect, complete) = (fetch.clone(), effect.clone(), complete.clone());
        Box::pin(async move {
            loop {
                let mut tx = cn.begin().await?;
                let rows: Vec<(Uuid, String)> = sqlx::query_as(AssertSqlSafe(fetch.to_string()))
                    .bind(batch)
                    .fetch_all(&mut *tx)
                    .await?;
                if rows.is_empty() {
                    return tx.commit().await;
                }
                for (_, message_id) in &rows {
                    sqlx::query(AssertSqlSafe(effect.to_string()))
                        .bind(message_id)
                        .execute(&mut *tx)
                        .await?;
                }
                let ids: Vec<Uuid> = rows.into_iter().map(|(id, _)| id).collect();
                sqlx::query(AssertSqlSafe(complete.to_string()))
                    .bind(&ids)
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }
        })
    })
    .await
}

/// Empties `t`, stores `rows` due rows in it and vacuums it: every drain starts alike.
async fn fresh(bed: &Bed, t: &TableName, a: &InboxArgs) -> Result<(), BenchError> {
    bed.truncate(t).await?;
    preload(bed, t, a.rows, a.keys).await?;
    sqlx::query(AssertSqlSafe(format!("VACUUM ANALYZE {}", t.qualified())))
        .execute(&bed.pool)
        .await
        .map_err(db("VACUUM ANALYZE"))?;
    Ok(())
}

/// `drain`: both references, then the processor once per `rows_per_transaction` of the sweep
/// (the references last in even runs); one [`Measured`] per setting, each against the batched
/// reference with the one-row reference beside it.
async fn drain(a: &InboxArgs, lib_first: bool) -> Result<Vec<Measured>, BenchError> {
    let bed = Bed::create(&a.conn, 2).await?;
    let res = async {
        let references = async {
            fresh(&bed, &bed.reference, a).await?;
            let one = drain_reference(&bed, a).await?;
            check(a.rows, bed.done(&bed.reference).await?, "drain (reference)")?;
            fresh(&bed, &bed.reference, a).await?;
            let batched = drain_reference_batched(&bed, a).await?;
            check(
                a.rows,
                bed.done(&bed.reference).await?,
                "drain (batched reference)",
            )?;
            Ok::<_, BenchError>((one, batched))
        };
        let library = async {
            let mut out = Vec::new();
            for &n in &a.per_transaction {
                fresh(&bed, &bed.lib, a).await?;
                let (secs, ended) = drain_library(&bed, a, n).await?;
                check(a.rows, bed.done(&bed.lib).await?, "drain (library)")?;
                out.push((n, secs, ended));
            }
            Ok::<_, BenchError>(out)
        };
        let (lib, (one, batched)) = if lib_first {
            let l = library.await?;
            (l, references.await?)
        } else {
            let r = references.await?;
            (library.await?, r)
        };
        Ok(lib
            .into_iter()
            .map(|(n, secs, ended)| Measured {
                library: a.rows as f64 / secs,
                reference: a.rows as f64 / batched,
                reference_one: Some(a.rows as f64 / one),
                label: format!("rows_per_transaction={n}"),
                extra: json!({"rows": a.rows, "keys": a.keys,
                    "handler_concurrency": a.concurrency, "rows_per_transaction": n,
                    "batch_size": a.drain_batch,
                    "ref_batch": a.ref_batch, "library_s": secs, "reference_s": batched,
                    "reference_one_s": one, "ended": ended}),
            })
            .collect())
    }
    .await;
    bed.drop().await;
    res
}

/// The scripted runner alone on `n` messages (for the broker shapes' second comparison);
/// returns messages per second.
#[cfg(any(feature = "nats", feature = "redis"))]
pub async fn scripted_rate(a: &InboxArgs, n: usize) -> Result<f64, BenchError> {
    let bed = Bed::create(&a.conn, 2).await?;
    let res = async {
        let (store, pool) = bed
            .store(&a.conn, (a.concurrency + 4) as u32, a.pool_ping)
            .await?;
        let (secs, _) = scripted_runner(store, &bed.lib, n, a.keys, a.concurrency).await?;
        pool.close().await;
        check(n, bed.done(&bed.lib).await?, "scripted runner")?;
        Ok(n as f64 / secs)
    }
    .await;
    bed.drop().await;
    res
}

pub async fn inbox(a: InboxArgs) -> Result<(), BenchError> {
    if let Some(bad) = a.per_transaction.iter().find(|n| !(1..=64).contains(*n)) {
        return Err(BenchError(format!(
            "--per-transaction: {bad} is not between 1 and 64 (R183)"
        )));
    }
    type Rates = (f64, f64, Option<f64>);
    let mut results: BTreeMap<(InboxShape, String), Vec<Rates>> = BTreeMap::new();
    let mut scripted_vs: BTreeMap<InboxShape, Vec<f64>> = BTreeMap::new();
    let mut shapes = a.shapes.clone();
    shapes.dedup();
    for run in 0..a.runs.max(1) {
        let lib_first = run % 2 == 0;
        let mut measured: Vec<(InboxShape, Measured)> = Vec::new();
        let land = shapes.contains(&InboxShape::Land);
        let dups = shapes.contains(&InboxShape::Duplicates);
        for s in &shapes {
            match s {
                InboxShape::Land | InboxShape::Duplicates => {
                    // Both come from one bed: duplicates redeliver what land completed.
                    if *s == InboxShape::Land || !land {
                        measured.extend(land_and_duplicates(&a, lib_first, land, dups).await?);
                    }
                }
                InboxShape::Drain => {
                    measured.extend(drain(&a, lib_first).await?.into_iter().map(|m| (*s, m)));
                }
                InboxShape::Nats | InboxShape::Redis => {
                    let m = crate::inbox_brokers::measure(*s, &a, lib_first).await?;
                    measured.push((*s, m));
                }
            }
        }
        for (s, m) in measured {
            let ratio = m.library / m.reference;
            let mut line = json!({
                "shape": s.name(), "setting": m.label, "run": run + 1, "library_first": lib_first,
                "library_per_s": m.library.round(), "reference_per_s": m.reference.round(),
                "reference_one_per_s": m.reference_one.map(f64::round),
                "ratio": (ratio * 1000.0).round() / 1000.0, "target": s.target(),
                "load": crate::suite::load_avg(), "pool_ping": a.pool_ping,
            });
            if let (Some(o), Value::Object(e)) = (line.as_object_mut(), m.extra) {
                if let Some(v) = e.get("scripted_per_s").and_then(Value::as_f64) {
                    scripted_vs.entry(s).or_default().push(m.library / v);
                }
                o.extend(e);
            }
            println!("{line}");
            results.entry((s, m.label)).or_default().push((
                m.library,
                m.reference,
                m.reference_one,
            ));
        }
    }
    eprintln!();
    eprintln!(
        "{:<36} {:>4} {:>10} {:>12} {:>7} {:>7} {:>12} {:>7} {:>11}",
        "shape",
        "runs",
        "library/s",
        "reference/s",
        "ratio",
        "target",
        "1-per-tx/s",
        "vs 1",
        "vs scripted"
    );
    for ((s, label), v) in &results {
        let med = |f: &dyn Fn(&Rates) -> f64| {
            crate::suite::median(v.iter().map(f).collect()).unwrap_or(f64::NAN)
        };
        let ratio = med(&|x| x.0 / x.1);
        let one = med(&|x| x.2.unwrap_or(f64::NAN));
        let vs_one = med(&|x| x.2.map_or(f64::NAN, |o| x.0 / o));
        let s = *s;
        let vs = scripted_vs
            .get(&s)
            .and_then(|v| crate::suite::median(v.clone()))
            .map(|r| format!("{r:.2}"))
            .unwrap_or_else(|| "-".into());
        let name = if label.is_empty() {
            s.name().to_owned()
        } else {
            format!("{} {label}", s.name())
        };
        eprintln!(
            "{:<36} {:>4} {:>10.0} {:>12.0} {:>7.2} {:>7.2} {:>12.0} {:>7.2} {:>11}  {}",
            name,
            v.len(),
            med(&|x| x.0),
            med(&|x| x.1),
            ratio,
            s.target(),
            one,
            vs_one,
            vs,
            if ratio >= s.target() {
                "met"
            } else {
                "NOT met"
            }
        );
    }
    eprintln!(
        "(medians of the runs; ratio = median of library / reference per run, both measured in the same run; \
         reference = the batched plain SQL where a 1-per-tx reference is shown beside it)"
    );
    Ok(())
}
