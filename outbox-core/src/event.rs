//! The event model (contract section 1) and the validating builder.
//!
//! [`NewEvent`] is an event that passed every limit of R5 to R8; it can only be made by
//! [`EventBuilder::build`]. [`OutboxEvent`] is a stored row, as a backend returns it; rows are
//! never validated again when read (R11, R82).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::{Map, Value};
use uuid::Uuid;

/// Limits of the contract, in one place (section 12).
pub mod limits {
    /// Maximum compact JSON size of a payload in bytes (R5).
    pub const PAYLOAD_MAX_BYTES: usize = 1_000_000;
    /// Maximum header entries (R6).
    pub const HEADERS_MAX: usize = 100;
    /// Maximum header key length in characters (R6).
    pub const HEADER_KEY_MAX: usize = 64;
    /// Maximum header value length in characters (R6).
    pub const HEADER_VALUE_MAX: usize = 512;
    /// event_type (R7).
    pub const EVENT_TYPE_MAX: usize = 100;
    /// aggregate_type (R7).
    pub const AGGREGATE_TYPE_MAX: usize = 50;
    /// topic (R7).
    pub const TOPIC_MAX: usize = 255;
    /// partition_key (R7).
    pub const PARTITION_KEY_MAX: usize = 255;
    /// idempotency_key (R7).
    pub const IDEMPOTENCY_KEY_MAX: usize = 128;
    /// trace_id, correlation_id, causation_id (R7).
    pub const TRACE_ID_MAX: usize = 64;
    /// schema_version (R7).
    pub const SCHEMA_VERSION_MAX: usize = 50;
    /// Worker id (R7, R10).
    pub const WORKER_ID_MAX: usize = 255;
    /// Force-unlock reason (R66).
    pub const FORCE_UNLOCK_REASON_MAX: usize = 255;
    /// The farthest a schedule may lie ahead, in seconds: 365 days (R8).
    pub const SCHEDULE_MAX_AHEAD_SECS: i64 = 31_536_000;
    /// The longest duration a relay, backoff, breaker or backend setting may take, in seconds:
    /// 365 days. Longer values are refused as configuration errors, so adding a setting to any
    /// clock's time cannot overflow.
    pub const SETTING_MAX_SECS: u64 = 31_536_000;
    /// Default of the builder's `scheduled_at_skew_seconds` (R8).
    pub const DEFAULT_SCHEDULE_SKEW_SECS: u64 = 60;
    /// Default max_attempts (R4).
    pub const DEFAULT_MAX_ATTEMPTS: i32 = 6;
    /// Default `error_max_length` in bytes (R9).
    pub const DEFAULT_ERROR_MAX_LENGTH: usize = 2000;
    /// The largest `error_max_length` (R9): the size of the `last_error` column,
    /// `varchar(2000)`. A larger setting would let a long error fail the whole outcome
    /// transaction on the database, so it is a configuration error instead.
    pub const ERROR_MAX_LENGTH_MAX: usize = 2000;
    /// Suffix appended to a truncated last_error (R9).
    pub const TRUNCATED_SUFFIX: &str = "... [TRUNCATED]";
    /// The text stored for an empty error (R9).
    pub const UNKNOWN_ERROR: &str = "Unknown error";
}

/// The status of a row (R2), stored as lowercase text.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    /// Waiting to be published.
    Pending,
    /// Acknowledged by the broker.
    Completed,
    /// Spent all its attempts; terminal except for requeue (R64).
    Failed,
}

impl Status {
    /// The stored text.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Completed => "completed",
            Status::Failed => "failed",
        }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Status {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "pending" => Ok(Status::Pending),
            "completed" => Ok(Status::Completed),
            "failed" => Ok(Status::Failed),
            other => Err(format!("unknown status {other:?}")),
        }
    }
}

