//! The relay's metrics exposed to Prometheus, with no service needed: the in-memory backend, a
//! broker that refuses some publishes, the [`MetricsStep`] observer, and
//! `metrics-exporter-prometheus` serving `/metrics`.
//!
//! ```sh
//! cargo run -p txoutbox-examples --features prometheus --example prometheus
//! # keep serving afterwards (scrape http://127.0.0.1:9898/metrics), stop with Ctrl-C:
//! cargo run -p txoutbox-examples --features prometheus --example prometheus -- --serve
//! ```
//!
//! It publishes 30 events over 3 keys (one is refused once, so a retry shows), scrapes its own
//! endpoint once and prints the `outbox_` lines. The `outbox-relay` binary serves the same
//! metrics with `--metrics-addr 127.0.0.1:9898` when built with `--features prometheus`.

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use txoutbox_core::scripted::{Action, ScriptedBroker};
use txoutbox_core::{
    Backoff, CancellationToken, InMemoryRepository, MetricsStep, NewEvent, OutboxRepository, Relay,
};
use uuid::Uuid;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr: std::net::SocketAddr = std::env::var("OUTBOX_METRICS_ADDR")
        .unwrap_or_else(|_| "127.0.0.1:9898".into())
        .parse()?;
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Suffix("_seconds".into()),
            &[0.001, 0.005, 0.025, 0.1, 0.5, 2.5, 10.0],
        )?
        .install()?;

    let repo = InMemoryRepository::default();
    let broker = ScriptedBroker::new();
    let mut first = None;
    for i in 0..10 {
        let mut tx = repo.begin();
        let events = ["a", "b", "c"]
            .iter()
            .map(|k| {
                NewEvent::builder()
                    .event_type(if i == 0 {
                        "item.created"
                    } else {
                        "item.updated"
                    })
                    .aggregate("item", Uuid::new_v4())
                    .topic("items")
                    .partition_key(*k)
                    .payload_json(json!({ "key": k, "n": i }))
                    .build()
            })
            .collect::<Result<Vec<_>, _>>()?;
        first.get_or_insert(events[0].id());
        tx.write(events).await?;
        tx.commit();
    }
    broker.script(
        first.expect("written"),
        [Action::Reject("refused once".into())],
    );
    let metrics = MetricsStep::new();
    let relay = Relay::builder(Arc::new(repo.clone()), Arc::new(broker))
        .backoff(Backoff::new(0.0, 1.0)?) // retry at once, so the example ends quickly
        .step(Arc::new(metrics.clone()))
        .build()?;
    let token = CancellationToken::new();
    while repo.oldest_due_age().await?.is_some() {
        relay.cycle(&token).await?;
    }
    // The backlog gauges (the binary updates them periodically).
    metrics
        .update_backlog(&repo, Duration::from_secs(300))
        .await?;

    // Scrape our own endpoint once.
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    for line in body.lines().filter(|l| l.starts_with("outbox_")) {
        println!("{line}");
    }
    if std::env::args().any(|a| a == "--serve") {
        println!("serving http://{addr}/metrics; Ctrl-C to stop");
        tokio::signal::ctrl_c().await?;
    }
    Ok(())
}
