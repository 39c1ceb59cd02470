//! W: writing, and I: idempotency.

use std::time::Duration;

use serde_json::json;
use txoutbox_core::event::Status;

use crate::ctx::Ctx;
use crate::harness::Factory;

/// W-01 Visibility follows the caller's commit.
pub async fn w_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.ev("k").build().unwrap();
    let a_id = a.id();
    let mut t = c.begin().await;
    let r = t.write(vec![a]).await.unwrap();
    assert!(r[0].inserted);
    assert!(c.cycle1().await.report.fetched.is_empty());
    t.commit().await.unwrap();
    assert_eq!(c.cycle1().await.sent, vec![a_id]);
    let b = c.ev("k").build().unwrap();
    let b_id = b.id();
    let mut u = c.begin().await;
    u.write(vec![b]).await.unwrap();
    u.rollback().await.unwrap();
    assert!(c.repo().get(b_id).await.unwrap().is_none());
    assert!(c.cycle1().await.report.fetched.is_empty());
}

/// W-02 Stored defaults.
pub async fn w_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    let a2 = c
        .put(c.ev("k").headers(Vec::<(String, String)>::new()))
        .await;
    for id in [a, a2] {
        let r = c.get(id).await;
        assert_eq!(r.status, Status::Pending);
        assert_eq!((r.attempts_made, r.max_attempts), (0, 6));
        assert!(r.last_error.is_none() && r.completed_at.is_none());
        assert!(r.locked_at.is_none() && r.locked_by.is_none());
        assert_eq!(r.scheduled_at, r.created_at);
        assert_eq!(r.updated_at, Some(r.created_at));
        assert!(r.headers.is_none());
        assert_eq!(r.id.get_version_num(), 7);
    }
}

/// W-03 A delay is measured on the backend clock.
pub async fn w_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").delay(Duration::from_secs(10))).await;
    let r = c.get(a).await;
    assert_eq!(r.scheduled_at - r.created_at, chrono::Duration::seconds(10));
    assert!(c.cycle1().await.report.fetched.is_empty());
    c.advance(Duration::from_secs(9)).await;
    assert!(c.cycle1().await.report.fetched.is_empty());
    c.advance(Duration::from_secs(1)).await;
    assert_eq!(c.cycle1().await.sent, vec![a]);
}

/// W-04 A serialized writer that began first but wrote second goes second.
///
/// The clock moves 1 s between T2's first statement and T1's write, so a created_at taken from
/// T2's start would be a full second before a's (on a database the transaction's `now()`; in
/// memory [`MemTransaction::started_at`](txoutbox_core::memory::MemTransaction::started_at)).
pub async fn w_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let mut t2 = c.begin().await;
    t2.touch().await;
    c.advance(Duration::from_secs(1)).await;
    let mut t1 = c.begin().await;
    t1.lock_app("L").await;
    let ev_b = c.ev("k").build().unwrap();
    let b_id = ev_b.id();
    // T2 is polled first, so it asks for L (and waits) before T1 writes; T1 holds L already,
    // so T2's write comes after T1's commit whatever the timing. Once T2 has L, the clock moves
    // another second and T2 reads the backend's now just before it writes b: b's created_at must
    // not be earlier (in memory a created_at from T2's start would otherwise hide behind the
    // 1 µs raise over a's, R73).
    let ctx = &c;
    let waiter = async move {
        t2.lock_app("L").await;
        ctx.advance(Duration::from_secs(1)).await;
        let before_b = ctx.now().await;
        t2.write(vec![ev_b]).await.unwrap();
        t2.commit().await.unwrap();
        before_b
    };
    let first = async {
        let a = c.ev("k").build().unwrap();
        let a_id = a.id();
        t1.write(vec![a]).await.unwrap();
        t1.commit().await.unwrap();
        a_id
    };
    let (before_b, a_id) = tokio::join!(waiter, first);
    let (ra, rb) = (c.get(a_id).await, c.get(b_id).await);
    assert!(
        ra.created_at < rb.created_at,
        "{} !< {}",
        ra.created_at,
        rb.created_at
    );
    // On a database clock the advance shifted b's created_at back by nothing (b came after it)
    // and a's by 1 s; `before_b` was read after the advance, so it bounds b from below either way.
    assert!(
        rb.created_at >= before_b,
        "b's created_at {} is before the backend clock {before_b} read just before its write",
        rb.created_at
    );
    assert_eq!(c.cycle1().await.sent, vec![a_id]);
    assert_eq!(c.cycle1().await.sent, vec![b_id]);
}

