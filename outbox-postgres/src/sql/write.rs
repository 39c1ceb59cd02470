//! The write: the insert, its schedule refusal, its binds and the plan of repeats.

use super::*;

/// Marks the error the insert raises for an absolute schedule outside the insert window; see
/// [`schedule_refusal`].
pub const SCHEDULE_REFUSED: &str = "outbox-schedule-refused";

/// The insert of [`Statements::insert`] for the quoted table `t` and column list `cols`;
/// `guard` (empty, or `WHERE …` over the unnested row `u`) decides which rows are inserted.
///
/// An absolute scheduled_at is checked against created_at, the database clock at insert: outside
/// [created_at − 60 s, created_at + 365 days] (R8, D2; the ancestor's load check) the statement
/// fails before it inserts anything, by casting a marked text to timestamptz (plain SQL has no
/// RAISE); [`schedule_refusal`] turns that error into
/// [`ValidationError::ScheduleOutsideInsertWindow`].
pub(super) fn insert_statement(t: &str, cols: &str, guard: &str) -> String {
    let skew = txoutbox_core::event::limits::DEFAULT_SCHEDULE_SKEW_SECS;
    let ahead = txoutbox_core::event::limits::SCHEDULE_MAX_AHEAD_SECS;
    format!(
        "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS ts)
INSERT INTO {t} ({cols})
SELECT u.id, u.event_type, u.payload::jsonb, u.headers::jsonb, u.trace_id, u.idempotency_key,
       u.correlation_id, u.causation_id, u.schema_version, 'pending', 0, u.max_attempts, NULL,
       CASE WHEN u.scheduled_at IS NULL
                 THEN c.ts + COALESCE(u.delay_us, 0) * INTERVAL '1 microsecond'
            WHEN u.scheduled_at >= c.ts - INTERVAL '{skew} seconds'
             AND u.scheduled_at <= c.ts + INTERVAL '{ahead} seconds'
                 THEN u.scheduled_at
            ELSE ('{SCHEDULE_REFUSED} ' || u.id::text
                  || ' ' || (EXTRACT(EPOCH FROM u.scheduled_at) * 1000000)::int8::text
                  || ' ' || (EXTRACT(EPOCH FROM c.ts) * 1000000)::int8::text)::timestamptz
       END,
       NULL, NULL, NULL, c.ts, c.ts, u.aggregate_type, u.aggregate_id, u.topic, u.partition_key
  FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
              $8::text[], $9::text[], $10::int4[], $11::timestamptz[], $12::int8[], $13::text[],
              $14::uuid[], $15::text[], $16::text[])
       WITH ORDINALITY AS u(id, event_type, payload, headers, trace_id, idempotency_key,
                            correlation_id, causation_id, schema_version, max_attempts,
                            scheduled_at, delay_us, aggregate_type, aggregate_id, topic,
                            partition_key, ord)
 CROSS JOIN c{guard}
 ORDER BY u.ord
ON CONFLICT DO NOTHING
RETURNING {cols}"
    )
}

/// The refusal of an absolute schedule by the insert ([`SCHEDULE_REFUSED`]), read back from a
/// database error message; `None` for any other error. Both Postgres backends map their insert
/// errors through this first.
pub fn schedule_refusal(message: &str) -> Option<txoutbox_core::ValidationError> {
    let rest = &message[message.find(SCHEDULE_REFUSED)? + SCHEDULE_REFUSED.len()..];
    let mut parts = rest
        .split(|c: char| c.is_whitespace() || c == '"')
        .filter(|p| !p.is_empty());
    let id = parts.next()?.parse::<Uuid>().ok()?;
    let mut micros = || {
        parts
            .next()?
            .parse::<i64>()
            .ok()
            .and_then(DateTime::<Utc>::from_timestamp_micros)
    };
    let at = micros()?;
    let created_at = micros()?;
    Some(txoutbox_core::ValidationError::ScheduleOutsideInsertWindow { id, at, created_at })
}

#[cfg(test)]
mod schedule_refusal_tests {
    use super::*;

    #[test]
    fn the_insert_refusal_is_read_back_and_other_errors_are_not() {
        let id = Uuid::now_v7();
        let msg = format!(
            "invalid input syntax for type timestamp with time zone: \"{SCHEDULE_REFUSED} {id} 1700000000000000 1700000090000001\""
        );
        let at = DateTime::<Utc>::from_timestamp_micros(1_700_000_000_000_000).unwrap();
        let created_at = DateTime::<Utc>::from_timestamp_micros(1_700_000_090_000_001).unwrap();
        assert_eq!(
            schedule_refusal(&msg),
            Some(
                txoutbox_core::ValidationError::ScheduleOutsideInsertWindow { id, at, created_at }
            )
        );
        assert_eq!(
            schedule_refusal("invalid input syntax for type timestamp"),
            None
        );
        assert_eq!(
            schedule_refusal(&format!("{SCHEDULE_REFUSED} not-a-uuid 1 2")),
            None
        );
    }

