//! F: runner failures, row states and takeovers (scenarios.md section 21).

use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::event::Status;
use txoutbox_core::inbox::repository::{InboxBackend, InboxTransaction};
use txoutbox_core::inbox::scripted::AckOp;
use txoutbox_core::inbox::{
    AckStrategy, AncestorAckSettings, CommitOffsetPolicy, DeliveryOutcome as O, OnFailure,
};

use crate::inbox::ctx::{Ictx, assert_within};
use crate::inbox::harness::{InboxFactory, InboxHarness, InboxPatch};
use crate::inbox::script::{Act, Gate};

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// F-01: a recorded failure is retried by a processor (R117, R119, R121, R126).
pub async fn f_01<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.script("m1", vec![Act::Fail("boom".into()), Act::Write]);
    let r = c.runner().build().unwrap();
    let before = c.now().await;
    let res = c.handle(&r).await;
    let after = c.now().await;
    assert_eq!((res.outcome, res.committed), (O::Recorded, true));
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Pending, 1, Some("boom"))
    );
    assert!(row.locked_at.is_none());
    assert_within(row.scheduled_at, before, after, 5.0, 10.0, "F-01");
    assert!(c.effects().await.is_empty());
    let wait = (row.scheduled_at - c.now().await)
        .to_std()
        .unwrap_or_default();
    c.advance(wait).await;
    let p = c.processor().build().unwrap();
    let rep = c.cycle(&p).await;
    assert_eq!(rep.completed(), vec![row.id]);
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// F-02: transient and not-counted failures are recorded without an attempt (R43, R44, R126).
pub async fn f_02<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let now = c.now().await;
    c.deliver("m1", Some("k1"));
    c.deliver("m2", Some("k2"));
    c.deliver("m3", Some("k3"));
    c.script("m1", vec![Act::Transient("down".into())]);
    c.script(
        "m2",
        vec![Act::Retry {
            text: "x".into(),
            counted: false,
            at: Some(now + chrono::Duration::seconds(42)),
        }],
    );
    c.script(
        "m3",
        vec![Act::Retry {
            text: "y".into(),
            counted: false,
            at: None,
        }],
    );
    let r = c.runner().build().unwrap();
    for _ in 0..3 {
        let res = c.handle(&r).await;
        assert_eq!((res.outcome, res.committed), (O::Recorded, true));
    }
    let t = c.now().await;
    for (id, err) in [("m1", "down"), ("m2", "x"), ("m3", "y")] {
        let row = c.row_of(id).await;
        assert_eq!(
            (row.status, row.attempts_made, row.last_error.as_deref()),
            (Status::Pending, 0, Some(err)),
            "{id}"
        );
        if id == "m2" {
            assert_eq!(
                row.scheduled_at,
                now + chrono::Duration::seconds(42),
                "{id}: next try"
            );
        } else {
            assert_within(row.scheduled_at, now, t, 1.0, 1.0, id);
        }
        assert!(row.locked_at.is_none());
    }
    assert!(c.effects().await.is_empty());
}

/// F-03: rewind delays grow by delivery number; the sixth delivery ends the message (R42,
/// R127, R128).
pub async fn f_03<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.handler.always(Act::Fail("boom".into()));
    let r = c.runner().on_failure(OnFailure::Rewind).build().unwrap();
    let windows = [
        (5.0, 10.0),
        (10.0, 20.0),
        (20.0, 40.0),
        (40.0, 80.0),
        (80.0, 160.0),
    ];
    let mut total = 0.0;
    for (i, (lo, hi)) in windows.iter().enumerate() {
        let res = c.handle(&r).await;
        assert_eq!(res.outcome, O::Rewound, "delivery {}", i + 1);
        let d = res.rewind_delay.expect("a rewind delay");
        assert!(
            d.as_secs_f64() >= *lo && d.as_secs_f64() <= *hi,
            "delivery {}: {d:?}",
            i + 1
        );
        assert!(c.row("m1").await.is_none());
        total += d.as_secs_f64();
        c.advance(d).await;
    }
    let res = c.handle(&r).await;
    assert_eq!((res.outcome, res.committed), (O::Recorded, true));
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Failed, 6, Some("boom"))
    );
    assert_eq!(c.rec.terminal_ids(), vec!["m1"]);
    assert!((155.0..=310.0).contains(&total), "waits sum to {total}");
    assert!(c.effects().await.is_empty());
}

