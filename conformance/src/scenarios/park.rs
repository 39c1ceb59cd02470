//! OP: parked keys (operations.md R191 to R193): `on_exhausted = park`, redrive and discard.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use txoutbox_core::event::OutboxEvent;
use txoutbox_core::step::PipelineStep;

use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::Status;
use txoutbox_core::repository::{FetchFilter, OnExhausted, ParkedTarget};
use txoutbox_core::scripted::Action;
use uuid::Uuid;

use crate::ctx::{Cfg, Ctx};
use crate::harness::Factory;

const LEASE: Duration = Duration::from_secs(300);

fn park() -> Cfg {
    Cfg {
        exhausted: OnExhausted::Park,
        ..Cfg::default()
    }
}

/// Runs 12 cycles of `cfg`, moving time an hour after each (past any retry); returns the ids
/// sent, in order.
async fn drain(c: &Ctx, cfg: &Cfg) -> Vec<Uuid> {
    let mut sent = Vec::new();
    for _ in 0..12 {
        sent.extend(c.cycle(cfg).await.sent);
        c.advance(Duration::from_secs(3600)).await;
    }
    sent
}

/// OP-01's setup: key k with r1, r2, r3; r1 (max_attempts 2) rejected twice by a relay with
/// `cfg`. Returns [r1, r2, r3] after the rejections and an hour more of cycles.
async fn poison_key(c: &Ctx, cfg: &Cfg) -> [Uuid; 3] {
    let r1 = c.put(c.ev("k").max_attempts(2)).await;
    let r2 = c.put(c.ev("k")).await;
    let r3 = c.put(c.ev("k")).await;
    c.broker.script(
        r1,
        [
            Action::Reject("poison".into()),
            Action::Reject("poison".into()),
        ],
    );
    let first = c.cycle(cfg).await;
    assert_eq!(first.report.counted.len(), 1, "r1 rejected once");
    c.advance_to(r1).await;
    let second = c.cycle(cfg).await;
    assert_eq!(second.report.counted.len(), 1, "r1 rejected twice");
    [r1, r2, r3]
}

/// Records the parks and terminal failures the relay reports to its steps (R193).
#[derive(Default)]
struct Ends {
    parked: Mutex<Vec<(Uuid, i32, String)>>,
    terminal: Mutex<Vec<Uuid>>,
}

#[async_trait]
impl PipelineStep for Ends {
    async fn on_parked(&self, e: &OutboxEvent, error: &str) {
        self.parked
            .lock()
            .unwrap()
            .push((e.id, e.attempts_made, error.to_owned()));
    }
    async fn on_terminal_failure(&self, e: &OutboxEvent, _error: &str) {
        self.terminal.lock().unwrap().push(e.id);
    }
}

/// OP-01 Park holds the key; the park calls `on_parked` once, not `on_terminal_failure` (R193).
pub async fn op_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ends = Arc::new(Ends::default());
    let cfg = park().step(ends.clone());
    let [r1, r2, r3] = poison_key(&c, &cfg).await;
    let sent = drain(&c, &cfg).await;
    assert_eq!(
        *ends.parked.lock().unwrap(),
        vec![(r1, 1, "poison".to_owned())],
        "one park of r1, reported with the row as before its last failure"
    );
    assert!(
        ends.terminal.lock().unwrap().is_empty(),
        "a park is not a terminal failure"
    );
    assert!(
        sent.is_empty(),
        "nothing of k goes out behind a parked head: {sent:?}"
    );
    let r = c.get(r1).await;
    assert_eq!(
        (r.status, r.attempts_made),
        (Status::Pending, 2),
        "r1 parked"
    );
    assert_eq!(r.last_error.as_deref(), Some("poison"));
    assert!(r.locked_at.is_none() && r.locked_by.is_none(), "released");
    c.assert_state(r2, Status::Pending, 0).await;
    c.assert_state(r3, Status::Pending, 0).await;
    assert!(
        c.broker.accepted_ids().is_empty(),
        "r2 and r3 never published"
    );
    let blocked = c.repo().blocked_keys(LEASE, 10).await.expect("blocked");
    assert_eq!(blocked.len(), 1, "{blocked:?}");
    let b = &blocked[0];
    assert_eq!((b.partition_key.as_str(), b.head_id), ("k", r1));
    assert!(b.parked, "marked parked: {b:?}");
    assert_eq!(b.last_error.as_deref(), Some("poison"));
    assert_eq!(b.parked_at, r.updated_at, "parked at its updated_at");
    assert_eq!(b.waiting, 2);
    assert_eq!(
        c.repo().parked_rows().await.expect("parked rows"),
        1,
        "outbox_parked_rows counts r1 (R193)"
    );
}