/// W-05 Unserialized writers can be passed (the hazard of R18).
pub async fn w_05(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.ev("k").build().unwrap();
    let a_id = a.id();
    let mut t1 = c.begin().await;
    t1.write(vec![a]).await.unwrap();
    let b = c.ev("k").build().unwrap();
    let b_id = b.id();
    let mut t2 = c.begin().await;
    t2.write(vec![b]).await.unwrap();
    t2.commit().await.unwrap();
    assert_eq!(c.cycle1().await.sent, vec![b_id]);
    t1.commit().await.unwrap();
    assert_eq!(c.cycle1().await.sent, vec![a_id]);
    assert_eq!(c.broker.accepted_ids(), vec![b_id, a_id]);
}

/// I-01 A duplicate key returns the existing row.
pub async fn i_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c
        .put(
            c.ev("k")
                .idempotency_key("ik")
                .payload_json(json!({"n": 1})),
        )
        .await;
    let r = c
        .write(vec![
            c.ev("k")
                .idempotency_key("ik")
                .payload_json(json!({"n": 2}))
                .build()
                .unwrap(),
        ])
        .await;
    assert_eq!(r[0].event.id, a);
    assert_eq!(r[0].event.payload, json!({"n": 1}));
    assert_eq!(r[0].event.status, Status::Pending);
    assert!(!r[0].inserted);
    let total = c.total_rows().await;
    assert_eq!(total, 1);
}

/// I-02 A duplicate of a completed row returns it.
pub async fn i_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").idempotency_key("ik")).await;
    c.cycle1().await;
    let r = c
        .write(vec![c.ev("k").idempotency_key("ik").build().unwrap()])
        .await;
    assert_eq!(
        (r[0].event.id, r[0].event.status, r[0].inserted),
        (a, Status::Completed, false)
    );
    let total = c.total_rows().await;
    assert_eq!(total, 1);
    assert!(c.cycle1().await.report.fetched.is_empty());
}

/// I-03 A concurrent writer waits for the first (and the rollback variant).
pub async fn i_03(f: &dyn Factory) {
    for commit_first in [true, false] {
        let c = Ctx::new(f).await;
        let e1 = c.ev("k").idempotency_key("ik").build().unwrap();
        let id1 = e1.id();
        let mut t1 = c.begin().await;
        t1.write(vec![e1]).await.unwrap();
        let e2 = c.ev("k").idempotency_key("ik").build().unwrap();
        let id2 = e2.id();
        let mut t2 = c.begin().await;
        let second = tokio::spawn(async move {
            let r = t2.write(vec![e2]).await.unwrap();
            t2.commit().await.unwrap();
            r
        });
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!second.is_finished(), "T2 did not wait for T1");
        if commit_first {
            t1.commit().await.unwrap();
        } else {
            t1.rollback().await.unwrap();
        }
        let r = second.await.unwrap();
        if commit_first {
            assert_eq!((r[0].event.id, r[0].inserted), (id1, false));
        } else {
            assert_eq!((r[0].event.id, r[0].inserted), (id2, true));
        }
        let total = c.total_rows().await;
        assert_eq!(total, 1);
    }
}

