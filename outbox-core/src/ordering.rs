//! The per-key ordering contract (contract section 4), in one place.
//!
//! **Key.** The ordering key is `(topic, partition_key)` (R26). Write order is ascending
//! `(created_at, id)` (R73).
//!
//! **In line.** A row is *in line* when it is pending and it is due, or has a last_error (tried,
//! waiting for its retry), or is held, expired leases included (R27). The *line* of a key is its
//! in-line rows in write order.
//!
//! **Heads.** A fetchable row (pending, due, attempts_made < max_attempts, not held or lease
//! expired, matching the filters) is a *head* only when no earlier row of its key is in line;
//! the check ignores the fetch filters and comes before the batch limit (R29). So:
//!
//! * a counted or transient failure holds its key until it completes or becomes `failed` (R30);
//! * a row held by a live relay, or a crashed one until its lease expires, holds its key (R30);
//! * a `failed` row, and a never-tried future row, do not hold (R31);
//! * a requeued row is in line again and holds its successors (R32).
//!
//! **Runs.** With `max_per_key > 1` a fetch extends each head with the rows right behind it in
//! the line, while they are fetchable and lockable, up to `max_per_key` rows per key (R74). The
//! batch fills breadth-first: heads of up to `limit` keys ordered by the head's
//! `(scheduled_at, created_at, id)`, then every key's second row in head order, and so on (R20).
//! Rows come back grouped by key, keys in head order, each key in write order (R22).
//!
//! **Central invariant (R28).** A fetch never returns a row while an earlier row of its key is
//! in line and not returned by the same fetch.
//!
//! [`select`] implements these rules over rows in memory; it is what the in-memory backend runs.
//! The Postgres backends implement the same rules in SQL (`txoutbox_postgres::sql`). Conformance
//! scenarios O-01 to O-23 and check them on every backend.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::event::{OutboxEvent, Status};
use crate::repository::FetchFilter;

/// The ordering key `(topic, partition_key)` (R26).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key {
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
}

impl Key {
    /// A key.
    pub fn new(topic: impl Into<String>, partition_key: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            partition_key: partition_key.into(),
        }
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.topic, self.partition_key)
    }
}

/// The write-order sort key `(created_at, id)` (R73).
pub fn write_order(e: &OutboxEvent) -> (DateTime<Utc>, Uuid) {
    (e.created_at, e.id)
}

/// Whether the row is in line at `now` (R27).
pub fn in_line(e: &OutboxEvent, now: DateTime<Utc>) -> bool {
    e.status == Status::Pending
        && (e.scheduled_at <= now || e.last_error.is_some() || e.locked_at.is_some())
}

/// Whether a held row's lease has expired at `now` (locked_at < now − lease).
pub fn lease_expired(e: &OutboxEvent, now: DateTime<Utc>, lease: Duration) -> bool {
    match e.locked_at {
        None => false,
        // A lease longer than the clock's range never expires (no overflow on any input).
        Some(at) => chrono::Duration::from_std(lease)
            .ok()
            .and_then(|l| now.checked_sub_signed(l))
            .is_some_and(|cutoff| at < cutoff),
    }
}

/// Whether the row could be fetched at `now`, ignoring the filters.
pub fn fetchable_unfiltered(e: &OutboxEvent, now: DateTime<Utc>, lease: Duration) -> bool {
    e.status == Status::Pending
        && e.scheduled_at <= now
        && e.attempts_made < e.max_attempts
        && (e.locked_at.is_none() || lease_expired(e, now, lease))
}

/// Whether the row could be fetched at `now` under these filters.
pub fn fetchable(e: &OutboxEvent, now: DateTime<Utc>, lease: Duration, f: &FetchFilter) -> bool {
    fetchable_unfiltered(e, now, lease) && f.matches(e)
}

/// The lines of every key with at least one in-line row, each in write order.
pub fn lines<'a>(
    rows: impl IntoIterator<Item = &'a OutboxEvent>,
    now: DateTime<Utc>,
) -> HashMap<Key, Vec<&'a OutboxEvent>> {
    let mut by_key: HashMap<Key, Vec<&OutboxEvent>> = HashMap::new();
    for e in rows {
        if in_line(e, now) {
            by_key.entry(e.key()).or_default().push(e);
        }
    }
    for line in by_key.values_mut() {
        line.sort_by_key(|e| write_order(e));
    }
    by_key
}

/// Selects the rows one fetch hands out (R20, R22, R28, R29, R74), in return order.
pub fn select<'a>(
    rows: impl IntoIterator<Item = &'a OutboxEvent>,
    now: DateTime<Utc>,
    limit: usize,
    lease: Duration,
    max_per_key: usize,
    filter: &FetchFilter,
) -> Vec<&'a OutboxEvent> {
    let lines = lines(rows, now);
    // Heads: the first row of each line, when fetchable (filters included).
    let mut heads: Vec<&Vec<&OutboxEvent>> = lines
        .values()
        .filter(|line| fetchable(line[0], now, lease, filter))
        .collect();
    heads.sort_by_key(|line| (line[0].scheduled_at, line[0].created_at, line[0].id));
    heads.truncate(limit);
    // Runs: the longest fetchable prefix of each line, up to max_per_key.
    let runs: Vec<usize> = heads
        .iter()
        .map(|line| {
            line.iter()
                .take(max_per_key.max(1))
                .take_while(|e| fetchable(e, now, lease, filter))
                .count()
        })
        .collect();
    // Breadth-first fill up to `limit` rows.
    let mut take = vec![0usize; heads.len()];
    let mut total = 0;
    let mut depth = 0;
    while total < limit {
        let mut added = false;
        for (i, run) in runs.iter().enumerate() {
            if total == limit {
                break;
            }
            if *run > depth {
                take[i] += 1;
                total += 1;
                added = true;
            }
        }
        if !added {
            break;
        }
        depth += 1;
    }
    heads
        .iter()
        .zip(take)
        .flat_map(|(line, n)| line.iter().take(n).copied())
        .collect()
}

/// Whether a key is blocked for the operator view (R80): its first in-line row waits for a
/// retry or is held under a live lease.
/// A parked head (R191, R193) is blocked too.
pub fn head_is_blocked(head: &OutboxEvent, now: DateTime<Utc>, lease: Duration) -> bool {
    (head.locked_at.is_some() && !lease_expired(head, now, lease))
        || head.scheduled_at > now
        || is_parked(head)
}

/// Whether the row is parked (R191): pending with attempts_made ≥ max_attempts. Parked rows are
/// in line (their last_error is set) and never fetchable, so they hold their keys.
pub fn is_parked(e: &OutboxEvent) -> bool {
    crate::repository::is_parked(e.status, e.attempts_made, e.max_attempts)
}
