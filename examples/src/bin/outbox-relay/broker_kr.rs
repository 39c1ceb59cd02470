//! `--broker kafka` and `--broker rabbitmq`: their flags and how they are built.

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use txoutbox_core::Broker;

use crate::broker::BrokerArgs;
use crate::error::{CliError, Result};

/// Kafka settings (`--broker kafka`, cargo feature `kafka`).
#[derive(Debug, Clone, Args)]
pub struct KafkaArgs {
    /// Kafka bootstrap brokers, host:port, comma separated.
    #[arg(long, env = "KAFKA_BROKERS", default_value = "127.0.0.1:9092")]
    pub kafka_brokers: String,
    /// Kafka topic = this prefix + topic (`outbox.event.` with the aggregate type as topic gives
    /// Debezium's layout).
    #[arg(long, env = "OUTBOX_KAFKA_TOPIC_PREFIX", default_value = "")]
    pub kafka_topic_prefix: String,
    /// The idempotent producer: on (a broker that grants none fails the start) or off.
    #[arg(long, env = "OUTBOX_KAFKA_IDEMPOTENCE", default_value = "on")]
    pub kafka_idempotence: String,
    /// Connect to Kafka with TLS (SSL, or SASL_SSL with --kafka-sasl-mechanism).
    #[arg(long, env = "OUTBOX_KAFKA_TLS")]
    pub kafka_tls: bool,
    /// PEM file of certificate authorities to trust for Kafka TLS (instead of the system's).
    #[arg(long, env = "OUTBOX_KAFKA_TLS_CA")]
    pub kafka_tls_ca: Option<PathBuf>,
    /// PEM client certificate for Kafka TLS (with --kafka-tls-key).
    #[arg(long, env = "OUTBOX_KAFKA_TLS_CERT", requires = "kafka_tls_key")]
    pub kafka_tls_cert: Option<PathBuf>,
    /// PEM key of the --kafka-tls-cert client certificate.
    #[arg(long, env = "OUTBOX_KAFKA_TLS_KEY", requires = "kafka_tls_cert")]
    pub kafka_tls_key: Option<PathBuf>,
    /// SASL mechanism: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512 (with --kafka-sasl-username and
    /// KAFKA_SASL_PASSWORD).
    #[arg(
        long,
        env = "OUTBOX_KAFKA_SASL_MECHANISM",
        requires = "kafka_sasl_username"
    )]
    pub kafka_sasl_mechanism: Option<String>,
    /// SASL user name.
    #[arg(long, env = "OUTBOX_KAFKA_SASL_USERNAME")]
    pub kafka_sasl_username: Option<String>,
    /// SASL password (read it from the environment rather than the command line).
    #[arg(long, env = "KAFKA_SASL_PASSWORD")]
    pub kafka_sasl_password: Option<String>,
}

/// RabbitMQ settings (`--broker rabbitmq`, cargo feature `rabbitmq`).
#[derive(Debug, Clone, Args)]
pub struct RabbitArgs {
    /// RabbitMQ URI (`amqps://` for TLS; the default virtual host is `%2f`).
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    pub amqp_url: String,
    /// The exchange to publish to (empty: the default exchange, which routes to the queue named
    /// by the routing key). It must exist unless --rabbitmq-declare-exchange is given.
    #[arg(long, env = "OUTBOX_RABBITMQ_EXCHANGE", default_value = "")]
    pub rabbitmq_exchange: String,
    /// Routing key = this prefix + topic.
    #[arg(long, env = "OUTBOX_RABBITMQ_ROUTING_KEY_PREFIX", default_value = "")]
    pub rabbitmq_routing_key_prefix: String,
    /// Declare the exchange (durable) of this type at start-up: topic, direct, fanout or
    /// headers.
    #[arg(long, env = "OUTBOX_RABBITMQ_DECLARE_EXCHANGE")]
    pub rabbitmq_declare_exchange: Option<String>,
    /// The app_id property of every message.
    #[arg(long, env = "OUTBOX_RABBITMQ_APP_ID")]
    pub rabbitmq_app_id: Option<String>,
    /// PEM file of certificate authorities to trust for amqps:// (besides the system's).
    #[arg(long, env = "OUTBOX_RABBITMQ_TLS_CA")]
    pub rabbitmq_tls_ca: Option<PathBuf>,
    /// PEM file with the client certificate chain and its PKCS#8 key, for amqps://.
    #[arg(long, env = "OUTBOX_RABBITMQ_TLS_CERT")]
    pub rabbitmq_tls_cert: Option<PathBuf>,
}

#[cfg(any(feature = "kafka", feature = "rabbitmq"))]
fn message_format(a: &BrokerArgs) -> Result<txoutbox_core::cloudevents::MessageFormat> {
    a.message_format
        .parse()
        .map_err(|e: String| CliError::usage(format!("--message-format: {e}")))
}

