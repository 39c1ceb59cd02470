//! Settings of the RabbitMQ broker adapter.

use std::path::PathBuf;
use std::time::Duration;

use txoutbox_core::cloudevents::{self, MessageFormat};

use crate::error::RabbitMqBrokerError;

/// Default confirm timeout (R90): the longest one publish waits for its confirm, connecting
/// included.
pub const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);
/// Default connect timeout.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest routing key AMQP 0-9-1 carries, in bytes (a short string).
pub const MAX_ROUTING_KEY_BYTES: usize = 255;

/// The type of an exchange the adapter declares ([`RabbitMqBrokerConfig::declare_exchange`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExchangeType {
    /// `topic` (the default): bindings match dot-separated routing-key patterns.
    #[default]
    Topic,
    /// `direct`: bindings match the routing key exactly.
    Direct,
    /// `fanout`: every bound queue gets every message.
    Fanout,
    /// `headers`: bindings match header values.
    Headers,
}

/// TLS settings of an `amqps://` connection (rustls with the ring provider; no OpenSSL). The
/// system's certificate authorities are trusted in any case.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RabbitMqTls {
    /// PEM file of certificate authorities to trust besides the system's.
    pub root_certificates: Option<PathBuf>,
    /// A PEM file holding the client certificate chain and its PKCS#8 key, for brokers that
    /// verify clients.
    pub client_certificate: Option<PathBuf>,
}

/// Settings of [`crate::RabbitMqBroker`]; [`validate`](Self::validate) (called by the
/// constructors) checks them. Its `Debug` output shows the URI with the password replaced by
/// `***`.
#[derive(Clone, PartialEq, Eq)]
pub struct RabbitMqBrokerConfig {
    pub(crate) uri: String,
    pub(crate) exchange: String,
    pub(crate) routing_key_prefix: String,
    pub(crate) declare_exchange: Option<ExchangeType>,
    pub(crate) app_id: Option<String>,
    pub(crate) confirm_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) connection_name: Option<String>,
    pub(crate) message_format: MessageFormat,
    pub(crate) cloudevents_source: Option<String>,
    pub(crate) tls: RabbitMqTls,
}

impl std::fmt::Debug for RabbitMqBrokerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqBrokerConfig")
            .field("uri", &txoutbox_core::redact::secrets(&self.uri))
            .field("exchange", &self.exchange)
            .field("routing_key_prefix", &self.routing_key_prefix)
            .field("declare_exchange", &self.declare_exchange)
            .field("app_id", &self.app_id)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("connection_name", &self.connection_name)
            .field("message_format", &self.message_format)
            .field("cloudevents_source", &self.cloudevents_source)
            .field("tls", &self.tls)
            .finish()
    }
}

impl RabbitMqBrokerConfig {
    /// Settings for the broker at `uri` (`amqp://user:password@host:5672/vhost`, `amqps://` for
    /// TLS; the default virtual host `/` is `%2f`), publishing to the default exchange `""` with
    /// routing key = topic, a 10 s confirm timeout and the plain message format.
    pub fn new(uri: impl Into<String>) -> Self {
        Self {
            uri: uri.into(),
            exchange: String::new(),
            routing_key_prefix: String::new(),
            declare_exchange: None,
            app_id: None,
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            connection_name: None,
            message_format: MessageFormat::Plain,
            cloudevents_source: None,
            tls: RabbitMqTls::default(),
        }
    }

    /// The exchange to publish to (default `""`, the default exchange, which routes a message
    /// to the queue named by its routing key).
    pub fn exchange(mut self, name: impl Into<String>) -> Self {
        self.exchange = name.into();
        self
    }

