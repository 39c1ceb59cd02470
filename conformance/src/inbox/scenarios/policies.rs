//! N: the runner and its failure policies (scenarios.md section 20; the ancestor's ack
//! strategies).

use std::time::Duration;

use txoutbox_core::event::Status;
use txoutbox_core::inbox::scripted::AckOp;
use txoutbox_core::inbox::{DeliveryOutcome as O, OnFailure};

use crate::inbox::ctx::{Ictx, assert_within};
use crate::inbox::harness::{InboxFactory, InboxHarness as _, InboxPatch};
use crate::inbox::script::Act;

async fn rewind_trial<F: InboxFactory>(
    f: &F,
    act: Act,
) -> (Ictx<F::Harness>, txoutbox_core::inbox::DeliveryResult) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.script("m1", vec![act]);
    let r = c
        .runner()
        .on_failure(OnFailure::Rewind)
        .handler_timeout(Duration::from_millis(50))
        .process_stored(false)
        .build()
        .expect("runner");
    let res = c.handle(&r).await;
    (c, res)
}

fn rewound_in(acks: &[AckOp], lo: f64, hi: f64) {
    assert_eq!(acks.len(), 1, "one ack: {acks:?}");
    match &acks[0] {
        AckOp::Rewind(d) => assert!(
            d.as_secs_f64() >= lo && d.as_secs_f64() <= hi,
            "rewind delay {d:?} not in [{lo}, {hi}]"
        ),
        other => panic!("expected a rewind, got {other:?}"),
    }
}

/// N-01: a handler run that writes completes the row and commits (R115, R119, R125).
pub async fn n_01<F: InboxFactory>(f: &F) {
    let (c, r) = rewind_trial(f, Act::Write).await;
    assert_eq!((r.outcome, r.committed), (O::Completed, true));
    assert_eq!(c.sub.acks(0), vec![AckOp::Commit]);
    let row = c.row_of("m1").await;
    assert_eq!((row.status, row.attempts_made), (Status::Completed, 0));
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// N-02: under rewind a failure stores nothing and rewinds 5 to 10 s (R119, R127).
pub async fn n_02<F: InboxFactory>(f: &F) {
    let (c, r) = rewind_trial(f, Act::Fail("boom".into())).await;
    assert_eq!((r.outcome, r.committed), (O::Rewound, false));
    rewound_in(&c.sub.acks(0), 5.0, 10.0);
    assert!(c.row("m1").await.is_none(), "nothing stored");
    assert!(
        c.effects().await.is_empty(),
        "the failed run's write is undone"
    );
}

/// N-03: retry("later") is rewound 5 to 10 s (R118, R127).
pub async fn n_03<F: InboxFactory>(f: &F) {
    let (c, r) = rewind_trial(
        f,
        Act::Retry {
            text: "later".into(),
            counted: true,
            at: None,
        },
    )
    .await;
    assert_eq!(r.outcome, O::Rewound);
    rewound_in(&c.sub.acks(0), 5.0, 10.0);
    assert!(c.row("m1").await.is_none());
}

/// N-04: a skip completes the row and commits (R118, R125).
pub async fn n_04<F: InboxFactory>(f: &F) {
    let (c, r) = rewind_trial(f, Act::Skip(String::new())).await;
    assert_eq!((r.outcome, r.committed), (O::Skipped, true));
    assert_eq!(c.sub.acks(0), vec![AckOp::Commit]);
    let row = c.row_of("m1").await;
    assert_eq!((row.status, row.attempts_made), (Status::Completed, 0));
    assert!(c.effects().await.is_empty());
}

/// N-05: without a handler the row is landed pending, not held, and committed (R125).
pub async fn n_05<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    let r = c
        .bare_runner()
        .on_failure(OnFailure::Rewind)
        .build()
        .unwrap();
    let res = c.handle(&r).await;
    assert_eq!((res.outcome, res.committed), (O::Landed, true));
    assert_eq!(c.sub.acks(0), vec![AckOp::Commit]);
    let row = c.row_of("m1").await;
    assert_eq!((row.status, row.attempts_made), (Status::Pending, 0));
    assert!(row.locked_at.is_none() && row.locked_by.is_none());
}

async fn record_trial<F: InboxFactory>(
    f: &F,
    act: Act,
    policy: Option<OnFailure>,
) -> (
    Ictx<F::Harness>,
    txoutbox_core::inbox::DeliveryResult,
    chrono::DateTime<chrono::Utc>,
    chrono::DateTime<chrono::Utc>,
) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.script("m1", vec![act]);
    let mut b = c.runner();
    if let Some(p) = policy {
        b = b.on_failure(p);
    }
    let r = b.build().expect("runner");
    let before = c.now().await;
    let res = c.handle(&r).await;
    let after = c.now().await;
    (c, res, before, after)
}

