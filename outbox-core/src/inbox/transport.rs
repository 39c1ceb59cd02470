//! The transport layer: what a broker adapter provides so that the subscription's plumbing (the
//! read-ahead buffer that survives a cancelled read, the bounded queue of waiting rewinds, the
//! give-back at close, the dead-letter header set) is written once, here, over it.
//!
//! **This module serves broker adapter implementers, not users, and is exempt from semver**:
//! its traits and types may change in any release. Users name the subscriptions at the adapter
//! crates' roots (`NatsSubscription`, `RedisSubscription`, …) and the runner takes them as
//! [`Subscription`]s.
//!
//! # The pieces
//!
//! - [`Transport`]: one broker's native half. It reads what is ready, up to a bound, waiting
//!   only for the first message (never to fill a batch, batches.md R184); it says what one of
//!   its messages is ([`Received`]); and it carries the native operations of one message
//!   (commit, rewind, renew, term, the dead-letter copy, the give-back at close). What it can do
//!   is data ([`TransportCapabilities`]).
//! - [`TransportSubscription`]: the [`Subscription`] over any transport. It owns, once for
//!   every broker:
//!   * the **read-ahead buffer**: a read runs in a task of its own and lands in a buffer, so
//!     that a read the runner gives up on (its loop's `select!`) loses no message the broker
//!     already handed over; the next read hands them out first;
//!   * the **bounded rewind queue** (R136's bound, on every transport that holds rewinds in
//!     the process, [`TransportCapabilities::holds_rewinds`]): at most the runner's concurrency
//!     rewinds wait at once, renewed while they wait and taken back when due
//!     ([`Transport::take_back`]); beyond the bound the ack reports no room (the runner records
//!     the failure instead, R126) and a rewind it must make anyway (R132, R140) goes to the
//!     transport's own rewind ([`Transport::rewind`]);
//!   * the **give-back at close**: read-ahead messages no runner took, and rewinds still
//!     waiting, are handed back to the broker ([`Transport::give_back`], [`Transport::rewind`]);
//!   * the **runner settings** ([`RunnerSettings`]), given by the runner at build: the user
//!     gives the concurrency, max_attempts and at_most_once once, to the runner.
//! - [`DeadLetter`]: the dead-letter copy's added attributes (R140), named once.
//! - [`transient`]: the transient-error form every adapter uses.
//!
//! # Writing a transport
//!
//! ```ignore
//! struct MyTransport { /* client, consumer, … */ }
//!
//! #[async_trait]
//! impl Transport for MyTransport {
//!     type Message = MyMessage;
//!     fn capabilities(&self) -> TransportCapabilities { /* … */ }
//!     async fn read(&self, max: usize, wait: Duration) -> Result<Vec<MyMessage>, SubscriptionError> {
//!         // at most `max`, waiting at most `wait` for the first, returning as soon as one is there
//!     }
//!     fn received(&self, m: &MyMessage) -> Result<Received, SubscriptionError> { /* … */ }
//!     // commit, rewind, renew, term, dead_letter, give_back …
//! }
//!
//! let subscription = TransportSubscription::new(MyTransport { /* … */ });
//! let runner = Runner::for_subscription(backend, subscription).handler(h).build()?;
//! ```
//!
//! The conformance suite's in-process transport (`txoutbox_conformance::inbox::channel`) is a
//! fifth broker written this way, outside this crate, and runs the J scenarios.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::inbox::decode::BrokerMessage;
pub use crate::inbox::subscription::RunnerSettings;
use crate::inbox::subscription::{
    AckHandle, InboxDelivery, Subscription, SubscriptionCapabilities, SubscriptionError,
};

