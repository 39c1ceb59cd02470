//! The CloudEvents binary content mode (R91), an opt-in message format of the broker adapters
//! whose broker has a CloudEvents protocol binding (Kafka, RabbitMQ/AMQP; NATS in its draft).
//!
//! `cloudevents` keeps everything the `plain` format sends (the body is still the payload, R50's
//! attributes are still headers) and adds the attributes of a CloudEvents 1.0 event whose data is
//! the body. This module computes those attributes once; each adapter writes them under its
//! binding's header names (`ce_` on Kafka, `cloudEvents_` on AMQP) and sends `datacontenttype`
//! the way its binding says (Kafka: the `content-type` header; AMQP: the content_type property).
//! Checked by scenario K-18.

use crate::broker::Message;

/// What an adapter sends (R91).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MessageFormat {
    /// R50 and the adapter's own rule (the default).
    #[default]
    Plain,
    /// `plain` plus the CloudEvents 1.0 attributes in binary content mode; needs a
    /// `cloudevents_source`.
    CloudEvents,
}

impl std::str::FromStr for MessageFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "plain" => Ok(Self::Plain),
            "cloudevents" => Ok(Self::CloudEvents),
            other => Err(format!(
                "message_format {other:?} is unknown; use plain or cloudevents"
            )),
        }
    }
}

/// The CloudEvents spec version sent as `specversion`.
pub const SPEC_VERSION: &str = "1.0";

/// The `datacontenttype` of every event: the body is the payload's compact JSON (R50).
pub const DATA_CONTENT_TYPE: &str = "application/json";

/// Checks a `cloudevents_source`: a URI-reference of printable ASCII without spaces (for
/// example `/orders-service` or `urn:example:orders`). The error says what is wrong.
pub fn check_source(source: Option<&str>) -> Result<&str, String> {
    let Some(s) = source else {
        return Err(
            "message_format cloudevents needs a cloudevents_source (a URI-reference such as /orders-service)"
                .into(),
        );
    };
    if s.is_empty() {
        return Err(
            "cloudevents_source is empty; give a URI-reference such as /orders-service".into(),
        );
    }
    if let Some(c) = s.chars().find(|c| !c.is_ascii_graphic()) {
        return Err(format!(
            "cloudevents_source {s:?} holds {c:?}; a URI-reference is printable ASCII without spaces (percent-encode the rest)"
        ));
    }
    Ok(s)
}

/// The CloudEvents attributes of a message, by their CloudEvents names, in this order:
/// `specversion`, `id` (the event id, hyphenated lowercase), `source`, `type` (event_type),
/// `time` (the `created_at` attribute, RFC 3339 in UTC with microseconds; absent when the
/// message has none), `partitionkey` (Partitioning extension), and `correlationid` and
/// `causationid` (Correlation extension) when set. Values are as they are; a binding that needs
/// an encoding (NATS) applies it. `datacontenttype` is not among them (see the module docs).
pub fn attributes(m: &Message, source: &str) -> Vec<(&'static str, String)> {
    let mut out = vec![
        ("specversion", SPEC_VERSION.to_owned()),
        ("id", m.event_id.hyphenated().to_string()),
        ("source", source.to_owned()),
        ("type", m.event_type.clone()),
    ];
    if let Some(t) = m.attributes.get("created_at") {
        out.push(("time", t.clone()));
    }
    out.push(("partitionkey", m.partition_key.clone()));
    for (attr, name) in [
        ("correlation_id", "correlationid"),
        ("causation_id", "causationid"),
    ] {
        if let Some(v) = m.attributes.get(attr) {
            out.push((name, v.clone()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::NewEvent;

    #[test]
    fn the_attributes_of_a_row_in_order() {
        let row = NewEvent::builder()
            .event_type("order créé")
            .aggregate("order", uuid::Uuid::nil())
            .topic("orders")
            .partition_key("acct 1")
            .correlation_id("c-1")
            .payload_json(serde_json::json!({"n": 1}))
            .build()
            .expect("valid")
            .into_row(
                chrono::DateTime::parse_from_rfc3339("2026-12-01T10:15:30.123456Z")
                    .expect("time")
                    .into(),
            );
        let m = Message::from_event(&row);
        let got = attributes(&m, "/orders-service");
        let id = row.id.hyphenated().to_string();
        assert_eq!(
            got,
            vec![
                ("specversion", "1.0".to_owned()),
                ("id", id),
                ("source", "/orders-service".to_owned()),
                ("type", "order créé".to_owned()),
                ("time", "2026-12-01T10:15:30.123456Z".to_owned()),
                ("partitionkey", "acct 1".to_owned()),
                ("correlationid", "c-1".to_owned()),
            ]
        );
    }

    #[test]
    fn a_source_must_be_printable_ascii_without_spaces() {
        assert_eq!(check_source(Some("/orders-service")), Ok("/orders-service"));
        assert_eq!(
            check_source(Some("urn:example:orders")),
            Ok("urn:example:orders")
        );
        assert!(
            check_source(None)
                .unwrap_err()
                .contains("needs a cloudevents_source")
        );
        assert!(check_source(Some("")).unwrap_err().contains("empty"));
        assert!(check_source(Some("/a b")).unwrap_err().contains("' '"));
        assert!(check_source(Some("/é")).is_err());
    }

    #[test]
    fn formats_parse_by_name() {
        assert_eq!("plain".parse(), Ok(MessageFormat::Plain));
        assert_eq!("cloudevents".parse(), Ok(MessageFormat::CloudEvents));
        assert!("structured".parse::<MessageFormat>().is_err());
    }
}
