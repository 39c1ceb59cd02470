//! Settings of the Kafka broker adapter (R86 to R88, section 12).

use std::path::PathBuf;
use std::time::Duration;

use txoutbox_core::cloudevents::{self, MessageFormat};

use crate::error::KafkaBrokerError;

/// Default delivery timeout (R88): the longest the client keeps sending one record.
pub const DEFAULT_DELIVERY_TIMEOUT: Duration = Duration::from_secs(20);
/// Default linger: how long the client may wait to fill a batch.
pub const DEFAULT_LINGER: Duration = Duration::from_millis(5);
/// Default first resend backoff; it doubles per resend up to 1 s.
pub const DEFAULT_RETRY_BACKOFF: Duration = Duration::from_millis(100);
/// Default connect timeout of one connection attempt.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Default largest record the adapter sends (above the brokers' topic limits, so that the
/// broker decides).
pub const DEFAULT_MAX_REQUEST_SIZE: usize = 16 * 1024 * 1024;

/// Whether the producer is idempotent (R87).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Idempotence {
    /// A producer id and sequence numbers (the default): a batch the client sends again after
    /// a lost answer is stored once. A broker that grants no producer id fails the start, and
    /// every publish is transient until it does.
    #[default]
    On,
    /// No producer id: a resent batch can be stored twice (consumers drop the copy by `id`).
    Off,
}

impl std::str::FromStr for Idempotence {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!("idempotence {other:?} is unknown; use on or off")),
        }
    }
}

/// A SASL mechanism and its credentials. `Debug` never shows the password.
#[derive(Clone, PartialEq, Eq)]
pub enum KafkaSasl {
    /// SASL/PLAIN (send it over TLS only).
    Plain {
        /// User name.
        username: String,
        /// Password.
        password: String,
    },
    /// SASL/SCRAM-SHA-256.
    ScramSha256 {
        /// User name.
        username: String,
        /// Password.
        password: String,
    },
    /// SASL/SCRAM-SHA-512.
    ScramSha512 {
        /// User name.
        username: String,
        /// Password.
        password: String,
    },
}

impl KafkaSasl {
    /// A mechanism by its Kafka name (`PLAIN`, `SCRAM-SHA-256`, `SCRAM-SHA-512`).
    pub fn from_mechanism(
        mechanism: &str,
        username: impl Into<String>,
        password: impl Into<String>,
    ) -> Result<Self, String> {
        let (username, password) = (username.into(), password.into());
        match mechanism.to_ascii_uppercase().as_str() {
            "PLAIN" => Ok(Self::Plain { username, password }),
            "SCRAM-SHA-256" => Ok(Self::ScramSha256 { username, password }),
            "SCRAM-SHA-512" => Ok(Self::ScramSha512 { username, password }),
            other => Err(format!(
                "SASL mechanism {other:?} is not supported; use PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512"
            )),
        }
    }

    /// The mechanism's Kafka name.
    pub fn mechanism(&self) -> &'static str {
        match self {
            Self::Plain { .. } => "PLAIN",
            Self::ScramSha256 { .. } => "SCRAM-SHA-256",
            Self::ScramSha512 { .. } => "SCRAM-SHA-512",
        }
    }

    fn username(&self) -> &str {
        match self {
            Self::Plain { username, .. }
            | Self::ScramSha256 { username, .. }
            | Self::ScramSha512 { username, .. } => username,
        }
    }
}

impl std::fmt::Debug for KafkaSasl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSasl")
            .field("mechanism", &self.mechanism())
            .field("username", &self.username())
            .field("password", &"***")
            .finish()
    }
}

/// TLS settings (rustls with the ring provider; no OpenSSL). Without a CA file the system's
/// certificate authorities are trusted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KafkaTls {
    /// Connect with TLS (SSL or SASL_SSL).
    pub enabled: bool,
    /// PEM file of the certificate authorities to trust instead of the system's.
    pub root_certificates: Option<PathBuf>,
    /// PEM files of the client certificate and its key, for brokers that verify clients.
    pub client_certificate: Option<(PathBuf, PathBuf)>,
}

