//! Q: head runs, and X: concurrency across keys.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::WorkerId;
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::{NewEvent, OutboxEvent, Status};
use txoutbox_core::repository::{
    BlockedKey, Capabilities, Delivery, DeliveryBound, FetchRequest, Fetched, OutboxRepository,
    Outcome, OutcomeKind, StatusCount, WrittenOutcome,
};
use txoutbox_core::scripted::{Action, Gate};
use uuid::Uuid;

use crate::ctx::{Cfg, Ctx};
use crate::harness::Factory;

fn rej(t: &str) -> Action {
    Action::Reject(t.into())
}

async fn write_key(c: &Ctx, key: &str, n: usize) -> Vec<Uuid> {
    let mut ids = Vec::with_capacity(n);
    let evs: Vec<NewEvent> = (0..n).map(|_| c.ev(key).build().unwrap()).collect();
    for chunk in evs.chunks(100) {
        for r in c.write(chunk.to_vec()).await {
            ids.push(r.event.id);
        }
    }
    ids
}

/// Q-01 A single-key backlog drains in ceil(1000 / max_per_key) cycles.
pub async fn q_01(f: &dyn Factory) {
    for (m, expected) in [(1usize, 1000usize), (7, 143), (100, 10)] {
        let c = Ctx::new(f).await;
        let ids = write_key(&c, "k", 1000).await;
        let relay = c.relay(&Cfg::default().batch(100).per_key(m));
        let mut sending = 0;
        let mut left = 1000;
        loop {
            let cy = c.run(&relay).await;
            if cy.report.fetched.is_empty() {
                break;
            }
            assert_eq!(
                cy.sent.len(),
                m.min(left),
                "m={m}: cycle {} sent {}",
                sending + 1,
                cy.sent.len()
            );
            left -= cy.sent.len();
            sending += 1;
            assert!(sending <= expected, "m={m}: more than {expected} cycles");
        }
        assert_eq!(sending, expected, "m={m}");
        assert_eq!(
            c.broker.accepted_ids(),
            ids,
            "m={m}: accepted order is not write order"
        );
    }
}

/// Q-02 A counted failure in the middle of a run releases the rest.
pub async fn q_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k"; 5]).await;
    c.broker.script(e[2], [rej("bad")]);
    let cfg = Cfg::default().per_key(5);
    let (b3, b4) = (c.get(e[3]).await, c.get(e[4]).await);
    let c1 = c.cycle(&cfg).await;
    assert_eq!(c1.report.fetched, e);
    assert_eq!(c1.sent, vec![e[0], e[1]]);
    let r = c.get(e[2]).await;
    assert_eq!(r.attempts_made, 1);
    c.assert_next_try_within(&c1, r.scheduled_at, 5.0, 10.0);
    c.assert_untouched(&b3).await;
    c.assert_untouched(&b4).await;
    assert!(!c.broker.called_ids().contains(&e[3]) && !c.broker.called_ids().contains(&e[4]));
    assert!(c.cycle(&cfg).await.report.fetched.is_empty());
    c.advance_to(e[2]).await;
    assert_eq!(c.cycle(&cfg).await.sent, vec![e[2], e[3], e[4]]);
}

/// Q-03 A transient failure in the middle of a run.
pub async fn q_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k", "k", "k", "k", "k", "j"]).await;
    c.broker.script(e[2], [Action::Transient("down".into())]);
    let cfg = Cfg::default().per_key(5);
    let (b3, b4, j0) = (c.get(e[3]).await, c.get(e[4]).await, c.get(e[5]).await);
    let c1 = c.cycle(&cfg).await;
    assert_eq!(c1.sent, vec![e[0], e[1]]);
    let r = c.get(e[2]).await;
    assert_eq!(r.attempts_made, 0);
    c.assert_next_try_after(&c1, r.scheduled_at, 1.0);
    c.assert_untouched(&b3).await;
    c.assert_untouched(&b4).await;
    let j = c.get(e[5]).await;
    assert_eq!(j.last_error.as_deref(), Some("down"));
    assert_eq!(j.scheduled_at, j0.scheduled_at);
    assert!(j.locked_by.is_none());
    c.advance(Duration::from_secs(1)).await;
    let c2 = c.cycle(&cfg).await;
    let mut sent = c2.sent.clone();
    sent.sort();
    let mut want = vec![e[2], e[3], e[4], e[5]];
    want.sort();
    assert_eq!(sent, want);
    let ks: Vec<Uuid> = c2.sent.iter().copied().filter(|id| *id != e[5]).collect();
    assert_eq!(ks, vec![e[2], e[3], e[4]]);
}

