#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
mod error;
pub mod record;
pub mod subscription;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use krafka::auth::{AuthConfig, TlsConfig};
use krafka::producer::{Acks, Producer};
use krafka::{Kafka, Record};
use txoutbox_core::broker::{Probe, ReconnectSignal, ReconnectWatch};
use txoutbox_core::{Ack, Broker, BrokerError, Message};

pub use config::{
    DEFAULT_CONNECT_TIMEOUT, DEFAULT_DELIVERY_TIMEOUT, DEFAULT_LINGER, DEFAULT_MAX_REQUEST_SIZE,
    DEFAULT_RETRY_BACKOFF, Idempotence, KafkaBrokerConfig, KafkaSasl, KafkaTls,
};
pub use error::{KafkaBrokerError, code_name, code_text};
/// The Kafka client this adapter is built on (krafka, pure Rust), for applications that name
/// its types.
pub use krafka;
pub use subscription::{KafkaSubscription, KafkaSubscriptionConfig, OffsetReset};
pub use txoutbox_core::cloudevents::MessageFormat;

/// A [`Broker`] sending each row as one Kafka record with acks = all and, unless turned off, an
/// idempotent producer (R86 to R88). Cloning shares the producer.
#[derive(Clone)]
pub struct KafkaBroker {
    inner: Arc<Inner>,
}

struct Inner {
    config: KafkaBrokerConfig,
    client: tokio::sync::Mutex<Option<Client>>,
    known_topics: std::sync::Mutex<HashSet<String>>,
    reconnected: ReconnectSignal,
}

#[derive(Clone)]
struct Client {
    kafka: Kafka,
    producer: Arc<Producer>,
}

impl std::fmt::Debug for KafkaBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaBroker")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

/// Why no producer could be had: the client's text, and whether it is R87's refusal.
#[derive(Debug)]
enum StartFailure {
    Unreachable(String),
    NoIdempotentProducer(String),
}

impl StartFailure {
    fn into_broker_error(self) -> BrokerError {
        match self {
            Self::Unreachable(m) => {
                BrokerError::transient(format!("Kafka broker unreachable: {m}"))
            }
            Self::NoIdempotentProducer(t) => BrokerError::transient(t),
        }
    }
}

impl KafkaBroker {
    /// Builds the adapter and runs its connection check ([`check`](Self::check)): fails when no
    /// bootstrap broker answers, or (idempotence on) the broker grants no producer id.
    pub async fn connect(config: KafkaBrokerConfig) -> Result<Self, KafkaBrokerError> {
        let b = Self::connect_lazy(config)?;
        b.check().await?;
        Ok(b)
    }