/// Settings of [`crate::KafkaBroker`]; [`validate`](Self::validate) (called by the
/// constructors) checks them. `Debug` never shows a password.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KafkaBrokerConfig {
    pub(crate) brokers: String,
    pub(crate) topic_prefix: String,
    pub(crate) idempotence: Idempotence,
    pub(crate) delivery_timeout: Duration,
    pub(crate) linger: Duration,
    pub(crate) retry_backoff: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) max_request_size: usize,
    pub(crate) client_id: String,
    pub(crate) message_format: MessageFormat,
    pub(crate) cloudevents_source: Option<String>,
    pub(crate) tls: KafkaTls,
    pub(crate) sasl: Option<KafkaSasl>,
}

impl KafkaBrokerConfig {
    /// Settings for the bootstrap brokers `brokers` (`host:port`, several separated by
    /// commas), with an empty topic prefix, idempotence on, acks = all (fixed), a 20 s delivery
    /// timeout, 5 ms linger and the plain message format.
    pub fn new(brokers: impl Into<String>) -> Self {
        Self {
            brokers: brokers.into(),
            topic_prefix: String::new(),
            idempotence: Idempotence::On,
            delivery_timeout: DEFAULT_DELIVERY_TIMEOUT,
            linger: DEFAULT_LINGER,
            retry_backoff: DEFAULT_RETRY_BACKOFF,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            max_request_size: DEFAULT_MAX_REQUEST_SIZE,
            client_id: "outbox-relay".into(),
            message_format: MessageFormat::Plain,
            cloudevents_source: None,
            tls: KafkaTls::default(),
            sasl: None,
        }
    }

