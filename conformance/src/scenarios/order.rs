//! O: per-key ordering.

use std::time::Duration;

use serde_json::json;
use txoutbox_core::event::{NewEvent, Status};
use txoutbox_core::repository::FetchFilter;
use txoutbox_core::scripted::Action;
use uuid::Uuid;

use crate::ctx::{Cfg, Ctx};
use crate::harness::{Factory, RowPatch};

fn rej(t: &str) -> Action {
    Action::Reject(t.into())
}

/// O-01 One head per key per cycle.
pub async fn o_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k1", "k1", "k1", "k2"]).await;
    let mut counts = vec![];
    for _ in 0..4 {
        counts.push(c.cycle1().await.report.completed.len());
    }
    assert_eq!(counts, vec![2, 1, 1, 0]);
    assert_eq!(c.broker.accepted_ids(), vec![e[0], e[3], e[1], e[2]]);
}

/// O-02 A counted failure holds its key and no other.
pub async fn o_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    o_02_steps(&c).await;
}

async fn o_02_steps(c: &Ctx) -> (Uuid, Uuid, Uuid) {
    let e = c.puts(&["k", "k", "o"]).await;
    let (a, b, cc) = (e[0], e[1], e[2]);
    c.broker.script(a, [rej("bad")]);
    let b_before = c.get(b).await;
    let c1 = c.cycle1().await;
    assert_eq!(c1.sent, vec![cc]);
    let ra = c.get(a).await;
    assert_eq!((ra.status, ra.attempts_made), (Status::Pending, 1));
    assert_eq!(ra.last_error.as_deref(), Some("bad"));
    assert!(ra.locked_by.is_none());
    c.assert_next_try_within(&c1, ra.scheduled_at, 5.0, 10.0);
    assert_eq!(c1.report.counted.len(), 1);
    assert_eq!(c1.report.counted[0].next_try, Some(ra.scheduled_at));
    assert!(!c1.report.fetched.contains(&b));
    c.assert_untouched(&b_before).await;
    let c2 = c.cycle1().await;
    assert!(
        c2.report.fetched.is_empty(),
        "cycle 2 fetched {:?}",
        c2.report.fetched
    );
    (a, b, cc)
}

/// O-03 Order resumes after the retry.
pub async fn o_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (a, b, cc) = o_02_steps(&c).await;
    c.advance_to(a).await;
    assert_eq!(c.cycle1().await.sent, vec![a]);
    assert_eq!(c.cycle1().await.sent, vec![b]);
    assert_eq!(c.broker.accepted_ids(), vec![cc, a, b]);
}

/// O-04 A terminally failed head releases its key.
pub async fn o_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").max_attempts(1)).await;
    let b = c.put(c.ev("k")).await;
    c.broker.script(a, [rej("no")]);
    let c1 = c.cycle1().await;
    c.assert_state(a, Status::Failed, 1).await;
    assert_eq!(c1.report.counted.len(), 1);
    let c2 = c.cycle1().await;
    assert_eq!(c2.sent, vec![b]);
    c.assert_state(b, Status::Completed, 0).await;
}

/// O-05 A delayed, never-tried head does not hold.
pub async fn o_05(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").delay(Duration::from_secs(3600))).await;
    let b = c.put(c.ev("k")).await;
    let a_before = c.get(a).await;
    assert_eq!(c.cycle1().await.sent, vec![b]);
    c.assert_untouched(&a_before).await;
    c.advance(Duration::from_secs(3600)).await;
    assert_eq!(c.cycle1().await.sent, vec![a]);
}

/// O-06 A transient failure holds its key; the rest of the batch is deferred.
pub async fn o_06(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k", "k", "x", "y"]).await;
    let (a, b, cx, dy) = (e[0], e[1], e[2], e[3]);
    c.broker.script(a, [Action::Transient("down".into())]);
    // Time passes between the writes and the cycle, so a deferral that kept the schedule and one
    // that moved it to now give different values.
    c.advance(Duration::from_secs(5)).await;
    let before: Vec<_> = futures::future::join_all([cx, dy].map(|id| c.get(id))).await;
    let c1 = c.cycle1().await;
    assert!(c1.sent.is_empty());
    let ra = c.get(a).await;
    assert_eq!(
        (ra.attempts_made, ra.last_error.as_deref()),
        (0, Some("down"))
    );
    assert!(
        ra.locked_at.is_none() && ra.locked_by.is_none(),
        "A is still held after its transient failure"
    );
    c.assert_next_try_after(&c1, ra.scheduled_at, 1.0);
    for b0 in &before {
        let r = c.get(b0.id).await;
        assert_eq!(r.attempts_made, 0);
        assert_eq!(r.last_error.as_deref(), Some("down"));
        assert_eq!(
            r.scheduled_at, b0.scheduled_at,
            "O-06: a deferred row keeps its scheduled_at (R47)"
        );
        assert!(r.locked_by.is_none());
    }
    assert_eq!(c.broker.calls().len(), 1);
    assert!(!c1.report.fetched.contains(&b));
    assert_eq!(c1.report.deferred.len(), 2);
    c.advance(Duration::from_millis(1100)).await;
    assert_eq!(c.cycle1().await.sent, vec![cx, dy, a]);
    assert_eq!(c.cycle1().await.sent, vec![b]);
}

