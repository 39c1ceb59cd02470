//! The inbox model (contract R100 to R106): the stored row [`InboxEvent`], the validated event
//! to land [`NewInboxEvent`], the inbox key (R143), and the reasons a delivery is invalid
//! ([`InvalidMessage`], R139).
//!
//! Strings are trimmed as the outbox trims them ([`trim_ancestor`]) and checked against R102's
//! limits; payloads and headers against R104 (the outbox's R5 and R6). Stored rows are never
//! validated again when read (R106). Checked by conformance scenarios E-04 to E-06 and E-09.

use std::collections::BTreeMap;
use std::fmt;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::event::{Status, limits, trim_ancestor, validate_headers};

/// Maximum lengths in characters of R102.
pub mod inbox_limits {
    /// message_id.
    pub const MESSAGE_ID_MAX: usize = 255;
    /// consumer_group.
    pub const CONSUMER_GROUP_MAX: usize = 255;
    /// source.
    pub const SOURCE_MAX: usize = 255;
    /// partition_key.
    pub const PARTITION_KEY_MAX: usize = 255;
    /// event_type.
    pub const EVENT_TYPE_MAX: usize = 100;
    /// trace_id, correlation_id, causation_id.
    pub const TRACE_ID_MAX: usize = 64;
    /// schema_version.
    pub const SCHEMA_VERSION_MAX: usize = 50;
}

/// A stored inbox row (R100), as a backend returns it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct InboxEvent {
    /// Row id (UUIDv7 for rows this library lands, R105).
    pub id: Uuid,
    /// Event type.
    pub event_type: String,
    /// Payload (a JSON object).
    pub payload: Value,
    /// Headers, or none.
    pub headers: Option<BTreeMap<String, String>>,
    /// Trace id.
    pub trace_id: Option<String>,
    /// Always null in rows this library lands (the column stays for the ancestor's table).
    pub idempotency_key: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// Causation id.
    pub causation_id: Option<String>,
    /// Schema version.
    pub schema_version: Option<String>,
    /// Status (R101).
    pub status: Status,
    /// Attempts spent.
    pub attempts_made: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Last failure text.
    pub last_error: Option<String>,
    /// Next try.
    pub scheduled_at: DateTime<Utc>,
    /// When it completed.
    pub completed_at: Option<DateTime<Utc>>,
    /// Lease start.
    pub locked_at: Option<DateTime<Utc>>,
    /// Lease holder.
    pub locked_by: Option<String>,
    /// Insert time (backend clock, R105).
    pub created_at: DateTime<Utc>,
    /// Last write.
    pub updated_at: Option<DateTime<Utc>>,
    /// The broker message's id (dedup key with consumer_group, R108).
    pub message_id: String,
    /// The consumer group.
    pub consumer_group: String,
    /// Where the message came from (R137).
    pub source: String,
    /// The partition key, or none: a row without one is a key of its own (R143).
    pub partition_key: Option<String>,
}

/// An inbox row's payload does not decode as the type a handler asked for
/// ([`InboxEvent::payload_as`]).
#[derive(Debug, thiserror::Error)]
#[error(
    "the payload of message {message_id:?} (event type {event_type:?}) does not decode as \
     {target}: {source}; fix the producer or the type, or skip such messages"
)]
pub struct PayloadError {
    /// The message id (the row's dedup key with the group, R108).
    pub message_id: String,
    /// The row's event type.
    pub event_type: String,
    /// The type it was decoded as.
    pub target: &'static str,
    /// What serde found wrong (a missing field, a wrong type).
    #[source]
    pub source: serde_json::Error,
}

impl InboxEvent {
    /// The payload decoded as `T`, e.g. `row.payload_as::<OrderPlaced>()?` in a handler (where
    /// `?` makes a [`PayloadError`] a counted failure, whose text names the message and what did
    /// not decode). A payload that can never decode can be skipped instead:
    /// `Err(e) => return Ok(HandlerOutcome::skipped(e.to_string()))`.
    pub fn payload_as<T: DeserializeOwned>(&self) -> Result<T, PayloadError> {
        T::deserialize(&self.payload).map_err(|source| PayloadError {
            message_id: self.message_id.clone(),
            event_type: self.event_type.clone(),
            target: std::any::type_name::<T>(),
            source,
        })
    }

