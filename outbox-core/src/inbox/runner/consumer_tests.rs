//! The consumer's short form: [`handler_fn`], the group and topics given once (taken from the
//! subscription, refused when given twice and different), and [`Runner::run`] with a
//! cancellation token. Paused tokio time; no test sleeps to wait for state.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::clock::ManualClock;
use crate::event::Status;
use crate::inbox::handler::{HandlerError, HandlerOutcome, handler_fn};
use crate::inbox::hooks::InboxHooks;
use crate::inbox::memory::{InMemoryInbox, MemInboxTx};
use crate::inbox::model::InboxEvent;
use crate::inbox::runner::{DeliveryOutcome, DeliveryResult, Runner};
use crate::inbox::scripted::{AckOp, MessageFactory, ScriptedSubscription};

fn setup() -> (InMemoryInbox, ScriptedSubscription, MessageFactory) {
    let clock = Arc::new(ManualClock::starting_now());
    (
        InMemoryInbox::new(clock.clone()),
        ScriptedSubscription::new(clock),
        MessageFactory::new(),
    )
}

fn msg(f: &MessageFactory, id: &str, key: &str, n: i64) -> crate::inbox::BrokerMessage {
    f.nats(
        &[
            ("event_id", id),
            ("topic", "src"),
            ("event_type", "order.placed"),
            ("partition_key", key),
        ],
        &json!({ "order": id, "n": n }).to_string(),
    )
}

#[derive(serde::Deserialize)]
struct Placed {
    order: String,
    n: i64,
}

#[tokio::test(start_paused = true)]
async fn handler_fn_runs_a_closure_in_the_deliverys_transaction() {
    let (inbox, sub, f) = setup();
    sub.push(msg(&f, "m1", "k", 1));
    sub.push(f.nats(&[("event_id", "m2"), ("topic", "src")], "{\"n\": \"two\"}"));
    let runner = Runner::for_subscription(inbox.clone(), sub.clone().for_group("g", ["src"]))
        .handler(handler_fn(|row: &InboxEvent, tx: &mut MemInboxTx| {
            Box::pin(async move {
                let p: Placed = row.payload_as()?;
                tx.record(json!({ "billed": p.order, "n": p.n }));
                Ok(HandlerOutcome::completed_with("billed"))
            })
        }))
        .process_stored(false)
        .build()
        .unwrap();
    let first = runner.handle_next().await.unwrap().unwrap();
    assert_eq!(first.outcome, DeliveryOutcome::Completed);
    assert_eq!(first.handler_status.as_deref(), Some("billed"));
    assert_eq!(inbox.records(), vec![json!({ "billed": "m1", "n": 1 })]);
    // The payload does not decode: a counted failure recorded in the row, whose text names
    // the message, and nothing of the run is kept.
    let second = runner.handle_next().await.unwrap().unwrap();
    assert_eq!(second.outcome, DeliveryOutcome::Recorded);
    let error = second.error.unwrap();
    assert!(
        error.contains("\"m2\"") && error.contains("Placed"),
        "{error}"
    );
    assert_eq!(inbox.records().len(), 1);
    let rows = inbox.rows();
    assert_eq!(rows[0].status, Status::Completed);
    assert_eq!(rows[1].status, Status::Pending);
    assert_eq!(rows[1].attempts_made, 1);
    assert_eq!(rows[1].last_error.as_deref(), Some(error.as_str()));
}

#[tokio::test(start_paused = true)]
async fn handler_fn_errors_and_state_it_shares() {
    let (inbox, sub, f) = setup();
    sub.push(msg(&f, "m1", "k", 1));
    let calls = Arc::new(AtomicUsize::new(0));
    // Shared state goes into the future as an owned clone (the future borrows only the row and
    // the transaction).
    let counted = calls.clone();
    let h = handler_fn(move |_row: &InboxEvent, tx: &mut MemInboxTx| {
        let calls = counted.clone();
        Box::pin(async move {
            calls.fetch_add(1, Ordering::SeqCst);
            tx.record(json!("written before the failure"));
            Err(HandlerError::transient("downstream unavailable"))
        })
    });
    let runner = Runner::builder(inbox.clone(), Arc::new(sub.clone()), "g")
        .handler(Arc::new(h))
        .process_stored(false)
        .build()
        .unwrap();
    let r = runner.handle_next().await.unwrap().unwrap();
    assert_eq!(r.outcome, DeliveryOutcome::Recorded);
    assert_eq!(r.error.as_deref(), Some("downstream unavailable"));
    assert_eq!(calls.load(Ordering::SeqCst), 1);
    assert!(
        inbox.records().is_empty(),
        "the failed run's write was undone"
    );
    // Transient: no attempt spent (R118).
    assert_eq!(inbox.rows()[0].attempts_made, 0);
}

/// R183: messages_per_transaction 1 to 64 (default 16), concurrency default 64 and never below
/// messages_per_transaction; each refusal names what was wrong.
#[test]
fn messages_per_transaction_is_checked_against_its_range_and_the_concurrency() {
    let (inbox, sub, _) = setup();
    let b = || {
        Runner::builder(inbox.clone(), Arc::new(sub.clone()), "g")
            .process_stored(false)
            .sources(["src"])
    };
    let r = b().build().unwrap();
    assert_eq!(
        (
            r.config().messages_per_transaction(),
            r.config().concurrency()
        ),
        (16, 64)
    );
    for n in [0, 65] {
        let e = b()
            .messages_per_transaction(n)
            .build()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("between 1 and 64") && e.contains(&format!("got {n}")),
            "{e}"
        );
    }
    let e = b()
        .messages_per_transaction(32)
        .concurrency(8)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("concurrency (8)") && e.contains("messages_per_transaction (32)"),
        "{e}"
    );
    let one = b()
        .messages_per_transaction(1)
        .concurrency(1)
        .build()
        .unwrap();
    assert_eq!(one.config().messages_per_transaction(), 1);
    let full = b().messages_per_transaction(64).build().unwrap();
    assert_eq!(full.config().messages_per_transaction(), 64);
}

