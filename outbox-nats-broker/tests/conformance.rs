//! Broker trials K-01 to K-06 and the outage trial against the machine's NATS JetStream
//! (`NATS_URL`, default `nats://127.0.0.1:4222`). Each trial uses a fresh stream and subject
//! prefix and deletes the stream at the end. An unreachable server fails the trials.

mod common;

use common::*;
use txoutbox_nats_broker::StreamSpec;

txoutbox_conformance::broker_suite!(Nats);

/// ensure_stream creates the stream at start-up; an uncovered subject is a rejection that
/// says so; an invalid topic is a rejection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ensure_stream_and_rejections() {
    use txoutbox_core::{BrokerError, Message};
    let suffix = fresh_suffix();
    let name = format!("OUTBOX_ENSURE_{suffix}");
    let prefix = format!("outboxensure.{suffix}.");
    let cfg = NatsBrokerConfig::new(url())
        .subject_prefix(&prefix)
        .timeout(Duration::from_secs(2))
        .ensure_stream(StreamSpec::new(&name).duplicate_window(Duration::from_secs(600)));
    let broker = NatsBroker::connect(cfg)
        .await
        .expect("connect and ensure the stream");
    let admin = jetstream::new(async_nats::connect(url()).await.expect("admin connection"));
    let mut stream = admin.get_stream(&name).await.expect("the stream exists");
    let info = stream.info().await.expect("info");
    assert_eq!(info.config.subjects, vec![format!("{prefix}>")]);
    assert_eq!(info.config.duplicate_window, Duration::from_secs(600));

    let row = txoutbox_core::NewEvent::builder()
        .event_type("t")
        .aggregate("a", uuid::Uuid::nil())
        .topic("orders")
        .partition_key("k")
        .payload_json(serde_json::json!({"n": 1}))
        .build()
        .expect("valid")
        .into_row(chrono::Utc::now());
    let m = Message::from_event(&row);
    assert!(!broker.publish(&m).await.expect("publish").duplicate);

    // A topic that is no valid subject.
    let mut bad = m.clone();
    bad.topic = "has space".into();
    match broker.publish(&bad).await {
        Err(BrokerError::Rejected(t)) => assert!(t.contains("cannot be published to"), "{t}"),
        other => panic!("expected a rejection, got {other:?}"),
    }

    // A subject no stream covers: an adapter with another prefix.
    let other = NatsBroker::connect(
        NatsBrokerConfig::new(url())
            .subject_prefix(format!("outboxnostream.{suffix}."))
            .timeout(Duration::from_secs(2))
            // Connect anyway: this checks the refusal of each publish.
            .check_streams(false),
    )
    .await
    .expect("connect");
    match other.publish(&m).await {
        Err(BrokerError::Rejected(t)) => {
            assert!(t.contains("no JetStream stream covers subject"), "{t}")
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
    admin.delete_stream(&name).await.expect("delete");
}
