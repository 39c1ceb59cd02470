//! The validating builder of a [`NewEvent`](super::NewEvent) (R5 to R8) and its settings.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::Serialize;
use serde_json::{Map, Value};
use uuid::Uuid;

use crate::clock::{Clock, SystemClock};
use crate::error::ValidationError;

use super::*;

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