/// I-04 Repeated keys within and across write calls.
pub async fn i_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let r1 = c
        .write(
            ["k1", "k2", "k1"]
                .iter()
                .map(|k| c.ev("p").idempotency_key(*k).build().unwrap())
                .collect(),
        )
        .await;
    let (x, y) = (r1[0].event.id, r1[1].event.id);
    assert_eq!(
        r1.iter().map(|r| r.event.id).collect::<Vec<_>>(),
        vec![x, y, x]
    );
    assert_eq!(
        r1.iter().map(|r| r.inserted).collect::<Vec<_>>(),
        vec![true, true, false]
    );
    let r2 = c
        .write(
            ["k2", "k3"]
                .iter()
                .map(|k| c.ev("p").idempotency_key(*k).build().unwrap())
                .collect(),
        )
        .await;
    assert_eq!((r2[0].event.id, r2[0].inserted), (y, false));
    assert!(r2[1].inserted && r2[1].event.id != x && r2[1].event.id != y);
    let total = c.total_rows().await;
    assert_eq!(total, 3);
}

/// W-06 An absolute schedule is checked again at insert, against the backend clock (R8, D2).
///
/// The builder checks scheduled_at against its own clock; created_at is the backend clock at
/// insert. A builder clock 2 minutes behind lets through a schedule 90 s before the backend's
/// now; a builder clock 1 day ahead lets through one 365 days + 1 day after it. The ancestor
/// refuses both rows when it loads them, so the write refuses them, with the window in the
/// error, and changes nothing; a schedule inside the window is stored as given.
pub async fn w_06(f: &dyn Factory) {
    use std::sync::Arc;

    use txoutbox_core::clock::ManualClock;
    use txoutbox_core::error::{RepositoryError, ValidationError};
    use txoutbox_core::event::BuildSettings;

    let c = Ctx::new(f).await;
    let now = c.now().await;
    let at_clock = |offset: chrono::Duration| {
        BuildSettings::new().with_clock(Arc::new(ManualClock::new(now + offset)))
    };
    let behind = at_clock(-chrono::Duration::seconds(120));
    let ahead = at_clock(chrono::Duration::days(1));
    let early = c
        .ev("k")
        .scheduled_at(now - chrono::Duration::seconds(90))
        .build_with(&behind)
        .expect("within the builder's window");
    let late = c
        .ev("k")
        .scheduled_at(now + chrono::Duration::days(366))
        .build_with(&ahead)
        .expect("within the builder's window");
    for (bad, what) in [(early, "90 s early"), (late, "366 days ahead")] {
        let bad_id = bad.id();
        let good = c.ev("k").build().unwrap();
        let good_id = good.id();
        let mut tx = c.begin().await;
        let err = tx.write(vec![good, bad]).await.expect_err(&format!(
            "a schedule {what} of the backend clock was written"
        ));
        match &err {
            RepositoryError::Validation(ValidationError::ScheduleOutsideInsertWindow {
                id,
                ..
            }) => assert_eq!(*id, bad_id, "{what}: {err}"),
            other => panic!("{what}: expected ScheduleOutsideInsertWindow, got {other}"),
        }
        assert!(err.to_string().contains("scheduled_at"), "{err}");
        tx.rollback().await.unwrap();
        assert_eq!(
            c.total_rows().await,
            0,
            "{what}: the refused write left rows"
        );
        assert!(c.repo().get(good_id).await.unwrap().is_none());
    }
    // Inside the window: 59 s before the backend clock's now, from a builder clock that agrees.
    let t = c.now().await - chrono::Duration::seconds(59);
    let ok = c
        .ev("k")
        .scheduled_at(t)
        .build_with(&at_clock(chrono::Duration::zero()))
        .unwrap();
    let id = c.write(vec![ok]).await[0].event.id;
    let r = c.get(id).await;
    assert_eq!(r.scheduled_at, t);
    assert!(r.scheduled_at >= r.created_at - chrono::Duration::seconds(60));
}
