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
use serde::Serialize;
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::clock::{Clock, SystemClock};
use crate::error::ValidationError;

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

/// Settings of the event builder: its clock and the schedule skew (R8).
#[derive(Debug, Clone)]
pub struct BuildSettings {
    clock: Arc<dyn Clock>,
    skew_seconds: u64,
}

impl Default for BuildSettings {
    fn default() -> Self {
        Self {
            clock: Arc::new(SystemClock),
            skew_seconds: limits::DEFAULT_SCHEDULE_SKEW_SECS,
        }
    }
}

impl BuildSettings {
    /// Settings with the system clock and a 60 s skew.
    pub fn new() -> Self {
        Self::default()
    }

    /// Uses this clock for the schedule window.
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Sets `scheduled_at_skew_seconds` (0 to 31,536,000; default 60).
    pub fn with_skew_seconds(mut self, skew: i64) -> Result<Self, crate::error::ConfigError> {
        if skew < 0 {
            return Err(crate::error::ConfigError::new(format!(
                "scheduled_at_skew_seconds must be >= 0, got {skew}"
            )));
        }
        if skew as u64 > limits::SETTING_MAX_SECS {
            return Err(crate::error::ConfigError::new(format!(
                "scheduled_at_skew_seconds must be at most {} (365 days), got {skew}",
                limits::SETTING_MAX_SECS
            )));
        }
        self.skew_seconds = skew as u64;
        Ok(self)
    }
}

enum PayloadInput {
    Value(Value),
    Error(ValidationError),
}

/// Collects the fields of a new event; [`build`](Self::build) validates them all.
#[derive(Default)]
pub struct EventBuilder {
    event_type: Option<String>,
    payload: Option<PayloadInput>,
    headers: Vec<(String, String)>,
    traceparent: Option<String>,
    trace_id: Option<String>,
    idempotency_key: Option<String>,
    correlation_id: Option<String>,
    causation_id: Option<String>,
    schema_version: Option<String>,
    aggregate_type: Option<String>,
    aggregate_id: Option<Uuid>,
    topic: Option<String>,
    partition_key: Option<String>,
    max_attempts: Option<i64>,
    schedule: Option<Schedule>,
    delay_secs: Option<f64>,
}

impl fmt::Debug for EventBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventBuilder")
            .field("event_type", &self.event_type)
            .field("topic", &self.topic)
            .field("partition_key", &self.partition_key)
            .finish_non_exhaustive()
    }
}