/// What a transport can do, as data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransportCapabilities {
    /// The subscription's capabilities as the runner sees them (rewind, last delivery, renewal
    /// period, the refusal text of a rewind it cannot make).
    pub subscription: SubscriptionCapabilities,
    /// Whether a rewind waits in this process until it is due (Redis keeps the entry pending
    /// and claims it again; a broker without a delayed redelivery holds the message): such
    /// rewinds are bounded by the runner's concurrency (R136). False where the broker itself
    /// delays the redelivery (a NATS nak with a delay): then [`Transport::rewind`] is called at
    /// once and nothing waits here.
    pub holds_rewinds: bool,
    /// The longest a held rewind waits (RabbitMQ's hold_max, R178): a longer delay is cut to
    /// it. None: the delay as the runner gives it.
    pub longest_hold: Option<Duration>,
}

/// What one message is: its view for decoding, its delivery number, whether the broker
/// delivers it again.
#[derive(Debug, Clone)]
pub struct Received {
    /// The message as received, for decoding (R137) and for its position (R138).
    pub message: BrokerMessage,
    /// How often the broker delivered it to the group, this delivery included (n ≥ 1).
    pub delivery_number: u32,
    /// False only on the broker's last delivery (R182).
    pub redelivered_later: bool,
}

/// The attributes the dead-letter copy adds to the message as received (R140): the reason,
/// the group and where the message came from. Every transport names them with one of the two
/// sets here, so that the names are written once.
#[derive(Debug, Clone, Copy)]
pub struct DeadLetter<'a> {
    /// Why the message is invalid (`InvalidMessage`'s reason).
    pub reason: &'a str,
    /// The consumer group that refused it.
    pub group: &'a str,
}

impl DeadLetter<'_> {
    /// As headers: `Inbox-Invalid-Reason`, `Inbox-Consumer-Group`, then `Inbox-Original-` + each
    /// name of `origin` (`Stream`, `Sequence`, `Topic`, `Queue`, …). Values keep no line break
    /// (a header value cannot hold one).
    pub fn headers(&self, origin: &[(&str, String)]) -> Vec<(String, String)> {
        let clean = |s: &str| s.replace(['\r', '\n'], " ");
        let mut out = vec![
            ("Inbox-Invalid-Reason".to_owned(), clean(self.reason)),
            ("Inbox-Consumer-Group".to_owned(), clean(self.group)),
        ];
        out.extend(
            origin
                .iter()
                .map(|(k, v)| (format!("Inbox-Original-{k}"), clean(v))),
        );
        out
    }

    /// As fields of a record (Redis Streams): `invalid_reason`, `consumer_group`, then
    /// `original_` + each name of `origin` in lowercase (`stream`, `id`).
    pub fn fields(&self, origin: &[(&str, String)]) -> Vec<(String, String)> {
        let mut out = vec![
            ("invalid_reason".to_owned(), self.reason.to_owned()),
            ("consumer_group".to_owned(), self.group.to_owned()),
        ];
        out.extend(
            origin
                .iter()
                .map(|(k, v)| (format!("original_{}", k.to_ascii_lowercase()), v.clone())),
        );
        out
    }
}

/// The transient error every transport reports for a failed broker call:
/// `{broker}: {what} failed: {error}` (R120: the runner tries again).
pub fn transient(broker: &str, what: &str, e: impl std::fmt::Display) -> SubscriptionError {
    SubscriptionError::transient(format!("{broker}: {what} failed: {e}"))
}

