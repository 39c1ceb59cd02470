//! End to end: events written to PostgreSQL through outbox-postgres (each in the writer's own
//! transaction) are drained by the relay into NATS JetStream; a consumer reads every event, in
//! order per key, with its headers. `DATABASE_URL` (default
//! `postgres://postgres@127.0.0.1:5432/test`) and `NATS_URL`; a fresh schema and stream.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_to_nats() {
    txoutbox_testkit::postgres_to_broker(&Nats).await;
}
