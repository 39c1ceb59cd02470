//! Outage handling for the relay loop: `Broker::reconnects` moves once the adapter has a
//! producer, and `Broker::probe` is a round trip.

mod common;

use common::*;
use txoutbox_conformance::net::Forwarder;
use txoutbox_core::broker::Probe;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_moves_and_the_probe_answers_once_the_broker_is_reachable() {
    let mut port = Forwarder::closed().await.expect("a free port");
    let broker = KafkaBroker::connect_lazy(
        KafkaBrokerConfig::new(port.addr().to_string())
            .idempotence(Idempotence::Off)
            .delivery_timeout(Duration::from_secs(2))
            .connect_timeout(Duration::from_millis(300)),
    )
    .expect("lazy");
    let mut watch = broker.reconnects().expect("reconnects");
    watch.mark_seen();
    assert_eq!(broker.probe().await, Probe::Down, "nothing listens");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), watch.changed())
            .await
            .is_err(),
        "no connection while the port is closed"
    );
    port.open(brokers()).await.expect("forward");
    assert_eq!(broker.probe().await, Probe::Up, "the broker answers");
    tokio::time::timeout(Duration::from_secs(1), watch.changed())
        .await
        .expect("the connection is reported");
    assert_eq!(broker.probe().await, Probe::Up, "a metadata round trip");
}

#[tokio::test]
async fn a_connect_error_names_the_brokers_and_is_transient() {
    let port = Forwarder::closed().await.expect("a free port");
    let e = KafkaBroker::connect(
        KafkaBrokerConfig::new(port.addr().to_string())
            .idempotence(Idempotence::Off)
            .delivery_timeout(Duration::from_secs(1))
            .connect_timeout(Duration::from_millis(300)),
    )
    .await
    .unwrap_err();
    assert!(e.is_transient(), "{e}");
    assert!(
        e.to_string().starts_with("Kafka broker unreachable: "),
        "{e}"
    );
}
