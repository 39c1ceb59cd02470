//! TX: delivery in one transaction (R84). They run with the relays of the
//! trial in delivery mode `transaction` ([`InTransaction`](crate::InTransaction)); TX-01,
//! TX-02, TX-03 and TX-05 need SQL (`[pg]`); TX-02's commit and rollback variants and TX-04 run
//! on every backend that supports the mode.

use std::collections::HashMap;
use std::time::Duration;

use txoutbox_core::DeliveryMode;
use txoutbox_core::event::{Status, WorkerId};
use txoutbox_core::repository::FetchRequest;
use txoutbox_core::scripted::{Action, Gate};
use uuid::Uuid;

use crate::ctx::{Cfg, Ctx};
use crate::harness::{Factory, RowPatch};
use crate::scenarios::pg::{one, sql};

async fn tx_ctx(f: &dyn Factory) -> Ctx {
    let c = Ctx::new(f).await;
    assert_eq!(
        c.h.delivery(),
        DeliveryMode::Transaction,
        "TX scenarios run with InTransaction(factory)"
    );
    c
}

/// TX-01 One write per row.
pub async fn tx_01(f: &dyn Factory) {
    let c = tx_ctx(f).await;
    // Count every row version an UPDATE makes, with a trigger in the trial's schema.
    sql(
        &c,
        "CREATE TABLE {schema}.tx01_updates (id uuid NOT NULL);
         CREATE FUNCTION {schema}.tx01_count() RETURNS trigger LANGUAGE plpgsql AS $f$
           BEGIN INSERT INTO {schema}.tx01_updates VALUES (NEW.id); RETURN NEW; END $f$;
         CREATE TRIGGER tx01 AFTER UPDATE ON {table} FOR EACH ROW
           EXECUTE FUNCTION {schema}.tx01_count();",
    )
    .await;
    let mut keys = Vec::new();
    for k in ["k1", "k2", "k3"] {
        keys.extend([k; 4]);
    }
    let ids = c.puts(&keys).await;
    let cy = c.cycle(&Cfg::default().per_key(4)).await;
    assert_eq!(cy.report.completed.len(), 12, "{:?}", cy.report);
    for id in &ids {
        let r = c.get(*id).await;
        assert_eq!(r.status, Status::Completed);
        assert!(r.locked_at.is_none() && r.locked_by.is_none(), "{r:?}");
        assert_eq!(r.updated_at, r.completed_at, "one write sets both");
    }
    let versions = sql(
        &c,
        "SELECT id::text AS id, count(*) AS n FROM {schema}.tx01_updates GROUP BY id",
    )
    .await;
    assert_eq!(versions.len(), 12, "{versions:?}");
    for v in &versions {
        assert_eq!(v["n"], 1, "each row updated once: {v}");
    }
}

/// TX-02 A crash frees the rows at once.
pub async fn tx_02(f: &dyn Factory) {
    let c = tx_ctx(f).await;
    let e = c.puts(&["k", "k"]).await;
    let (a, b) = (e[0], e[1]);
    let gate = Gate::new();
    c.broker.script(a, [Action::Gate(gate.clone())]);
    let relay_a = c.relay(&Cfg::default().worker("relay-a"));
    let a_cycle = relay_a.cycle(&c.shutdown);
    let rest = async {
        c.broker
            .wait_for_calls(|calls| calls.iter().any(|x| x.event_id == a))
            .await;
        // Relay A's connection is ended by the server while it publishes a.
        let killed = one(
            &c,
            "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity \
              WHERE state = 'idle in transaction' AND position('{table}' in query) > 0",
        )
        .await;
        assert_eq!(killed["n"], 1, "relay A's open delivery transaction");
        // Relay B fetches at once, without waiting for any lease: a, not b.
        let b_cycle = c.cycle(&Cfg::default().worker("relay-b")).await;
        assert_eq!(b_cycle.report.fetched, vec![a], "B fetches a (not b)");
        assert_eq!(b_cycle.sent, vec![a], "B publishes a again");
        gate.open();
    };
    let (a_report, ()) = tokio::join!(a_cycle, rest);
    let a_report = a_report.expect("relay A's cycle ends");
    assert!(
        a_report.commit_failed,
        "A's outcome write fails: {a_report:?}"
    );
    let b_next = c.cycle(&Cfg::default().worker("relay-b")).await;
    assert_eq!(b_next.sent, vec![b], "then b");
    let order: Vec<Uuid> = c.broker.accepted_ids();
    assert_eq!(order, vec![a, a, b], "a at least once, then b, in order");
    for id in [a, b] {
        let r = c.get(id).await;
        assert_eq!((r.status, r.attempts_made), (Status::Completed, 0));
        assert!(r.locked_by.is_none());
    }
}

