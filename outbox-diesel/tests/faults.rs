//! Issue 14's fault suite on the diesel backend: the relay's connection terminated mid-fetch
//! (its first fetch statement waits on a table lock; its backend is ended), in both delivery
//! modes. The relay fetches again on a fresh pooled connection; nothing is lost or reordered.

use txoutbox_testkit::diesel as common;

use std::sync::Arc;
use std::time::Duration;

use common::patient_pool;
use txoutbox_core::repository::DeliveryMode;
use txoutbox_diesel::{DieselConfig, DieselOutboxRepository};
use txoutbox_testkit::fetch_terminated_mid_statement_with;

async fn mid_fetch(delivery: DeliveryMode) {
    let f = fetch_terminated_mid_statement_with(delivery, |url, table| {
        Arc::new(DieselOutboxRepository::new(
            patient_pool(url, 2),
            DieselConfig::default().table(table.clone()),
        ))
    })
    .await;
    println!("faults diesel terminated mid-fetch: {f:?}");
    // The target is 1 s (printed above); the relay waits 250 ms after a failed fetch.
    assert!(
        f.first_publish_after < Duration::from_secs(5),
        "no publish within 5 s after the fetch was cut: {f:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_connection_terminated_mid_fetch() {
    mid_fetch(DeliveryMode::Lease).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_connection_terminated_mid_fetch_transaction_delivery() {
    mid_fetch(DeliveryMode::Transaction).await;
}
