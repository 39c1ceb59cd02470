#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod subscription;

pub use subscription::{
    DEFAULT_CLAIM_IDLE, DEFAULT_DEAD_LETTER_SUFFIX, RedisEntry, RedisSubscription,
    RedisSubscriptionConfig, RedisTransport,
};

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use txoutbox_core::{Ack, Broker, BrokerError, Message};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, ServerErrorKind};
use thiserror::Error;
pub use txoutbox_core::cloudevents::MessageFormat;

/// The redis client this crate is built with: name its types as `txoutbox_redis_broker::redis::…`,
/// whatever redis you depend on.
pub use redis;

/// Default adapter timeout: the longest one XADD may take, reconnecting included.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default key pattern.
pub const DEFAULT_KEY_PATTERN: &str = "outbox:{topic}";

/// The fields that carry a standard attribute of R50 (the rest of the attributes are the
/// user's headers and go into the `headers` field).
pub const ATTRIBUTE_FIELDS: [&str; 11] = [
    "event_id",
    "event_type",
    "topic",
    "partition_key",
    "aggregate_type",
    "aggregate_id",
    "created_at",
    "schema_version",
    "trace_id",
    "correlation_id",
    "causation_id",
];

/// The field that carries the W3C trace context the event was written with
/// (`txoutbox_core::trace`); it is not repeated in the `headers` field.
pub const TRACEPARENT_FIELD: &str = txoutbox_core::trace::TRACEPARENT;

/// A Redis broker could not be configured or started.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RedisBrokerError {
    /// A setting is out of range or malformed; the message names the setting and the fix.
    #[error("invalid Redis broker configuration: {0}")]
    Config(String),
    /// The URL could not be parsed, or the first connection failed.
    #[error(
        "could not connect to Redis at {url}: {message}; check the URL and that redis-server is running"
    )]
    Connect {
        /// The URL given.
        url: String,
        /// What the client said.
        message: String,
    },
}

/// Settings of [`RedisBroker`]. Its `Debug` output shows the URL with the password replaced by
/// `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisBrokerConfig {
    url: String,
    key_pattern: String,
    max_len: Option<u64>,
    timeout: Duration,
    connect_timeout: Duration,
    message_format: MessageFormat,
}

impl std::fmt::Debug for RedisBrokerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBrokerConfig")
            .field("url", &txoutbox_core::redact::secrets(&self.url))
            .field("key_pattern", &self.key_pattern)
            .field("max_len", &self.max_len)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("message_format", &self.message_format)
            .finish()
    }
}

impl RedisBrokerConfig {
    /// Settings for the server at `url` (e.g. `redis://127.0.0.1:6379`), key pattern
    /// `outbox:{topic}`, no MAXLEN, a 10 s timeout.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            key_pattern: DEFAULT_KEY_PATTERN.into(),
            max_len: None,
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            message_format: MessageFormat::Plain,
        }
    }

    /// Only `plain` (the default) is accepted: Redis Streams has no CloudEvents binding, so
    /// [`validate`](Self::validate) (and every constructor) fails on `cloudevents` with
    /// `message_format cloudevents has no Redis Streams binding` (R91, scenario K-18).
    pub fn message_format(mut self, f: MessageFormat) -> Self {
        self.message_format = f;
        self
    }

    /// The stream key: the pattern with `{topic}` (required) and `{partition_key}` (optional)
    /// replaced. Any other text, braces included (a cluster hash tag such as `{outbox}`), is
    /// kept as it is. With `{partition_key}` every key gets its own stream.
    pub fn key_pattern(mut self, pattern: impl Into<String>) -> Self {
        self.key_pattern = pattern.into();
        self
    }

    /// Stream key = `prefix` + topic (the pattern `prefix{topic}`).
    pub fn key_prefix(mut self, prefix: impl AsRef<str>) -> Self {
        self.key_pattern = format!("{}{{topic}}", prefix.as_ref());
        self
    }

    /// Trims each stream to about `n` entries on every XADD (`MAXLEN ~ n`; ≥ 1). Trimmed
    /// entries are gone for consumers that had not read them yet.
    pub fn max_len(mut self, n: u64) -> Self {
        self.max_len = Some(n);
        self
    }

    /// The adapter's own bound on one publish, reconnecting included (> 0). Keep it below the
    /// relay's publish timeout.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = d;
        self
    }

    /// How long one connection attempt may take (> 0).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// The URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The stream key of a topic and partition key.
    pub fn stream_key(&self, topic: &str, partition_key: &str) -> String {
        self.key_pattern
            .replace("{topic}", topic)
            .replace("{partition_key}", partition_key)
    }

    /// Checks every setting.
    pub fn validate(&self) -> Result<(), RedisBrokerError> {
        let bad = |m: String| Err(RedisBrokerError::Config(m));
        if self.url.trim().is_empty() {
            return bad("url must not be empty; give e.g. redis://127.0.0.1:6379".into());
        }
        if !self.key_pattern.contains("{topic}") {
            return bad(format!(
                "key_pattern {:?} must contain {{topic}}, or every topic would share one stream",
                self.key_pattern
            ));
        }
        if self.max_len == Some(0) {
            return bad("max_len must be >= 1 (or not set)".into());
        }
        if self.timeout.is_zero() {
            return bad("timeout must be > 0".into());
        }
        if self.connect_timeout.is_zero() {
            return bad("connect_timeout must be > 0".into());
        }
        if self.message_format == MessageFormat::CloudEvents {
            return bad(
                "message_format cloudevents has no Redis Streams binding; use plain (the default)"
                    .into(),
            );
        }
        Ok(())
    }
}

