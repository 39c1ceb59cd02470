//! Subscriptions, deliveries and ack handles (contract R113): what a broker adapter gives the
//! runner.
//!
//! A [`Subscription`] hands out [`InboxDelivery`]s, each with its [`BrokerMessage`], its delivery
//! number n, whether the broker will deliver it again, and an [`AckHandle`] with the four
//! operations of R113 (commit, rewind, term, renew) plus the dead-letter copy of R140. The runner
//! ends each delivery with exactly one of commit, rewind or term, unless it stops or crashes
//! first. What an adapter can do is data ([`SubscriptionCapabilities`]), so that a runner can
//! refuse a setting the broker cannot carry (Kafka refuses `rewind`, R175) when it is built.
//!
//! The suite's scripted subscription (`txoutbox_core::inbox::scripted`, feature `testing`) records
//! every operation; the NATS, Redis, Kafka and RabbitMQ adapters live in their own crates.

use std::time::Duration;

use async_trait::async_trait;

use crate::inbox::decode::BrokerMessage;

/// A subscription operation failed. Its display is the adapter's text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SubscriptionError {
    /// What failed.
    pub message: String,
    /// Whether trying again later can help (no answer, connection lost).
    pub transient: bool,
}

impl SubscriptionError {
    /// A transient failure (the broker could not be reached or did not answer in time).
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transient: true,
        }
    }

    /// A failure that retrying will not fix.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transient: false,
        }
    }

    /// Whether trying again later can help.
    pub fn is_transient(&self) -> bool {
        self.transient
    }
}

/// The operations on one delivery (R113, R134, R136, R140).
#[async_trait]
pub trait AckHandle: Send + Sync {
    /// Tells the broker the group is done with the message; returns once the broker confirmed
    /// it (the runner bounds the wait by commit_timeout, R131).
    async fn commit(&self) -> Result<(), SubscriptionError>;
    /// Has the broker deliver the message again after `delay` (R127, R132).
    async fn rewind(&self, delay: Duration) -> Result<(), SubscriptionError>;
    /// Ends the message for the group without handling it, with a reason (R140).
    async fn term(&self, reason: &str) -> Result<(), SubscriptionError>;
    /// Keeps the delivery from being handed to another consumer (R134, R136).
    async fn renew(&self) -> Result<(), SubscriptionError>;
    /// Copies the message as received to the dead-letter destination with the reason and the
    /// group (R140). A failure leaves the delivery to be rewound.
    async fn dead_letter(&self, reason: &str, group: &str) -> Result<(), SubscriptionError>;
    /// Whether one more rewind may wait now. A subscription that keeps the waiting rewinds
    /// itself bounds them (Redis: at most the runner's concurrency, R136); when this is false,
    /// the runner records a handler failure in the row (R126) instead of rewinding it. True by
    /// default: a broker that holds rewound messages itself (a NATS nak, a RabbitMQ nack) needs
    /// no bound.
    fn rewind_has_room(&self) -> bool {
        true
    }
}

/// One hand-over of a broker message to one runner (R113).
pub struct InboxDelivery {
    /// The message as received.
    pub message: BrokerMessage,
    /// How often the broker delivered it to the group, this delivery included (n ≥ 1).
    pub delivery_number: u32,
    /// False only on the broker's last delivery (R113, R182).
    pub redelivered_later: bool,
    /// Its operations (shared, so the runner can renew a delivery while it is handled).
    pub ack: std::sync::Arc<dyn AckHandle>,
}

impl std::fmt::Debug for InboxDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InboxDelivery")
            .field("position", &self.message.position())
            .field("delivery_number", &self.delivery_number)
            .field("redelivered_later", &self.redelivered_later)
            .finish_non_exhaustive()
    }
}

impl InboxDelivery {
    /// Whether this is the broker's last delivery of the message (R182).
    pub fn is_last(&self) -> bool {
        !self.redelivered_later
    }
}

/// What a subscription can do, as data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscriptionCapabilities {
    /// A short name (`scripted`, `nats`, `redis`, `kafka`, `rabbitmq`).
    pub name: &'static str,
    /// Whether a delivery can be rewound one by one (false on Kafka: `on_failure = rewind` is
    /// refused when the runner is built, R175).
    pub rewind: bool,
    /// Whether the broker has a last delivery (NATS with max_deliver, RabbitMQ with
    /// delivery_limit; R182).
    pub last_delivery: bool,
    /// How often the runner renews every delivery it holds, handled or waiting for its key
    /// (NATS: ack_wait / 2, R134; Redis: claim_idle / 2, R136); none: never.
    pub renew_every: Option<Duration>,
    /// Where `rewind` is false, the broker's own words for refusing `on_failure = rewind` when
    /// the runner is built (Kafka's R175 text); none: the runner's generic text.
    pub rewind_refusal: Option<&'static str>,
}

