//! L: leases, crash and shutdown.

use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::CancellationToken;
use txoutbox_core::event::{Status, WorkerId};
use txoutbox_core::relay::{CycleReport, Relay};
use txoutbox_core::repository::{
    FetchRequest, Fetched, Outcome, OutcomeKind, OutcomeResult, Retry,
};
use txoutbox_core::scripted::{Action, Gate};

use crate::ctx::{Cfg, Ctx};
use crate::harness::{Factory, RowPatch};

fn w(id: &str) -> WorkerId {
    WorkerId::new(id).unwrap()
}

/// L-01 Stale-lock release.
pub async fn l_01(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k1", "k2", "k3"]).await;
    let now = c.now().await;
    c.set(
        ids[0],
        RowPatch::held("dead", now - chrono::Duration::seconds(120)),
    )
    .await;
    c.set(
        ids[1],
        RowPatch::held("dead", now - chrono::Duration::seconds(120)),
    )
    .await;
    c.set(
        ids[2],
        RowPatch::held("live", now - chrono::Duration::seconds(10)),
    )
    .await;
    assert_eq!(
        c.repo()
            .release_stale_locks(Duration::from_secs(60))
            .await
            .unwrap(),
        2
    );
    let mut holders = vec![];
    for id in ids {
        holders.push(c.get(id).await.locked_by);
    }
    assert_eq!(holders, vec![None, None, Some("live".to_string())]);
}

/// L-02 Stale-lock validation.
pub async fn l_02(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let a = c.put(c.ev("k")).await;
    let now = c.now().await;
    c.set(
        a,
        RowPatch::held("dead", now - chrono::Duration::seconds(120)),
    )
    .await;
    let before = c.get(a).await;
    assert!(c.repo().release_stale_locks(Duration::ZERO).await.is_err());
    assert_eq!(c.get(a).await, before);
}

/// L-03 A lost lease is reported, not written.
pub async fn l_03(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["ka", "kb"]).await;
    let (a, b) = (e[0], e[1]);
    assert_eq!(c.fetch("w1", 100, 1).await, vec![a, b]);
    c.advance(Duration::from_secs(301)).await;
    assert_eq!(c.fetch("w2", 1, 1).await, vec![a]);
    let a_before = c.get(a).await;
    let res = c
        .repo()
        .write_outcomes(
            &w("w1"),
            &[
                Outcome {
                    id: a,
                    kind: OutcomeKind::Completed,
                },
                Outcome {
                    id: b,
                    kind: OutcomeKind::Completed,
                },
            ],
        )
        .await
        .unwrap();
    let ra = res.iter().find(|r| r.id == a).expect("A reported");
    let rb = res.iter().find(|r| r.id == b).expect("B reported");
    assert_eq!(ra.result, OutcomeResult::LeaseLost);
    assert!(
        matches!(
            rb.result,
            OutcomeResult::Applied {
                status: Status::Completed,
                ..
            }
        ),
        "{rb:?}"
    );
    let a_now = c.get(a).await;
    assert_eq!(a_now.locked_by.as_deref(), Some("w2"));
    assert_eq!(a_now, a_before);
    c.assert_state(b, Status::Completed, 0).await;
}

/// L-04 Shutdown in the middle of a batch releases what is left.
pub async fn l_04(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k1", "k2", "k3"]).await;
    let mut before = vec![];
    for id in &ids[1..] {
        before.push(c.get(*id).await);
    }
    let stop = CancellationToken::new();
    c.broker.on_ack({
        let stop = stop.clone();
        move |_| stop.cancel()
    });
    let relay = c.relay(&Cfg::default());
    let r1 = relay.cycle(&stop).await.unwrap();
    assert_eq!(r1.completed, vec![ids[0]]);
    assert_eq!(r1.released, vec![ids[1], ids[2]]);
    for b in &before {
        c.assert_untouched(b).await;
    }
    assert_eq!(c.broker.called_ids(), vec![ids[0]]);
    let c2 = c.cycle(&Cfg::default().worker("w2")).await;
    assert_eq!(c2.sent, vec![ids[1], ids[2]]);
}