/// A [`Broker`] appending each message to a Redis stream with XADD.
///
/// Cloning shares the connection.
#[derive(Clone)]
pub struct RedisBroker {
    conn: ConnectionManager,
    config: RedisBrokerConfig,
}

impl std::fmt::Debug for RedisBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBroker")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RedisBroker {
    /// Connects (failing when the server cannot be reached within the connect timeout). After
    /// that the connection manager reconnects by itself whenever the connection is lost.
    pub async fn connect(config: RedisBrokerConfig) -> Result<Self, RedisBrokerError> {
        config.validate()?;
        let client = client(&config)?;
        let conn = tokio::time::timeout(
            config.connect_timeout,
            ConnectionManager::new_with_config(client, manager_config(&config)),
        )
        .await
        .map_err(|_| RedisBrokerError::Connect {
            url: txoutbox_core::redact::secrets(&config.url),
            message: format!("no connection within {:?}", config.connect_timeout),
        })?
        .map_err(|e| RedisBrokerError::Connect {
            url: txoutbox_core::redact::secrets(&config.url),
            message: txoutbox_core::redact::secrets(&e.to_string()),
        })?;
        Ok(Self { conn, config })
    }

    /// Returns at once; the first publish connects. Publishes fail transiently while Redis
    /// cannot be reached. Use it when the relay may start before Redis.
    pub fn connect_lazy(config: RedisBrokerConfig) -> Result<Self, RedisBrokerError> {
        config.validate()?;
        let client = client(&config)?;
        let conn = ConnectionManager::new_lazy_with_config(client, manager_config(&config))
            .map_err(|e| RedisBrokerError::Connect {
                url: txoutbox_core::redact::secrets(&config.url),
                message: txoutbox_core::redact::secrets(&e.to_string()),
            })?;
        Ok(Self { conn, config })
    }

    /// The configuration.
    pub fn config(&self) -> &RedisBrokerConfig {
        &self.config
    }

    /// A handle on the connection the adapter uses (it reconnects by itself).
    pub fn connection(&self) -> ConnectionManager {
        self.conn.clone()
    }

    /// Sends PING within the timeout; the error is mapped as a publish error would be.
    pub async fn ping(&self) -> Result<(), BrokerError> {
        let mut conn = self.conn.clone();
        let key = "PING";
        match tokio::time::timeout(
            self.config.timeout,
            redis::cmd("PING").query_async::<String>(&mut conn),
        )
        .await
        {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(map_error(&e, key)),
            Err(_) => Err(BrokerError::transient(format!(
                "Redis: no answer to PING within {:?}",
                self.config.timeout
            ))),
        }
    }

    /// The stream key of a message.
    pub fn stream_key(&self, m: &Message) -> String {
        self.config.stream_key(&m.topic, &m.partition_key)
    }

    /// The fields XADD writes for a message, in order: `event_id`, `event_type`, `topic`,
    /// `partition_key`, `payload`, `headers` (only when the event has headers of its own, the
    /// trace context apart), then `aggregate_type`, `aggregate_id`, `created_at` and those of
    /// `schema_version`, `trace_id`, `correlation_id`, `causation_id` that are set, then
    /// `traceparent` when the event was written with a W3C trace context (a field of its own,
    /// so a consumer continues the producer's trace without parsing `headers`).
    pub fn fields(m: &Message) -> Vec<(&'static str, String)> {
        let payload = String::from_utf8_lossy(&m.body).into_owned();
        let mut out = vec![
            ("event_id", m.event_id.hyphenated().to_string()),
            ("event_type", m.event_type.clone()),
            ("topic", m.topic.clone()),
            ("partition_key", m.partition_key.clone()),
            ("payload", payload),
        ];
        let headers: BTreeMap<&str, &str> = m
            .attributes
            .iter()
            .filter(|(k, _)| {
                !ATTRIBUTE_FIELDS.contains(&k.as_str()) && k.as_str() != TRACEPARENT_FIELD
            })
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        if !headers.is_empty() {
            out.push((
                "headers",
                serde_json::to_string(&headers).expect("a map of strings always serializes"),
            ));
        }
        for name in &ATTRIBUTE_FIELDS[4..] {
            if let Some(v) = m.attributes.get(*name) {
                out.push((name, v.clone()));
            }
        }
        if let Some(tp) = m.traceparent() {
            out.push((TRACEPARENT_FIELD, tp.to_owned()));
        }
        out
    }
}

