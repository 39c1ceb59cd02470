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
    /// A RabbitMQ (AMQP 0-9-1) delivery; it has no position (R113, R177).
    RabbitMq {
        /// The queue it was consumed from.
        queue: String,
        /// The exchange it was published to (`""` for the default exchange).
        exchange: String,
        /// Its routing key.
        routing_key: String,
        /// The routing-key prefix the source is read under (R89), e.g. `in.`.
        routing_key_prefix: String,
        /// The message_id property.
        message_id: Option<String>,
        /// The type property.
        kind: Option<String>,
        /// The headers table, typed.
        headers: Vec<(String, AmqpValue)>,
        /// The body.
        body: Vec<u8>,
        /// Whether RabbitMQ set the redelivered flag (not decoded; for n and logs, R178).
        redelivered: bool,
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

/// A RabbitMQ header value, as R137 and R141 read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AmqpValue {
    /// A short or long string, or a byte array that is UTF-8: read and stored as it is.
    Text(String),
    /// An integer of any width: stored as its text (`3`), never read.
    Integer(i64),
    /// A decimal or floating-point number, as its text: stored, never read.
    Decimal(String),
    /// A boolean: stored as `true` or `false`, never read.
    Boolean(bool),
    /// Any other value (array, table, timestamp, void, a byte array that is not UTF-8), named by
    /// its kind: neither read nor stored.
    Other(String),
}

impl AmqpValue {
    /// The text R141 stores, or none for a value that is not stored.
    pub fn stored_text(&self) -> Option<String> {
        match self {
            AmqpValue::Text(s) | AmqpValue::Decimal(s) => Some(s.clone()),
            AmqpValue::Integer(i) => Some(i.to_string()),
            AmqpValue::Boolean(b) => Some(b.to_string()),
            AmqpValue::Other(_) => None,
        }
    }
}