/// L-05 Shutdown before the fetch.
pub async fn l_05(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k1", "k2", "k3"]).await;
    c.shutdown.cancel();
    let cy = c.cycle1().await;
    assert_eq!(cy.report, CycleReport::default());
    for id in ids {
        let r = c.get(id).await;
        assert!(r.locked_at.is_none() && r.locked_by.is_none());
    }
    assert!(c.broker.calls().is_empty());
}

/// L-06 Lock helpers and force unlock.
pub async fn l_06(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["ka", "kb"]).await;
    let (a, b) = (e[0], e[1]);
    let now = c.now().await;
    c.set(a, RowPatch::held("w1", now)).await;
    let repo = c.repo();
    assert!(!repo.refresh_lock(a, &w("w2")).await.unwrap());
    assert!(!repo.release_lock(a, &w("w2")).await.unwrap());
    assert_eq!(c.get(a).await.locked_by.as_deref(), Some("w1"));
    assert!(repo.force_unlock(b, "ops").await.is_err());
    assert!(repo.force_unlock(a, "").await.is_err());
    assert!(repo.force_unlock(a, &"a".repeat(256)).await.is_err());
    assert_eq!(c.get(a).await.locked_by.as_deref(), Some("w1"));
    repo.force_unlock(a, "  ops ").await.unwrap();
    let r = c.get(a).await;
    assert!(r.locked_at.is_none() && r.locked_by.is_none());
    assert_eq!(r.last_error.as_deref(), Some("Force unlock: ops"));
    // A reason of exactly 255 characters (after trimming) is the longest accepted (R66).
    let reason = "r".repeat(255);
    c.set(a, RowPatch::held("w1", c.now().await)).await;
    repo.force_unlock(a, &format!(" {reason} ")).await.unwrap();
    let r = c.get(a).await;
    assert!(r.locked_at.is_none() && r.locked_by.is_none());
    assert_eq!(
        r.last_error.as_deref(),
        Some(format!("Force unlock: {reason}").as_str())
    );
}

/// L-07 A crashed relay's rows come back after the lease, in order.
pub async fn l_07(f: &dyn Factory) {
    for per_key in [3, 1] {
        let c = Ctx::new(f).await;
        let e = c.puts(&["k", "k", "k", "j"]).await;
        let req = FetchRequest::new(w("w1"), 100).max_per_key(3);
        let got: Vec<_> = c
            .repo()
            .fetch_and_lock(&req)
            .await
            .unwrap()
            .iter()
            .map(Fetched::id)
            .collect();
        assert_eq!(got, e);
        let w2 = Cfg::default().worker("w2");
        assert!(c.cycle(&w2).await.report.fetched.is_empty());
        c.advance(Duration::from_secs(299)).await;
        assert!(c.cycle(&w2).await.report.fetched.is_empty());
        c.advance(Duration::from_secs(2)).await;
        let w2 = w2.per_key(per_key);
        if per_key == 3 {
            let cy = c.cycle(&w2).await;
            assert_eq!(cy.report.fetched, e);
            assert_eq!(cy.sent, e);
        } else {
            assert_eq!(c.cycle(&w2).await.sent, vec![e[0], e[3]]);
            assert_eq!(c.cycle(&w2).await.sent, vec![e[1]]);
            assert_eq!(c.cycle(&w2).await.sent, vec![e[2]]);
        }
    }
}

/// L-08 A publish in flight finishes on shutdown.
pub async fn l_08(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k1", "k2", "k3"]).await;
    let gate = Gate::new();
    c.broker.script(ids[0], [Action::Gate(gate.clone())]);
    let mut before = vec![];
    for id in &ids[1..] {
        before.push(c.get(*id).await);
    }
    let drive = async {
        c.broker.wait_for_calls(|calls| !calls.is_empty()).await;
        c.shutdown.cancel();
        gate.open();
    };
    let (cy, ()) = tokio::join!(c.cycle1(), drive);
    assert_eq!(cy.report.completed, vec![ids[0]]);
    c.assert_state(ids[0], Status::Completed, 0).await;
    assert_eq!(cy.report.released, vec![ids[1], ids[2]]);
    for b in &before {
        c.assert_untouched(b).await;
    }
    assert_eq!(c.broker.called_ids(), vec![ids[0]]);
}