/// F-04: with backoff base 0 the rewinds have delay 0 (R40, R127, R128).
pub async fn f_04<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.handler.always(Act::Fail("boom".into()));
    let r = c
        .runner()
        .on_failure(OnFailure::Rewind)
        .backoff(Ictx::<F::Harness>::backoff(0.0))
        .build()
        .unwrap();
    for i in 1..=5 {
        let res = c.handle(&r).await;
        assert_eq!(
            (res.outcome, res.rewind_delay),
            (O::Rewound, Some(Duration::ZERO)),
            "delivery {i}"
        );
    }
    let res = c.handle(&r).await;
    assert_eq!(res.outcome, O::Recorded);
    let row = c.row_of("m1").await;
    assert_eq!((row.status, row.attempts_made), (Status::Failed, 6));
}

/// F-05: transient failures never end a rewound message before the last delivery (R127,
/// R128).
pub async fn f_05<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let i = c.deliver("m1", Some("k"));
    c.sub.last_at(i, 9);
    c.handler.always(Act::Transient("down".into()));
    let r = c.runner().on_failure(OnFailure::Rewind).build().unwrap();
    for n in 1..=8 {
        let res = c.handle(&r).await;
        assert_eq!(
            (res.outcome, res.rewind_delay),
            (O::Rewound, Some(secs(1.0))),
            "delivery {n}"
        );
        assert!(c.row("m1").await.is_none());
        c.advance(secs(1.0)).await;
    }
    let res = c.handle(&r).await;
    assert_eq!((res.outcome, res.committed), (O::Recorded, true));
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Failed, 6, Some("down"))
    );
}

/// F-06: an explicit time on the rewind path; one beyond the cap is recorded (R127).
pub async fn f_06<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let now = c.now().await;
    c.deliver("m1", Some("k1"));
    c.deliver("m2", Some("k2"));
    c.script(
        "m1",
        vec![Act::Retry {
            text: "x".into(),
            counted: false,
            at: Some(now + chrono::Duration::seconds(42)),
        }],
    );
    let far = now + chrono::Duration::hours(2);
    c.script(
        "m2",
        vec![Act::Retry {
            text: "y".into(),
            counted: false,
            at: Some(far),
        }],
    );
    let r = c.runner().on_failure(OnFailure::Rewind).build().unwrap();
    let a = c.handle(&r).await;
    let after = c.now().await;
    assert_eq!(a.outcome, O::Rewound);
    let d = a.rewind_delay.unwrap().as_secs_f64();
    // at − now for the runner's now, which lies between `now` and `after` on a moving clock.
    let lo = (now + chrono::Duration::seconds(42) - after).as_seconds_f64() - 1e-3;
    assert!(
        (lo..=42.0).contains(&d),
        "m1 rewound with {d}, not in [{lo}, 42]"
    );
    assert!(c.row("m1").await.is_none());
    let b = c.handle(&r).await;
    assert_eq!((b.outcome, b.committed), (O::Recorded, true));
    assert_eq!(c.sub.acks(c.idx("m2")), vec![AckOp::Commit]);
    let row = c.row_of("m2").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Pending, 0, Some("y"))
    );
    assert_eq!(row.scheduled_at, far);
}

/// F-07: at_most_once counts every failure; the redelivery is a duplicate (R109, R129).
pub async fn f_07<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.script("m1", vec![Act::Transient("down".into())]);
    let r = c.runner().at_most_once(true).build().unwrap();
    let a = c.handle(&r).await;
    assert_eq!((a.outcome, a.committed), (O::Recorded, true));
    let row = c.row_of("m1").await;
    assert_eq!(
        (
            row.status,
            row.attempts_made,
            row.last_error.as_deref(),
            row.max_attempts
        ),
        (Status::Failed, 1, Some("down"), 1)
    );
    c.duplicate("m1");
    let b = c.handle(&r).await;
    assert_eq!((b.outcome, b.committed), (O::Duplicate, true));
    assert_eq!(c.handler.runs_of("m1"), 1);
}

