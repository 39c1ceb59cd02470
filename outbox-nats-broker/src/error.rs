//! The error type of this crate: configuration and start-up failures.
//!
//! Publish failures are not reported through this type: [`crate::NatsBroker`] implements
//! [`txoutbox_core::Broker`], whose errors are [`txoutbox_core::BrokerError`] (transient or
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
    /// No JetStream stream covers the subjects the adapter publishes to: every publish would
    /// be refused, so this configuration can never publish (found at start-up by
    /// [`crate::NatsBroker::check_streams`]).
    #[error(
        "no JetStream stream covers the subjects {subjects:?} this adapter publishes to, so every publish would be refused; create a stream whose subjects include {subjects:?} (or configure ensure_stream; in outbox-relay, --nats-stream), or fix the subject prefix"
    )]
    NoStream {
        /// The subjects looked for (the prefix followed by `>`).
        subjects: String,
    },
    /// JetStream did not answer the start-up check of the streams (not enabled, restarting,
    /// or the check timed out).
    #[error(
        "could not check which JetStream stream covers {subjects:?}: {message}; is nats-server running with JetStream (-js), and may this user call the JetStream API?"
    )]
    StreamCheck {
        /// The subjects looked for.
        subjects: String,
        /// What the server or the client said.
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
