//! The runner's batch scenarios (batches.md, group BT: R183 to R188, R190): one transaction per
//! batch of ready deliveries, each run all or nothing under a savepoint of its own, and the
//! fallback to one message per transaction whenever a batch cannot finish as a batch. The
//! processor's BT-11 and the brokers' BT-13 are checked elsewhere. They run the runner's loop
//! (`run_until_stopped`) on tokio's real clock and count transactions with the trial's
//! recorder ([`crate::inbox::ctx::Recorder::transactions`]).

use std::sync::Arc;
use std::time::Duration;

use txoutbox_core::event::Status;
use txoutbox_core::inbox::scripted::{AckOp, ScriptedSubscription};
use txoutbox_core::inbox::{
    DeliveryOutcome as O, FallbackReason, Runner, RunnerBuilder, TransactionSide,
};

use crate::inbox::ctx::Ictx;
use crate::inbox::harness::{InboxFactory, InboxHarness};
use crate::inbox::script::{Act, Gate};

/// The runner with batches on: 16 messages per transaction, concurrency 64 (R183's defaults).
fn batched<H: InboxHarness>(c: &Ictx<H>) -> RunnerBuilder<H::Backend> {
    c.runner().messages_per_transaction(16).concurrency(64)
}

/// Runs `r`'s loop until `n` delivery results were recorded, then stops it.
async fn run_until<H: InboxHarness>(c: &Ictx<H>, r: &Runner<H::Backend>, n: usize) {
    r.start();
    let control = async {
        c.rec.wait_deliveries(n).await;
        r.stop();
    };
    let (done, ()) = tokio::join!(r.run_until_stopped(), control);
    done.expect("the runner runs");
}

/// 16 messages over 4 keys, 4 each, interleaved: m1..m16 on k1 k2 k3 k4 k2 k1 k3 k4 k1 k2 …
/// (m5 is k2's second message).
const KEYS: [&str; 16] = [
    "k1", "k2", "k3", "k4", "k2", "k1", "k3", "k4", "k1", "k2", "k3", "k4", "k1", "k2", "k3", "k4",
];

fn deliver_16<H: InboxHarness>(c: &Ictx<H>) -> Vec<(String, &'static str, usize)> {
    (1..=16)
        .map(|i| {
            let id = format!("m{i}");
            let k = KEYS[i - 1];
            let idx = c.deliver(&id, Some(k));
            (id, k, idx)
        })
        .collect()
}

