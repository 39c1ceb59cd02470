//! Broker trials K-01 to K-06 and the outage trial against the machine's Redis (`REDIS_URL`,
//! default `redis://127.0.0.1:6379`). Each trial uses a fresh key prefix and deletes its keys at
//! the end. An unreachable server fails the trials.

mod common;

use common::*;
use txoutbox_core::{BrokerError, Message, NewEvent};

txoutbox_conformance::broker_suite!(Redis);

fn message(topic: &str, key: &str) -> Message {
    message_with(topic, key, true)
}

fn message_with(topic: &str, key: &str, headers: bool) -> Message {
    let mut b = NewEvent::builder()
        .event_type("t.happened")
        .aggregate("order", uuid::Uuid::now_v7())
        .topic(topic)
        .partition_key(key)
        .payload_json(serde_json::json!({"n": 1}))
        .correlation_id("corr-1");
    if headers {
        b = b.header("tenant", "acme").header("topic", "spoofed");
    }
    let row = b.build().expect("valid").into_row(chrono::Utc::now());
    Message::from_event(&row)
}

/// The fields of one entry: names, order, the `headers` JSON without attribute names, and
/// `headers` absent when the event has none; MAXLEN trims approximately.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fields_and_maxlen() {
    let prefix = format!("outboxtest:{}:", fresh_suffix());
    let broker = RedisBroker::connect(
        RedisBrokerConfig::new(url())
            .key_prefix(&prefix)
            .max_len(10),
    )
    .await
    .expect("connect");
    let m = message("orders", "k1");
    broker.publish(&m).await.expect("publish");
    let mut conn = admin().await;
    let key = format!("{prefix}orders");
    let entries = xrange(&mut conn, &key).await;
    assert_eq!(entries.len(), 1);
    let names: Vec<&str> = entries[0].1.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "event_id",
            "event_type",
            "topic",
            "partition_key",
            "payload",
            "headers",
            "aggregate_type",
            "aggregate_id",
            "created_at",
            "correlation_id"
        ]
    );
    let f: BTreeMap<_, _> = entries[0].1.iter().cloned().collect();
    assert_eq!(f["topic"], "orders", "the attribute wins over the header");
    assert_eq!(f["headers"], r#"{"tenant":"acme"}"#);
    assert_eq!(f["payload"], r#"{"n":1}"#);
    assert_eq!(f["event_id"], m.event_id.hyphenated().to_string());

    // No headers: no headers field.
    broker
        .publish(&message_with("orders", "k1", false))
        .await
        .expect("publish");
    let entries = xrange(&mut conn, &key).await;
    assert!(
        entries[1].1.iter().all(|(k, _)| k != "headers"),
        "{:?}",
        entries[1].1
    );

    // MAXLEN ~ 10: after 300 more entries, far fewer than 302 remain.
    for _ in 0..300 {
        broker.publish(&m).await.expect("publish");
    }
    let len: usize = redis::cmd("XLEN")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("XLEN");
    assert!(
        (10..302).contains(&len),
        "approximate trim keeps about 10 entries, has {len}"
    );
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("DEL");
}

/// The key pattern may hold the partition key: one stream per key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_pattern_with_partition_key() {
    let prefix = format!("outboxtest:{}:", fresh_suffix());
    let broker = RedisBroker::connect(
        RedisBrokerConfig::new(url()).key_pattern(format!("{prefix}{{topic}}:{{partition_key}}")),
    )
    .await
    .expect("connect");
    broker
        .publish(&message("orders", "acct-7"))
        .await
        .expect("publish");
    let mut conn = admin().await;
    let key = format!("{prefix}orders:acct-7");
    assert_eq!(xrange(&mut conn, &key).await.len(), 1);
    let _: () = redis::cmd("DEL")
        .arg(&key)
        .query_async(&mut conn)
        .await
        .expect("DEL");
}

/// A connect to a closed port fails with a message that names the URL; publishing through a
/// lazy adapter there is transient.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_port_errors() {
    let addr = txoutbox_conformance::broker::closed_port().await;
    let cfg = RedisBrokerConfig::new(format!("redis://{addr}")).timeout(Duration::from_secs(1));
    let err = RedisBroker::connect(cfg.clone())
        .await
        .expect_err("nothing listens");
    assert!(err.to_string().contains(&addr.to_string()), "{err}");
    let lazy = RedisBroker::connect_lazy(cfg).expect("lazy");
    match lazy.publish(&message("orders", "k")).await {
        Err(BrokerError::Transient(t)) => assert!(t.contains("Redis"), "{t}"),
        other => panic!("expected a transient failure, got {other:?}"),
    }
}