/// N-06: by default a failure is recorded in the row and committed (R126, D33).
pub async fn n_06<F: InboxFactory>(f: &F) {
    let (c, r, before, after) = record_trial(f, Act::Fail("boom".into()), None).await;
    assert_eq!((r.outcome, r.committed), (O::Recorded, true));
    assert_eq!(c.sub.acks(0), vec![AckOp::Commit]);
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Pending, 1, Some("boom"))
    );
    assert_within(row.scheduled_at, before, after, 5.0, 10.0, "N-06");
    assert!(row.locked_at.is_none());
    assert!(c.effects().await.is_empty());
}

/// N-07: a handler that hangs past the timeout is a counted failure, rewound (R118, R165).
pub async fn n_07<F: InboxFactory>(f: &F) {
    let (c, r) = rewind_trial(f, Act::Hang).await;
    assert_eq!(r.outcome, O::Rewound);
    assert_eq!(
        r.error.as_deref(),
        Some("Handler execution timed out after 0.05s")
    );
    rewound_in(&c.sub.acks(0), 5.0, 10.0);
    assert!(c.row("m1").await.is_none());
}

/// N-08: on_failure record: fail("boom") is recorded with backoff (R126).
pub async fn n_08<F: InboxFactory>(f: &F) {
    let (c, r, before, after) =
        record_trial(f, Act::Fail("boom".into()), Some(OnFailure::Record)).await;
    assert_eq!((r.outcome, r.committed), (O::Recorded, true));
    let row = c.row_of("m1").await;
    assert_eq!((row.status, row.attempts_made), (Status::Pending, 1));
    assert_eq!(row.last_error.as_deref(), Some("boom"));
    assert_within(row.scheduled_at, before, after, 5.0, 10.0, "N-08");
    assert!(c.effects().await.is_empty());
}

/// N-09: on_failure record: retry("later") is recorded (R126).
pub async fn n_09<F: InboxFactory>(f: &F) {
    let (c, r, _, _) = record_trial(
        f,
        Act::Retry {
            text: "later".into(),
            counted: true,
            at: None,
        },
        Some(OnFailure::Record),
    )
    .await;
    assert_eq!((r.outcome, r.committed), (O::Recorded, true));
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Pending, 1, Some("later"))
    );
}

/// N-10: on_failure rewind: fail("boom") is rewound 5 to 10 s (R127).
pub async fn n_10<F: InboxFactory>(f: &F) {
    let (c, r) = rewind_trial(f, Act::Fail("boom".into())).await;
    assert_eq!(r.outcome, O::Rewound);
    rewound_in(&c.sub.acks(0), 5.0, 10.0);
    assert!(c.row("m1").await.is_none());
}

/// N-11: on_failure rewind: a skip completes and commits (R125).
pub async fn n_11<F: InboxFactory>(f: &F) {
    let (c, r) = rewind_trial(f, Act::Skip(String::new())).await;
    assert_eq!((r.outcome, r.committed), (O::Skipped, true));
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
}

/// N-12: at_most_once: committed before the run; a failure makes the row failed at once
/// (R129).
pub async fn n_12<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.script("m1", vec![Act::Fail("boom".into())]);
    let r = c.runner().at_most_once(true).build().unwrap();
    let res = c.handle(&r).await;
    assert_eq!((res.outcome, res.committed), (O::Recorded, true));
    assert_eq!(c.sub.acks(0), vec![AckOp::Commit]);
    let row = c.row_of("m1").await;
    assert_eq!(
        (
            row.status,
            row.attempts_made,
            row.last_error.as_deref(),
            row.max_attempts
        ),
        (Status::Failed, 1, Some("boom"), 1)
    );
    assert!(c.effects().await.is_empty());
}

