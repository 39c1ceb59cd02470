//! What one row becomes on Kafka (R86, and R91's Kafka binding).

use std::collections::BTreeMap;

use txoutbox_core::cloudevents::{self, MessageFormat};
use txoutbox_core::{BrokerError, Message};

use crate::config::KafkaBrokerConfig;

/// The longest topic name Kafka holds.
pub const MAX_TOPIC_LEN: usize = 249;

/// The header in which Debezium's outbox event router puts the event id (R86).
pub const ID_HEADER: &str = "id";

/// The prefix of the CloudEvents attribute headers in the Kafka binding.
pub const CLOUDEVENTS_HEADER_PREFIX: &str = "ce_";

/// Why Kafka cannot hold a topic name, or `None` when it can: only `a`-`z`, `A`-`Z`, `0`-`9`,
/// `.`, `_` and `-`, at most 249 characters, and neither `.` nor `..`.
pub fn topic_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() {
        return Some("it is empty");
    }
    if name == "." || name == ".." {
        return Some("it is \".\" or \"..\"");
    }
    if name.len() > MAX_TOPIC_LEN {
        return Some("it is longer than 249 characters");
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Some("it holds a character other than a-z, A-Z, 0-9, '.', '_' and '-'");
    }
    None
}

/// The Kafka topic of a message (prefix + topic), or R86's rejection.
pub fn topic(config: &KafkaBrokerConfig, m: &Message) -> Result<String, BrokerError> {
    let name = config.topic_for(&m.topic);
    match topic_problem(&name) {
        None => Ok(name),
        Some(_) => Err(BrokerError::rejected(format!(
            "Kafka: {name:?} is not a valid topic name"
        ))),
    }
}

/// The record's headers, each once: R50's attributes, `id` = the event id, and under
/// `cloudevents` the `ce_*` attributes and `content-type`; the added headers override event
/// headers of the same name.
pub fn headers(config: &KafkaBrokerConfig, m: &Message) -> BTreeMap<String, String> {
    let mut h = m.attributes.clone();
    h.insert(ID_HEADER.into(), m.event_id.hyphenated().to_string());
    if config.message_format == MessageFormat::CloudEvents {
        let source = config.cloudevents_source.as_deref().unwrap_or_default();
        for (name, value) in cloudevents::attributes(m, source) {
            h.insert(format!("{CLOUDEVENTS_HEADER_PREFIX}{name}"), value);
        }
        h.insert("content-type".into(), cloudevents::DATA_CONTENT_TYPE.into());
    }
    h
}

/// The size the adapter counts against `max_request_size`: key, value and headers.
pub fn size(m: &Message, headers: &BTreeMap<String, String>) -> usize {
    m.partition_key.len()
        + m.body.len()
        + headers
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_names_kafka_cannot_hold() {
        assert_eq!(topic_problem("ob.orders-1_a"), None);
        assert!(topic_problem("ob.bad topic!").is_some());
        assert!(topic_problem(".").is_some());
        assert!(topic_problem("..").is_some());
        assert!(topic_problem("").is_some());
        assert!(topic_problem(&"a".repeat(249)).is_none());
        assert!(topic_problem(&"a".repeat(250)).is_some());
        assert!(topic_problem("é").is_some());
    }
}