    /// The row's inbox key (R143), or none for a row without partition_key.
    pub fn key(&self) -> Option<InboxKey> {
        self.partition_key.as_ref().map(|pk| InboxKey {
            consumer_group: self.consumer_group.clone(),
            source: self.source.clone(),
            partition_key: pk.clone(),
        })
    }

    /// Whether the row is held (locked_at set).
    pub fn is_held(&self) -> bool {
        self.locked_at.is_some()
    }

    /// The `traceparent` header, if any (not validated; R170 ignores an invalid one).
    pub fn traceparent(&self) -> Option<&str> {
        self.headers
            .as_ref()
            .and_then(|h| h.get(crate::trace::TRACEPARENT))
            .map(String::as_str)
    }
}

/// The inbox key (consumer_group, source, partition_key) of R143.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InboxKey {
    /// Group.
    pub consumer_group: String,
    /// Source.
    pub source: String,
    /// Partition key.
    pub partition_key: String,
}

impl fmt::Display for InboxKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}/{}/{}",
            self.consumer_group, self.source, self.partition_key
        )
    }
}

/// The metric label of an invalid delivery (R139's third column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InvalidLabel {
    /// Not JSON, or no payload field.
    NotJson,
    /// JSON, not an object.
    NotObject,
    /// The empty object.
    EmptyPayload,
    /// Over 1,000,000 bytes.
    TooLarge,
    /// A string of the payload, an object key included, holding U+0000.
    Nul,
    /// A field of R102.
    Field,
    /// Headers.
    Headers,
    /// The database refused the message (R132).
    DbRefused,
}

impl InvalidLabel {
    /// The label text.
    pub fn as_str(self) -> &'static str {
        match self {
            InvalidLabel::NotJson => "not_json",
            InvalidLabel::NotObject => "not_object",
            InvalidLabel::EmptyPayload => "empty_payload",
            InvalidLabel::TooLarge => "too_large",
            InvalidLabel::Nul => "nul",
            InvalidLabel::Field => "field",
            InvalidLabel::Headers => "headers",
            InvalidLabel::DbRefused => "db_refused",
        }
    }
}

/// A delivery that cannot become a valid inbox event (R139). Its display is
/// `invalid message: {reason}`, the text of the dead-letter copy and of the term (R140).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid message: {reason}")]
pub struct InvalidMessage {
    /// The reason, as R139 words it (`body is not JSON`, `message_id: empty`, …).
    pub reason: String,
    /// The metric label.
    pub label: InvalidLabel,
}

impl InvalidMessage {
    /// An invalid message.
    pub fn new(label: InvalidLabel, reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
            label,
        }
    }

    fn field(reason: String) -> Self {
        Self::new(InvalidLabel::Field, reason)
    }
}

/// An inbox event that passed R102 and R104; made by [`NewInboxEvent::builder`] (or the
/// decoder, R137), landed by a backend's `land` (R107).
#[derive(Debug, Clone, PartialEq)]
pub struct NewInboxEvent {
    id: Uuid,
    message_id: String,
    consumer_group: String,
    source: String,
    event_type: String,
    partition_key: Option<String>,
    payload: Map<String, Value>,
    headers: Option<BTreeMap<String, String>>,
    trace_id: Option<String>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
    schema_version: Option<String>,
    max_attempts: i32,
}