/// A stored outbox row (R1), as a backend returns it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OutboxEvent {
    /// Event id (UUIDv7 when written by this library; the ancestor wrote UUIDv4, R79).
    pub id: Uuid,
    /// Event type, e.g. `order.created`.
    pub event_type: String,
    /// The JSON payload.
    pub payload: Value,
    /// String headers, or none.
    pub headers: Option<BTreeMap<String, String>>,
    /// Trace id.
    pub trace_id: Option<String>,
    /// Idempotency key (R16).
    pub idempotency_key: Option<String>,
    /// Correlation id.
    pub correlation_id: Option<String>,
    /// Causation id.
    pub causation_id: Option<String>,
    /// Schema version of the payload.
    pub schema_version: Option<String>,
    /// Status (R2).
    pub status: Status,
    /// Counted attempts spent.
    pub attempts_made: i32,
    /// Attempt budget.
    pub max_attempts: i32,
    /// Last failure text (R9).
    pub last_error: Option<String>,
    /// When the row is due.
    pub scheduled_at: DateTime<Utc>,
    /// When it was acknowledged.
    pub completed_at: Option<DateTime<Utc>>,
    /// When the holder locked it.
    pub locked_at: Option<DateTime<Utc>>,
    /// The holder.
    pub locked_by: Option<String>,
    /// Insert time on the backend clock (R73).
    pub created_at: DateTime<Utc>,
    /// Last update time.
    pub updated_at: Option<DateTime<Utc>>,
    /// Aggregate type.
    pub aggregate_type: String,
    /// Aggregate id.
    pub aggregate_id: Uuid,
    /// Topic; with partition_key it forms the ordering key (R26).
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
}

impl OutboxEvent {
    /// The W3C trace context stored with the row (the header `traceparent`), if any.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers
            .as_ref()
            .and_then(|h| h.get(crate::trace::TRACEPARENT))
            .map(String::as_str)
    }

    /// The ordering key (R26).
    pub fn key(&self) -> crate::ordering::Key {
        crate::ordering::Key::new(&self.topic, &self.partition_key)
    }

    /// Whether the row is held (locked_at set; R0 "held").
    pub fn is_held(&self) -> bool {
        self.locked_at.is_some()
    }
}

/// When a new event becomes due (R15).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Schedule {
    /// Due at once: scheduled_at = created_at.
    Now,
    /// Due after a delay measured on the backend clock from created_at.
    Delay(Duration),
    /// Due at an absolute instant, stored as given.
    At(DateTime<Utc>),
}

/// An event that passed every validation rule, ready to be written.
#[derive(Debug, Clone, PartialEq)]
pub struct NewEvent {
    pub(crate) id: Uuid,
    pub(crate) event_type: String,
    pub(crate) payload: Map<String, Value>,
    pub(crate) payload_json: Arc<str>,
    pub(crate) headers: Option<BTreeMap<String, String>>,
    pub(crate) trace_id: Option<String>,
    pub(crate) idempotency_key: Option<String>,
    pub(crate) correlation_id: Option<String>,
    pub(crate) causation_id: Option<String>,
    pub(crate) schema_version: Option<String>,
    pub(crate) aggregate_type: String,
    pub(crate) aggregate_id: Uuid,
    pub(crate) topic: String,
    pub(crate) partition_key: String,
    pub(crate) max_attempts: i32,
    pub(crate) schedule: Schedule,
}

