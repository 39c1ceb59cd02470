#![doc = include_str!("../README.md")]
#![deny(missing_docs)]

mod config;
mod error;
pub mod message;
mod subscription;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind};
use tokio::time::Instant;
use txoutbox_core::broker::{Probe, ReconnectSignal, ReconnectWatch};
use txoutbox_core::{Ack, Broker, BrokerError, Message};

pub use config::{
    DEFAULT_CONFIRM_TIMEOUT, DEFAULT_CONNECT_TIMEOUT, ExchangeType, MAX_ROUTING_KEY_BYTES,
    RabbitMqBrokerConfig, RabbitMqTls,
};
pub use error::RabbitMqBrokerError;
/// The AMQP client this adapter is built on, for applications that name its types.
pub use lapin;
pub use subscription::{
    DEAD_LETTER_SUFFIX, DEFAULT_CONSUMER_TIMEOUT, DEFAULT_HOLD_MAX, DeadLetterMode, QueueType,
    RabbitDelivery, RabbitSubscription, RabbitSubscriptionConfig, RabbitTransport, amqp_value,
};
pub use txoutbox_core::cloudevents::MessageFormat;

/// The AMQP reply code of a channel closed for a resource error (R90: transient).
const RESOURCE_ERROR: u16 = 506;
/// The reply code of a returned (unroutable) message.
const NO_ROUTE: u16 = 312;
/// Idle confirm channels kept for the next publishes.
const MAX_IDLE_CHANNELS: usize = 64;

/// A [`Broker`] publishing to RabbitMQ on channels in confirm mode with the mandatory flag
/// (R89, R90). Cloning shares the connection and its channels.
#[derive(Clone)]
pub struct RabbitMqBroker {
    inner: Arc<Inner>,
}

struct Inner {
    config: RabbitMqBrokerConfig,
    conn: tokio::sync::Mutex<Option<Arc<Connection>>>,
    idle: std::sync::Mutex<Vec<Channel>>,
    blocked: Arc<AtomicBool>,
    reconnected: ReconnectSignal,
}

impl std::fmt::Debug for RabbitMqBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitMqBroker")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

impl RabbitMqBroker {
    /// Connects and runs the start check ([`check`](Self::check)): fails when the broker cannot
    /// be reached within the connect timeout, or the exchange does not exist (and is not to be
    /// declared). After this, a lost connection is opened again by the next publish or probe.
    pub async fn connect(config: RabbitMqBrokerConfig) -> Result<Self, RabbitMqBrokerError> {
        let b = Self::connect_lazy(config)?;
        b.check().await?;
        Ok(b)
    }

    /// Builds the adapter without a broker: every publish is a transient failure until a
    /// connection can be opened (each publish and probe tries). Call [`check`](Self::check)
    /// once the broker is there to verify the exchange.
    pub fn connect_lazy(config: RabbitMqBrokerConfig) -> Result<Self, RabbitMqBrokerError> {
        config.validate()?;
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                conn: tokio::sync::Mutex::new(None),
                idle: std::sync::Mutex::new(Vec::new()),
                blocked: Arc::new(AtomicBool::new(false)),
                reconnected: ReconnectSignal::new(),
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RabbitMqBrokerConfig {
        &self.inner.config
    }

    /// The start check (R89): connects, then checks that the exchange exists (a passive
    /// declare), or declares it (durable) when [`RabbitMqBrokerConfig::declare_exchange`] says
    /// so. The default exchange always exists.
    pub async fn check(&self) -> Result<(), RabbitMqBrokerError> {
        let cfg = &self.inner.config;
        let conn = self
            .connection()
            .await
            .map_err(|message| RabbitMqBrokerError::Connect {
                uri: txoutbox_core::redact::secrets(&cfg.uri),
                message,
            })?;
        if cfg.exchange.is_empty() {
            return Ok(());
        }
        let connect_err = |e: lapin::Error| RabbitMqBrokerError::Connect {
            uri: txoutbox_core::redact::secrets(&cfg.uri),
            message: txoutbox_core::redact::secrets(&e.to_string()),
        };
        let ch = tokio::time::timeout(cfg.connect_timeout, conn.create_channel())
            .await
            .map_err(|_| RabbitMqBrokerError::Connect {
                uri: txoutbox_core::redact::secrets(&cfg.uri),
                message: "no channel opened within the connect timeout".into(),
            })?
            .map_err(connect_err)?;
        let (kind, options) = match cfg.declare_exchange {
            None => (
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
            ),
            Some(t) => (
                exchange_kind(t),
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
            ),
        };
        let declared = ch
            .exchange_declare(
                cfg.exchange.as_str().into(),
                kind,
                options,
                FieldTable::default(),
            )
            .await;
        let _ = ch.close(200, "start check done".into()).await;
        declared.map_err(|e| RabbitMqBrokerError::Exchange {
            exchange: cfg.exchange.clone(),
            message: match cfg.declare_exchange {
                None => format!(
                    "the passive declare failed ({e}); declare the exchange (durable) before the relay starts, or set declare_exchange"
                ),
                Some(_) => format!("could not be declared: {e}"),
            },
        })
    }

    /// Whether a connection is open right now.
    pub async fn is_connected(&self) -> bool {
        self.inner
            .conn
            .lock()
            .await
            .as_ref()
            .is_some_and(|c| c.status().connected())
    }

    /// The open connection, or a new one (within the connect timeout). The error text says
    /// why, passwords redacted.
    async fn connection(&self) -> Result<Arc<Connection>, String> {
        let mut slot = self.inner.conn.lock().await;
        if let Some(c) = slot.as_ref()
            && c.status().connected()
        {
            return Ok(c.clone());
        }
        if let Some(old) = slot.take() {
            self.inner.idle.lock().expect("idle channels").clear();
            drop(old);
        }
        let cfg = &self.inner.config;
        let conn = Arc::new(
            tokio::time::timeout(cfg.connect_timeout, open(cfg))
                .await
                .map_err(|_| {
                    format!(
                        "no connection within the connect timeout of {:?}",
                        cfg.connect_timeout
                    )
                })??,
        );
        self.inner.blocked.store(false, Ordering::SeqCst);
        watch_blocked(&conn, self.inner.blocked.clone());
        *slot = Some(conn.clone());
        drop(slot);
        tracing::info!(uri = %txoutbox_core::redact::secrets(&cfg.uri), "RabbitMQ connected");
        self.inner.reconnected.connected();
        Ok(conn)
    }

    /// An idle confirm channel, or a new one.
    async fn channel(&self) -> Result<Channel, String> {
        loop {
            let c = self.inner.idle.lock().expect("idle channels").pop();
            match c {
                Some(c) if c.status().connected() => return Ok(c),
                Some(_) => continue,
                None => break,
            }
        }
        let conn = self.connection().await?;
        let ch = conn
            .create_channel()
            .await
            .map_err(|e| txoutbox_core::redact::secrets(&e.to_string()))?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| txoutbox_core::redact::secrets(&e.to_string()))?;
        Ok(ch)
    }

