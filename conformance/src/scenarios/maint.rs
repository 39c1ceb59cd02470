//! R and C: requeue and cleanup.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tracing_subscriber::Layer;
use tracing_subscriber::layer::{Context, SubscriberExt};
use txoutbox_core::event::Status;
use txoutbox_core::scripted::Action;
use uuid::Uuid;

use crate::ctx::Ctx;
use crate::harness::{Factory, RowPatch};

/// R-01 Requeue.
pub async fn r_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").max_attempts(1)).await;
    c.broker.script(a, [Action::Reject("no".into())]);
    c.cycle1().await;
    c.assert_state(a, Status::Failed, 1).await;
    let t0 = c.now().await;
    assert!(c.repo().requeue_failed(a).await.unwrap());
    let t1 = c.now().await;
    let r = c.get(a).await;
    assert_eq!((r.status, r.attempts_made), (Status::Pending, 0));
    assert!(r.last_error.is_none());
    if c.clock_stands_still() {
        assert_eq!(r.scheduled_at, t0);
    } else {
        assert!(
            r.scheduled_at >= t0 && r.scheduled_at <= t1,
            "scheduled_at {} not in [{t0}, {t1}]",
            r.scheduled_at
        );
    }
    assert!(!c.repo().requeue_failed(a).await.unwrap());
}

/// R-02 Requeue on a row that is not failed.
pub async fn r_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let b = c.put(c.ev("kb")).await;
    assert_eq!(c.cycle1().await.sent, vec![b]);
    let a = c.put(c.ev("ka")).await;
    let (ra, rb) = (c.get(a).await, c.get(b).await);
    assert_eq!((ra.status, rb.status), (Status::Pending, Status::Completed));
    assert!(!c.repo().requeue_failed(a).await.unwrap());
    assert!(!c.repo().requeue_failed(b).await.unwrap());
    assert!(!c.repo().requeue_failed(Uuid::new_v4()).await.unwrap());
    assert_eq!(c.get(a).await, ra);
    assert_eq!(c.get(b).await, rb);
}

async fn total_rows(c: &Ctx) -> i64 {
    c.total_rows().await
}

/// C-01 Cleanup.
pub async fn c_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("ka")).await;
    assert_eq!(c.cycle1().await.sent, vec![a]);
    c.advance(Duration::from_secs(2 * 86_400)).await;
    let b = c.put(c.ev("kb")).await;
    let cc = c.put(c.ev("kc").max_attempts(1)).await;
    c.broker.script(cc, [Action::Reject("no".into())]);
    assert_eq!(c.cycle1().await.sent, vec![b]);
    c.assert_state(cc, Status::Failed, 1).await;
    assert_eq!(c.repo().cleanup_old_events(1, 1, 10_000).await.unwrap(), 1);
    assert!(c.repo().get(a).await.unwrap().is_none());
    c.assert_state(b, Status::Completed, 0).await;
    c.assert_state(cc, Status::Failed, 1).await;
    assert_eq!(total_rows(&c).await, 2);
}

/// Counts WARN events.
struct WarnCounter(Arc<AtomicUsize>);

impl<S: tracing::Subscriber> Layer<S> for WarnCounter {
    fn on_event(&self, event: &tracing::Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// C-02 Cleanup limits.
pub async fn c_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k1", "k2", "k3", "k4", "k5"]).await;
    assert_eq!(c.cycle1().await.sent, ids);
    c.advance(Duration::from_secs(3 * 86_400)).await;
    assert!(c.repo().cleanup_old_events(0, 1000, 10_000).await.is_err());
    assert_eq!(total_rows(&c).await, 5);
    let warnings = Arc::new(AtomicUsize::new(0));
    // The scenario's future runs on the test's own thread (block_on), so a thread-local
    // subscriber sees what the call logs.
    let _guard = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(WarnCounter(warnings.clone())),
    );
    let n = c.repo().cleanup_old_events(1, 1, 2).await.unwrap();
    drop(_guard);
    assert_eq!(n, 2);
    assert!(
        warnings.load(Ordering::SeqCst) >= 1,
        "no warning about the iteration cap"
    );
    assert_eq!(total_rows(&c).await, 3);
}

/// C-03 Cleanup never deletes pending or failed rows, however old.
pub async fn c_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let done = c.put(c.ev("kd")).await;
    let failing = c.put(c.ev("kr")).await;
    let failed = c.put(c.ev("kf").max_attempts(1)).await;
    let never_tried = c.put(c.ev("kn").delay(Duration::from_secs(3600))).await;
    c.broker.script(failing, [Action::Reject("no".into())]);
    c.broker.script(failed, [Action::Reject("no".into())]);
    assert_eq!(c.cycle1().await.sent, vec![done]);
    c.assert_state(failing, Status::Pending, 1).await;
    c.assert_state(failed, Status::Failed, 1).await;
    c.assert_state(never_tried, Status::Pending, 0).await;
    // Every row is now 3 days old: created, updated, scheduled and (for `done`) completed.
    c.advance(Duration::from_secs(3 * 86_400)).await;
    let kept = [
        c.get(failing).await,
        c.get(failed).await,
        c.get(never_tried).await,
    ];
    assert_eq!(
        c.repo().cleanup_old_events(1, 1, 10_000).await.unwrap(),
        1,
        "C-03: cleanup deletes only the completed row, never pending or failed ones (R65)"
    );
    assert!(c.repo().get(done).await.unwrap().is_none());
    for r in &kept {
        assert_eq!(
            &c.get(r.id).await,
            r,
            "cleanup changed a {:?} row",
            r.status
        );
    }
    assert_eq!(total_rows(&c).await, 3);
}

/// C-04 A completed row exactly `retention_days` old is kept `[mem]`: delete_old_completed
/// deletes rows completed strictly before now − retention (R65).
pub async fn c_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k1", "k2"]).await;
    let now = c.now().await;
    let boundary = now - chrono::Duration::days(1);
    for (id, at) in [
        (e[0], boundary),
        (e[1], boundary - chrono::Duration::milliseconds(1)),
    ] {
        c.set(
            id,
            RowPatch {
                status: Some(Status::Completed),
                completed_at: Some(Some(at)),
                ..RowPatch::default()
            },
        )
        .await;
    }
    assert_eq!(
        c.now().await,
        now,
        "the backend clock must be exact for C-04"
    );
    assert_eq!(
        c.repo().delete_old_completed(1, 1000).await.unwrap(),
        1,
        "C-04: only the row completed more than 1 day ago is deleted (R65)"
    );
    assert!(
        c.repo().get(e[0]).await.unwrap().is_some(),
        "C-04: a row completed exactly 1 day ago was deleted with retention 1 day (R65)"
    );
    assert!(c.repo().get(e[1]).await.unwrap().is_none());
    c.advance(Duration::from_millis(1)).await;
    assert_eq!(c.repo().delete_old_completed(1, 1000).await.unwrap(), 1);
    assert!(c.repo().get(e[0]).await.unwrap().is_none());
}
