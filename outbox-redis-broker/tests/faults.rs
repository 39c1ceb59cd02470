//! The broker fault suite on Redis Streams: three relay loops on PostgreSQL publishing through a
//! fault-injecting proxy while the broker refuses connections for 10 s, black-holes them, or
//! resets them. Nothing may be lost or reordered per key; the figures are printed and held to
//! the recovery bounds of `broker_outage_recovers_within_bounds` (at most 10 % of the ancestor's
//! row updates and cycles during the outage, a publish soon after the broker is back).

mod common;

use common::*;
use txoutbox_core::repository::DeliveryMode;
use txoutbox_testkit::{BrokerFault, broker_outage_recovers_within_bounds};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_refused() {
    broker_outage_recovers_within_bounds(&Redis, BrokerFault::Refuse, DeliveryMode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_refused_transaction_delivery() {
    broker_outage_recovers_within_bounds(&Redis, BrokerFault::Refuse, DeliveryMode::Transaction)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_black_holed() {
    broker_outage_recovers_within_bounds(&Redis, BrokerFault::BlackHole, DeliveryMode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_black_holed_transaction_delivery() {
    broker_outage_recovers_within_bounds(&Redis, BrokerFault::BlackHole, DeliveryMode::Transaction)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connections_reset() {
    broker_outage_recovers_within_bounds(&Redis, BrokerFault::Reset, DeliveryMode::Lease).await;
}
