//! The quick start: a relay over the in-memory backend and a broker that fails some publishes.
//!
//! Run it with `cargo run -p txoutbox-examples --bin quickstart` (no service needed). Time is
//! simulated: the backend clock is a manual clock that the demo advances by one second whenever a
//! cycle finds nothing due, so the backoff of a failed head (5 to 10 s) shows without waiting.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

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
    Ok(())
}
