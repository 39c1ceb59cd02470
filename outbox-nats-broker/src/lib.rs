#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod cloudevents;
mod config;
mod error;
mod subject;
mod subscription;

use std::sync::Arc;
use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::{GetStreamByNameErrorKind, PublishErrorKind};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::{self, ErrorCode};
use async_nats::{HeaderMap, HeaderName, HeaderValue};
use async_trait::async_trait;
use tokio::sync::Notify;
use tokio::time::Instant;
use txoutbox_core::broker::{ReconnectSignal, ReconnectWatch};
use txoutbox_core::{Ack, Broker, BrokerError, Message};

/// The async-nats this crate is built with: name its types as `txoutbox_nats_broker::async_nats::…`
/// (a client to read the stream back, a header map), whatever async-nats you depend on.
pub use async_nats;
pub use cloudevents::{CLOUDEVENTS_HEADER_PREFIX, percent_encode};
pub use config::{
    BodyFormat, DEFAULT_CONNECT_TIMEOUT, DEFAULT_RECONNECT_DELAY_MAX, DEFAULT_TIMEOUT, KeyToken,
    NatsBrokerConfig, NatsTls, StreamSpec, StreamStorage,
};
pub use error::NatsBrokerError;
pub use subscription::{
    DEFAULT_ACK_WAIT, DEFAULT_DEAD_LETTER_PREFIX, NatsSubscription, NatsSubscriptionConfig,
    NatsTransport, consumer_name_for,
};
pub use txoutbox_core::cloudevents::MessageFormat;

/// A [`Broker`] publishing to NATS JetStream and waiting for the acknowledgement.
///
/// Cloning shares the connection.
#[derive(Clone)]
pub struct NatsBroker {
    client: async_nats::Client,
    js: jetstream::Context,
    config: Arc<NatsBrokerConfig>,
    state_changed: Arc<Notify>,
    reconnected: ReconnectSignal,
}

impl std::fmt::Debug for NatsBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBroker")
            .field("url", &txoutbox_core::redact::secrets(&self.config.url))
            .field("subject_prefix", &self.config.subject_prefix)
            .field("state", &self.client.connection_state())
            .finish_non_exhaustive()
    }
}

impl NatsBroker {
    /// Connects (failing when the server cannot be reached within the connect timeout) and,
    /// when the configuration says so, creates the stream if it does not exist; then checks
    /// that a stream covers the adapter's subjects ([`check_streams`](Self::check_streams);
    /// [`NatsBrokerError::NoStream`] when none does). After this first connection the client
    /// reconnects by itself whenever the connection is lost.
    pub async fn connect(config: NatsBrokerConfig) -> Result<Self, NatsBrokerError> {
        config.validate()?;
        let notify = Arc::new(Notify::new());
        let signal = ReconnectSignal::new();
        let client = options(&config, &notify, &signal)
            .await?
            .connect(config.url.as_str())
            .await
            .map_err(|e| NatsBrokerError::Connect {
                url: txoutbox_core::redact::secrets(&config.url),
                message: txoutbox_core::redact::secrets(&e.to_string()),
            })?;
        let broker = Self::assemble(client, config, notify, signal);
        broker.ensure_stream().await?;
        if broker.config.check_streams {
            broker.check_streams().await?;
        }
        Ok(broker)
    }

    /// Returns at once and connects in the background, retrying until the server is there;
    /// publishes fail transiently until then. Use it when the relay may start before NATS.
    /// [`NatsBrokerConfig::ensure_stream`] is not allowed here (call
    /// [`ensure_stream`](Self::ensure_stream) once connected), and the streams are not
    /// checked: call [`check_streams`](Self::check_streams) once connected.
    pub async fn connect_lazy(config: NatsBrokerConfig) -> Result<Self, NatsBrokerError> {
        config.validate()?;
        if config.ensure_stream.is_some() {
            return Err(NatsBrokerError::Config(
                "ensure_stream needs a connection at start-up: use NatsBroker::connect, or call ensure_stream() after wait_connected()".into(),
            ));
        }
        let notify = Arc::new(Notify::new());
        let signal = ReconnectSignal::new();
        let client = options(&config, &notify, &signal)
            .await?
            .retry_on_initial_connect()
            .connect(config.url.as_str())
            .await
            .map_err(|e| NatsBrokerError::Connect {
                url: txoutbox_core::redact::secrets(&config.url),
                message: txoutbox_core::redact::secrets(&e.to_string()),
            })?;
        Ok(Self::assemble(client, config, notify, signal))
    }

