//! Building the broker chosen with `--broker`.

use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use txoutbox_core::Broker;
use txoutbox_core::broker::{NoopBroker, StdoutBroker};

use crate::BrokerKind;
use crate::error::{CliError, Result, code};

/// Broker settings (each used only by its broker).
#[derive(Debug, Clone, Args)]
pub struct BrokerArgs {
    /// The broker, required: nats (feature `nats`, default on), redis (feature `redis`), stdout
    /// (a JSON line per event on stdout; rows are marked completed) or noop (acknowledges and
    /// discards every event; benchmarks only). There is no default, so a forgotten flag never
    /// drains the outbox into a terminal.
    #[arg(long, env = "OUTBOX_BROKER", value_enum)]
    pub broker: BrokerKind,
    /// NATS server URL(s), comma separated (`tls://` for TLS).
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    pub nats_url: String,
    /// NATS credentials file (`.creds`, a user JWT and its NKey seed, as `nsc` writes it).
    #[arg(long, env = "NATS_CREDS")]
    pub nats_creds: Option<std::path::PathBuf>,
    /// Refuse to connect to NATS without TLS.
    #[arg(long, env = "OUTBOX_NATS_TLS_REQUIRED")]
    pub nats_tls_required: bool,
    /// PEM file of certificate authorities to trust for NATS TLS (besides the system's).
    #[arg(long, env = "OUTBOX_NATS_TLS_CA")]
    pub nats_tls_ca: Option<std::path::PathBuf>,
    /// PEM client certificate for NATS TLS (with --nats-tls-key).
    #[arg(long, env = "OUTBOX_NATS_TLS_CERT", requires = "nats_tls_key")]
    pub nats_tls_cert: Option<std::path::PathBuf>,
    /// PEM key of the --nats-tls-cert client certificate.
    #[arg(long, env = "OUTBOX_NATS_TLS_KEY", requires = "nats_tls_cert")]
    pub nats_tls_key: Option<std::path::PathBuf>,
    /// NATS subject = this prefix + topic.
    #[arg(long, env = "OUTBOX_NATS_SUBJECT_PREFIX", default_value = "outbox.")]
    pub nats_subject_prefix: String,
    /// A JetStream stream to create (covering prefix + `>`) when it does not exist; empty to
    /// create none.
    #[arg(long, env = "OUTBOX_NATS_STREAM", default_value = "OUTBOX")]
    pub nats_stream: String,
    /// The duplicate window of a stream this command creates (events republished within it are
    /// dropped by JetStream). Make it longer than the lease.
    #[arg(long, env = "OUTBOX_NATS_DUPLICATE_WINDOW", default_value = "10m", value_parser = crate::parse_dur)]
    pub nats_duplicate_window: Duration,
    /// Redis URL (`rediss://` for TLS).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub redis_url: String,
    /// Redis stream key pattern: `{topic}` required, `{partition_key}` optional.
    #[arg(
        long,
        env = "OUTBOX_REDIS_KEY_PATTERN",
        default_value = "outbox:{topic}"
    )]
    pub redis_key_pattern: String,
    /// Trim each Redis stream to about this many entries (MAXLEN ~).
    #[arg(long, env = "OUTBOX_REDIS_MAX_LEN")]
    pub redis_max_len: Option<u64>,
    /// The adapter's own bound on one publish (keep it below --publish-timeout); on Kafka the
    /// delivery timeout, on RabbitMQ the confirm timeout.
    #[arg(long, env = "OUTBOX_BROKER_TIMEOUT", default_value = "10s", value_parser = crate::parse_dur)]
    pub broker_timeout: Duration,
    #[command(flatten)]
    pub kafka: crate::broker_kr::KafkaArgs,
    #[command(flatten)]
    pub rabbitmq: crate::broker_kr::RabbitArgs,
    /// plain (default) or cloudevents (CloudEvents binary mode; Kafka and RabbitMQ only, with
    /// --cloudevents-source).
    #[arg(long, env = "OUTBOX_MESSAGE_FORMAT", default_value = "plain")]
    pub message_format: String,
    /// The CloudEvents `source` of every event (a URI-reference such as /orders-service).
    #[arg(long, env = "OUTBOX_CLOUDEVENTS_SOURCE")]
    pub cloudevents_source: Option<String>,
}

#[cfg_attr(
    all(
        feature = "nats",
        feature = "redis",
        feature = "kafka",
        feature = "rabbitmq"
    ),
    allow(dead_code)
)]
pub(crate) fn not_compiled(name: &str) -> CliError {
    CliError::new(
        code::BROKER,
        format!(
            "--broker {name} is not compiled into this binary; rebuild with `cargo build -p txoutbox-examples --features {name} --bin outbox-relay`, or choose another broker (compiled in: {})",
            compiled_in().join(", ")
        ),
    )
}

/// The brokers compiled into this binary.
pub fn compiled_in() -> Vec<&'static str> {
    let mut v = Vec::new();
    if cfg!(feature = "nats") {
        v.push("nats");
    }
    if cfg!(feature = "redis") {
        v.push("redis");
    }
    if cfg!(feature = "kafka") {
        v.push("kafka");
    }
    if cfg!(feature = "rabbitmq") {
        v.push("rabbitmq");
    }
    v.extend(["stdout", "noop"]);
    v
}

