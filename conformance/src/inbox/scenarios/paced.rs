//! The `[mem]` scenarios on paused time: the runner loop's pacing (N-19) and breaker (F-20),
//! the processor's lease margin (Y-10) and loop waits (Y-19). The backend clock is moved with
//! tokio's paused clock where a scenario needs rows to come due.

use std::time::Duration;

use txoutbox_core::CancellationToken;
use txoutbox_core::inbox::{DeliveryOutcome as O, OnFailure, RowReport};

use crate::inbox::ctx::Ictx;
use crate::inbox::harness::{InboxFactory, InboxHarness};
use crate::inbox::script::Act;

fn offsets<H: InboxHarness>(c: &Ictx<H>, t0: tokio::time::Instant, what: Option<&str>) -> Vec<f64> {
    c.rec
        .times
        .lock()
        .unwrap()
        .iter()
        .filter(|(w, _)| what.is_none_or(|x| w == x) && (what.is_some() || w != "fetch"))
        .map(|(_, t)| ((t.duration_since(t0).as_secs_f64()) * 1000.0).round() / 1000.0)
        .collect()
}

/// N-19: the loop waits 0.1 s doubling after persistence errors, never after a rewind, and
/// does not run before `start` (R120). (a) as amended by issue 28: after the persistence error
/// at 0 s the loop keeps m1, reads nothing and probes the database after each wait (0.1, 0.3 s
/// fail); the probe at 0.7 s answers, and m1, tried again, commits, then the others.
pub async fn n_19<F: InboxFactory>(f: &F) {
    // (a) persistence errors.
    let c = Ictx::new(f).await;
    for i in 1..=5 {
        c.deliver(&format!("m{i}"), None);
    }
    let r = c.runner().build().unwrap();
    c.h.set_db_down(true);
    r.start();
    let t0 = tokio::time::Instant::now();
    let control = async {
        tokio::time::sleep(Duration::from_millis(650)).await;
        c.h.set_db_down(false);
        c.rec.wait_deliveries(5).await;
        r.stop();
    };
    let (done, ()) = tokio::join!(r.run_until_stopped(), control);
    done.unwrap();
    let res = c.rec.results();
    let t = offsets(&c, t0, None);
    assert_eq!(&t[..2], &[0.0, 0.7], "{t:?}");
    assert_eq!(res[0].outcome, O::PersistFailed);
    assert!(
        res[1..].iter().all(|x| x.outcome == O::Completed),
        "{res:?}"
    );
    assert_eq!(res[1].message_id.as_deref(), Some("m1"));
    // (b) rewinds make the loop wait for nothing.
    let c = Ictx::new(f).await;
    for i in 1..=5 {
        c.deliver(&format!("m{i}"), None);
    }
    c.handler.always(Act::Fail("x".into()));
    let r = c.runner().on_failure(OnFailure::Rewind).build().unwrap();
    r.start();
    let t0 = tokio::time::Instant::now();
    let control = async {
        c.rec.wait_deliveries(5).await;
        r.stop();
    };
    let (done, ()) = tokio::join!(r.run_until_stopped(), control);
    done.unwrap();
    assert!(c.rec.results().iter().all(|x| x.outcome == O::Rewound));
    assert_eq!(offsets(&c, t0, None), vec![0.0; 5]);
    // (c) run before start.
    let c = Ictx::new(f).await;
    let r = c.runner().build().unwrap();
    assert_eq!(
        r.run_until_stopped().await.unwrap_err().to_string(),
        "Runner is not started."
    );
}

/// F-20: the runner's circuit breaker (R62, R120).
pub async fn f_20<F: InboxFactory>(f: &F) {
    for variant in [false, true] {
        let c = Ictx::new(f).await;
        for i in 1..=5 {
            c.deliver(&format!("m{i}"), Some(&format!("k{i}")));
        }
        for i in 1..=3 {
            c.script(&format!("m{i}"), vec![Act::Transient("down".into())]);
        }
        if variant {
            c.script("m4", vec![Act::Transient("down".into())]);
        }
        let r = c.runner().breaker(3, 10.0).unwrap().build().unwrap();
        r.start();
        let t0 = tokio::time::Instant::now();
        let control = async {
            c.rec.wait_deliveries(5).await;
            r.stop();
        };
        let (done, ()) = tokio::join!(r.run_until_stopped(), control);
        done.unwrap();
        let t = offsets(&c, t0, None);
        let res = c.rec.results();
        assert!(
            res[..3]
                .iter()
                .all(|x| x.outcome == O::Recorded && x.committed)
        );
        if variant {
            assert_eq!(t, vec![0.0, 0.0, 0.0, 10.0, 20.0], "{t:?}");
            assert_eq!(res[3].outcome, O::Recorded);
        } else {
            assert_eq!(t, vec![0.0, 0.0, 0.0, 10.0, 10.0], "{t:?}");
            assert_eq!(res[3].outcome, O::Completed);
        }
        assert_eq!(res[4].outcome, O::Completed);
    }
}

