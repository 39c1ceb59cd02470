//! The error type of this crate: configuration and start-up failures.
//!
//! Publish failures are not reported through this type: [`crate::NatsBroker`] implements
//! [`outbox_core::Broker`], whose errors are [`outbox_core::BrokerError`] (transient or
//! rejected; the mapping is in the crate documentation).

use thiserror::Error;

/// A NATS broker could not be configured or started.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum NatsBrokerError {
    /// A setting is out of range or malformed; the message names the setting and the fix.
    #[error("invalid NATS broker configuration: {0}")]
    Config(String),
    /// The first connection to the server failed.
    #[error(
        "could not connect to NATS at {url}: {message}; check the URL and that nats-server is running with JetStream (-js)"
    )]
    Connect {
        /// The server address given.
        url: String,
        /// What the client said.
        message: String,
    },
    /// The stream to ensure at start-up could not be looked up or created.
    #[error("could not ensure JetStream stream {stream:?}: {message}")]
    Stream {
        /// The stream name.
        stream: String,
        /// What the server said.
        message: String,
    },
}
