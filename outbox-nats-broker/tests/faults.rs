//! Issue 14's fault suite on NATS JetStream: a relay loop on PostgreSQL publishing through a
//! fault-injecting proxy while the broker refuses connections, black-holes them, or resets them.
//! Checks nothing is lost or reordered per key and prints the figures of each outage.

mod common;

use std::time::Duration;

use common::*;
use outbox_core::repository::DeliveryMode;
use outbox_postgres::testing::{BrokerFault, broker_outage_on_postgres};

async fn outage(fault: BrokerFault, delivery: DeliveryMode) {
    let f = broker_outage_on_postgres(&Nats, fault, Duration::from_secs(3), delivery).await;
    println!(
        "faults nats {fault:?} {delivery:?}: outage {:?}: {} cycles, {} rows fetched, {} row writes during it; first publish {:?} after the broker answered again",
        f.outage,
        f.cycles_during,
        f.rows_fetched_during,
        f.row_writes_during,
        f.first_publish_after
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
