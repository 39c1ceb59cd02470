//! Y: the inbox processor (scenarios.md section 23), with the ancestor's inbox IDs P-01, B-09,
//! B-11, T-09, H-02 to H-04 and H-07.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::CancellationToken;
use txoutbox_core::event::Status;
use txoutbox_core::event::WorkerId;
use txoutbox_core::inbox::repository::{InboxFetchRequest, InboxRepository};
use txoutbox_core::inbox::{DeliveryOutcome as O, RowReport};

use crate::inbox::ctx::{Ictx, assert_within, g};
use crate::inbox::harness::{InboxFactory, InboxHarness as _, InboxPatch};
use crate::inbox::script::Act;

fn fetch_req(worker: &str, limit: usize) -> InboxFetchRequest {
    let mut r = InboxFetchRequest::new(WorkerId::new(worker).unwrap(), g(), limit);
    r.max_per_key = 1;
    r
}

/// P-01 (amended): a skip completes the row (R155).
pub async fn p_01<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let a = c.land("m1", Some("k1")).await;
    let b = c.land("m2", Some("k2")).await;
    c.script("m1", vec![Act::Skip(String::new())]);
    c.script("m2", vec![Act::Skip(String::new())]);
    let p = c.processor().build().unwrap();
    let rep = c.cycle(&p).await;
    for id in [a.id, b.id] {
        assert_eq!(
            rep.of(id),
            Some(&RowReport::Skipped {
                reason: "Explicitly skipped".into()
            })
        );
    }
    for m in ["m1", "m2"] {
        let r = c.row_of(m).await;
        assert_eq!((r.status, r.attempts_made), (Status::Completed, 0));
        assert!(r.locked_at.is_none());
    }
    assert!(c.cycle(&p).await.fetched.is_empty());
}

async fn one_row<F: InboxFactory>(
    f: &F,
    act: Act,
    timeout: Duration,
) -> (
    Ictx<F::Harness>,
    RowReport,
    chrono::DateTime<chrono::Utc>,
    chrono::DateTime<chrono::Utc>,
) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", None).await;
    c.script("m1", vec![act]);
    let p = c.processor().handler_timeout(timeout).build().unwrap();
    let before = c.now().await;
    let rep = c.cycle(&p).await;
    let after = c.now().await;
    let r = rep.of(row.id).cloned().expect("reported");
    (c, r, before, after)
}

/// B-09: a handler timeout is counted with backoff (R118, R154, R165).
pub async fn b_09<F: InboxFactory>(f: &F) {
    let (c, rep, before, after) = one_row(f, Act::Hang, Duration::from_millis(50)).await;
    assert!(
        matches!(
            rep,
            RowReport::Counted {
                terminal: false,
                ..
            }
        ),
        "{rep:?}"
    );
    let r = c.row_of("m1").await;
    assert_eq!(
        (r.attempts_made, r.last_error.as_deref()),
        (1, Some("Handler execution timed out after 0.05s"))
    );
    assert_within(r.scheduled_at, before, after, 5.0, 10.0, "B-09");
}

/// B-11 (amended): a skip neither counts nor reschedules (R155).
pub async fn b_11<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", None).await;
    c.set(
        row.id,
        InboxPatch {
            attempts_made: Some(2),
            last_error: Some(Some("x".into())),
            ..Default::default()
        },
    )
    .await;
    let before = c.row_of("m1").await;
    c.script("m1", vec![Act::Skip("stale".into())]);
    let p = c.processor().build().unwrap();
    let rep = c.cycle(&p).await;
    assert_eq!(
        rep.of(row.id),
        Some(&RowReport::Skipped {
            reason: "stale".into()
        })
    );
    let r = c.row_of("m1").await;
    assert_eq!(
        (r.status, r.attempts_made, r.last_error.as_deref()),
        (Status::Completed, 2, Some("x"))
    );
    assert_eq!(r.scheduled_at, before.scheduled_at);
}

