//! The inbox's NATS JetStream subscription (contract R133, R134, R137, R140).
//!
//! [`NatsSubscription`] reads a durable pull consumer of one stream for one consumer group. It
//! binds to the consumer by name, or creates it when it does not exist (deliver policy all, ack
//! policy explicit, max_deliver −1, filter subject = prefix + topic), so that no delivery of a
//! consumer it created is a last delivery (R182). A bound consumer must have ack policy explicit
//! (`ack_policy must be explicit`), and, when the runner rewinds, a max_deliver of at least
//! max_attempts (`max_deliver ({d}) is below max_attempts ({m})`).
//!
//! The operations of a delivery (R134):
//!
//! | operation | JetStream |
//! |---|---|
//! | commit | `+ACK`, confirmed by the server (a double ack) |
//! | rewind(d) | `-NAK {"delay": d}` (a plain `-NAK` for 0) |
//! | term(reason) | `+TERM {reason}` (a plain `+TERM` on servers before 2.10.4, which ignore the reason form) |
//! | renew | `+WPI` (in progress), every ack_wait / 2 |
//! | dead-letter copy | a JetStream publish to `deadletter.` + subject with R140's headers |
//!
//! The delivery number is the `delivered` count of the message's JetStream metadata; the last
//! delivery is the one with n = max_deliver when max_deliver is set. Checked by the J scenarios
//! J-01 to J-07 and J-31, and the G scenarios, in `outbox-conformance`'s broker trials.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::Config as PullConfig;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::context::ConsumerInfoErrorKind;
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::{self};
use async_nats::{HeaderMap, HeaderValue};
use async_trait::async_trait;
use futures::StreamExt;
use txoutbox_core::inbox::decode::BrokerMessage;
use txoutbox_core::inbox::subscription::{
    AckHandle, InboxDelivery, Subscription, SubscriptionCapabilities, SubscriptionError,
};

use crate::error::NatsBrokerError;

/// Default ack_wait of a consumer the subscription creates.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(30);
/// Default prefix of the dead-letter subject (R140).
pub const DEFAULT_DEAD_LETTER_PREFIX: &str = "deadletter.";

/// Settings of a [`NatsSubscription`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsSubscriptionConfig {
    stream: String,
    group: String,
    consumer: Option<String>,
    subject_prefix: String,
    topics: Vec<String>,
    ack_wait: Duration,
    dead_letter_prefix: String,
    rewind_max_attempts: Option<u32>,
    timeout: Duration,
}

impl NatsSubscriptionConfig {
    /// Reads stream `stream` for consumer group `group`, with the consumer named after the group
    /// ([`consumer_name_for`]), ack_wait 30 s, dead-letter prefix `deadletter.`.
    pub fn new(stream: impl Into<String>, group: impl Into<String>) -> Self {
        Self {
            stream: stream.into(),
            group: group.into(),
            consumer: None,
            subject_prefix: String::new(),
            topics: Vec::new(),
            ack_wait: DEFAULT_ACK_WAIT,
            dead_letter_prefix: DEFAULT_DEAD_LETTER_PREFIX.into(),
            rewind_max_attempts: None,
            timeout: crate::DEFAULT_TIMEOUT,
        }
    }

    /// The consumer's name, instead of the one derived from the group (two groups that differ
    /// only in characters NATS forbids need names of their own, R133).
    pub fn consumer(mut self, name: impl Into<String>) -> Self {
        self.consumer = Some(name.into());
        self
    }

    /// The subject prefix the topics are published under (R53), e.g. `in.`; a message without a
    /// source header gets its subject without this prefix as source (R137).
    pub fn subject_prefix(mut self, p: impl Into<String>) -> Self {
        self.subject_prefix = p.into();
        self
    }

    /// The topics a consumer that does not exist yet is created for (filter subjects prefix +
    /// topic). Without topics the consumer must exist.
    pub fn topics<S: Into<String>>(mut self, t: impl IntoIterator<Item = S>) -> Self {
        self.topics = t.into_iter().map(Into::into).collect();
        self
    }

    /// ack_wait of a consumer the subscription creates (≥ 100 ms; default 30 s). A bound
    /// consumer keeps its own.
    pub fn ack_wait(mut self, d: Duration) -> Self {
        self.ack_wait = d;
        self
    }