/// L-09 The lease margin (paused clock).
pub async fn l_09(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k", "k", "k"]).await;
    for id in &ids {
        c.broker
            .script(*id, [Action::Delay(Duration::from_millis(800))]);
    }
    let third = c.get(ids[2]).await;
    let cfg = Cfg {
        lease: Duration::from_secs(2),
        ..Cfg::default().timeout(Duration::from_secs(1)).per_key(3)
    };
    let cy = c.cycle(&cfg).await;
    assert_eq!(cy.report.fetched, ids);
    assert_eq!(cy.report.completed, vec![ids[0], ids[1]]);
    assert_eq!(cy.report.released, vec![ids[2]]);
    assert_eq!(c.broker.called_ids(), vec![ids[0], ids[1]]);
    c.assert_untouched(&third).await;
    let built = Relay::builder(c.repo(), Arc::new(c.broker.clone()))
        .worker_id("w1")
        .lease_ttl(Duration::from_secs(1))
        .publish_timeout(Duration::from_secs(1))
        .build();
    assert!(
        built.is_err(),
        "lease TTL 1 s with publish timeout 1 s was accepted"
    );
}

/// L-10 The lease ends exactly at the TTL `[mem]`: a row locked exactly TTL ago is still held (and
/// holds its key); 1 ms later it is free.
pub async fn l_10(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k", "k"]).await;
    assert_eq!(c.fetch("w1", 1, 1).await, vec![e[0]]);
    let locked_at = c.get(e[0]).await.locked_at.expect("held");
    c.advance(Duration::from_secs(300)).await;
    assert_eq!(
        c.now().await - locked_at,
        chrono::Duration::seconds(300),
        "the backend clock must be exact for L-10"
    );
    assert!(
        c.fetch("w2", 10, 3).await.is_empty(),
        "a lease exactly TTL old was taken over"
    );
    let blocked = c
        .repo()
        .blocked_keys(Duration::from_secs(300), 10)
        .await
        .unwrap();
    assert_eq!(
        blocked.iter().map(|b| b.head_id).collect::<Vec<_>>(),
        vec![e[0]],
        "a head held exactly TTL ago is blocked"
    );
    c.advance(Duration::from_millis(1)).await;
    assert!(
        c.repo()
            .blocked_keys(Duration::from_secs(300), 10)
            .await
            .unwrap()
            .is_empty(),
        "a head whose lease ended 1 ms ago is still listed as blocked"
    );
    assert_eq!(c.fetch("w2", 10, 3).await, e);
    assert_eq!(c.get(e[0]).await.locked_by.as_deref(), Some("w2"));
}

/// L-11 refresh_lock by the holder moves locked_at to now, so the lease runs from the refresh.
pub async fn l_11(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k", "k", "j"]).await;
    assert_eq!(c.fetch("w1", 1, 1).await, vec![e[0]]);
    c.advance(Duration::from_secs(200)).await;
    let t0 = c.now().await;
    assert!(c.repo().refresh_lock(e[0], &w("w1")).await.unwrap());
    let t1 = c.now().await;
    let r = c.get(e[0]).await;
    let at = r.locked_at.expect("still held");
    assert!(
        at >= t0 && at <= t1,
        "refresh_lock left locked_at at {at}, not in [{t0}, {t1}]"
    );
    assert_eq!(r.locked_by.as_deref(), Some("w1"));
    // 250 s after the refresh (450 s after the fetch) the lease still holds the key...
    c.advance(Duration::from_secs(250)).await;
    assert_eq!(c.fetch("w2", 10, 3).await, vec![e[2]]);
    // ...and 301 s after the refresh it has ended.
    c.advance(Duration::from_secs(51)).await;
    assert_eq!(c.fetch("w2", 10, 3).await, vec![e[0], e[1]]);
    assert!(!c.repo().refresh_lock(e[0], &w("w1")).await.unwrap());
    assert_eq!(c.get(e[0]).await.locked_by.as_deref(), Some("w2"));
    // W1's outcome for the row W2 now holds is refused by the guard (R55).
    let before = c.get(e[0]).await;
    let res = c
        .repo()
        .write_outcomes(
            &w("w1"),
            &[Outcome {
                id: e[0],
                kind: OutcomeKind::Completed,
            }],
        )
        .await
        .unwrap();
    assert_eq!(res[0].result, OutcomeResult::LeaseLost);
    assert_eq!(c.get(e[0]).await, before);
}

