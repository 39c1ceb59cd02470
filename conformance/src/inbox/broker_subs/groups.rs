//! G-02, G-04 to G-06, G-08 and G-09 on a live broker (scenarios.md section 22): the group
//! trials whose fixtures the broker cannot make on demand, made from outside as the parent
//! module's docs say.

use super::*;
/// The results one runner's hooks recorded for `message_id`: (outcome, committed).
fn outcomes(r: &Recorder, message_id: &str) -> Vec<(O, bool)> {
    r.results()
        .into_iter()
        .filter(|x| x.message_id.as_deref() == Some(message_id))
        .map(|x| (x.outcome, x.committed))
        .collect()
}

/// G-02 on a broker: one message delivered to two runners at once. A broker gives one stored
/// message to one runner of a group at a time, and JetStream cannot be made to redeliver on
/// demand, so the second delivery is the message published again (a producer's duplicate: the
/// same event id, without a broker-level message id, which NATS would drop): w1 (concurrency 1) starts m1 and waits at
/// its gate; m1 is published again and reaches w2, which starts landing it; 200 ms later w2 has
/// reported nothing (its landing waits for w1's transaction); then the gate opens. w1:
/// completed, committed; w2: duplicate, committed; effects `[m1]`. Variant (w1's run fails,
/// on_failure rewind): w1 rewinds and stores nothing, w2 lands m1 and completes it; w1's
/// rewound delivery comes back as a duplicate; effects `[m1]` (R110, R119).
pub async fn g_02<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    for variant in [false, true] {
        let b = Bed::new(s).await;
        if let Some(why) = b.trial.no_second_reader_on_demand() {
            println!(
                "SKIPPED G-02: needs a second runner to get a key's delivery while the first runs; {why}"
            );
            b.trial.cleanup().await;
            return;
        }
        let gate = Gate::new();
        b.handler.script(
            "m1",
            vec![if variant {
                Act::GateFail(gate.clone(), "boom".into())
            } else {
                Act::Gate(gate.clone())
            }],
        );
        let pol = if variant {
            OnFailure::Rewind
        } else {
            OnFailure::Record
        };
        b.publish("m1", "k", 0).await;
        let (r1, r2) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
        let redeliver = Duration::from_secs(30);
        let w1 = b.run(
            b.builder("w1", redeliver)
                .await
                .concurrency(1)
                .on_failure(pol)
                .backoff(Backoff::new(0.2, 0.4).expect("backoff"))
                .hooks(r1.clone()),
        );
        tokio::time::timeout(Duration::from_secs(10), gate.reached(1))
            .await
            .expect("w1 starts m1");
        b.publish("m1", "k", 0).await;
        let (builder, seen2) = b.spied("w2", redeliver).await;
        let w2 = b.run(builder.on_failure(pol).hooks(r2.clone()));
        b.wait_for("w2 gets the duplicate", Duration::from_secs(10), |_| {
            !seen2.deliveries.lock().expect("poisoned").is_empty()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            r2.results().is_empty(),
            "G-02: w2 waits for w1's transaction: {:?}",
            r2.results()
        );
        gate.open();
        let expect = if variant { 3 } else { 2 };
        b.wait_for("every delivery's result", Duration::from_secs(10), |b| {
            b.rec.results().len() >= expect
        })
        .await;
        w1.stop().await;
        w2.stop().await;
        if variant {
            let first = outcomes(&r1, "m1");
            assert_eq!(first[0].0, O::Rewound, "w1: {first:?}");
            assert_eq!(outcomes(&r2, "m1")[0], (O::Completed, true));
            let all: Vec<_> = b.rec.results().iter().map(|r| r.outcome).collect();
            assert_eq!(all.len(), 3, "{all:?}");
            assert_eq!(all[2], O::Duplicate, "the rewound delivery: {all:?}");
        } else {
            assert_eq!(outcomes(&r1, "m1"), vec![(O::Completed, true)]);
            assert_eq!(outcomes(&r2, "m1"), vec![(O::Duplicate, true)]);
        }
        assert_eq!(b.h.effects().await, vec!["m1"]);
        b.trial.cleanup().await;
    }
}