impl EventBuilder {
    /// The event type (≤ 100).
    pub fn event_type(mut self, v: impl Into<String>) -> Self {
        self.event_type = Some(v.into());
        self
    }
    /// The aggregate type (≤ 50) and id.
    pub fn aggregate(mut self, aggregate_type: impl Into<String>, id: Uuid) -> Self {
        self.aggregate_type = Some(aggregate_type.into());
        self.aggregate_id = Some(id);
        self
    }
    /// The topic (≤ 255).
    pub fn topic(mut self, v: impl Into<String>) -> Self {
        self.topic = Some(v.into());
        self
    }
    /// The partition key (≤ 255).
    pub fn partition_key(mut self, v: impl Into<String>) -> Self {
        self.partition_key = Some(v.into());
        self
    }
    /// The payload as a JSON value (must be a non-empty object).
    pub fn payload_json(mut self, v: Value) -> Self {
        self.payload = Some(PayloadInput::Value(v));
        self
    }
    /// The payload from a typed value; NaN and infinities are rejected, never turned into null.
    pub fn payload<T: Serialize + ?Sized>(mut self, v: &T) -> Self {
        self.payload = Some(match crate::finite::check(v) {
            Err(e) => PayloadInput::Error(e),
            Ok(()) => match serde_json::to_value(v) {
                Ok(v) => PayloadInput::Value(v),
                Err(e) => PayloadInput::Error(ValidationError::PayloadSerialize(e.to_string())),
            },
        });
        self
    }
    /// Adds one header.
    pub fn header(mut self, k: impl Into<String>, v: impl Into<String>) -> Self {
        self.headers.push((k.into(), v.into()));
        self
    }
    /// Adds headers.
    pub fn headers<K: Into<String>, V: Into<String>>(
        mut self,
        h: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.headers
            .extend(h.into_iter().map(|(k, v)| (k.into(), v.into())));
        self
    }
    /// The W3C trace context of the code writing the event
    /// (`00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`), checked at build. It is stored
    /// as the reserved header `traceparent` and sent with the message (the NATS header and the
    /// Redis field `traceparent`), so the consumer continues this trace; see
    /// [`crate::trace`]. Setting the header `traceparent` as well is a duplicate-key error.
    pub fn traceparent(mut self, v: impl Into<String>) -> Self {
        self.traceparent = Some(v.into());
        self
    }
    /// The trace context of the current `tracing` span, through tracing-opentelemetry (feature
    /// `opentelemetry`), as [`traceparent`](Self::traceparent) would store it. Without a valid
    /// OpenTelemetry context (no tracing-opentelemetry layer, no span) it stores none.
    #[cfg(feature = "opentelemetry")]
    pub fn current_trace_context(self) -> Self {
        match crate::trace::current() {
            Some(tp) => self.traceparent(tp.as_str()),
            None => self,
        }
    }
    /// Trace id (≤ 64).
    pub fn trace_id(mut self, v: impl Into<String>) -> Self {
        self.trace_id = Some(v.into());
        self
    }
    /// Idempotency key (≤ 128, R16).
    pub fn idempotency_key(mut self, v: impl Into<String>) -> Self {
        self.idempotency_key = Some(v.into());
        self
    }
    /// Correlation id (≤ 64).
    pub fn correlation_id(mut self, v: impl Into<String>) -> Self {
        self.correlation_id = Some(v.into());
        self
    }
    /// Causation id (≤ 64).
    pub fn causation_id(mut self, v: impl Into<String>) -> Self {
        self.causation_id = Some(v.into());
        self
    }
    /// Schema version (≤ 50).
    pub fn schema_version(mut self, v: impl Into<String>) -> Self {
        self.schema_version = Some(v.into());
        self
    }
    /// Attempt budget; 0 means the default 6 (R4).
    pub fn max_attempts(mut self, v: i64) -> Self {
        self.max_attempts = Some(v);
        self
    }
    /// Due after a delay on the backend clock (0 to 365 days, R8).
    pub fn delay(mut self, d: Duration) -> Self {
        self.schedule = Some(Schedule::Delay(d));
        self.delay_secs = None;
        self
    }
    /// Due after a delay given in seconds, which may be out of range (it is checked at build).
    pub fn delay_seconds(mut self, secs: f64) -> Self {
        self.delay_secs = Some(secs);
        self.schedule = None;
        self
    }
    /// Due at an absolute instant (within [t − skew, t + 365 days], R8).
    pub fn scheduled_at(mut self, at: DateTime<Utc>) -> Self {
        self.schedule = Some(Schedule::At(at));
        self.delay_secs = None;
        self
    }

    /// Validates with the default settings (system clock, 60 s skew).
    pub fn build(self) -> Result<NewEvent, ValidationError> {
        self.build_with(&BuildSettings::default())
    }