    /// The dead-letter subject prefix (default `deadletter.`, R140).
    pub fn dead_letter_prefix(mut self, p: impl Into<String>) -> Self {
        self.dead_letter_prefix = p.into();
        self
    }

    /// The runner uses `on_failure = rewind` with this max_attempts: a bound consumer whose
    /// max_deliver is below it is refused (R133).
    pub fn rewinds_with_max_attempts(mut self, max_attempts: u32) -> Self {
        self.rewind_max_attempts = Some(max_attempts);
        self
    }

    /// The bound on one JetStream API call or dead-letter publish (default 10 s).
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// The consumer name used: the configured one, else [`consumer_name_for`] the group.
    pub fn consumer_name(&self) -> String {
        self.consumer
            .clone()
            .unwrap_or_else(|| consumer_name_for(&self.group))
    }

    fn validate(&self) -> Result<(), NatsBrokerError> {
        let bad = |m: String| Err(NatsBrokerError::Config(m));
        if self.stream.trim().is_empty() {
            return bad("the subscription's stream must not be empty".into());
        }
        if self.group.trim().is_empty() {
            return bad("the subscription's consumer group must not be empty".into());
        }
        if self.ack_wait < Duration::from_millis(100) {
            return bad("ack_wait must be at least 100 ms".into());
        }
        if self.timeout.is_zero() {
            return bad("timeout must be > 0".into());
        }
        for t in &self.topics {
            let s = format!("{}{t}", self.subject_prefix);
            if let Some(p) = crate::subject::subject_problem(&s) {
                return bad(format!(
                    "topic {t:?} gives the filter subject {s:?}, which is not a subject: {p}"
                ));
            }
        }
        Ok(())
    }
}

/// The consumer name of a group: every character NATS forbids in consumer names (whitespace,
/// `.`, `*`, `>`, `/`, `\` and non-printable characters) replaced by `_` (R133).
pub fn consumer_name_for(group: &str) -> String {
    group
        .chars()
        .map(|c| {
            if c.is_whitespace() || c.is_control() || matches!(c, '.' | '*' | '>' | '/' | '\\') {
                '_'
            } else {
                c
            }
        })
        .collect()
}

struct Inner {
    client: async_nats::Client,
    js: jetstream::Context,
    consumer: PullConsumer,
    stream: String,
    /// The consumer group of the config, given to the runner (R133).
    group: String,
    /// The config's topics, given to the runner as its default sources (R121): none when
    /// there are none (a consumer bound by name) or one is a wildcard, which is no source.
    topics: Option<Vec<String>>,
    subject_prefix: String,
    dead_letter_prefix: String,
    ack_wait: Duration,
    max_deliver: Option<i64>,
    /// Whether the server takes `+TERM {reason}` (2.10.4 and later); an earlier one ignores
    /// that payload, so it gets a plain `+TERM`.
    term_with_reason: bool,
    /// Messages a pull brought after its caller stopped waiting (the runner's read is
    /// cancelled when another branch of its loop wins); handed out by the next read.
    buffer: std::sync::Mutex<std::collections::VecDeque<jetstream::Message>>,
    /// Held by a pull task for its duration; a close waits for it.
    reading: tokio::sync::Mutex<()>,
    closed: std::sync::atomic::AtomicBool,
}

/// The inbox's subscription on a NATS JetStream durable pull consumer (R133, R134). Cloning
/// shares it; several runners of one group may read one consumer, each through its own
/// subscription.
#[derive(Clone)]
pub struct NatsSubscription {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NatsSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsSubscription")
            .field("stream", &self.inner.stream)
            .field("ack_wait", &self.inner.ack_wait)
            .field("max_deliver", &self.inner.max_deliver)
            .finish_non_exhaustive()
    }
}

fn consumer_error(consumer: &str, message: impl std::fmt::Display) -> NatsBrokerError {
    NatsBrokerError::Stream {
        stream: format!("consumer {consumer}"),
        message: message.to_string(),
    }
}

