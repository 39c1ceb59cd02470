//! K-18 CloudEvents binary mode, NATS case (R91): one relay cycle through an adapter with
//! message_format `cloudevents` against the NATS at `NATS_URL` (a fresh in-memory stream), the
//! message read back from the stream; and an adapter with `cloudevents` but no source fails to
//! build. A plain adapter on the same stream sends no `ce-` header (the default is unchanged).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_nats::jetstream;
use serde_json::json;
use txoutbox_conformance::broker::fresh_suffix;
use txoutbox_core::{
    Broker, CancellationToken, InMemoryRepository, ManualClock, NewEvent, OutboxEvent, Relay,
};
use txoutbox_nats_broker::{MessageFormat, NatsBroker, NatsBrokerConfig, NatsBrokerError};

const TRACEPARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

fn url() -> String {
    std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

async fn write_one(repo: &InMemoryRepository, topic: &str) -> OutboxEvent {
    let e = NewEvent::builder()
        .event_type("order créé")
        .aggregate("order", uuid::Uuid::nil())
        .topic(topic)
        .partition_key("acct 1")
        .correlation_id("c-1")
        .header("tenant", "acme")
        .header("ce_id", "spoof")
        .header("traceparent", TRACEPARENT)
        .payload_json(json!({"n": 18}))
        .build()
        .expect("valid");
    let r = repo.write_committed(vec![e]).await.expect("write");
    r.into_iter().next().expect("one row").event
}

async fn one_cycle(repo: &InMemoryRepository, broker: NatsBroker) -> Vec<uuid::Uuid> {
    let relay = Relay::builder(Arc::new(repo.clone()), Arc::new(broker) as Arc<dyn Broker>)
        .worker_id("w1")
        .build()
        .expect("relay");
    relay
        .cycle(&CancellationToken::new())
        .await
        .expect("cycle")
        .completed
}

/// The headers (last value of each) and body of the stream's message number `seq`.
async fn read(stream: &jetstream::stream::Stream, seq: u64) -> (BTreeMap<String, String>, Vec<u8>) {
    let m = stream.get_raw_message(seq).await.expect("read the message");
    let headers = m
        .headers
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                v.last().map(|v| v.as_str().to_owned()).unwrap_or_default(),
            )
        })
        .collect();
    (headers, m.payload.to_vec())
}

#[tokio::test]
async fn k_18_cloudevents_binary_mode_on_nats() {
    let suffix = fresh_suffix();
    let stream_name = format!("OUTBOX_CE_{suffix}");
    let prefix = format!("outboxtest.{suffix}.");
    let admin = jetstream::new(
        async_nats::connect(url())
            .await
            .unwrap_or_else(|e| panic!("NATS at {} is unreachable: {e}", url())),
    );
    let stream = admin
        .create_stream(jetstream::stream::Config {
            name: stream_name.clone(),
            subjects: vec![format!("{prefix}>")],
            storage: jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("create the stream");

    // Without a source the adapter is not built.
    let e = NatsBroker::connect(
        NatsBrokerConfig::new(url())
            .subject_prefix(&prefix)
            .message_format(MessageFormat::CloudEvents),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(&e, NatsBrokerError::Config(m) if m.contains("needs a cloudevents_source")),
        "{e}"
    );

    let repo = InMemoryRepository::new(Arc::new(ManualClock::starting_now()));
    let row = write_one(&repo, "orders").await;
    let ce = NatsBroker::connect(
        NatsBrokerConfig::new(url())
            .subject_prefix(&prefix)
            .message_format(MessageFormat::CloudEvents)
            .cloudevents_source("/orders-service"),
    )
    .await
    .expect("connect the cloudevents adapter");
    assert_eq!(one_cycle(&repo, ce).await, vec![row.id], "K-18: completed");

    let (h, body) = read(&stream, 1).await;
    let id = row.id.hyphenated().to_string();
    let time = row
        .created_at
        .to_rfc3339_opts(txoutbox_core::broker::CREATED_AT_FORMAT, true);
    let get = |k: &str| h.get(k).map(String::as_str);
    // Everything of the plain message.
    assert_eq!(get("Nats-Msg-Id"), Some(id.as_str()));
    assert_eq!(get("event_id"), Some(id.as_str()));
    assert_eq!(get("event_type"), Some("order créé"));
    assert_eq!(get("partition_key"), Some("acct 1"));
    assert_eq!(get("correlation_id"), Some("c-1"));
    assert_eq!(get("tenant"), Some("acme"));
    assert_eq!(get("traceparent"), Some(TRACEPARENT), "the event's own");
    assert_eq!(get("ce_id"), Some("spoof"), "not a NATS attribute header");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).expect("JSON"),
        json!({"n": 18}),
        "K-18: the body is the payload"
    );
    // The NATS binding's attributes, percent-encoded.
    for (k, v) in [
        ("ce-specversion", "1.0"),
        ("ce-id", id.as_str()),
        ("ce-source", "/orders-service"),
        ("ce-type", "order%20cr%C3%A9%C3%A9"),
        ("ce-time", time.as_str()),
        ("ce-partitionkey", "acct%201"),
        ("ce-correlationid", "c-1"),
        ("ce-datacontenttype", "application/json"),
    ] {
        assert_eq!(get(k), Some(v), "K-18: {k}");
    }
    assert!(!h.contains_key("ce-causationid"), "{h:?}");
    assert!(!h.contains_key("ce-traceparent"), "{h:?}");

    // The default format adds no CloudEvents header.
    let row2 = write_one(&repo, "orders").await;
    let plain = NatsBroker::connect(NatsBrokerConfig::new(url()).subject_prefix(&prefix))
        .await
        .expect("connect the plain adapter");
    assert_eq!(one_cycle(&repo, plain).await, vec![row2.id]);
    let (h, body) = read(&stream, 2).await;
    assert_eq!(
        h.get("event_id").map(String::as_str),
        Some(row2.id.hyphenated().to_string().as_str())
    );
    assert!(!h.keys().any(|k| k.starts_with("ce-")), "plain: {h:?}");
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&body).expect("JSON"),
        json!({"n": 18})
    );
    let _ = admin.delete_stream(&stream_name).await;
}