/// One broker's native half of a subscription (see the module docs).
#[async_trait]
pub trait Transport: Send + Sync + 'static {
    /// One message as read, with what its native operations need (a reply subject, an entry
    /// id, a delivery tag).
    type Message: Send + Sync + 'static;

    /// What the transport can do.
    fn capabilities(&self) -> TransportCapabilities;

    /// The consumer group the transport reads for, when its configuration names one
    /// ([`Subscription::group`]).
    fn group(&self) -> Option<&str> {
        None
    }

    /// The topics the transport reads, when it knows them as topics ([`Subscription::topics`]).
    fn topics(&self) -> Option<&[String]> {
        None
    }

    /// Checks the runner's settings when the runner is built (NATS: a bound consumer's
    /// max_deliver below the rewinding runner's max_attempts is refused); the error says what
    /// to change. The default takes every setting.
    fn check_settings(&self, _settings: &RunnerSettings) -> Result<(), String> {
        Ok(())
    }

    /// Reads what is ready, at most `max` (≥ 1) messages, waiting at most `wait` for the first
    /// and never longer to fill the rest (batches.md R184); an empty list when none came. This
    /// is called in a task of its own: it is never cancelled half-way by the runner.
    async fn read(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<Self::Message>, SubscriptionError>;

    /// What `m` is (its view for decoding, n, whether it is the last delivery).
    fn received(&self, m: &Self::Message) -> Result<Received, SubscriptionError>;

    /// Tells the broker the group is done with `m`, confirmed (R113, R131).
    async fn commit(&self, m: &Self::Message) -> Result<(), SubscriptionError>;

    /// The broker's own rewind of `m` after `delay`: where the transport does not hold
    /// rewinds, every rewind; where it does, one beyond the bound and one still waiting at
    /// close (Redis leaves the entry pending for XAUTOCLAIM; a broker without a delayed
    /// redelivery gives it back at once).
    async fn rewind(&self, m: &Self::Message, delay: Duration) -> Result<(), SubscriptionError>;

    /// A held rewind of `m`, made with `delay`, is due: the messages it gives back at once
    /// (Redis claims the entry again, which counts a delivery), or none where the broker
    /// redelivers it through [`read`](Self::read) (the default: [`rewind`](Self::rewind) with
    /// no delay; RabbitMQ returns it with basic.reject, or basic.nack for a give-back of delay
    /// 0).
    async fn take_back(
        &self,
        m: &Self::Message,
        _delay: Duration,
    ) -> Result<Vec<Self::Message>, SubscriptionError> {
        self.rewind(m, Duration::ZERO).await?;
        Ok(Vec::new())
    }

    /// Ends `m` for the group without handling it (R140).
    async fn term(&self, m: &Self::Message, reason: &str) -> Result<(), SubscriptionError>;

    /// Keeps `m` from being handed to another consumer (R134, R136).
    async fn renew(&self, m: &Self::Message) -> Result<(), SubscriptionError>;

    /// Copies `m` as received to the dead-letter destination with `letter`'s attributes (R140).
    async fn dead_letter(
        &self,
        m: &Self::Message,
        letter: &DeadLetter<'_>,
    ) -> Result<(), SubscriptionError>;

    /// Gives back, at close, a message read ahead that no runner took (R167). The default
    /// rewinds it with no delay.
    async fn give_back(&self, m: Self::Message) {
        if let Err(e) = self.rewind(&m, Duration::ZERO).await {
            tracing::warn!(error = %e, "giving back a read-ahead message at close failed");
        }
    }

    /// Ends reading as the runner begins to stop ([`Subscription::stop_reading`]).
    async fn stop_reading(&self) {}

    /// Closes the transport after everything was given back ([`Subscription::close`]).
    async fn close(&self) {}
}

/// A rewind waiting in the process (R136).
struct Held<M> {
    message: Arc<M>,
    delay: Duration,
    due: Instant,
    renewed: Instant,
}

struct Shared<T: Transport> {
    transport: T,
    /// Messages read after their caller stopped waiting; handed out first by the next read.
    buffer: Mutex<VecDeque<T::Message>>,
    /// The waiting rewinds, at most `bound` (R136).
    rewinds: Mutex<Vec<Held<T::Message>>>,
    /// How many rewinds may wait: the configured override, else the runner's concurrency.
    bound: AtomicUsize,
    /// Whether the bound was set by the adapter's configuration (then the runner's concurrency
    /// does not replace it).
    bound_overridden: AtomicBool,
    /// Held by a read task for its duration; a close waits for it.
    reading: tokio::sync::Mutex<()>,
    closed: AtomicBool,
}

/// The [`Subscription`] over a [`Transport`] (see the module docs). Cloning shares it.
pub struct TransportSubscription<T: Transport> {
    shared: Arc<Shared<T>>,
}