impl NatsSubscription {
    /// Binds to the configured consumer, or creates it (R133), on `client`'s connection. Fails
    /// with a configuration error for a consumer this library cannot use.
    pub async fn bind(
        client: async_nats::Client,
        config: NatsSubscriptionConfig,
    ) -> Result<Self, NatsBrokerError> {
        config.validate()?;
        let js = jetstream::ContextBuilder::new()
            .timeout(config.timeout)
            .build(client.clone());
        let stream = js
            .get_stream(&config.stream)
            .await
            .map_err(|e| NatsBrokerError::Stream {
                stream: config.stream.clone(),
                message: e.to_string(),
            })?;
        let name = config.consumer_name();
        let info = match stream.consumer_info(&name).await {
            Ok(info) => Some(info),
            Err(e) if e.kind() == ConsumerInfoErrorKind::NotFound => None,
            Err(e) => return Err(consumer_error(&name, e)),
        };
        let consumer: PullConsumer = match info {
            Some(info) => {
                let c = &info.config;
                if c.ack_policy != AckPolicy::Explicit {
                    return Err(NatsBrokerError::Config(
                        "ack_policy must be explicit".into(),
                    ));
                }
                if let Some(m) = config.rewind_max_attempts
                    && c.max_deliver > 0
                    && c.max_deliver < i64::from(m)
                {
                    return Err(NatsBrokerError::Config(format!(
                        "max_deliver ({}) is below max_attempts ({m})",
                        c.max_deliver
                    )));
                }
                if info.push_bound || c.deliver_subject.is_some() {
                    return Err(NatsBrokerError::Config(format!(
                        "consumer {name} is a push consumer; the inbox reads a pull consumer"
                    )));
                }
                stream
                    .get_consumer(&name)
                    .await
                    .map_err(|e| consumer_error(&name, e))?
            }
            None => {
                if config.topics.is_empty() {
                    return Err(NatsBrokerError::Config(format!(
                        "consumer {name} does not exist on stream {}; give the topics to create it, or create it",
                        config.stream
                    )));
                }
                let mut filters: Vec<String> = config
                    .topics
                    .iter()
                    .map(|t| format!("{}{t}", config.subject_prefix))
                    .collect();
                let mut cfg = PullConfig {
                    durable_name: Some(name.clone()),
                    deliver_policy: DeliverPolicy::All,
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    max_deliver: -1,
                    ..Default::default()
                };
                if filters.len() == 1 {
                    cfg.filter_subject = filters.remove(0);
                } else {
                    cfg.filter_subjects = filters;
                }
                stream
                    .create_consumer(cfg)
                    .await
                    .map_err(|e| consumer_error(&name, e))?
            }
        };
        let c = &consumer.cached_info().config;
        let ack_wait = if c.ack_wait.is_zero() {
            DEFAULT_ACK_WAIT
        } else {
            c.ack_wait
        };
        let max_deliver = (c.max_deliver > 0).then_some(c.max_deliver);
        let term_with_reason = version_at_least(&client.server_info().version, (2, 10, 4));
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                js,
                consumer,
                stream: config.stream,
                group: config.group,
                topics: config
                    .topics
                    .iter()
                    .all(|t| !t.split('.').any(|tok| tok == "*" || tok == ">"))
                    .then_some(config.topics)
                    .filter(|t| !t.is_empty()),
                subject_prefix: config.subject_prefix,
                dead_letter_prefix: config.dead_letter_prefix,
                ack_wait,
                max_deliver,
                term_with_reason,
                buffer: std::sync::Mutex::default(),
                reading: tokio::sync::Mutex::new(()),
                closed: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// The consumer's ack_wait (renewals go every half of it).
    pub fn ack_wait(&self) -> Duration {
        self.inner.ack_wait
    }

    /// The consumer's max_deliver, when it has one.
    pub fn max_deliver(&self) -> Option<i64> {
        self.inner.max_deliver
    }

    /// The consumer's name.
    pub fn consumer_name(&self) -> &str {
        &self.inner.consumer.cached_info().name
    }

    fn delivery(&self, m: jetstream::Message) -> Result<InboxDelivery, SubscriptionError> {
        let info = m.info().map_err(|e| {
            SubscriptionError::permanent(format!(
                "NATS: a pulled message has no JetStream metadata: {e}"
            ))
        })?;
        let n = u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX);
        let sequence = info.stream_sequence;
        let stream = info.stream.to_owned();
        let last = self.inner.max_deliver.is_some_and(|d| info.delivered >= d);
        let mut headers = Vec::new();
        if let Some(h) = &m.headers {
            for (k, vs) in h.iter() {
                for v in vs {
                    headers.push((k.to_string(), v.as_str().to_owned()));
                }
            }
        }
        let message = BrokerMessage::Nats {
            stream,
            sequence,
            subject: m.subject.to_string(),
            subject_prefix: self.inner.subject_prefix.clone(),
            headers,
            body: m.payload.to_vec(),
        };
        Ok(InboxDelivery {
            message,
            delivery_number: n,
            redelivered_later: !last,
            ack: Arc::new(NatsAck {
                inner: self.inner.clone(),
                msg: m,
            }),
        })
    }
}

