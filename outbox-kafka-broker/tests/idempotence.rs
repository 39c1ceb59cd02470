//! R87 against a broker that grants no producer id, on any broker: a private Tansu behind a
//! proxy that answers every InitProducerId with UNKNOWN_SERVER_ERROR (the answer Tansu's memory
//! storage is reported to give other clients). K-16 itself runs only on a broker that declares
//! no `idempotent_producer`; this test covers the same path where the broker does grant one.

mod common;

use common::*;
use txoutbox_conformance::kafka::KafkaUnderTest;
use txoutbox_conformance::kafka_proxy::{DropFirstProduceAnswer, Mode};
use txoutbox_core::{BrokerError, Message, NewEvent};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_refuses_init_producer_id_fails_the_start_and_every_publish_under_on() {
    let (listener, proxy_addr) = DropFirstProduceAnswer::bind().await;
    let Some(private) = TestKafka.private_broker(proxy_addr).await else {
        txoutbox_conformance::kafka::report(
            "SKIPPED a_broker_that_refuses_init_producer_id…: needs a broker the test can start",
        );
        return;
    };
    let proxy =
        DropFirstProduceAnswer::with_mode(listener, private.listen, Mode::RefuseInitProducerId);
    let topic = format!("ob.refused-{}", fresh_suffix());
    create_topic_at(&proxy.addr().to_string(), &topic, 1, &[]).await;
    let cfg = |i| {
        KafkaBrokerConfig::new(proxy.addr().to_string())
            .idempotence(i)
            .delivery_timeout(Duration::from_secs(3))
            .connect_timeout(Duration::from_millis(500))
    };
    let on = KafkaBroker::connect_lazy(cfg(Idempotence::On)).expect("lazy");
    let e = on
        .check()
        .await
        .expect_err("the check fails under idempotence on");
    let text = e.to_string();
    assert!(!e.is_transient(), "{text}");
    assert!(
        text.starts_with("Kafka: the broker did not grant an idempotent producer: ")
            && text.ends_with("set idempotence off to send without one"),
        "{text}"
    );
    let row = NewEvent::builder()
        .event_type("t")
        .aggregate("a", uuid::Uuid::nil())
        .topic(topic.clone())
        .partition_key("k")
        .payload_json(serde_json::json!({"n": 1}))
        .build()
        .expect("valid")
        .into_row(chrono::Utc::now());
    let m = Message::from_event(&row);
    match on.publish(&m).await {
        Err(BrokerError::Transient(t)) => assert_eq!(t, text, "the publish carries R87's text"),
        other => panic!("expected a transient failure, got {other:?}"),
    }
    assert!(proxy.dropped() >= 2, "InitProducerId was asked and refused");
    let off = KafkaBroker::connect_lazy(cfg(Idempotence::Off)).expect("lazy");
    off.check()
        .await
        .expect("idempotence off needs no producer id");
    off.publish(&m).await.expect("sent without a producer id");
    let got = read_topic_at(&proxy.addr().to_string(), &topic).await;
    assert_eq!(got.len(), 1, "only the publish under off is stored");
    drop(private);
}