    /// Validates every field (R5 to R8) and assigns a UUIDv7 id.
    pub fn build_with(self, settings: &BuildSettings) -> Result<NewEvent, ValidationError> {
        let event_type = required("event_type", self.event_type, limits::EVENT_TYPE_MAX)?;
        let aggregate_type = required(
            "aggregate_type",
            self.aggregate_type,
            limits::AGGREGATE_TYPE_MAX,
        )?;
        let aggregate_id = self.aggregate_id.ok_or(ValidationError::Missing {
            field: "aggregate_id",
        })?;
        let topic = required("topic", self.topic, limits::TOPIC_MAX)?;
        let partition_key = required(
            "partition_key",
            self.partition_key,
            limits::PARTITION_KEY_MAX,
        )?;
        let trace_id = optional("trace_id", self.trace_id, limits::TRACE_ID_MAX)?;
        let correlation_id = optional("correlation_id", self.correlation_id, limits::TRACE_ID_MAX)?;
        let causation_id = optional("causation_id", self.causation_id, limits::TRACE_ID_MAX)?;
        let schema_version = optional(
            "schema_version",
            self.schema_version,
            limits::SCHEMA_VERSION_MAX,
        )?;
        let idempotency_key = optional(
            "idempotency_key",
            self.idempotency_key,
            limits::IDEMPOTENCY_KEY_MAX,
        )?;
        let (payload, payload_json) = validate_payload(self.payload)?;
        let mut raw_headers = self.headers;
        if let Some(tp) = self.traceparent {
            raw_headers.push((crate::trace::TRACEPARENT.to_owned(), tp));
        }
        let headers = validate_headers(raw_headers)?;
        let max_attempts = match self.max_attempts {
            None | Some(0) => limits::DEFAULT_MAX_ATTEMPTS,
            Some(n) if (1..=i32::MAX as i64).contains(&n) => n as i32,
            Some(n) => return Err(ValidationError::MaxAttempts(n)),
        };
        let schedule = match (self.schedule, self.delay_secs) {
            (_, Some(secs)) => {
                if !(secs.is_finite()
                    && (0.0..=limits::SCHEDULE_MAX_AHEAD_SECS as f64).contains(&secs))
                {
                    return Err(ValidationError::DelayOutOfRange { seconds: secs });
                }
                Schedule::Delay(Duration::from_secs_f64(secs))
            }
            (None, None) => Schedule::Now,
            (Some(Schedule::Delay(d)), None) => {
                if d > Duration::from_secs(limits::SCHEDULE_MAX_AHEAD_SECS as u64) {
                    return Err(ValidationError::DelayOutOfRange {
                        seconds: d.as_secs_f64(),
                    });
                }
                Schedule::Delay(d)
            }
            (Some(Schedule::At(at)), None) => {
                let t = settings.clock.now();
                let earliest = t
                    .checked_sub_signed(chrono::Duration::seconds(settings.skew_seconds as i64))
                    .unwrap_or(DateTime::<Utc>::MIN_UTC);
                let latest = t
                    .checked_add_signed(chrono::Duration::seconds(limits::SCHEDULE_MAX_AHEAD_SECS))
                    .unwrap_or(DateTime::<Utc>::MAX_UTC);
                if at < earliest || at > latest {
                    return Err(ValidationError::ScheduleOutOfWindow {
                        at,
                        earliest,
                        latest,
                        skew_seconds: settings.skew_seconds,
                    });
                }
                Schedule::At(at)
            }
            (Some(Schedule::Now), None) => Schedule::Now,
        };
        Ok(NewEvent {
            id: crate::ids::new_event_id(),
            event_type,
            payload,
            payload_json,
            headers,
            trace_id,
            idempotency_key,
            correlation_id,
            causation_id,
            schema_version,
            aggregate_type,
            aggregate_id,
            topic,
            partition_key,
            max_attempts,
            schedule,
        })
    }
}

/// Whether `c` is whitespace to the ancestor: what Python's `str.isspace()` accepts, and so what
/// its `str.strip()` removes. That is Unicode White_Space (Rust's [`char::is_whitespace`]) plus
/// the information separators U+001C to U+001F, which Python also counts as whitespace.
pub fn is_ancestor_whitespace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// `s` without leading and trailing [ancestor whitespace](is_ancestor_whitespace): every text the
/// contract trims (R6, R7, R9, R10, R66) is trimmed this way, so a value accepted here reads back
/// the same through the ancestor's model.
pub fn trim_ancestor(s: &str) -> &str {
    s.trim_matches(is_ancestor_whitespace)
}