/// OP-02 Redrive keeps order.
pub async fn op_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let [r1, r2, r3] = poison_key(&c, &park()).await;
    let redriven = c
        .repo()
        .redrive(&ParkedTarget::Key {
            topic: "t".into(),
            partition_key: "k".into(),
        })
        .await
        .expect("redrive");
    assert_eq!(redriven, vec![r1]);
    let r = c.get(r1).await;
    assert_eq!((r.status, r.attempts_made), (Status::Pending, 0));
    assert!(r.last_error.is_none() && r.locked_at.is_none());
    let sent = drain(&c, &park()).await;
    assert_eq!(sent, vec![r1, r2, r3], "the key resumes in write order");
    for id in [r1, r2, r3] {
        assert_eq!(c.get(id).await.status, Status::Completed);
    }
}

/// OP-03 Discard releases.
pub async fn op_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let [r1, r2, r3] = poison_key(&c, &park()).await;
    let discarded = c
        .repo()
        .discard(&ParkedTarget::Id(r1), "bad payload")
        .await
        .expect("discard");
    assert_eq!(discarded, vec![r1]);
    let r = c.get(r1).await;
    assert_eq!((r.status, r.attempts_made), (Status::Failed, 2));
    assert_eq!(
        r.last_error.as_deref(),
        Some("discarded: bad payload; poison")
    );
    let sent = drain(&c, &park()).await;
    assert_eq!(sent, vec![r2, r3], "the key resumes without r1");
    assert!(c.repo().blocked_keys(LEASE, 10).await.unwrap().is_empty());
}

/// OP-04 Release stays the default.
pub async fn op_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let [r1, r2, r3] = poison_key(&c, &Cfg::default()).await;
    c.assert_state(r1, Status::Failed, 2).await;
    let sent = drain(&c, &Cfg::default()).await;
    assert_eq!(sent, vec![r2, r3]);
    // A failed row is not parked: redrive by id refuses it, naming its state.
    let err = c.repo().redrive(&ParkedTarget::Id(r1)).await.unwrap_err();
    assert!(err.to_string().contains("failed"), "{err}");
}

/// OP-05 Refusals: redrive of a completed row, discard of a pending row with attempts left, a
/// discard without a reason: refused with the state named, nothing changed.
pub async fn op_05(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let done = c.put(c.ev("a")).await;
    assert_eq!(c.cycle1().await.sent, vec![done]);
    let [r1, ..] = poison_key(&c, &park()).await;
    let waiting = c.put(c.ev("b")).await;
    let before = rows(&c, &[done, waiting, r1]).await;

    let e = c.repo().redrive(&ParkedTarget::Id(done)).await.unwrap_err();
    assert!(
        matches!(e, RepositoryError::NotParked { id, .. } if id == done),
        "{e:?}"
    );
    assert!(e.to_string().contains("completed"), "{e}");
    let e = c
        .repo()
        .discard(&ParkedTarget::Id(waiting), "bad payload")
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("pending with 0 of 6 attempts spent"),
        "{e}"
    );
    let e = c
        .repo()
        .discard(&ParkedTarget::Id(r1), "  ")
        .await
        .unwrap_err();
    assert!(matches!(e, RepositoryError::Validation(_)), "{e:?}");
    let e = c
        .repo()
        .discard(&ParkedTarget::Id(r1), &"x".repeat(256))
        .await
        .unwrap_err();
    assert!(matches!(e, RepositoryError::Validation(_)), "{e:?}");
    let e = c
        .repo()
        .redrive(&ParkedTarget::Id(Uuid::new_v4()))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("not in the table"), "{e}");
    // By topic, only parked rows are touched: none in topic "none".
    assert!(
        c.repo()
            .redrive(&ParkedTarget::Topic("none".into()))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        rows(&c, &[done, waiting, r1]).await,
        before,
        "nothing changed"
    );
}

async fn rows(c: &Ctx, ids: &[Uuid]) -> Vec<txoutbox_core::event::OutboxEvent> {
    let mut v = Vec::new();
    for id in ids {
        v.push(c.get(*id).await);
    }
    v
}

