//! Reading rows: [`RawRow`] and its decoding.

use super::*;

// ---------------------------------------------------------------------------------------------
// Reading: row mapping
// ---------------------------------------------------------------------------------------------

/// One row as the driver decodes [`COLUMNS`], before the outbox's own decoding. The Rust type
/// of each field is what a driver should decode the column into.
#[derive(Debug, Clone, PartialEq)]
pub struct RawRow {
    /// `id uuid`.
    pub id: Uuid,
    /// `event_type varchar`.
    pub event_type: String,
    /// `payload jsonb`.
    pub payload: serde_json::Value,
    /// `headers jsonb` (NULL → None). Must be an object of strings to decode (R82).
    pub headers: Option<serde_json::Value>,
    /// `trace_id varchar`.
    pub trace_id: Option<String>,
    /// `idempotency_key varchar`.
    pub idempotency_key: Option<String>,
    /// `correlation_id varchar`.
    pub correlation_id: Option<String>,
    /// `causation_id varchar`.
    pub causation_id: Option<String>,
    /// `schema_version varchar`.
    pub schema_version: Option<String>,
    /// `status varchar`: `pending`, `completed` or `failed` to decode.
    pub status: String,
    /// `attempts_made integer`.
    pub attempts_made: i32,
    /// `max_attempts integer`.
    pub max_attempts: i32,
    /// `last_error varchar`.
    pub last_error: Option<String>,
    /// `scheduled_at timestamptz`.
    pub scheduled_at: DateTime<Utc>,
    /// `completed_at timestamptz`.
    pub completed_at: Option<DateTime<Utc>>,
    /// `locked_at timestamptz`.
    pub locked_at: Option<DateTime<Utc>>,
    /// `locked_by varchar`.
    pub locked_by: Option<String>,
    /// `created_at timestamptz`.
    pub created_at: DateTime<Utc>,
    /// `updated_at timestamptz` (nullable in the ancestor's DDL).
    pub updated_at: Option<DateTime<Utc>>,
    /// `aggregate_type varchar`.
    pub aggregate_type: String,
    /// `aggregate_id uuid`.
    pub aggregate_id: Uuid,
    /// `topic varchar`.
    pub topic: String,
    /// `partition_key varchar`.
    pub partition_key: String,
}

/// Headers as stored (jsonb or NULL) to the event's map: NULL, JSON null and `{}` are none; an
/// object whose values are all strings is the map; anything else cannot be decoded (R82).
pub fn decode_headers(
    v: Option<serde_json::Value>,
) -> Result<Option<BTreeMap<String, String>>, String> {
    match v {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Object(m)) => {
            if m.is_empty() {
                return Ok(None);
            }
            let mut out = BTreeMap::new();
            for (k, v) in m {
                match v {
                    serde_json::Value::String(s) => {
                        out.insert(k, s);
                    }
                    other => {
                        return Err(format!(
                            "headers must map strings to strings, but {k:?} holds {other}"
                        ));
                    }
                }
            }
            Ok(Some(out))
        }
        Some(other) => Err(format!("headers must be a JSON object, got {other}")),
    }
}

/// A PostgreSQL timestamp (microseconds since 2000-01-01 00:00 UTC, as the binary protocol
/// sends it) as a chrono time, or `None` for `±infinity` and values outside chrono's range
/// (R82: the row is then undecodable; nothing panics).
pub fn timestamp_from_pg_micros(micros: i64) -> Option<DateTime<Utc>> {
    let epoch = DateTime::<Utc>::from_timestamp(946_684_800, 0)?;
    if micros == i64::MAX || micros == i64::MIN {
        return None;
    }
    epoch.checked_add_signed(chrono::Duration::microseconds(micros))
}

impl RawRow {
    /// Decodes the row, or says why it cannot be (R82). The error is the text after
    /// `undecodable row: ` (the relay adds the prefix).
    pub fn decode(mut self) -> Result<OutboxEvent, UndecodableRow> {
        let status = self.status.parse::<Status>();
        let headers = decode_headers(self.headers.take());
        let reason = match (&status, &headers) {
            (Err(e), _) => Some(e.clone()),
            (_, Err(e)) => Some(e.clone()),
            _ => None,
        };
        if let Some(reason) = reason {
            return Err(UndecodableRow {
                id: self.id,
                topic: self.topic,
                partition_key: self.partition_key,
                attempts_made: self.attempts_made,
                reason,
            });
        }
        Ok(OutboxEvent {
            id: self.id,
            event_type: self.event_type,
            payload: self.payload,
            headers: headers.expect("checked"),
            trace_id: self.trace_id,
            idempotency_key: self.idempotency_key,
            correlation_id: self.correlation_id,
            causation_id: self.causation_id,
            schema_version: self.schema_version,
            status: status.expect("checked"),
            attempts_made: self.attempts_made,
            max_attempts: self.max_attempts,
            last_error: self.last_error,
            scheduled_at: self.scheduled_at,
            completed_at: self.completed_at,
            locked_at: self.locked_at,
            locked_by: self.locked_by,
            created_at: self.created_at,
            updated_at: self.updated_at,
            aggregate_type: self.aggregate_type,
            aggregate_id: self.aggregate_id,
            topic: self.topic,
            partition_key: self.partition_key,
        })
    }
}