/// F-08: a failed row's message is a duplicate under every policy (R109, R130).
pub async fn f_08<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", None).await;
    c.set(
        row.id,
        InboxPatch {
            status: Some(Status::Failed),
            attempts_made: Some(6),
            last_error: Some(Some("bad".into())),
            ..Default::default()
        },
    )
    .await;
    let before = c.row_of("m1").await;
    for policy in ["rewind", "record", "at_most_once"] {
        c.deliver("m1", None);
        let b = c.runner();
        let b = match policy {
            "rewind" => b.on_failure(OnFailure::Rewind),
            "record" => b.on_failure(OnFailure::Record),
            _ => b.at_most_once(true),
        };
        let res = c.handle(&b.build().unwrap()).await;
        assert_eq!(
            (res.outcome, res.committed),
            (O::Duplicate, true),
            "{policy}"
        );
    }
    assert_eq!(c.handler.runs_of("m1"), 0);
    assert_eq!(c.row_of("m1").await, before);
}

/// F-09: a row waiting for its retry is not run early (R116, R130).
pub async fn f_09<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", Some("k")).await;
    let now = c.now().await;
    c.set(
        row.id,
        InboxPatch {
            attempts_made: Some(2),
            last_error: Some(Some("bad".into())),
            scheduled_at: Some(now + chrono::Duration::hours(1)),
            ..Default::default()
        },
    )
    .await;
    let before = c.row_of("m1").await;
    c.deliver("m1", Some("k"));
    let res = c.handle(&c.runner().build().unwrap()).await;
    assert_eq!((res.outcome, res.committed), (O::Landed, true));
    assert_eq!(c.handler.runs_of("m1"), 0);
    assert_eq!(c.row_of("m1").await, before);
}

/// F-10: an expired lease is taken over; a live one is left (R116).
pub async fn f_10<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let m1 = c.land("m1", Some("k")).await;
    let m2 = c.land("m2", Some("j")).await;
    let now = c.now().await;
    c.set(
        m1.id,
        InboxPatch::held("dead", now - chrono::Duration::seconds(301)),
    )
    .await;
    c.set(
        m2.id,
        InboxPatch::held("live", now - chrono::Duration::seconds(10)),
    )
    .await;
    c.deliver("m1", Some("k"));
    c.deliver("m2", Some("j"));
    let r = c.runner().build().unwrap();
    let a = c.handle(&r).await;
    let b = c.handle(&r).await;
    assert_eq!((a.outcome, a.committed), (O::Completed, true));
    assert_eq!((b.outcome, b.committed), (O::Landed, true));
    let r1 = c.row_of("m1").await;
    assert!(r1.locked_at.is_none() && r1.locked_by.is_none());
    assert_eq!(c.row_of("m2").await.locked_by.as_deref(), Some("live"));
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// F-11: a row locked by another transaction is not waited for (R116, R130).
pub async fn f_11<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", None).await;
    let mut other = c.backend().begin().await.unwrap();
    let _ = other.lock_row(row.id).await.unwrap();
    c.deliver("m1", None);
    let r = c.runner().build().unwrap();
    let res = tokio::time::timeout(Duration::from_secs(1), c.handle(&r))
        .await
        .expect("handled within 1 s");
    assert_eq!((res.outcome, res.committed), (O::Landed, true));
    assert_eq!(c.handler.runs_of("m1"), 0);
    other.rollback().await;
}

/// F-12: a panic is a counted failure and the runner keeps going (R118, R119, R126).
pub async fn f_12<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.deliver("m2", Some("j"));
    c.script("m1", vec![Act::Panic("kaput".into())]);
    let r = c.runner().build().unwrap();
    let a = c.handle(&r).await;
    assert_eq!(a.outcome, O::Recorded);
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Pending, 1, Some("Handler panicked: kaput"))
    );
    let b = c.handle(&r).await;
    assert_eq!(b.outcome, O::Completed);
    assert_eq!(c.effects().await, vec!["m2"]);
}