impl BrokerMessage {
    /// The broker position: `{stream}:{sequence}` or `{stream key}:{entry id}` (R138); a
    /// RabbitMQ delivery has none, so for it this names the queue and the message_id property,
    /// for logs only.
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
            BrokerMessage::RabbitMq {
                queue, message_id, ..
            } => rabbitmq_label(queue, message_id.as_deref()),
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
            BrokerMessage::RabbitMq { .. } => &[],
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
    if let BrokerMessage::RabbitMq { .. } = msg {
        return decode_rabbitmq(msg, group, opts);
    }
    let (nats_ce, ce_problem) = nats_cloudevents(msg);
    let msg = nats_ce.as_ref().unwrap_or(msg);
    // The payload first (R139's order).
    let body: &[u8] = match msg {
        BrokerMessage::Nats { body, .. } | BrokerMessage::RabbitMq { body, .. } => body,
        BrokerMessage::Kafka { .. } => unreachable!("decoded by decode_kafka"),
        BrokerMessage::Redis { .. } => msg
            .attr("payload")
            .ok_or_else(|| InvalidMessage::new(InvalidLabel::NotJson, "payload field missing"))?
            .as_bytes(),
    };
    let payload: Value = serde_json::from_slice(body)
        .map_err(|_| InvalidMessage::new(InvalidLabel::NotJson, "body is not JSON"))?;
    let id_names: &[&str] = match msg {
        BrokerMessage::Nats { .. } => &["message_id", "event_id", "Nats-Msg-Id", "ce-id"],
        BrokerMessage::Redis { .. }
        | BrokerMessage::RabbitMq { .. }
        | BrokerMessage::Kafka { .. } => &["message_id", "event_id"],
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
            BrokerMessage::RabbitMq { .. } => rabbitmq_source(msg),
            BrokerMessage::Kafka { .. } => unreachable!("decoded by decode_kafka"),
        },
    };
    let event_type = match msg
        .attr("event_type")
        .or_else(|| nats_ce_fallback(msg, "event_type"))
    {
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
        if let Some(v) = msg.attr(name).or_else(|| nats_ce_fallback(msg, name)) {
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
    if let Some(p) = ce_problem.or(headers_problem) {
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

/// The headers R141 stores, and a problem found while reading them (a repeated NATS header,
/// stored or read, a Redis `headers` field that is not a JSON object of strings).
fn stored_headers(msg: &BrokerMessage) -> (Vec<(String, String)>, Option<InvalidMessage>) {
    let bad = |what: String| InvalidMessage::new(InvalidLabel::Headers, format!("headers: {what}"));
    let mapped = |k: &str| MAPPED_NAMES.contains(&k);
    match msg {
        BrokerMessage::Nats { headers, .. } => {
            let mut seen = std::collections::HashSet::new();
            let mut problem = None;
            let mut out = Vec::new();
            for (k, v) in headers {
                let lower = k.to_ascii_lowercase();
                let broker = lower.starts_with("nats-");
                // A repeated name is invalid whether it is stored or read (R137's names, the
                // CloudEvents attributes, `Nats-Msg-Id`), as on Kafka (R179, E-16); only the
                // other broker headers, neither read nor stored, are let be.
                if (!broker || lower == "nats-msg-id") && !seen.insert(k.as_str()) {
                    problem.get_or_insert_with(|| bad(format!("repeated key {k}")));
                    continue;
                }
                if mapped(k) || broker || lower.starts_with(NATS_CE_PREFIX) {
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
        BrokerMessage::RabbitMq { .. } => (rabbitmq_headers(msg), None),
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

// ---- NATS CloudEvents attributes (brokers.md R137, R180) ----

/// The prefix of CloudEvents attribute headers on NATS, in any case (R180).
const NATS_CE_PREFIX: &str = "ce-";

/// A NATS message whose CloudEvents attribute headers (`ce-` + attribute, in any case) are
/// named in lowercase and percent-decoded, or none when it has none (or is no NATS message);
/// and the problem of a value that does not decode to UTF-8 (R139, R180).
fn nats_cloudevents(msg: &BrokerMessage) -> (Option<BrokerMessage>, Option<InvalidMessage>) {
    let BrokerMessage::Nats { headers, .. } = msg else {
        return (None, None);
    };
    if !headers
        .iter()
        .any(|(k, _)| k.to_ascii_lowercase().starts_with(NATS_CE_PREFIX))
    {
        return (None, None);
    }
    let mut problem = None;
    let mut out = msg.clone();
    if let BrokerMessage::Nats { headers, .. } = &mut out {
        for (k, v) in headers.iter_mut() {
            let lower = k.to_ascii_lowercase();
            if !lower.starts_with(NATS_CE_PREFIX) {
                continue;
            }
            match percent_decode(v) {
                Some(d) => *v = d,
                None => {
                    problem.get_or_insert_with(|| {
                        InvalidMessage::new(
                            InvalidLabel::Headers,
                            format!("headers: {k} is not percent-encoded UTF-8"),
                        )
                    });
                }
            }
            *k = lower;
        }
    }
    (Some(out), problem)
}

/// The CloudEvents attribute a NATS message falls back to for a row field (R137's NATS
/// column): `ce-type`, `ce-partitionkey`, `ce-correlationid`, `ce-causationid`.
fn nats_ce_fallback<'a>(msg: &'a BrokerMessage, field: &str) -> Option<&'a str> {
    if !matches!(msg, BrokerMessage::Nats { .. }) {
        return None;
    }
    let attr = match field {
        "event_type" => "ce-type",
        "partition_key" => "ce-partitionkey",
        "correlation_id" => "ce-correlationid",
        "causation_id" => "ce-causationid",
        _ => return None,
    };
    msg.attr(attr)
}

/// Percent-decodes a value to UTF-8; none for a malformed escape or bytes that are not UTF-8.
fn percent_decode(v: &str) -> Option<String> {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

// ---- RabbitMQ (brokers.md R137's RabbitMQ column, R138, R141, R180) ----

/// The CloudEvents attribute header prefixes of the AMQP binding (R180).
pub const RABBITMQ_CLOUDEVENTS_PREFIXES: [&str; 2] = ["cloudEvents_", "cloudEvents:"];

/// RabbitMQ's own headers, never stored (R141): these names, and names starting with
/// `x-first-death-` or `x-last-death-`.
const RABBITMQ_BROKER_HEADERS: [&str; 3] = ["x-death", "x-delivery-count", "x-received-from"];

/// What a RabbitMQ delivery is called in logs: it has no position (R113).
fn rabbitmq_label(queue: &str, message_id: Option<&str>) -> String {
    format!(
        "queue {queue}, message_id {}",
        message_id.unwrap_or("(none)")
    )
}

/// A RabbitMQ header's string value (R137 reads string values only); `cloudEvents_x` is looked
/// up under both separators (R180).
fn rabbitmq_text<'a>(msg: &'a BrokerMessage, name: &str) -> Option<&'a str> {
    let BrokerMessage::RabbitMq { headers, .. } = msg else {
        return None;
    };
    let names: Vec<String> = match name.strip_prefix("cloudEvents_") {
        Some(attr) => RABBITMQ_CLOUDEVENTS_PREFIXES
            .iter()
            .map(|p| format!("{p}{attr}"))
            .collect(),
        None => vec![name.to_owned()],
    };
    names.iter().find_map(|n| {
        headers.iter().find_map(|(k, v)| match v {
            AmqpValue::Text(s) if k == n => Some(s.as_str()),
            _ => None,
        })
    })
}

/// The message_id of R137's RabbitMQ column: header `message_id`, `event_id`, the message_id
/// property, header `cloudEvents_id`; none else (R138: such a delivery is invalid).
fn rabbitmq_message_id(msg: &BrokerMessage) -> Option<&str> {
    let BrokerMessage::RabbitMq { message_id, .. } = msg else {
        return None;
    };
    rabbitmq_text(msg, "message_id")
        .or_else(|| rabbitmq_text(msg, "event_id"))
        .or(message_id.as_deref())
        .or_else(|| rabbitmq_text(msg, "cloudEvents_id"))
}

/// The source: header `source`, `source_service`, `topic`, else the routing key without the
/// routing-key prefix, else (an empty routing key) the queue name.
fn rabbitmq_source(msg: &BrokerMessage) -> String {
    if let Some(s) = ["source", "source_service", "topic"]
        .iter()
        .find_map(|n| rabbitmq_text(msg, n))
    {
        return s.to_owned();
    }
    let BrokerMessage::RabbitMq {
        queue,
        routing_key,
        routing_key_prefix,
        ..
    } = msg
    else {
        return String::new();
    };
    if routing_key.is_empty() {
        return queue.clone();
    }
    routing_key
        .strip_prefix(routing_key_prefix.as_str())
        .unwrap_or(routing_key)
        .to_owned()
}

/// The headers R141 stores from a RabbitMQ delivery: strings as they are, integers, decimals and
/// booleans as their text, other values dropped; without the names R137 reads, R50's other
/// attributes, CloudEvents attribute headers and RabbitMQ's own headers.
fn rabbitmq_headers(msg: &BrokerMessage) -> Vec<(String, String)> {
    let BrokerMessage::RabbitMq { headers, .. } = msg else {
        return Vec::new();
    };
    headers
        .iter()
        .filter(|(k, _)| {
            !MAPPED_NAMES.contains(&k.as_str())
                && !RABBITMQ_BROKER_HEADERS.contains(&k.as_str())
                && !k.starts_with("x-first-death-")
                && !k.starts_with("x-last-death-")
                && !RABBITMQ_CLOUDEVENTS_PREFIXES
                    .iter()
                    .any(|p| k.starts_with(p))
        })
        .filter_map(|(k, v)| v.stored_text().map(|t| (k.clone(), t)))
        .collect()
}

/// Decodes a RabbitMQ delivery by R137's RabbitMQ column. A delivery without an id is invalid
/// with `message_id: missing` whatever require_message_id says (R138), after the checks that
/// come before it in R139's order.
fn decode_rabbitmq(
    msg: &BrokerMessage,
    group: &ConsumerGroup,
    opts: DecodeOptions,
) -> Result<NewInboxEvent, InvalidMessage> {
    let BrokerMessage::RabbitMq { kind, body, .. } = msg else {
        return Err(InvalidMessage::new(
            InvalidLabel::NotJson,
            "not a RabbitMQ delivery",
        ));
    };
    let payload: Value = serde_json::from_slice(body)
        .map_err(|_| InvalidMessage::new(InvalidLabel::NotJson, "body is not JSON"))?;
    let message_id = rabbitmq_message_id(msg);
    let source = rabbitmq_source(msg);
    let event_type = rabbitmq_text(msg, "event_type")
        .or(kind.as_deref())
        .or_else(|| rabbitmq_text(msg, "cloudEvents_type"))
        .map(str::to_owned)
        .or_else(|| {
            payload
                .get("event_type")
                .and_then(Value::as_str)
                .filter(|t| !crate::event::trim_ancestor(t).is_empty())
                .map(str::to_owned)
        })
        .unwrap_or_else(|| source.clone());
    let mut b = NewInboxEvent::builder()
        .consumer_group(group.as_str())
        .message_id(message_id.unwrap_or("-"))
        .source(source)
        .event_type(event_type)
        .payload_json(payload)
        .headers(rabbitmq_headers(msg))
        .max_attempts(opts.max_attempts);
    let first = |names: &[&str]| names.iter().find_map(|n| rabbitmq_text(msg, n));
    if let Some(v) = first(&["partition_key", "cloudEvents_partitionkey"]) {
        b = b.partition_key(v);
    }
    if let Some(v) = first(&["trace_id"]) {
        b = b.trace_id(v);
    }
    if let Some(v) = first(&["schema_version"]) {
        b = b.schema_version(v);
    }
    if let Some(v) = first(&["correlation_id", "cloudEvents_correlationid"]) {
        b = b.correlation_id(v);
    }
    if let Some(v) = first(&["causation_id", "cloudEvents_causationid"]) {
        b = b.causation_id(v);
    }
    let event = b.build()?;
    if message_id.is_none() {
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

    fn rabbit(
        id: Option<&str>,
        kind: Option<&str>,
        headers: Vec<(&str, AmqpValue)>,
        routing_key: &str,
    ) -> BrokerMessage {
        BrokerMessage::RabbitMq {
            queue: "q".into(),
            exchange: String::new(),
            routing_key: routing_key.into(),
            routing_key_prefix: "in.".into(),
            message_id: id.map(str::to_owned),
            kind: kind.map(str::to_owned),
            headers: headers.into_iter().map(|(k, v)| (k.into(), v)).collect(),
            body: b"{\"n\":1}".to_vec(),
            redelivered: false,
        }
    }

    #[test]
    fn nats_cloudevents_attributes() {
        let o = DecodeOptions::default();
        let e = decode(
            &nats(
                &[
                    ("CE-SpecVersion", "1.0"),
                    ("ce-id", "c1"),
                    ("ce-type", "order%20paid"),
                    ("Ce-PartitionKey", "k%2F9"),
                    ("tenant", "acme"),
                ],
                "{\"n\":1}",
            ),
            &g(),
            o,
        )
        .unwrap();
        assert_eq!(
            (e.message_id(), e.event_type(), e.partition_key()),
            ("c1", "order paid", Some("k/9"))
        );
        let r = decode(&nats(&[("ce-type", "%C0%A0")], "{\"n\":1}"), &g(), o).unwrap_err();
        assert_eq!(
            r.to_string(),
            "invalid message: headers: ce-type is not percent-encoded UTF-8"
        );
        assert_eq!(percent_decode("a%2"), None);
    }

    #[test]
    fn rabbitmq_column() {
        let o = DecodeOptions::default();
        let t = |s: &str| AmqpValue::Text(s.into());
        let e = decode(&rabbit(Some("p"), None, vec![], "in.orders"), &g(), o).unwrap();
        assert_eq!(
            (e.message_id(), e.source(), e.event_type()),
            ("p", "orders", "orders")
        );
        let e = decode(
            &rabbit(
                Some("p"),
                Some("order.paid"),
                vec![("event_id", t("b"))],
                "",
            ),
            &g(),
            o,
        )
        .unwrap();
        assert_eq!(
            (e.message_id(), e.source(), e.event_type()),
            ("b", "q", "order.paid")
        );
        let r = decode(&rabbit(None, None, vec![], "in.src"), &g(), o).unwrap_err();
        assert_eq!(r.to_string(), "invalid message: message_id: missing");
        let e = decode(
            &rabbit(
                None,
                None,
                vec![
                    ("cloudEvents:id", t("c1")),
                    ("cloudEvents_type", t("t.x")),
                    ("cloudEvents_partitionkey", t("k9")),
                    ("retries", AmqpValue::Integer(3)),
                    ("x-death", AmqpValue::Other("array".into())),
                ],
                "in.src",
            ),
            &g(),
            o,
        )
        .unwrap();
        assert_eq!(
            (e.message_id(), e.event_type(), e.partition_key()),
            ("c1", "t.x", Some("k9"))
        );
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