/// Whether a server version `a.b.c…` is at least `min`.
pub(crate) fn version_at_least(v: &str, min: (u64, u64, u64)) -> bool {
    let p: Vec<u64> = v
        .split(|c: char| !c.is_ascii_digit())
        .filter(|x| !x.is_empty())
        .take(3)
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    let at = |i: usize| p.get(i).copied().unwrap_or(0);
    (at(0), at(1), at(2)) >= min
}

fn transient(what: &str, e: impl std::fmt::Display) -> SubscriptionError {
    SubscriptionError::transient(format!("NATS: {what} failed: {e}"))
}

#[async_trait]
impl Subscription for NatsSubscription {
    fn capabilities(&self) -> SubscriptionCapabilities {
        SubscriptionCapabilities {
            name: "nats",
            rewind: true,
            last_delivery: self.inner.max_deliver.is_some(),
            renew_every: Some(self.inner.ack_wait / 2),
        }
    }

    /// The config's consumer group: the runner's (`Runner::for_subscription` takes it).
    fn group(&self) -> Option<&str> {
        Some(&self.inner.group)
    }

    /// The config's topics, unless there are none or one is a wildcard (`*`, `>`): then the
    /// runner's sources must be given (R121).
    fn topics(&self) -> Option<&[String]> {
        self.inner.topics.as_deref()
    }

    /// Pulls at most `max` messages (the runner's free slots, R134), waiting at most `wait`.
    async fn next(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<InboxDelivery>, SubscriptionError> {
        if max == 0 || self.inner.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(Vec::new());
        }
        if self.buffered() == 0 {
            // The pull runs in a task of its own, so that a read the runner gives up on (its
            // loop's select) does not drop messages the server already sent: they wait in the
            // buffer for the next read instead of coming back only after ack_wait.
            let inner = self.inner.clone();
            tokio::spawn(async move {
                let _reading = inner.reading.lock().await;
                if inner.closed.load(std::sync::atomic::Ordering::SeqCst) {
                    return Ok(());
                }
                pull(&inner, max, wait).await
            })
            .await
            .map_err(|e| transient("a pull task", e))??;
        }
        let taken: Vec<jetstream::Message> = {
            let mut b = self.inner.buffer.lock().expect("poisoned");
            let n = b.len().min(max);
            b.drain(..n).collect()
        };
        taken.into_iter().map(|m| self.delivery(m)).collect()
    }

    /// No pull after this; waits for one in flight (at most its wait), and gives the messages
    /// it brought back at once (a plain nak) rather than after ack_wait (R167).
    async fn close(&self) {
        self.inner
            .closed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        drop(self.inner.reading.lock().await);
        let left: Vec<jetstream::Message> = self
            .inner
            .buffer
            .lock()
            .expect("poisoned")
            .drain(..)
            .collect();
        for m in left {
            if let Err(e) = m.ack_with(AckKind::Nak(None)).await {
                tracing::warn!(error = %e, "giving back a pulled message at close failed");
            }
        }
    }
}

impl NatsSubscription {
    fn buffered(&self) -> usize {
        self.inner.buffer.lock().expect("poisoned").len()
    }
}

/// One pull of at most `max` messages, waiting at most `wait`, into the buffer.
async fn pull(inner: &Inner, max: usize, wait: Duration) -> Result<(), SubscriptionError> {
    let mut batch = if wait.is_zero() {
        inner
            .consumer
            .fetch()
            .max_messages(max)
            .messages()
            .await
            .map_err(|e| transient("a pull request", e))?
    } else {
        inner
            .consumer
            .batch()
            .max_messages(max)
            .expires(wait.max(Duration::from_millis(10)))
            .messages()
            .await
            .map_err(|e| transient("a pull request", e))?
    };
    let mut got = 0;
    while let Some(m) = batch.next().await {
        match m {
            Ok(m) => {
                got += 1;
                inner.buffer.lock().expect("poisoned").push_back(m);
            }
            Err(e) if got == 0 => return Err(transient("a pull", e)),
            Err(e) => {
                tracing::debug!(error = %e, "NATS pull ended early");
                break;
            }
        }
    }
    Ok(())
}