/// The effects of key `k`'s messages, in the order they were written.
fn of_key(effects: &[String], all: &[(String, &'static str, usize)], k: &str) -> Vec<String> {
    effects
        .iter()
        .filter(|e| all.iter().any(|(id, kk, _)| id == *e && *kk == k))
        .cloned()
        .collect()
}

fn runner_transactions<H: InboxHarness>(c: &Ictx<H>) -> Vec<(usize, Option<FallbackReason>)> {
    c.rec
        .transactions
        .lock()
        .expect("poisoned")
        .iter()
        .filter(|t| t.side == TransactionSide::Runner)
        .map(|t| (t.messages, t.fallback))
        .collect()
}

/// BT-01: 16 new messages over 4 keys ready at once: one transaction, 16 rows completed,
/// effects each once, per key in delivery order (R184, R185).
pub async fn bt_01<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let all = deliver_16(&c);
    let r = batched(&c).build().unwrap();
    run_until(&c, &r, 16).await;
    assert_eq!(runner_transactions(&c), vec![(16, None)], "one T of 16");
    let effects = c.effects().await;
    assert_eq!(effects.len(), 16, "{effects:?}");
    for (id, _, idx) in &all {
        assert_eq!(c.row_of(id).await.status, Status::Completed, "{id}");
        assert_eq!(c.sub.acks(*idx), vec![AckOp::Commit], "{id}");
    }
    for k in ["k1", "k2", "k3", "k4"] {
        let want: Vec<String> = all
            .iter()
            .filter(|(_, kk, _)| *kk == k)
            .map(|(id, _, _)| id.clone())
            .collect();
        assert_eq!(of_key(&effects, &all, k), want, "order of {k}");
    }
}

/// The end state of BT-02 and BT-03: m5 (k2's second) failed alone, k2's later messages landed
/// behind it, everything else completed, in one transaction.
async fn one_failed_run<H: InboxHarness>(c: &Ictx<H>, all: &[(String, &'static str, usize)]) {
    assert_eq!(runner_transactions(c), vec![(16, None)], "one T of 16");
    let m5 = c.row_of("m5").await;
    assert_eq!((m5.status, m5.attempts_made), (Status::Pending, 1));
    let effects = c.effects().await;
    assert!(!effects.contains(&"m5".to_owned()), "{effects:?}");
    for (id, k, idx) in all {
        let row = c.row_of(id).await;
        let behind = *k == "k2" && ["m10", "m14"].contains(&id.as_str());
        if behind {
            // R145: landed and waiting behind m5, not run.
            assert_eq!(
                (row.status, row.attempts_made),
                (Status::Pending, 0),
                "{id}"
            );
            assert!(!effects.contains(id), "{id} ran behind a failed run");
        } else if id != "m5" {
            assert_eq!(row.status, Status::Completed, "{id}");
            assert_eq!(effects.iter().filter(|e| *e == id).count(), 1, "{id}");
        }
        // G-18: no other delivery rewound or failed; every delivery committed.
        assert_eq!(c.sub.acks(*idx), vec![AckOp::Commit], "{id}");
    }
    let results = c.rec.results();
    let of = |id: &str| {
        results
            .iter()
            .find(|r| r.message_id.as_deref() == Some(id))
            .map(|r| r.outcome)
    };
    assert_eq!(of("m5"), Some(O::Recorded));
    assert_eq!(of("m10"), Some(O::Landed));
    assert_eq!(of("m14"), Some(O::Landed));
}

/// BT-02: a failed run in a batch (savepoint form): its writes undone alone, its row recorded,
/// its key's later messages landed behind it, every other key completed, one T (R186, G-17).
pub async fn bt_02<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let all = deliver_16(&c);
    c.script("m5", vec![Act::Fail("boom".into())]);
    let r = batched(&c).build().unwrap();
    run_until(&c, &r, 16).await;
    one_failed_run(&c, &all).await;
}

/// BT-03 `[pg]`: an SQL error in a batch: the 5th handler's statement fails (aborting T until the
/// rollback to its savepoint); the end state of BT-02, no other delivery rewound or failed
/// (R186, G-18).
pub async fn bt_03<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let all = deliver_16(&c);
    c.script("m5", vec![Act::Sql("SELECT 1/0".into())]);
    let r = batched(&c).build().unwrap();
    run_until(&c, &r, 16).await;
    one_failed_run(&c, &all).await;
}

/// BT-04: a batch whose commit fails: nothing of T applies; every message goes again one per
/// transaction and completes once; one fallback, reason `commit` (R188, R190).
pub async fn bt_04<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let all = deliver_16(&c);
    c.h.fail_next_row_commit();
    let r = batched(&c).build().unwrap();
    run_until(&c, &r, 16).await;
    let ts = runner_transactions(&c);
    assert_eq!(ts[0], (16, Some(FallbackReason::Commit)), "{ts:?}");
    assert_eq!(ts[1..], vec![(1, None); 16], "{ts:?}");
    let effects = c.effects().await;
    assert_eq!(effects.len(), 16, "{effects:?}");
    for (id, _, idx) in &all {
        assert_eq!(c.row_of(id).await.status, Status::Completed, "{id}");
        assert_eq!(c.sub.acks(*idx), vec![AckOp::Commit], "{id}");
    }
    let runs = c.handler.runs().len();
    assert_eq!(runs, 32, "each message ran in T and again alone");
}