impl NewInboxEvent {
    /// A builder.
    pub fn builder() -> InboxEventBuilder {
        InboxEventBuilder::default()
    }
    /// The id the row gets when this landing inserts it.
    pub fn id(&self) -> Uuid {
        self.id
    }
    /// message_id.
    pub fn message_id(&self) -> &str {
        &self.message_id
    }
    /// consumer_group.
    pub fn consumer_group(&self) -> &str {
        &self.consumer_group
    }
    /// source.
    pub fn source(&self) -> &str {
        &self.source
    }
    /// event_type.
    pub fn event_type(&self) -> &str {
        &self.event_type
    }
    /// partition_key.
    pub fn partition_key(&self) -> Option<&str> {
        self.partition_key.as_deref()
    }
    /// The payload.
    pub fn payload(&self) -> &Map<String, Value> {
        &self.payload
    }
    /// The headers.
    pub fn headers(&self) -> Option<&BTreeMap<String, String>> {
        self.headers.as_ref()
    }
    /// max_attempts the row is landed with (R103).
    pub fn max_attempts(&self) -> i32 {
        self.max_attempts
    }
    /// The same event with another budget (the runner's setting, R103; 0 means 6).
    pub fn with_max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = effective_max_attempts(n);
        self
    }
    /// The same event in another group (the runner's group, R114).
    pub fn with_group(mut self, group: &ConsumerGroup) -> Self {
        self.consumer_group = group.as_str().to_owned();
        self
    }
    /// The inbox key (R143).
    pub fn key(&self) -> Option<InboxKey> {
        self.partition_key.as_ref().map(|pk| InboxKey {
            consumer_group: self.consumer_group.clone(),
            source: self.source.clone(),
            partition_key: pk.clone(),
        })
    }

    /// The row this event becomes when inserted at `created_at` (R103): pending, no attempts,
    /// scheduled_at = updated_at = created_at, no lock, idempotency_key null.
    pub fn into_row(self, created_at: DateTime<Utc>) -> InboxEvent {
        InboxEvent {
            id: self.id,
            event_type: self.event_type,
            payload: Value::Object(self.payload),
            headers: self.headers,
            trace_id: self.trace_id,
            idempotency_key: None,
            correlation_id: self.correlation_id,
            causation_id: self.causation_id,
            schema_version: self.schema_version,
            status: Status::Pending,
            attempts_made: 0,
            max_attempts: self.max_attempts,
            last_error: None,
            scheduled_at: created_at,
            completed_at: None,
            locked_at: None,
            locked_by: None,
            created_at,
            updated_at: Some(created_at),
            message_id: self.message_id,
            consumer_group: self.consumer_group,
            source: self.source,
            partition_key: self.partition_key,
        }
    }
}

/// max_attempts as R103 reads it: 0 means 6.
pub fn effective_max_attempts(n: u32) -> i32 {
    if n == 0 {
        limits::DEFAULT_MAX_ATTEMPTS
    } else {
        i32::try_from(n).unwrap_or(i32::MAX)
    }
}

/// A validated consumer group (R102: trimmed, 1 to 255 characters, no U+0000), checked when a
/// runner or processor is built.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConsumerGroup(String);

