//! The probe a relay loop calls while it waits out an outage (`Broker::probe`): Redis's
//! connection manager has no connection events, so the adapter answers with a PING.

mod common;

use common::*;
use txoutbox_conformance::net::Forwarder;
use txoutbox_core::broker::Probe;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_is_down_while_unreachable_and_up_once_reachable() {
    let mut port = Forwarder::closed().await.expect("a free port");
    let cfg = RedisBrokerConfig::new(format!("redis://{}", port.addr()))
        .timeout(Duration::from_secs(2))
        .connect_timeout(Duration::from_secs(1));
    let broker = RedisBroker::connect_lazy(cfg).expect("lazy connect");
    assert!(broker.reconnects().is_none());
    assert_eq!(broker.probe().await, Probe::Down);
    let target = url()
        .trim_start_matches("redis://")
        .trim_end_matches('/')
        .to_owned();
    port.open(target).await.expect("forward");
    // The connection manager reconnects with its own back-off; probe as the relay loop does.
    let mut up = false;
    for _ in 0..40 {
        if broker.probe().await == Probe::Up {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(up, "the probe answers Up once Redis is reachable");
}