/// N-13: at_most_once with a write completes, max_attempts 1 (R129).
pub async fn n_13<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    let r = c.runner().at_most_once(true).build().unwrap();
    let res = c.handle(&r).await;
    assert_eq!((res.outcome, res.committed), (O::Completed, true));
    let row = c.row_of("m1").await;
    assert_eq!((row.status, row.max_attempts), (Status::Completed, 1));
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// N-14: a redelivery of a completed message is a duplicate naming the first row (R109, R119).
pub async fn n_14<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    let r = c.runner().build().unwrap();
    let first = c.handle(&r).await;
    assert_eq!((first.outcome, first.committed), (O::Completed, true));
    c.duplicate("m1");
    let second = c.handle(&r).await;
    assert_eq!((second.outcome, second.committed), (O::Duplicate, true));
    assert_eq!(second.row_id, first.row_id);
    assert_eq!(c.sub.acks(0), vec![AckOp::Commit, AckOp::Commit]);
    assert_eq!(c.effects().await, vec!["m1"]);
    assert_eq!(c.handler.runs_of("m1"), 1);
}

/// N-15: landed by a runner without a handler, then handled by w2 on redelivery (R116, R125).
pub async fn n_15<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    let bare = c.bare_runner().build().unwrap();
    let w2 = c.runner().worker_id("w2").build().unwrap();
    let a = c.handle(&bare).await;
    assert_eq!((a.outcome, a.committed), (O::Landed, true));
    c.duplicate("m1");
    let b = c.handle(&w2).await;
    assert_eq!((b.outcome, b.committed), (O::Completed, true));
    let row = c.row_of("m1").await;
    assert_eq!(row.status, Status::Completed);
    assert!(row.locked_at.is_none());
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// N-16: a row held by another worker under a live lease is landed, committed, not run
/// (R116, R130).
pub async fn n_16<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", Some("k")).await;
    let now = c.now().await;
    c.set(row.id, InboxPatch::held("other", now)).await;
    c.deliver("m1", Some("k"));
    let r = c.runner().build().unwrap();
    let res = c.handle(&r).await;
    assert_eq!((res.outcome, res.committed), (O::Landed, true));
    assert_eq!(c.handler.runs_of("m1"), 0);
    let after = c.row_of("m1").await;
    assert_eq!(after.locked_by.as_deref(), Some("other"));
    assert_eq!(after.status, Status::Pending);
}

/// N-17: the same message in another group is another row (R108).
pub async fn n_17<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    let rg = c.runner().build().unwrap();
    let rg2 = txoutbox_core::inbox::Runner::builder(
        c.backend(),
        std::sync::Arc::new(c.sub.clone()),
        "g2",
    )
    .handler(c.handler.clone())
    .worker_id("w2")
    .messages_per_transaction(1)
    .concurrency(1)
    .process_stored(false)
    .build()
    .unwrap();
    let a = c.handle(&rg).await;
    c.duplicate("m1");
    let b = c.handle(&rg2).await;
    assert_eq!((a.outcome, a.committed), (O::Completed, true));
    assert_eq!((b.outcome, b.committed), (O::Completed, true));
    assert_ne!(a.row_id, b.row_id);
    let g2 = txoutbox_core::inbox::ConsumerGroup::new("g2").unwrap();
    use txoutbox_core::inbox::InboxRepository;
    assert!(
        c.backend()
            .get_by_message_id("m1", &g2)
            .await
            .unwrap()
            .is_some()
    );
    assert!(c.row("m1").await.is_some());
    assert_eq!(c.effects().await, vec!["m1", "m1"]);
}

/// N-18: a persistence failure stores nothing; record and rewind rewind 1.0 s; at_most_once
/// loses the delivery after its commit (R129, R132).
pub async fn n_18<F: InboxFactory>(f: &F) {
    for policy in ["record", "rewind", "at_most_once"] {
        let c = Ictx::new(f).await;
        c.deliver("m1", Some("k"));
        let mut b = c.runner();
        b = match policy {
            "record" => b.on_failure(OnFailure::Record),
            "rewind" => b.on_failure(OnFailure::Rewind),
            _ => b.at_most_once(true),
        };
        let r = b.build().unwrap();
        c.h.set_db_down(true);
        let res = c.handle(&r).await;
        c.h.set_db_down(false);
        assert_eq!(res.outcome, O::PersistFailed, "{policy}");
        assert!(res.error.is_some(), "{policy}: the cause is reported");
        if policy == "at_most_once" {
            assert_eq!(c.sub.acks(0), vec![AckOp::Commit], "{policy}");
            c.advance(Duration::from_secs(60)).await;
            assert!(
                r.handle_next().await.unwrap().is_none(),
                "not delivered again"
            );
        } else {
            assert_eq!(
                c.sub.acks(0),
                vec![AckOp::Rewind(Duration::from_secs(1))],
                "{policy}"
            );
        }
        assert!(c.row("m1").await.is_none(), "{policy}: no row");
        assert!(c.effects().await.is_empty());
    }
}
