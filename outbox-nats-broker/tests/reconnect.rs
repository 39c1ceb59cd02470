//! The reconnection signal a relay loop waits on during an outage (`Broker::reconnects`): a
//! broker made while NATS is unreachable reports the connection once the server is reachable.

mod common;

use common::*;
use txoutbox_conformance::net::Forwarder;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_moves_when_the_server_becomes_reachable() {
    let mut port = Forwarder::closed().await.expect("a free port");
    let cfg = NatsBrokerConfig::new(format!("nats://{}", port.addr()))
        .timeout(Duration::from_secs(2))
        .reconnect_delay_max(Duration::from_millis(200));
    let broker = NatsBroker::connect_lazy(cfg).await.expect("lazy connect");
    let mut watch = broker.reconnects().expect("NATS reports reconnections");
    watch.mark_seen();
    assert!(!broker.is_connected());
    // Nothing arrives while the port refuses connections.
    assert!(
        tokio::time::timeout(Duration::from_millis(300), watch.changed())
            .await
            .is_err(),
        "no connection while the port is closed"
    );
    port.open(host_port(&url())).await.expect("forward");
    tokio::time::timeout(Duration::from_secs(10), watch.changed())
        .await
        .expect("the connection is reported within 10 s of the server being reachable");
    assert!(broker.is_connected());
}

/// `Broker::probe` is a round trip: through a black-holed connection (accepted, silent, still
/// open, so no disconnect is ever reported) it answers `Down`, and `Up` again once bytes flow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_is_a_round_trip_and_fails_while_the_network_is_black_holed() {
    use txoutbox_conformance::broker::LoopbackProxy;
    use txoutbox_core::broker::Probe;

    let proxy = LoopbackProxy::start(Nats.server_addr()).await;
    let cfg = NatsBrokerConfig::new(format!("nats://{}", proxy.addr()))
        .timeout(Duration::from_millis(500))
        .reconnect_delay_max(Duration::from_millis(200))
        // Nothing is published here, so no stream is needed.
        .check_streams(false);
    let broker = NatsBroker::connect(cfg)
        .await
        .expect("connect through the proxy");
    assert_eq!(broker.probe().await, Probe::Up, "through a healthy network");
    proxy.stall();
    assert_eq!(
        broker.probe().await,
        Probe::Down,
        "nothing answers through a black hole"
    );
    assert!(broker.is_connected(), "the client saw no disconnect");
    proxy.resume();
    assert_eq!(broker.probe().await, Probe::Up, "after the network is back");
    proxy.shutdown().await;
}
