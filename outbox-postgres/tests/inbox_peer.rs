//! The `[peer]` scenarios (scenarios.md section 28): omni-box 0.3.1 itself on the same inbox
//! table as this library, through `txoutbox_conformance::inbox::peer::OmniBoxPeer` (a Python
//! process running omni-box's own runner, processor and repository). `scripts/omnibox install`
//! sets the peer up; without it these trials fail with the command to run, they never skip.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use txoutbox_conformance::inbox::ctx::Ictx;
use txoutbox_conformance::inbox::peer::{OmniBoxPeer, PeerTable};
use txoutbox_conformance::inbox::script::{Act, Gate};
use txoutbox_core::event::Status;
use txoutbox_core::inbox::{DeliveryOutcome, InboxBackend, InboxTransaction, NewInboxEvent};
use txoutbox_postgres::Layout;
use txoutbox_postgres::sqlx::{self, AssertSqlSafe};
use txoutbox_testkit::inbox::{PgInboxFactory, PgInboxHarness, trial_table};

async fn peer_on(ctx: &Ictx<PgInboxHarness>, layout: Layout) -> OmniBoxPeer {
    let schema = ctx.h.schema().to_owned();
    let table = trial_table(&schema, layout);
    OmniBoxPeer::start(&PeerTable {
        database_url: txoutbox_testkit::database_url(),
        schema: schema.clone(),
        table: table.table().to_owned(),
        partitioned: layout == Layout::Partitioned,
        group: "g".into(),
        worker: "omnibox-1".into(),
        effects_insert: format!(
            "INSERT INTO \"{schema}\".inbox_effects (message_id, key, n) VALUES (:m, NULL, 0)"
        ),
    })
    .await
    .expect("omni-box 0.3.1 peer (scripts/omnibox install)")
}

/// A message as omni-box's consumer hands it over: source `src`, payload like the suite's.
fn m(id: &str) -> Value {
    json!({"message_id": id, "source": "src", "event_type": "e", "payload": {"key": null, "n": 0}})
}

async fn effects_of(ctx: &Ictx<PgInboxHarness>, id: &str) -> usize {
    ctx.effects().await.iter().filter(|e| *e == id).count()
}

async fn row_id(ctx: &Ictx<PgInboxHarness>, id: &str) -> String {
    ctx.row_of(id).await.id.to_string()
}