    #[test]
    fn both_layouts_check_an_absolute_schedule_at_insert() {
        let t = TableName::new("outbox_events").unwrap();
        for layout in [Layout::Plain, Layout::Partitioned] {
            let s = Statements::with_layout(&t, layout).insert;
            assert!(s.contains(SCHEDULE_REFUSED), "{layout:?}");
            assert!(s.contains("c.ts - INTERVAL '60 seconds'"), "{layout:?}");
            assert!(
                s.contains("c.ts + INTERVAL '31536000 seconds'"),
                "{layout:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Writing: parameters and repeats within one call
// ---------------------------------------------------------------------------------------------

/// The sixteen array parameters of [`Statements::insert`], in bind order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct InsertColumns {
    /// `$1`.
    pub id: Vec<Uuid>,
    /// `$2`.
    pub event_type: Vec<String>,
    /// `$3` payload as compact JSON.
    pub payload: Vec<String>,
    /// `$4` headers as JSON, or NULL.
    pub headers: Vec<Option<String>>,
    /// `$5`.
    pub trace_id: Vec<Option<String>>,
    /// `$6`.
    pub idempotency_key: Vec<Option<String>>,
    /// `$7`.
    pub correlation_id: Vec<Option<String>>,
    /// `$8`.
    pub causation_id: Vec<Option<String>>,
    /// `$9`.
    pub schema_version: Vec<Option<String>>,
    /// `$10`.
    pub max_attempts: Vec<i32>,
    /// `$11` absolute scheduled_at.
    pub scheduled_at: Vec<Option<DateTime<Utc>>>,
    /// `$12` delay in microseconds.
    pub delay_us: Vec<Option<i64>>,
    /// `$13`.
    pub aggregate_type: Vec<String>,
    /// `$14`.
    pub aggregate_id: Vec<Uuid>,
    /// `$15`.
    pub topic: Vec<String>,
    /// `$16`.
    pub partition_key: Vec<String>,
}

impl InsertColumns {
    /// The columns of these events, in order.
    pub fn new<'a>(events: impl IntoIterator<Item = &'a NewEvent>) -> Self {
        let mut c = Self::default();
        for e in events {
            c.id.push(e.id());
            c.event_type.push(e.event_type().to_owned());
            c.payload.push(e.payload_json().to_owned());
            c.headers.push(e.headers_json().map(|h| h.to_string()));
            c.trace_id.push(e.trace_id().map(str::to_owned));
            c.idempotency_key
                .push(e.idempotency_key().map(str::to_owned));
            c.correlation_id.push(e.correlation_id().map(str::to_owned));
            c.causation_id.push(e.causation_id().map(str::to_owned));
            c.schema_version.push(e.schema_version().map(str::to_owned));
            c.max_attempts.push(e.max_attempts());
            c.scheduled_at.push(e.scheduled_at());
            c.delay_us.push(e.delay().map(micros));
            c.aggregate_type.push(e.aggregate_type().to_owned());
            c.aggregate_id.push(e.aggregate_id());
            c.topic.push(e.topic().to_owned());
            c.partition_key.push(e.partition_key().to_owned());
        }
        c
    }
}

/// How one write call handles repeats (R16): `first[i]` is the index of the first event in the
/// call with event i's idempotency key (or, without a key, its id); `unique` lists the indexes
/// to insert, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WritePlan {
    /// For each event, the index of the event whose result it shares.
    pub first: Vec<usize>,
    /// The events to send to [`Statements::insert`], in call order.
    pub unique: Vec<usize>,
}

/// Collapses repeats within one write call: a repeated idempotency key, or a repeated id, goes
/// to its first occurrence (R16; I-04).
pub fn dedupe_write(events: &[NewEvent]) -> WritePlan {
    let mut by_key: BTreeMap<&str, usize> = BTreeMap::new();
    let mut by_id: BTreeMap<Uuid, usize> = BTreeMap::new();
    let mut first = Vec::with_capacity(events.len());
    let mut unique = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let prior = e
            .idempotency_key()
            .and_then(|k| by_key.get(k).copied())
            .or_else(|| by_id.get(&e.id()).copied());
        match prior {
            Some(p) => first.push(p),
            None => {
                if let Some(k) = e.idempotency_key() {
                    by_key.insert(k, i);
                }
                by_id.insert(e.id(), i);
                first.push(i);
                unique.push(i);
            }
        }
    }
    WritePlan { first, unique }
}