/// Y-10: a run starts only with the handler timeout left on the lease; a lease not above
/// the handler timeout is rejected (R153).
pub async fn y_10<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let rows = [
        c.land("r1", Some("k")).await,
        c.land("r2", Some("k")).await,
        c.land("r3", Some("k")).await,
    ];
    c.handler.always(Act::Delay(Duration::from_millis(800)));
    let p = c
        .processor()
        .lease_ttl(Duration::from_secs(2))
        .handler_timeout(Duration::from_secs(1))
        .max_per_key(3)
        .build()
        .unwrap();
    let rep = c.cycle(&p).await;
    assert_eq!(rep.completed(), vec![rows[0].id, rows[1].id]);
    assert_eq!(rep.of(rows[2].id), Some(&RowReport::Released));
    assert_eq!(c.handler.runs_of("r3"), 0);
    assert!(
        c.processor()
            .lease_ttl(Duration::from_secs(1))
            .handler_timeout(Duration::from_secs(1))
            .build()
            .is_err()
    );
}

/// Y-19: the processor loop waits its poll interval after a cycle whose runs all failed
/// transient or not counted (R154, R159).
pub async fn y_19<F: InboxFactory>(f: &F) {
    for variant in [false, true] {
        let c = Ictx::new(f).await;
        c.land("m1", Some("k1")).await;
        c.land("m2", Some("k2")).await;
        c.handler.always(Act::Transient("down".into()));
        if variant {
            c.script("m2", vec![Act::Write]);
        } else {
            c.script(
                "m2",
                (0..10)
                    .map(|_| Act::Retry {
                        text: "x".into(),
                        counted: false,
                        at: None,
                    })
                    .collect(),
            );
        }
        let p = c
            .processor()
            .poll_interval(Duration::from_secs(5))
            .build()
            .unwrap();
        let token = CancellationToken::new();
        let t0 = tokio::time::Instant::now();
        let control = async {
            // The backend clock moves with tokio's paused clock, in 0.5 s steps.
            for _ in 0..24 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                c.advance(Duration::from_millis(500)).await;
            }
            token.cancel();
        };
        let (done, ()) = tokio::join!(p.run(token.clone()), control);
        done.unwrap();
        let t = offsets(&c, t0, Some("fetch"));
        if variant {
            assert_eq!(&t[..3], &[0.0, 0.0, 5.0], "{t:?}");
        } else {
            assert_eq!(&t[..3], &[0.0, 5.0, 10.0], "{t:?}");
        }
    }
}

/// F-23: a last delivery is never given back without a row: persistence errors and a failed
/// dead-letter copy are tried again in place every 1.0 s; a stop ends the retries and leaves
/// the delivery unended (R132, R140, R167, R182). Run on paused time.
pub async fn f_23<F: InboxFactory>(f: &F) {
    use txoutbox_core::inbox::scripted::AckOp;
    // (a) the database comes back 2.5 s after the first try.
    let c = Ictx::new(f).await;
    let i = c.deliver("m1", None);
    c.sub.last_at(i, 1);
    let r = c.runner().build().unwrap();
    c.h.set_db_down(true);
    let t0 = tokio::time::Instant::now();
    let control = async {
        tokio::time::sleep(Duration::from_millis(2500)).await;
        c.h.set_db_down(false);
    };
    let (res, ()) = tokio::join!(c.handle(&r), control);
    assert_eq!((res.outcome, res.committed), (O::Completed, true));
    assert_eq!(
        t0.elapsed(),
        Duration::from_secs(3),
        "tries at 0, 1, 2 and 3 s"
    );
    let fails = c
        .rec
        .results()
        .iter()
        .filter(|x| x.outcome == O::PersistFailed)
        .count();
    assert_eq!(fails, 3, "each failed try is counted");
    assert_eq!(c.sub.acks(i), vec![AckOp::Commit]);
    assert_eq!(c.effects().await, vec!["m1"]);
    // (b) a failed dead-letter copy is tried again 1.0 s later.
    let c = Ictx::new(f).await;
    let i = c.sub.push(c.msgs.nats(&[], "not json"));
    c.sub.last_at(i, 1);
    c.sub.fail_dead_letter();
    let r = c.runner().build().unwrap();
    let t0 = tokio::time::Instant::now();
    let res = c.handle(&r).await;
    assert_eq!(res.outcome, O::Invalid);
    assert_eq!(t0.elapsed(), Duration::from_secs(1));
    assert_eq!(
        c.sub.acks(i),
        vec![AckOp::Term("invalid message: body is not JSON".into())]
    );
    assert_eq!(c.sub.dead_letters().len(), 1);
    // (c) the database stays down; a stop 1.5 s after the first try ends the retries.
    let c = Ictx::new(f).await;
    let i = c.deliver("m3", None);
    c.sub.last_at(i, 1);
    let r = c
        .runner()
        .handler_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    c.h.set_db_down(true);
    r.start();
    let control = async {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let stopped = tokio::time::Instant::now();
        r.stop();
        stopped
    };
    let (done, stopped) = tokio::join!(r.run_until_stopped(), control);
    done.unwrap();
    assert!(
        stopped.elapsed() <= Duration::from_millis(500),
        "the stop ends within 0.5 s"
    );
    assert!(c.sub.acks(i).is_empty(), "no ack");
    c.h.set_db_down(false);
    assert!(c.row("m3").await.is_none());
}

