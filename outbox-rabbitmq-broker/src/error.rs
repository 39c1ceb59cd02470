//! The error type of this crate: configuration and start-up failures.
//!
//! Publish failures are not reported through this type: [`crate::RabbitMqBroker`] implements
//! [`txoutbox_core::Broker`], whose errors are [`txoutbox_core::BrokerError`] (transient or
//! rejected; the mapping is in the crate documentation, R90).

use thiserror::Error;

/// A RabbitMQ broker adapter could not be configured or started.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RabbitMqBrokerError {
    /// A setting is out of range or malformed; the message names the setting and the fix.
    #[error("invalid RabbitMQ broker configuration: {0}")]
    Config(String),
    /// The connection to the broker failed (refused, timed out, credentials or virtual host
    /// refused). Transient: try again later.
    #[error(
        "could not connect to RabbitMQ at {uri}: {message}; check the URI (user, password, virtual host) and that rabbitmq-server runs"
    )]
    Connect {
        /// The URI given, password redacted.
        uri: String,
        /// What the client said, passwords redacted.
        message: String,
    },
    /// The start check failed: the exchange does not exist (and is not to be declared), or it
    /// could not be declared. Not transient: fix the exchange or the configuration.
    #[error("RabbitMQ exchange {exchange:?}: {message}")]
    Exchange {
        /// The exchange.
        exchange: String,
        /// What the broker said, and the fix.
        message: String,
    },
    /// A queue the inbox subscription is to consume does not exist (R177). Not transient:
    /// declare and bind it, then start again.
    #[error("RabbitMQ queue {queue:?} does not exist")]
    NoQueue {
        /// The queue.
        queue: String,
    },
}

impl RabbitMqBrokerError {
    /// Whether trying again later can succeed without a change of configuration.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Connect { .. })
    }
}