/// TX-02 (commit) A failed outcome commit loses nothing: the rows are free at once and are
/// published again (R84, at least once).
pub async fn tx_02_commit(f: &dyn Factory) {
    let c = tx_ctx(f).await;
    let e = c.puts(&["k1", "k2", "k1"]).await;
    c.h.fail_next_outcome_commit();
    let first = c.cycle1().await;
    assert!(first.report.commit_failed);
    assert_eq!(first.sent, vec![e[0], e[1]]);
    for id in &e {
        let r = c.get(*id).await;
        assert_eq!((r.status, r.attempts_made), (Status::Pending, 0), "{r:?}");
        assert!(
            r.locked_at.is_none() && r.locked_by.is_none(),
            "nothing held: {r:?}"
        );
    }
    // No clock moves: the rows are fetched again at once.
    let again = c.cycle1().await;
    assert_eq!(again.sent, vec![e[0], e[1]]);
    let last = c.cycle1().await;
    assert_eq!(last.sent, vec![e[2]]);
}

/// TX-02 (rollback) A delivery rolled back with [`Delivery::rollback`] writes nothing and frees
/// its rows at once (R84): another worker's fetch gets the same rows, in the same order, each as
/// it was before the first fetch; then a relay publishes them.
///
/// [`Delivery::rollback`]: txoutbox_core::repository::Delivery::rollback
pub async fn tx_02_rollback(f: &dyn Factory) {
    let c = tx_ctx(f).await;
    let e = c.puts(&["k1", "k1", "k2"]).await;
    let mut before = Vec::new();
    for id in &e {
        before.push(c.get(*id).await);
    }
    let bound = c.relay(&Cfg::default()).config().delivery_bound();
    // Each worker's delivery holds every row, in write order per key; then it rolls back.
    for (worker, what) in [
        ("w-first", "the first delivery holds every row"),
        ("w-second", "rolled back: the rows are free at once"),
    ] {
        let req = FetchRequest::new(WorkerId::new(worker).unwrap(), 10).max_per_key(4);
        let (rows, delivery) = c.repo().begin_delivery(&req, bound).await.expect("fetch");
        assert_eq!(rows.iter().map(|r| r.id()).collect::<Vec<_>>(), e, "{what}");
        delivery.rollback().await;
    }
    for (id, b) in e.iter().zip(&before) {
        assert_eq!(
            &c.get(*id).await,
            b,
            "row {id} unchanged by two rolled-back deliveries"
        );
    }
    assert_eq!(
        c.cycle1().await.sent,
        vec![e[0], e[2]],
        "heads of k1 and k2"
    );
    assert_eq!(c.cycle1().await.sent, vec![e[1]]);
}

/// TX-03 A silent relay is cut off.
pub async fn tx_03(f: &dyn Factory) {
    let c = tx_ctx(f).await;
    let a = c.put(c.ev("k")).await;
    let relay = c.relay(&Cfg::default().timeout(Duration::from_secs(2)));
    let bound = relay.config().delivery_bound();
    let req = FetchRequest::new(WorkerId::new("silent").unwrap(), 10);
    // A relay whose task stops after the fetch: it neither publishes nor rolls back.
    let (rows, held) = c.repo().begin_delivery(&req, bound).await.expect("fetch");
    assert_eq!(rows.iter().map(|r| r.id()).collect::<Vec<_>>(), vec![a]);
    assert!(c.fetch("w2", 10, 1).await.is_empty(), "a is held");
    let started = std::time::Instant::now();
    let limit = bound.server_timeout + Duration::from_secs(3);
    loop {
        // The server-side timer is what is being waited for; poll it, bounded.
        tokio::time::sleep(Duration::from_millis(200)).await;
        if c.fetch("w2", 10, 1).await == vec![a] {
            break;
        }
        assert!(
            started.elapsed() < limit,
            "the server did not end the silent transaction within {limit:?}"
        );
    }
    drop(held);
}