struct NatsAck {
    inner: Arc<Inner>,
    msg: jetstream::Message,
}

impl NatsAck {
    fn reply(&self) -> Result<async_nats::Subject, SubscriptionError> {
        self.msg
            .reply
            .clone()
            .ok_or_else(|| SubscriptionError::permanent("NATS: the message has no reply subject"))
    }
}

#[async_trait]
impl AckHandle for NatsAck {
    /// `+ACK`, confirmed by the server (R134).
    async fn commit(&self) -> Result<(), SubscriptionError> {
        self.msg
            .double_ack()
            .await
            .map_err(|e| transient("the confirmed ack", e))
    }

    /// `-NAK` with the delay (R134).
    async fn rewind(&self, delay: Duration) -> Result<(), SubscriptionError> {
        let d = (!delay.is_zero()).then_some(delay);
        self.msg
            .ack_with(AckKind::Nak(d))
            .await
            .map_err(|e| transient("nak", e))
    }

    /// `+TERM {reason}` to the reply subject (R134); a plain `+TERM` on a server before 2.10.4,
    /// which would ignore the longer payload and leave the message pending.
    async fn term(&self, reason: &str) -> Result<(), SubscriptionError> {
        let reply = self.reply()?;
        let payload = if self.inner.term_with_reason {
            format!("+TERM {reason}")
        } else {
            "+TERM".to_owned()
        };
        self.inner
            .client
            .publish(reply, payload.into())
            .await
            .map_err(|e| transient("term", e))?;
        self.inner
            .client
            .flush()
            .await
            .map_err(|e| transient("term (flush)", e))
    }

    /// In progress (`+WPI`, R134).
    async fn renew(&self) -> Result<(), SubscriptionError> {
        self.msg
            .ack_with(AckKind::Progress)
            .await
            .map_err(|e| transient("in-progress", e))
    }

    /// Publishes the message as received to `deadletter.` + subject with R140's headers and
    /// waits for the stream's acknowledgement.
    async fn dead_letter(&self, reason: &str, group: &str) -> Result<(), SubscriptionError> {
        let info = self
            .msg
            .info()
            .map_err(|e| SubscriptionError::permanent(format!("NATS: no metadata: {e}")))?;
        let (stream, seq) = (info.stream.to_owned(), info.stream_sequence);
        let mut h = HeaderMap::new();
        if let Some(orig) = &self.msg.headers {
            for (k, vs) in orig.iter() {
                if k.to_string().eq_ignore_ascii_case("Nats-Msg-Id") {
                    continue;
                }
                for v in vs {
                    h.append(k.clone(), v.clone());
                }
            }
        }
        let value = |s: &str| -> HeaderValue {
            // Header values cannot hold line breaks.
            s.replace(['\r', '\n'], " ")
                .parse()
                .unwrap_or_else(|_| HeaderValue::from(""))
        };
        h.insert("Inbox-Invalid-Reason", value(reason));
        h.insert("Inbox-Consumer-Group", value(group));
        h.insert("Inbox-Original-Stream", value(&stream));
        h.insert("Inbox-Original-Sequence", value(&seq.to_string()));
        h.insert("Nats-Msg-Id", value(&format!("{stream}:{seq}:{group}")));
        let subject = format!("{}{}", self.inner.dead_letter_prefix, self.msg.subject);
        let ack = self
            .inner
            .js
            .publish_with_headers(subject.clone(), h, self.msg.payload.clone())
            .await
            .map_err(|e| transient(&format!("the dead-letter publish to {subject}"), e))?;
        ack.await
            .map(|_| ())
            .map_err(|e| transient(&format!("the dead-letter copy to {subject}"), e))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn versions_and_names() {
        assert!(super::version_at_least("2.10.4", (2, 10, 4)));
        assert!(super::version_at_least("2.11.0-beta", (2, 10, 4)));
        assert!(!super::version_at_least("2.9.10", (2, 10, 4)));
        assert_eq!(super::consumer_name_for("a.b c"), "a_b_c");
        assert_eq!(super::consumer_name_for("x*>/\\\ty"), "x_____y");
    }
}
