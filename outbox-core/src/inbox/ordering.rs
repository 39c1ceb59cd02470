//! Per-key order on the consumer side (contract R143 to R150), by the outbox's own rules.
//!
//! The inbox key is (consumer_group, source, partition_key); a row without partition_key, and
//! every row when key_order is off (R147), is a key of its own. Rather than a second copy of
//! the head rule, the inbox runs [`crate::ordering`] over a *view* of its rows: an
//! [`OutboxEvent`] whose topic is the source and whose partition key is the partition_key (or a
//! value unique to the row). Callers first keep only the rows of one group, so the view's key
//! is the inbox key.

use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::event::OutboxEvent;
use crate::inbox::model::InboxEvent;
use crate::ordering;

/// The outbox view of an inbox row, for the rules of [`crate::ordering`].
pub fn view(r: &InboxEvent, key_order: bool) -> OutboxEvent {
    let partition_key = view_key(r.id, r.partition_key.as_deref(), key_order);
    OutboxEvent {
        id: r.id,
        event_type: r.event_type.clone(),
        payload: serde_json::Value::Null,
        headers: None,
        trace_id: None,
        idempotency_key: None,
        correlation_id: None,
        causation_id: None,
        schema_version: None,
        status: r.status,
        attempts_made: r.attempts_made,
        max_attempts: r.max_attempts,
        last_error: r.last_error.clone(),
        scheduled_at: r.scheduled_at,
        completed_at: r.completed_at,
        locked_at: r.locked_at,
        locked_by: r.locked_by.clone(),
        created_at: r.created_at,
        updated_at: r.updated_at,
        aggregate_type: String::new(),
        aggregate_id: uuid::Uuid::nil(),
        topic: r.source.clone(),
        partition_key,
    }
}

/// The view's partition key of row `id`: its partition_key when key order is on and it has
/// one, else a value unique to the row.
pub fn view_key(id: uuid::Uuid, partition_key: Option<&str>, key_order: bool) -> String {
    match (partition_key, key_order) {
        (Some(pk), true) => format!("k:{pk}"),
        _ => format!("row:{id}"),
    }
}

/// Whether a fetch could take the row at `now`, ignoring its key: pending, due, attempts left,
/// not held or its lease expired (R116, R19).
pub fn fetchable(r: &InboxEvent, now: DateTime<Utc>, lease: Duration) -> bool {
    ordering::fetchable_unfiltered(&view(r, false), now, lease)
}

/// Whether the row's lease has expired at `now` (locked_at < now − lease).
pub fn lease_expired(r: &InboxEvent, now: DateTime<Utc>, lease: Duration) -> bool {
    ordering::lease_expired(&view(r, false), now, lease)
}

/// Whether the row is in line at `now` (R27).
pub fn in_line(r: &InboxEvent, now: DateTime<Utc>) -> bool {
    ordering::in_line(&view(r, false), now)
}

/// The write order (created_at, id) (R105).
pub fn write_order(r: &InboxEvent) -> (DateTime<Utc>, uuid::Uuid) {
    (r.created_at, r.id)
}

/// The 64-bit hash that orders a batch's key locks in a store that computes no hash of its own
/// (R185 step 1): FNV-1a over the key's JSON array text `["group","source","partition_key"]`.
/// Every runner of one store takes a batch's key locks in ascending order of one hash, so two
/// batches that share keys wait in one order and cannot deadlock (BT-07). PostgreSQL orders by
/// the hash that names its advisory lock instead (`hashtextextended`, key_locks.sql).
pub fn key_lock_hash(k: &crate::inbox::model::InboxKey) -> u64 {
    let text = serde_json::json!([k.consumer_group, k.source, k.partition_key]).to_string();
    text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}