impl<T: Transport> Clone for TransportSubscription<T> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<T: Transport> std::fmt::Debug for TransportSubscription<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransportSubscription")
            .field(
                "transport",
                &self.shared.transport.capabilities().subscription.name,
            )
            .field("rewind_bound", &self.shared.bound.load(Ordering::SeqCst))
            .finish_non_exhaustive()
    }
}

impl<T: Transport> TransportSubscription<T> {
    /// The subscription over `transport`; its rewind bound is the runner's concurrency, given
    /// when the runner is built (16, the runner's default, until then).
    pub fn new(transport: T) -> Self {
        Self {
            shared: Arc::new(Shared {
                transport,
                buffer: Mutex::default(),
                rewinds: Mutex::new(Vec::new()),
                bound: AtomicUsize::new(crate::inbox::runner::DEFAULT_RUNNER_CONCURRENCY),
                bound_overridden: AtomicBool::new(false),
                reading: tokio::sync::Mutex::new(()),
                closed: AtomicBool::new(false),
            }),
        }
    }

    /// Sets the rewind bound (≥ 1) instead of the runner's concurrency (R136).
    pub fn with_rewind_bound(self, n: usize) -> Self {
        self.shared.bound.store(n.max(1), Ordering::SeqCst);
        self.shared.bound_overridden.store(true, Ordering::SeqCst);
        self
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.shared.transport
    }

    /// How many rewinds may wait at once (R136).
    pub fn rewind_bound(&self) -> usize {
        self.shared.bound.load(Ordering::SeqCst)
    }

    /// How many rewinds wait now.
    pub fn waiting_rewinds(&self) -> usize {
        self.shared.rewinds.lock().expect("poisoned").len()
    }
}

impl<T: Transport> Shared<T> {
    fn holds_rewinds(&self) -> bool {
        self.transport.capabilities().holds_rewinds
    }

    /// Renews waiting rewinds as their renewal falls due, then takes back the due ones (at
    /// most `max`), then reads; the read waits no longer than the next rewind is due, and not
    /// at all once a rewind came back (R184).
    async fn fill(&self, max: usize, wait: Duration) -> Result<Vec<T::Message>, SubscriptionError> {
        let now = Instant::now();
        let renew_every = self.transport.capabilities().subscription.renew_every;
        let (due, renew, next_due) = {
            let mut held = self.rewinds.lock().expect("poisoned");
            held.sort_by_key(|h| h.due);
            let n = held.iter().take_while(|h| h.due <= now).count().min(max);
            let due: Vec<(Arc<T::Message>, Duration)> =
                held.drain(..n).map(|h| (h.message, h.delay)).collect();
            let mut renew = Vec::new();
            if let Some(every) = renew_every {
                for h in held.iter_mut() {
                    if now.saturating_duration_since(h.renewed) >= every {
                        h.renewed = now;
                        renew.push(h.message.clone());
                    }
                }
            }
            (due, renew, held.first().map(|h| h.due))
        };
        // A failed renewal or take-back is logged and does not fail the read: the message
        // stays with the broker, which hands it out again (its ack deadline, XAUTOCLAIM, the
        // channel's close), and the other due rewinds are still taken back.
        for m in renew {
            if let Err(e) = self.transport.renew(&m).await {
                tracing::warn!(error = %e, "renewing a waiting rewind failed");
            }
        }
        let mut out = Vec::new();
        for (m, delay) in due {
            match self.transport.take_back(&m, delay).await {
                Ok(back) => out.extend(back),
                Err(e) => tracing::warn!(error = %e, "taking back a due rewind failed"),
            }
        }
        if !out.is_empty() {
            return Ok(out);
        }
        let wait = match next_due {
            Some(t) => wait.min(t.saturating_duration_since(Instant::now())),
            None => wait,
        };
        self.transport.read(max, wait).await
    }
}

#[async_trait]
impl<T: Transport> Subscription for TransportSubscription<T> {
    fn capabilities(&self) -> SubscriptionCapabilities {
        self.shared.transport.capabilities().subscription
    }