/// G-04 on a broker: w1 handles m1 and its acknowledgement is lost (the commit never reaches
/// the broker and fails transiently); m1 is then published again. w1 stops; the broker gives
/// m1 back after the redelivery time and w2 gets it and the duplicate: both duplicate,
/// committed. w1: completed with commit_failed; one row; effects `[m1]` (R109, R119, R131).
pub async fn g_04<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    b.publish("m1", "k", 0).await;
    let redeliver = Duration::from_secs(2);
    let (builder, seen1) = b.spied("w1", redeliver).await;
    seen1
        .lose_commits
        .store(1, std::sync::atomic::Ordering::SeqCst);
    let (r1, r2) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
    let w1 = b.run(builder.hooks(r1.clone()));
    b.wait_for("w1's result", Duration::from_secs(10), |_| {
        !r1.results().is_empty()
    })
    .await;
    w1.stop().await;
    let a = r1.results();
    assert_eq!(
        (a[0].outcome, a[0].commit_failed),
        (O::Completed, true),
        "{a:?}"
    );
    b.publish("m1", "k", 0).await;
    let w2 = b.run(b.builder("w2", redeliver).await.hooks(r2.clone()));
    b.wait_for("w2's two results", Duration::from_secs(15), |_| {
        r2.results().len() >= 2
    })
    .await;
    w2.stop().await;
    assert_eq!(
        outcomes(&r2, "m1"),
        vec![(O::Duplicate, true), (O::Duplicate, true)]
    );
    assert_eq!(b.handler.runs_of("m1"), 1);
    assert_eq!(
        b.h.inbox
            .rows()
            .iter()
            .filter(|r| r.message_id == "m1")
            .count(),
        1
    );
    assert_eq!(b.h.effects().await, vec!["m1"]);
    b.trial.cleanup().await;
}

impl Bed {
    /// m1 on k stored pending, as a runner that did not run it would have left it.
    async fn land(&self, id: &str, key: &str) -> txoutbox_core::inbox::InboxEvent {
        let e = txoutbox_core::inbox::NewInboxEvent::builder()
            .message_id(id)
            .consumer_group("g")
            .source("src")
            .event_type("e")
            .partition_key(key)
            .payload_json(json!({"key": key, "n": 0}))
            .build()
            .expect("valid event");
        self.h
            .inbox
            .land_committed(vec![e])
            .await
            .expect("land")
            .remove(0)
            .row
    }

    fn processor(&self) -> txoutbox_core::inbox::Processor<InMemoryInbox> {
        txoutbox_core::inbox::Processor::builder(self.h.backend(), "g", self.handler.clone())
            .worker_id("w2")
            .max_per_key(1)
            .handler_concurrency(1)
            .hooks(self.rec.clone())
            .random_source(Box::new(SeededRng::new(11)))
            .build()
            .expect("processor")
    }
}

/// G-05 on a broker: a processor (w2) runs stored m1 and waits at its gate; m1 comes from the
/// broker to runner w1: landed, committed (acknowledged), its handler not called; the cycle
/// completes m1; effects `[m1]` (R116, R130, R152).
pub async fn g_05<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    let row = b.land("m1", "k").await;
    let gate = Gate::new();
    b.handler.script("m1", vec![Act::Gate(gate.clone())]);
    let p = b.processor();
    let token = txoutbox_core::CancellationToken::new();
    let cycle = p.cycle(&token);
    let r1 = Arc::new(Recorder::default());
    let runner = async {
        gate.reached(1).await;
        b.publish("m1", "k", 0).await;
        let w1 = b.run(
            b.builder("w1", Duration::from_secs(30))
                .await
                .hooks(r1.clone()),
        );
        b.wait_for("w1's result", Duration::from_secs(10), |_| {
            !r1.results().is_empty()
        })
        .await;
        gate.open();
        w1
    };
    let (rep, w1) = tokio::join!(cycle, runner);
    w1.stop().await;
    assert_eq!(outcomes(&r1, "m1"), vec![(O::Landed, true)]);
    assert_eq!(rep.expect("cycle").completed(), vec![row.id]);
    assert_eq!(b.handler.runs_of("m1"), 1);
    assert_eq!(b.h.effects().await, vec!["m1"]);
    b.trial.cleanup().await;
}

