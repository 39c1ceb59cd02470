//! W: writing, and I: idempotency.

use std::time::Duration;

use outbox_core::event::Status;
use serde_json::json;

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
pub async fn w_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let mut t2 = c.begin().await;
    t2.touch().await;
    let mut t1 = c.begin().await;
    t1.lock_app("L").await;
    let ev_b = c.ev("k").build().unwrap();
    let b_id = ev_b.id();
    let waiter = async move {
        t2.lock_app("L").await;
        t2.write(vec![ev_b]).await.unwrap();
        t2.commit().await.unwrap();
    };
    let first = async {
        // Give T2 a chance to block on L before T1 writes.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let a = c.ev("k").build().unwrap();
        let a_id = a.id();
        t1.write(vec![a]).await.unwrap();
        t1.commit().await.unwrap();
        a_id
    };
    let (a_id, ()) = tokio::join!(first, waiter);
    let (ra, rb) = (c.get(a_id).await, c.get(b_id).await);
    assert!(
        ra.created_at < rb.created_at,
        "{} !< {}",
        ra.created_at,
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