fn processed(reply: &Value) -> Vec<String> {
    reply["processed"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_05() {
    let ctx = Ictx::new(&PgInboxFactory::plain()).await;
    let peer = peer_on(&ctx, Layout::Plain).await;
    let ours = ctx.runner().build().expect("runner");
    let bare = ctx.bare_runner().build().expect("bare runner");
    let processor = ctx.processor().build().expect("processor");

    // (a) omni-box's runner without a handler lands m1 and m2; our processor completes both.
    for id in ["m1", "m2"] {
        let r = peer.runner(m(id), false).await.expect("peer runner");
        assert_eq!(r["committed"], json!(true), "Z-05 (a): {id} committed: {r}");
    }
    ctx.cycle(&processor).await;
    for id in ["m1", "m2"] {
        assert_eq!(
            ctx.row_of(id).await.status,
            Status::Completed,
            "Z-05 (a) {id}"
        );
        assert_eq!(
            effects_of(&ctx, id).await,
            1,
            "Z-05 (a): {id} has one effect"
        );
    }

    // (b) our runner without a handler lands m3; omni-box's processor completes it.
    ctx.deliver("m3", None);
    let r = ctx.handle(&bare).await;
    assert_eq!(r.outcome, DeliveryOutcome::Landed, "Z-05 (b): {r:?}");
    let done = peer.process(10).await.expect("peer processor");
    assert!(
        processed(&done).contains(&row_id(&ctx, "m3").await),
        "Z-05 (b): omni-box's processor completed m3: {done}"
    );
    assert_eq!(ctx.row_of("m3").await.status, Status::Completed);
    assert_eq!(effects_of(&ctx, "m3").await, 1, "Z-05 (b): one effect");

    // (c) omni-box's runner completes m4; m4 delivered to our runner is a duplicate, committed.
    let r = peer.runner(m("m4"), true).await.expect("peer runner");
    assert_eq!(
        (r["processed"].clone(), r["committed"].clone()),
        (json!(true), json!(true))
    );
    ctx.deliver("m4", None);
    let r = ctx.handle(&ours).await;
    assert_eq!(r.outcome, DeliveryOutcome::Duplicate, "Z-05 (c): {r:?}");
    assert!(r.committed, "Z-05 (c): the duplicate is committed");
    assert_eq!(effects_of(&ctx, "m4").await, 1, "Z-05 (c): one effect");

    // (d) our runner completes m5; given to omni-box's runner it is a duplicate, committed.
    ctx.deliver("m5", None);
    let r = ctx.handle(&ours).await;
    assert_eq!(r.outcome, DeliveryOutcome::Completed, "Z-05 (d): {r:?}");
    let r = peer.runner(m("m5"), true).await.expect("peer runner");
    assert_eq!(
        (r["duplicate"].clone(), r["committed"].clone()),
        (json!(true), json!(true))
    );
    assert_eq!(effects_of(&ctx, "m5").await, 1, "Z-05 (d): one effect");

    // (e) our processor holds m6 inside a gated run: omni-box's runner does not run its
    // handler, omni-box's processor does not fetch m6; open the gate: m6 completed once.
    ctx.land("m6", None).await;
    let gate = Gate::new();
    ctx.script("m6", vec![Act::Gate(gate.clone())]);
    let p6 = Arc::new(ctx.processor().build().expect("processor"));
    let cycle = tokio::spawn({
        let p6 = p6.clone();
        async move {
            p6.cycle(&txoutbox_core::CancellationToken::new())
                .await
                .expect("cycle")
        }
    });
    gate.reached(1).await;
    let peer = Arc::new(peer);
    let their_runner = tokio::spawn({
        let peer = peer.clone();
        async move { peer.runner(m("m6"), true).await }
    });
    let done = peer.process(10).await.expect("peer processor");
    assert!(
        !processed(&done).contains(&row_id(&ctx, "m6").await),
        "Z-05 (e): omni-box's processor does not fetch m6 while our run holds it: {done}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    gate.open();
    cycle.await.expect("our cycle");
    let r = their_runner.await.expect("join").expect("peer runner");
    assert_eq!(
        r["processed"],
        json!(false),
        "Z-05 (e): omni-box did not run m6: {r}"
    );
    assert_eq!(ctx.row_of("m6").await.status, Status::Completed);
    assert_eq!(
        effects_of(&ctx, "m6").await,
        1,
        "Z-05 (e): m6 completed once"
    );

    // (f) omni-box's processor fetches m7 and its handler waits; m7 delivered to our runner is
    // landed, committed, not run.
    ctx.land("m7", None).await;
    let theirs = tokio::spawn({
        let peer = peer.clone();
        async move { peer.process_gated(10, "f").await }
    });
    peer.started("f").await.expect("omni-box's handler started");
    ctx.deliver("m7", None);
    let r = ctx.handle(&ours).await;
    assert!(r.committed, "Z-05 (f): committed: {r:?}");
    assert!(
        !ctx.handler.run_ids().contains(&"m7".to_owned()),
        "Z-05 (f): our runner did not run m7"
    );
    peer.open("f").await.expect("open");
    let done = theirs.await.expect("join").expect("peer processor");
    assert!(
        processed(&done).contains(&row_id(&ctx, "m7").await),
        "{done}"
    );
    assert_eq!(
        effects_of(&ctx, "m7").await,
        1,
        "Z-05 (f): m7 once, by omni-box"
    );

    // (g) record: our runner records m8 on k as a failure and lands m9 on k behind it;
    // omni-box's processor, run before m8's retry is due, runs m9 (no key order, R146 (d)).
    ctx.script(
        "m8",
        vec![Act::Retry {
            text: "boom".into(),
            counted: true,
            at: None,
        }],
    );
    ctx.deliver("m8", Some("k"));
    ctx.deliver("m9", Some("k"));
    let r8 = ctx.handle(&ours).await;
    assert!(
        r8.committed,
        "Z-05 (g): m8's failure is recorded and committed: {r8:?}"
    );
    let r9 = ctx.handle(&ours).await;
    assert!(r9.committed, "Z-05 (g): m9 landed behind m8: {r9:?}");
    assert_eq!(ctx.row_of("m9").await.status, Status::Pending);
    let done = peer.process(10).await.expect("peer processor");
    assert!(
        processed(&done).contains(&row_id(&ctx, "m9").await),
        "Z-05 (g): omni-box's processor runs m9 ahead of m8 (R146 (d)): {done}"
    );
    assert!(!processed(&done).contains(&row_id(&ctx, "m8").await));

    // After all: no row left held, effects once per message.
    let held: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {} WHERE locked_at IS NOT NULL",
        trial_table(ctx.h.schema(), Layout::Plain).qualified()
    )))
    .fetch_one(ctx.h.pool())
    .await
    .expect("held rows");
    assert_eq!(held, 0, "Z-05: no row left held");
    let effects = ctx.effects().await;
    for id in ["m1", "m2", "m3", "m4", "m5", "m6", "m7", "m9"] {
        assert_eq!(
            effects.iter().filter(|e| *e == id).count(),
            1,
            "Z-05: {id} has one effect: {effects:?}"
        );
    }
    Arc::into_inner(peer).expect("peer").stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn z_06() {
    let ctx = Ictx::new(&PgInboxFactory::partitioned()).await;
    let peer = Arc::new(peer_on(&ctx, Layout::Partitioned).await);
    let new = |id: &str| {
        NewInboxEvent::builder()
            .message_id(id)
            .consumer_group("g")
            .source("src")
            .event_type("e")
            .payload_json(json!({"key": null, "n": 0}))
            .build()
            .expect("valid event")
    };

    // omni-box's create in an open transaction; our landing waits, then returns its row.
    let theirs = tokio::spawn({
        let peer = peer.clone();
        async move { peer.create(m("m1"), Some("z1")).await }
    });
    peer.started("z1").await.expect("omni-box created m1");
    let backend = ctx.backend();
    let ours = tokio::spawn(async move {
        let mut tx = backend.begin().await.expect("begin");
        let started = tokio::time::Instant::now();
        let landed = tx.land(vec![new("m1")]).await.expect("land");
        tx.commit().await.expect("commit");
        (landed, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !ours.is_finished(),
        "Z-06: our landing waits for omni-box's transaction"
    );
    peer.open("z1").await.expect("open");
    let created = theirs.await.expect("join").expect("peer create");
    let (landed, waited) = ours.await.expect("join");
    assert!(!landed[0].inserted, "Z-06: ours found omni-box's row");
    assert_eq!(
        landed[0].row.id.to_string(),
        created["row_id"].as_str().unwrap_or("")
    );
    assert!(
        waited >= Duration::from_millis(150),
        "Z-06: waited {waited:?}"
    );

    // The reverse: our landing in an open transaction; omni-box's create waits, returns ours.
    let mut tx = ctx.backend().begin().await.expect("begin");
    let landed = tx.land(vec![new("m2")]).await.expect("land");
    assert!(landed[0].inserted);
    let theirs = tokio::spawn({
        let peer = peer.clone();
        async move { peer.create(m("m2"), None).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !theirs.is_finished(),
        "Z-06: omni-box's create waits for ours"
    );
    tx.commit().await.expect("commit");
    let created = theirs.await.expect("join").expect("peer create");
    assert_eq!(created["inserted"], json!(false), "Z-06: {created}");
    assert_eq!(
        created["row_id"].as_str(),
        Some(landed[0].row.id.to_string().as_str())
    );

    for id in ["m1", "m2"] {
        let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {} WHERE message_id = $1",
            trial_table(ctx.h.schema(), Layout::Partitioned).qualified()
        )))
        .bind(id)
        .fetch_one(ctx.h.pool())
        .await
        .expect("rows");
        assert_eq!(n, 1, "Z-06: one row for {id}");
    }
    Arc::into_inner(peer).expect("peer").stop().await;
}

/// OP-11 `[peer]` (operations.md R174 added to): a row parked by this library (pending, attempts
/// all spent) on a table omni-box 0.3.1 also uses. What omni-box does with it (recorded
/// 2026-12-05): its runner, given the message again, fails the delivery with
/// `InboxPersistError` (its persist step loads the existing row on the idempotency-key conflict,
/// and the row does not validate); its repository's `create` of the message raises pydantic's
/// `ValidationError` "status is PENDING, but attempts_made (1) has reached max_attempts (1)";
/// its processor does not fetch the row (its fetch wants attempts_made < max_attempts). The
/// row stays parked, as it was. Hence the README: no `park` on a table omni-box also uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn op_11() {
    let ctx = Ictx::new(&PgInboxFactory::plain()).await;
    let peer = peer_on(&ctx, Layout::Plain).await;
    let runner = ctx
        .runner()
        .max_attempts(1)
        .on_exhausted(txoutbox_core::repository::OnExhausted::Park)
        .build()
        .expect("runner");
    ctx.deliver("m1", None);
    ctx.script("m1", vec![Act::Fail("poison".into())]);
    let r = ctx.handle(&runner).await;
    assert_eq!(r.outcome, DeliveryOutcome::Recorded, "{r:?}");
    let parked = ctx.row_of("m1").await;
    assert_eq!((parked.status, parked.attempts_made), (Status::Pending, 1));

    let redelivered = peer.runner(m("m1"), true).await;
    assert!(
        redelivered
            .as_ref()
            .is_err_and(|e| e.to_string().contains("InboxPersistError")),
        "OP-11: omni-box's runner fails a redelivery of a parked message: {redelivered:?}"
    );
    let created = peer.create(m("m1"), None).await;
    assert!(
        created.as_ref().is_err_and(|e| e
            .to_string()
            .contains("status is PENDING, but attempts_made (1) has reached max_attempts (1)")),
        "OP-11: omni-box's create rejects the parked row it loads: {created:?}"
    );
    let fetched = peer.process(10).await.expect("peer processor");
    assert!(
        processed(&fetched).is_empty() && fetched["failed"] == json!(0),
        "OP-11: omni-box's processor leaves the parked row alone: {fetched}"
    );
    assert_eq!(effects_of(&ctx, "m1").await, 0, "OP-11: no effect");
    let after = ctx.row_of("m1").await;
    assert_eq!(
        (
            after.status,
            after.attempts_made,
            after.last_error.as_deref()
        ),
        (Status::Pending, 1, Some("poison")),
        "OP-11: still parked"
    );
    peer.stop().await;
}