/// G-06 on a broker: processor w2 takes stored m1 (fetch_and_lock) and does nothing more; m1
/// comes from the broker to runner w1: landed, committed. The store's clock moves 301 s (the
/// lease is the store's, not the broker's); m1 comes again: w1 completes it. w2's late run is
/// lease lost, its handler not called; effects `[m1]` (R116, R152, R156).
pub async fn g_06<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    use txoutbox_core::event::WorkerId;
    use txoutbox_core::inbox::RowReport;
    use txoutbox_core::inbox::repository::InboxFetchRequest;
    let b = Bed::new(s).await;
    let row = b.land("m1", "k").await;
    let req = InboxFetchRequest::new(WorkerId::new("w2").expect("worker"), g(), 10);
    assert_eq!(b.h.inbox.fetch_and_lock(&req).await.unwrap().len(), 1);
    b.publish("m1", "k", 0).await;
    let w1 = b.run(b.builder("w1", Duration::from_secs(30)).await);
    b.wait_for("the first delivery", Duration::from_secs(10), |b| {
        !b.rec.results().is_empty()
    })
    .await;
    b.h.advance(Duration::from_secs(301)).await;
    b.publish("m1", "k", 0).await;
    b.wait_for("the second delivery", Duration::from_secs(10), |b| {
        b.rec.results().len() >= 2
    })
    .await;
    w1.stop().await;
    assert_eq!(
        outcomes(&b.rec, "m1"),
        vec![(O::Landed, true), (O::Completed, true)]
    );
    // The row as it stands: the test clock (advance) moves created_at back with the other times.
    let row = b.h.inbox.get(row.id).await.unwrap().expect("the row");
    assert_eq!(
        b.processor().run_row(row.id, row.created_at).await,
        RowReport::LeaseLost
    );
    assert_eq!(b.handler.runs_of("m1"), 1);
    assert_eq!(b.h.effects().await, vec!["m1"]);
    b.trial.cleanup().await;
}

// G-07 (two processors keep key order) involves no subscription: processors read the store
// only, so a broker adds nothing to it; it runs on the scripted subscription's suite alone.

/// G-08 on a broker: w1 (concurrency 4) takes m1 and m2 on k and m3 on j; m1 and m3 wait at
/// their gates, m2 waits for its key; w1 is killed. Nothing was committed: no row, no effect.
/// The broker gives all three back after the redelivery time; w2 completes them, m1 before m2;
/// each id's effect once (R119, R144, R166).
pub async fn g_08<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    let b = Bed::new(s).await;
    let (g1, g3) = (Gate::new(), Gate::new());
    b.publish("m1", "k", 0).await;
    b.publish("m2", "k", 1).await;
    b.publish("m3", "j", 0).await;
    b.handler.script("m1", vec![Act::Gate(g1.clone())]);
    b.handler.script("m3", vec![Act::Gate(g3.clone())]);
    let redeliver = Duration::from_secs(2);
    let (builder, seen1) = b.spied("w1", redeliver).await;
    let w1 = b.run(builder.concurrency(4));
    tokio::time::timeout(Duration::from_secs(10), async {
        g1.reached(1).await;
        g3.reached(1).await;
    })
    .await
    .expect("w1 starts m1 and m3");
    b.wait_for("w1 holds all three", Duration::from_secs(10), |_| {
        seen1.deliveries.lock().expect("poisoned").len() == 3
    })
    .await;
    w1.kill();
    assert!(
        seen1
            .acks
            .lock()
            .expect("poisoned")
            .iter()
            .all(|(op, _)| *op == "renew"),
        "w1 ended no delivery"
    );
    assert!(b.h.inbox.rows().is_empty(), "no row after the kill");
    assert!(b.h.effects().await.is_empty());
    let w2 = b.run(b.builder("w2", redeliver).await.concurrency(4));
    b.wait_for("three completions", Duration::from_secs(15), |b| {
        b.completed().len() >= 3
    })
    .await;
    w2.stop().await;
    let e = b.h.effects().await;
    let mut sorted = e.clone();
    sorted.sort();
    assert_eq!(sorted, vec!["m1", "m2", "m3"], "each id once: {e:?}");
    let pos = |m: &str| e.iter().position(|x| x == m).expect("effect");
    assert!(pos("m1") < pos("m2"), "m1 before m2: {e:?}");
    b.trial.cleanup().await;
}