impl ConsumerGroup {
    /// Validates a group name.
    pub fn new(v: impl AsRef<str>) -> Result<Self, crate::error::ConfigError> {
        text_field(
            "consumer_group",
            v.as_ref(),
            inbox_limits::CONSUMER_GROUP_MAX,
        )
        .map(Self)
        .map_err(|e| crate::error::ConfigError::new(e.reason))
    }
    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ConsumerGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks one text field of R102: trimmed, non-empty, at most `max` characters, no U+0000.
/// The error's reason is R139's wording.
pub fn text_field(field: &str, v: &str, max: usize) -> Result<String, InvalidMessage> {
    let t = trim_ancestor(v);
    if t.is_empty() {
        return Err(InvalidMessage::field(format!("{field}: empty")));
    }
    if t.contains('\0') {
        return Err(InvalidMessage::field(format!("{field}: contains U+0000")));
    }
    if t.chars().count() > max {
        return Err(InvalidMessage::field(format!(
            "{field}: longer than {max} characters"
        )));
    }
    Ok(t.to_owned())
}

fn optional_field(
    field: &str,
    v: Option<String>,
    max: usize,
) -> Result<Option<String>, InvalidMessage> {
    v.map(|v| text_field(field, &v, max)).transpose()
}

fn has_nul(v: &Value) -> bool {
    match v {
        Value::String(s) => s.contains('\0'),
        Value::Array(a) => a.iter().any(has_nul),
        Value::Object(m) => m.iter().any(|(k, v)| k.contains('\0') || has_nul(v)),
        _ => false,
    }
}

/// Checks a payload (R104, R139): a non-empty object without U+0000 whose compact JSON is at
/// most 1,000,000 bytes.
pub fn check_payload(v: Value) -> Result<Map<String, Value>, InvalidMessage> {
    let Value::Object(map) = v else {
        return Err(InvalidMessage::new(
            InvalidLabel::NotObject,
            "body is not a JSON object",
        ));
    };
    if map.is_empty() {
        return Err(InvalidMessage::new(
            InvalidLabel::EmptyPayload,
            "payload is empty",
        ));
    }
    let len = serde_json::to_string(&map).map(|s| s.len()).unwrap_or(0);
    if len > limits::PAYLOAD_MAX_BYTES {
        return Err(InvalidMessage::new(
            InvalidLabel::TooLarge,
            format!("payload exceeds {} bytes", limits::PAYLOAD_MAX_BYTES),
        ));
    }
    if map.iter().any(|(k, v)| k.contains('\0') || has_nul(v)) {
        return Err(InvalidMessage::new(
            InvalidLabel::Nul,
            "payload contains U+0000",
        ));
    }
    Ok(map)
}

/// Checks headers (R104, R6, R139). A `traceparent` header, its name in any case (Go's
/// canonical `Traceparent` included), is stored as `traceparent` and its value held to R6's
/// text rules only: an invalid trace context is ignored by the span (R170), never a reason to
/// refuse the message (E-15).
pub fn check_headers(
    raw: Vec<(String, String)>,
) -> Result<Option<BTreeMap<String, String>>, InvalidMessage> {
    let bad = |what: String| InvalidMessage::new(InvalidLabel::Headers, format!("headers: {what}"));
    if raw.len() > limits::HEADERS_MAX {
        return Err(bad(format!("more than {} entries", limits::HEADERS_MAX)));
    }
    for (k, v) in &raw {
        if k.contains('\0') || v.contains('\0') {
            return Err(bad(format!(
                "{} contains U+0000",
                k.replace('\0', "\u{FFFD}")
            )));
        }
    }
    let (tp, rest): (Vec<_>, Vec<_>) = raw
        .into_iter()
        .partition(|(k, _)| trim_ancestor(k).eq_ignore_ascii_case(crate::trace::TRACEPARENT));
    let mut out = validate_headers(rest)
        .map_err(|e| bad(e.to_string()))?
        .unwrap_or_default();
    for (_, v) in tp {
        // R6's value rules, through the same check under a neutral key.
        let checked = validate_headers(vec![("x".into(), v)]).map_err(|e| bad(e.to_string()))?;
        if let Some(v) = checked.and_then(|m| m.into_values().next())
            && out.insert(crate::trace::TRACEPARENT.into(), v).is_some()
        {
            return Err(bad(format!("repeated key {}", crate::trace::TRACEPARENT)));
        }
    }
    Ok(if out.is_empty() { None } else { Some(out) })
}

/// Builds a [`NewInboxEvent`], validating every field on [`build`](Self::build).
#[derive(Debug, Clone, Default)]
pub struct InboxEventBuilder {
    message_id: Option<String>,
    consumer_group: Option<String>,
    source: Option<String>,
    event_type: Option<String>,
    partition_key: Option<String>,
    payload: Option<Value>,
    headers: Vec<(String, String)>,
    trace_id: Option<String>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
    schema_version: Option<String>,
    max_attempts: u32,
}

macro_rules! setter {
    ($($name:ident),*) => {$(
        #[doc = concat!("Sets ", stringify!($name), ".")]
        pub fn $name(mut self, v: impl Into<String>) -> Self {
            self.$name = Some(v.into());
            self
        }
    )*};
}

impl InboxEventBuilder {
    setter!(
        message_id,
        consumer_group,
        source,
        event_type,
        partition_key,
        trace_id,
        correlation_id,
        causation_id,
        schema_version
    );