    fn give_back(&self, ch: Channel) {
        let mut idle = self.inner.idle.lock().expect("idle channels");
        if idle.len() < MAX_IDLE_CHANNELS && ch.status().connected() {
            idle.push(ch);
        }
    }

    async fn send(&self, m: &Message, deadline: Instant) -> Result<Ack, BrokerError> {
        let cfg = &self.inner.config;
        let key = message::routing_key(cfg, m)?;
        let x = cfg.exchange.as_str();
        let unreachable =
            |cause: String| BrokerError::transient(format!("RabbitMQ broker unreachable: {cause}"));
        if self.inner.blocked.load(Ordering::SeqCst) {
            return Err(unreachable(
                "the connection is blocked by a resource alarm (connection.blocked)".into(),
            ));
        }
        let timed_out = || {
            unreachable(format!(
                "no confirm within the confirm timeout of {:?} (exchange {x:?}, routing key {key:?})",
                cfg.confirm_timeout
            ))
        };
        let ch = match tokio::time::timeout_at(deadline, self.channel()).await {
            Err(_) => return Err(timed_out()),
            Ok(Err(cause)) => return Err(unreachable(cause)),
            Ok(Ok(ch)) => ch,
        };
        let props = message::properties(cfg, m);
        let options = BasicPublishOptions {
            mandatory: true,
            ..Default::default()
        };
        let outcome = tokio::time::timeout_at(deadline, async {
            ch.basic_publish(x.into(), key.as_str().into(), options, &m.body, props)
                .await?
                .await
        })
        .await;
        match outcome {
            Err(_) => {
                // The channel still owes a confirm: it is not used again.
                tokio::spawn(async move {
                    let _ = ch.close(200, "confirm timed out".into()).await;
                });
                Err(timed_out())
            }
            Ok(Ok(Confirmation::Ack(None))) => {
                self.give_back(ch);
                Ok(Ack::default())
            }
            Ok(Ok(Confirmation::Ack(Some(ret)))) => {
                self.give_back(ch);
                let code = ret.reply_code;
                if code == NO_ROUTE {
                    Err(BrokerError::rejected(format!(
                        "RabbitMQ could not route the message: exchange {x:?}, routing key {key:?} ({code} {})",
                        ret.reply_text
                    )))
                } else {
                    Err(BrokerError::rejected(format!(
                        "RabbitMQ returned the message: exchange {x:?}, routing key {key:?} ({code} {})",
                        ret.reply_text
                    )))
                }
            }
            Ok(Ok(Confirmation::Nack(_))) => {
                self.give_back(ch);
                Err(BrokerError::transient(format!(
                    "RabbitMQ did not take the message (basic.nack): exchange {x:?}, routing key {key:?}"
                )))
            }
            Ok(Ok(Confirmation::NotRequested)) => Err(unreachable(
                "the channel was not in confirm mode; it is dropped".into(),
            )),
            Ok(Err(e)) => Err(map_error(&e)),
        }
    }
}

