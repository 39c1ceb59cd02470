//! Cross-backend: events written through the diesel writer are drained by the sqlx relay, and
//! events written through the sqlx writer are drained by the diesel relay, on one table, in
//! per-key write order (issue 4; PG-06 checks the same with the suite's scenarios).

use txoutbox_testkit::diesel as common;

use std::collections::BTreeMap;
use std::time::Duration;

use txoutbox_conformance::ctx::{Cfg, Ctx};
use txoutbox_core::event::Status;
use txoutbox_core::scripted::Action;
use uuid::Uuid;

const KEYS: usize = 4;
const PER_KEY: usize = 15;

/// Writes KEYS × PER_KEY events interleaved across keys: one event per transaction for the
/// first half, then the rest two per write call (one transaction, "many"). Returns each key's
/// ids in write order and the partition key of every id.
async fn write_plan(c: &Ctx, peer: bool) -> (BTreeMap<String, Vec<Uuid>>, BTreeMap<Uuid, String>) {
    let mut per_key: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    let mut key_of = BTreeMap::new();
    let keys: Vec<String> = (0..KEYS).map(|k| format!("acct-{k}")).collect();
    let mut pending = Vec::new();
    for n in 0..PER_KEY {
        for k in &keys {
            pending.push((k.clone(), n));
        }
    }
    let (singles, pairs) = pending.split_at(pending.len() / 2);
    let mut batches: Vec<Vec<(String, usize)>> = singles.iter().map(|e| vec![e.clone()]).collect();
    batches.extend(pairs.chunks(2).map(|c| c.to_vec()));
    for batch in batches {
        let mut tx = if peer {
            c.h.begin_peer().await
        } else {
            c.h.begin().await
        };
        let events = batch
            .iter()
            .map(|(k, _)| c.ev(k).build().expect("valid event"))
            .collect();
        let written = tx.write(events).await.expect("write");
        tx.commit().await.expect("commit");
        for (w, (k, _)) in written.iter().zip(&batch) {
            assert!(w.inserted);
            per_key.entry(k.clone()).or_default().push(w.event.id);
            key_of.insert(w.event.id, k.clone());
        }
    }
    (per_key, key_of)
}

/// Drains the table with the relay of one backend (`peer` = the sqlx one) with head runs and
/// concurrent keys, one transient failure on the way; then checks every row completed and
/// each key's deliveries in write order.
async fn drain_and_check(
    c: &Ctx,
    peer: bool,
    per_key: &BTreeMap<String, Vec<Uuid>>,
    key_of: &BTreeMap<Uuid, String>,
) {
    // The third row of acct-1 fails transiently once: its successors must wait for it.
    let flaky = per_key["acct-1"][2];
    c.broker
        .script(flaky, [Action::Transient("unreachable".into())]);
    let mut cfg = Cfg::default().batch(10).per_key(5).concurrency(4);
    cfg.peer = peer;
    let mut idle_rounds = 0;
    for _ in 0..200 {
        let cy = c.cycle(&cfg).await;
        assert!(!cy.report.commit_failed, "{:?}", cy.report);
        if cy.report.fetched.is_empty() {
            if c.broker.accepted().len() >= KEYS * PER_KEY {
                break;
            }
            idle_rounds += 1;
            assert!(idle_rounds < 10, "nothing fetchable but not drained");
            c.advance(Duration::from_millis(1100)).await;
        }
    }
    let accepted = c.broker.accepted_ids();
    assert_eq!(
        accepted.len(),
        KEYS * PER_KEY,
        "every event delivered exactly once"
    );
    let mut delivered: BTreeMap<String, Vec<Uuid>> = BTreeMap::new();
    for id in accepted {
        delivered.entry(key_of[&id].clone()).or_default().push(id);
    }
    assert_eq!(&delivered, per_key, "per-key order kept across backends");
    for ids in per_key.values() {
        for id in ids {
            let row = c.get(*id).await;
            assert_eq!(row.status, Status::Completed, "{id}");
            assert!(row.locked_by.is_none());
        }
    }
    assert_eq!(
        c.get(flaky).await.last_error.as_deref(),
        Some("unreachable")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diesel_writer_then_sqlx_relay() {
    let c = Ctx::new(&common::DieselFactory::new()).await;
    assert_eq!(c.h.repository().capabilities().name, "postgres-diesel");
    assert_eq!(c.h.peer_repository().capabilities().name, "postgres-sqlx");
    let (per_key, key_of) = write_plan(&c, false).await;
    drain_and_check(&c, true, &per_key, &key_of).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_writer_then_diesel_relay() {
    let c = Ctx::new(&common::DieselFactory::new()).await;
    let (per_key, key_of) = write_plan(&c, true).await;
    drain_and_check(&c, false, &per_key, &key_of).await;
}