/// The Kafka adapter (exit 4, retryable, when no broker answers; 2 for a bad setting).
#[cfg(feature = "kafka")]
pub async fn kafka(a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    use crate::error::code;
    use txoutbox_kafka_broker::{
        Idempotence, KafkaBroker, KafkaBrokerConfig, KafkaBrokerError, KafkaSasl, KafkaTls,
    };
    let k = &a.kafka;
    let idem: Idempotence = k
        .kafka_idempotence
        .parse()
        .map_err(|e: String| CliError::usage(format!("--kafka-idempotence: {e}")))?;
    let mut cfg = KafkaBrokerConfig::new(k.kafka_brokers.clone())
        .topic_prefix(k.kafka_topic_prefix.clone())
        .idempotence(idem)
        .delivery_timeout(a.broker_timeout)
        .message_format(message_format(a)?)
        .tls(KafkaTls {
            enabled: k.kafka_tls,
            root_certificates: k.kafka_tls_ca.clone(),
            client_certificate: k.kafka_tls_cert.clone().zip(k.kafka_tls_key.clone()),
        });
    if let Some(s) = &a.cloudevents_source {
        cfg = cfg.cloudevents_source(s.clone());
    }
    if let Some(m) = &k.kafka_sasl_mechanism {
        let user = k.kafka_sasl_username.clone().unwrap_or_default();
        let Some(pw) = k.kafka_sasl_password.clone() else {
            return Err(CliError::usage(
                "--kafka-sasl-mechanism needs a password: set KAFKA_SASL_PASSWORD".to_owned(),
            ));
        };
        cfg = cfg.sasl(
            KafkaSasl::from_mechanism(m, user, pw)
                .map_err(|e| CliError::usage(format!("--kafka-sasl-mechanism: {e}")))?,
        );
    }
    match KafkaBroker::connect(cfg).await {
        Ok(b) => Ok(Arc::new(b)),
        Err(e @ KafkaBrokerError::Config(_)) => Err(CliError::usage(e.to_string())),
        Err(e @ KafkaBrokerError::Connect { .. }) => Err(CliError::new(
            code::BROKER,
            format!("{e}; check --kafka-brokers (KAFKA_BROKERS)"),
        )
        .retryable()),
        Err(e) => Err(CliError::new(code::BROKER, e.to_string())),
    }
}

#[cfg(not(feature = "kafka"))]
pub async fn kafka(_a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    Err(crate::broker::not_compiled("kafka"))
}

/// The RabbitMQ adapter (exit 4, retryable, when the broker is unreachable; 2 for a bad
/// setting).
#[cfg(feature = "rabbitmq")]
pub async fn rabbitmq(a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    use crate::error::code;
    use txoutbox_rabbitmq_broker::{
        ExchangeType, RabbitMqBroker, RabbitMqBrokerConfig, RabbitMqBrokerError, RabbitMqTls,
    };
    let r = &a.rabbitmq;
    let mut cfg = RabbitMqBrokerConfig::new(r.amqp_url.clone())
        .exchange(r.rabbitmq_exchange.clone())
        .routing_key_prefix(r.rabbitmq_routing_key_prefix.clone())
        .confirm_timeout(a.broker_timeout)
        .connection_name("outbox-relay")
        .message_format(message_format(a)?)
        .tls(RabbitMqTls {
            root_certificates: r.rabbitmq_tls_ca.clone(),
            client_certificate: r.rabbitmq_tls_cert.clone(),
        });
    if let Some(s) = &a.cloudevents_source {
        cfg = cfg.cloudevents_source(s.clone());
    }
    if let Some(app) = &r.rabbitmq_app_id {
        cfg = cfg.app_id(app.clone());
    }
    if let Some(t) = &r.rabbitmq_declare_exchange {
        let t = match t.as_str() {
            "topic" => ExchangeType::Topic,
            "direct" => ExchangeType::Direct,
            "fanout" => ExchangeType::Fanout,
            "headers" => ExchangeType::Headers,
            other => {
                return Err(CliError::usage(format!(
                    "--rabbitmq-declare-exchange {other:?}: use topic, direct, fanout or headers"
                )));
            }
        };
        cfg = cfg.declare_exchange(t);
    }
    match RabbitMqBroker::connect(cfg).await {
        Ok(b) => Ok(Arc::new(b)),
        Err(e @ RabbitMqBrokerError::Config(_)) => Err(CliError::usage(
            txoutbox_core::redact::secrets(&e.to_string()),
        )),
        Err(e @ RabbitMqBrokerError::Connect { .. }) => Err(CliError::new(
            code::BROKER,
            txoutbox_core::redact::secrets(&format!("{e}; check --amqp-url (AMQP_URL)")),
        )
        .retryable()),
        Err(e) => Err(CliError::new(
            code::BROKER,
            txoutbox_core::redact::secrets(&e.to_string()),
        )),
    }
}

#[cfg(not(feature = "rabbitmq"))]
pub async fn rabbitmq(_a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    Err(crate::broker::not_compiled("rabbitmq"))
}

/// R88 and R90: the relay's publish timeout must exceed the adapter's own bound on a publish
/// (Kafka's delivery timeout, RabbitMQ's confirm timeout), so that no message is still being
/// sent after its publish ended.
pub fn check_timeouts(a: &BrokerArgs, publish_timeout: std::time::Duration) -> Result<()> {
    use crate::BrokerKind;
    if matches!(a.broker, BrokerKind::Kafka | BrokerKind::Rabbitmq)
        && publish_timeout <= a.broker_timeout
    {
        return Err(CliError::usage(format!(
            "--publish-timeout ({publish_timeout:?}) must exceed --broker-timeout ({:?}) on --broker kafka and rabbitmq",
            a.broker_timeout
        )));
    }
    Ok(())
}