/// T-09: a transient error affects its own row only (R154).
pub async fn t_09<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let m1 = c.land("m1", Some("k1")).await;
    let m2 = c.land("m2", Some("k2")).await;
    c.script("m1", vec![Act::Transient("svc down".into())]);
    let p = c.processor().build().unwrap();
    let before = c.now().await;
    let rep = c.cycle(&p).await;
    let after = c.now().await;
    let r1 = c.row_of("m1").await;
    assert_eq!(
        (r1.attempts_made, r1.last_error.as_deref()),
        (0, Some("svc down"))
    );
    assert_within(r1.scheduled_at, before, after, 1.0, 1.0, "T-09");
    assert!(matches!(rep.of(m1.id), Some(RowReport::NotCounted { .. })));
    assert_eq!(rep.of(m2.id), Some(&RowReport::Completed { status: None }));
    assert_eq!(c.handler.runs_of("m1") + c.handler.runs_of("m2"), 2);
}

/// H-02: a status text is reported (R118, R157).
pub async fn h_02<F: InboxFactory>(f: &F) {
    let (c, rep, _, _) = one_row(f, Act::Ok(Some("ok".into())), Duration::from_secs(30)).await;
    assert_eq!(
        rep,
        RowReport::Completed {
            status: Some("ok".into())
        }
    );
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
}

/// H-03: a skip with a reason (R118, R155).
pub async fn h_03<F: InboxFactory>(f: &F) {
    let (c, rep, _, _) = one_row(f, Act::Skip("not for me".into()), Duration::from_secs(30)).await;
    assert_eq!(
        rep,
        RowReport::Skipped {
            reason: "not for me".into()
        }
    );
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
}

/// H-04: a skip without a reason (R118).
pub async fn h_04<F: InboxFactory>(f: &F) {
    let (c, rep, _, _) = one_row(f, Act::Skip(String::new()), Duration::from_secs(30)).await;
    assert_eq!(
        rep,
        RowReport::Skipped {
            reason: "Explicitly skipped".into()
        }
    );
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
}

/// H-07: a handler that never returns, timeout 0.01 s (R118, R165).
pub async fn h_07<F: InboxFactory>(f: &F) {
    let (c, rep, _, _) = one_row(f, Act::Hang, Duration::from_millis(10)).await;
    assert!(matches!(rep, RowReport::Counted { .. }));
    assert_eq!(
        c.row_of("m1").await.last_error.as_deref(),
        Some("Handler execution timed out after 0.01s")
    );
}

/// Y-01: a processor serves one group, and its sources (R148).
pub async fn y_01<F: InboxFactory>(f: &F) {
    for sources in [None, Some("src2")] {
        let c = Ictx::new(f).await;
        let m1 = c.land_in("g", "src", "m1", None).await;
        let m2 = c.land_in("g2", "src", "m2", None).await;
        let m3 = c.land_in("g", "src2", "m3", None).await;
        let mut b = c.processor();
        if let Some(s) = sources {
            b = b.sources([s]);
        }
        let rep = c.cycle(&b.build().unwrap()).await;
        let mut done = rep.completed();
        done.sort();
        let mut want = if sources.is_some() {
            vec![m3.id]
        } else {
            vec![m1.id, m3.id]
        };
        want.sort();
        assert_eq!(done, want, "sources {sources:?}");
        assert!(
            !rep.fetched.contains(&m2.id),
            "another group's row is never fetched"
        );
        assert_eq!(
            c.backend().get(m2.id).await.unwrap().unwrap().status,
            Status::Pending
        );
    }
}

/// Y-02: a failed run's writes are undone (R119, R152).
pub async fn y_02<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.land("m1", None).await;
    c.script("m1", vec![Act::Fail("boom".into()), Act::Write]);
    let p = c.processor().build().unwrap();
    c.cycle(&p).await;
    let r = c.row_of("m1").await;
    assert_eq!(
        (r.status, r.attempts_made, r.last_error.as_deref()),
        (Status::Pending, 1, Some("boom"))
    );
    assert!(
        c.effects().await.is_empty(),
        "the failed run's write is undone"
    );
    let wait = (r.scheduled_at - c.now().await)
        .to_std()
        .unwrap_or_default();
    c.advance(wait).await;
    c.cycle(&p).await;
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// Y-04 and Y-05: a counted failure holds its key and no other; order resumes after the retry
/// (R150, R154).
pub async fn y_04<F: InboxFactory>(f: &F) {
    y_04_05(f, false).await;
}

/// Y-05: see [`y_04`].
pub async fn y_05<F: InboxFactory>(f: &F) {
    y_04_05(f, true).await;
}