fn client(config: &RedisBrokerConfig) -> Result<redis::Client, RedisBrokerError> {
    redis::Client::open(config.url.as_str()).map_err(|e| RedisBrokerError::Connect {
        url: txoutbox_core::redact::secrets(&config.url),
        message: txoutbox_core::redact::secrets(&e.to_string()),
    })
}

fn manager_config(config: &RedisBrokerConfig) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(config.connect_timeout))
        .set_response_timeout(Some(config.timeout))
        .set_number_of_retries(1)
        .set_max_delay(Duration::from_millis(500))
}

/// Maps a Redis error of an XADD to `key` (see the crate docs for the table).
pub fn map_error(e: &RedisError, key: &str) -> BrokerError {
    if e.is_timeout() {
        return BrokerError::transient(format!("Redis: no reply to XADD {key} in time: {e}"));
    }
    if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
        return BrokerError::transient(format!("Redis unreachable (XADD {key}): {e}"));
    }
    let code = e.code().unwrap_or("");
    match e.kind() {
        ErrorKind::Server(
            ServerErrorKind::BusyLoading
            | ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::ReadOnly,
        )
        | ErrorKind::ClusterConnectionNotFound
        | ErrorKind::AuthenticationFailed
        | ErrorKind::InvalidClientConfig
        | ErrorKind::Client
        | ErrorKind::Parse
        | ErrorKind::UnexpectedReturnType => {
            BrokerError::transient(format!("Redis could not take XADD {key} now: {e}"))
        }
        _ if matches!(
            code,
            "OOM" | "BUSY" | "NOAUTH" | "WRONGPASS" | "LOADING" | "MISCONF"
        ) =>
        {
            BrokerError::transient(format!("Redis could not take XADD {key} now: {e}"))
        }
        _ => BrokerError::rejected(format!("Redis refused XADD {key}: {e}")),
    }
}