/// BT-05: 8 completed messages redelivered among 8 new ones: 8 `duplicate`, 8 completed, the
/// new ones' effects once, every delivery committed (R109, R184).
pub async fn bt_05<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let mut idx = Vec::new();
    for i in 1..=8 {
        idx.push(c.deliver(&format!("o{i}"), Some(&format!("k{i}"))));
    }
    let one = c.runner().build().unwrap();
    for _ in 0..8 {
        assert_eq!(c.handle(&one).await.outcome, O::Completed);
    }
    drop(one);
    for i in 1..=8 {
        c.duplicate(&format!("o{i}"));
        idx.push(c.deliver(&format!("n{i}"), Some(&format!("k{i}"))));
    }
    let r = batched(&c).build().unwrap();
    run_until(&c, &r, 24).await;
    let results = c.rec.results();
    let batch = &results[8..];
    let count = |o: O| batch.iter().filter(|r| r.outcome == o).count();
    assert_eq!(
        (count(O::Duplicate), count(O::Completed)),
        (8, 8),
        "{batch:?}"
    );
    assert!(batch.iter().all(|r| r.committed), "{batch:?}");
    let effects = c.effects().await;
    for i in 1..=8 {
        for id in [format!("o{i}"), format!("n{i}")] {
            assert_eq!(effects.iter().filter(|e| **e == id).count(), 1, "{id}");
        }
    }
    assert_eq!(runner_transactions(&c), vec![(16, None)]);
}

/// BT-06: m1 and m2 of key k in one batch, m1's run fails (record): m1 recorded, m2 landed and
/// not run; once m1's retry completes (a processor), m2 runs (R145, R184).
pub async fn bt_06<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.deliver("m1", Some("k"));
    c.deliver("m2", Some("k"));
    c.script("m1", vec![Act::Fail("boom".into()), Act::Write]);
    let r = batched(&c)
        .backoff(Ictx::<F::Harness>::backoff(1.0))
        .build()
        .unwrap();
    run_until(&c, &r, 2).await;
    assert_eq!(runner_transactions(&c), vec![(2, None)]);
    let res = c.rec.results();
    assert_eq!(
        res.iter().map(|r| r.outcome).collect::<Vec<_>>(),
        vec![O::Recorded, O::Landed]
    );
    assert!(c.effects().await.is_empty());
    assert_eq!(c.row_of("m2").await.attempts_made, 0);
    c.advance(Duration::from_secs(60)).await;
    let p = c.processor().build().unwrap();
    for _ in 0..4 {
        c.cycle(&p).await;
    }
    assert_eq!(c.effects().await, vec!["m1", "m2"]);
}

/// BT-07: two runners whose batches hold the same keys in opposite delivery orders (w1: a, b;
/// w2: b, a, 8 key pairs), started at once: both finish within 5 s, no deadlock fallback,
/// effects each once, per key in order (R185 step 1: key locks in hash order).
pub async fn bt_07<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let sub2 = ScriptedSubscription::new(c.h.clock());
    for p in 0..8 {
        let (a, b) = (format!("a{p}"), format!("b{p}"));
        c.sub.push(c.msg(&format!("{a}-1"), Some(&a)));
        c.sub.push(c.msg(&format!("{b}-1"), Some(&b)));
        sub2.push(c.msg(&format!("{b}-2"), Some(&b)));
        sub2.push(c.msg(&format!("{a}-2"), Some(&a)));
    }
    let w1 = batched(&c).build().unwrap();
    let w2 = Runner::builder(c.backend(), Arc::new(sub2.clone()), "g")
        .worker_id("w2")
        .handler(c.handler.clone())
        .process_stored(false)
        .sources(["src"])
        .hooks(c.rec.clone())
        .build()
        .unwrap();
    w1.start();
    w2.start();
    let control = async {
        c.rec.wait_deliveries(32).await;
        w1.stop();
        w2.stop();
    };
    let all = async { tokio::join!(w1.run_until_stopped(), w2.run_until_stopped(), control) };
    let (d1, d2, ()) = tokio::time::timeout(Duration::from_secs(5), all)
        .await
        .expect("two crossing batches finish within 5 s (no deadlock)");
    d1.unwrap();
    d2.unwrap();
    let ts = runner_transactions(&c);
    assert!(
        ts.iter().all(|(_, f)| f.is_none()),
        "a batch fell back: {ts:?}"
    );
    let effects = c.effects().await;
    assert_eq!(effects.len(), 32, "{effects:?}");
    for p in 0..8 {
        for k in [format!("a{p}"), format!("b{p}")] {
            let mine: Vec<&String> = effects.iter().filter(|e| e.starts_with(&k)).collect();
            assert_eq!(mine.len(), 2, "{k}: {mine:?}");
        }
    }
}

