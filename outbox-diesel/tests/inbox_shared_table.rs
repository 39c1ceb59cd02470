//! Z-07: the two Postgres backends share an inbox table (R172): rows landed through
//! outbox-postgres (sqlx) are run by outbox-diesel's processor and the reverse, and a message
//! one backend completed is a duplicate for the other's runner; G-02 (one message delivered to
//! two runners at once) and G-07 (two processors keep key order) run with one party on each
//! backend, each way round, on the plain and the partitioned table.

use txoutbox_testkit::diesel as common;

use std::sync::Arc;

use async_trait::async_trait;
use diesel::sql_types::{BigInt, Nullable, Text};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde_json::json;
use txoutbox_conformance::inbox::InboxHarness;
use txoutbox_core::CancellationToken;
use txoutbox_core::clock::{Clock, ManualClock};
use txoutbox_core::inbox::repository::{InboxBackend, InboxTransaction};
use txoutbox_core::inbox::scripted::{MessageFactory, ScriptedSubscription};
use txoutbox_core::inbox::{
    DeliveryOutcome, Handler, HandlerError, HandlerOutcome, InboxEvent, NewInboxEvent, OnFailure,
    Processor, RowReport, Runner,
};
use txoutbox_diesel::Layout;
use txoutbox_diesel::inbox::diesel_inbox;
use txoutbox_postgres::inbox::SqlxHandlerTx;
use txoutbox_postgres::sqlx;
use txoutbox_testkit::database_url;
use txoutbox_testkit::inbox::{PgInboxHarness, effects, trial_table};

use common::{patient_pool, url_in_new_york};

struct DieselEffect(String);

#[async_trait]
impl Handler<AsyncPgConnection> for DieselEffect {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut AsyncPgConnection,
    ) -> Result<HandlerOutcome, HandlerError> {
        diesel::sql_query(effects::insert(&self.0))
            .bind::<Text, _>(&row.message_id)
            .bind::<Nullable<Text>, _>(row.partition_key.as_deref())
            .bind::<BigInt, _>(0)
            .execute(tx)
            .await
            .map_err(HandlerError::new)?;
        Ok(HandlerOutcome::completed())
    }
}

struct SqlxEffect(String);

#[async_trait]
impl Handler<SqlxHandlerTx> for SqlxEffect {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut SqlxHandlerTx,
    ) -> Result<HandlerOutcome, HandlerError> {
        sqlx::query(sqlx::AssertSqlSafe(effects::insert(&self.0)))
            .bind(&row.message_id)
            .bind(row.partition_key.as_deref())
            .bind(0_i64)
            .execute(&mut **tx)
            .await
            .map_err(HandlerError::new)?;
        Ok(HandlerOutcome::completed())
    }
}

fn ev(id: &str) -> NewInboxEvent {
    NewInboxEvent::builder()
        .message_id(id)
        .consumer_group("g")
        .source("src")
        .event_type("e")
        .partition_key("k")
        .payload_json(json!({"n": 1}))
        .build()
        .expect("valid")
}

async fn land<B: InboxBackend>(b: &B, id: &str) -> InboxEvent {
    let mut tx = b.begin().await.unwrap();
    let l = tx.land(vec![ev(id)]).await.unwrap();
    tx.commit().await.unwrap();
    l[0].row.clone()
}

