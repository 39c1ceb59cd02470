//! From a broker message to an inbox event (contract R137, R138, R141), in one place.
//!
//! [`BrokerMessage`] is what a subscription hands over, broker by broker; [`decode`] maps it to a
//! [`NewInboxEvent`] of the runner's group, or says why it is invalid ([`InvalidMessage`],
//! R139). Names are looked up exactly, in R137's order; a name that is present is used even when
//! blank, and then refused. Checked by conformance scenarios E-01 to E-06.

use serde_json::Value;

use crate::inbox::model::{ConsumerGroup, InvalidLabel, InvalidMessage, NewInboxEvent};

/// The names R137 maps to columns, and the outbox's other message attributes (R50), none of
/// which is stored as a header (R141, D24).
pub const MAPPED_NAMES: [&str; 14] = [
    "message_id",
    "event_id",
    "source",
    "source_service",
    "topic",
    "event_type",
    "partition_key",
    "trace_id",
    "correlation_id",
    "causation_id",
    "schema_version",
    "aggregate_type",
    "aggregate_id",
    "created_at",
];

/// A message as a broker delivered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerMessage {
    /// A NATS JetStream message.
    Nats {
        /// Stream name.
        stream: String,
        /// Stream sequence.
        sequence: u64,
        /// Subject.
        subject: String,
        /// The subject prefix the source is read under (R53), e.g. `in.`.
        subject_prefix: String,
        /// Headers in order, repeats kept.
        headers: Vec<(String, String)>,
        /// The body.
        body: Vec<u8>,
    },
    /// A Redis Streams entry.
    Redis {
        /// Stream key.
        stream_key: String,
        /// The key prefix the source is read under (R53), e.g. `in:`.
        key_prefix: String,
        /// Entry id.
        entry_id: String,
        /// Fields in order.
        fields: Vec<(String, String)>,
    },
}

impl BrokerMessage {
    /// The broker position: `{stream}:{sequence}` or `{stream key}:{entry id}` (R138).
    pub fn position(&self) -> String {
        match self {
            BrokerMessage::Nats {
                stream, sequence, ..
            } => format!("{stream}:{sequence}"),
            BrokerMessage::Redis {
                stream_key,
                entry_id,
                ..
            } => format!("{stream_key}:{entry_id}"),
        }
    }

    fn attrs(&self) -> &[(String, String)] {
        match self {
            BrokerMessage::Nats { headers, .. } => headers,
            BrokerMessage::Redis { fields, .. } => fields,
        }
    }

    fn attr(&self, name: &str) -> Option<&str> {
        self.attrs()
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    fn first_of(&self, names: &[&str]) -> Option<&str> {
        names.iter().find_map(|n| self.attr(n))
    }
}

/// Decoding settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// A message without an id is invalid instead of getting its position as id (R138).
    pub require_message_id: bool,
    /// max_attempts of the landed row (R103; 0 means 6).
    pub max_attempts: u32,
}

/// Decodes a message for `group` (R137 to R139, R141).
pub fn decode(
    msg: &BrokerMessage,
    group: &ConsumerGroup,
    opts: DecodeOptions,
) -> Result<NewInboxEvent, InvalidMessage> {
    // The payload first (R139's order).
    let body: &[u8] = match msg {
        BrokerMessage::Nats { body, .. } => body,
        BrokerMessage::Redis { .. } => msg
            .attr("payload")
            .ok_or_else(|| InvalidMessage::new(InvalidLabel::NotJson, "payload field missing"))?
            .as_bytes(),
    };
    let payload: Value = serde_json::from_slice(body)
        .map_err(|_| InvalidMessage::new(InvalidLabel::NotJson, "body is not JSON"))?;
    let id_names: &[&str] = match msg {
        BrokerMessage::Nats { .. } => &["message_id", "event_id", "Nats-Msg-Id"],
        BrokerMessage::Redis { .. } => &["message_id", "event_id"],
    };
    let message_id = match msg.first_of(id_names) {
        Some(id) => id.to_owned(),
        None if opts.require_message_id => String::new(),
        None => msg.position(),
    };
    let source = match msg.first_of(&["source", "source_service", "topic"]) {
        Some(s) => s.to_owned(),
        None => match msg {
            BrokerMessage::Nats {
                subject,
                subject_prefix,
                ..
            } => subject
                .strip_prefix(subject_prefix.as_str())
                .unwrap_or(subject)
                .to_owned(),
            BrokerMessage::Redis {
                stream_key,
                key_prefix,
                ..
            } => stream_key
                .strip_prefix(key_prefix.as_str())
                .unwrap_or(stream_key)
                .to_owned(),
        },
    };
    let event_type = match msg.attr("event_type") {
        Some(t) => t.to_owned(),
        None => payload
            .get("event_type")
            .and_then(Value::as_str)
            .filter(|t| !crate::event::trim_ancestor(t).is_empty())
            .map(str::to_owned)
            .unwrap_or_else(|| source.clone()),
    };
    let (headers, headers_problem) = stored_headers(msg);
    let mut b = NewInboxEvent::builder()
        .consumer_group(group.as_str())
        .source(source)
        .event_type(event_type)
        .payload_json(payload)
        .headers(headers)
        .max_attempts(opts.max_attempts);
    if !message_id.is_empty() || msg.first_of(id_names).is_some() {
        b = b.message_id(message_id);
    } else {
        // require_message_id and no id: the payload is checked first, then this (R139).
        b = b.message_id("-");
    }
    for name in [
        "partition_key",
        "trace_id",
        "correlation_id",
        "causation_id",
        "schema_version",
    ] {
        if let Some(v) = msg.attr(name) {
            b = match name {
                "partition_key" => b.partition_key(v),
                "trace_id" => b.trace_id(v),
                "correlation_id" => b.correlation_id(v),
                "causation_id" => b.causation_id(v),
                _ => b.schema_version(v),
            };
        }
    }
    let event = b.build()?;
    if let Some(p) = headers_problem {
        return Err(p);
    }
    if opts.require_message_id && msg.first_of(id_names).is_none() {
        return Err(InvalidMessage::new(
            InvalidLabel::Field,
            "message_id: missing",
        ));
    }
    Ok(event)
}