/// Q-04 A publish timeout in the middle of a run.
pub async fn q_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k"; 5]).await;
    c.broker.script(e[2], [Action::Hang]);
    let cfg = Cfg::default().per_key(5).timeout(Duration::from_millis(50));
    let (b3, b4) = (c.get(e[3]).await, c.get(e[4]).await);
    let c1 = c.cycle(&cfg).await;
    assert_eq!(c1.sent, vec![e[0], e[1]]);
    let r = c.get(e[2]).await;
    assert_eq!(
        r.last_error.as_deref(),
        Some("Publish timed out after 0.05s")
    );
    assert_eq!(r.attempts_made, 0);
    c.assert_next_try_after(&c1, r.scheduled_at, 1.0);
    c.assert_untouched(&b3).await;
    c.assert_untouched(&b4).await;
}

/// Q-05 A rescheduled head's successors never fill the batch.
pub async fn q_05(f: &dyn Factory) {
    for batch in [1usize, 3] {
        let c = Ctx::new(f).await;
        let e = c.puts(&["k", "k", "k", "k", "j", "j", "j"]).await;
        let (h, s, j) = (e[0], &e[1..4], &e[4..7]);
        c.broker.script(h, [Action::Transient("down".into())]);
        let cfg = Cfg::default().batch(batch).per_key(3);
        let mut sends = vec![];
        let mut fetched_all = vec![];
        loop {
            let cy = c.cycle(&cfg).await;
            if cy.report.fetched.is_empty() {
                break;
            }
            fetched_all.push(cy.report.fetched.clone());
            sends.push(cy.sent.clone());
        }
        if batch == 1 {
            assert_eq!(fetched_all[0], vec![h]);
        } else {
            // h's run may come along with h in the first fetch; never without it.
            assert_eq!(fetched_all[0][0], h);
        }
        if batch == 1 {
            assert_eq!(
                sends[1..].to_vec(),
                vec![vec![j[0]], vec![j[1]], vec![j[2]]]
            );
        } else {
            assert_eq!(sends[1..].to_vec(), vec![j.to_vec()]);
        }
        for f in &fetched_all[1..] {
            assert!(
                s.iter().all(|x| !f.contains(x)),
                "an s-row was fetched while h was pending"
            );
            if batch == 1 {
                assert_eq!(f.len(), 1);
            }
        }
        c.advance(Duration::from_secs(1)).await;
        let mut after = vec![];
        loop {
            let cy = c.cycle(&cfg).await;
            if cy.report.fetched.is_empty() {
                break;
            }
            after.extend(cy.sent);
        }
        assert_eq!(after, vec![h, s[0], s[1], s[2]], "batch {batch}");
    }
}

/// Q-06 A run passes over a never-tried future row.
pub async fn q_06(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e1 = c.put(c.ev("k")).await;
    let fr = c.put(c.ev("k").delay(Duration::from_secs(3600))).await;
    let e2 = c.put(c.ev("k")).await;
    let before = c.get(fr).await;
    let cfg = Cfg::default().per_key(3);
    assert_eq!(c.cycle(&cfg).await.sent, vec![e1, e2]);
    c.assert_untouched(&before).await;
    c.advance(Duration::from_secs(3600)).await;
    assert_eq!(c.cycle(&cfg).await.sent, vec![fr]);
}

/// Q-07 A run stops at a row that is not fetchable.
pub async fn q_07(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k").max_attempts(1)).await;
    let b = c.put(c.ev("k")).await;
    let cc = c.put(c.ev("k")).await;
    c.broker.script(a, [rej("x")]);
    c.broker.script(b, [rej("y")]);
    c.cycle1().await;
    c.assert_state(a, Status::Failed, 1).await;
    c.cycle1().await;
    c.assert_state(b, Status::Pending, 1).await;
    assert!(c.repo().requeue_failed(a).await.unwrap());
    let cfg = Cfg::default().per_key(3);
    let c3 = c.cycle(&cfg).await;
    assert_eq!(c3.report.fetched, vec![a]);
    assert_eq!(c3.sent, vec![a]);
    c.advance_to(b).await;
    assert_eq!(c.cycle(&cfg).await.sent, vec![b, cc]);
}

