//! T: transient failures and outages.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use txoutbox_core::CancellationToken;
use txoutbox_core::backoff::Backoff;
use txoutbox_core::event::Status;
use txoutbox_core::relay::Relay;
use txoutbox_core::scripted::Action;
use txoutbox_core::step::PipelineStep;
use uuid::Uuid;

use crate::ctx::{Cfg, Ctx};
use crate::harness::Factory;

const NODE_DOWN: &str = "broker unreachable: node 1 is not ready";

fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

async fn put_keys(c: &Ctx, ks: &[String]) -> Vec<Uuid> {
    let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
    c.puts(&refs).await
}

/// T-01 Broker unreachable for longer than the budget.
pub async fn t_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    t_01_steps(&c).await;
}

async fn t_01_steps(c: &Ctx) -> Vec<Uuid> {
    let ids = put_keys(c, &keys("order-", 20)).await;
    let mut start = Vec::new();
    for id in &ids {
        start.push(c.get(*id).await.scheduled_at);
    }
    c.broker.set_default(Action::Transient(NODE_DOWN.into()));
    for n in 1..=7 {
        let cy = c.cycle1().await;
        assert!(cy.sent.is_empty(), "cycle {n} sent {:?}", cy.sent);
        assert_eq!(c.broker.calls().len(), n, "broker calls after cycle {n}");
        let mut moved = 0;
        for (id, s0) in ids.iter().zip(&start) {
            let r = c.get(*id).await;
            assert_eq!(
                (r.status, r.attempts_made),
                (Status::Pending, 0),
                "cycle {n}, row {id}"
            );
            assert!(
                r.locked_at.is_none() && r.locked_by.is_none(),
                "cycle {n}: {id} held"
            );
            assert_eq!(
                r.last_error.as_deref(),
                Some(NODE_DOWN),
                "cycle {n}, row {id}"
            );
            if r.scheduled_at > *s0 {
                moved += 1;
            }
        }
        assert_eq!(moved, n, "rows rescheduled after cycle {n}");
    }
    assert!(c.broker.accepted().is_empty());
    ids
}

/// T-02 The broker comes back.
pub async fn t_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = t_01_steps(&c).await;
    c.broker.set_default(Action::Ok);
    c.advance(Duration::from_millis(1500)).await;
    let cy = c.cycle1().await;
    let mut sent = cy.sent.clone();
    sent.sort();
    let mut want = ids.clone();
    want.sort();
    assert_eq!(sent, want);
    for id in ids {
        c.assert_state(id, Status::Completed, 0).await;
    }
}

/// T-03 The broker refuses every row.
pub async fn t_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = put_keys(&c, &keys("k", 20)).await;
    c.broker
        .set_default(Action::Reject("message too large".into()));
    let cy = c.cycle1().await;
    assert_eq!(cy.report.counted.len(), 20);
    assert!(cy.report.transient.is_empty());
    for id in ids {
        let r = c.get(id).await;
        assert_eq!((r.status, r.attempts_made), (Status::Pending, 1));
        assert_eq!(r.last_error.as_deref(), Some("message too large"));
        c.assert_next_try_within(&cy, r.scheduled_at, 5.0, 10.0);
    }
}

/// T-04 A transient failure is not counted.
pub async fn t_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    c.broker.script(a, [Action::Transient("gone".into())]);
    let cy = c.cycle1().await;
    assert_eq!(cy.report.transient.len(), 1);
    assert!(cy.report.counted.is_empty());
    let r = c.get(a).await;
    assert_eq!(
        (r.attempts_made, r.last_error.as_deref()),
        (0, Some("gone"))
    );
    c.assert_next_try_after(&cy, r.scheduled_at, 1.0);
}

/// T-05 A publish timeout is transient.
pub async fn t_05(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    c.broker.script(a, [Action::Hang]);
    let cy = c
        .cycle(&Cfg::default().timeout(Duration::from_millis(50)))
        .await;
    assert_eq!(cy.report.transient.len(), 1);
    assert!(cy.report.counted.is_empty());
    let r = c.get(a).await;
    assert_eq!(
        r.last_error.as_deref(),
        Some("Publish timed out after 0.05s")
    );
    assert_eq!(r.attempts_made, 0);
    c.assert_next_try_after(&cy, r.scheduled_at, 1.0);
}

/// T-06 A transient failure defers the rest without calling the broker.
pub async fn t_06(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    t_06_steps(&c).await;
}

async fn t_06_steps(c: &Ctx) -> Vec<Uuid> {
    let ids = c.puts(&["k1", "k2", "k3"]).await;
    c.broker.script(ids[0], [Action::Transient("down".into())]);
    // Time passes before the cycle, so a deferral that kept the schedule and one that moved it
    // to now differ.
    c.advance(Duration::from_secs(5)).await;
    let before = [c.get(ids[1]).await, c.get(ids[2]).await];
    let cy = c.cycle1().await;
    assert_eq!(c.broker.called_ids(), vec![ids[0]]);
    assert_eq!(cy.report.deferred.len(), 2);
    for b in before {
        let r = c.get(b.id).await;
        assert_eq!(r.last_error.as_deref(), Some("down"));
        assert_eq!(
            r.scheduled_at, b.scheduled_at,
            "T-06: a deferred row keeps its scheduled_at (R47)"
        );
        assert!(r.scheduled_at < cy.t0, "the deferral moved the schedule");
        assert_eq!(r.attempts_made, 0);
        assert!(r.locked_at.is_none() && r.locked_by.is_none());
    }
    ids
}

