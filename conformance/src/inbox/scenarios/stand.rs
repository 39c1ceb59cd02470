//! SI: the inbox stand tests (scenarios.md section 29): 600 messages over 20 keys through three
//! runners with seeded failures, lost acknowledgements and duplicates.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use txoutbox_core::event::Status;
use txoutbox_core::inbox::repository::InboxRepository;
use txoutbox_core::inbox::{OnFailure, Runner};

use crate::inbox::ctx::{Ictx, g};
use crate::inbox::harness::{InboxFactory, InboxHarness};
use crate::inbox::script::Act;

const KEYS: usize = 20;
const PER_KEY: usize = 30;

struct Plan {
    /// (message id, key index, n) in delivery order.
    order: Vec<(String, usize, usize)>,
}

fn plan(rng: &mut StdRng) -> Plan {
    let mut next = [0usize; KEYS];
    let mut order = Vec::new();
    while order.len() < KEYS * PER_KEY {
        let k = rng.random_range(0..KEYS);
        if next[k] == PER_KEY {
            continue;
        }
        let id = format!("{:016x}", rng.random::<u64>());
        order.push((id, k, next[k]));
        next[k] += 1;
    }
    Plan { order }
}

fn key(k: usize) -> String {
    format!("acct-{k:02}")
}

async fn stand<F: InboxFactory>(f: &F, rewind: bool) {
    let seed: u64 = std::env::var("INBOX_STAND_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_261_201);
    println!("SI-0{} seed {seed}", if rewind { 2 } else { 1 });
    let mut rng = StdRng::seed_from_u64(seed);
    let c = Ictx::new(f).await;
    let p = plan(&mut rng);
    let mut idx = HashMap::new();
    let mut by_id = HashMap::new();
    for (id, k, n) in &p.order {
        let i = c.deliver(id, Some(&key(*k)));
        idx.insert(id.clone(), i);
        by_id.insert(id.clone(), (*k, *n));
    }
    let shared_rng = Arc::new(Mutex::new(StdRng::seed_from_u64(seed ^ 0x5eed)));
    let r2 = shared_rng.clone();
    c.handler.always(Act::Choose(Arc::new(move || {
        let x: f64 = r2.lock().unwrap().random();
        if x < 0.05 {
            Act::Fail("boom".into())
        } else if x < 0.08 {
            Act::Transient("down".into())
        } else {
            Act::Write
        }
    })));
    if !rewind {
        c.sub
            .partitioned(Arc::new(|k: &str| k[5..].parse::<usize>().unwrap_or(0) % 3));
    }
    let build = |i: usize| -> Runner<_> {
        let b = Runner::builder(c.backend(), Arc::new(c.sub.view(i)), "g")
            .handler(c.handler.clone())
            .worker_id(format!("w{}", i + 1))
            .messages_per_transaction(1)
            .concurrency(4)
            .process_stored(false)
            .random_source(Box::new(txoutbox_core::backoff::SeededRng::new(
                seed + i as u64,
            )))
            .on_failure(if rewind {
                OnFailure::Rewind
            } else {
                OnFailure::Record
            });
        b.build().unwrap()
    };
    let mut runners: Vec<Option<Runner<_>>> = (0..3).map(|i| Some(build(i))).collect();
    let (mut recorded, mut dups, mut commit_failures, mut row_commit_failures) = (0, 0, 0, 0);
    let mut later: Vec<(usize, usize)> = Vec::new();
    let mut done_rounds = 0;
    for round in 0..20_000usize {
        done_rounds = round;
        if rewind && round == 50 {
            // kill(w2): it dies holding a delivery it read and never ended.
            let _held = txoutbox_core::inbox::Subscription::next(&c.sub.view(1), 1, Duration::ZERO)
                .await
                .unwrap();
            runners[1] = None;
        }
        if rewind && round == 51 {
            runners[1] = Some(build(1));
        }
        let due: Vec<usize> = later
            .iter()
            .filter(|(r, _)| *r <= round)
            .map(|(_, i)| *i)
            .collect();
        later.retain(|(r, _)| *r > round);
        for i in due {
            c.sub.duplicate(i);
        }
        let mut active = false;
        for r in runners.iter().flatten() {
            for _ in 0..10 {
                {
                    let mut g = shared_rng.lock().unwrap();
                    if g.random::<f64>() < 0.03 {
                        // The next commit of a random message fails (its acknowledgement is lost).
                        let m = g.random_range(0..p.order.len());
                        c.sub.fail_commit(m);
                    }
                }
                let Some(res) = r.handle_next().await.unwrap() else {
                    break;
                };
                active = true;
                if res.outcome == txoutbox_core::inbox::DeliveryOutcome::Recorded {
                    recorded += 1;
                }
                if res.outcome == txoutbox_core::inbox::DeliveryOutcome::Duplicate {
                    dups += 1;
                }
                if res.commit_failed {
                    commit_failures += 1;
                }
                if res.committed {
                    let mut g = shared_rng.lock().unwrap();
                    if g.random::<f64>() < 0.05 {
                        let id = res.message_id.clone().unwrap();
                        later.push((round + g.random_range(1..20usize), idx[&id]));
                    }
                }
            }
        }
        if !rewind {
            for w in ["p1", "p2"] {
                let (batch, mpk) = {
                    let mut g = shared_rng.lock().unwrap();
                    (
                        [1, 5, 20][g.random_range(0..3usize)],
                        [1, 5][g.random_range(0..2usize)],
                    )
                };
                let proc = c
                    .processor()
                    .worker_id(w)
                    .batch_size(batch)
                    .max_per_key(mpk)
                    .handler_concurrency(2)
                    .build()
                    .unwrap();
                let rep = c.cycle(&proc).await;
                active |= !rep.fetched.is_empty();
                row_commit_failures += rep
                    .outcomes
                    .iter()
                    .filter(|(_, o)| {
                        matches!(o, txoutbox_core::inbox::RowReport::CommitFailed { .. })
                    })
                    .count();
            }
        }
        if c.sub.is_drained() && later.is_empty() {
            let counts = c.backend().counts(&g()).await.unwrap();
            let total: i64 = counts.iter().map(|s| s.count).sum();
            if total == (KEYS * PER_KEY) as i64
                && counts.iter().all(|s| s.status != Status::Pending)
            {
                break;
            }
        }
        if !active {
            c.advance(Duration::from_secs(1)).await;
        }
    }
    assert!(
        done_rounds < 19_999,
        "the stand did not finish within 20,000 rounds"
    );
    let counts = c.backend().counts(&g()).await.unwrap();
    assert_eq!(counts.len(), 1, "{counts:?}");
    assert_eq!(
        (counts[0].status, counts[0].count),
        (Status::Completed, (KEYS * PER_KEY) as i64)
    );
    let effects = c.effects().await;
    let mut uniq = effects.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(
        (effects.len(), uniq.len()),
        (KEYS * PER_KEY, KEYS * PER_KEY),
        "each message's effect exactly once"
    );
    let mut per_key: Vec<Vec<usize>> = vec![Vec::new(); KEYS];
    for e in &effects {
        let (k, n) = by_id[e];
        per_key[k].push(n);
    }
    let out_of_order = per_key
        .iter()
        .filter(|ns| ns.windows(2).any(|w| w[0] > w[1]))
        .count();
    println!(
        "SI-0{}: {done_rounds} rounds; recorded failures {recorded}, duplicates {dups}, commit failures {commit_failures}, row commit failures {row_commit_failures}, keys out of n order {out_of_order}",
        if rewind { 2 } else { 1 }
    );
    if !rewind {
        assert_eq!(out_of_order, 0, "every key's effects in n order");
        assert_eq!(row_commit_failures, 0);
    }
    let _ = c.h.kind();
}

/// SI-01: recorded failures, keys partitioned across three runners, two processors (R119,
/// R126, R144, R145, R150, R152, R166).
pub async fn si_01<F: InboxFactory>(f: &F) {
    stand(f, false).await;
}

/// SI-02: the rewind policy, competing runners, one killed and restarted (R110, R119, R127,
/// R128, R146).
pub async fn si_02<F: InboxFactory>(f: &F) {
    stand(f, true).await;
}

#[allow(dead_code)]
fn _h<H: InboxHarness>() {}