async fn effects_of(h: &PgInboxHarness) -> Vec<String> {
    sqlx::query_scalar::<_, String>(sqlx::AssertSqlSafe(effects::select(h.schema())))
        .fetch_all(h.pool())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_07() {
    for layout in [Layout::Plain, Layout::Partitioned] {
        let h = PgInboxHarness::create(layout).await;
        let table = trial_table(h.schema(), layout);
        let sqlx_inbox =
            txoutbox_postgres::inbox::SqlxInbox::sqlx(h.pool().clone(), &table, layout);
        let diesel = diesel_inbox(
            patient_pool(&url_in_new_york(&database_url()), 4),
            &table,
            layout,
        );
        let schema = h.schema().to_owned();
        // Landed with sqlx, run by diesel's processor.
        let m1 = land(&sqlx_inbox, "m1").await;
        let m2 = land(&sqlx_inbox, "m2").await;
        let dp = Processor::builder(diesel.clone(), "g", Arc::new(DieselEffect(schema.clone())))
            .worker_id("p-diesel")
            .build()
            .unwrap();
        let rep = dp.cycle(&CancellationToken::new()).await.unwrap();
        assert_eq!(
            rep.of(m1.id),
            Some(&RowReport::Completed { status: None }),
            "{layout:?}"
        );
        // One key: m2 runs after m1 in the same cycle (max_per_key 16).
        assert_eq!(
            rep.of(m2.id),
            Some(&RowReport::Completed { status: None }),
            "{layout:?}"
        );
        // Landed with diesel, run by the sqlx processor.
        let m3 = land(&diesel, "m3").await;
        let sp = Processor::builder(
            sqlx_inbox.clone(),
            "g",
            Arc::new(SqlxEffect(schema.clone())),
        )
        .worker_id("p-sqlx")
        .build()
        .unwrap();
        let rep = sp.cycle(&CancellationToken::new()).await.unwrap();
        assert_eq!(
            rep.of(m3.id),
            Some(&RowReport::Completed { status: None }),
            "{layout:?}"
        );
        assert_eq!(effects_of(&h).await, vec!["m1", "m2", "m3"], "{layout:?}");
        // A message diesel completed is a duplicate for the sqlx runner, and the reverse.
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::starting_now());
        let msgs = MessageFactory::new();
        let sub = ScriptedSubscription::new(clock);
        for id in ["m1", "m3"] {
            sub.push(msgs.nats(
                &[
                    ("event_id", id),
                    ("topic", "src"),
                    ("event_type", "e"),
                    ("partition_key", "k"),
                ],
                "{\"n\": 1}",
            ));
        }
        let sr = Runner::builder(sqlx_inbox.clone(), Arc::new(sub.clone()), "g")
            .handler(Arc::new(SqlxEffect(schema.clone())))
            .worker_id("r-sqlx")
            .messages_per_transaction(1)
            .concurrency(1)
            .process_stored(false)
            .build()
            .unwrap();
        let r = sr.handle_next().await.unwrap().unwrap();
        assert_eq!((r.outcome, r.committed), (DeliveryOutcome::Duplicate, true));
        let dr = Runner::builder(diesel.clone(), Arc::new(sub.clone()), "g")
            .handler(Arc::new(DieselEffect(schema.clone())))
            .worker_id("r-diesel")
            .messages_per_transaction(1)
            .concurrency(1)
            .process_stored(false)
            .build()
            .unwrap();
        let r = dr.handle_next().await.unwrap().unwrap();
        assert_eq!((r.outcome, r.committed), (DeliveryOutcome::Duplicate, true));
        assert_eq!(effects_of(&h).await, vec!["m1", "m2", "m3"], "{layout:?}");
    }
}

// ---- Z-07's "run G-02 and G-07 with one party on each backend" ----

/// What a party's handler does on one run of a message (the `Act`s of G-02): `write` once the
/// message's script runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Writes the effect, returns completed.
    Write,
    /// Writes the effect, waits at the gate, returns completed (`gate`).
    Gate,
    /// Writes the effect, waits at the gate, returns the error `boom` (`gate_fail("boom")`).
    GateFail,
}

/// The scripts and the gate both parties' handlers share, and the runs they made.
struct Script {
    steps: std::sync::Mutex<std::collections::HashMap<String, Vec<Step>>>,
    runs: std::sync::Mutex<Vec<String>>,
    open: tokio::sync::watch::Sender<bool>,
    arrived: tokio::sync::watch::Sender<u32>,
}