/// F-26 (added by the suite): the runner renews every delivery it holds, the one being handled
/// and the one waiting for its key, at the subscription's renewal interval, until it ends it
/// (R134, R136, R166). Run on paused time.
pub async fn f_26<F: InboxFactory>(f: &F) {
    use crate::inbox::script::Gate;
    use txoutbox_core::inbox::scripted::AckOp;
    let c = Ictx::new(f).await;
    c.sub.renew_every(Duration::from_secs(1));
    let gate = Gate::new();
    let i1 = c.deliver("m1", Some("k"));
    let i2 = c.deliver("m2", Some("k"));
    c.script("m1", vec![Act::Gate(gate.clone())]);
    let r = c.runner().concurrency(2).build().unwrap();
    r.start();
    let control = async {
        gate.reached(1).await;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert_eq!(c.sub.acks(i1), vec![AckOp::Renew, AckOp::Renew]);
        assert_eq!(c.sub.acks(i2), vec![AckOp::Renew, AckOp::Renew]);
        gate.open();
        c.rec.wait_deliveries(2).await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        r.stop();
    };
    let (done, ()) = tokio::join!(r.run_until_stopped(), control);
    done.unwrap();
    assert_eq!(
        c.sub.acks(i1),
        vec![AckOp::Renew, AckOp::Renew, AckOp::Commit]
    );
    assert_eq!(
        c.sub.acks(i2),
        vec![AckOp::Renew, AckOp::Renew, AckOp::Commit]
    );
}

/// Y-20 (added by the suite): the processor's circuit breaker opens after `failure_threshold`
/// consecutive failed runs, counted or not; the rest of the cycle is released and no cycle
/// fetches until recovery_timeout passed; then one more failure opens it again (R62, R158).
/// Run on paused time.
pub async fn y_20<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let rows = [
        c.land("a", Some("k1")).await,
        c.land("b", Some("k2")).await,
        c.land("d", Some("k3")).await,
    ];
    c.handler.always(Act::Transient("down".into()));
    // One row per transaction: the breaker counts outcomes that committed (R190), and the
    // runs of one T_b commit together (conformance README).
    let p = c
        .processor()
        .rows_per_transaction(1)
        .breaker(2, 10.0)
        .unwrap()
        .build()
        .unwrap();
    let rep = c.cycle(&p).await;
    let failed = rep.outcomes.iter().filter(|(_, r)| r.is_failure()).count();
    assert_eq!((failed, rep.released().len()), (2, 1), "{rep:?}");
    assert!(c.cycle(&p).await.fetched.is_empty(), "open: no fetch");
    tokio::time::sleep(Duration::from_secs(10)).await;
    c.advance(Duration::from_secs(10)).await;
    let rep = c.cycle(&p).await;
    assert!(!rep.fetched.is_empty(), "half-open: the cycle fetches");
    let ran = rep.outcomes.iter().filter(|(_, r)| r.is_failure()).count();
    assert_eq!(ran, 1, "one more failure opens it again: {rep:?}");
    let _ = rows;
}