    /// Builds the adapter without the broker (R87): until it has a connection and, under
    /// idempotence on, a producer id, every publish is a transient failure (each publish and
    /// probe tries to get them).
    pub fn connect_lazy(config: KafkaBrokerConfig) -> Result<Self, KafkaBrokerError> {
        config.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                client: tokio::sync::Mutex::new(None),
                known_topics: std::sync::Mutex::new(HashSet::new()),
                reconnected: ReconnectSignal::new(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &KafkaBrokerConfig {
        &self.inner.config
    }

    /// The connection check: connects to a bootstrap broker and builds the producer (under
    /// idempotence on, obtaining its producer id).
    pub async fn check(&self) -> Result<(), KafkaBrokerError> {
        match self.client().await {
            Ok(_) => Ok(()),
            Err(StartFailure::Unreachable(message)) => Err(KafkaBrokerError::Connect {
                brokers: self.inner.config.brokers.clone(),
                message,
            }),
            Err(StartFailure::NoIdempotentProducer(t)) => {
                Err(KafkaBrokerError::NoIdempotentProducer(t))
            }
        }
    }

    /// The adapter's own bound on one publish: its delivery timeout plus a small margin for the
    /// metadata check. A relay's publish timeout must exceed it (R88).
    pub fn publish_bound(&self) -> Duration {
        self.inner.config.delivery_timeout + Duration::from_millis(200)
    }

    fn request_timeout(&self) -> Duration {
        let c = &self.inner.config;
        (c.delivery_timeout - c.linger - Duration::from_millis(5)).min(Duration::from_secs(30))
    }

    fn auth(&self) -> Option<AuthConfig> {
        auth_config(&self.inner.config)
    }

    /// The producer, or a new one (connect, and under idempotence on InitProducerId), within
    /// the delivery timeout.
    async fn client(&self) -> Result<Client, StartFailure> {
        let mut slot = self.inner.client.lock().await;
        if let Some(c) = slot.as_ref()
            && !c.producer.is_closed()
        {
            return Ok(c.clone());
        }
        let c = &self.inner.config;
        let request_timeout = self.request_timeout();
        let mut b = Kafka::builder(c.brokers.clone())
            .client_id(c.client_id.clone())
            .request_timeout(request_timeout)
            .connect_timeout(c.connect_timeout.min(request_timeout))
            .allow_auto_create_topics(false);
        if let Some(a) = self.auth() {
            b = b.security(a);
        }
        let built = tokio::time::timeout(c.delivery_timeout, async {
            let kafka = b
                .connect()
                .await
                .map_err(|e| StartFailure::Unreachable(e.to_string()))?;
            let producer = kafka
                .producer()
                .acks(Acks::All)
                .idempotent(c.idempotence == Idempotence::On)
                .linger(c.linger)
                .delivery_timeout(c.delivery_timeout)
                .retry_backoff(c.retry_backoff)
                .max_request_size(c.max_request_size.saturating_add(64 * 1024))
                .max_block(c.delivery_timeout)
                .metrics_push(false)
                .build()
                .await
                .map_err(|e| classify_build_error(&e, c.idempotence))?;
            Ok::<_, StartFailure>(Client {
                kafka,
                producer: Arc::new(producer),
            })
        })
        .await
        .map_err(|_| {
            StartFailure::Unreachable(format!(
                "no connection and producer within {:?}",
                c.delivery_timeout
            ))
        })??;
        *slot = Some(built.clone());
        drop(slot);
        tracing::info!(brokers = %c.brokers, idempotence = ?c.idempotence, "Kafka producer ready");
        self.inner.reconnected.connected();
        Ok(built)
    }

    /// R88's metadata check for a topic not seen before: one metadata request; no answer is
    /// transient, an answer without the topic a rejection.
    async fn ensure_topic(&self, client: &Client, topic: &str) -> Result<(), BrokerError> {
        if self
            .inner
            .known_topics
            .lock()
            .expect("known topics")
            .contains(topic)
        {
            return Ok(());
        }
        match client.producer.partitions_for(topic).await {
            Ok(p) if !p.is_empty() => {
                self.inner
                    .known_topics
                    .lock()
                    .expect("known topics")
                    .insert(topic.to_owned());
                Ok(())
            }
            Ok(_) => Err(BrokerError::rejected(format!(
                "Kafka: topic {topic:?} does not exist"
            ))),
            Err(e) => Err(error::map_send_error(&e, topic, self.idempotent())),
        }
    }

    fn idempotent(&self) -> bool {
        self.inner.config.idempotence == Idempotence::On
    }

    /// Drops `stale` (if it is still the adapter's producer) after the broker stopped knowing
    /// its producer id or sequences, as after a restart that lost the broker's producer state:
    /// the client answers such a failure by bumping its epoch under the same id, which a broker
    /// that never issued the id keeps refusing (UNKNOWN_PRODUCER_ID on every later send). The
    /// next publish builds a producer with a new id from InitProducerId. Order is kept because
    /// the failed publish was not written and is retried by the relay, and a key's next event
    /// is not published before it completes.
    fn forget_producer(&self, stale: &Client) {
        let Ok(mut slot) = self.inner.client.try_lock() else {
            // Another task is building or reading the producer; the next failure retries.
            return;
        };
        if slot
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(&c.producer, &stale.producer))
        {
            *slot = None;
            // The old producer finishes what it holds (each send reports its own outcome)
            // within the delivery timeout, then closes.
            let (old, within) = (stale.producer.clone(), self.inner.config.delivery_timeout);
            tokio::spawn(async move {
                let _ = old
                    .close_with(krafka::CloseOptions::new().timeout(within))
                    .await;
            });
            tracing::warn!(
                "Kafka: the broker no longer knows the idempotent producer's id or sequences; building a new producer"
            );
        }
    }
}

/// The client's TLS and SASL settings (shared by the adapter and the inbox subscription).
pub(crate) fn auth_config(c: &KafkaBrokerConfig) -> Option<AuthConfig> {
    let tls = c.tls.enabled.then(|| {
        let mut t = TlsConfig::new();
        if let Some(ca) = &c.tls.root_certificates {
            t = t.with_ca_cert(ca.display().to_string());
        } else {
            t = t.with_native_roots();
        }
        if let Some((cert, key)) = &c.tls.client_certificate {
            t = t.with_client_cert(cert.display().to_string(), key.display().to_string());
        }
        t
    });
    let sasl = c.sasl.as_ref().map(|s| match s {
        KafkaSasl::Plain { username, password } => AuthConfig::sasl_plain(username, password),
        KafkaSasl::ScramSha256 { username, password } => {
            AuthConfig::sasl_scram_sha256(username, password)
        }
        KafkaSasl::ScramSha512 { username, password } => {
            AuthConfig::sasl_scram_sha512(username, password)
        }
    });
    match (sasl, tls) {
        (Some(s), Some(t)) => Some(s.with_tls(t)),
        (Some(s), None) => Some(s),
        (None, Some(t)) => Some(AuthConfig::ssl(t)),
        (None, None) => None,
    }
}

/// A failed producer build: under idempotence on, an answer to InitProducerId that is not a
/// connection problem is R87's refusal.
fn classify_build_error(e: &krafka::error::KrafkaError, idem: Idempotence) -> StartFailure {
    use krafka::error::KrafkaError as K;
    match e {
        K::Network(_) | K::Timeout { .. } | K::Closed { .. } => {
            StartFailure::Unreachable(e.to_string())
        }
        _ if idem == Idempotence::On => {
            StartFailure::NoIdempotentProducer(error::no_idempotent_producer(&e.to_string()))
        }
        _ => StartFailure::Unreachable(e.to_string()),
    }
}

#[async_trait]
impl Broker for KafkaBroker {
    fn messaging_system(&self) -> &'static str {
        "kafka"
    }