/// G-09 on a broker: w1 (concurrency 1) starts m1 on k and waits at its gate; m2 on k reaches
/// w2, which starts landing it; 200 ms later no row of m2 exists (w2 waits for the key); the
/// gate opens: w1 completes m1, then w2 lands and completes m2; effects `[m1, m2]`. Variant
/// (m1's run fails, on_failure record): m1 is recorded (pending, 1, `boom`); w2 lands m2 behind
/// it (landed, committed, not run); effects `[]` (R116, R144, R145).
pub async fn g_09<S: SubscriptionUnderTest + ?Sized>(s: &S) {
    for variant in [false, true] {
        let b = Bed::new(s).await;
        if let Some(why) = b.trial.no_second_reader_on_demand() {
            println!(
                "SKIPPED G-09: needs a second runner to get a key's delivery while the first runs; {why}"
            );
            b.trial.cleanup().await;
            return;
        }
        let gate = Gate::new();
        b.handler.script(
            "m1",
            vec![if variant {
                Act::GateFail(gate.clone(), "boom".into())
            } else {
                Act::Gate(gate.clone())
            }],
        );
        b.publish("m1", "k", 0).await;
        let (r1, r2) = (Arc::new(Recorder::default()), Arc::new(Recorder::default()));
        let redeliver = Duration::from_secs(30);
        let w1 = b.run(
            b.builder("w1", redeliver)
                .await
                .concurrency(1)
                .on_failure(OnFailure::Record)
                .hooks(r1.clone()),
        );
        tokio::time::timeout(Duration::from_secs(10), gate.reached(1))
            .await
            .expect("w1 starts m1");
        b.publish("m2", "k", 1).await;
        let (builder, seen2) = b.spied("w2", redeliver).await;
        let w2 = b.run(builder.on_failure(OnFailure::Record).hooks(r2.clone()));
        b.wait_for("w2 gets m2", Duration::from_secs(10), |_| {
            !seen2.deliveries.lock().expect("poisoned").is_empty()
        })
        .await;
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            b.h.inbox
                .get_by_message_id("m2", &g())
                .await
                .unwrap()
                .is_none(),
            "G-09: w2 has landed nothing while w1 holds k"
        );
        gate.open();
        b.wait_for("both results", Duration::from_secs(10), |_| {
            !r1.results().is_empty() && !r2.results().is_empty()
        })
        .await;
        w1.stop().await;
        w2.stop().await;
        if variant {
            assert_eq!(outcomes(&r1, "m1"), vec![(O::Recorded, true)]);
            let r =
                b.h.inbox
                    .get_by_message_id("m1", &g())
                    .await
                    .unwrap()
                    .unwrap();
            assert_eq!(
                (r.status, r.attempts_made, r.last_error.as_deref()),
                (Status::Pending, 1, Some("boom"))
            );
            assert_eq!(outcomes(&r2, "m2"), vec![(O::Landed, true)]);
            assert_eq!(b.handler.runs_of("m2"), 0);
            assert!(b.h.effects().await.is_empty());
        } else {
            assert_eq!(outcomes(&r1, "m1"), vec![(O::Completed, true)]);
            assert_eq!(outcomes(&r2, "m2"), vec![(O::Completed, true)]);
            assert_eq!(b.h.effects().await, vec!["m1", "m2"]);
        }
        b.trial.cleanup().await;
    }
}
