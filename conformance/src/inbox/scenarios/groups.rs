//! G: consumer groups, crashes and duplicates (scenarios.md section 22).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use txoutbox_core::event::{Status, WorkerId};
use txoutbox_core::inbox::repository::{InboxFetchRequest, InboxRepository};
use txoutbox_core::inbox::{DeliveryOutcome as O, OnFailure, RowReport, Runner};

use crate::inbox::ctx::{Ictx, g};
use crate::inbox::harness::InboxFactory;
use crate::inbox::script::{Act, Gate};

/// G-01: two runners share a subscription; every message lands and runs once (R110, R119).
pub async fn g_01<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    for n in 0..20 {
        for k in 0..10 {
            c.deliver(&format!("k{k}-{n}"), Some(&format!("k{k}")));
        }
    }
    let w1 = c.runner().build().unwrap();
    let w2 = c.runner().worker_id("w2").build().unwrap();
    let (mut a, mut b) = (0, 0);
    loop {
        let x = w1.handle_next().await.unwrap();
        let y = w2.handle_next().await.unwrap();
        a += usize::from(x.is_some());
        b += usize::from(y.is_some());
        if x.is_none() && y.is_none() {
            break;
        }
    }
    assert!(a > 0 && b > 0, "each runner handled some: {a}, {b}");
    let mut e = c.effects().await;
    assert_eq!(e.len(), 200);
    e.sort();
    e.dedup();
    assert_eq!(e.len(), 200, "each message once");
    let counts = c.backend().counts(&g()).await.unwrap();
    assert_eq!(counts.len(), 1);
    assert_eq!(
        (counts[0].status, counts[0].count),
        (Status::Completed, 200)
    );
}

/// G-02: one message delivered to two runners at once: the second waits for the first's
/// transaction (R110, R119).
pub async fn g_02<F: InboxFactory>(f: &F) {
    for variant in [false, true] {
        let c = Ictx::new(f).await;
        let gate = Gate::new();
        c.deliver("m1", None);
        c.script(
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
        let w1 = c.runner().on_failure(pol).build().unwrap();
        let w2 = c.runner().on_failure(pol).worker_id("w2").build().unwrap();
        let done2 = AtomicBool::new(false);
        let first = c.handle(&w1);
        let second = async {
            gate.reached(1).await;
            c.duplicate("m1");
            let r = c.handle(&w2).await;
            done2.store(true, Ordering::SeqCst);
            r
        };
        let control = async {
            gate.reached(1).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(
                !done2.load(Ordering::SeqCst),
                "w2 waits for w1's transaction"
            );
            gate.open();
        };
        let (a, b, ()) = tokio::join!(first, second, control);
        if variant {
            assert_eq!(a.outcome, O::Rewound);
            assert_eq!((b.outcome, b.committed), (O::Completed, true));
        } else {
            assert_eq!((a.outcome, a.committed), (O::Completed, true));
            assert_eq!((b.outcome, b.committed), (O::Duplicate, true));
        }
        assert_eq!(c.effects().await, vec!["m1"]);
    }
}

/// G-03: a runner killed in the middle of a message leaves nothing; the redelivery completes
/// it (R115, R119, R142).
pub async fn g_03<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let gate = Gate::new();
    c.deliver("m1", None);
    c.script("m1", vec![Act::Gate(gate.clone()), Act::Write]);
    let w1 = c.runner().build().unwrap();
    tokio::select! {
        _ = c.handle(&w1) => panic!("the gated run cannot end"),
        _ = gate.reached(1) => {}
    }
    // kill(w1): its future and open unit of work are dropped.
    drop(w1);
    assert!(c.row("m1").await.is_none());
    assert!(c.effects().await.is_empty());
    c.advance(Duration::from_secs(30)).await;
    let w2 = c.runner().worker_id("w2").build().unwrap();
    let r = c.handle(&w2).await;
    assert_eq!(c.sub.deliveries(c.idx("m1")), 2);
    assert_eq!((r.outcome, r.committed), (O::Completed, true));
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// G-04: a redelivery after the acknowledgement was lost is a duplicate (R109, R119, R131).
pub async fn g_04<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let i = c.deliver("m1", None);
    c.sub.fail_commit(i);
    let w1 = c.runner().build().unwrap();
    let a = c.handle(&w1).await;
    assert_eq!((a.outcome, a.commit_failed), (O::Completed, true));
    c.duplicate("m1");
    c.advance(Duration::from_secs(30)).await;
    let w2 = c.runner().worker_id("w2").build().unwrap();
    for _ in 0..2 {
        let r = c.handle(&w2).await;
        assert_eq!((r.outcome, r.committed), (O::Duplicate, true));
    }
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// G-05: a runner meets a row a processor is running: landed, committed, not run (R116, R130,
/// R152).
pub async fn g_05<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", Some("k")).await;
    let gate = Gate::new();
    c.script("m1", vec![Act::Gate(gate.clone())]);
    let p = c.processor().worker_id("w2").build().unwrap();
    let r = c.runner().build().unwrap();
    let cycle = c.cycle(&p);
    let runner = async {
        gate.reached(1).await;
        c.deliver("m1", Some("k"));
        let res = c.handle(&r).await;
        gate.open();
        res
    };
    let (rep, res) = tokio::join!(cycle, runner);
    assert_eq!((res.outcome, res.committed), (O::Landed, true));
    assert_eq!(rep.completed(), vec![row.id]);
    assert_eq!(c.handler.runs_of("m1"), 1);
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// G-06: a runner takes over a crashed processor's row once its lease expired; the processor's
/// late run is lease lost (R116, R152, R156).
pub async fn g_06<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", Some("k")).await;
    let req = InboxFetchRequest::new(WorkerId::new("w2").unwrap(), g(), 10);
    assert_eq!(c.backend().fetch_and_lock(&req).await.unwrap().len(), 1);
    let r = c.runner().build().unwrap();
    c.deliver("m1", Some("k"));
    assert_eq!(c.handle(&r).await.outcome, O::Landed);
    c.advance(Duration::from_secs(301)).await;
    c.duplicate("m1");
    assert_eq!(c.handle(&r).await.outcome, O::Completed);
    let p = c.processor().worker_id("w2").build().unwrap();
    // The row as it stands: the test clock (advance) moves created_at back with the other times.
    let row = c.backend().get(row.id).await.unwrap().expect("the row");
    assert_eq!(
        p.run_row(row.id, row.created_at).await,
        RowReport::LeaseLost
    );
    assert_eq!(c.handler.runs_of("m1"), 1);
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// G-07: two processors keep key order (R149, R150).
pub async fn g_07<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let a1 = c.land("a1", Some("k")).await;
    let a2 = c.land("a2", Some("k")).await;
    let b1 = c.land("b1", Some("o")).await;
    let mut req = InboxFetchRequest::new(WorkerId::new("W1").unwrap(), g(), 1);
    req.max_per_key = 1;
    let got = c.backend().fetch_and_lock(&req).await.unwrap();
    assert_eq!(got.iter().map(|r| r.id()).collect::<Vec<_>>(), vec![a1.id]);
    let w2 = c.processor().worker_id("W2").build().unwrap();
    assert_eq!(c.cycle(&w2).await.completed(), vec![b1.id]);
    c.advance(Duration::from_secs(299)).await;
    assert!(c.cycle(&w2).await.fetched.is_empty());
    c.advance(Duration::from_secs(2)).await;
    assert_eq!(c.cycle(&w2).await.completed(), vec![a1.id]);
    assert_eq!(c.cycle(&w2).await.completed(), vec![a2.id]);
    assert_eq!(c.effects().await, vec!["b1", "a1", "a2"]);
}