/// O-07 Another relay gets only other keys while a head is held.
pub async fn o_07(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    o_07_steps(&c).await;
}

async fn o_07_steps(c: &Ctx) -> (Uuid, Uuid, Uuid) {
    let e = c.puts(&["k", "k", "o"]).await;
    assert_eq!(c.fetch("w1", 1, 1).await, vec![e[0]]);
    let w2 = Cfg::default().worker("w2");
    let c1 = c.cycle(&w2).await;
    assert_eq!(c1.report.fetched, vec![e[2]]);
    assert_eq!(c1.sent, vec![e[2]]);
    c.advance(Duration::from_secs(299)).await;
    assert!(c.cycle(&w2).await.report.fetched.is_empty());
    (e[0], e[1], e[2])
}

/// O-08 An expired lease is reclaimed in order.
pub async fn o_08(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (a, b, _) = o_07_steps(&c).await;
    c.advance(Duration::from_secs(2)).await;
    let w2 = Cfg::default().worker("w2");
    let c3 = c.cycle(&w2).await;
    assert_eq!(c3.report.fetched, vec![a]);
    assert_eq!(c3.sent, vec![a]);
    assert_eq!(c.cycle(&w2).await.sent, vec![b]);
    let before = c.get(a).await;
    let w1 = txoutbox_core::WorkerId::new("w1").unwrap();
    let res = c
        .repo()
        .write_outcomes(
            &w1,
            &[txoutbox_core::repository::Outcome {
                id: a,
                kind: txoutbox_core::repository::OutcomeKind::Completed,
            }],
        )
        .await
        .unwrap();
    assert_eq!(
        res[0].result,
        txoutbox_core::repository::OutcomeResult::LeaseLost
    );
    assert_eq!(c.get(a).await, before);
}

/// O-09 Topics separate keys.
pub async fn o_09(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e0 = c.put(c.ev("k").topic("t1")).await;
    let e1 = c.put(c.ev("k").topic("t2")).await;
    let e2 = c.put(c.ev("k").topic("t1")).await;
    c.broker.script(e0, [rej("x")]);
    let c1 = c.cycle1().await;
    assert_eq!(c1.sent, vec![e1]);
    assert!(!c1.report.fetched.contains(&e2));
}

/// O-10 A requeued row re-enters the line.
pub async fn o_10(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").max_attempts(1)).await;
    let b = c.put(c.ev("k")).await;
    let cc = c.put(c.ev("k")).await;
    c.broker.script(a, [rej("x")]);
    c.cycle1().await;
    c.assert_state(a, Status::Failed, 1).await;
    assert_eq!(c.cycle1().await.sent, vec![b]);
    assert!(c.repo().requeue_failed(a).await.unwrap());
    let c3 = c.cycle1().await;
    assert_eq!(c3.sent, vec![a]);
    assert!(!c3.report.fetched.contains(&cc));
    assert_eq!(c.cycle1().await.sent, vec![cc]);
    assert_eq!(c.broker.accepted_ids(), vec![b, a, cc]);
}

/// O-11 The batch size counts heads first.
pub async fn o_11(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k1", "k1", "k1", "k2", "k2", "k2", "k3"]).await;
    let got = c.fetch("w1", 2, 1).await;
    assert_eq!(got, vec![e[0], e[3]]);
    c.release_all(&got).await;
    let got = c.fetch("w1", 2, 3).await;
    assert_eq!(got, vec![e[0], e[3]]);
    c.release_all(&got).await;
    let got = c.fetch("w1", 4, 3).await;
    assert_eq!(got, vec![e[0], e[1], e[3], e[6]]);
}