    /// Sets the payload.
    pub fn payload_json(mut self, v: Value) -> Self {
        self.payload = Some(v);
        self
    }

    /// Adds a header.
    pub fn header(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.headers.push((k.into(), v.into()));
        self
    }

    /// Adds headers.
    pub fn headers(mut self, h: Vec<(String, String)>) -> Self {
        self.headers.extend(h);
        self
    }

    /// Sets max_attempts (0 means 6, R103).
    pub fn max_attempts(mut self, n: u32) -> Self {
        self.max_attempts = n;
        self
    }

    /// Validates (R102, R104) in R139's order: payload, fields, headers. event_type defaults
    /// to the source when not given.
    pub fn build(self) -> Result<NewInboxEvent, InvalidMessage> {
        let payload =
            check_payload(self.payload.ok_or_else(|| {
                InvalidMessage::new(InvalidLabel::NotJson, "payload field missing")
            })?)?;
        let need = |field: &str, v: Option<String>| {
            v.ok_or_else(|| InvalidMessage::field(format!("{field}: missing")))
        };
        let message_id = text_field(
            "message_id",
            &need("message_id", self.message_id)?,
            inbox_limits::MESSAGE_ID_MAX,
        )?;
        let consumer_group = text_field(
            "consumer_group",
            &need("consumer_group", self.consumer_group)?,
            inbox_limits::CONSUMER_GROUP_MAX,
        )?;
        let source = text_field(
            "source",
            &need("source", self.source)?,
            inbox_limits::SOURCE_MAX,
        )?;
        let event_type = text_field(
            "event_type",
            &self.event_type.unwrap_or_else(|| source.clone()),
            inbox_limits::EVENT_TYPE_MAX,
        )?;
        let partition_key = optional_field(
            "partition_key",
            self.partition_key,
            inbox_limits::PARTITION_KEY_MAX,
        )?;
        let trace_id = optional_field("trace_id", self.trace_id, inbox_limits::TRACE_ID_MAX)?;
        let correlation_id = optional_field(
            "correlation_id",
            self.correlation_id,
            inbox_limits::TRACE_ID_MAX,
        )?;
        let causation_id = optional_field(
            "causation_id",
            self.causation_id,
            inbox_limits::TRACE_ID_MAX,
        )?;
        let schema_version = optional_field(
            "schema_version",
            self.schema_version,
            inbox_limits::SCHEMA_VERSION_MAX,
        )?;
        let headers = check_headers(self.headers)?;
        Ok(NewInboxEvent {
            id: crate::ids::new_event_id(),
            message_id,
            consumer_group,
            source,
            event_type,
            partition_key,
            payload,
            headers,
            trace_id,
            correlation_id,
            causation_id,
            schema_version,
            max_attempts: effective_max_attempts(self.max_attempts),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> InboxEventBuilder {
        NewInboxEvent::builder()
            .message_id("m1")
            .consumer_group("g")
            .source("src")
            .payload_json(json!({"n": 1}))
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    struct Placed {
        order: String,
        total_cents: i64,
    }

    #[test]
    fn payload_as_decodes_the_payload_into_the_asked_type() {
        let row = base()
            .payload_json(json!({"order": "o-1", "total_cents": 1200, "extra": true}))
            .build()
            .unwrap()
            .into_row(Utc::now());
        assert_eq!(
            row.payload_as::<Placed>().unwrap(),
            Placed {
                order: "o-1".into(),
                total_cents: 1200
            }
        );
    }

    #[test]
    fn payload_as_names_the_message_the_type_and_what_failed() {
        let row = base()
            .event_type("order.placed")
            .payload_json(json!({"order": "o-1"}))
            .build()
            .unwrap()
            .into_row(Utc::now());
        let e = row.payload_as::<Placed>().unwrap_err();
        assert_eq!(e.message_id, "m1");
        assert_eq!(e.event_type, "order.placed");
        assert!(e.target.ends_with("Placed"), "{}", e.target);
        let text = e.to_string();
        assert!(text.contains("\"m1\""), "{text}");
        assert!(text.contains("order.placed"), "{text}");
        assert!(text.contains("missing field `total_cents`"), "{text}");
        // In a handler, `?` makes it a counted failure with this text (R118).
        let h: crate::inbox::HandlerError = e.into();
        assert!(!h.transient);
        assert_eq!(h.message, text);
        let wrong = base()
            .payload_json(json!({"order": 7, "total_cents": 1}))
            .build()
            .unwrap()
            .into_row(Utc::now());
        let text = wrong.payload_as::<Placed>().unwrap_err().to_string();
        assert!(
            text.contains("invalid type: integer `7`, expected a string"),
            "{text}"
        );
    }

    #[test]
    fn defaults_and_limits() {
        let e = base().build().unwrap();
        assert_eq!(e.event_type(), "src");
        assert_eq!(e.max_attempts(), 6);
        assert_eq!(e.clone().with_max_attempts(1).max_attempts(), 1);
        let long = "a".repeat(256);
        let err = base().message_id(long).build().unwrap_err();
        assert_eq!(err.reason, "message_id: longer than 255 characters");
        assert!(base().message_id("a".repeat(255)).build().is_ok());
        let err = base().message_id("   ").build().unwrap_err();
        assert_eq!(err.to_string(), "invalid message: message_id: empty");
        let err = base().partition_key("k\0").build().unwrap_err();
        assert_eq!(err.reason, "partition_key: contains U+0000");
        let err = base().event_type("e".repeat(101)).build().unwrap_err();
        assert_eq!(err.reason, "event_type: longer than 100 characters");
    }

    #[test]
    fn payload_rules() {
        let s = "a".repeat(999_992);
        assert!(base().payload_json(json!({ "x": s })).build().is_ok());
        let s = "a".repeat(999_993);
        let e = base().payload_json(json!({ "x": s })).build().unwrap_err();
        assert_eq!(e.reason, "payload exceeds 1000000 bytes");
        assert_eq!(e.label, InvalidLabel::TooLarge);
        let e = base().payload_json(json!({})).build().unwrap_err();
        assert_eq!(e.reason, "payload is empty");
        let e = base().payload_json(json!([1])).build().unwrap_err();
        assert_eq!(e.reason, "body is not a JSON object");
        for p in [
            json!({"x": "a\u{0}b"}),
            json!({"a\u{0}": 1}),
            json!({"x": ["\u{0}"]}),
        ] {
            let e = base().payload_json(p).build().unwrap_err();
            assert_eq!(e.reason, "payload contains U+0000");
            assert_eq!(e.label, InvalidLabel::Nul);
        }
    }

    #[test]
    fn header_rules() {
        let many: Vec<_> = (0..101)
            .map(|i| (format!("h{i}"), "v".to_string()))
            .collect();
        let e = base().headers(many).build().unwrap_err();
        assert_eq!(e.reason, "headers: more than 100 entries");
        let e = base().header("tenant", "a\0b").build().unwrap_err();
        assert_eq!(e.reason, "headers: tenant contains U+0000");
        assert!(base().header("a", "x\ny").build().is_err());
        assert!(base().header("a", "x\ty").build().is_ok());
        assert!(base().header("A", "1").header("a", "2").build().is_err());
        // An invalid trace context is stored, not refused (R170).
        let e = base()
            .header(
                "traceparent",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            )
            .build()
            .unwrap();
        assert!(e.headers().unwrap().contains_key("traceparent"));
    }
}