    /// The Kafka topic (prefix + topic).
    fn destination_name(&self, m: &Message) -> String {
        self.inner.config.topic_for(&m.topic)
    }

    /// Moves each time the adapter has built a producer (its first, and each after the client
    /// closed).
    fn reconnects(&self) -> Option<ReconnectWatch> {
        Some(self.inner.reconnected.watch())
    }

    /// One round trip: builds the producer when there is none, else lists the cluster's topics
    /// (a metadata request answered by a broker).
    async fn probe(&self) -> Probe {
        let had = self.inner.client.lock().await.clone();
        let client = match had {
            Some(c) => c,
            None => {
                return match self.client().await {
                    Ok(_) => Probe::Up,
                    Err(_) => Probe::Down,
                };
            }
        };
        let admin = client.kafka.admin();
        match admin.list_topics(Default::default()).await {
            Ok(_) => Probe::Up,
            Err(e) => {
                tracing::debug!(error = %e, "Kafka probe: no metadata answer");
                Probe::Down
            }
        }
    }

    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let cfg = &self.inner.config;
        let topic = record::topic(cfg, m)?;
        let headers = record::headers(cfg, m);
        let size = record::size(m, &headers);
        if size > cfg.max_request_size {
            return Err(BrokerError::rejected(format!(
                "Kafka: the record for topic {topic:?} is {size} bytes, above the adapter's max_request_size of {} bytes",
                cfg.max_request_size
            )));
        }
        let client = self
            .client()
            .await
            .map_err(StartFailure::into_broker_error)?;
        let bound = self.publish_bound();
        let sent = tokio::time::timeout(bound, async {
            self.ensure_topic(&client, &topic).await?;
            let mut r = Record::new(topic.clone(), m.body.clone()).key(m.partition_key.clone());
            for (k, v) in headers {
                r = r.header(k, v.into_bytes());
            }
            client.producer.send(r).await.map_err(|e| {
                if self.idempotent() && error::producer_identity_lost(&e) {
                    self.forget_producer(&client);
                }
                error::map_send_error(&e, &topic, self.idempotent())
            })
        })
        .await;
        match sent {
            Ok(Ok(meta)) if meta.is_persisted() => Ok(Ack {
                duplicate: meta.is_deduplicated(),
            }),
            Ok(Ok(meta)) => Err(BrokerError::transient(format!(
                "Kafka broker unreachable: the broker did not confirm the record for topic {topic:?} ({:?})",
                meta.delivery
            ))),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(BrokerError::transient(format!(
                "Kafka broker unreachable: no answer for topic {topic:?} within {bound:?}"
            ))),
        }
    }
}