impl Script {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            steps: Default::default(),
            runs: Default::default(),
            open: tokio::sync::watch::channel(false).0,
            arrived: tokio::sync::watch::channel(0).0,
        })
    }
    fn script(&self, id: &str, steps: Vec<Step>) {
        self.steps.lock().unwrap().insert(id.to_owned(), steps);
    }
    /// The step of this run, recorded.
    fn next(&self, id: &str) -> Step {
        self.runs.lock().unwrap().push(id.to_owned());
        let mut s = self.steps.lock().unwrap();
        match s.get_mut(id) {
            Some(v) if !v.is_empty() => v.remove(0),
            _ => Step::Write,
        }
    }
    fn runs_of(&self, id: &str) -> usize {
        self.runs
            .lock()
            .unwrap()
            .iter()
            .filter(|r| *r == id)
            .count()
    }
    async fn reached(&self, n: u32) {
        let _ = self.arrived.subscribe().wait_for(|a| *a >= n).await;
    }
    fn open_gate(&self) {
        self.open.send_replace(true);
    }
    /// The step's end, after the effect was written.
    async fn finish(&self, step: Step) -> Result<HandlerOutcome, HandlerError> {
        if step != Step::Write {
            self.arrived.send_modify(|a| *a += 1);
            let _ = self.open.subscribe().wait_for(|o| *o).await;
        }
        match step {
            Step::GateFail => Err(HandlerError::new("boom")),
            _ => Ok(HandlerOutcome::completed()),
        }
    }
}

/// The diesel party's scripted handler.
struct DieselParty(String, Arc<Script>);

#[async_trait]
impl Handler<AsyncPgConnection> for DieselParty {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut AsyncPgConnection,
    ) -> Result<HandlerOutcome, HandlerError> {
        let step = self.1.next(&row.message_id);
        DieselEffect(self.0.clone()).handle(row, tx).await?;
        self.1.finish(step).await
    }
}

/// The sqlx party's scripted handler.
struct SqlxParty(String, Arc<Script>);

#[async_trait]
impl Handler<SqlxHandlerTx> for SqlxParty {
    async fn handle(
        &self,
        row: &InboxEvent,
        tx: &mut SqlxHandlerTx,
    ) -> Result<HandlerOutcome, HandlerError> {
        let step = self.1.next(&row.message_id);
        SqlxEffect(self.0.clone()).handle(row, tx).await?;
        self.1.finish(step).await
    }
}

/// One runner of group g as the suite builds it (`Ictx::runner`): sources {src}, concurrency
/// 1, no embedded processor.
fn party_runner<B: InboxBackend>(
    backend: B,
    sub: &ScriptedSubscription,
    handler: Arc<dyn Handler<txoutbox_core::inbox::repository::HandlerTx<B>>>,
    worker: &str,
    on_failure: OnFailure,
) -> Runner<B> {
    Runner::builder(backend, Arc::new(sub.clone()), "g")
        .handler(handler)
        .worker_id(worker)
        .messages_per_transaction(1)
        .concurrency(1)
        .process_stored(false)
        .sources(["src"])
        .on_failure(on_failure)
        .build()
        .unwrap()
}

/// The two parties of a trial: the sqlx store and the diesel store on one table, each with its
/// scripted handler (one script for both).
struct Parties {
    h: PgInboxHarness,
    sqlx: txoutbox_postgres::inbox::SqlxInbox,
    diesel: txoutbox_diesel::inbox::DieselInbox,
    script: Arc<Script>,
}

impl Parties {
    async fn new(layout: Layout) -> Self {
        let h = PgInboxHarness::create(layout).await;
        let table = trial_table(h.schema(), layout);
        Self {
            sqlx: txoutbox_postgres::inbox::SqlxInbox::sqlx(h.pool().clone(), &table, layout),
            diesel: diesel_inbox(
                patient_pool(&url_in_new_york(&database_url()), 4),
                &table,
                layout,
            ),
            h,
            script: Script::new(),
        }
    }
    fn sqlx_handler(&self) -> Arc<dyn Handler<SqlxHandlerTx>> {
        Arc::new(SqlxParty(self.h.schema().to_owned(), self.script.clone()))
    }
    fn diesel_handler(&self) -> Arc<dyn Handler<AsyncPgConnection>> {
        Arc::new(DieselParty(self.h.schema().to_owned(), self.script.clone()))
    }
}