/// O-12 Filtered fetches keep key order.
pub async fn o_12(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").aggregate("x", Uuid::new_v4())).await;
    let b = c.put(c.ev("k").aggregate("y", Uuid::new_v4())).await;
    c.broker.script(a, [rej("x")]);
    let c1 = c.cycle1().await;
    assert_eq!(c1.report.counted.len(), 1);
    let fy = Cfg::default().filter(FetchFilter::aggregate_types(["y"]));
    let fx = Cfg::default().filter(FetchFilter::aggregate_types(["x"]));
    assert!(c.cycle(&fy).await.report.fetched.is_empty());
    c.advance_to(a).await;
    assert!(c.cycle(&fy).await.report.fetched.is_empty());
    assert_eq!(c.cycle(&fx).await.sent, vec![a]);
    assert_eq!(c.cycle(&fy).await.sent, vec![b]);
}

/// O-13 A force-unlocked future row holds its key.
pub async fn o_13(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").delay(Duration::from_secs(3600))).await;
    let b = c.put(c.ev("k")).await;
    let now = c.now().await;
    c.set(a, RowPatch::held("w9", now)).await;
    c.repo().force_unlock(a, "ops").await.unwrap();
    let ra = c.get(a).await;
    assert!(ra.locked_by.is_none() && ra.locked_at.is_none());
    assert_eq!(ra.last_error.as_deref(), Some("Force unlock: ops"));
    assert!(c.cycle1().await.report.fetched.is_empty());
    c.advance(Duration::from_secs(3600)).await;
    assert_eq!(c.cycle1().await.sent, vec![a]);
    assert_eq!(c.cycle1().await.sent, vec![b]);
}

/// O-14 Write order within and across write calls.
pub async fn o_14(f: &dyn Factory) {
    // (a) one call shares created_at, so id (build) order decides.
    let c = Ctx::new(f).await;
    let e1 = c.ev("k").build().unwrap();
    let e0 = c.ev("k").build().unwrap();
    let (i1, i0) = (e1.id(), e0.id());
    c.write(vec![e0, e1]).await;
    assert_eq!(c.cycle1().await.sent, vec![i1]);
    assert_eq!(c.cycle1().await.sent, vec![i0]);
    // (b) separate calls keep the order in which they were made.
    let c = Ctx::new(f).await;
    let f1 = c.ev("k").build().unwrap();
    let f0 = c.ev("k").build().unwrap();
    let (j1, j0) = (f1.id(), f0.id());
    let mut tx = c.begin().await;
    tx.write(vec![f0]).await.unwrap();
    tx.write(vec![f1]).await.unwrap();
    tx.commit().await.unwrap();
    assert_eq!(c.cycle1().await.sent, vec![j0]);
    assert_eq!(c.cycle1().await.sent, vec![j1]);
}

/// O-16 Two keys go out one head each per cycle.
pub async fn o_16(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["ka", "kb", "ka", "kb", "ka", "kb"]).await;
    assert_eq!(c.cycle1().await.sent, vec![e[0], e[1]]);
    assert_eq!(c.cycle1().await.sent, vec![e[2], e[3]]);
    assert_eq!(c.cycle1().await.sent, vec![e[4], e[5]]);
    assert!(c.cycle1().await.sent.is_empty());
}

async fn three_steps(c: &Ctx) -> [Uuid; 3] {
    let agg = Uuid::new_v4();
    let evs: Vec<NewEvent> = ["order.created", "order.paid", "order.cancelled"]
        .iter()
        .enumerate()
        .map(|(i, t)| {
            NewEvent::builder()
                .event_type(*t)
                .aggregate("order", agg)
                .topic("t")
                .partition_key("k")
                .payload_json(json!({ "step": i }))
                .build()
                .unwrap()
        })
        .collect();
    let ids = [evs[0].id(), evs[1].id(), evs[2].id()];
    c.write(evs).await;
    ids
}

/// O-17 Ancestor issue #60: transient failure on the first of three events.
pub async fn o_17(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = three_steps(&c).await;
    c.broker
        .script(ids[0], [Action::Transient("broker unreachable".into())]);
    // Times on the trial's timeline: a database clock does not move when the suite advances
    // (rows move back instead), so `shifted` adds what was advanced.
    let start = c.shifted(c.now().await);
    let mut sent_at = vec![];
    for n in 1..=40 {
        let cy = c.cycle1().await;
        for id in &cy.sent {
            sent_at.push((*id, n, c.shifted(cy.t0)));
        }
        if c.broker.accepted().len() == 3 {
            break;
        }
        c.advance(Duration::from_millis(250)).await;
    }
    let order: Vec<Uuid> = sent_at.iter().map(|s| s.0).collect();
    assert_eq!(order, ids.to_vec());
    let first = sent_at[0].2;
    assert!(
        first - start >= chrono::Duration::milliseconds(1000),
        "sent after {}",
        first - start
    );
    if c.clock_stands_still() {
        assert_eq!(
            sent_at.iter().map(|s| s.1).collect::<Vec<_>>(),
            vec![5, 6, 7]
        );
    } else {
        assert_eq!(sent_at[1].1, sent_at[0].1 + 1);
        assert_eq!(sent_at[2].1, sent_at[1].1 + 1);
    }
    assert_eq!(c.get(ids[0]).await.attempts_made, 0);
}

