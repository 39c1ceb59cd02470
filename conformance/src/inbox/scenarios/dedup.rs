//! D: deduplication and retention (scenarios.md section 24; I-06 and the plain-table part; the
//! partitioned table's D-03 to D-06 and P-04 are `[pg]`).

use std::time::Duration;

use serde_json::json;
use txoutbox_core::inbox::repository::{InboxBackend, InboxRepository, InboxTransaction};
use txoutbox_core::inbox::{DeliveryOutcome as O, NewInboxEvent};

use crate::inbox::ctx::{Ictx, g};
use crate::inbox::harness::InboxFactory;
use crate::inbox::script::Act;

fn ev(id: &str, payload: serde_json::Value, source: &str, event_type: &str) -> NewInboxEvent {
    NewInboxEvent::builder()
        .message_id(id)
        .consumer_group("g")
        .source(source)
        .event_type(event_type)
        .payload_json(payload)
        .build()
        .expect("valid")
}

/// I-06: an inbox duplicate returns the first row (R108, R109).
pub async fn i_06<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let b = c.backend();
    let mut t = b.begin().await.unwrap();
    let first = t
        .land(vec![ev("m1", json!({"n": 1}), "src", "e")])
        .await
        .unwrap();
    t.commit().await.unwrap();
    let mut t = b.begin().await.unwrap();
    let again = t
        .land(vec![ev("m1", json!({"n": 1}), "src", "e")])
        .await
        .unwrap();
    t.commit().await.unwrap();
    assert!(first[0].inserted);
    assert_eq!(
        (again[0].row.id, again[0].inserted),
        (first[0].row.id, false)
    );
    assert_eq!(b.counts(&g()).await.unwrap()[0].count, 1);
}

/// D-01: a duplicate returns the stored row; a repeat within a call collapses (R107, R109).
pub async fn d_01<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let b = c.backend();
    let mut t = b.begin().await.unwrap();
    t.land(vec![ev("m1", json!({"n": 1}), "a", "x")])
        .await
        .unwrap();
    t.commit().await.unwrap();
    let mut t = b.begin().await.unwrap();
    let l = t
        .land(vec![ev("m1", json!({"n": 2}), "b", "y")])
        .await
        .unwrap();
    let two = t
        .land(vec![
            ev("m2", json!({"n": 1}), "a", "x"),
            ev("m2", json!({"n": 9}), "a", "x"),
        ])
        .await
        .unwrap();
    t.commit().await.unwrap();
    let r = &l[0].row;
    assert_eq!(
        (
            &r.payload,
            r.source.as_str(),
            r.event_type.as_str(),
            l[0].inserted
        ),
        (&json!({"n": 1}), "a", "x", false)
    );
    assert_eq!(two[0].row.id, two[1].row.id);
    assert_eq!((two[0].inserted, two[1].inserted), (true, false));
}

/// D-02: a concurrent landing waits for the first transaction (R110).
pub async fn d_02<F: InboxFactory>(f: &F) {
    for commit in [true, false] {
        let c = Ictx::new(f).await;
        let b = c.backend();
        let mut t1 = b.begin().await.unwrap();
        let l1 = t1
            .land(vec![ev("m1", json!({"n": 1}), "src", "e")])
            .await
            .unwrap();
        let mut t2 = b.begin().await.unwrap();
        let waiting = t2.land(vec![ev("m1", json!({"n": 2}), "src", "e")]);
        let control = async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if commit {
                t1.commit().await.unwrap();
            } else {
                t1.rollback().await;
            }
        };
        let (l2, ()) = tokio::join!(waiting, control);
        let l2 = l2.unwrap();
        t2.commit().await.unwrap();
        if commit {
            assert_eq!((l2[0].row.id, l2[0].inserted), (l1[0].row.id, false));
        } else {
            assert!(l2[0].inserted, "T1 rolled back: T2 inserts its own row");
        }
        assert_eq!(b.counts(&g()).await.unwrap()[0].count, 1);
    }
}

/// D-07: a failed row outlives cleanup and keeps its message deduplicated (R163).
pub async fn d_07<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", None);
    c.script("m1", vec![Act::Fail("x".into())]);
    let r = c.runner().at_most_once(true).build().unwrap();
    c.handle(&r).await;
    c.advance(Duration::from_secs(400 * 86_400)).await;
    assert_eq!(
        c.backend()
            .cleanup_old_events(1, 1000, 10_000)
            .await
            .unwrap(),
        0
    );
    c.duplicate("m1");
    let res = c.handle(&r).await;
    assert_eq!((res.outcome, res.committed), (O::Duplicate, true));
}

/// D-08: the deduplication window ends at cleanup (the ancestor's C-03) (R163).
pub async fn d_08<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", None);
    let r = c.runner().build().unwrap();
    assert_eq!(c.handle(&r).await.outcome, O::Completed);
    c.advance(Duration::from_secs(2 * 86_400)).await;
    assert_eq!(
        c.backend()
            .cleanup_old_events(1, 1000, 10_000)
            .await
            .unwrap(),
        1
    );
    c.duplicate("m1");
    assert_eq!(c.handle(&r).await.outcome, O::Completed);
    assert_eq!(c.backend().counts(&g()).await.unwrap()[0].count, 1);
    assert_eq!(c.effects().await, vec!["m1", "m1"]);
}