/// The headers R141 stores, and a problem found while reading them (a repeated NATS header, a
/// Redis `headers` field that is not a JSON object of strings).
fn stored_headers(msg: &BrokerMessage) -> (Vec<(String, String)>, Option<InvalidMessage>) {
    let bad = |what: String| InvalidMessage::new(InvalidLabel::Headers, format!("headers: {what}"));
    let mapped = |k: &str| MAPPED_NAMES.contains(&k);
    match msg {
        BrokerMessage::Nats { headers, .. } => {
            let mut seen = std::collections::HashSet::new();
            let mut problem = None;
            let mut out = Vec::new();
            for (k, v) in headers {
                if mapped(k) || k.to_ascii_lowercase().starts_with("nats-") {
                    continue;
                }
                if !seen.insert(k.clone()) {
                    problem.get_or_insert_with(|| bad(format!("repeated key {k}")));
                    continue;
                }
                out.push((k.clone(), v.clone()));
            }
            (out, problem)
        }
        BrokerMessage::Redis { fields, .. } => {
            let mut out = Vec::new();
            let mut problem = None;
            for (k, v) in fields {
                if k == "headers" {
                    match serde_json::from_str::<serde_json::Map<String, Value>>(v) {
                        Ok(m) if m.values().all(Value::is_string) => {
                            for (hk, hv) in m {
                                if !mapped(&hk) {
                                    out.push((hk, hv.as_str().unwrap_or_default().to_owned()));
                                }
                            }
                        }
                        _ => problem = Some(bad("not a JSON object of strings".into())),
                    }
                } else if k != "payload" && !mapped(k) {
                    out.push((k.clone(), v.clone()));
                }
            }
            (out, problem)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nats(headers: &[(&str, &str)], body: &str) -> BrokerMessage {
        BrokerMessage::Nats {
            stream: "S".into(),
            sequence: 17,
            subject: "in.src".into(),
            subject_prefix: "in.".into(),
            headers: headers
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            body: body.as_bytes().to_vec(),
        }
    }

    fn g() -> ConsumerGroup {
        ConsumerGroup::new("g").unwrap()
    }

    #[test]
    fn ids_and_sources() {
        let o = DecodeOptions::default();
        let e = decode(
            &nats(&[("message_id", "a"), ("event_id", "b")], "{\"n\":1}"),
            &g(),
            o,
        )
        .unwrap();
        assert_eq!(e.message_id(), "a");
        let e = decode(&nats(&[], "{\"n\":1}"), &g(), o).unwrap();
        assert_eq!(e.message_id(), "S:17");
        assert_eq!(e.source(), "src");
        let r = decode(
            &nats(&[], "{\"n\":1}"),
            &g(),
            DecodeOptions {
                require_message_id: true,
                max_attempts: 0,
            },
        )
        .unwrap_err();
        assert_eq!(r.to_string(), "invalid message: message_id: missing");
        let e = decode(
            &nats(&[("topic", "t")], "{\"event_type\":\"x.y\"}"),
            &g(),
            o,
        )
        .unwrap();
        assert_eq!((e.source(), e.event_type()), ("t", "x.y"));
        let e = decode(
            &nats(&[("source_service", "s2"), ("topic", "t")], "{\"n\":1}"),
            &g(),
            o,
        )
        .unwrap();
        assert_eq!((e.source(), e.event_type()), ("s2", "s2"));
        let r = decode(
            &nats(&[("tenant", "a"), ("tenant", "b")], "{\"n\":1}"),
            &g(),
            o,
        )
        .unwrap_err();
        assert_eq!(r.reason, "headers: repeated key tenant");
        let r = decode(&nats(&[], "{\"x\": 1e999}"), &g(), o).unwrap_err();
        assert_eq!(r.reason, "body is not JSON");
    }
}