/// F-14: a commit that fails after T is reported, not rewound; the redelivery is a duplicate
/// (R109, R131).
pub async fn f_14<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let i = c.deliver("m1", Some("k"));
    c.sub.fail_commit(i);
    let r = c.runner().build().unwrap();
    let a = c.handle(&r).await;
    assert_eq!(
        (a.outcome, a.committed, a.commit_failed),
        (O::Completed, false, true)
    );
    assert_eq!(c.sub.acks(i), vec![AckOp::Commit]);
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
    c.advance(Duration::from_secs(30)).await;
    let b = c.handle(&r).await;
    assert_eq!((b.outcome, b.committed), (O::Duplicate, true));
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// F-15: a message behind a recorded failure of its key waits for it (R144, R145, R150).
pub async fn f_15<F: InboxFactory>(f: &F) {
    key_trial(f, true).await;
}

/// F-16: with key order off nothing waits (R147).
pub async fn f_16<F: InboxFactory>(f: &F) {
    key_trial(f, false).await;
}

async fn key_trial<F: InboxFactory>(f: &F, key_order: bool) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.deliver("m2", Some("k"));
    c.script("m1", vec![Act::Fail("boom".into()), Act::Write]);
    let r = c.runner().key_order(key_order).build().unwrap();
    let a = c.handle(&r).await;
    assert_eq!(a.outcome, O::Recorded);
    let b = c.handle(&r).await;
    let p = c.processor().key_order(key_order).build().unwrap();
    let m1 = c.row_of("m1").await;
    let wait = (m1.scheduled_at - c.now().await)
        .to_std()
        .unwrap_or_default();
    c.advance(wait).await;
    if key_order {
        assert_eq!(
            (b.outcome, b.committed),
            (O::Landed, true),
            "m2 waits behind m1"
        );
        assert_eq!(c.handler.runs_of("m2"), 0);
        let m2 = c.row_of("m2").await;
        let c1 = c.cycle(&p).await;
        assert_eq!(c1.completed(), vec![m1.id], "the first cycle runs m1 only");
        let c2 = c.cycle(&p).await;
        assert_eq!(c2.completed(), vec![m2.id]);
        assert_eq!(c.effects().await, vec!["m1", "m2"]);
    } else {
        assert_eq!(
            (b.outcome, b.committed),
            (O::Completed, true),
            "m2 runs at once"
        );
        c.cycle(&p).await;
        assert_eq!(c.effects().await, vec!["m2", "m1"]);
    }
}

/// F-17: rows without a key hold nothing (R143).
pub async fn f_17<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", None);
    c.deliver("m2", None);
    c.script("m1", vec![Act::Fail("boom".into())]);
    let r = c.runner().build().unwrap();
    assert_eq!(c.handle(&r).await.outcome, O::Recorded);
    assert_eq!(c.handle(&r).await.outcome, O::Completed);
    assert_eq!(c.effects().await, vec!["m2"]);
}

/// F-18: configuration: defaults, checks and the ancestor's aliases (R10, R103, R121, R123,
/// R153, R165).
pub async fn f_18<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", None);
    c.deliver("m2", None);
    let r0 = c.bare_runner().max_attempts(0).build().unwrap();
    c.handle(&r0).await;
    assert_eq!(c.row_of("m1").await.max_attempts, 6);
    let r1 = c.bare_runner().at_most_once(true).build().unwrap();
    c.handle(&r1).await;
    assert_eq!(c.row_of("m2").await.max_attempts, 1);
    let e = c
        .runner()
        .handler_timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert_eq!(e.to_string(), "handler_timeout must be positive");
    let e = c
        .runner()
        .lease_ttl(Duration::from_secs(30))
        .handler_timeout(Duration::from_secs(30))
        .process_stored(true)
        .build();
    assert!(
        e.is_err(),
        "a lease not above the handler timeout is rejected (R153)"
    );
    let alias =
        |s: AckStrategy, cp: Option<CommitOffsetPolicy>, cf: Option<bool>| AncestorAckSettings {
            ack_strategy: Some(s),
            commit_offset_policy: cp,
            exactly_once_commit_on_failed: cf,
        };
    let cases = [
        (
            alias(AckStrategy::ExactlyOnceInbox, None, None),
            O::Recorded,
        ),
        (
            alias(AckStrategy::ExactlyOnceInbox, None, Some(false)),
            O::Rewound,
        ),
        (alias(AckStrategy::AtLeastOnce, None, None), O::Recorded),
        (
            alias(
                AckStrategy::AtLeastOnce,
                Some(CommitOffsetPolicy::OnSuccess),
                None,
            ),
            O::Rewound,
        ),
        (alias(AckStrategy::AtMostOnce, None, None), O::Recorded),
    ];
    for (i, (a, want)) in cases.into_iter().enumerate() {
        let id = format!("a{i}");
        c.deliver(&id, Some(&id));
        c.script(&id, vec![Act::Fail("x".into())]);
        let r = c.runner().ancestor_ack_settings(a).build().unwrap();
        let res = c.handle(&r).await;
        assert_eq!(res.outcome, want, "alias {a:?}");
        if a.ack_strategy == Some(AckStrategy::AtMostOnce) {
            let row = c.row_of(&id).await;
            assert_eq!((row.status, row.max_attempts), (Status::Failed, 1));
        }
    }
    let e = c
        .runner()
        .on_failure(OnFailure::Rewind)
        .ancestor_ack_settings(alias(AckStrategy::AtLeastOnce, None, None))
        .build()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "give on_failure and at_most_once, or the ancestor's ack settings, not both"
    );
    let w = "w".repeat(254);
    let e = c
        .runner()
        .worker_id(w.clone())
        .process_stored(true)
        .build()
        .unwrap_err();
    assert_eq!(e.to_string(), format!("Invalid worker_id format: '{w}/p'"));
}