#[async_trait]
impl Broker for RedisBroker {
    fn messaging_system(&self) -> &'static str {
        "redis"
    }

    /// The stream key.
    fn destination_name(&self, m: &Message) -> String {
        self.stream_key(m)
    }

    /// PING within the timeout (the connection manager has no reconnection events, so a relay
    /// waiting out an outage probes).
    async fn probe(&self) -> txoutbox_core::broker::Probe {
        match self.ping().await {
            Ok(()) => txoutbox_core::broker::Probe::Up,
            Err(_) => txoutbox_core::broker::Probe::Down,
        }
    }

    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let key = self.stream_key(m);
        let mut cmd = redis::cmd("XADD");
        cmd.arg(&key);
        if let Some(n) = self.config.max_len {
            cmd.arg("MAXLEN").arg("~").arg(n);
        }
        cmd.arg("*");
        for (name, value) in Self::fields(m) {
            cmd.arg(name).arg(value);
        }
        let mut conn = self.conn.clone();
        match tokio::time::timeout(self.config.timeout, cmd.query_async::<String>(&mut conn)).await
        {
            Ok(Ok(_entry_id)) => Ok(Ack::default()),
            Ok(Err(e)) => Err(map_error(&e, &key)),
            Err(_) => Err(BrokerError::transient(format!(
                "Redis: no reply to XADD {key} within {:?}",
                self.config.timeout
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_password_of_the_url_reaches_no_error_and_no_debug_output() {
        let cfg = RedisBrokerConfig::new("redis://app:s3cret-pw@127.0.0.1:1/0")
            .connect_timeout(Duration::from_secs(2));
        let debug = format!("{cfg:?}");
        assert!(
            !debug.contains("s3cret-pw") && debug.contains("app:***@"),
            "{debug}"
        );
        let e = RedisBroker::connect(cfg).await.unwrap_err().to_string();
        assert!(e.contains("127.0.0.1:1"), "{e}");
        assert!(!e.contains("s3cret-pw"), "{e}");
    }

    #[cfg(feature = "tls")]
    #[tokio::test]
    async fn a_rediss_url_is_accepted_with_the_tls_feature() {
        // Lazy: nothing connects; without rustls the client refuses the scheme at once.
        let b = RedisBroker::connect_lazy(RedisBrokerConfig::new("rediss://127.0.0.1:6380"));
        assert!(b.is_ok(), "{:?}", b.err());
    }

    /// K-18, Redis case: Redis Streams has no CloudEvents binding, so an adapter with
    /// message_format `cloudevents` is not built (by any constructor); `plain` is the default.
    #[tokio::test]
    async fn k_18_cloudevents_has_no_redis_streams_binding() {
        let url = std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into());
        let ce = RedisBrokerConfig::new(&url).message_format(MessageFormat::CloudEvents);
        let text = "message_format cloudevents has no Redis Streams binding";
        let e = ce.validate().unwrap_err().to_string();
        assert!(e.contains(text), "{e}");
        let e = RedisBroker::connect(ce.clone()).await.unwrap_err();
        assert!(
            matches!(&e, RedisBrokerError::Config(m) if m.contains(text)),
            "{e}"
        );
        let e = RedisBroker::connect_lazy(ce).unwrap_err();
        assert!(e.to_string().contains(text), "{e}");
        let plain = RedisBrokerConfig::new(&url);
        assert_eq!(plain.message_format, MessageFormat::Plain);
        assert!(
            plain
                .clone()
                .message_format(MessageFormat::Plain)
                .validate()
                .is_ok()
        );
        RedisBroker::connect(plain)
            .await
            .expect("a plain adapter connects to the machine's Redis");
    }

    #[test]
    fn config_validation() {
        let ok = RedisBrokerConfig::new("redis://127.0.0.1:6379");
        assert!(ok.validate().is_ok());
        assert!(RedisBrokerConfig::new(" ").validate().is_err());
        assert!(ok.clone().key_pattern("outbox").validate().is_err());
        assert!(ok.clone().max_len(0).validate().is_err());
        assert!(ok.clone().timeout(Duration::ZERO).validate().is_err());
        let p = ok.clone().key_pattern("{outbox}:{topic}:{partition_key}");
        assert!(p.validate().is_ok());
        assert_eq!(p.stream_key("orders", "k1"), "{outbox}:orders:k1");
        assert_eq!(
            ok.key_prefix("app:").stream_key("orders", "k1"),
            "app:orders"
        );
    }
}