/// G-02 with w1 and w2 given: one message delivered to two runners at once; w2's landing waits
/// for w1's transaction (R110, R119). Variant (`rewind`): w1's run is `gate_fail("boom")` under
/// on_failure rewind; w1 is rewound and stores nothing, w2 then lands m1 and completes it.
async fn g_02_across<B1: InboxBackend, B2: InboxBackend>(
    p: &Parties,
    sub: &ScriptedSubscription,
    w1: &Runner<B1>,
    w2: &Runner<B2>,
    rewind: bool,
    ctx: &str,
) {
    let msgs = MessageFactory::new();
    let i = sub.push(msgs.nats(
        &[("event_id", "m1"), ("topic", "src"), ("event_type", "e")],
        "{\"n\": 0}",
    ));
    p.script
        .script("m1", vec![if rewind { Step::GateFail } else { Step::Gate }]);
    let done2 = std::sync::atomic::AtomicBool::new(false);
    let first = async { w1.handle_next().await.unwrap().expect("w1 gets m1") };
    let second = async {
        p.script.reached(1).await;
        sub.duplicate(i);
        let r = w2.handle_next().await.unwrap().expect("w2 gets m1");
        done2.store(true, std::sync::atomic::Ordering::SeqCst);
        r
    };
    let control = async {
        p.script.reached(1).await;
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        assert!(
            !std::sync::atomic::AtomicBool::load(&done2, std::sync::atomic::Ordering::SeqCst),
            "{ctx}: w2 waits for w1's transaction (R110)"
        );
        p.script.open_gate();
    };
    let (a, b, ()) = tokio::join!(first, second, control);
    if rewind {
        assert_eq!(a.outcome, DeliveryOutcome::Rewound, "{ctx}: {a:?}");
        assert_eq!(
            (b.outcome, b.committed),
            (DeliveryOutcome::Completed, true),
            "{ctx}: {b:?}"
        );
        assert_eq!(p.script.runs_of("m1"), 2, "{ctx}");
    } else {
        assert_eq!(
            (a.outcome, a.committed),
            (DeliveryOutcome::Completed, true),
            "{ctx}: {a:?}"
        );
        assert_eq!(
            (b.outcome, b.committed),
            (DeliveryOutcome::Duplicate, true),
            "{ctx}: {b:?}"
        );
        assert_eq!(p.script.runs_of("m1"), 1, "{ctx}");
    }
    assert_eq!(effects_of(&p.h).await, vec!["m1"], "{ctx}");
}

/// Z-07 (G-02 across the backends): one message delivered to a runner on each backend at once,
/// w1 on sqlx and w2 on diesel, then the reverse; both variants of G-02, on the plain and the
/// partitioned table. The outcomes are G-02's on one backend (R110, R119, R172).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_07_g_02() {
    for layout in [Layout::Plain, Layout::Partitioned] {
        for rewind in [false, true] {
            let pol = if rewind {
                OnFailure::Rewind
            } else {
                OnFailure::Record
            };
            for sqlx_first in [true, false] {
                let p = Parties::new(layout).await;
                let sub = ScriptedSubscription::new(Arc::new(ManualClock::starting_now()));
                let on_sqlx = party_runner(
                    p.sqlx.clone(),
                    &sub,
                    p.sqlx_handler(),
                    if sqlx_first { "w1" } else { "w2" },
                    pol,
                );
                let on_diesel = party_runner(
                    p.diesel.clone(),
                    &sub,
                    p.diesel_handler(),
                    if sqlx_first { "w2" } else { "w1" },
                    pol,
                );
                let ctx = format!(
                    "Z-07 G-02 {layout:?} rewind={rewind} w1 on {}",
                    if sqlx_first { "sqlx" } else { "diesel" }
                );
                if sqlx_first {
                    g_02_across(&p, &sub, &on_sqlx, &on_diesel, rewind, &ctx).await;
                } else {
                    g_02_across(&p, &sub, &on_diesel, &on_sqlx, rewind, &ctx).await;
                }
            }
        }
    }
}