/// Q-08 No other relay gets rows behind a held run.
pub async fn q_08(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k"; 4]).await;
    let got = c.fetch("w1", 100, 2).await;
    assert_eq!(got, vec![e[0], e[1]]);
    let w2 = Cfg::default().worker("w2").per_key(4);
    assert!(c.cycle(&w2).await.report.fetched.is_empty());
    let w1 = WorkerId::new("w1").unwrap();
    let outs: Vec<Outcome> = got
        .iter()
        .map(|id| Outcome {
            id: *id,
            kind: OutcomeKind::Completed,
        })
        .collect();
    c.repo().write_outcomes(&w1, &outs).await.unwrap();
    assert_eq!(c.cycle(&w2).await.sent, vec![e[2], e[3]]);
}

/// Q-09 max_per_key configuration.
pub async fn q_09(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k"; 5]).await;
    let r = txoutbox_core::Relay::builder(c.repo(), std::sync::Arc::new(c.broker.clone()))
        .worker_id("w1")
        .max_per_key(0)
        .build();
    assert!(r.is_err());
    assert_eq!(
        c.cycle(&Cfg::default().batch(3).per_key(10)).await.sent,
        e[..3].to_vec()
    );
}

/// X-01 Never two rows of one key at once.
pub async fn x_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let keys: Vec<String> = (0..10).map(|i| format!("k{i}")).collect();
    let mut order: std::collections::HashMap<String, Vec<Uuid>> = Default::default();
    for _ in 0..20 {
        for k in &keys {
            let id = c.put(c.ev(k)).await;
            order.entry(k.clone()).or_default().push(id);
        }
    }
    c.broker
        .set_default(Action::Delay(Duration::from_millis(2)));
    let cfg = Cfg::default().batch(100).per_key(5).concurrency(8);
    let relay = c.relay(&cfg);
    loop {
        if c.run(&relay).await.report.fetched.is_empty() {
            break;
        }
    }
    let calls = c.broker.calls();
    assert_eq!(calls.len(), 200);
    for (k, ids) in &order {
        let mut kc: Vec<_> = calls.iter().filter(|x| &x.partition_key == k).collect();
        kc.sort_by_key(|x| x.start);
        assert_eq!(
            kc.iter().map(|x| x.event_id).collect::<Vec<_>>(),
            *ids,
            "{k}: starts not in write order"
        );
        for w in kc.windows(2) {
            assert!(
                w[0].end.unwrap() <= w[1].start,
                "{k}: overlapping publishes"
            );
        }
        for id in ids {
            assert_eq!(c.get(*id).await.status, Status::Completed);
        }
    }
    // Concurrency across keys: at most 8, and at some moment at least 2.
    let mut max_in_flight = 0;
    for x in &calls {
        let n = calls
            .iter()
            .filter(|y| y.start <= x.start && y.end.unwrap() > x.start)
            .count();
        max_in_flight = max_in_flight.max(n);
    }
    assert!(
        (2..=8).contains(&max_in_flight),
        "max in flight {max_in_flight}"
    );
}

/// X-02 A transient failure stops new publishes.
pub async fn x_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let keys: Vec<String> = (1..=8).map(|i| format!("k{i}")).collect();
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let e = c.puts(&refs).await;
    let gate = Gate::new();
    c.broker.script(e[0], [Action::Gate(gate.clone())]);
    c.broker.script(e[1], [Action::Transient("down".into())]);
    c.broker.script(e[2], [Action::Gate(gate.clone())]);
    let before: Vec<_> = futures::future::join_all(e[3..].iter().map(|id| c.get(*id))).await;
    let relay = c.relay(&Cfg::default().concurrency(3));
    let k2 = e[1];
    let driver = async {
        c.broker
            .wait_for_calls(|calls| calls.iter().any(|x| x.event_id == k2 && x.result.is_some()))
            .await;
        gate.open();
    };
    let (cy, ()) = tokio::join!(c.run(&relay), driver);
    let mut called = c.broker.called_ids();
    called.sort();
    let mut want = e[..3].to_vec();
    want.sort();
    assert_eq!(called, want);
    c.assert_state(e[0], Status::Completed, 0).await;
    c.assert_state(e[2], Status::Completed, 0).await;
    let r = c.get(e[1]).await;
    assert_eq!(r.attempts_made, 0);
    c.assert_next_try_after(&cy, r.scheduled_at, 1.0);
    for b in before {
        let r = c.get(b.id).await;
        assert_eq!(r.attempts_made, 0);
        assert_eq!(r.last_error.as_deref(), Some("down"));
        assert_eq!(r.scheduled_at, b.scheduled_at);
        assert!(r.locked_by.is_none());
    }
}