/// L-12 The bulk release: every id held by the worker, or an error and nothing released (R24).
pub async fn l_12(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["ka", "kb", "kc"]).await;
    let (a, b, free) = (e[0], e[1], e[2]);
    let mut got = c.fetch("w1", 2, 1).await;
    got.sort();
    let mut want = vec![a, b];
    want.sort();
    assert_eq!(got, want);
    let before = [c.get(a).await, c.get(b).await, c.get(free).await];
    let repo = c.repo();
    for (ids, worker, what) in [
        (vec![a, b], "w2", "another worker's rows"),
        (vec![a, free], "w1", "one row not held"),
        (vec![a, uuid::Uuid::new_v4()], "w1", "an unknown id"),
    ] {
        let err = match repo.release_locks(&ids, &w(worker)).await {
            Err(e) => e,
            Ok(n) => panic!(
                "L-12 {what}: release_locks returned Ok({n}), expected ReleaseMismatch (R24)"
            ),
        };
        assert!(
            matches!(
                err,
                txoutbox_core::RepositoryError::ReleaseMismatch { expected: 2, .. }
            ),
            "{what}: {err}"
        );
        for b0 in &before {
            assert_eq!(
                &c.get(b0.id).await,
                b0,
                "{what}: the failed release changed a row"
            );
        }
    }
    assert_eq!(repo.release_locks(&[a, b], &w("w1")).await.unwrap(), 2);
    for id in [a, b] {
        let r = c.get(id).await;
        assert!(
            r.locked_at.is_none() && r.locked_by.is_none(),
            "{id} still held"
        );
        assert_eq!((r.status, r.attempts_made), (Status::Pending, 0));
        assert!(r.last_error.is_none());
    }
    assert_eq!(c.cycle1().await.sent, e);
}

/// L-13 The lease margin at its boundary `[mem]` (paused clock): with exactly the publish timeout
/// left on the lease, the next publish still starts (R49: "at least").
pub async fn l_13(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let ids = c.puts(&["k", "k"]).await;
    c.broker
        .script(ids[0], [Action::Delay(Duration::from_secs(1))]);
    let cfg = Cfg {
        lease: Duration::from_secs(2),
        ..Cfg::default().timeout(Duration::from_secs(1)).per_key(2)
    };
    let cy = c.cycle(&cfg).await;
    assert_eq!(cy.report.fetched, ids);
    assert_eq!(
        cy.report.completed, ids,
        "the second publish, with exactly 1 s of lease left, was not started"
    );
}

/// L-16 The outcome guard checks the worker: after a force-unlock (the row held by nobody) and
/// after another worker took the row, W1's outcomes for it are lease lost and change nothing,
/// while its outcome for a row it still holds applies (second scenario for R54/R55, besides
/// L-03's expired lease).
pub async fn l_16(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["ka", "kb"]).await;
    let (a, b) = (e[0], e[1]);
    assert_eq!(c.fetch("w1", 100, 1).await, vec![a, b]);
    c.repo().force_unlock(a, "ops").await.unwrap();
    let unheld = c.get(a).await;
    let res = c
        .repo()
        .write_outcomes(
            &w("w1"),
            &[
                Outcome {
                    id: a,
                    kind: OutcomeKind::Counted {
                        error: "late".into(),
                        retry: Retry::After(Duration::from_secs(10)),
                        exhausted: txoutbox_core::repository::OnExhausted::Release,
                    },
                },
                Outcome {
                    id: b,
                    kind: OutcomeKind::Completed,
                },
            ],
        )
        .await
        .unwrap();
    let result = |id| {
        res.iter()
            .find(|r| r.id == id)
            .expect("reported")
            .result
            .clone()
    };
    assert_eq!(result(a), OutcomeResult::LeaseLost, "A is held by nobody");
    assert!(
        matches!(
            result(b),
            OutcomeResult::Applied {
                status: Status::Completed,
                ..
            }
        ),
        "{res:?}"
    );
    assert_eq!(c.get(a).await, unheld, "A unchanged");
    // A is due (its force-unlock reason is no retry time): w2 takes it; w1 is still not its
    // holder.
    assert_eq!(c.fetch("w2", 100, 1).await, vec![a]);
    let held_by_w2 = c.get(a).await;
    let res = c
        .repo()
        .write_outcomes(
            &w("w1"),
            &[Outcome {
                id: a,
                kind: OutcomeKind::Completed,
            }],
        )
        .await
        .unwrap();
    assert_eq!(res[0].result, OutcomeResult::LeaseLost, "A is held by w2");
    assert_eq!(c.get(a).await, held_by_w2, "A unchanged, still w2's");
}