/// The window an absolute schedule must meet at insert (R8, D2): `[created_at − 60 s,
/// created_at + 365 days]`, created_at being the backend clock when the row is inserted. It is
/// the ancestor's load check with its default skew; a row outside it would make the ancestor's
/// relay fail on the whole table (R78). Backends call this (or do the same in SQL) before they
/// insert anything, and refuse the write with
/// [`ValidationError::ScheduleOutsideInsertWindow`].
pub fn check_insert_window(
    id: Uuid,
    at: DateTime<Utc>,
    created_at: DateTime<Utc>,
) -> Result<(), ValidationError> {
    let earliest =
        created_at - chrono::Duration::seconds(limits::DEFAULT_SCHEDULE_SKEW_SECS as i64);
    let latest = created_at + chrono::Duration::seconds(limits::SCHEDULE_MAX_AHEAD_SECS);
    if at < earliest || at > latest {
        return Err(ValidationError::ScheduleOutsideInsertWindow { id, at, created_at });
    }
    Ok(())
}

fn check_len(field: &'static str, v: &str, max: usize) -> Result<(), ValidationError> {
    let n = v.chars().count();
    if n == 0 {
        return Err(ValidationError::Empty { field });
    }
    if n > max {
        return Err(ValidationError::TooLong {
            field,
            max,
            actual: n,
        });
    }
    Ok(())
}

fn required(field: &'static str, v: Option<String>, max: usize) -> Result<String, ValidationError> {
    let v = v.ok_or(ValidationError::Missing { field })?;
    let t = trim_ancestor(&v);
    check_len(field, t, max)?;
    Ok(t.to_owned())
}

fn optional(
    field: &'static str,
    v: Option<String>,
    max: usize,
) -> Result<Option<String>, ValidationError> {
    match v {
        None => Ok(None),
        Some(v) => {
            let t = trim_ancestor(&v);
            check_len(field, t, max)?;
            Ok(Some(t.to_owned()))
        }
    }
}

fn validate_payload(
    p: Option<PayloadInput>,
) -> Result<(Map<String, Value>, Arc<str>), ValidationError> {
    let v = match p {
        None => return Err(ValidationError::Missing { field: "payload" }),
        Some(PayloadInput::Error(e)) => return Err(e),
        Some(PayloadInput::Value(v)) => v,
    };
    let map = match v {
        Value::Object(m) => m,
        other => {
            return Err(ValidationError::PayloadNotObject {
                kind: match other {
                    Value::Null => "null",
                    Value::Bool(_) => "boolean",
                    Value::Number(_) => "number",
                    Value::String(_) => "string",
                    Value::Array(_) => "array",
                    Value::Object(_) => unreachable!(),
                },
            });
        }
    };
    if map.is_empty() {
        return Err(ValidationError::PayloadEmpty);
    }
    let json = serde_json::to_string(&map)
        .map_err(|e| ValidationError::PayloadSerialize(e.to_string()))?;
    if json.len() > limits::PAYLOAD_MAX_BYTES {
        return Err(ValidationError::PayloadTooLarge {
            bytes: json.len(),
            max: limits::PAYLOAD_MAX_BYTES,
        });
    }
    Ok((map, json.into()))
}

fn header_err(key: &str, problem: impl Into<String>) -> ValidationError {
    ValidationError::Header {
        key: key.to_owned(),
        problem: problem.into(),
    }
}