    fn group(&self) -> Option<&str> {
        self.shared.transport.group()
    }

    fn topics(&self) -> Option<&[String]> {
        self.shared.transport.topics()
    }

    /// The runner's concurrency becomes the rewind bound (unless the adapter's configuration
    /// set one); the transport checks the rest.
    fn configure(&self, settings: &RunnerSettings) -> Result<(), String> {
        if !self.shared.bound_overridden.load(Ordering::SeqCst) {
            self.shared
                .bound
                .store(settings.concurrency.max(1), Ordering::SeqCst);
        }
        self.shared.transport.check_settings(settings)
    }

    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        if max == 0 || self.shared.closed.load(Ordering::SeqCst) {
            return Ok(Vec::new());
        }
        if self.shared.buffer.lock().expect("poisoned").is_empty() {
            // The read runs in a task of its own, so that a read the runner gives up on does
            // not drop what the broker already handed over: it waits in the buffer.
            let shared = self.shared.clone();
            tokio::spawn(async move {
                let _reading = shared.reading.lock().await;
                // A read the caller gave up on may have filled the buffer meanwhile: hand that
                // out first instead of reading (and waiting) again.
                if shared.closed.load(Ordering::SeqCst)
                    || !shared.buffer.lock().expect("poisoned").is_empty()
                {
                    return Ok(());
                }
                let got = shared.fill(max, wait).await?;
                shared.buffer.lock().expect("poisoned").extend(got);
                Ok::<(), SubscriptionError>(())
            })
            .await
            .map_err(|e| SubscriptionError::transient(format!("a read task failed: {e}")))??;
        }
        let taken: Vec<T::Message> = {
            let mut b = self.shared.buffer.lock().expect("poisoned");
            let n = b.len().min(max);
            b.drain(..n).collect()
        };
        taken
            .into_iter()
            .map(|m| {
                let r = self.shared.transport.received(&m)?;
                Ok(InboxDelivery {
                    message: r.message,
                    delivery_number: r.delivery_number.max(1),
                    redelivered_later: r.redelivered_later,
                    ack: Arc::new(TransportAck {
                        shared: self.shared.clone(),
                        message: Arc::new(m),
                    }),
                })
            })
            .collect()
    }

    async fn stop_reading(&self) {
        self.shared.transport.stop_reading().await
    }

    /// No read after this; waits for one in flight, gives back what was read ahead and the
    /// rewinds still waiting, then closes the transport (R167).
    async fn close(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        drop(self.shared.reading.lock().await);
        let left: Vec<T::Message> = self
            .shared
            .buffer
            .lock()
            .expect("poisoned")
            .drain(..)
            .collect();
        for m in left {
            self.shared.transport.give_back(m).await;
        }
        let held: Vec<Held<T::Message>> = self
            .shared
            .rewinds
            .lock()
            .expect("poisoned")
            .drain(..)
            .collect();
        for h in held {
            let delay = h.due.saturating_duration_since(Instant::now());
            if let Err(e) = self.shared.transport.rewind(&h.message, delay).await {
                tracing::warn!(error = %e, "giving back a waiting rewind at close failed");
            }
        }
        self.shared.transport.close().await
    }
}

/// The operations of one delivery, over the transport and the shared rewind queue.
struct TransportAck<T: Transport> {
    shared: Arc<Shared<T>>,
    message: Arc<T::Message>,
}

#[async_trait]
impl<T: Transport> AckHandle for TransportAck<T> {
    async fn commit(&self) -> Result<(), SubscriptionError> {
        self.shared.transport.commit(&self.message).await
    }

