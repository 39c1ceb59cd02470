//! Outage handling for the relay loop: `Broker::reconnects` moves when the adapter opens a
//! connection, and `Broker::probe` is a round trip (a black hole probes `Down`).

mod common;

use common::*;
use txoutbox_conformance::broker::LoopbackProxy;
use txoutbox_conformance::net::Forwarder;
use txoutbox_core::broker::Probe;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_moves_when_the_broker_becomes_reachable() {
    let mut port = Forwarder::closed().await.expect("a free port");
    let broker = RabbitMqBroker::connect_lazy(
        RabbitMqBrokerConfig::new(url_at(port.addr())).connect_timeout(Duration::from_millis(500)),
    )
    .expect("lazy");
    let mut watch = broker.reconnects().expect("reconnects");
    watch.mark_seen();
    assert_eq!(broker.probe().await, Probe::Down);
    port.open(server_addr().to_string()).await.expect("forward");
    assert_eq!(broker.probe().await, Probe::Up);
    tokio::time::timeout(Duration::from_secs(1), watch.changed())
        .await
        .expect("the connection is reported");
    assert!(broker.is_connected().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_is_a_round_trip_and_fails_while_the_network_is_black_holed() {
    let proxy = LoopbackProxy::start(server_addr()).await;
    let broker = RabbitMqBroker::connect(
        RabbitMqBrokerConfig::new(url_at(proxy.addr())).confirm_timeout(Duration::from_secs(1)),
    )
    .await
    .expect("connect through the proxy");
    assert_eq!(broker.probe().await, Probe::Up);
    proxy.stall();
    let probe = tokio::time::timeout(Duration::from_secs(1), broker.probe()).await;
    assert!(
        matches!(probe, Err(_) | Ok(Probe::Down)),
        "nothing answers through a black hole: {probe:?}"
    );
    proxy.resume();
    assert_eq!(broker.probe().await, Probe::Up, "after the network is back");
    proxy.shutdown().await;
}