#[test]
fn the_group_and_topics_come_from_the_subscription() {
    let (inbox, sub, _) = setup();
    let runner = Runner::for_subscription(inbox, sub.for_group("billing", ["orders"]))
        .handler(handler_fn(|_: &InboxEvent, _: &mut MemInboxTx| {
            Box::pin(async { Ok(HandlerOutcome::completed()) })
        }))
        .build()
        .unwrap();
    assert_eq!(runner.config().group().as_str(), "billing");
    // The topics are the embedded processor's sources (R121).
    assert!(runner.embedded_processor().is_some());
    assert_eq!(runner.config().sources, vec!["orders".to_owned()]);
}

#[test]
fn build_refuses_a_group_that_differs_from_the_subscriptions() {
    let (inbox, sub, _) = setup();
    let sub = sub.for_group("billing", ["orders"]);
    let e = Runner::builder(inbox.clone(), Arc::new(sub.clone()), "biling")
        .build()
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"biling\"") && e.contains("\"billing\""), "{e}");
    assert!(e.contains("Runner::for_subscription"), "{e}");
    let e = Runner::for_subscription(inbox.clone(), sub.clone())
        .group("payments")
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("\"payments\"") && e.contains("\"billing\""),
        "{e}"
    );
    // The same name twice is no conflict: the existing builder form keeps working.
    assert!(
        Runner::builder(inbox.clone(), Arc::new(sub.clone()), "billing")
            .topics(["orders"])
            .process_stored(false)
            .build()
            .is_ok()
    );
    // Topics differ: refused, both lists named.
    let e = Runner::for_subscription(inbox.clone(), sub)
        .topics(["order"])
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("[\"order\"]") && e.contains("[\"orders\"]"),
        "{e}"
    );
    // A subscription that names no group, and none given: refused with what to do.
    let (_, bare, _) = setup();
    let e = Runner::for_subscription(inbox, bare)
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no consumer group") && e.contains(".group("),
        "{e}"
    );
}

/// Sends every ended delivery to the test.
struct Ended(mpsc::UnboundedSender<DeliveryResult>);

impl InboxHooks for Ended {
    fn on_delivery(&self, r: &DeliveryResult) {
        let _ = self.0.send(r.clone());
    }
}

#[tokio::test(start_paused = true)]
async fn run_token_starts_consumes_and_stops_on_cancel() {
    let (inbox, sub, f) = setup();
    let a1 = sub.push(msg(&f, "a1", "a", 1));
    sub.push(msg(&f, "b1", "b", 1));
    sub.push(msg(&f, "a2", "a", 2));
    sub.duplicate(a1); // delivered twice, handled once
    let (tx, mut ended) = mpsc::unbounded_channel();
    let runner = Runner::for_subscription(inbox.clone(), sub.clone().for_group("g", ["src"]))
        .handler(handler_fn(|row: &InboxEvent, tx: &mut MemInboxTx| {
            Box::pin(async move {
                let p: Placed = row.payload_as()?;
                tx.record(json!({ "key": row.partition_key, "order": p.order }));
                Ok(HandlerOutcome::completed())
            })
        }))
        .hooks(Arc::new(Ended(tx)))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    // No start(): run starts the runner itself.
    let control = async {
        let mut outcomes = Vec::new();
        while outcomes.len() < 4 {
            outcomes.push(ended.recv().await.expect("a delivery ended").outcome);
        }
        shutdown.cancel();
        outcomes
    };
    let (done, outcomes) = tokio::join!(runner.run(shutdown.clone()), control);
    done.expect("run ends without error after the cancel");
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == DeliveryOutcome::Completed)
            .count(),
        3
    );
    assert_eq!(
        outcomes
            .iter()
            .filter(|o| **o == DeliveryOutcome::Duplicate)
            .count(),
        1
    );
    // Each message's effect once, per key in order.
    let effects: Vec<Value> = inbox.records();
    assert_eq!(effects.len(), 3);
    let of_a: Vec<&Value> = effects.iter().filter(|e| e["key"] == "a").collect();
    assert_eq!(
        of_a,
        [
            &json!({"key": "a", "order": "a1"}),
            &json!({"key": "a", "order": "a2"})
        ]
    );
    // Every delivery committed, and the stop closed the subscription (R167).
    assert_eq!(
        sub.acks(a1),
        vec![AckOp::Commit, AckOp::Commit],
        "both deliveries of a1 committed"
    );
    assert!(sub.is_drained());
    assert!(sub.is_closed());
}

#[tokio::test(start_paused = true)]
async fn run_token_cancelled_at_once_returns_and_closes() {
    let (inbox, sub, _) = setup();
    let runner = Runner::for_subscription(inbox, sub.clone().for_group("g", ["src"]))
        .build()
        .unwrap();
    let shutdown = CancellationToken::new();
    shutdown.cancel();
    runner.run(shutdown).await.expect("no `not started` error");
    assert!(sub.is_closed());
}

#[tokio::test(start_paused = true)]
async fn run_token_ends_on_stop_as_well() {
    let (inbox, sub, _) = setup();
    let runner = Runner::for_subscription(inbox, sub.clone().for_group("g", ["src"]))
        .build()
        .unwrap();
    let never = CancellationToken::new();
    let stop = async {
        tokio::task::yield_now().await;
        runner.stop();
    };
    let (done, ()) = tokio::join!(runner.run(never.clone()), stop);
    done.unwrap();
    assert!(!never.is_cancelled());
    assert!(sub.is_closed());
}