/// Validates headers (R6); an empty set becomes none.
pub fn validate_headers(
    raw: Vec<(String, String)>,
) -> Result<Option<BTreeMap<String, String>>, ValidationError> {
    if raw.len() > limits::HEADERS_MAX {
        return Err(ValidationError::TooManyHeaders {
            count: raw.len(),
            max: limits::HEADERS_MAX,
        });
    }
    let mut out = BTreeMap::new();
    let mut folded = std::collections::HashSet::new();
    for (k, v) in raw {
        let k = trim_ancestor(&k);
        let v = trim_ancestor(&v);
        if k.is_empty() {
            return Err(header_err(k, "key must not be empty or blank"));
        }
        let kn = k.chars().count();
        if kn > limits::HEADER_KEY_MAX {
            return Err(header_err(
                k,
                format!(
                    "key is {kn} characters long; the limit is {}",
                    limits::HEADER_KEY_MAX
                ),
            ));
        }
        if k.chars().any(|c| (c as u32) < 32 || c as u32 == 127) {
            return Err(header_err(k, "key contains a control character"));
        }
        if v.is_empty() {
            return Err(header_err(k, "value must not be empty or blank"));
        }
        let vn = v.chars().count();
        if vn > limits::HEADER_VALUE_MAX {
            return Err(header_err(
                k,
                format!(
                    "value is {vn} characters long; the limit is {}",
                    limits::HEADER_VALUE_MAX
                ),
            ));
        }
        if v.chars()
            .any(|c| ((c as u32) < 32 && c != '\t') || c as u32 == 127)
        {
            return Err(header_err(
                k,
                "value contains a control character (only TAB is allowed)",
            ));
        }
        if k.eq_ignore_ascii_case(crate::trace::TRACEPARENT) {
            if k != crate::trace::TRACEPARENT {
                return Err(header_err(
                    k,
                    "the reserved trace-context key is spelled `traceparent` (lowercase)",
                ));
            }
            crate::trace::TraceParent::parse(v)?;
        }
        if !folded.insert(k.to_lowercase()) {
            return Err(header_err(
                k,
                "duplicate key (keys must differ after trimming and ignoring case)",
            ));
        }
        out.insert(k.to_owned(), v.to_owned());
    }
    Ok(if out.is_empty() { None } else { Some(out) })
}

/// A validated worker id (R10): trimmed, 1 to 255 characters of `[A-Za-z0-9.\-/:]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerId(String);