/// A row of group g, source src, on `key` (the suite's "landed id on key").
fn ev_on(id: &str, key: &str) -> NewInboxEvent {
    NewInboxEvent::builder()
        .message_id(id)
        .consumer_group("g")
        .source("src")
        .event_type("e")
        .partition_key(key)
        .payload_json(json!({"key": key}))
        .build()
        .expect("valid")
}

async fn land_on<B: InboxBackend>(b: &B, id: &str, key: &str) -> InboxEvent {
    let mut tx = b.begin().await.unwrap();
    let l = tx.land(vec![ev_on(id, key)]).await.unwrap();
    tx.commit().await.unwrap();
    l[0].row.clone()
}

/// G-07 with W1 (a fetch_and_lock that keeps its row) on one backend and W2 (a processor) on
/// the other: landed a1, a2 on k, then b1 on o; W2's first cycle runs only b1, its second (299
/// s later) nothing, its third (2 s later) a1 only, its fourth a2 (R149, R150).
async fn g_07_across<B1: InboxBackend, B2: InboxBackend>(
    p: &Parties,
    w1: &B1,
    b2: &B2,
    w2: Processor<B2>,
    ctx: &str,
) {
    let a1 = land_on(w1, "a1", "k").await;
    let a2 = land_on(b2, "a2", "k").await;
    let b1 = land_on(w1, "b1", "o").await;
    let mut req = txoutbox_core::inbox::repository::InboxFetchRequest::new(
        txoutbox_core::event::WorkerId::new("W1").unwrap(),
        txoutbox_core::inbox::ConsumerGroup::new("g").unwrap(),
        1,
    );
    req.max_per_key = 1;
    let got = w1.fetch_and_lock(&req).await.unwrap();
    assert_eq!(
        got.iter().map(|r| r.id()).collect::<Vec<_>>(),
        vec![a1.id],
        "{ctx}: W1 fetches a1"
    );
    let cycle = || async { w2.cycle(&CancellationToken::new()).await.unwrap() };
    assert_eq!(cycle().await.completed(), vec![b1.id], "{ctx}: first cycle");
    p.h.advance(std::time::Duration::from_secs(299)).await;
    let rep = cycle().await;
    assert!(rep.fetched.is_empty(), "{ctx}: second cycle: {rep:?}");
    p.h.advance(std::time::Duration::from_secs(2)).await;
    assert_eq!(cycle().await.completed(), vec![a1.id], "{ctx}: third cycle");
    assert_eq!(
        cycle().await.completed(),
        vec![a2.id],
        "{ctx}: fourth cycle"
    );
    assert_eq!(effects_of(&p.h).await, vec!["b1", "a1", "a2"], "{ctx}");
}

/// Z-07 (G-07 across the backends): W1 on sqlx and the processor W2 on diesel, then the
/// reverse, on the plain and the partitioned table. The outcomes are G-07's on one backend
/// (R149, R150, R172).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_07_g_07() {
    for layout in [Layout::Plain, Layout::Partitioned] {
        for sqlx_first in [true, false] {
            let p = Parties::new(layout).await;
            let ctx = format!(
                "Z-07 G-07 {layout:?} W1 on {}",
                if sqlx_first { "sqlx" } else { "diesel" }
            );
            if sqlx_first {
                let w2 = Processor::builder(p.diesel.clone(), "g", p.diesel_handler())
                    .worker_id("W2")
                    .batch_size(100)
                    .max_per_key(1)
                    .handler_concurrency(1)
                    .build()
                    .unwrap();
                g_07_across(&p, &p.sqlx, &p.diesel, w2, &ctx).await;
            } else {
                let w2 = Processor::builder(p.sqlx.clone(), "g", p.sqlx_handler())
                    .worker_id("W2")
                    .batch_size(100)
                    .max_per_key(1)
                    .handler_concurrency(1)
                    .build()
                    .unwrap();
                g_07_across(&p, &p.diesel, &p.sqlx, w2, &ctx).await;
            }
        }
    }
}