    /// Where the transport holds rewinds: waits in the queue while it has room (R136), else the
    /// transport's own rewind; elsewhere the transport's own rewind at once.
    async fn rewind(&self, delay: Duration) -> Result<(), SubscriptionError> {
        let caps = self.shared.transport.capabilities();
        if caps.holds_rewinds {
            let delay = caps.longest_hold.map_or(delay, |l| delay.min(l));
            let bound = self.shared.bound.load(Ordering::SeqCst);
            let mut held = self.shared.rewinds.lock().expect("poisoned");
            if held.len() < bound {
                let now = Instant::now();
                held.push(Held {
                    message: self.message.clone(),
                    delay,
                    due: now + delay,
                    renewed: now,
                });
                return Ok(());
            }
        }
        self.shared.transport.rewind(&self.message, delay).await
    }

    async fn term(&self, reason: &str) -> Result<(), SubscriptionError> {
        self.shared.transport.term(&self.message, reason).await
    }

    async fn renew(&self) -> Result<(), SubscriptionError> {
        self.shared.transport.renew(&self.message).await
    }

    async fn dead_letter(&self, reason: &str, group: &str) -> Result<(), SubscriptionError> {
        self.shared
            .transport
            .dead_letter(&self.message, &DeadLetter { reason, group })
            .await
    }

    /// False once the bound's number of rewinds wait (R136); always true where the broker
    /// holds the rewinds itself.
    fn rewind_has_room(&self) -> bool {
        !self.shared.holds_rewinds()
            || self.shared.rewinds.lock().expect("poisoned").len()
                < self.shared.bound.load(Ordering::SeqCst)
    }
}

/// Declares an adapter's public subscription type over its transport: a newtype of
/// [`TransportSubscription`] that is cloneable, dereferences to it (so
/// [`transport`](TransportSubscription::transport) and the rewind bound are reachable), and is a
/// [`Subscription`] (every method forwarded). The adapter then writes its constructors on the
/// newtype, so users keep names like `NatsSubscription::bind`. The adapter crate needs
/// `async-trait` as a dependency.
///
/// ```ignore
/// txoutbox_core::transport_subscription! {
///     /// The inbox's subscription on …
///     pub struct MySubscription(MyTransport);
/// }
/// ```
#[macro_export]
macro_rules! transport_subscription {
    ($(#[$m:meta])* $vis:vis struct $name:ident($transport:ty);) => {
        $(#[$m])*
        #[derive(Clone, Debug)]
        $vis struct $name($crate::inbox::transport::TransportSubscription<$transport>);

        impl ::std::ops::Deref for $name {
            type Target = $crate::inbox::transport::TransportSubscription<$transport>;
            fn deref(&self) -> &Self::Target {
                &self.0
            }
        }

        #[::async_trait::async_trait]
        impl $crate::inbox::subscription::Subscription for $name {
            fn capabilities(&self) -> $crate::inbox::subscription::SubscriptionCapabilities {
                self.0.capabilities()
            }
            fn group(&self) -> ::std::option::Option<&str> {
                self.0.group()
            }
            fn topics(&self) -> ::std::option::Option<&[::std::string::String]> {
                self.0.topics()
            }
            fn configure(
                &self,
                settings: &$crate::inbox::subscription::RunnerSettings,
            ) -> ::std::result::Result<(), ::std::string::String> {
                self.0.configure(settings)
            }
            async fn next(
                &self,
                max: usize,
                wait: ::std::time::Duration,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::inbox::subscription::InboxDelivery>,
                $crate::inbox::subscription::SubscriptionError,
            > {
                self.0.next(max, wait).await
            }
            async fn stop_reading(&self) {
                self.0.stop_reading().await
            }
            async fn close(&self) {
                self.0.close().await
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_names() {
        let l = DeadLetter {
            reason: "body is not JSON\nreally",
            group: "g",
        };
        assert_eq!(
            l.headers(&[("Stream", "S".into())]),
            vec![
                (
                    "Inbox-Invalid-Reason".into(),
                    "body is not JSON really".into()
                ),
                ("Inbox-Consumer-Group".into(), "g".into()),
                ("Inbox-Original-Stream".into(), "S".into()),
            ]
        );
        assert_eq!(
            l.fields(&[("Id", "1-0".into())])[2],
            ("original_id".into(), "1-0".into())
        );
    }
}