/// The URL of the chosen broker, password redacted, for log lines (`-` for stdout and noop).
pub fn redacted_url(a: &BrokerArgs) -> String {
    match a.broker {
        BrokerKind::Nats => txoutbox_core::redact::secrets(&a.nats_url),
        BrokerKind::Redis => txoutbox_core::redact::secrets(&a.redis_url),
        BrokerKind::Kafka => a.kafka.kafka_brokers.clone(),
        BrokerKind::Rabbitmq => txoutbox_core::redact::secrets(&a.rabbitmq.amqp_url),
        BrokerKind::Stdout | BrokerKind::Noop => "-".to_owned(),
    }
}

/// Whether the chosen broker is compiled into this binary.
pub fn compiled(kind: BrokerKind) -> bool {
    match kind {
        BrokerKind::Nats => cfg!(feature = "nats"),
        BrokerKind::Redis => cfg!(feature = "redis"),
        BrokerKind::Kafka => cfg!(feature = "kafka"),
        BrokerKind::Rabbitmq => cfg!(feature = "rabbitmq"),
        BrokerKind::Stdout | BrokerKind::Noop => true,
    }
}

/// Connects the broker (exit 4 when unreachable, 2 for a bad setting; an unreachable server is
/// marked retryable).
pub async fn build(a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    match a.broker {
        BrokerKind::Stdout => Ok(Arc::new(StdoutBroker)),
        BrokerKind::Noop => {
            tracing::warn!(
                "--broker noop: every event is acknowledged and DISCARDED (marked completed, sent nowhere); use it for benchmarks only"
            );
            Ok(Arc::new(NoopBroker))
        }
        BrokerKind::Nats | BrokerKind::Redis if a.message_format != "plain" => {
            Err(CliError::usage(format!(
                "--message-format {} is offered on --broker kafka and rabbitmq only",
                a.message_format
            )))
        }
        BrokerKind::Nats => nats(a).await,
        BrokerKind::Redis => redis(a).await,
        BrokerKind::Kafka => crate::broker_kr::kafka(a).await,
        BrokerKind::Rabbitmq => crate::broker_kr::rabbitmq(a).await,
    }
}

#[cfg(feature = "nats")]
async fn nats(a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    use txoutbox_nats_broker::{NatsBroker, NatsBrokerConfig, NatsBrokerError, StreamSpec};
    let mut cfg = NatsBrokerConfig::new(a.nats_url.clone())
        .subject_prefix(a.nats_subject_prefix.clone())
        .timeout(a.broker_timeout)
        // The client retries a lost connection at most every 500 ms (its default: 2 s), so the
        // relay, woken by the reconnection, publishes within a second of NATS answering again.
        .reconnect_delay_max(Duration::from_millis(500))
        .client_name("outbox-relay")
        .tls(txoutbox_nats_broker::NatsTls {
            required: a.nats_tls_required,
            root_certificates: a.nats_tls_ca.clone(),
            client_certificate: a.nats_tls_cert.clone().zip(a.nats_tls_key.clone()),
        });
    if let Some(creds) = &a.nats_creds {
        cfg = cfg.credentials_file(creds.clone());
    }
    if !a.nats_stream.is_empty() {
        cfg = cfg.ensure_stream(
            StreamSpec::new(a.nats_stream.clone()).duplicate_window(a.nats_duplicate_window),
        );
    }
    match NatsBroker::connect(cfg).await {
        Ok(b) => Ok(Arc::new(b)),
        Err(e @ NatsBrokerError::Config(_)) => Err(CliError::usage(e.to_string())),
        Err(e @ NatsBrokerError::Connect { .. }) => Err(CliError::new(
            code::BROKER,
            txoutbox_core::redact::secrets(&format!(
                "{e}; check --nats-url (NATS_URL) and that nats-server runs"
            )),
        )
        .retryable()),
        Err(e) => Err(CliError::new(
            code::BROKER,
            txoutbox_core::redact::secrets(&format!(
                "{e}; check --nats-url (NATS_URL) and that nats-server runs with JetStream (-js)"
            )),
        )),
    }
}

#[cfg(not(feature = "nats"))]
async fn nats(_a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    Err(not_compiled("nats"))
}

#[cfg(feature = "redis")]
async fn redis(a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    use txoutbox_redis_broker::{RedisBroker, RedisBrokerConfig, RedisBrokerError};
    let mut cfg = RedisBrokerConfig::new(a.redis_url.clone())
        .key_pattern(a.redis_key_pattern.clone())
        .timeout(a.broker_timeout);
    if let Some(n) = a.redis_max_len {
        cfg = cfg.max_len(n);
    }
    match RedisBroker::connect(cfg).await {
        Ok(b) => Ok(Arc::new(b)),
        Err(e @ RedisBrokerError::Config(_)) => Err(CliError::usage(e.to_string())),
        Err(e @ RedisBrokerError::Connect { .. }) => Err(CliError::new(
            code::BROKER,
            txoutbox_core::redact::secrets(&e.to_string()),
        )
        .retryable()),
        Err(e) => Err(CliError::new(
            code::BROKER,
            txoutbox_core::redact::secrets(&e.to_string()),
        )),
    }
}

#[cfg(not(feature = "redis"))]
async fn redis(_a: &BrokerArgs) -> Result<Arc<dyn Broker>> {
    Err(not_compiled("redis"))
}