/// F-19: runner shutdown: runs in flight finish, a waiting delivery goes back with delay 0, a
/// waiting last delivery is landed (R159, R166, R167, R182).
pub async fn f_19<F: InboxFactory>(f: &F) {
    for variant in [false, true] {
        let c = Ictx::new(f).await;
        let (g1, g3) = (Gate::new(), Gate::new());
        c.deliver("m1", Some("k"));
        let i2 = c.deliver("m2", Some("k"));
        c.deliver("m3", Some("j"));
        if variant {
            c.sub.last_at(i2, 1);
        }
        c.script("m1", vec![Act::Gate(g1.clone())]);
        c.script("m3", vec![Act::Gate(g3.clone())]);
        let r = c
            .runner()
            .concurrency(3)
            .process_stored(true)
            .build()
            .unwrap();
        r.start();
        let control = async {
            g1.reached(1).await;
            g3.reached(1).await;
            r.stop();
            g1.open();
            g3.open();
        };
        let (done, ()) = tokio::join!(r.run_until_stopped(), control);
        done.unwrap();
        r.stop();
        let res = c.rec.results();
        let of = |id: &str| {
            res.iter()
                .find(|x| x.message_id.as_deref() == Some(id))
                .cloned()
        };
        for id in ["m1", "m3"] {
            let x = of(id).unwrap_or_else(|| panic!("{id} has a result"));
            assert_eq!((x.outcome, x.committed), (O::Completed, true), "{id}");
        }
        assert_eq!(c.handler.runs_of("m2"), 0);
        if variant {
            assert_eq!(c.sub.acks(i2), vec![AckOp::Commit]);
            let row = c.row_of("m2").await;
            assert_eq!((row.status, row.attempts_made), (Status::Pending, 0));
        } else {
            assert_eq!(c.sub.acks(i2), vec![AckOp::Rewind(Duration::ZERO)]);
            assert!(c.row("m2").await.is_none());
        }
        assert!(c.sub.is_closed());
        let mut e = c.effects().await;
        e.sort();
        assert_eq!(e, vec!["m1", "m3"]);
    }
}