/// O-18 Ancestor issue #60: counted failure on the first of three events.
pub async fn o_18(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = three_steps(&c).await;
    c.broker.script(ids[0], [rej("broker rejected the record")]);
    let mut sent_at = vec![];
    let mut next_try = None;
    for n in 1..=100 {
        let cy = c.cycle1().await;
        if n == 1 {
            let r = c.get(ids[0]).await;
            c.assert_next_try_within(&cy, r.scheduled_at, 5.0, 10.0);
            next_try = Some(c.shifted(r.scheduled_at));
        }
        for id in &cy.sent {
            sent_at.push((*id, n, c.shifted(cy.t1)));
        }
        if c.broker.accepted().len() == 3 {
            break;
        }
        c.advance(Duration::from_millis(250)).await;
    }
    let order: Vec<Uuid> = sent_at.iter().map(|s| s.0).collect();
    assert_eq!(order, ids.to_vec());
    assert!(
        sent_at[0].2 >= next_try.unwrap(),
        "created went out before its next try"
    );
    if c.clock_stands_still() {
        assert!(
            (21..=41).contains(&sent_at[0].1),
            "created went out in cycle {}",
            sent_at[0].1
        );
    }
    let r = c.get(ids[0]).await;
    assert_eq!(r.attempts_made, 1);
    assert_eq!(r.last_error.as_deref(), Some("broker rejected the record"));
}

/// O-19 Ancestor issue #60 with backoff base 0.
pub async fn o_19(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = three_steps(&c).await;
    c.broker.script(ids[0], [rej("broker rejected the record")]);
    let cfg = Cfg::default().base(0.0);
    assert!(c.cycle(&cfg).await.sent.is_empty());
    assert_eq!(c.cycle(&cfg).await.sent, vec![ids[0]]);
    assert_eq!(c.cycle(&cfg).await.sent, vec![ids[1]]);
    assert_eq!(c.cycle(&cfg).await.sent, vec![ids[2]]);
    assert_eq!(c.get(ids[0]).await.attempts_made, 1);
    // Variant with max_per_key 3.
    let c = Ctx::new(f).await;
    let ids = three_steps(&c).await;
    c.broker.script(ids[0], [rej("broker rejected the record")]);
    let cfg = Cfg::default().base(0.0).per_key(3);
    let before1 = c.get(ids[1]).await;
    let before2 = c.get(ids[2]).await;
    let c1 = c.cycle(&cfg).await;
    assert_eq!(c1.report.fetched, ids.to_vec());
    assert!(c1.sent.is_empty());
    assert_eq!(c1.report.released, vec![ids[1], ids[2]]);
    c.assert_untouched(&before1).await;
    c.assert_untouched(&before2).await;
    assert_eq!(c.cycle(&cfg).await.sent, ids.to_vec());
}

