//! A: inbox visibility and observability (scenarios.md section 27; A-03's counters are
//! checked by `txoutbox_core::inbox::metrics`'s tests, A-04's spans need an OpenTelemetry
//! exporter).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use txoutbox_core::event::Status;
use txoutbox_core::inbox::repository::InboxRepository;
use txoutbox_core::inbox::{DeliveryOutcome as O, DeliveryResult, InboxEvent, InboxHooks};

use crate::inbox::ctx::{Ictx, g};
use crate::inbox::harness::{InboxFactory, InboxHarness as _, InboxPatch};
use crate::inbox::script::Act;

/// blocked keys per group, oldest head first (R161).
pub async fn a_01<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let a1 = c.land("a1", Some("k1")).await;
    c.land("a2", Some("k1")).await;
    c.land("a3", Some("k1")).await;
    let b1 = c.land("b1", Some("k2")).await;
    c.land("b2", Some("k2")).await;
    c.land("c1", Some("k3")).await;
    let e1 = c.land("e1", Some("k5")).await;
    let d1 = c.land("d1", None).await;
    let other = c.land_in("g2", "src", "a1", Some("k1")).await;
    let now = c.now().await;
    let retry = InboxPatch {
        attempts_made: Some(1),
        last_error: Some(Some("bad".into())),
        scheduled_at: Some(now + chrono::Duration::seconds(8)),
        ..Default::default()
    };
    c.set(a1.id, retry.clone()).await;
    c.set(d1.id, retry.clone()).await;
    c.set(other.id, retry).await;
    c.set(b1.id, InboxPatch::held("w2", now)).await;
    c.set(
        e1.id,
        InboxPatch::held("w9", now - chrono::Duration::seconds(301)),
    )
    .await;
    let bk = c
        .backend()
        .blocked_keys(&g(), Duration::from_secs(300), 100)
        .await
        .unwrap();
    assert_eq!(bk.len(), 2, "{bk:?}");
    let k1 = &bk[0];
    assert_eq!(
        (
            k1.partition_key.as_str(),
            k1.head_id,
            k1.message_id.as_str()
        ),
        ("k1", a1.id, "a1")
    );
    assert_eq!(
        (
            k1.attempts_made,
            k1.max_attempts,
            k1.last_error.as_deref(),
            k1.locked_by.as_deref(),
            k1.waiting
        ),
        (1, 6, Some("bad"), None, 2)
    );
    assert_eq!(k1.next_try, now + chrono::Duration::seconds(8));
    let k2 = &bk[1];
    assert_eq!(
        (
            k2.partition_key.as_str(),
            k2.head_id,
            k2.locked_by.as_deref(),
            k2.locked_at,
            k2.waiting
        ),
        ("k2", b1.id, Some("w2"), Some(now), 1)
    );
}

/// counts and the oldest due row per group (R161).
pub async fn a_02<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.land_in("g", "s1", "p1", None).await;
    c.land_in("g", "s1", "p2", None).await;
    let c1 = c.land_in("g", "s1", "c1", None).await;
    let f1 = c.land_in("g", "s2", "f1", None).await;
    c.land_in("g2", "s1", "x", None).await;
    let now = c.now().await;
    c.set(
        c1.id,
        InboxPatch {
            status: Some(Status::Completed),
            completed_at: Some(Some(now)),
            ..Default::default()
        },
    )
    .await;
    c.set(
        f1.id,
        InboxPatch {
            status: Some(Status::Failed),
            ..Default::default()
        },
    )
    .await;
    c.advance(Duration::from_secs(30)).await;
    let counts: Vec<_> = c
        .backend()
        .counts(&g())
        .await
        .unwrap()
        .into_iter()
        .map(|s| (s.consumer_group, s.source, s.status, s.count))
        .collect();
    let mut want = vec![
        ("g".to_string(), "s1".to_string(), Status::Pending, 2),
        ("g".into(), "s1".into(), Status::Completed, 1),
        ("g".into(), "s2".into(), Status::Failed, 1),
    ];
    want.sort();
    let mut got = counts;
    got.sort();
    assert_eq!(got, want);
    let age = c
        .backend()
        .oldest_due_age(&g())
        .await
        .unwrap()
        .expect("a due row");
    assert!((age.as_secs_f64() - 30.0).abs() < 2.0, "age {age:?}");
    let fresh = Ictx::new(f).await;
    assert_eq!(fresh.backend().oldest_due_age(&g()).await.unwrap(), None);
}

struct Seen<H: crate::inbox::harness::InboxHarness> {
    h: Arc<H>,
    seen: Mutex<Vec<(String, Option<Status>)>>,
    terminal: Mutex<Vec<String>>,
}

impl<H: crate::inbox::harness::InboxHarness> InboxHooks for Seen<H> {
    fn on_delivery(&self, r: &DeliveryResult) {
        let row = r.row_id.and_then(|id| {
            futures::executor::block_on(self.h.backend().get(id))
                .ok()
                .flatten()
        });
        let first = {
            let mut s = self.seen.lock().unwrap();
            s.push((
                r.message_id.clone().unwrap_or_default(),
                row.map(|x| x.status),
            ));
            s.len() == 1
        };
        if first {
            panic!("the outcome hook's first call panics");
        }
    }
    fn on_terminal_failure(&self, row: &InboxEvent, _: &str) {
        self.terminal.lock().unwrap().push(row.message_id.clone());
    }
}

/// the runner's hooks run after the commit, and not when T failed; a panicking hook
/// changes nothing (R171).
pub async fn a_05<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let hook = Arc::new(Seen {
        h: c.h.clone(),
        seen: Mutex::default(),
        terminal: Mutex::default(),
    });
    let r = c
        .runner()
        .at_most_once(true)
        .hooks(hook.clone())
        .build()
        .unwrap();
    c.deliver("m1", Some("k1"));
    c.deliver("m2", Some("k2"));
    c.deliver("m3", Some("k3"));
    c.script("m2", vec![Act::Fail("x".into())]);
    c.script("m3", vec![Act::Fail("y".into())]);
    assert_eq!(c.handle(&r).await.outcome, O::Completed);
    assert_eq!(c.handle(&r).await.outcome, O::Recorded);
    c.h.fail_next_row_commit();
    assert_eq!(c.handle(&r).await.outcome, O::PersistFailed);
    let seen = hook.seen.lock().unwrap().clone();
    assert_eq!(
        seen,
        vec![
            ("m1".into(), Some(Status::Completed)),
            ("m2".into(), Some(Status::Failed))
        ]
    );
    assert_eq!(*hook.terminal.lock().unwrap(), vec!["m2".to_string()]);
}