/// R90's table for a failed publish: a channel closed by the broker with any code but 506 is
/// a rejection (the message caused it); everything else is transient.
fn map_error(e: &lapin::Error) -> BrokerError {
    if let lapin::ErrorKind::ProtocolError(amqp) = e.kind()
        && e.is_amqp_soft_error()
        && amqp.get_id() != RESOURCE_ERROR
    {
        return BrokerError::rejected(format!(
            "RabbitMQ refused the message: {} {}",
            amqp.get_id(),
            amqp.get_message()
        ));
    }
    BrokerError::transient(format!(
        "RabbitMQ broker unreachable: {}",
        txoutbox_core::redact::secrets(&e.to_string())
    ))
}

fn exchange_kind(t: ExchangeType) -> ExchangeKind {
    match t {
        ExchangeType::Topic => ExchangeKind::Topic,
        ExchangeType::Direct => ExchangeKind::Direct,
        ExchangeType::Fanout => ExchangeKind::Fanout,
        ExchangeType::Headers => ExchangeKind::Headers,
    }
}

pub(crate) async fn open(cfg: &RabbitMqBrokerConfig) -> Result<Connection, String> {
    let mut props = ConnectionProperties::default();
    if let Some(name) = &cfg.connection_name {
        props = props.with_connection_name(name.as_str().into());
    }
    let redact = |e: lapin::Error| txoutbox_core::redact::secrets(&e.to_string());
    let tls = &cfg.tls;
    if tls.root_certificates.is_none() && tls.client_certificate.is_none() {
        return Connection::connect(&cfg.uri, props).await.map_err(redact);
    }
    let read = |p: &std::path::Path| {
        std::fs::read_to_string(p).map_err(|e| format!("could not read {}: {e}", p.display()))
    };
    let tls_config = lapin::tcp::OwnedTLSConfig {
        identity: match &tls.client_certificate {
            Some(p) => Some(lapin::tcp::OwnedIdentity::PKCS8 {
                pem: read(p)?.into_bytes(),
                key: read(p)?.into_bytes(),
            }),
            None => None,
        },
        cert_chain: match &tls.root_certificates {
            Some(p) => Some(read(p)?),
            None => None,
        },
    };
    lapin::ConnectionBuilder::new()
        .map_err(redact)?
        .with_uri_str(cfg.uri.clone())
        .with_properties(props)
        .with_tls_config(tls_config)
        .connect()
        .await
        .map_err(redact)
}

/// Follows connection.blocked / connection.unblocked: while blocked, a publish fails at once
/// (R90) instead of waiting for a confirm that cannot come.
fn watch_blocked(conn: &Connection, blocked: Arc<AtomicBool>) {
    use futures::StreamExt;
    let mut events = conn.events_listener();
    tokio::spawn(async move {
        while let Some(ev) = events.next().await {
            match ev {
                lapin::Event::ConnectionBlocked(reason) => {
                    tracing::warn!(%reason, "RabbitMQ blocked the connection (resource alarm)");
                    blocked.store(true, Ordering::SeqCst);
                }
                lapin::Event::ConnectionUnblocked => blocked.store(false, Ordering::SeqCst),
                _ => {}
            }
        }
    });
}

#[async_trait]
impl Broker for RabbitMqBroker {
    fn messaging_system(&self) -> &'static str {
        "rabbitmq"
    }

    /// The routing key (prefix + topic).
    fn destination_name(&self, m: &Message) -> String {
        self.inner.config.routing_key(&m.topic)
    }

    /// Moves each time the adapter opens a connection (its first, and each after a loss).
    fn reconnects(&self) -> Option<ReconnectWatch> {
        Some(self.inner.reconnected.watch())
    }

    /// One round trip: opens the connection if none is open, then a channel (channel.open is
    /// answered by the broker), and closes the channel. A black-holed connection never answers,
    /// and the loop counts that as `Down`.
    async fn probe(&self) -> Probe {
        let conn = match self.connection().await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!(error = %e, "RabbitMQ probe: no connection");
                return Probe::Down;
            }
        };
        match conn.create_channel().await {
            Ok(ch) => {
                let _ = ch.close(200, "probe".into()).await;
                Probe::Up
            }
            Err(e) => {
                tracing::debug!(error = %e, "RabbitMQ probe: no channel");
                Probe::Down
            }
        }
    }

    async fn publish(&self, m: &Message) -> Result<Ack, BrokerError> {
        let deadline = Instant::now() + self.inner.config.confirm_timeout;
        self.send(m, deadline).await
    }
}

impl RabbitMqBroker {
    /// The adapter's own bound on one publish (its confirm timeout); a relay's publish timeout
    /// must exceed it (R90).
    pub fn publish_bound(&self) -> Duration {
        self.inner.config.confirm_timeout
    }
}