async fn y_04_05<F: InboxFactory>(f: &F, resume: bool) {
    let c = Ictx::new(f).await;
    let a = c.land("A", Some("k")).await;
    let b = c.land("B", Some("k")).await;
    let cc = c.land("C", Some("o")).await;
    c.script("A", vec![Act::Fail("bad".into()), Act::Write]);
    let p = c.processor().build().unwrap();
    let before = c.now().await;
    let c1 = c.cycle(&p).await;
    let after = c.now().await;
    assert_eq!(c1.completed(), vec![cc.id]);
    assert!(!c1.fetched.contains(&b.id));
    let ra = c.row_of("A").await;
    assert_eq!(
        (ra.status, ra.attempts_made, ra.last_error.as_deref()),
        (Status::Pending, 1, Some("bad"))
    );
    assert!(ra.locked_at.is_none());
    assert_within(ra.scheduled_at, before, after, 5.0, 10.0, "Y-04");
    assert_eq!(c.row_of("B").await, b);
    assert!(c.cycle(&p).await.fetched.is_empty());
    if resume {
        let wait = (ra.scheduled_at - c.now().await)
            .to_std()
            .unwrap_or_default();
        c.advance(wait).await;
        assert_eq!(c.cycle(&p).await.completed(), vec![a.id]);
        assert_eq!(c.cycle(&p).await.completed(), vec![b.id]);
        assert_eq!(c.effects().await, vec!["C", "A", "B"]);
    }
}

/// Y-06: a terminally failed head releases its key (R31, R101, R150).
pub async fn y_06<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let a = c.land("A", Some("k")).await;
    let b = c.land("B", Some("k")).await;
    c.set(
        a.id,
        InboxPatch {
            max_attempts: Some(1),
            ..Default::default()
        },
    )
    .await;
    c.script("A", vec![Act::Fail("bad".into())]);
    let p = c.processor().build().unwrap();
    c.cycle(&p).await;
    assert_eq!(c.row_of("A").await.status, Status::Failed);
    assert_eq!(c.cycle(&p).await.completed(), vec![b.id]);
}

/// Y-07: rows without a key are not ordered (R150).
pub async fn y_07<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let a = c.land("A", None).await;
    let b = c.land("B", None).await;
    c.script("A", vec![Act::Fail("bad".into())]);
    let rep = c.cycle(&c.processor().build().unwrap()).await;
    assert!(matches!(rep.of(a.id), Some(RowReport::Counted { .. })));
    assert_eq!(rep.of(b.id), Some(&RowReport::Completed { status: None }));
}

/// Y-08: a failure in the middle of a run releases the rows behind it untouched (R151).
pub async fn y_08<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let mut rows = Vec::new();
    for i in 1..=5 {
        rows.push(c.land(&format!("e{i}"), Some("k")).await);
    }
    c.script("e3", vec![Act::Fail("bad".into())]);
    let rep = c
        .cycle(&c.processor().max_per_key(5).build().unwrap())
        .await;
    assert_eq!(rep.completed(), vec![rows[0].id, rows[1].id]);
    assert!(matches!(
        rep.of(rows[2].id),
        Some(RowReport::Counted { .. })
    ));
    assert_eq!(rep.released(), vec![rows[3].id, rows[4].id]);
    for i in [3, 4] {
        let now = c.row_of(&format!("e{}", i + 1)).await;
        let was = &rows[i];
        assert_eq!(
            (
                now.status,
                now.attempts_made,
                &now.last_error,
                now.scheduled_at,
                now.locked_at
            ),
            (
                was.status,
                was.attempts_made,
                &was.last_error,
                was.scheduled_at,
                None
            ),
            "released untouched"
        );
    }
    assert_eq!(c.handler.runs_of("e4") + c.handler.runs_of("e5"), 0);
}