/// BT-08: a paced subscription (one message every 200 ms): each is committed before the next
/// arrives, in a transaction of one (R184: a batch never waits to fill). The next message comes
/// 200 ms after the previous one or once that one is committed, whichever is later (a loaded
/// database may take longer than 200 ms for a transaction); a runner that held a lone message
/// back to fill a batch never commits it and fails the 5 s bound.
pub async fn bt_08<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let r = batched(&c).build().unwrap();
    r.start();
    let control = async {
        for i in 1..=5 {
            let idx = c.deliver(&format!("m{i}"), Some("k"));
            let paced = tokio::time::sleep(Duration::from_millis(200));
            let committed = async {
                while c.sub.acks(idx) != vec![AckOp::Commit] {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(5), committed)
                .await
                .unwrap_or_else(|_| panic!("m{i} was held back: not committed within 5 s"));
            paced.await;
        }
        r.stop();
    };
    let (done, ()) = tokio::join!(r.run_until_stopped(), control);
    done.unwrap();
    assert_eq!(runner_transactions(&c), vec![(1, None); 5]);
}

/// BT-09: a batch's time: handlers that take 40 % of the handler timeout, 8 ready of one key:
/// no T runs more than 3 of them; all complete once, in order (R187).
pub async fn bt_09<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    for i in 1..=8 {
        c.deliver(&format!("m{i}"), Some("k"));
        c.script(
            &format!("m{i}"),
            vec![Act::Delay(Duration::from_millis(200))],
        );
    }
    let r = batched(&c)
        .handler_timeout(Duration::from_millis(500))
        .build()
        .unwrap();
    run_until(&c, &r, 8).await;
    let effects = c.effects().await;
    let want: Vec<String> = (1..=8).map(|i| format!("m{i}")).collect();
    assert_eq!(
        effects,
        want,
        "{:?} {:?}",
        c.rec
            .results()
            .iter()
            .map(|r| (r.message_id.clone(), r.outcome, r.error.clone()))
            .collect::<Vec<_>>(),
        runner_transactions(&c)
    );
    // Every run of one T started within one handler timeout of the T's first run: the runs
    // come in groups of at most 3, each group's starts within 500 ms of its first.
    let runs = c.handler.runs();
    assert_eq!(runs.len(), 8);
    let ts = runner_transactions(&c);
    assert!(
        ts.len() >= 3,
        "8 runs of 200 ms in T's of at most 3: {ts:?}"
    );
    assert!(ts.iter().all(|(_, f)| f.is_none()), "{ts:?}");
}

/// BT-10: a runner killed while the 10th run of a batch of 16 waits at a gate: no row and no
/// effect of the batch; the redeliveries complete each message once (R115, R119).
pub async fn bt_10<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let all = deliver_16(&c);
    let gate = Gate::new();
    c.script("m10", vec![Act::Gate(gate.clone()), Act::Write]);
    let w1 = batched(&c).build().unwrap();
    w1.start();
    let reached = async {
        tokio::select! {
            _ = w1.run_until_stopped() => panic!("the gated run cannot end"),
            _ = gate.reached(1) => {}
        }
    };
    tokio::time::timeout(Duration::from_secs(10), reached)
        .await
        .expect("m10's run reaches its gate");
    // kill(w1): its future and open transaction are dropped.
    drop(w1);
    for (id, _, _) in &all {
        assert!(c.row(id).await.is_none(), "{id} has a row");
    }
    assert!(c.effects().await.is_empty());
    c.advance(Duration::from_secs(30)).await;
    let w2 = batched(&c).worker_id("w2").build().unwrap();
    run_until(&c, &w2, 16).await;
    let effects = c.effects().await;
    assert_eq!(effects.len(), 16, "{effects:?}");
    for (id, _, _) in &all {
        assert_eq!(c.row_of(id).await.status, Status::Completed, "{id}");
    }
}

