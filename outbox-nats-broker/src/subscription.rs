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
    RunnerSettings, SubscriptionCapabilities, SubscriptionError,
};
use txoutbox_core::inbox::transport::{
    DeadLetter, Received, Transport, TransportCapabilities, TransportSubscription, transient,
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
    /// max_deliver is below it is refused at bind (R133). Optional: the runner gives its
    /// max_attempts to the subscription when it is built, and that build refuses the same
    /// consumer; this only moves the refusal earlier.
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

/// The NATS half of the inbox's subscription ([`Transport`]): a JetStream durable pull
/// consumer. Reached through [`NatsSubscription`] (which dereferences to the generic
/// subscription; its [`transport`](TransportSubscription::transport) is this).
pub struct NatsTransport {
    client: async_nats::Client,
    js: jetstream::Context,
    consumer: PullConsumer,
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
}

txoutbox_core::transport_subscription! {
    /// The inbox's subscription on a NATS JetStream durable pull consumer (R133, R134): the
    /// generic subscription over [`NatsTransport`]. Cloning shares it; several runners of one
    /// group may read one consumer, each through its own subscription.
    pub struct NatsSubscription(NatsTransport);
}

fn consumer_error(consumer: &str, message: impl std::fmt::Display) -> NatsBrokerError {
    NatsBrokerError::Stream {
        stream: format!("consumer {consumer}"),
        message: message.to_string(),
    }
}

/// The max_deliver check of R133: a bound consumer must deliver at least max_attempts times
/// when the runner rewinds.
fn max_deliver_problem(max_deliver: i64, max_attempts: u32) -> Option<String> {
    (max_deliver > 0 && max_deliver < i64::from(max_attempts))
        .then(|| format!("max_deliver ({max_deliver}) is below max_attempts ({max_attempts})"))
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
                if let Some(p) = config
                    .rewind_max_attempts
                    .and_then(|m| max_deliver_problem(c.max_deliver, m))
                {
                    return Err(NatsBrokerError::Config(p));
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
        Ok(Self(TransportSubscription::new(NatsTransport {
            client,
            js,
            consumer,
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
        })))
    }

    /// The consumer's ack_wait (renewals go every half of it).
    pub fn ack_wait(&self) -> Duration {
        self.transport().ack_wait
    }

    /// The consumer's max_deliver, when it has one.
    pub fn max_deliver(&self) -> Option<i64> {
        self.transport().max_deliver
    }

    /// The consumer's name.
    pub fn consumer_name(&self) -> &str {
        &self.transport().consumer.cached_info().name
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

fn failed(what: &str, e: impl std::fmt::Display) -> SubscriptionError {
    transient("NATS", what, e)
}

#[async_trait]
impl Transport for NatsTransport {
    type Message = jetstream::Message;

    /// Rewinds are naks with a delay: the server holds them, none waits in the process.
    fn capabilities(&self) -> TransportCapabilities {
        TransportCapabilities {
            subscription: SubscriptionCapabilities {
                name: "nats",
                rewind: true,
                last_delivery: self.max_deliver.is_some(),
                renew_every: Some(self.ack_wait / 2),
                rewind_refusal: None,
            },
            holds_rewinds: false,
            longest_hold: None,
        }
    }

    /// The config's consumer group: the runner's (`Runner::for_subscription` takes it).
    fn group(&self) -> Option<&str> {
        Some(&self.group)
    }

    /// The config's topics, unless there are none or one is a wildcard (`*`, `>`): then the
    /// runner's sources must be given (R121).
    fn topics(&self) -> Option<&[String]> {
        self.topics.as_deref()
    }

    /// A rewinding runner's max_attempts above the consumer's max_deliver is refused (R133).
    fn check_settings(&self, settings: &RunnerSettings) -> Result<(), String> {
        match (settings.rewind_max_attempts, self.max_deliver) {
            (Some(m), Some(d)) => max_deliver_problem(d, m).map_or(Ok(()), Err),
            _ => Ok(()),
        }
    }

    /// One pull of at most `max` messages, waiting at most `wait` (R134).
    async fn read(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<jetstream::Message>, SubscriptionError> {
        let mut batch = if wait.is_zero() {
            self.consumer
                .fetch()
                .max_messages(max)
                .messages()
                .await
                .map_err(|e| failed("a pull request", e))?
        } else {
            self.consumer
                .batch()
                .max_messages(max)
                .expires(wait.max(Duration::from_millis(10)))
                .messages()
                .await
                .map_err(|e| failed("a pull request", e))?
        };
        let mut out = Vec::new();
        while let Some(m) = batch.next().await {
            match m {
                Ok(m) => out.push(m),
                Err(e) if out.is_empty() => return Err(failed("a pull", e)),
                Err(e) => {
                    tracing::debug!(error = %e, "NATS pull ended early");
                    break;
                }
            }
        }
        Ok(out)
    }

    /// n is the `delivered` count of the JetStream metadata; the last delivery is n =
    /// max_deliver.
    fn received(&self, m: &jetstream::Message) -> Result<Received, SubscriptionError> {
        let info = m.info().map_err(|e| {
            SubscriptionError::permanent(format!(
                "NATS: a pulled message has no JetStream metadata: {e}"
            ))
        })?;
        let mut headers = Vec::new();
        if let Some(h) = &m.headers {
            for (k, vs) in h.iter() {
                for v in vs {
                    headers.push((k.to_string(), v.as_str().to_owned()));
                }
            }
        }
        Ok(Received {
            message: BrokerMessage::Nats {
                stream: info.stream.to_owned(),
                sequence: info.stream_sequence,
                subject: m.subject.to_string(),
                subject_prefix: self.subject_prefix.clone(),
                headers,
                body: m.payload.to_vec(),
            },
            delivery_number: u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX),
            redelivered_later: self.max_deliver.is_none_or(|d| info.delivered < d),
        })
    }

    /// `+ACK`, confirmed by the server (R134).
    async fn commit(&self, m: &jetstream::Message) -> Result<(), SubscriptionError> {
        m.double_ack()
            .await
            .map_err(|e| failed("the confirmed ack", e))
    }

    /// `-NAK` with the delay (a plain `-NAK` for none, R134).
    async fn rewind(
        &self,
        m: &jetstream::Message,
        delay: Duration,
    ) -> Result<(), SubscriptionError> {
        let d = (!delay.is_zero()).then_some(delay);
        m.ack_with(AckKind::Nak(d))
            .await
            .map_err(|e| failed("nak", e))
    }

    /// `+TERM {reason}` to the reply subject (R134); a plain `+TERM` on a server before 2.10.4,
    /// which would ignore the longer payload and leave the message pending.
    async fn term(&self, m: &jetstream::Message, reason: &str) -> Result<(), SubscriptionError> {
        let reply = m.reply.clone().ok_or_else(|| {
            SubscriptionError::permanent("NATS: the message has no reply subject")
        })?;
        let payload = if self.term_with_reason {
            format!("+TERM {reason}")
        } else {
            "+TERM".to_owned()
        };
        self.client
            .publish(reply, payload.into())
            .await
            .map_err(|e| failed("term", e))?;
        self.client
            .flush()
            .await
            .map_err(|e| failed("term (flush)", e))
    }

    /// In progress (`+WPI`, R134).
    async fn renew(&self, m: &jetstream::Message) -> Result<(), SubscriptionError> {
        m.ack_with(AckKind::Progress)
            .await
            .map_err(|e| failed("in-progress", e))
    }

    /// Publishes the message as received to `deadletter.` + subject with R140's headers and
    /// waits for the stream's acknowledgement.
    async fn dead_letter(
        &self,
        m: &jetstream::Message,
        letter: &DeadLetter<'_>,
    ) -> Result<(), SubscriptionError> {
        let info = m
            .info()
            .map_err(|e| SubscriptionError::permanent(format!("NATS: no metadata: {e}")))?;
        let (stream, seq) = (info.stream.to_owned(), info.stream_sequence);
        let mut h = HeaderMap::new();
        if let Some(orig) = &m.headers {
            for (k, vs) in orig.iter() {
                if k.to_string().eq_ignore_ascii_case("Nats-Msg-Id") {
                    continue;
                }
                for v in vs {
                    h.append(k.clone(), v.clone());
                }
            }
        }
        let value =
            |s: &str| -> HeaderValue { s.parse().unwrap_or_else(|_| HeaderValue::from("")) };
        let added = letter.headers(&[("Stream", stream.clone()), ("Sequence", seq.to_string())]);
        for (k, v) in &added {
            h.insert(k.as_str(), value(v));
        }
        h.insert(
            "Nats-Msg-Id",
            value(&format!("{stream}:{seq}:{}", letter.group)),
        );
        let subject = format!("{}{}", self.dead_letter_prefix, m.subject);
        let ack = self
            .js
            .publish_with_headers(subject.clone(), h, m.payload.clone())
            .await
            .map_err(|e| failed(&format!("the dead-letter publish to {subject}"), e))?;
        ack.await
            .map(|_| ())
            .map_err(|e| failed(&format!("the dead-letter copy to {subject}"), e))
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