    /// Routing key = this prefix + topic (default empty).
    pub fn routing_key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.routing_key_prefix = prefix.into();
        self
    }

    /// Declares the exchange (durable, of this type) at start-up instead of only checking that
    /// it exists. Not allowed for the default exchange.
    pub fn declare_exchange(mut self, kind: ExchangeType) -> Self {
        self.declare_exchange = Some(kind);
        self
    }

    /// The `app_id` property of every message (none by default).
    pub fn app_id(mut self, app_id: impl Into<String>) -> Self {
        self.app_id = Some(app_id.into());
        self
    }

    /// The longest one publish waits for its confirm, connecting and opening a channel
    /// included (default 10 s); keep it below the relay's publish timeout (R90).
    pub fn confirm_timeout(mut self, d: Duration) -> Self {
        self.confirm_timeout = d;
        self
    }

    /// The longest one connection attempt may take (default 5 s).
    pub fn connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d;
        self
    }

    /// The connection name the management UI shows.
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.connection_name = Some(name.into());
        self
    }

    /// `plain` (default) or `cloudevents` (R91, AMQP binding: `cloudEvents_` headers); the
    /// latter needs [`cloudevents_source`](Self::cloudevents_source).
    pub fn message_format(mut self, f: MessageFormat) -> Self {
        self.message_format = f;
        self
    }

    /// The CloudEvents `source` of every event (a URI-reference, e.g. `/orders-service`).
    pub fn cloudevents_source(mut self, source: impl Into<String>) -> Self {
        self.cloudevents_source = Some(source.into());
        self
    }

    /// TLS settings for `amqps://` (see [`RabbitMqTls`]).
    pub fn tls(mut self, tls: RabbitMqTls) -> Self {
        self.tls = tls;
        self
    }

    /// The exchange.
    pub fn exchange_name(&self) -> &str {
        &self.exchange
    }

    /// The confirm timeout.
    pub fn confirm_timeout_value(&self) -> Duration {
        self.confirm_timeout
    }

    /// The routing key of a topic: prefix + topic.
    pub fn routing_key(&self, topic: &str) -> String {
        format!("{}{topic}", self.routing_key_prefix)
    }

    /// Checks the settings; the error names the setting and the fix.
    pub fn validate(&self) -> Result<(), RabbitMqBrokerError> {
        let bad = |m: String| Err(RabbitMqBrokerError::Config(m));
        if !(self.uri.starts_with("amqp://") || self.uri.starts_with("amqps://")) {
            return bad(format!(
                "uri {:?} is no AMQP URI; use amqp://user:password@host:5672/%2f (amqps:// for TLS)",
                txoutbox_core::redact::secrets(&self.uri)
            ));
        }
        if self.uri.parse::<lapin::uri::AMQPUri>().is_err() {
            return bad(format!(
                "uri {:?} cannot be parsed; use amqp://user:password@host:5672/%2f (percent-encode the virtual host)",
                txoutbox_core::redact::secrets(&self.uri)
            ));
        }
        if self.confirm_timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("confirm_timeout and connect_timeout must be above zero".into());
        }
        if self.exchange.len() > MAX_ROUTING_KEY_BYTES {
            return bad(format!(
                "exchange {:?} is longer than {MAX_ROUTING_KEY_BYTES} bytes",
                self.exchange
            ));
        }
        if self.exchange.is_empty() && self.declare_exchange.is_some() {
            return bad(
                "declare_exchange is set for the default exchange \"\", which cannot be declared; name an exchange or drop declare_exchange".into(),
            );
        }
        if let Some(a) = &self.app_id
            && a.len() > MAX_ROUTING_KEY_BYTES
        {
            return bad(format!(
                "app_id is longer than {MAX_ROUTING_KEY_BYTES} bytes"
            ));
        }
        if self.message_format == MessageFormat::CloudEvents {
            cloudevents::check_source(self.cloudevents_source.as_deref())
                .map_err(RabbitMqBrokerError::Config)?;
        }
        for p in [&self.tls.root_certificates, &self.tls.client_certificate]
            .into_iter()
            .flatten()
        {
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
    fn the_debug_output_hides_the_password() {
        let c = RabbitMqBrokerConfig::new("amqp://app:s3cret@127.0.0.1:5672/%2f");
        let d = format!("{c:?}");
        assert!(!d.contains("s3cret"), "{d}");
        assert!(d.contains("app:***@127.0.0.1"), "{d}");
    }

    #[test]
    fn bad_settings_are_refused_with_the_fix() {
        let e = RabbitMqBrokerConfig::new("http://x")
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("no AMQP URI"), "{e}");
        let e = RabbitMqBrokerConfig::new("amqp://127.0.0.1")
            .declare_exchange(ExchangeType::Topic)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("default exchange"), "{e}");
        let e = RabbitMqBrokerConfig::new("amqp://127.0.0.1")
            .message_format(MessageFormat::CloudEvents)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("cloudevents_source"), "{e}");
        let e = RabbitMqBrokerConfig::new("amqp://127.0.0.1")
            .confirm_timeout(Duration::ZERO)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("above zero"), "{e}");
        RabbitMqBrokerConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")
            .message_format(MessageFormat::CloudEvents)
            .cloudevents_source("/orders-service")
            .validate()
            .expect("valid");
    }
}