/// TX-04 An outage writes nothing.
pub async fn tx_04(f: &dyn Factory) {
    let c = tx_ctx(f).await;
    let mut keys = Vec::new();
    for k in 0..5 {
        let key = format!("k{k}");
        keys.push(key.clone());
        keys.push(key);
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let ids = c.puts(&refs).await;
    let mut before = HashMap::new();
    for id in &ids {
        before.insert(*id, c.get(*id).await);
    }
    c.broker
        .set_default(Action::Transient("broker down".into()));
    for n in 1..=3 {
        let cy = c.cycle1().await;
        assert!(cy.sent.is_empty());
        assert!(
            cy.report.broker_unreachable,
            "cycle {n}: the relay knows to wait before fetching again"
        );
        for id in &ids {
            let r = c.get(*id).await;
            let b = &before[id];
            assert_eq!(
                (
                    r.attempts_made,
                    r.scheduled_at,
                    r.updated_at,
                    r.locked_at,
                    &r.last_error
                ),
                (
                    b.attempts_made,
                    b.scheduled_at,
                    b.updated_at,
                    b.locked_at,
                    &b.last_error
                ),
                "cycle {n}: row {id} changed during the outage"
            );
        }
    }
    c.broker.set_default(Action::Ok);
    let mut sent = Vec::new();
    for _ in 0..20 {
        let cy = c.cycle1().await;
        if cy.report.fetched.is_empty() {
            break;
        }
        sent.extend(cy.sent);
    }
    let mut by_key: HashMap<String, Vec<Uuid>> = HashMap::new();
    for (id, k) in ids.iter().zip(&keys) {
        by_key.entry(k.clone()).or_default().push(*id);
    }
    assert_eq!(
        sent.len(),
        10,
        "each row published once after the outage: {sent:?}"
    );
    for (k, want) in by_key {
        let got: Vec<Uuid> = sent
            .iter()
            .filter(|id| want.contains(id))
            .copied()
            .collect();
        assert_eq!(got, want, "key {k} in write order");
    }
}

/// TX-05 Both modes and the ancestor's lease on one table.
pub async fn tx_05(f: &dyn Factory) {
    let c = tx_ctx(f).await;
    let mut keys = Vec::new();
    for _ in 0..10 {
        for k in 0..20 {
            keys.push(format!("k{k}"));
        }
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let ids = c.puts(&refs).await;
    // k0's first row is leased by another worker, ancestor style, and the lease is live.
    let now = c.now().await;
    c.set(ids[0], RowPatch::held("ancestor-relay", now)).await;
    for (n, id) in ids.iter().enumerate() {
        c.broker.script(
            *id,
            [Action::Delay(Duration::from_millis((n as u64 * 7) % 5))],
        );
    }
    let mut tx_cfg = Cfg::default().worker("tx-relay");
    tx_cfg.delivery = Some(DeliveryMode::Transaction);
    let mut lease_cfg = Cfg::default().worker("lease-relay");
    lease_cfg.delivery = Some(DeliveryMode::Lease);
    let (lease, txr) = (c.relay(&lease_cfg), c.relay(&tx_cfg));
    let (lease, txr, shutdown) = (&lease, &txr, &c.shutdown);
    let drain = |rounds: usize| async move {
        for _ in 0..rounds {
            let (a, b) = tokio::join!(lease.cycle(shutdown), txr.cycle(shutdown));
            let (a, b) = (a.expect("lease cycle"), b.expect("tx cycle"));
            if a.fetched.is_empty() && b.fetched.is_empty() {
                return;
            }
        }
        panic!("not drained in {rounds} rounds");
    };
    drain(200).await;
    let k0: Vec<Uuid> = ids
        .iter()
        .zip(&keys)
        .filter(|(_, k)| *k == "k0")
        .map(|(id, _)| *id)
        .collect();
    for id in &ids {
        let r = c.get(*id).await;
        if k0.contains(id) {
            assert_eq!(r.status, Status::Pending, "k0 waits behind the live lease");
        } else {
            assert_eq!(r.status, Status::Completed, "{r:?}");
        }
    }
    c.advance(Duration::from_secs(301)).await;
    drain(200).await;
    let accepted = c.broker.accepted_ids();
    for k in 0..20 {
        let key = format!("k{k}");
        let want: Vec<Uuid> = ids
            .iter()
            .zip(&keys)
            .filter(|(_, kk)| **kk == key)
            .map(|(id, _)| *id)
            .collect();
        let got: Vec<Uuid> = accepted
            .iter()
            .filter(|id| want.contains(id))
            .copied()
            .collect();
        assert_eq!(got, want, "key {key}: every row once, in write order");
    }
    for id in &ids {
        let r = c.get(*id).await;
        assert_eq!(r.status, Status::Completed);
        assert!(
            r.locked_at.is_none() && r.locked_by.is_none(),
            "nothing left locked"
        );
    }
}