impl NewEvent {
    /// The id (UUIDv7, assigned at build).
    pub fn id(&self) -> Uuid {
        self.id
    }
    /// The event type.
    pub fn event_type(&self) -> &str {
        self.event_type.as_str()
    }
    /// The payload object.
    pub fn payload(&self) -> &Map<String, Value> {
        &self.payload
    }
    /// The payload as compact JSON, as it will be stored.
    pub fn payload_json(&self) -> &str {
        &self.payload_json
    }
    /// Headers (none when empty).
    pub fn headers(&self) -> Option<&BTreeMap<String, String>> {
        self.headers.as_ref()
    }
    /// The W3C trace context stored with the event (the header `traceparent`), if any.
    pub fn traceparent(&self) -> Option<&str> {
        self.headers
            .as_ref()
            .and_then(|h| h.get(crate::trace::TRACEPARENT))
            .map(String::as_str)
    }
    /// Trace id.
    pub fn trace_id(&self) -> Option<&str> {
        self.trace_id.as_deref()
    }
    /// Idempotency key.
    pub fn idempotency_key(&self) -> Option<&str> {
        self.idempotency_key.as_deref()
    }
    /// Correlation id.
    pub fn correlation_id(&self) -> Option<&str> {
        self.correlation_id.as_deref()
    }
    /// Causation id.
    pub fn causation_id(&self) -> Option<&str> {
        self.causation_id.as_deref()
    }
    /// Schema version.
    pub fn schema_version(&self) -> Option<&str> {
        self.schema_version.as_deref()
    }
    /// Aggregate type.
    pub fn aggregate_type(&self) -> &str {
        self.aggregate_type.as_str()
    }
    /// Aggregate id.
    pub fn aggregate_id(&self) -> Uuid {
        self.aggregate_id
    }
    /// Topic.
    pub fn topic(&self) -> &str {
        self.topic.as_str()
    }
    /// Partition key.
    pub fn partition_key(&self) -> &str {
        self.partition_key.as_str()
    }
    /// Attempt budget (0 at build means 6).
    pub fn max_attempts(&self) -> i32 {
        self.max_attempts
    }
    /// The schedule.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }
}

impl NewEvent {
    /// Starts a builder.
    pub fn builder() -> EventBuilder {
        EventBuilder::default()
    }

    /// Headers as a JSON object, or none.
    pub fn headers_json(&self) -> Option<Value> {
        self.headers.as_ref().map(|h| {
            Value::Object(
                h.iter()
                    .map(|(k, v)| (k.clone(), Value::String(v.clone())))
                    .collect(),
            )
        })
    }

    /// The relative delay of the schedule, if any.
    pub fn delay(&self) -> Option<Duration> {
        match self.schedule {
            Schedule::Delay(d) => Some(d),
            _ => None,
        }
    }

    /// The absolute schedule, if any.
    pub fn scheduled_at(&self) -> Option<DateTime<Utc>> {
        match self.schedule {
            Schedule::At(t) => Some(t),
            _ => None,
        }
    }

    /// The row this event becomes when inserted at `created_at`: pending, no attempts (R4).
    pub fn into_row(self, created_at: DateTime<Utc>) -> OutboxEvent {
        let scheduled_at = match self.schedule {
            Schedule::Now => created_at,
            // The delay is at most 365 days (checked at build); saturate rather than panic
            // on a created_at at the end of chrono's range.
            Schedule::Delay(d) => chrono::Duration::from_std(d)
                .ok()
                .and_then(|d| created_at.checked_add_signed(d))
                .unwrap_or(DateTime::<Utc>::MAX_UTC),
            Schedule::At(t) => t,
        };
        OutboxEvent {
            id: self.id,
            event_type: self.event_type,
            payload: Value::Object(self.payload),
            headers: self.headers,
            trace_id: self.trace_id,
            idempotency_key: self.idempotency_key,
            correlation_id: self.correlation_id,
            causation_id: self.causation_id,
            schema_version: self.schema_version,
            status: Status::Pending,
            attempts_made: 0,
            max_attempts: self.max_attempts,
            last_error: None,
            scheduled_at,
            completed_at: None,
            locked_at: None,
            locked_by: None,
            created_at,
            updated_at: Some(created_at),
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            topic: self.topic,
            partition_key: self.partition_key,
        }
    }
}

mod builder;
mod error_text;
#[cfg(test)]
mod tests;
mod validate;
mod worker_id;

pub use builder::{BuildSettings, EventBuilder};
pub use error_text::{check_error_max_length, force_unlock_text, normalize_error};
pub use validate::{check_insert_window, is_ancestor_whitespace, trim_ancestor, validate_headers};
pub use worker_id::WorkerId;