    /// Uses a client the application already has. [`wait_connected`](Self::wait_connected)
    /// is only exact for clients made by this crate; here it re-checks the state every 50 ms.
    pub async fn from_client(
        client: async_nats::Client,
        config: NatsBrokerConfig,
    ) -> Result<Self, NatsBrokerError> {
        config.validate()?;
        let broker = Self::assemble(
            client,
            config,
            Arc::new(Notify::new()),
            ReconnectSignal::new(),
        );
        broker.ensure_stream().await?;
        if broker.config.check_streams {
            broker.check_streams().await?;
        }
        Ok(broker)
    }

    fn assemble(
        client: async_nats::Client,
        config: NatsBrokerConfig,
        notify: Arc<Notify>,
        reconnected: ReconnectSignal,
    ) -> Self {
        let js = jetstream::ContextBuilder::new()
            .timeout(config.timeout)
            .backpressure_on_inflight(true)
            .build(client.clone());
        Self {
            client,
            js,
            config: Arc::new(config),
            state_changed: notify,
            reconnected,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &NatsBrokerConfig {
        &self.config
    }

    /// The underlying client.
    pub fn client(&self) -> &async_nats::Client {
        &self.client
    }

    /// The JetStream context the adapter publishes with.
    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Whether the client is connected right now.
    pub fn is_connected(&self) -> bool {
        self.client.connection_state() == State::Connected
    }

    /// Waits until the client is connected, at most `within`; returns whether it is.
    pub async fn wait_connected(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        loop {
            let notified = self.state_changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_connected() {
                return true;
            }
            let step = deadline.min(Instant::now() + Duration::from_millis(50));
            if Instant::now() >= deadline {
                return false;
            }
            let _ = tokio::time::timeout_at(step, notified).await;
        }
    }

    /// Creates the configured stream when it does not exist (a no-op without one).
    pub async fn ensure_stream(&self) -> Result<(), NatsBrokerError> {
        let Some(spec) = &self.config.ensure_stream else {
            return Ok(());
        };
        let mut cfg = jetstream::stream::Config {
            name: spec.name.clone(),
            subjects: self.config.stream_subjects(spec),
            storage: match spec.storage {
                StreamStorage::File => jetstream::stream::StorageType::File,
                StreamStorage::Memory => jetstream::stream::StorageType::Memory,
            },
            ..Default::default()
        };
        if let Some(n) = spec.max_message_size {
            cfg.max_message_size = n;
        }
        if let Some(d) = spec.duplicate_window {
            cfg.duplicate_window = d;
        }
        if let Some(d) = spec.max_age {
            cfg.max_age = d;
        }
        self.js
            .get_or_create_stream(cfg)
            .await
            .map(|_| ())
            .map_err(|e| NatsBrokerError::Stream {
                stream: spec.name.clone(),
                message: e.to_string(),
            })
    }

    /// Checks that this configuration can publish at all: at least one JetStream stream covers
    /// the adapter's subjects ([`NatsBrokerConfig::subject_space`]: the prefix followed by
    /// `>`). Without one every publish is refused with "no JetStream stream covers subject…"
    /// and the rows wait for their retries; this says so when the relay starts. A stream that
    /// covers only some topics passes (the rows of the others are refused one by one, each
    /// naming its subject). A prefix that does not end in `.` names no subject space, and is
    /// not checked. [`connect`](Self::connect) and [`from_client`](Self::from_client) call it
    /// unless [`NatsBrokerConfig::check_streams`] is off.
    pub async fn check_streams(&self) -> Result<(), NatsBrokerError> {
        let Some(subjects) = self.config.subject_space() else {
            return Ok(());
        };
        let lookup = self.js.stream_by_subject(subjects.clone());
        match tokio::time::timeout(self.config.timeout, lookup).await {
            Ok(Ok(_stream)) => Ok(()),
            Ok(Err(e)) if e.kind() == GetStreamByNameErrorKind::NotFound => {
                Err(NatsBrokerError::NoStream { subjects })
            }
            Ok(Err(e)) => Err(NatsBrokerError::StreamCheck {
                subjects,
                message: e.to_string(),
            }),
            Err(_) => Err(NatsBrokerError::StreamCheck {
                subjects,
                message: format!("no answer within {:?}", self.config.timeout),
            }),
        }
    }

    /// The subject of a message, or why it has none (a rejection).
    pub fn subject(&self, m: &Message) -> Result<String, BrokerError> {
        let base = self.config.subject_for_topic(&m.topic);
        if let Some(p) = subject::subject_problem(&base) {
            return Err(BrokerError::rejected(format!(
                "NATS: topic {:?} gives subject {base:?}, which cannot be published to: {p}; use topics made of dot-separated tokens without spaces or wildcards",
                m.topic
            )));
        }
        match self.config.key_token {
            KeyToken::Off => Ok(base),
            KeyToken::Sanitized => Ok(format!(
                "{base}.{}",
                subject::sanitize_token(&m.partition_key)
            )),
            KeyToken::Validated => match subject::token_problem(&m.partition_key) {
                None => Ok(format!("{base}.{}", m.partition_key)),
                Some(p) => Err(BrokerError::rejected(format!(
                    "NATS: partition key {:?} cannot be a subject token: {p}; use KeyToken::Sanitized or keys without '.', '*', '>' and spaces",
                    m.partition_key
                ))),
            },
        }
    }

    /// The headers of a message: every attribute of R50 plus `Nats-Msg-Id` = event id. The
    /// stored W3C trace context is among them as the header `traceparent`
    /// ([`Message::traceparent`]), so a consumer continues the producer's trace. With
    /// [`MessageFormat::CloudEvents`] also the `ce-` attribute headers of R91.
    pub fn headers(&self, m: &Message) -> Result<HeaderMap, BrokerError> {
        let mut h = HeaderMap::new();
        for (k, v) in &m.attributes {
            if k.len() >= 5 && k[..5].eq_ignore_ascii_case("nats-") {
                return Err(BrokerError::rejected(format!(
                    "NATS: header {k:?} uses the reserved prefix \"Nats-\", which would change how JetStream stores the message; rename the header"
                )));
            }
            let name: HeaderName = k.parse().map_err(|_| {
                BrokerError::rejected(format!(
                    "NATS: header name {k:?} is not allowed (only printable ASCII without ':' or spaces); rename the header"
                ))
            })?;
            let value: HeaderValue = v.parse().map_err(|_| {
                BrokerError::rejected(format!(
                    "NATS: the value of header {k:?} holds a line break"
                ))
            })?;
            h.insert(name, value);
        }
        if self.config.message_format == MessageFormat::CloudEvents {
            let source = self
                .config
                .cloudevents_source
                .as_deref()
                .unwrap_or_default();
            cloudevents::add_headers(&mut h, m, source);
        }
        Ok(h)
    }

    /// The body of a message.
    pub fn body(&self, m: &Message) -> Vec<u8> {
        match self.config.body {
            BodyFormat::Payload => m.body.clone(),
            BodyFormat::Envelope => serde_json::to_vec(&serde_json::json!({
                "event_id": m.event_id.hyphenated().to_string(),
                "event_type": m.event_type,
                "topic": m.topic,
                "partition_key": m.partition_key,
                "attributes": m.attributes,
                "payload": m.payload(),
            }))
            .expect("a JSON value always serializes"),
        }
    }

    async fn diagnose_no_responders(&self, subject: &str, deadline: Instant) -> BrokerError {
        match tokio::time::timeout_at(deadline, self.js.stream_by_subject(subject)).await {
            Ok(Err(e)) if e.kind() == GetStreamByNameErrorKind::NotFound => {
                BrokerError::rejected(format!(
                    "NATS: no JetStream stream covers subject {subject:?}; create a stream whose subjects include it (or configure ensure_stream)"
                ))
            }
            Ok(Ok(stream)) => BrokerError::transient(format!(
                "NATS: no responders for subject {subject:?} although stream {stream:?} covers it; JetStream may be restarting"
            )),
            Ok(Err(e)) => BrokerError::transient(format!(
                "NATS: no responders for subject {subject:?}, and the JetStream API did not answer ({e}); is JetStream enabled and up?"
            )),
            Err(_) => BrokerError::transient(format!(
                "NATS: no responders for subject {subject:?}, and the JetStream API did not answer within the timeout"
            )),
        }
    }

    async fn map_error(
        &self,
        e: async_nats::jetstream::context::PublishError,
        subject: &str,
        deadline: Instant,
    ) -> BrokerError {
        use std::error::Error as _;
        match e.kind() {
            PublishErrorKind::StreamNotFound => {
                self.diagnose_no_responders(subject, deadline).await
            }
            PublishErrorKind::TimedOut => BrokerError::transient(format!(
                "NATS: no JetStream acknowledgement for subject {subject:?} within {:?}",
                self.config.timeout
            )),
            PublishErrorKind::BrokenPipe => BrokerError::transient(format!(
                "NATS: the connection was lost before the acknowledgement for subject {subject:?} arrived"
            )),
            PublishErrorKind::MaxAckPending => BrokerError::transient(
                "NATS: too many publishes are waiting for acknowledgements; try again".to_string(),
            ),
            PublishErrorKind::MaxPayloadExceeded => BrokerError::rejected(format!(
                "NATS: message for subject {subject:?} is larger than the server's max_payload: {e}"
            )),
            PublishErrorKind::WrongLastMessageId | PublishErrorKind::WrongLastSequence => {
                BrokerError::rejected(format!(
                    "NATS JetStream refused the message on {subject:?}: {e}"
                ))
            }
            _ => {
                let api = e
                    .source()
                    .and_then(|s| s.downcast_ref::<jetstream::Error>());
                match api {
                    Some(api) if is_temporary(api) => BrokerError::transient(format!(
                        "NATS JetStream is temporarily unavailable for subject {subject:?}: {api}"
                    )),
                    Some(api) => BrokerError::rejected(format!(
                        "NATS JetStream refused the message on subject {subject:?}: {api}"
                    )),
                    None => {
                        BrokerError::transient(format!("NATS: publish to {subject:?} failed: {e}"))
                    }
                }
            }
        }
    }
}

/// JetStream API errors that say "not now" rather than "not this message".
fn is_temporary(e: &jetstream::Error) -> bool {
    e.code() == 503
        || [
            ErrorCode::CLUSTER_NOT_AVAILABLE,
            ErrorCode::CLUSTER_NOT_ACTIVE,
            ErrorCode::CLUSTER_NOT_LEADER,
            ErrorCode::CLUSTER_NO_PEERS,
            ErrorCode::CLUSTER_INCOMPLETE,
            ErrorCode::RAFT_GENERAL,
            ErrorCode::JETSTREAM_NOT_ENABLED,
            ErrorCode::JETSTREAM_NOT_ENABLED_FOR_ACCOUNT,
        ]
        .contains(&e.error_code())
}

async fn options(
    config: &NatsBrokerConfig,
    notify: &Arc<Notify>,
    signal: &ReconnectSignal,
) -> Result<async_nats::ConnectOptions, NatsBrokerError> {
    let n = notify.clone();
    let signal = signal.clone();
    let max = config.reconnect_delay_max;
    let mut o = async_nats::ConnectOptions::new()
        .connection_timeout(config.connect_timeout)
        .max_reconnects(None)
        .reconnect_delay_callback(move |attempts| {
            // 0, 100 ms, 200 ms, 400 ms, ... up to the configured maximum.
            if attempts <= 1 {
                Duration::ZERO
            } else {
                let exp = (attempts - 2).min(16) as u32;
                Duration::from_millis(100u64.saturating_mul(1 << exp)).min(max)
            }
        })
        .event_callback(move |event| {
            let n = n.clone();
            let signal = signal.clone();
            async move {
                match event {
                    async_nats::Event::Connected => {
                        tracing::info!("NATS connected");
                        signal.connected();
                    }
                    async_nats::Event::Disconnected => tracing::warn!("NATS disconnected"),
                    other => tracing::debug!("NATS event: {other}"),
                }
                n.notify_waiters();
            }
        });
    if let Some(name) = &config.client_name {
        o = o.name(name);
    }
    if let Some(path) = &config.credentials_file {
        o = o.credentials_file(path).await.map_err(|e| {
            NatsBrokerError::Config(format!(
                "could not load the NATS credentials file {}: {e}; give the .creds file `nsc` wrote (a user JWT and its seed)",
                path.display()
            ))
        })?;
    }
    let tls = &config.tls;
    if tls.required {
        o = o.require_tls(true);
    }
    if let Some(roots) = &tls.root_certificates {
        o = o.add_root_certificates(roots.clone());
    }
    if let Some((cert, key)) = &tls.client_certificate {
        o = o.add_client_certificate(cert.clone(), key.clone());
    }
    Ok(o)
}

#[async_trait]
impl Broker for NatsBroker {
    fn messaging_system(&self) -> &'static str {
        "nats"
    }

    /// The subject (the topic when the partition key cannot be a subject token).
    fn destination_name(&self, m: &Message) -> String {
        self.subject(m)
            .unwrap_or_else(|_| self.config.subject_for_topic(&m.topic))
    }

    /// Moves on every `Connected` event of the client (clients made by this crate; a client
    /// given to [`from_client`](NatsBroker::from_client) reports none).
    fn reconnects(&self) -> Option<ReconnectWatch> {
        Some(self.reconnected.watch())
    }

    /// One JetStream round trip within the adapter's timeout: the account's JetStream info
    /// (`$JS.API.INFO`), asked only while the client is connected. It answers only when the
    /// server and JetStream do, so a black-holed connection (accepted, silent, never dropped)
    /// probes `Down` until bytes flow again, when the relay loop starts its next cycle at once.
    async fn probe(&self) -> txoutbox_core::broker::Probe {
        use txoutbox_core::broker::Probe;
        if self.client.connection_state() != State::Connected {
            return Probe::Down;
        }
        // A raw request to the JetStream API's account info: any reply is an answer (the
        // typed `query_account` may not parse every server version's reply).
        let empty = serde_json::Map::new();
        let info = self.js.request::<_, _, serde_json::Value>("INFO", &empty);
        match tokio::time::timeout(self.config.timeout, info).await {
            Ok(Ok(reply)) if reply.get("error").is_none() => Probe::Up,
            Ok(Ok(reply)) => {
                tracing::debug!(error = %reply["error"], "NATS probe: JetStream answered with an error");
                Probe::Down
            }
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "NATS probe: JetStream did not answer");
                Probe::Down
            }
            Err(_) => Probe::Down,
        }
    }

    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let subject = self.subject(m)?;
        let headers = self.headers(m)?;
        let body = self.body(m);
        let state = self.client.connection_state();
        if state != State::Connected {
            return Err(BrokerError::transient(format!(
                "NATS: not connected to {} (connection {state}); the message for {subject:?} was not sent",
                txoutbox_core::redact::secrets(&self.config.url)
            )));
        }
        let deadline = Instant::now() + self.config.timeout;
        let publish = PublishMessage::build()
            .payload(body.into())
            .headers(headers)
            .message_id(m.event_id.hyphenated().to_string());
        let sent = tokio::time::timeout_at(deadline, async {
            self.js.send_publish(subject.clone(), publish).await?.await
        })
        .await;
        match sent {
            Ok(Ok(ack)) => {
                if ack.duplicate {
                    tracing::debug!(event_id = %m.event_id, stream = %ack.stream, "JetStream dropped a duplicate");
                }
                Ok(Ack {
                    duplicate: ack.duplicate,
                })
            }
            Ok(Err(e)) => Err(self.map_error(e, &subject, deadline).await),
            Err(_) => Err(BrokerError::transient(format!(
                "NATS: no JetStream acknowledgement for subject {subject:?} within {:?}",
                self.config.timeout
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_connect_error_never_shows_the_password_of_the_url() {
        let cfg = NatsBrokerConfig::new("nats://app:s3cret-pw@127.0.0.1:1")
            .connect_timeout(Duration::from_secs(2));
        let e = NatsBroker::connect(cfg).await.unwrap_err().to_string();
        assert!(e.contains("127.0.0.1:1"), "{e}");
        assert!(!e.contains("s3cret-pw"), "{e}");
    }

    #[tokio::test]
    async fn a_credentials_file_that_is_no_credentials_file_is_a_configuration_error() {
        let path = std::env::temp_dir().join(format!("outbox-bad-{}.creds", std::process::id()));
        std::fs::write(&path, "not a credentials file").unwrap();
        let cfg = NatsBrokerConfig::new("nats://127.0.0.1:4222").credentials_file(&path);
        let e = NatsBroker::connect(cfg).await.unwrap_err();
        std::fs::remove_file(&path).ok();
        assert!(matches!(e, NatsBrokerError::Config(_)), "{e}");
        assert!(e.to_string().contains("credentials file"), "{e}");
    }
}