/// Y-09: never two rows of one key at once, and at most handler_concurrency runs (R151).
pub async fn y_09<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let mut order: HashMap<String, Vec<String>> = HashMap::new();
    for n in 0..5 {
        for k in 0..10 {
            let id = format!("k{k}-{n}");
            c.land(&id, Some(&format!("k{k}"))).await;
            order.entry(format!("k{k}")).or_default().push(id);
        }
    }
    c.handler.always(Act::Delay(Duration::from_millis(2)));
    let p = c
        .processor()
        .max_per_key(5)
        .handler_concurrency(4)
        .build()
        .unwrap();
    for _ in 0..100 {
        if c.cycle(&p).await.fetched.is_empty() {
            break;
        }
    }
    let runs = c.handler.runs();
    assert_eq!(runs.len(), 50);
    for (k, ids) in &order {
        let mine: Vec<_> = runs
            .iter()
            .filter(|r| r.message_id.starts_with(&format!("{k}-")))
            .collect();
        let started: Vec<_> = mine.iter().map(|r| r.message_id.clone()).collect();
        assert_eq!(&started, ids, "key {k} runs in write order");
        for w in mine.windows(2) {
            assert!(w[0].end.unwrap() <= w[1].start, "key {k}: runs overlap");
        }
    }
    let mut max = 0;
    let mut peak2 = false;
    for r in &runs {
        let at = r.start;
        let n = runs
            .iter()
            .filter(|x| x.start <= at && x.end.unwrap() > at)
            .count();
        max = max.max(n);
        peak2 |= n >= 2;
    }
    assert!(peak2, "some runs overlapped");
    assert!(max <= 4, "at most four runs at once, saw {max}");
}

/// Y-11: a row commit failure leaves the row leased, without effects (R119, R156).
pub async fn y_11<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", None).await;
    c.h.fail_next_row_commit();
    // One row per transaction: a T_b whose commit fails hands its rows again at once (R189,
    // BT-11), not after the lease (conformance README).
    let p = c.processor().rows_per_transaction(1).build().unwrap();
    let rep = c.cycle(&p).await;
    assert!(
        matches!(rep.of(row.id), Some(RowReport::CommitFailed { .. })),
        "{rep:?}"
    );
    let r = c.row_of("m1").await;
    assert_eq!(
        (r.status, r.attempts_made, r.locked_by.as_deref()),
        (Status::Pending, 0, Some("p1"))
    );
    assert!(c.effects().await.is_empty());
    c.advance(Duration::from_secs(301)).await;
    assert_eq!(c.cycle(&p).await.completed(), vec![row.id]);
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// Y-21: a run that succeeds in a T_row that then breaks (the connection lost before the
/// outcome commits) does not complete the row without its writes: it is reported as a failed
/// commit and the row, still leased, runs again after the lease (R119, R152, R156).
pub async fn y_21<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", None).await;
    c.script("m1", vec![Act::BreakTxOk, Act::Write]);
    // One row per transaction: a broken T_b hands its rows again at once (R189, the principle
    // of batches.md), not after the lease (conformance README).
    let p = c.processor().rows_per_transaction(1).build().unwrap();
    let rep = c.cycle(&p).await;
    assert!(
        matches!(rep.of(row.id), Some(RowReport::CommitFailed { .. })),
        "{rep:?}"
    );
    let r = c.row_of("m1").await;
    assert_eq!(
        (r.status, r.attempts_made, r.locked_by.as_deref()),
        (Status::Pending, 0, Some("p1"))
    );
    assert!(c.effects().await.is_empty());
    c.advance(Duration::from_secs(301)).await;
    assert_eq!(c.cycle(&p).await.completed(), vec![row.id]);
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// Y-12: a lease lost before the run: the handler is not called (R152, R156).
pub async fn y_12<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let row = c.land("m1", None).await;
    let w1 = c.processor().worker_id("W1").build().unwrap();
    let w2 = c.processor().worker_id("W2").build().unwrap();
    assert_eq!(
        c.backend()
            .fetch_and_lock(&fetch_req("W1", 10))
            .await
            .unwrap()
            .len(),
        1
    );
    c.advance(Duration::from_secs(301)).await;
    assert_eq!(
        c.backend()
            .fetch_and_lock(&fetch_req("W2", 10))
            .await
            .unwrap()
            .len(),
        1
    );
    // The row as it stands: the test clock (advance) moves created_at back with the other times.
    let row = c.backend().get(row.id).await.unwrap().expect("the row");
    assert_eq!(
        w1.run_row(row.id, row.created_at).await,
        RowReport::LeaseLost
    );
    assert_eq!(c.handler.runs_of("m1"), 0);
    assert_eq!(
        w2.run_row(row.id, row.created_at).await,
        RowReport::Completed { status: None }
    );
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// Y-13: a shutdown in the middle of a cycle releases the rows not started (R159).
pub async fn y_13<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    for (m, k) in [("a", "k1"), ("b", "k2"), ("cc", "k3")] {
        c.land(m, Some(k)).await;
    }
    let token = CancellationToken::new();
    let t2 = token.clone();
    struct Cancel(CancellationToken);
    impl txoutbox_core::inbox::InboxHooks for Cancel {
        fn on_row(&self, _: uuid::Uuid, _: Option<&str>, _: &RowReport, _: Option<Duration>) {
            self.0.cancel();
        }
    }
    // One row per transaction: the hook that sets the signal runs after each commit, which
    // in a T_b of several rows comes after every run of it (R158, conformance README).
    let w1 = c
        .processor()
        .rows_per_transaction(1)
        .worker_id("w1")
        .hooks(Arc::new(Cancel(t2)))
        .build()
        .unwrap();
    let rep = w1.cycle(&token).await.unwrap();
    assert_eq!(rep.completed().len(), 1);
    assert_eq!(rep.released().len(), 2);
    let w2 = c.processor().worker_id("w2").build().unwrap();
    let rep2 = c.cycle(&w2).await;
    let mut a = rep2.completed();
    let mut b = rep.released();
    a.sort();
    b.sort();
    assert_eq!(
        a, b,
        "w2 runs the released rows without waiting for a lease"
    );
}

