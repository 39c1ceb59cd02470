//! Broker trials K-01 to K-06, the outage trials, and the RabbitMQ trials K-08 to K-18 against
//! the machine's RabbitMQ (`AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`). Each
//! trial uses fresh queues and deletes them at the end. An unreachable broker fails the trials.

mod common;

use common::*;

txoutbox_conformance::broker_suite!(Rabbit);

mod rabbitmq_trials {
    use super::common::*;
    txoutbox_conformance::rabbitmq_suite!(Rabbit);
}

/// The start check: a missing exchange fails it with the fix; a declared one passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_start_check_finds_a_missing_exchange_and_can_declare_one() {
    use txoutbox_rabbitmq_broker::{ExchangeType, RabbitMqBrokerError};
    let name = format!("outbox-test-x-{}", fresh_suffix());
    let e = RabbitMqBroker::connect(RabbitMqBrokerConfig::new(url()).exchange(&name))
        .await
        .unwrap_err();
    assert!(matches!(e, RabbitMqBrokerError::Exchange { .. }), "{e}");
    assert!(e.to_string().contains("declare the exchange"), "{e}");
    RabbitMqBroker::connect(
        RabbitMqBrokerConfig::new(url())
            .exchange(&name)
            .declare_exchange(ExchangeType::Topic),
    )
    .await
    .expect("declared");
    RabbitMqBroker::connect(RabbitMqBrokerConfig::new(url()).exchange(&name))
        .await
        .expect("now it exists");
    let ch = channel().await;
    ch.exchange_delete(name.as_str().into(), Default::default())
        .await
        .expect("delete");
}

/// A routing key over 255 bytes is a rejection without a broker call (the adapter points at a
/// closed port).
#[tokio::test]
async fn a_routing_key_over_255_bytes_is_a_rejection_without_a_broker_call() {
    use txoutbox_core::{BrokerError, Message, NewEvent};
    let port = txoutbox_conformance::broker::closed_port().await;
    let b = RabbitMqBroker::connect_lazy(
        RabbitMqBrokerConfig::new(url_at(port)).routing_key_prefix("p".repeat(10)),
    )
    .expect("lazy");
    let row = NewEvent::builder()
        .event_type("t")
        .aggregate("a", uuid::Uuid::nil())
        .topic("t".repeat(250))
        .partition_key("k")
        .payload_json(serde_json::json!({"n": 1}))
        .build()
        .expect("valid")
        .into_row(chrono::Utc::now());
    match b.publish(&Message::from_event(&row)).await {
        Err(BrokerError::Rejected(t)) => {
            assert!(t.contains("is longer than 255 bytes"), "{t}")
        }
        other => panic!("expected a rejection, got {other:?}"),
    }
}

/// A connect error never shows the password of the URI.
#[tokio::test]
async fn a_connect_error_never_shows_the_password() {
    let port = txoutbox_conformance::broker::closed_port().await;
    let e = RabbitMqBroker::connect(
        RabbitMqBrokerConfig::new(format!("amqp://app:s3cret-pw@{port}/%2f"))
            .connect_timeout(Duration::from_secs(1)),
    )
    .await
    .unwrap_err();
    assert!(e.is_transient(), "{e}");
    assert!(!e.to_string().contains("s3cret-pw"), "{e}");
    assert!(!format!("{e:?}").contains("s3cret-pw"), "{e:?}");
}