/// L-14 release_lock frees a row only for its holder and says whether it did (R24).
pub async fn l_14(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k", "k", "j"]).await;
    assert_eq!(c.fetch("w1", 1, 1).await, vec![e[0]]);
    let held = c.get(e[0]).await;
    let free = c.get(e[2]).await;
    let repo = c.repo();
    for (id, worker, what) in [
        (e[0], "w2", "another worker's row"),
        (e[2], "w1", "a row not held"),
        (uuid::Uuid::new_v4(), "w1", "an unknown id"),
    ] {
        assert!(
            !repo.release_lock(id, &w(worker)).await.unwrap(),
            "L-14 {what}: release_lock returned true (R24)"
        );
    }
    assert_eq!(
        c.get(e[0]).await,
        held,
        "a refused release_lock changed the row"
    );
    assert_eq!(
        c.get(e[2]).await,
        free,
        "a refused release_lock changed the row"
    );
    assert!(
        repo.release_lock(e[0], &w("w1")).await.unwrap(),
        "L-14: release_lock by the holder returned false (R24)"
    );
    let r = c.get(e[0]).await;
    assert!(
        r.locked_at.is_none() && r.locked_by.is_none(),
        "L-14: release_lock by the holder left the row held (R24)"
    );
    assert_eq!(
        (
            r.status,
            r.attempts_made,
            r.last_error.as_deref(),
            r.scheduled_at
        ),
        (Status::Pending, 0, None, held.scheduled_at),
        "L-14: release_lock changed more than the lock"
    );
    assert!(
        !repo.release_lock(e[0], &w("w1")).await.unwrap(),
        "L-14: a second release_lock of a released row returned true (R24)"
    );
    // The key is free at once, without waiting for the lease.
    assert_eq!(c.fetch("w2", 10, 3).await, e);
}

/// L-15 A stale lock exactly `timeout` old is kept `[mem]`: release_stale_locks releases rows
/// locked strictly before now − timeout (R63).
pub async fn l_15(f: &dyn Factory) {
    let c = Ctx::new(f).await;
    let e = c.puts(&["k1", "k2"]).await;
    let now = c.now().await;
    let boundary = now - chrono::Duration::seconds(60);
    c.set(e[0], RowPatch::held("dead", boundary)).await;
    c.set(
        e[1],
        RowPatch::held("dead", boundary - chrono::Duration::milliseconds(1)),
    )
    .await;
    assert_eq!(
        c.now().await,
        now,
        "the backend clock must be exact for L-15"
    );
    assert_eq!(
        c.repo()
            .release_stale_locks(Duration::from_secs(60))
            .await
            .unwrap(),
        1,
        "L-15: only the lock older than the timeout is released (R63)"
    );
    assert_eq!(
        c.get(e[0]).await.locked_by.as_deref(),
        Some("dead"),
        "L-15: a lock exactly 60 s old was released by release_stale_locks(60) (R63)"
    );
    assert!(c.get(e[1]).await.locked_by.is_none());
    c.advance(Duration::from_millis(1)).await;
    assert_eq!(
        c.repo()
            .release_stale_locks(Duration::from_secs(60))
            .await
            .unwrap(),
        1
    );
    assert!(c.get(e[0]).await.locked_by.is_none());
}
