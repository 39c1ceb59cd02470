//! The quick start: both halves in memory. A relay over the in-memory backend and a broker that
//! fails some publishes; then the inbox, which gets every published message twice and handles
//! each once, per key in order.
//!
//! Run it with `cargo run -p txoutbox-examples --bin quickstart` (no service needed). Time is
//! simulated: the backend clock is a manual clock that the demo advances by one second whenever a
//! cycle finds nothing due, so the backoff of a failed head (5 to 10 s) shows without waiting. It
//! checks what it prints and exits non-zero when an outcome is not the expected one.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use tokio::sync::mpsc;
use txoutbox_core::inbox::scripted::ScriptedSubscription;
use txoutbox_core::inbox::{
    BrokerMessage, DeliveryOutcome, DeliveryResult, HandlerOutcome, InMemoryInbox, InboxEvent,
    InboxHooks, MemInboxTx, Runner, handler_fn,
};

use serde_json::json;
use txoutbox_core::scripted::{Action, ScriptedBroker};
use txoutbox_core::{
    CancellationToken, InMemoryRepository, ManualClock, NewEvent, Relay, RowOutcome,
};
use uuid::Uuid;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let clock = ManualClock::starting_now();
    let start = txoutbox_core::Clock::now(&clock);
    let repo = InMemoryRepository::new(Arc::new(clock.clone()));
    let broker = ScriptedBroker::new();

    // A service writes its events in one unit of work per order, as it would in a transaction.
    let steps = [
        "order.created",
        "order.paid",
        "order.shipped",
        "order.delivered",
    ];
    let mut names: BTreeMap<Uuid, (String, &str)> = BTreeMap::new();
    let mut heads = BTreeMap::new();
    for order in ["order-1", "order-2", "order-3"] {
        let aggregate = Uuid::new_v4();
        let events = steps
            .iter()
            .enumerate()
            .map(|(i, step)| {
                NewEvent::builder()
                    .event_type(*step)
                    .aggregate("order", aggregate)
                    .topic("orders")
                    .partition_key(order)
                    .payload_json(json!({ "order": order, "step": i }))
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        for e in &events {
            names.insert(
                e.id(),
                (order.to_string(), e.event_type().to_string().leak()),
            );
        }
        heads.insert(order, (events[0].id(), events[2].id()));
        let mut tx = repo.begin();
        tx.write(events).await?;
        tx.commit();
    }
    // The broker refuses order-1's first event once (counted: backoff 5-10 s) and is
    // unreachable once when order-2's third event goes out (not counted: retry after 1 s).
    broker.script(
        heads["order-1"].0,
        [Action::Reject("payment service refused the message".into())],
    );
    broker.script(
        heads["order-2"].1,
        [Action::Transient("broker unreachable".into())],
    );

    let relay = Relay::builder(Arc::new(repo.clone()), Arc::new(broker.clone()))
        .worker_id("quickstart")
        .build()?;
    let shutdown = CancellationToken::new();
    let secs =
        |c: &ManualClock| (txoutbox_core::Clock::now(c) - start).num_milliseconds() as f64 / 1000.0;

    println!("{:>7}  {:<8}  {:<16}  outcome", "time", "key", "event");
    let mut sent_per_key: BTreeMap<String, Vec<(f64, &str)>> = BTreeMap::new();
    for _ in 0..200 {
        let t = secs(&clock);
        let report = relay.cycle(&shutdown).await?;
        for (id, outcome) in &report.outcomes {
            let (key, ty) = &names[id];
            let text = match outcome {
                RowOutcome::Completed { .. } => {
                    sent_per_key.entry(key.clone()).or_default().push((t, ty));
                    "sent".to_string()
                }
                RowOutcome::Counted {
                    error, next_try, ..
                } => format!(
                    "rejected ({error}); attempt spent, key waits, retry at {:.1}s",
                    next_try
                        .map(|n| (n - start).num_milliseconds() as f64 / 1000.0)
                        .unwrap_or(f64::NAN)
                ),
                RowOutcome::Transient { error, .. } => {
                    format!("{error}; no attempt spent, retry in 1.0s")
                }
                RowOutcome::Deferred { error } => format!("deferred ({error})"),
                RowOutcome::Released => "released: waits behind its key's failed row".into(),
                RowOutcome::LeaseLost => "lease lost".into(),
            };
            println!("{t:>6.1}s  {key:<8}  {ty:<16}  {text}");
        }
        if repo
            .rows()
            .iter()
            .all(|r| r.status != txoutbox_core::Status::Pending)
        {
            break;
        }
        if report.fetched.is_empty() || report.broker_unreachable {
            clock.advance(Duration::from_secs(1));
        }
    }

    println!("\nWhat went out, per key (order kept within each key):");
    for (key, sent) in &sent_per_key {
        let line: Vec<String> = sent
            .iter()
            .map(|(t, ty)| format!("{ty} @{t:.1}s"))
            .collect();
        println!("  {key}: {}", line.join(" -> "));
    }
    let accepted = broker.accepted();
    println!(
        "\n{} events published; every key in write order while its failing head backed off.",
        accepted.len()
    );
    check(accepted.len() == 12, "12 events published")?;
    for (key, sent) in &sent_per_key {
        let order: Vec<&str> = sent.iter().map(|(_, ty)| *ty).collect();
        check(
            order == steps,
            &format!("{key}'s events published in write order"),
        )?;
    }

    consume(&clock, &accepted, &names, &steps).await?;
    Ok(())
}

/// The payload the service wrote.
#[derive(Debug, Deserialize)]
struct Step {
    order: String,
    step: usize,
}

/// Sends each delivery's result to the demo, as it ends.
struct Ended(mpsc::UnboundedSender<DeliveryResult>);

impl InboxHooks for Ended {
    fn on_delivery(&self, r: &DeliveryResult) {
        let _ = self.0.send(r.clone());
    }
}

/// The consuming half: every published message comes twice (a relay that published again, a
/// broker that redelivered), as a NATS message with the headers the NATS relay sets; the inbox
/// handles each once, per key in order, and the handler's writes commit with the row.
async fn consume(
    clock: &ManualClock,
    accepted: &[txoutbox_core::Message],
    names: &BTreeMap<Uuid, (String, &str)>,
    steps: &[&str],
) -> Result<(), Box<dyn std::error::Error>> {
    println!("\nThe inbox of a billing service: each message delivered twice.");
    let inbox = InMemoryInbox::new(Arc::new(clock.clone()));
    let subscription =
        ScriptedSubscription::new(Arc::new(clock.clone())).for_group("billing", ["orders"]);
    for (seq, m) in accepted.iter().enumerate() {
        let mut headers: Vec<(String, String)> = m.attributes.clone().into_iter().collect();
        headers.push(("Nats-Msg-Id".into(), m.event_id.to_string()));
        let first = subscription.push(BrokerMessage::Nats {
            stream: "ORDERS".into(),
            sequence: seq as u64 + 1,
            subject: format!("orders.{}", m.topic),
            subject_prefix: "orders.".into(),
            headers,
            body: m.body.clone(),
        });
        subscription.duplicate(first);
    }
    let (ended_tx, mut ended) = mpsc::unbounded_channel();
    // The group and the topic come from the subscription; the handler is a closure.
    let runner = Runner::for_subscription(inbox.clone(), subscription)
        .handler(handler_fn(|row: &InboxEvent, tx: &mut MemInboxTx| {
            Box::pin(async move {
                let step: Step = row.payload_as()?;
                tx.record(json!({ "order": step.order, "step": step.step }));
                Ok(HandlerOutcome::completed())
            })
        }))
        .hooks(Arc::new(Ended(ended_tx)))
        .build()?;
    let shutdown = CancellationToken::new();
    let deliveries = accepted.len() * 2;
    let watch = async {
        let mut results = Vec::new();
        while results.len() < deliveries {
            let Some(r) = ended.recv().await else { break };
            let id = r.message_id.as_deref().and_then(|m| m.parse::<Uuid>().ok());
            let (key, ty) = id
                .and_then(|id| names.get(&id))
                .map(|(k, t)| (k.as_str(), *t))
                .unwrap_or(("?", "?"));
            let what = match r.outcome {
                DeliveryOutcome::Completed => "handled".to_owned(),
                DeliveryOutcome::Duplicate => "duplicate: already handled, not run again".into(),
                other => format!("{other:?} ({})", r.error.clone().unwrap_or_default()),
            };
            println!("  {key:<8}  {ty:<16}  {what}");
            results.push(r);
        }
        shutdown.cancel();
        results
    };
    let (ran, results) = tokio::join!(runner.run(shutdown.clone()), watch);
    ran?;

    let count = |o: DeliveryOutcome| results.iter().filter(|r| r.outcome == o).count();
    let effects = inbox.records();
    println!(
        "\n{} deliveries: {} handled, {} duplicates; {} ledger entries.",
        results.len(),
        count(DeliveryOutcome::Completed),
        count(DeliveryOutcome::Duplicate),
        effects.len()
    );
    check(results.len() == deliveries, "every delivery ended")?;
    check(
        count(DeliveryOutcome::Completed) == accepted.len(),
        "each message handled once",
    )?;
    check(
        count(DeliveryOutcome::Duplicate) == accepted.len(),
        "each second delivery a duplicate",
    )?;
    check(effects.len() == accepted.len(), "one effect per message")?;
    println!("What was handled, per key (order kept within each key):");
    for order in ["order-1", "order-2", "order-3"] {
        let handled: Vec<usize> = effects
            .iter()
            .filter(|e| e["order"] == order)
            .filter_map(|e| e["step"].as_u64().map(|s| s as usize))
            .collect();
        let line: Vec<&str> = handled.iter().map(|s| steps[*s]).collect();
        println!("  {order}: {}", line.join(" -> "));
        check(
            handled == (0..steps.len()).collect::<Vec<_>>(),
            &format!("{order}'s events handled once each, in order"),
        )?;
    }
    println!("\nEvery message handled exactly once, per key in order, though delivered twice.");
    Ok(())
}

/// Fails the demo when `ok` is false.
fn check(ok: bool, what: &str) -> Result<(), Box<dyn std::error::Error>> {
    if ok {
        Ok(())
    } else {
        Err(format!("quickstart: expected {what}, and it did not happen").into())
    }
}
