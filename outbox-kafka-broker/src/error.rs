//! The error type of this crate (configuration and start-up) and R88's mapping of what happened
//! to a record onto [`txoutbox_core::BrokerError`].

use krafka::error::{ErrorCode, KrafkaError};
use thiserror::Error;
use txoutbox_core::BrokerError;

/// A Kafka broker adapter could not be configured or started.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum KafkaBrokerError {
    /// A setting is out of range or malformed; the message names the setting and the fix.
    #[error("invalid Kafka broker configuration: {0}")]
    Config(String),
    /// No bootstrap broker answered (or the connection's authentication was refused).
    /// Transient: try again later.
    #[error(
        "Kafka broker unreachable: {message}; check the brokers ({brokers}), TLS and SASL settings"
    )]
    Connect {
        /// The bootstrap brokers.
        brokers: String,
        /// What the client said.
        message: String,
    },
    /// Idempotence is on and the broker granted no producer id (R87). Not transient for a
    /// broker that lacks the feature: set idempotence off to send without one.
    #[error("{0}")]
    NoIdempotentProducer(String),
}

impl KafkaBrokerError {
    /// Whether trying again later can succeed without a change of configuration.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Connect { .. })
    }
}

/// The text of R87's failed start.
pub(crate) fn no_idempotent_producer(answer: &str) -> String {
    format!(
        "Kafka: the broker did not grant an idempotent producer: {answer}; set idempotence off to send without one"
    )
}

/// A Kafka protocol error code's name as the protocol spells it (`NOT_ENOUGH_REPLICAS`).
pub fn code_name(code: ErrorCode) -> String {
    // Where the client's variant name differs from the protocol's.
    match i16::from(code) {
        6 => return "NOT_LEADER_OR_FOLLOWER".into(),
        17 => return "INVALID_TOPIC_EXCEPTION".into(),
        56 => return "KAFKA_STORAGE_ERROR".into(),
        _ => {}
    }
    let camel = format!("{code:?}");
    let mut out = String::with_capacity(camel.len() + 8);
    for (i, c) in camel.chars().enumerate() {
        if c.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_uppercase());
    }
    out
}

/// `NAME (code)`.
pub fn code_text(code: ErrorCode) -> String {
    format!("{} ({})", code_name(code), i16::from(code))
}

/// R88's transient codes (after the client's own resends).
fn transient_code(code: ErrorCode, idempotent: bool) -> bool {
    use ErrorCode as E;
    matches!(
        code,
        E::CorruptMessage
            | E::LeaderNotAvailable
            | E::NotLeaderForPartition
            | E::RequestTimedOut
            | E::BrokerNotAvailable
            | E::NetworkException
            | E::NotEnoughReplicas
            | E::NotEnoughReplicasAfterAppend
            | E::KafkaStorageException
            | E::SaslAuthenticationFailed
    ) || (idempotent
        && matches!(
            code,
            E::OutOfOrderSequenceNumber | E::InvalidProducerEpoch | E::UnknownProducerId
        ))
}

/// Maps the outcome the client reports for a record (R88).
/// Whether a failed send says the broker lost the idempotent producer's identity or sequences
/// (UNKNOWN_PRODUCER_ID, OUT_OF_ORDER_SEQUENCE_NUMBER, INVALID_PRODUCER_EPOCH): the producer is
/// rebuilt with a new id.
pub(crate) fn producer_identity_lost(e: &KrafkaError) -> bool {
    match e {
        KrafkaError::OutOfOrderSequence { .. } => true,
        KrafkaError::Broker { code, .. } => matches!(
            code,
            ErrorCode::OutOfOrderSequenceNumber
                | ErrorCode::UnknownProducerId
                | ErrorCode::InvalidProducerEpoch
        ),
        _ => false,
    }
}

pub(crate) fn map_send_error(e: &KrafkaError, topic: &str, idempotent: bool) -> BrokerError {
    let unreachable =
        |cause: String| BrokerError::transient(format!("Kafka broker unreachable: {cause}"));
    match e {
        KrafkaError::Broker { code, message } => {
            if transient_code(*code, idempotent) {
                unreachable(format!("{} for topic {topic:?}", code_text(*code)))
            } else if *code == ErrorCode::UnknownTopicOrPartition {
                BrokerError::rejected(format!("Kafka: topic {topic:?} does not exist"))
            } else {
                let mut text = format!(
                    "Kafka refused the record for topic {topic:?}: {}",
                    code_text(*code)
                );
                if !message.is_empty() {
                    text.push_str(": ");
                    text.push_str(message);
                }
                BrokerError::rejected(text)
            }
        }
        KrafkaError::Config { message } => BrokerError::rejected(format!(
            "Kafka: the record for topic {topic:?} cannot be sent: {message}"
        )),
        KrafkaError::DeliveryTimeout { message, .. } => unreachable(format!(
            "no answer for topic {topic:?} within the delivery timeout: {message}"
        )),
        other => unreachable(format!("{other} (topic {topic:?})")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_names_are_the_protocol_names() {
        assert_eq!(
            code_text(ErrorCode::NotEnoughReplicas),
            "NOT_ENOUGH_REPLICAS (19)"
        );
        assert_eq!(
            code_text(ErrorCode::MessageTooLarge),
            "MESSAGE_TOO_LARGE (10)"
        );
        assert_eq!(
            code_text(ErrorCode::UnknownServerError),
            "UNKNOWN_SERVER_ERROR (-1)"
        );
    }

    #[test]
    fn r88_table() {
        let b = |code| KrafkaError::Broker {
            code,
            message: String::new(),
        };
        let t = "ob.orders";
        for code in [
            ErrorCode::NotEnoughReplicas,
            ErrorCode::NotLeaderForPartition,
            ErrorCode::RequestTimedOut,
            ErrorCode::KafkaStorageException,
        ] {
            assert!(
                map_send_error(&b(code), t, false).is_transient(),
                "{code:?}"
            );
        }
        let e = map_send_error(&b(ErrorCode::NotEnoughReplicas), t, false);
        assert_eq!(
            e.to_string(),
            "Kafka broker unreachable: NOT_ENOUGH_REPLICAS (19) for topic \"ob.orders\""
        );
        assert!(map_send_error(&b(ErrorCode::UnknownProducerId), t, true).is_transient());
        assert!(!map_send_error(&b(ErrorCode::UnknownProducerId), t, false).is_transient());
        let e = map_send_error(&b(ErrorCode::MessageTooLarge), t, true);
        assert!(!e.is_transient());
        assert_eq!(
            e.to_string(),
            "Kafka refused the record for topic \"ob.orders\": MESSAGE_TOO_LARGE (10)"
        );
        let e = map_send_error(&b(ErrorCode::TopicAuthorizationFailed), t, true);
        assert!(!e.is_transient(), "authorization concerns one topic");
        let e = map_send_error(&b(ErrorCode::SaslAuthenticationFailed), t, true);
        assert!(e.is_transient(), "authentication concerns the connection");
        let e = map_send_error(&b(ErrorCode::UnknownTopicOrPartition), t, true);
        assert_eq!(e.to_string(), "Kafka: topic \"ob.orders\" does not exist");
    }
}
