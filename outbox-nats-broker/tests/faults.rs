//! Issue 14's fault suite on NATS JetStream, in the setting: three relay loops on PostgreSQL
//! publishing through a fault-injecting proxy while the broker refuses connections for 10 s,
//! black-holes them, or resets them. Checks nothing is lost or reordered per key, prints the
//! figures of each outage (cycles, row updates counted by PostgreSQL, first publish after), and
//! holds the targets: at most 10 % of the ancestor's row updates and cycles during the
//! outage, and the relays publishing again soon after the broker answers.

mod common;

use std::time::Duration;

use common::*;
use outbox_core::repository::DeliveryMode;
use outbox_postgres::testing::{BrokerFault, broker_outage_on_postgres};

/// The outage.
const OUTAGE: Duration = Duration::from_secs(10);

async fn outage(fault: BrokerFault, delivery: DeliveryMode) {
    let f = broker_outage_on_postgres(&Nats, fault, OUTAGE, delivery).await;
    println!("faults nats {fault:?} {delivery:?}: {f}");
    // The ancestor's cycles, from its row updates: each cycle leased and released a batch of
    // 50 rows (2 updates per row).
    let ancestor_cycles = f.ancestor_row_writes / (2 * 50);
    assert!(
        f.row_writes_during * 10 <= f.ancestor_row_writes as i64,
        "more than 10 % of the ancestor's row updates: {f}"
    );
    assert!(
        f.cycles_during * 10 <= ancestor_cycles,
        "more than 10 % of the ancestor's {ancestor_cycles} cycles: {f}"
    );
    if delivery == DeliveryMode::Transaction {
        // Nothing for the outage itself: at most the completions of the cycles in flight when
        // the broker went away (3 relays × batch 50).
        assert!(
            f.row_writes_during <= 3 * 50,
            "transaction delivery writes nothing during an outage: {f}"
        );
    }
    // The target is 1 s (printed above); this bound only catches a relay that waits for its
    // back-off timer (up to 30 s) instead of the broker's return.
    assert!(
        f.first_publish_after < Duration::from_secs(5),
        "no publish within 5 s after the broker came back: {f}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_refused() {
    outage(BrokerFault::Refuse, DeliveryMode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_refused_transaction_delivery() {
    outage(BrokerFault::Refuse, DeliveryMode::Transaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_black_holed() {
    outage(BrokerFault::BlackHole, DeliveryMode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_black_holed_transaction_delivery() {
    outage(BrokerFault::BlackHole, DeliveryMode::Transaction).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connections_reset() {
    outage(BrokerFault::Reset, DeliveryMode::Lease).await;
}