/// F-22: a persistence error takes its key's waiting deliveries back with it (R132, R144,
/// R166). As amended by issue 28, in the runner's loop "back" means kept: the failed delivery
/// and the one waiting behind it stay held, neither given back nor started, until a probe finds
/// the database answering (0.1 s later); then they run in their order.
pub async fn f_22<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let g3 = Gate::new();
    let i1 = c.deliver("m1", Some("k"));
    let i2 = c.deliver("m2", Some("k"));
    c.deliver("m3", Some("j"));
    c.script("m3", vec![Act::Gate(g3.clone())]);
    let r = Arc::new(c.runner().concurrency(4).build().unwrap());
    c.h.fail_next_row_commit();
    r.start();
    let control = async {
        c.rec.wait_deliveries(1).await;
        let first = c.rec.results()[0].clone();
        assert_eq!(first.message_id.as_deref(), Some("m1"));
        assert_eq!(first.outcome, O::PersistFailed);
        assert!(c.sub.acks(i1).is_empty(), "m1 kept, not given back");
        assert!(c.sub.acks(i2).is_empty(), "m2 kept, not given back");
        assert!(
            c.row("m1").await.is_none() && c.row("m2").await.is_none(),
            "no row of k"
        );
        g3.open();
        c.rec.wait_deliveries(2).await;
        c.advance(Duration::from_secs(1)).await;
        c.rec.wait_deliveries(4).await;
        r.stop();
    };
    let (done, ()) = tokio::join!(r.run_until_stopped(), control);
    done.unwrap();
    assert_eq!(c.effects().await, vec!["m3", "m1", "m2"]);
    assert_eq!(c.sub.acks(i1), vec![AckOp::Commit]);
    assert_eq!(c.sub.acks(i2), vec![AckOp::Commit]);
}

/// F-24: a broken transaction's failure is written under a guard (R122, R126, R181).
pub async fn f_24<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let m2 = c.land("m2", None).await;
    c.deliver("m1", None);
    c.deliver("m2", None);
    c.script("m1", vec![Act::BreakTx("gone".into(), None)]);
    let h = c.h.clone();
    let id = m2.id;
    let now = c.now().await;
    let hook: crate::inbox::script::Hook = Arc::new(move || {
        let h = h.clone();
        h.clone().before_next_begin(Box::pin(async move {
            h.set(
                id,
                InboxPatch {
                    status: Some(Status::Completed),
                    completed_at: Some(Some(now)),
                    ..Default::default()
                },
            )
            .await;
        }));
    });
    c.script("m2", vec![Act::BreakTx("gone".into(), Some(hook))]);
    let r = c.runner().build().unwrap();
    let a = c.handle(&r).await;
    assert_eq!(
        (a.outcome, a.committed, a.guard_failed),
        (O::Recorded, true, false)
    );
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Pending, 1, Some("gone"))
    );
    let b = c.handle(&r).await;
    assert_eq!(
        (b.outcome, b.committed, b.guard_failed),
        (O::Duplicate, true, true)
    );
    assert_eq!(b.error.as_deref(), Some("gone"));
    let row = c.row_of("m2").await;
    assert_eq!((row.status, row.attempts_made), (Status::Completed, 0));
    assert!(c.effects().await.is_empty());
}

/// F-27: a run that succeeds in a transaction that then breaks (the connection lost before the
/// outcome commits) is not handled: its writes are rolled back, no row is left completed
/// without them, the delivery goes back, and the next one has the effect once (R115, R119).
pub async fn f_27<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.script("m1", vec![Act::BreakTxOk, Act::Write]);
    let r = c.runner().build().unwrap();
    let a = c.handle(&r).await;
    assert_eq!((a.outcome, a.committed), (O::PersistFailed, false));
    assert_eq!(
        c.sub.acks(c.idx("m1")),
        vec![AckOp::Rewind(Duration::from_secs(1))]
    );
    assert!(c.row("m1").await.is_none(), "no row without the effect");
    assert!(c.effects().await.is_empty());
    c.advance(Duration::from_secs(1)).await;
    let b = c.handle(&r).await;
    assert_eq!((b.outcome, b.committed), (O::Completed, true));
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// F-25: the rewind policy records the failure of a row that existed before T (R127).
pub async fn f_25<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.land("m1", Some("k")).await;
    c.deliver("m1", Some("k"));
    c.script("m1", vec![Act::Fail("boom".into())]);
    let r = c.runner().on_failure(OnFailure::Rewind).build().unwrap();
    let before = c.now().await;
    let res = c.handle(&r).await;
    let after = c.now().await;
    assert_eq!((res.outcome, res.committed), (O::Recorded, true));
    assert_eq!(c.sub.acks(c.idx("m1")), vec![AckOp::Commit]);
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Pending, 1, Some("boom"))
    );
    assert!(row.locked_at.is_none());
    assert_within(row.scheduled_at, before, after, 5.0, 10.0, "F-25");
}

#[allow(dead_code)]
fn _h<H: InboxHarness>() {}