/// T-07 The next cycle publishes again.
pub async fn t_07(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = t_06_steps(&c).await;
    let cy = c.cycle1().await;
    assert_eq!(c.broker.calls().len(), 3);
    assert_eq!(cy.sent, vec![ids[1], ids[2]]);
    assert!(
        !cy.report.fetched.contains(&ids[0]),
        "the first row is not due yet"
    );
}

/// T-08 A rejection counts and the batch goes on.
pub async fn t_08(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k1", "k2"]).await;
    c.broker
        .script(ids[0], [Action::Reject("payload rejected".into())]);
    let cy = c.cycle1().await;
    assert_eq!(cy.report.counted.len(), 1);
    assert_eq!(cy.report.counted[0].id, ids[0]);
    let r = c.get(ids[0]).await;
    assert_eq!(
        (r.attempts_made, r.last_error.as_deref()),
        (1, Some("payload rejected"))
    );
    assert_eq!(cy.sent, vec![ids[1]]);
    c.assert_state(ids[1], Status::Completed, 0).await;
}

/// T-10 A timeout also stops new publishes.
pub async fn t_10(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k1", "k2", "k3"]).await;
    c.broker.script(ids[0], [Action::Hang]);
    let cy = c
        .cycle(&Cfg::default().timeout(Duration::from_millis(50)))
        .await;
    assert_eq!(c.broker.called_ids(), vec![ids[0]]);
    assert_eq!(cy.report.transient.len(), 1);
    assert_eq!(cy.report.transient[0].id, ids[0]);
    assert_eq!(cy.report.deferred.len(), 2);
    for id in &ids[1..] {
        let r = c.get(*id).await;
        assert_eq!(
            r.last_error.as_deref(),
            Some("Publish timed out after 0.05s")
        );
        assert_eq!(r.attempts_made, 0);
    }
}

/// Records when each fetch ran (paused-clock time since the start) and how many rows it got.
struct FetchLog {
    start: tokio::time::Instant,
    log: Arc<Mutex<Vec<(Duration, usize)>>>,
}

#[async_trait]
impl PipelineStep for FetchLog {
    async fn on_fetch(&self, rows: usize) {
        self.log
            .lock()
            .unwrap()
            .push((tokio::time::Instant::now() - self.start, rows));
    }
}

/// Runs a relay loop (poll interval 5 s) for `secs` of paused time; returns the fetch log.
async fn run_loop(c: &Ctx, cfg: &Cfg, secs: u64) -> Vec<(Duration, usize)> {
    let log = Arc::new(Mutex::new(Vec::new()));
    let relay = Relay::builder(c.repo(), Arc::new(c.broker.clone()))
        .worker_id(cfg.worker.clone())
        .batch_size(cfg.batch)
        .max_per_key(cfg.max_per_key)
        .publish_concurrency(cfg.concurrency)
        .backoff(Backoff::new(cfg.base, cfg.cap).unwrap())
        .poll_interval(Duration::from_secs(5))
        .step(Arc::new(FetchLog {
            start: tokio::time::Instant::now(),
            log: log.clone(),
        }))
        .build()
        .expect("relay config");
    let relay = Arc::new(relay);
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let (relay, stop) = (relay.clone(), stop.clone());
        async move { relay.run(stop).await }
    });
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.cancel();
    task.await
        .expect("loop task")
        .expect("the loop ends without error");
    log.lock().unwrap().clone()
}

/// T-11 The loop waits after an unreachable broker (paused clock).
pub async fn t_11(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    put_keys(&c, &keys("k", 5)).await;
    c.broker.set_default(Action::Transient("down".into()));
    let log = run_loop(&c, &Cfg::default(), 12).await;
    let starts: Vec<Duration> = log.iter().map(|(t, _)| *t).collect();
    assert_eq!(
        starts,
        [0, 5, 10].map(Duration::from_secs).to_vec(),
        "fetch log {log:?}"
    );

    // Variant: a broker that acknowledges, 120 rows on one key, batch 50, max_per_key 50.
    let c = Ctx::new(f).await;
    let ids = put_keys(&c, &vec!["k".to_string(); 120]).await;
    let log = run_loop(&c, &Cfg::default().batch(50).per_key(50), 7).await;
    let z = Duration::ZERO;
    let five = Duration::from_secs(5);
    assert_eq!(log, vec![(z, 50), (z, 50), (z, 20), (z, 0), (five, 0)]);
    assert_eq!(c.broker.accepted_ids(), ids);
}