    /// Topic = this prefix + the event's topic (default empty; `outbox.event.` gives
    /// Debezium's layout with the aggregate type as topic).
    pub fn topic_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.topic_prefix = prefix.into();
        self
    }

    /// Idempotence `on` (default) or `off` (R87).
    pub fn idempotence(mut self, i: Idempotence) -> Self {
        self.idempotence = i;
        self
    }

    /// How long the client keeps sending one record, resends included (default 20 s); keep it
    /// below the relay's publish timeout (R88).
    pub fn delivery_timeout(mut self, d: Duration) -> Self {
        self.delivery_timeout = d;
        self
    }

    /// How long a batch may wait for more records (default 5 ms).
    pub fn linger(mut self, d: Duration) -> Self {
        self.linger = d;
        self
    }

    /// The first resend backoff (default 100 ms; it doubles up to 1 s).
    pub fn retry_backoff(mut self, d: Duration) -> Self {
        self.retry_backoff = d;
        self
    }

    /// The longest one connection attempt may take (default 5 s; capped by the delivery
    /// timeout).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// The largest record the adapter sends (default 16 MiB); a larger one is a rejection
    /// without a broker call.
    pub fn max_request_size(mut self, bytes: usize) -> Self {
        self.max_request_size = bytes;
        self
    }

    /// The client id the brokers see (default `outbox-relay`).
    pub fn client_id(mut self, id: impl Into<String>) -> Self {
        self.client_id = id.into();
        self
    }

    /// `plain` (default) or `cloudevents` (R91, Kafka binding: `ce_` headers and
    /// `content-type`); the latter needs [`cloudevents_source`](Self::cloudevents_source).
    pub fn message_format(mut self, f: MessageFormat) -> Self {
        self.message_format = f;
        self
    }

    /// The CloudEvents `source` of every event (a URI-reference, e.g. `/orders-service`).
    pub fn cloudevents_source(mut self, source: impl Into<String>) -> Self {
        self.cloudevents_source = Some(source.into());
        self
    }

    /// TLS settings.
    pub fn tls(mut self, tls: KafkaTls) -> Self {
        self.tls = tls;
        self
    }

    /// SASL authentication.
    pub fn sasl(mut self, sasl: KafkaSasl) -> Self {
        self.sasl = Some(sasl);
        self
    }

    /// The bootstrap brokers.
    pub fn brokers(&self) -> &str {
        &self.brokers
    }

    /// The idempotence setting.
    pub fn idempotence_value(&self) -> Idempotence {
        self.idempotence
    }

    /// The delivery timeout.
    pub fn delivery_timeout_value(&self) -> Duration {
        self.delivery_timeout
    }

    /// The Kafka topic of an event topic: prefix + topic.
    pub fn topic_for(&self, topic: &str) -> String {
        format!("{}{topic}", self.topic_prefix)
    }

    /// Checks the settings; the error names the setting and the fix.
    pub fn validate(&self) -> Result<(), KafkaBrokerError> {
        let bad = |m: String| Err(KafkaBrokerError::Config(m));
        if self.brokers.split(',').all(|b| b.trim().is_empty()) {
            return bad("brokers is empty; give host:port[,host:port]".into());
        }
        for b in self.brokers.split(',').map(str::trim) {
            if b.contains("://") || !b.contains(':') {
                return bad(format!(
                    "broker {b:?} is not host:port (no scheme: TLS is KafkaTls::enabled)"
                ));
            }
        }
        if self.delivery_timeout <= self.linger + Duration::from_millis(10) {
            return bad(format!(
                "delivery_timeout ({:?}) must exceed linger ({:?}) by more than 10 ms",
                self.delivery_timeout, self.linger
            ));
        }
        if self.connect_timeout.is_zero() {
            return bad("connect_timeout must be above zero".into());
        }
        if self.max_request_size < 1024 {
            return bad(format!(
                "max_request_size ({}) is below 1 KiB",
                self.max_request_size
            ));
        }
        if self.message_format == MessageFormat::CloudEvents {
            cloudevents::check_source(self.cloudevents_source.as_deref())
                .map_err(KafkaBrokerError::Config)?;
        }
        let mut files: Vec<&PathBuf> = self.tls.root_certificates.iter().collect();
        if let Some((c, k)) = &self.tls.client_certificate {
            files.extend([c, k]);
        }
        if !self.tls.enabled && !files.is_empty() {
            return bad("TLS files are set but TLS is not enabled".into());
        }
        for p in files {
            if !p.is_file() {
                return bad(format!(
                    "TLS file {} does not exist or is no file",
                    p.display()
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_sasl_password() {
        let c = KafkaBrokerConfig::new("127.0.0.1:9092")
            .sasl(KafkaSasl::from_mechanism("scram-sha-512", "app", "s3cret").expect("mechanism"));
        let d = format!("{c:?}");
        assert!(!d.contains("s3cret"), "{d}");
        assert!(d.contains("SCRAM-SHA-512") && d.contains("app"), "{d}");
    }

    #[test]
    fn bad_settings_are_refused_with_the_fix() {
        let e = KafkaBrokerConfig::new("").validate().unwrap_err();
        assert!(e.to_string().contains("brokers is empty"), "{e}");
        let e = KafkaBrokerConfig::new("kafka://h:9092")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("not host:port"), "{e}");
        let e = KafkaBrokerConfig::new("h:9092")
            .delivery_timeout(Duration::from_millis(5))
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("delivery_timeout"), "{e}");
        let e = KafkaBrokerConfig::new("h:9092")
            .message_format(MessageFormat::CloudEvents)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("cloudevents_source"), "{e}");
        assert!(KafkaSasl::from_mechanism("GSSAPI", "u", "p").is_err());
        assert_eq!("off".parse(), Ok(Idempotence::Off));
        assert!("auto".parse::<Idempotence>().is_err());
        KafkaBrokerConfig::new("h:9092,h2:9092")
            .validate()
            .expect("valid");
    }
}
