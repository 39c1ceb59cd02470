//! The start-up check of the streams against the machine's NATS JetStream (`NATS_URL`, default
//! `nats://127.0.0.1:4222`): a configuration whose subjects no stream covers can never publish,
//! and says so when the adapter is made, not in each row's `last_error`. Each test uses a fresh
//! subject prefix (and stream, deleted at the end).

mod common;

use common::*;
use txoutbox_nats_broker::{NatsBrokerError, StreamSpec};

fn config(prefix: &str) -> NatsBrokerConfig {
    NatsBrokerConfig::new(url())
        .subject_prefix(prefix)
        .timeout(Duration::from_secs(2))
}

/// Creates a memory stream with these subjects (the admin's, not the adapter's).
async fn create_stream(admin: &jetstream::Context, name: &str, subjects: String) {
    admin
        .create_stream(jetstream::stream::Config {
            name: name.to_owned(),
            subjects: vec![subjects],
            storage: jetstream::stream::StorageType::Memory,
            ..Default::default()
        })
        .await
        .expect("create the stream");
}

async fn admin() -> jetstream::Context {
    jetstream::new(
        async_nats::connect(url())
            .await
            .unwrap_or_else(|e| panic!("NATS at {} is unreachable: {e}", url())),
    )
}

/// No stream covers `prefix>`: `connect` fails with `NoStream`, naming the subjects and the fix.
#[tokio::test]
async fn connect_refuses_subjects_no_stream_covers() {
    let prefix = format!("outboxcheck.none.{}.", fresh_suffix());
    match NatsBroker::connect(config(&prefix)).await {
        Err(e @ NatsBrokerError::NoStream { .. }) => {
            let text = e.to_string();
            assert!(text.contains(&format!("{prefix}>")), "{text}");
            assert!(text.contains("create a stream"), "{text}");
        }
        other => panic!("expected NoStream, got {other:?}"),
    }
}

/// A stream made by someone else covers the prefix: `connect` succeeds; so does one made by
/// `ensure_stream`; and a stream that covers the subjects only partly (one topic) passes too.
#[tokio::test]
async fn connect_accepts_a_covering_stream() {
    let suffix = fresh_suffix();
    let admin = admin().await;

    let prefix = format!("outboxcheck.wide.{suffix}.");
    let wide = format!("OUTBOX_CHECK_WIDE_{suffix}");
    create_stream(&admin, &wide, format!("{prefix}>")).await;
    NatsBroker::connect(config(&prefix))
        .await
        .expect("a stream covers prefix>");

    let partial_prefix = format!("outboxcheck.part.{suffix}.");
    let partial = format!("OUTBOX_CHECK_PART_{suffix}");
    create_stream(&admin, &partial, format!("{partial_prefix}orders")).await;
    NatsBroker::connect(config(&partial_prefix))
        .await
        .expect("a stream covering one topic can publish that topic");

    let ensured_prefix = format!("outboxcheck.ens.{suffix}.");
    let ensured = format!("OUTBOX_CHECK_ENS_{suffix}");
    NatsBroker::connect(config(&ensured_prefix).ensure_stream(
        StreamSpec::new(&ensured).storage(txoutbox_nats_broker::StreamStorage::Memory),
    ))
    .await
    .expect("ensure_stream makes the covering stream before the check");

    for name in [wide, partial, ensured] {
        admin.delete_stream(&name).await.expect("delete the stream");
    }
}

/// `check_streams(false)` connects without the check; a lazy adapter is not checked at start,
/// and `check_streams()` called once it is connected reports the same error.
#[tokio::test]
async fn the_check_can_be_deferred_and_run_by_hand() {
    let prefix = format!("outboxcheck.off.{}.", fresh_suffix());
    let unchecked = NatsBroker::connect(config(&prefix).check_streams(false))
        .await
        .expect("no check asked for");
    assert!(matches!(
        unchecked.check_streams().await,
        Err(NatsBrokerError::NoStream { .. })
    ));
    let lazy = NatsBroker::connect_lazy(config(&prefix))
        .await
        .expect("a lazy adapter does not check");
    assert!(lazy.wait_connected(Duration::from_secs(5)).await);
    match lazy.check_streams().await {
        Err(NatsBrokerError::NoStream { subjects }) => assert_eq!(subjects, format!("{prefix}>")),
        other => panic!("expected NoStream, got {other:?}"),
    }
}

/// A prefix that does not end in `.` names no subject space: nothing to check.
#[test]
fn a_prefix_without_a_dot_has_no_subject_space() {
    assert_eq!(
        config("outbox.").subject_space().as_deref(),
        Some("outbox.>")
    );
    assert_eq!(config("").subject_space().as_deref(), Some(">"));
    assert_eq!(config("outbox").subject_space(), None);
}
