//! A fifth broker with no edit to outbox-core: the in-process transport of
//! `txoutbox_conformance::inbox::channel`, written on `txoutbox_core::inbox::transport`, runs the
//! shared broker trials (G-01 to G-06, G-08, G-09, the poison message, dead-lettering), the
//! rewind, kill and renewal trials (J-02/J-09's, J-04/J-10's, J-05/J-11's on this broker) and
//! R136's bound (J-38).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use txoutbox_conformance::inbox::broker_subs::{self, SubscriptionTrial, SubscriptionUnderTest};
use txoutbox_conformance::inbox::channel::ChannelBroker;
use txoutbox_core::inbox::Subscription;

struct Channel;

struct Trial {
    broker: ChannelBroker,
}

#[async_trait]
impl SubscriptionTrial for Trial {
    async fn publish(&self, attrs: &[(&str, &str)], body: &str) {
        self.broker.publish("src", attrs, body);
    }

    async fn subscription(
        &self,
        _worker: &str,
        redeliver_after: Duration,
    ) -> Arc<dyn Subscription> {
        Arc::new(self.broker.subscription("g", &["src"], redeliver_after))
    }

    async fn cleanup(&self) {}
}

#[async_trait]
impl SubscriptionUnderTest for Channel {
    async fn trial(&self) -> Box<dyn SubscriptionTrial> {
        Box::new(Trial {
            broker: ChannelBroker::default(),
        })
    }
}

txoutbox_conformance::inbox_broker_suite!(Channel);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_09_rewind_is_redelivered_later() {
    broker_subs::rewind_is_redelivered_later(&Channel).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_10_killed_runner_message_comes_back() {
    broker_subs::killed_runner_message_comes_back(
        &Channel,
        Duration::from_secs(1),
        Duration::from_secs(4),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_11_renewal_keeps_slow_run() {
    broker_subs::renewal_keeps_slow_run(&Channel).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn j_38_rewinds_bounded_by_the_runner_concurrency() {
    broker_subs::rewinds_bounded_by_the_runner_concurrency(&Channel, true).await;
}

/// The dead-letter copy carries R140's headers, named once in outbox-core's transport layer.
#[tokio::test]
async fn dead_letter_copy_has_r140_headers() {
    let broker = ChannelBroker::default();
    let sub = broker.subscription("g", &["src"], Duration::from_secs(30));
    broker.publish("src", &[("event_id", "bad")], "not json");
    let d = sub.next(1, Duration::from_secs(1)).await.unwrap();
    assert_eq!(d.len(), 1);
    d[0].ack.dead_letter("body is not JSON", "g").await.unwrap();
    d[0].ack.term("body is not JSON").await.unwrap();
    let dl = broker.dead_letters();
    assert_eq!(dl.len(), 1);
    let names: Vec<&str> = dl[0].1.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "Inbox-Invalid-Reason",
            "Inbox-Consumer-Group",
            "Inbox-Original-Topic",
            "Inbox-Original-Sequence"
        ]
    );
    assert_eq!(broker.unended("g"), 0);
}