/// G-08: a killed runner with deliveries waiting for their key: nothing committed; the
/// redeliveries complete in key order (R119, R144, R166).
pub async fn g_08<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let (g1, g3) = (Gate::new(), Gate::new());
    c.deliver("m1", Some("k"));
    c.deliver("m2", Some("k"));
    c.deliver("m3", Some("j"));
    c.script("m1", vec![Act::Gate(g1.clone())]);
    c.script("m3", vec![Act::Gate(g3.clone())]);
    {
        let w1 = c.runner().concurrency(4).build().unwrap();
        w1.start();
        tokio::select! {
            _ = w1.run_until_stopped() => panic!("the loop cannot end while its gates are closed"),
            _ = async { g1.reached(1).await; g3.reached(1).await; } => {}
        }
    }
    assert!(c.sub.log().is_empty(), "w1 ended no delivery");
    assert_eq!(c.count_rows(&["m1", "m2", "m3"]).await, 0);
    assert!(c.effects().await.is_empty());
    c.advance(Duration::from_secs(30)).await;
    let w2 = c.runner().worker_id("w2").build().unwrap();
    for _ in 0..3 {
        assert_eq!(c.handle(&w2).await.outcome, O::Completed);
    }
    let e = c.effects().await;
    assert_eq!(e.len(), 3);
    let pos = |m: &str| e.iter().position(|x| x == m).unwrap();
    assert!(pos("m1") < pos("m2"), "m1 before m2: {e:?}");
}

/// G-09: two runners land one key one at a time: the second waits for the key lock (R116,
/// R144, R145).
pub async fn g_09<F: InboxFactory>(f: &F) {
    for variant in [false, true] {
        let c = Ictx::new(f).await;
        let gate = Gate::new();
        c.deliver("m1", Some("k"));
        c.deliver("m2", Some("k"));
        c.script(
            "m1",
            vec![if variant {
                Act::GateFail(gate.clone(), "boom".into())
            } else {
                Act::Gate(gate.clone())
            }],
        );
        let w1 = c.runner().build().unwrap();
        let w2: Runner<_> = c.runner().worker_id("w2").build().unwrap();
        let first = c.handle(&w1);
        let second = async {
            gate.reached(1).await;
            c.handle(&w2).await
        };
        let control = async {
            gate.reached(1).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert!(
                c.row("m2").await.is_none(),
                "w2 has landed nothing while w1 holds k"
            );
            gate.open();
        };
        let (a, b, ()) = tokio::join!(first, second, control);
        if variant {
            assert_eq!(a.outcome, O::Recorded);
            let r = c.row_of("m1").await;
            assert_eq!(
                (r.status, r.attempts_made, r.last_error.as_deref()),
                (Status::Pending, 1, Some("boom"))
            );
            assert_eq!((b.outcome, b.committed), (O::Landed, true));
            assert_eq!(c.handler.runs_of("m2"), 0);
            assert!(c.effects().await.is_empty());
        } else {
            assert_eq!(a.outcome, O::Completed);
            assert_eq!(b.outcome, O::Completed);
            assert_eq!(c.effects().await, vec!["m1", "m2"]);
        }
        let _ = Arc::new(());
    }
}