/// Y-14: a requeued row re-enters its key's line (R32, R162).
pub async fn y_14<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let a = c.land("A", Some("k")).await;
    let b = c.land("B", Some("k")).await;
    let cc = c.land("C", Some("k")).await;
    c.set(
        a.id,
        InboxPatch {
            max_attempts: Some(1),
            ..Default::default()
        },
    )
    .await;
    c.script("A", vec![Act::Fail("bad".into()), Act::Write]);
    let p = c.processor().build().unwrap();
    c.cycle(&p).await;
    assert_eq!(c.row_of("A").await.status, Status::Failed);
    assert_eq!(c.cycle(&p).await.completed(), vec![b.id]);
    assert!(c.backend().requeue_failed(a.id).await.unwrap());
    assert_eq!(c.cycle(&p).await.completed(), vec![a.id]);
    assert_eq!(c.cycle(&p).await.completed(), vec![cc.id]);
    assert_eq!(c.effects().await, vec!["B", "A", "C"]);
}

/// Y-15: a terminal failure is reported after the commit, and not when it failed (R158).
pub async fn y_15<F: InboxFactory>(f: &F) {
    for fail_commit in [false, true] {
        let c = Ictx::new(f).await;
        let d1 = c.land("d1", Some("k1")).await;
        c.land("d2", Some("k2")).await;
        c.set(
            d1.id,
            InboxPatch {
                attempts_made: Some(1),
                max_attempts: Some(2),
                ..Default::default()
            },
        )
        .await;
        let d2 = c.row_of("d2").await;
        c.set(
            d2.id,
            InboxPatch {
                max_attempts: Some(2),
                ..Default::default()
            },
        )
        .await;
        c.handler.always(Act::Fail("x".into()));
        if fail_commit {
            c.h.fail_next_row_commit();
        }
        // One row per transaction: after a T_b's failed commit its rows run again at once in
        // T_rows of their own (R189), whose terminal failure is then reported (README).
        let p = c
            .processor()
            .rows_per_transaction(1)
            .backoff(Ictx::<F::Harness>::backoff(0.0))
            .build()
            .unwrap();
        c.cycle(&p).await;
        let t = c.rec.terminal.lock().unwrap().clone();
        if fail_commit {
            assert!(t.is_empty(), "no hook after a failed commit: {t:?}");
        } else {
            assert_eq!(t.len(), 1);
            assert_eq!(
                (t[0].0.as_str(), t[0].2, t[0].3.as_str()),
                ("d1", 1, "x"),
                "the row as before the failure"
            );
            let r = c.row_of("d1").await;
            assert_eq!((r.status, r.attempts_made), (Status::Failed, 2));
            let r2 = c.row_of("d2").await;
            assert_eq!((r2.status, r2.attempts_made), (Status::Pending, 1));
        }
    }
}