/// X-03 A counted failure does not stop other keys.
pub async fn x_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c
        .puts(&["k1", "k2", "k3", "k4", "k5", "k6", "k7", "k8"])
        .await;
    c.broker.script(e[1], [rej("no")]);
    let cy = c.cycle(&Cfg::default().concurrency(4)).await;
    assert_eq!(cy.report.completed.len(), 7);
    assert_eq!(cy.report.counted.len(), 1);
    assert_eq!(cy.report.counted[0].id, e[1]);
    assert_eq!(c.broker.calls().len(), 8);
}

/// X-04 Runs in parallel, with a failure in one.
pub async fn x_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["ka", "ka", "ka", "kb", "kb", "kb"]).await;
    c.broker.script(e[1], [rej("no")]);
    let a3 = c.get(e[2]).await;
    c.cycle(&Cfg::default().per_key(3).concurrency(2)).await;
    for id in [e[0], e[3], e[4], e[5]] {
        c.assert_state(id, Status::Completed, 0).await;
    }
    c.assert_state(e[1], Status::Pending, 1).await;
    c.assert_untouched(&a3).await;
    assert!(!c.broker.called_ids().contains(&e[2]));
}

/// Keys interleaved round-robin, each key's rows reversed.
fn interleave(rows: Vec<Fetched>) -> Vec<Fetched> {
    let mut keys: Vec<(txoutbox_core::ordering::Key, Vec<Fetched>)> = Vec::new();
    for r in rows {
        let k = r.key();
        match keys.iter_mut().find(|(kk, _)| *kk == k) {
            Some((_, v)) => v.push(r),
            None => keys.push((k, vec![r])),
        }
    }
    for (_, v) in &mut keys {
        v.reverse();
    }
    let mut out = Vec::new();
    let mut depth = 0;
    loop {
        let before = out.len();
        for (_, v) in &keys {
            if let Some(r) = v.get(depth) {
                out.push(r.clone());
            }
        }
        if out.len() == before {
            return out;
        }
        depth += 1;
    }
}

/// A repository that hands out what the one under test fetched in another order: keys
/// interleaved round-robin, each key's rows in reverse write order (what a careless third-party
/// backend might return). Everything else goes straight through.
struct Interleaving(Arc<dyn OutboxRepository>);

#[async_trait]
impl OutboxRepository for Interleaving {
    fn capabilities(&self) -> Capabilities {
        self.0.capabilities()
    }
    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        self.0.now().await
    }
    async fn get(&self, id: Uuid) -> Result<Option<OutboxEvent>, RepositoryError> {
        self.0.get(id).await
    }
    async fn fetch_and_lock(&self, req: &FetchRequest) -> Result<Vec<Fetched>, RepositoryError> {
        Ok(interleave(self.0.fetch_and_lock(req).await?))
    }
    async fn begin_delivery(
        &self,
        req: &FetchRequest,
        bound: DeliveryBound,
    ) -> Result<(Vec<Fetched>, Box<dyn Delivery>), RepositoryError> {
        let (rows, d) = self.0.begin_delivery(req, bound).await?;
        Ok((interleave(rows), d))
    }
    async fn write_outcomes(
        &self,
        worker: &WorkerId,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        self.0.write_outcomes(worker, outcomes).await
    }
    async fn refresh_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        self.0.refresh_lock(id, worker).await
    }
    async fn release_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        self.0.release_lock(id, worker).await
    }
    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError> {
        self.0.release_locks(ids, worker).await
    }
    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError> {
        self.0.release_stale_locks(timeout).await
    }
    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError> {
        self.0.requeue_failed(id).await
    }
    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError> {
        self.0
            .delete_old_completed(retention_days, batch_size)
            .await
    }
    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError> {
        self.0.force_unlock(id, reason).await
    }
    async fn blocked_keys(
        &self,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<BlockedKey>, RepositoryError> {
        self.0.blocked_keys(lease_ttl, limit).await
    }
    async fn counts(&self) -> Result<Vec<StatusCount>, RepositoryError> {
        self.0.counts().await
    }
    async fn oldest_due_age(&self) -> Result<Option<Duration>, RepositoryError> {
        self.0.oldest_due_age().await
    }
    async fn parked_rows(&self) -> Result<u64, RepositoryError> {
        self.0.parked_rows().await
    }
}