/// OP-07 Shared table, mixed settings: a relay with park and one with release drain one table
/// with two poison keys; each poison row ends as the setting of the worker that spent its last
/// attempt says; no key is reordered.
pub async fn op_07(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let relay = |worker: &str, exhausted, topic: &str| Cfg {
        worker: worker.into(),
        exhausted,
        filter: FetchFilter::topics([topic]),
        ..Cfg::default()
    };
    let p1 = c.put(c.ev("k1").topic("t1").max_attempts(2)).await;
    let s1 = c.put(c.ev("k1").topic("t1")).await;
    let p2 = c.put(c.ev("k2").topic("t2").max_attempts(2)).await;
    let s2 = c.put(c.ev("k2").topic("t2")).await;
    for p in [p1, p2] {
        c.broker.script(
            p,
            [
                Action::Reject("poison".into()),
                Action::Reject("poison".into()),
            ],
        );
    }
    // First attempts: p1 by the parking relay, p2 by the releasing one.
    assert_eq!(
        c.cycle(&relay("parker", OnExhausted::Park, "t1"))
            .await
            .report
            .counted
            .len(),
        1
    );
    assert_eq!(
        c.cycle(&relay("releaser", OnExhausted::Release, "t2"))
            .await
            .report
            .counted
            .len(),
        1
    );
    c.advance(Duration::from_secs(3600)).await;
    // Last attempts the other way round.
    let last1 = c
        .cycle(&relay("releaser", OnExhausted::Release, "t1"))
        .await;
    assert_eq!(last1.report.counted.len(), 1);
    let last2 = c.cycle(&relay("parker", OnExhausted::Park, "t2")).await;
    assert_eq!(last2.report.counted.len(), 1);
    c.assert_state(p1, Status::Failed, 2).await;
    c.assert_state(p2, Status::Pending, 2).await;
    // Both relays drain what is left: s1 goes (p1 released its key), s2 waits behind p2.
    let mut sent = drain(&c, &relay("parker", OnExhausted::Park, "t1")).await;
    sent.extend(drain(&c, &relay("releaser", OnExhausted::Release, "t2")).await);
    assert_eq!(sent, vec![s1]);
    c.assert_state(s2, Status::Pending, 0).await;
    // Redriven, p2 goes before s2 (by either relay).
    assert_eq!(
        c.repo()
            .redrive(&ParkedTarget::Topic("t2".into()))
            .await
            .unwrap(),
        vec![p2]
    );
    let sent = drain(&c, &relay("releaser", OnExhausted::Release, "t2")).await;
    assert_eq!(sent, vec![p2, s2], "no key reordered");
}

/// OP-12 A parked head and a deep backlog `[pg]`: 100,000 rows behind one parked head, 1,000
/// other keys due. Every other key drains, each fetch returns a full batch of them and none of
/// the parked key's, and each fetch stays within R85's bound (measured: the slowest fetch is
/// reported and must stay under 250 ms on an unloaded test server, the same order as a fetch on
/// an empty table); the blocked keys list the key as parked, waiting capped.
pub async fn op_12(f: &dyn Factory) {
    use crate::scenarios::pg::{bulk, one, sql};
    let c = Ctx::new(f).await;
    // Key p: its head parked (6 of 6 attempts spent), 100,000 due rows behind it, all older than
    // the 1,000 one-row keys.
    sql(
        &c,
        "INSERT INTO {table} (id, event_type, payload, status, attempts_made, max_attempts, last_error, \
         scheduled_at, created_at, updated_at, aggregate_type, aggregate_id, topic, partition_key) \
         VALUES (gen_random_uuid(), 'bulk', '{\"n\": 0}', 'pending', 6, 6, 'poison', \
                 now() - interval '3 hours', now() - interval '3 hours', now(), 'agg', \
                 gen_random_uuid(), 'bulk', 'p')",
    )
    .await;
    bulk(&c, 100_000, "'p'", "2 hours").await;
    bulk(&c, 1_000, "'k' || g", "1 hour").await;
    sql(&c, "ANALYZE {table}").await;
    let mut slowest = Duration::ZERO;
    let mut fetches = 0;
    let mut taken = 0;
    loop {
        let t = std::time::Instant::now();
        let got = c.fetch("w1", 100, 16).await;
        slowest = slowest.max(t.elapsed());
        if got.is_empty() {
            break;
        }
        fetches += 1;
        taken += got.len();
        let ids: Vec<String> = got.iter().map(|id| format!("'{id}'")).collect();
        let p = one(
            &c,
            &format!(
                "SELECT count(*) AS n FROM {{table}} WHERE partition_key = 'p' AND id IN ({})",
                ids.join(",")
            ),
        )
        .await;
        assert_eq!(
            p["n"], 0,
            "fetch {fetches} returned a row of the parked key"
        );
        sql(
            &c,
            &format!(
                "UPDATE {{table}} SET status = 'completed', completed_at = now(), locked_at = NULL, \
                 locked_by = NULL WHERE id IN ({})",
                ids.join(",")
            ),
        )
        .await;
        assert!(fetches <= 10, "more than 10 fetches");
    }
    assert_eq!((fetches, taken), (10, 1_000), "every other key drained");
    eprintln!("OP-12: 10 fetches of 100 behind a parked head of 100,000 rows; slowest {slowest:?}");
    assert!(
        slowest < Duration::from_millis(250),
        "a fetch took {slowest:?} behind a parked head (R85)"
    );
    let t = std::time::Instant::now();
    let blocked = c.repo().blocked_keys(LEASE, 10).await.expect("blocked");
    eprintln!("OP-12: blocked keys in {:?}", t.elapsed());
    assert_eq!(blocked.len(), 1, "{blocked:?}");
    assert!(blocked[0].parked && blocked[0].partition_key == "p");
    assert_eq!(
        blocked[0].waiting,
        txoutbox_core::repository::BLOCKED_WAITING_CAP
    );
}