/// O-20 A held row stays in line, before a force-unlock and after its lease expired.
pub async fn o_20(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    // A is not due and has no last_error: only its lock puts it in line (R27). It has another
    // aggregate type, so a filtered fetch that leaves it out must still see it (R29).
    let a = c
        .put(
            c.ev("k")
                .aggregate("held", Uuid::new_v4())
                .delay(Duration::from_secs(3600)),
        )
        .await;
    let b = c.put(c.ev("k")).await;
    let o = c.put(c.ev("o")).await;
    c.set(a, RowPatch::held("w9", c.now().await)).await;
    let b_before = c.get(b).await;
    let only_agg = FetchFilter::aggregate_types(["agg"]);
    for cfg in [
        Cfg::default(),
        Cfg::default().per_key(3),
        Cfg::default().filter(only_agg),
    ] {
        let per_key = cfg.max_per_key;
        let cy = c.cycle(&cfg).await;
        assert!(
            !cy.report.fetched.contains(&b),
            "B was fetched while A, earlier on its key, was held (max_per_key {per_key}, filter {:?})",
            cfg.filter
        );
        assert!(!cy.report.fetched.contains(&a));
    }
    c.assert_untouched(&b_before).await;
    assert_eq!(c.broker.accepted_ids(), vec![o]);
    // The lease expires; A is still held (not released), so it stays in line.
    c.advance(Duration::from_secs(301)).await;
    let cy = c.cycle(&Cfg::default().per_key(3)).await;
    assert!(
        cy.report.fetched.is_empty(),
        "fetched {:?} while A held an expired lease",
        cy.report.fetched
    );
    // After the force-unlock A has a last_error, so it still holds its key until due.
    c.repo().force_unlock(a, "ops").await.unwrap();
    assert!(c.cycle1().await.report.fetched.is_empty());
    c.advance(Duration::from_secs(3600)).await;
    assert_eq!(c.cycle1().await.sent, vec![a]);
    assert_eq!(c.cycle1().await.sent, vec![b]);
    // A held row in the middle of a line ends the run in front of it: m1 is a head, m2 is held
    // by w9, so a fetch with max_per_key 3 takes m1 only (R74).
    let c = Ctx::new(f).await;
    let m = c.puts(&["m", "m", "m"]).await;
    c.set(m[1], RowPatch::held("w9", c.now().await)).await;
    let cy = c.cycle(&Cfg::default().per_key(3)).await;
    assert_eq!(cy.report.fetched, vec![m[0]]);
    assert_eq!(c.get(m[1]).await.locked_by.as_deref(), Some("w9"));
}

/// O-21 A pending row at its attempt budget is not fetched, and holds its key.
///
/// Outcomes never leave a row pending with attempts_made = max_attempts (it becomes `failed`),
/// but rows written by others can be in that state (the ancestor's check allows it): such a row
/// is not fetchable (R19: attempts_made < max_attempts) and, being pending and due, is in line.
pub async fn o_21(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k", "k", "o"]).await;
    c.set(
        e[0],
        RowPatch {
            attempts_made: Some(6),
            last_error: Some(Some("spent".into())),
            ..RowPatch::default()
        },
    )
    .await;
    let before = [c.get(e[0]).await, c.get(e[1]).await];
    let cy = c.cycle(&Cfg::default().per_key(3)).await;
    assert_eq!(cy.report.fetched, vec![e[2]]);
    for b in &before {
        c.assert_untouched(b).await;
    }
}

/// O-22 Heads are taken in scheduled_at order across keys, not in write order (second
/// scenario for R20/R28's head order, besides O-06).
pub async fn o_22(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let x = c.put(c.ev("k1").delay(Duration::from_secs(10))).await;
    let y = c.put(c.ev("k2")).await;
    let z = c.put(c.ev("k3").delay(Duration::from_secs(5))).await;
    c.advance(Duration::from_secs(10)).await;
    // Written x, y, z; due y (now), z (+5 s), x (+10 s).
    let one = c.fetch("w1", 1, 1).await;
    assert_eq!(one, vec![y], "batch 1 takes the earliest scheduled head");
    c.release_all(&one).await;
    let two = c.fetch("w1", 2, 1).await;
    assert_eq!(
        two,
        vec![y, z],
        "batch 2 takes the two earliest scheduled heads"
    );
    c.release_all(&two).await;
    assert_eq!(c.cycle1().await.sent, vec![y, z, x]);
}

/// O-23 The head check ignores an aggregate-id filter: a fetchable, never-tried head that the
/// filter excludes still keeps its key's later rows out of a filtered fetch (second scenario
/// for R29/R81, besides O-12's aggregate-type filter on a failed head).
pub async fn o_23(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let (ida, idb) = (Uuid::new_v4(), Uuid::new_v4());
    let a = c.put(c.ev("k").aggregate("acct", ida)).await;
    let b = c.put(c.ev("k").aggregate("acct", idb)).await;
    let other = c.put(c.ev("o").aggregate("acct", idb)).await;
    let only = |id: Uuid| {
        Cfg::default().filter(FetchFilter {
            aggregate_ids: Some(vec![id]),
            ..FetchFilter::default()
        })
    };
    let c1 = c.cycle(&only(idb)).await;
    assert_eq!(
        c1.sent,
        vec![other],
        "B waits behind A, which the filter excludes; the other key's row goes"
    );
    assert_eq!(c.get(b).await.status, Status::Pending);
    assert_eq!(c.cycle(&only(ida)).await.sent, vec![a]);
    assert_eq!(c.cycle(&only(idb)).await.sent, vec![b]);
}