/// X-05 A backend that returns a key's rows interleaved with other keys' and out of write order
/// still gets them published one at a time, in write order (R22, R45): the relay
/// groups by key wherever the rows are and orders each key's run by `(created_at, id)`.
pub async fn x_05(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let keys = ["k1", "k2", "k3"];
    let mut order: std::collections::HashMap<&str, Vec<Uuid>> = Default::default();
    for _ in 0..4 {
        for k in keys {
            let id = c.put(c.ev(k)).await;
            order.entry(k).or_default().push(id);
        }
    }
    c.broker
        .set_default(Action::Delay(Duration::from_millis(2)));
    let cfg = Cfg::default().per_key(4).concurrency(3);
    let relay = c.relay_on(Arc::new(Interleaving(c.repo())), &cfg);
    let first = c.run(&relay).await;
    assert_eq!(first.report.fetched.len(), 12, "{:?}", first.report);
    // The wrapper did interleave: the first two rows it handed out are of different keys.
    let k0 = c.get(first.report.fetched[0]).await.partition_key;
    let k1 = c.get(first.report.fetched[1]).await.partition_key;
    assert_ne!(k0, k1, "the wrapper did not interleave");
    while !c.run(&relay).await.report.fetched.is_empty() {}
    let calls = c.broker.calls();
    assert_eq!(calls.len(), 12);
    for (k, ids) in &order {
        let mut kc: Vec<_> = calls.iter().filter(|x| x.partition_key == *k).collect();
        kc.sort_by_key(|x| x.start);
        assert_eq!(
            kc.iter().map(|x| x.event_id).collect::<Vec<_>>(),
            *ids,
            "{k}: not published in write order"
        );
        for w in kc.windows(2) {
            assert!(
                w[0].end.unwrap() <= w[1].start,
                "{k}: two rows of the key in flight at once"
            );
        }
        for id in ids {
            assert_eq!(c.get(*id).await.status, Status::Completed);
        }
    }
}

/// Q-10 Only the first unpublished row of a healthy key is deferred; the rest of its run is
/// released untouched (R47).
pub async fn q_10(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k", "x", "x", "x"]).await;
    c.broker.script(e[0], [Action::Transient("down".into())]);
    c.advance(Duration::from_secs(5)).await;
    let before: Vec<_> = futures::future::join_all(e[1..].iter().map(|id| c.get(*id))).await;
    let c1 = c.cycle(&Cfg::default().per_key(3)).await;
    assert_eq!(c1.report.fetched, e);
    assert_eq!(c.broker.called_ids(), vec![e[0]]);
    assert_eq!(
        c1.report.deferred.iter().map(|d| d.id).collect::<Vec<_>>(),
        vec![e[1]],
        "Q-10: only the first unpublished row of a healthy key is deferred (R47)"
    );
    assert_eq!(
        c1.report.released,
        vec![e[2], e[3]],
        "Q-10: the rest of the healthy key's run is released untouched (R47, R77)"
    );
    let x1 = c.get(e[1]).await;
    assert_eq!(x1.last_error.as_deref(), Some("down"));
    assert_eq!(
        (x1.attempts_made, x1.scheduled_at),
        (0, before[0].scheduled_at)
    );
    assert!(x1.locked_at.is_none() && x1.locked_by.is_none());
    c.assert_untouched(&before[1]).await;
    c.assert_untouched(&before[2]).await;
    // The next cycle sends the healthy key's whole run in order.
    let c2 = c.cycle(&Cfg::default().per_key(3)).await;
    assert_eq!(c2.sent, vec![e[1], e[2], e[3]]);
}

/// Q-11 A run stops at a row held by another worker and at a row at its attempt budget (second
/// scenario for R28/R74's run end, besides Q-07's waiting row).
pub async fn q_11(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let k = c.puts(&["k", "k", "k"]).await;
    let m = c.puts(&["m", "m", "m"]).await;
    let now = c.now().await;
    c.set(k[1], crate::harness::RowPatch::held("w9", now)).await;
    c.set(
        m[1],
        crate::harness::RowPatch {
            attempts_made: Some(6),
            ..crate::harness::RowPatch::default()
        },
    )
    .await;
    let behind = [c.get(k[2]).await, c.get(m[2]).await];
    let c1 = c.cycle(&Cfg::default().per_key(3)).await;
    assert_eq!(
        c1.report.fetched,
        vec![k[0], m[0]],
        "each run ends before its held or exhausted row"
    );
    assert_eq!(c1.sent, vec![k[0], m[0]]);
    for row in &behind {
        c.assert_untouched(row).await;
    }
}