/// Y-17: the embedded processor runs recorded failures under `{worker}/p`, with its runner's
/// handler and sources only (R121, R148).
pub async fn y_17<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.script("m1", vec![Act::Fail("boom".into()), Act::Write]);
    let r = c
        .runner()
        .process_stored(true)
        .processor_poll_interval(Duration::from_millis(100))
        .build()
        .unwrap();
    let p = r.embedded_processor().expect("process_stored builds one");
    assert_eq!(p.config().worker().as_str(), "w1/p");
    assert_eq!(c.handle(&r).await.outcome, O::Recorded);
    let row = c.row_of("m1").await;
    let wait = (row.scheduled_at - c.now().await)
        .to_std()
        .unwrap_or_default();
    c.advance(wait).await;
    r.start();
    let control = async {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        while c.row_of("m1").await.status != Status::Completed
            && tokio::time::Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        r.stop();
    };
    let (done, ()) = tokio::join!(r.run_until_stopped(), control);
    done.unwrap();
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
    assert_eq!(c.effects().await, vec!["m1"]);
}

/// Y-18: a poison message's course: retried with backoff while it holds and lists its key,
/// then failed, its key going on; requeued, it completes (R42, R158, R160 to R162).
pub async fn y_18<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.deliver("m2", Some("k"));
    c.deliver("m3", Some("j"));
    c.script("m1", (0..6).map(|_| Act::Fail("poison".into())).collect());
    let r = c.runner().build().unwrap();
    assert_eq!(c.handle(&r).await.outcome, O::Recorded);
    assert_eq!(c.handle(&r).await.outcome, O::Landed);
    assert_eq!(c.handle(&r).await.outcome, O::Completed);
    let p = c.processor().build().unwrap();
    let mut waits = 0.0;
    for attempt in 1..=5 {
        let bk = c
            .backend()
            .blocked_keys(&g(), Duration::from_secs(300), 10)
            .await
            .unwrap();
        assert_eq!(bk.len(), 1, "only k is blocked");
        assert_eq!(
            (
                bk[0].message_id.as_str(),
                bk[0].attempts_made,
                bk[0].waiting
            ),
            ("m1", attempt, 1)
        );
        let row = c.row_of("m1").await;
        let wait = (row.scheduled_at - c.now().await)
            .to_std()
            .unwrap_or_default();
        waits += wait.as_secs_f64();
        c.advance(wait).await;
        c.cycle(&p).await;
    }
    let row = c.row_of("m1").await;
    assert_eq!(
        (row.status, row.attempts_made, row.last_error.as_deref()),
        (Status::Failed, 6, Some("poison"))
    );
    assert_eq!(c.rec.terminal_ids(), vec!["m1"]);
    let m2 = c.row_of("m2").await;
    assert_eq!(c.cycle(&p).await.completed(), vec![m2.id]);
    assert!(c.backend().requeue_failed(row.id).await.unwrap());
    c.cycle(&p).await;
    c.cycle(&p).await;
    assert_eq!(c.row_of("m1").await.status, Status::Completed);
    assert_eq!(c.effects().await, vec!["m3", "m2", "m1"]);
    assert!((150.0..=310.0).contains(&waits), "waits {waits}");
}

/// Y-22 (added by the suite): a fetch finds the heads past a window full of rows that cannot
/// go. Key s's head waits for its retry an hour later with 100 due rows behind it (more than the
/// window a Postgres fetch of 5 reads, 64 rows), then five keys of one row each are landed: a
/// fetch of 5 returns those five, in head order, and nothing of s; a second fetch returns nothing
/// (R20, R27, R85, R150).
pub async fn y_22<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let head = c.land("s0", Some("s")).await;
    let now = c.now().await;
    c.set(
        head.id,
        InboxPatch {
            attempts_made: Some(1),
            last_error: Some(Some("boom".into())),
            scheduled_at: Some(now + chrono::Duration::hours(1)),
            ..Default::default()
        },
    )
    .await;
    for i in 1..=100 {
        c.land(&format!("s{i}"), Some("s")).await;
    }
    let mut free = Vec::new();
    for i in 1..=5 {
        free.push(c.land(&format!("f{i}"), Some(&format!("f{i}"))).await.id);
    }
    let got = c
        .backend()
        .fetch_and_lock(&fetch_req("W1", 5))
        .await
        .unwrap();
    assert_eq!(got.iter().map(|r| r.id()).collect::<Vec<_>>(), free);
    assert!(
        c.backend()
            .fetch_and_lock(&fetch_req("W2", 5))
            .await
            .unwrap()
            .is_empty()
    );
}