impl WorkerId {
    /// Validates a worker id; anything else is `Invalid worker_id format: '<value>'`.
    pub fn new(v: impl AsRef<str>) -> Result<Self, ValidationError> {
        let raw = v.as_ref();
        let t = trim_ancestor(raw);
        let ok = !t.is_empty()
            && t.chars().count() <= limits::WORKER_ID_MAX
            && t.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '/' | ':'));
        if ok {
            Ok(Self(t.to_owned()))
        } else {
            Err(ValidationError::WorkerId(raw.to_owned()))
        }
    }

    /// A worker id unique per process start: `relay-<host>-<pid>-<random>` (R25).
    pub fn generate() -> Self {
        let host = std::env::var("HOSTNAME")
            .ok()
            .map(|h| {
                h.chars()
                    .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
                    .take(64)
                    .collect::<String>()
            })
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| "host".into());
        let nonce: u32 = rand::random();
        Self(format!("relay-{host}-{}-{nonce:08x}", std::process::id()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for WorkerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for WorkerId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Normalizes a failure text for last_error (R9): trimmed, `Unknown error` when empty, and cut
/// on a character boundary with the suffix `... [TRUNCATED]` when longer than `max_bytes`.
pub fn normalize_error(text: &str, max_bytes: usize) -> String {
    let t = trim_ancestor(text);
    if t.is_empty() {
        return limits::UNKNOWN_ERROR.to_owned();
    }
    if t.len() <= max_bytes {
        return t.to_owned();
    }
    let budget = max_bytes.saturating_sub(limits::TRUNCATED_SUFFIX.len());
    let mut end = budget.min(t.len());
    while !t.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{}", &t[..end], limits::TRUNCATED_SUFFIX)
}

/// Validates an `error_max_length` setting (R9): greater than the 15-byte truncation suffix
/// and at most [`limits::ERROR_MAX_LENGTH_MAX`] (2,000 bytes, the size of the `last_error`
/// column).
pub fn check_error_max_length(v: usize) -> Result<usize, crate::error::ConfigError> {
    if v <= limits::TRUNCATED_SUFFIX.len() {
        return Err(crate::error::ConfigError::new(format!(
            "error_max_length must be greater than {} (the length of the truncation suffix), got {v}",
            limits::TRUNCATED_SUFFIX.len()
        )));
    }
    if v > limits::ERROR_MAX_LENGTH_MAX {
        return Err(crate::error::ConfigError::new(format!(
            "error_max_length must be at most {} bytes (the size of the last_error column, varchar({})), got {v}; a longer text could not be stored",
            limits::ERROR_MAX_LENGTH_MAX,
            limits::ERROR_MAX_LENGTH_MAX
        )));
    }
    Ok(v)
}

/// Validates a force-unlock reason (R66) and returns the text stored as last_error.
pub fn force_unlock_text(reason: &str) -> Result<String, ValidationError> {
    let r = trim_ancestor(reason);
    if r.is_empty() {
        return Err(ValidationError::Argument(
            "force_unlock reason must not be empty".into(),
        ));
    }
    let n = r.chars().count();
    if n > limits::FORCE_UNLOCK_REASON_MAX {
        return Err(ValidationError::Argument(format!(
            "force_unlock reason is {n} characters long; the limit is {}",
            limits::FORCE_UNLOCK_REASON_MAX
        )));
    }
    Ok(format!("Force unlock: {r}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> EventBuilder {
        NewEvent::builder()
            .event_type("order.created")
            .aggregate("order", Uuid::new_v4())
            .topic("orders")
            .partition_key("k")
            .payload_json(json!({"n": 1}))
    }

    #[test]
    fn string_limits_at_and_past_the_edge() {
        type Set = fn(EventBuilder, String) -> EventBuilder;
        let cases: [(&str, usize, Set); 9] = [
            ("event_type", limits::EVENT_TYPE_MAX, |b, v| b.event_type(v)),
            ("aggregate_type", limits::AGGREGATE_TYPE_MAX, |b, v| {
                b.aggregate(v, Uuid::nil())
            }),
            ("topic", limits::TOPIC_MAX, |b, v| b.topic(v)),
            ("partition_key", limits::PARTITION_KEY_MAX, |b, v| {
                b.partition_key(v)
            }),
            ("idempotency_key", limits::IDEMPOTENCY_KEY_MAX, |b, v| {
                b.idempotency_key(v)
            }),
            ("trace_id", limits::TRACE_ID_MAX, |b, v| b.trace_id(v)),
            ("correlation_id", limits::TRACE_ID_MAX, |b, v| {
                b.correlation_id(v)
            }),
            ("causation_id", limits::TRACE_ID_MAX, |b, v| {
                b.causation_id(v)
            }),
            ("schema_version", limits::SCHEMA_VERSION_MAX, |b, v| {
                b.schema_version(v)
            }),
        ];
        for (field, max, set) in cases {
            // Characters, not bytes: a two-byte character counts once.
            assert!(
                set(base(), "ü".repeat(max)).build().is_ok(),
                "{field} at {max}"
            );
            assert_eq!(
                set(base(), "ü".repeat(max + 1)).build().unwrap_err(),
                ValidationError::TooLong {
                    field,
                    max,
                    actual: max + 1
                }
            );
            assert_eq!(
                set(base(), "  ".into()).build().unwrap_err(),
                ValidationError::Empty { field }
            );
            // Trimmed before counting.
            assert!(
                set(base(), format!(" {} ", "a".repeat(max)))
                    .build()
                    .is_ok()
            );
        }
    }

    #[test]
    fn payload_limits() {
        let at = json!({ "x": "a".repeat(999_992) });
        assert!(base().payload_json(at).build().is_ok());
        let past = json!({ "x": "a".repeat(999_993) });
        assert_eq!(
            base().payload_json(past).build().unwrap_err(),
            ValidationError::PayloadTooLarge {
                bytes: 1_000_001,
                max: 1_000_000
            }
        );
        assert_eq!(
            base().payload_json(json!({})).build().unwrap_err(),
            ValidationError::PayloadEmpty
        );
        assert_eq!(
            base().payload_json(json!([1])).build().unwrap_err(),
            ValidationError::PayloadNotObject { kind: "array" }
        );
        #[derive(serde::Serialize)]
        struct P {
            v: Vec<f64>,
        }
        let e = base()
            .payload(&P {
                v: vec![1.0, f64::NEG_INFINITY],
            })
            .build()
            .unwrap_err();
        assert!(matches!(e, ValidationError::PayloadNotFinite { .. }), "{e}");
        assert!(base().payload(&P { v: vec![1.5] }).build().is_ok());
    }

    #[test]
    fn header_limits() {
        let n = |n: usize| {
            (0..n)
                .map(|i| (format!("h{i}"), "v".to_string()))
                .collect::<Vec<_>>()
        };
        assert!(base().headers(n(100)).build().is_ok());
        assert_eq!(
            base().headers(n(101)).build().unwrap_err(),
            ValidationError::TooManyHeaders {
                count: 101,
                max: 100
            }
        );
        assert!(base().header("k".repeat(64), "v").build().is_ok());
        assert!(matches!(
            base().header("k".repeat(65), "v").build(),
            Err(ValidationError::Header { .. })
        ));
        assert!(base().header("k", "v".repeat(512)).build().is_ok());
        assert!(matches!(
            base().header("k", "v".repeat(513)).build(),
            Err(ValidationError::Header { .. })
        ));
        assert!(base().header("k", "a\tb").build().is_ok());
        for (k, v) in [
            ("k", "a\nb"),
            ("k\u{7f}", "v"),
            ("k\u{1}", "v"),
            ("k", "  "),
        ] {
            assert!(
                matches!(
                    base().header(k, v).build(),
                    Err(ValidationError::Header { .. })
                ),
                "{k:?}={v:?}"
            );
        }
        assert!(base().header("A", "1").header("a", "2").build().is_err());
        let e = base().header(" k ", " v ").build().unwrap();
        assert_eq!(e.headers().unwrap().get("k").map(String::as_str), Some("v"));
        assert!(
            base()
                .headers(Vec::<(String, String)>::new())
                .build()
                .unwrap()
                .headers()
                .is_none()
        );
    }

    #[test]
    fn schedule_window() {
        use crate::clock::ManualClock;
        let t = Utc::now();
        let s = BuildSettings::new().with_clock(Arc::new(ManualClock::new(t)));
        let at = |secs: i64| {
            base()
                .scheduled_at(t + chrono::Duration::seconds(secs))
                .build_with(&s)
        };
        assert!(at(-60).is_ok());
        assert!(matches!(
            at(-61),
            Err(ValidationError::ScheduleOutOfWindow { .. })
        ));
        assert!(at(31_536_000).is_ok());
        assert!(matches!(
            at(31_536_001),
            Err(ValidationError::ScheduleOutOfWindow { .. })
        ));
        assert!(
            base()
                .delay(Duration::from_secs(31_536_000))
                .build()
                .is_ok()
        );
        assert!(matches!(
            base().delay(Duration::from_secs(31_536_001)).build(),
            Err(ValidationError::DelayOutOfRange { .. })
        ));
        assert!(matches!(
            base().delay_seconds(-1.0).build(),
            Err(ValidationError::DelayOutOfRange { .. })
        ));
        let s0 = BuildSettings::new()
            .with_clock(Arc::new(ManualClock::new(t)))
            .with_skew_seconds(0)
            .unwrap();
        assert!(
            base()
                .scheduled_at(t - chrono::Duration::seconds(1))
                .build_with(&s0)
                .is_err()
        );
        assert!(BuildSettings::new().with_skew_seconds(-1).is_err());
    }

    #[test]
    fn max_attempts_and_missing_fields() {
        assert_eq!(base().max_attempts(0).build().unwrap().max_attempts(), 6);
        assert_eq!(base().build().unwrap().max_attempts(), 6);
        assert_eq!(base().max_attempts(1).build().unwrap().max_attempts(), 1);
        assert_eq!(
            base().max_attempts(-1).build().unwrap_err(),
            ValidationError::MaxAttempts(-1)
        );
        let e = NewEvent::builder().topic("t").build().unwrap_err();
        assert!(matches!(e, ValidationError::Missing { .. }));
    }

    #[test]
    fn worker_ids() {
        assert_eq!(
            WorkerId::new("worker_1").unwrap_err().to_string(),
            "Invalid worker_id format: 'worker_1'"
        );
        assert!(WorkerId::new("").is_err());
        assert!(WorkerId::new("a".repeat(255)).is_ok());
        assert!(WorkerId::new("a".repeat(256)).is_err());
        assert_eq!(
            WorkerId::new(" relay-1:host/a.b ").unwrap().as_str(),
            "relay-1:host/a.b"
        );
        let g = WorkerId::generate();
        assert!(WorkerId::new(g.as_str()).is_ok());
        assert_ne!(g, WorkerId::generate());
    }

    #[test]
    fn ancestor_whitespace_is_pythons_isspace_set() {
        // The code points for which Python 3's str.isspace() is true (checked over all of
        // Unicode with CPython 3): Unicode White_Space plus U+001C..U+001F.
        let python: Vec<u32> = [
            0x9, 0xa, 0xb, 0xc, 0xd, 0x1c, 0x1d, 0x1e, 0x1f, 0x20, 0x85, 0xa0,
        ]
        .into_iter()
        .chain([0x1680])
        .chain(0x2000..=0x200a)
        .chain([0x2028, 0x2029, 0x202f, 0x205f, 0x3000])
        .collect();
        let ours: Vec<u32> = (0..=0x10ffff)
            .filter_map(char::from_u32)
            .filter(|c| is_ancestor_whitespace(*c))
            .map(|c| c as u32)
            .collect();
        assert_eq!(ours, python);
        assert_eq!(trim_ancestor("\u{1f}\u{1c} k \u{3000}\u{1e}"), "k");
        assert_eq!(trim_ancestor("\u{200b}k"), "\u{200b}k");
    }

    #[test]
    fn insert_window_is_checked_against_created_at() {
        let c = Utc::now();
        let id = Uuid::nil();
        let s = chrono::Duration::seconds;
        assert!(check_insert_window(id, c - s(60), c).is_ok());
        assert!(check_insert_window(id, c + s(31_536_000), c).is_ok());
        for at in [c - s(61), c + s(31_536_001)] {
            let e = check_insert_window(id, at, c).unwrap_err();
            assert_eq!(
                e,
                ValidationError::ScheduleOutsideInsertWindow {
                    id,
                    at,
                    created_at: c
                }
            );
            assert!(e.to_string().contains("nothing was written"), "{e}");
        }
    }

    #[test]
    fn traceparent_is_validated_and_stored_as_the_reserved_header() {
        const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let e = base()
            .traceparent(TP)
            .header("tenant", "a")
            .build()
            .unwrap();
        assert_eq!(e.traceparent(), Some(TP));
        assert_eq!(
            e.headers().unwrap().get("traceparent").map(String::as_str),
            Some(TP)
        );
        let row = e.into_row(Utc::now());
        assert_eq!(row.traceparent(), Some(TP));
        // Through the header too, with the same check.
        assert_eq!(
            base()
                .header("traceparent", TP)
                .build()
                .unwrap()
                .traceparent(),
            Some(TP)
        );
        for b in [
            base().traceparent("not-a-trace"),
            base().header("traceparent", "00-xyz"),
            base().header("TraceParent", TP),
            base().traceparent(TP).header("traceparent", TP),
        ] {
            let err = b.build().unwrap_err();
            assert!(
                matches!(&err, ValidationError::Header { key, .. } if key.eq_ignore_ascii_case("traceparent")),
                "{err}"
            );
        }
        assert!(base().build().unwrap().traceparent().is_none());
    }

    #[test]
    fn error_text_normalization() {
        let x = normalize_error(&"x".repeat(3000), 2000);
        assert_eq!(x.len(), 2000);
        assert!(x.ends_with(limits::TRUNCATED_SUFFIX));
        assert_eq!(normalize_error(&"é".repeat(1001), 2000).len(), 1999);
        assert_eq!(normalize_error(" ", 2000), "Unknown error");
        assert!(check_error_max_length(15).is_err());
        assert!(check_error_max_length(16).is_ok());
        assert_eq!(check_error_max_length(2000).unwrap(), 2000);
        let e = check_error_max_length(2001).unwrap_err().to_string();
        assert!(
            e.contains("at most 2000") && e.contains("last_error"),
            "{e}"
        );
        assert_eq!(force_unlock_text("  ops ").unwrap(), "Force unlock: ops");
        assert!(force_unlock_text("").is_err());
        assert!(force_unlock_text(&"a".repeat(256)).is_err());
        assert!(force_unlock_text(&"a".repeat(255)).is_ok());
    }
}
