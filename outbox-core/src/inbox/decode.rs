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
    /// A Kafka record (R179); decoded by its own column of R137 ([`decode`] hands it to the
    /// Kafka part).
    Kafka {
        /// The record's topic.
        topic: String,
        /// The topic prefix the source is read under (R86), e.g. `in.`.
        topic_prefix: String,
        /// Partition.
        partition: i32,
        /// Offset in the partition.
        offset: i64,
        /// The record key; none for a record without one.
        key: Option<Vec<u8>>,
        /// Headers in order, repeats kept; a value is none for a null header value.
        headers: Vec<(String, Option<Vec<u8>>)>,
        /// The record value; none for a tombstone.
        value: Option<Vec<u8>>,
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
            BrokerMessage::Kafka {
                topic,
                partition,
                offset,
                ..
            } => kafka_position(topic, *partition, *offset),
        }
    }

    fn attrs(&self) -> &[(String, String)] {
        match self {
            BrokerMessage::Nats { headers, .. } => headers,
            BrokerMessage::Redis { fields, .. } => fields,
            // The Kafka column reads its own headers (`decode_kafka`).
            BrokerMessage::Kafka { .. } => &[],
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
    if let BrokerMessage::Kafka { .. } = msg {
        return decode_kafka(msg, group, opts);
    }
    // The payload first (R139's order).
    let body: &[u8] = match msg {
        BrokerMessage::Nats { body, .. } => body,
        BrokerMessage::Kafka { .. } => unreachable!("decoded by decode_kafka"),
        BrokerMessage::Redis { .. } => msg
            .attr("payload")
            .ok_or_else(|| InvalidMessage::new(InvalidLabel::NotJson, "payload field missing"))?
            .as_bytes(),
    };
    let payload: Value = serde_json::from_slice(body)
        .map_err(|_| InvalidMessage::new(InvalidLabel::NotJson, "body is not JSON"))?;
    let id_names: &[&str] = match msg {
        BrokerMessage::Nats { .. } => &["message_id", "event_id", "Nats-Msg-Id"],
        BrokerMessage::Redis { .. } | BrokerMessage::Kafka { .. } => &["message_id", "event_id"],
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
            BrokerMessage::Kafka { .. } => unreachable!("decoded by decode_kafka"),
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
        BrokerMessage::Kafka { .. } => (Vec::new(), None),
    }
}

/// A Kafka record's position, `{topic}:{partition}:{offset}` (R138).
fn kafka_position(topic: &str, partition: i32, offset: i64) -> String {
    format!("{topic}:{partition}:{offset}")
}

/// The names the Kafka column reads besides [`MAPPED_NAMES`]: Debezium's `id` (R141).
const KAFKA_READ_NAMES: [&str; 1] = ["id"];

/// A Kafka record's headers as R179 takes them: values that are UTF-8 (a null value or one
/// that is not UTF-8 is skipped), in order; and the first name that occurs twice.
fn kafka_headers(headers: &[(String, Option<Vec<u8>>)]) -> (Vec<(&str, &str)>, Option<&str>) {
    let mut seen = std::collections::HashSet::new();
    let mut repeated = None;
    let mut out = Vec::new();
    for (k, v) in headers {
        if !seen.insert(k.as_str()) {
            repeated.get_or_insert(k.as_str());
        }
        if let Some(v) = v.as_deref().and_then(|v| std::str::from_utf8(v).ok()) {
            out.push((k.as_str(), v));
        }
    }
    (out, repeated)
}

/// The inbox key a Kafka record key gives (R179): its text when it is UTF-8 of 1 to 255
/// characters after trimming without U+0000, else `sha256:` + the hex SHA-256 of its bytes;
/// none for a record without a key or with an empty one.
pub fn kafka_key_partition_key(key: Option<&[u8]>) -> Option<String> {
    use sha2::Digest;
    let key = key.filter(|k| !k.is_empty())?;
    if let Ok(text) = std::str::from_utf8(key) {
        let t = crate::event::trim_ancestor(text);
        let chars = t.chars().count();
        if (1..=crate::inbox::model::inbox_limits::PARTITION_KEY_MAX).contains(&chars)
            && !t.contains('\0')
        {
            return Some(t.to_owned());
        }
    }
    let digest = sha2::Sha256::digest(key);
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in digest {
        out.push_str(&format!("{b:02x}"));
    }
    Some(out)
}

/// R137's Kafka column with R179 and R180: headers by name, the record key as the inbox key, the
/// value as the payload.
fn decode_kafka(
    msg: &BrokerMessage,
    group: &ConsumerGroup,
    opts: DecodeOptions,
) -> Result<NewInboxEvent, InvalidMessage> {
    let BrokerMessage::Kafka {
        topic,
        topic_prefix,
        key,
        headers,
        value,
        ..
    } = msg
    else {
        return Err(InvalidMessage::new(
            InvalidLabel::NotJson,
            "not a Kafka record",
        ));
    };
    let value = value
        .as_deref()
        .ok_or_else(|| InvalidMessage::new(InvalidLabel::NotJson, "record has no value"))?;
    let payload: Value = serde_json::from_slice(value)
        .map_err(|_| InvalidMessage::new(InvalidLabel::NotJson, "body is not JSON"))?;
    let (present, repeated) = kafka_headers(headers);
    let attr = |name: &str| present.iter().find(|(k, _)| *k == name).map(|(_, v)| *v);
    let first_of = |names: &[&str]| names.iter().find_map(|n| attr(n));
    let id = first_of(&["message_id", "event_id", "id", "ce_id"]);
    let message_id = match id {
        Some(id) => id.to_owned(),
        // require_message_id and no id: the payload is checked first, then this (R139).
        None if opts.require_message_id => "-".to_owned(),
        None => msg.position(),
    };
    let source = match first_of(&["source", "source_service", "topic"]) {
        Some(s) => s.to_owned(),
        None => topic
            .strip_prefix(topic_prefix.as_str())
            .unwrap_or(topic)
            .to_owned(),
    };
    let event_type = match first_of(&["event_type", "ce_type"]) {
        Some(t) => t.to_owned(),
        None => payload
            .get("event_type")
            .and_then(Value::as_str)
            .filter(|t| !crate::event::trim_ancestor(t).is_empty())
            .map(str::to_owned)
            .unwrap_or_else(|| source.clone()),
    };
    let cloudevents = attr("ce_specversion").is_some();
    let mut seen = std::collections::HashSet::new();
    // A repeated name is refused below with its own reason; its first value stands until then.
    let stored: Vec<(String, String)> = present
        .iter()
        .filter(|(k, _)| seen.insert(*k))
        .filter(|(k, _)| {
            let read = MAPPED_NAMES.contains(k) || KAFKA_READ_NAMES.contains(k);
            let cloudevents_attr =
                k.starts_with("ce_") || (cloudevents && k.eq_ignore_ascii_case("content-type"));
            !(read || cloudevents_attr)
        })
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let mut b = NewInboxEvent::builder()
        .consumer_group(group.as_str())
        .source(source)
        .event_type(event_type)
        .payload_json(payload)
        .headers(stored)
        .max_attempts(opts.max_attempts)
        .message_id(message_id);
    let partition_key = match first_of(&["partition_key", "ce_partitionkey"]) {
        Some(p) => Some(p.to_owned()),
        None => kafka_key_partition_key(key.as_deref()),
    };
    if let Some(p) = partition_key {
        b = b.partition_key(p);
    }
    for (name, fallback) in [
        ("trace_id", None),
        ("correlation_id", Some("ce_correlationid")),
        ("causation_id", Some("ce_causationid")),
        ("schema_version", None),
    ] {
        if let Some(v) = attr(name).or_else(|| fallback.and_then(attr)) {
            b = match name {
                "trace_id" => b.trace_id(v),
                "correlation_id" => b.correlation_id(v),
                "causation_id" => b.causation_id(v),
                _ => b.schema_version(v),
            };
        }
    }
    let event = b.build()?;
    if let Some(name) = repeated {
        return Err(InvalidMessage::new(
            InvalidLabel::Headers,
            format!("headers: repeated key {name}"),
        ));
    }
    if opts.require_message_id && id.is_none() {
        return Err(InvalidMessage::new(
            InvalidLabel::Field,
            "message_id: missing",
        ));
    }
    Ok(event)
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

    #[test]
    fn kafka_keys() {
        // The digest is SHA-256 (FIPS 180-4's "abc" vector), so `sha256:` keys agree with any
        // other implementation.
        use sha2::Digest;
        let abc: String = sha2::Sha256::digest(b"abc")
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            abc,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        // Short text is the key itself, trimmed; anything else hashes; empty or none: none.
        assert_eq!(
            kafka_key_partition_key(Some(b" acct-1 ")).as_deref(),
            Some("acct-1")
        );
        let hashed = |k: &[u8]| {
            let d: String = sha2::Sha256::digest(k)
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect();
            Some(format!("sha256:{d}"))
        };
        assert_eq!(kafka_key_partition_key(Some(b"   ")), hashed(b"   "));
        assert_eq!(kafka_key_partition_key(Some(b"a\0b")), hashed(b"a\0b"));
        assert_eq!(kafka_key_partition_key(Some(&[0xff])), hashed(&[0xff]));
        let long = "é".repeat(256);
        assert_eq!(
            kafka_key_partition_key(Some(long.as_bytes())),
            hashed(long.as_bytes())
        );
        let max = "é".repeat(255);
        assert_eq!(
            kafka_key_partition_key(Some(max.as_bytes())),
            Some(max.clone())
        );
        assert_eq!(kafka_key_partition_key(Some(b"")), None);
        assert_eq!(kafka_key_partition_key(None), None);
    }
}