/// The runner's settings a subscription may need, given to it once when the runner is built
/// ([`Subscription::configure`]), so that the user gives them to the runner only.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunnerSettings {
    /// Deliveries the runner holds at once (R166): the bound on waiting rewinds (R136).
    pub concurrency: usize,
    /// The runner's max_attempts when it rewinds failures (`on_failure = rewind`, not at most
    /// once); none otherwise (NATS refuses a bound consumer whose max_deliver is below it, R133).
    pub rewind_max_attempts: Option<u32>,
    /// Whether the runner commits before handling (R129).
    pub at_most_once: bool,
}

impl RunnerSettings {
    /// Settings of a runner with this concurrency that does not rewind.
    pub fn new(concurrency: usize) -> Self {
        Self {
            concurrency,
            rewind_max_attempts: None,
            at_most_once: false,
        }
    }

    /// The same settings, for a runner that rewinds failures with this max_attempts.
    pub fn rewinding(mut self, max_attempts: u32) -> Self {
        self.rewind_max_attempts = Some(max_attempts);
        self
    }

    /// The same settings, at most once or not.
    pub fn at_most_once(mut self, on: bool) -> Self {
        self.at_most_once = on;
        self
    }
}

/// A source of deliveries for one consumer group (R113).
#[async_trait]
pub trait Subscription: Send + Sync {
    /// What the adapter can do.
    fn capabilities(&self) -> SubscriptionCapabilities;

    /// The consumer group this subscription reads for, when its configuration names one (the
    /// NATS, Redis, Kafka and RabbitMQ subscriptions do). A runner takes its group from here
    /// ([`Runner::for_subscription`](crate::inbox::Runner::for_subscription)), and refuses to
    /// be built with another one given to its builder. None by default.
    fn group(&self) -> Option<&str> {
        None
    }

    /// The topics this subscription reads, when it knows them as topics: the sources R137
    /// gives their messages, which are the runner's default sources (R121). A runner takes its
    /// topics from here, and refuses to be built with other topics given to its builder. None
    /// by default, and where the subscription reads something else (RabbitMQ queues, a NATS
    /// consumer bound by name without topics): then the runner's sources must be given.
    fn topics(&self) -> Option<&[String]> {
        None
    }

    /// Takes the runner's settings when the runner is built ([`RunnerSettings`]); an error is
    /// a setting this subscription cannot serve, with what to change, and the build fails with
    /// it. The default takes every setting.
    fn configure(&self, _settings: &RunnerSettings) -> Result<(), String> {
        Ok(())
    }

    /// Up to `max` deliveries (the runner's free slots, R134, R166), waiting at most `wait` for
    /// the first; an empty list when none came. An error is a failed read (R120).
    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError>;

    /// Ends reading as the runner begins to stop (R167), before it gives back the deliveries it
    /// holds and has not started: no more messages come to this runner, so none given back
    /// returns to it (RabbitMQ cancels its consumers). The default does nothing.
    async fn stop_reading(&self) {}

    /// Closes the subscription after the runner stopped (R167).
    async fn close(&self) {}
}

/// A shared subscription is a subscription (every method forwarded), so that
/// [`Runner::for_subscription`](crate::inbox::Runner::for_subscription) takes an
/// `Arc<dyn Subscription>` as well as the subscription itself.
#[async_trait]
impl<S: Subscription + ?Sized> Subscription for std::sync::Arc<S> {
    fn capabilities(&self) -> SubscriptionCapabilities {
        (**self).capabilities()
    }
    fn group(&self) -> Option<&str> {
        (**self).group()
    }
    fn topics(&self) -> Option<&[String]> {
        (**self).topics()
    }
    fn configure(&self, settings: &RunnerSettings) -> Result<(), String> {
        (**self).configure(settings)
    }
    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        (**self).next(max, wait).await
    }
    async fn stop_reading(&self) {
        (**self).stop_reading().await
    }
    async fn close(&self) {
        (**self).close().await
    }
}