/// BT-12 `[pg]`: one message of 16 carries a value the table refuses at landing (a class-22
/// error, E-18's trigger): the batch falls back (`refused`); the refused message is
/// dead-lettered alone (R132), the 15 others completed once.
pub async fn bt_12<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    c.h.sql(
        "CREATE FUNCTION {schema}.bt12_refuse() RETURNS trigger LANGUAGE plpgsql AS $$ \
         BEGIN IF NEW.message_id = 'm5' THEN PERFORM NEW.message_id::numeric; END IF; \
         RETURN NEW; END $$",
    )
    .await;
    c.h.sql(
        "CREATE TRIGGER bt12_refuse BEFORE INSERT ON {table} \
         FOR EACH ROW EXECUTE FUNCTION {schema}.bt12_refuse()",
    )
    .await;
    let all = deliver_16(&c);
    let r = batched(&c).build().unwrap();
    run_until(&c, &r, 16).await;
    let ts = runner_transactions(&c);
    assert_eq!(ts[0], (16, Some(FallbackReason::Refused)), "{ts:?}");
    let dl = c.sub.dead_letters();
    assert_eq!(dl.len(), 1, "one dead-letter copy");
    let effects = c.effects().await;
    assert_eq!(effects.len(), 15, "{effects:?}");
    for (id, _, idx) in &all {
        if id == "m5" {
            assert!(c.row(id).await.is_none());
            assert_eq!(c.sub.acks(*idx), vec![AckOp::Term(dl[0].reason.clone())]);
        } else {
            assert_eq!(c.row_of(id).await.status, Status::Completed, "{id}");
            assert_eq!(c.sub.acks(*idx), vec![AckOp::Commit], "{id}");
        }
    }
}

/// BT-14: at_most_once, savepoint form, 16 messages, the 5th fails: all 16 deliveries
/// committed before T; the 5th `failed` and not retried; the others completed (R129, R186).
pub async fn bt_14<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let all = deliver_16(&c);
    c.script("m5", vec![Act::Fail("boom".into())]);
    let r = batched(&c).at_most_once(true).build().unwrap();
    run_until(&c, &r, 16).await;
    assert_eq!(runner_transactions(&c), vec![(16, None)]);
    let effects = c.effects().await;
    for (id, _, idx) in &all {
        assert_eq!(c.sub.acks(*idx), vec![AckOp::Commit], "{id}");
        let row = c.row_of(id).await;
        if id == "m5" {
            assert_eq!(row.status, Status::Failed);
            assert!(!effects.contains(id));
        } else if ["m10", "m14"].contains(&id.as_str()) {
            // k2's later messages: m5 is `failed` and holds its key no longer (R185 step 3).
            assert_eq!(row.status, Status::Completed, "{id}");
        } else {
            assert_eq!(row.status, Status::Completed, "{id}");
        }
    }
    assert_eq!(c.handler.runs_of("m5"), 1, "not retried");
    assert_eq!(effects.len(), 15, "{effects:?}");
}

/// BT-15: two deliveries of one message in one batch (a republish): one run, one effect, the
/// second `duplicate`, both committed after T (R184).
pub async fn bt_15<F: InboxFactory>(f: &F) {
    let c = Ictx::new(f).await;
    let i = c.deliver("m1", Some("k"));
    c.duplicate("m1");
    c.deliver("m2", Some("j"));
    let r = batched(&c).build().unwrap();
    run_until(&c, &r, 3).await;
    assert_eq!(runner_transactions(&c), vec![(3, None)]);
    let outs: Vec<O> = c.rec.results().iter().map(|r| r.outcome).collect();
    assert_eq!(outs, vec![O::Completed, O::Duplicate, O::Completed]);
    assert_eq!(c.handler.runs_of("m1"), 1);
    assert_eq!(c.effects().await, vec!["m1", "m2"]);
    assert_eq!(c.sub.acks(i), vec![AckOp::Commit, AckOp::Commit]);
}
