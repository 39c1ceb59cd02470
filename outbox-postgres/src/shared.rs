//! Driver-independent Rust around the statements of [`crate::sql`], shared by the sqlx backend
//! of this crate and by `outbox-diesel`: turning a cycle's outcomes into the binds of the three
//! outcome statements, and assembling a write call's results. Like [`crate::sql`] it compiles
//! without the `sqlx` feature.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::{NewEvent, OutboxEvent, normalize_error};
use txoutbox_core::repository::{
    Fetched, OnExhausted, Outcome, OutcomeKind, OutcomeResult, Retry, WriteResult, WrittenOutcome,
};
use uuid::Uuid;

use crate::sql::{self, WritePlan};

/// The binds of one cycle's outcome statements (R54): `complete` takes `done`, `release` takes
/// `released`, and `fail` takes the five `fail_*` arrays (one element per failed row).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OutcomeBinds {
    /// Rows to complete (`$1` of [`sql::Statements::complete`]).
    pub done: Vec<Uuid>,
    /// Rows to release untouched (`$1` of [`sql::Statements::release`]).
    pub released: Vec<Uuid>,
    /// Failed rows (`$1` of [`sql::Statements::fail`]).
    pub fail_ids: Vec<Uuid>,
    /// Whether each failure spends an attempt (`$2`).
    pub fail_counted: Vec<bool>,
    /// Each failure's normalized text (`$3`, R9).
    pub fail_errors: Vec<String>,
    /// Each failure's delay in microseconds from the database's now, if any (`$4`).
    pub fail_after_us: Vec<Option<i64>>,
    /// Each failure's explicit next try, if any (`$5`); neither means keep the schedule.
    pub fail_at: Vec<Option<DateTime<Utc>>>,
    /// Whether each failure parks the row when it spends the last attempt (`$7`, R191).
    pub fail_park: Vec<bool>,
}

impl OutcomeBinds {
    /// Groups outcomes by statement; failure texts are normalized to `error_max_length`.
    pub fn new(outcomes: &[Outcome], error_max_length: usize) -> Self {
        let mut b = Self::default();
        for o in outcomes {
            let (counted, error, retry, park) = match &o.kind {
                OutcomeKind::Completed => {
                    b.done.push(o.id);
                    continue;
                }
                OutcomeKind::Released => {
                    b.released.push(o.id);
                    continue;
                }
                OutcomeKind::Counted {
                    error,
                    retry,
                    exhausted,
                } => (true, error, *retry, *exhausted == OnExhausted::Park),
                OutcomeKind::Transient { error, retry } => (false, error, *retry, false),
                OutcomeKind::Deferred { error } => (false, error, Retry::Keep, false),
            };
            let (after, at) = match retry {
                Retry::Keep => (None, None),
                Retry::After(d) => (Some(sql::micros(d)), None),
                Retry::At(t) => (None, Some(t)),
            };
            b.fail_ids.push(o.id);
            b.fail_counted.push(counted);
            b.fail_errors.push(normalize_error(error, error_max_length));
            b.fail_after_us.push(after);
            b.fail_at.push(at);
            b.fail_park.push(park);
        }
        b
    }
}

/// The per-row report of an outcome write, in input order: a row no statement returned lost
/// its lease (R55).
pub fn written_outcomes(
    outcomes: &[Outcome],
    results: &HashMap<Uuid, OutcomeResult>,
) -> Vec<WrittenOutcome> {
    outcomes
        .iter()
        .map(|o| WrittenOutcome {
            id: o.id,
            result: results
                .get(&o.id)
                .cloned()
                .unwrap_or(OutcomeResult::LeaseLost),
        })
        .collect()
}

/// Delivery in one transaction (R84): the outcomes that are written, completions and counted
/// failures; transient, deferred and released rows end with the transaction, untouched.
pub fn delivery_writes(outcomes: &[Outcome]) -> Vec<Outcome> {
    outcomes
        .iter()
        .filter(|o| matches!(o.kind, OutcomeKind::Completed | OutcomeKind::Counted { .. }))
        .cloned()
        .collect()
}

/// The state of fetched rows, as reported for the rows a delivery does not write.
pub fn fetched_state(rows: &[Fetched]) -> HashMap<Uuid, OutcomeResult> {
    rows.iter()
        .filter_map(|f| f.row())
        .map(|e| {
            (
                e.id,
                OutcomeResult::Applied {
                    status: e.status,
                    attempts_made: e.attempts_made,
                    scheduled_at: e.scheduled_at,
                },
            )
        })
        .collect()
}

/// The per-row report of a delivery's commit, in input order: written rows as the statements
/// returned them (a written row no statement returned lost its row: `LeaseLost`), rows not
/// written as fetched.
pub fn delivery_outcomes(
    outcomes: &[Outcome],
    written: &HashMap<Uuid, OutcomeResult>,
    fetched: &HashMap<Uuid, OutcomeResult>,
) -> Vec<WrittenOutcome> {
    outcomes
        .iter()
        .map(|o| {
            let is_written = matches!(o.kind, OutcomeKind::Completed | OutcomeKind::Counted { .. });
            let from = if is_written { written } else { fetched };
            WrittenOutcome {
                id: o.id,
                result: from.get(&o.id).cloned().unwrap_or(OutcomeResult::LeaseLost),
            }
        })
        .collect()
}

/// The events of a write call that the insert skipped (a duplicate id or idempotency key), as
/// the binds of [`sql::Statements::select_existing`]: their ids and their keys. `None` when the
/// insert took every event.
pub fn skipped_lookup(
    events: &[NewEvent],
    plan: &WritePlan,
    inserted: &HashMap<Uuid, OutboxEvent>,
) -> Option<(Vec<Uuid>, Vec<String>)> {
    let skipped: Vec<&NewEvent> = plan
        .unique
        .iter()
        .map(|&i| &events[i])
        .filter(|e| !inserted.contains_key(&e.id()))
        .collect();
    if skipped.is_empty() {
        return None;
    }
    Some((
        skipped.iter().map(|e| e.id()).collect(),
        skipped
            .iter()
            .filter_map(|e| e.idempotency_key().map(str::to_owned))
            .collect(),
    ))
}

/// Assembles a write call's results (R13, R16): per event, the inserted row, or the row already
/// there with its idempotency key or id; a repeat within the call shares its first occurrence's
/// row and reports `inserted = false`.
pub fn write_results(
    events: &[NewEvent],
    plan: &WritePlan,
    inserted: &HashMap<Uuid, OutboxEvent>,
    existing: Vec<OutboxEvent>,
) -> Result<Vec<WriteResult>, RepositoryError> {
    let mut by_key: HashMap<String, OutboxEvent> = HashMap::new();
    let mut by_id: HashMap<Uuid, OutboxEvent> = HashMap::new();
    for e in existing {
        if let Some(k) = &e.idempotency_key {
            by_key.insert(k.clone(), e.clone());
        }
        by_id.insert(e.id, e);
    }
    let mut firsts: HashMap<usize, WriteResult> = HashMap::with_capacity(plan.unique.len());
    for &i in &plan.unique {
        let ev = &events[i];
        let res = match inserted.get(&ev.id()) {
            Some(row) => WriteResult {
                event: row.clone(),
                inserted: true,
            },
            None => WriteResult {
                event: ev
                    .idempotency_key()
                    .and_then(|k| by_key.get(k))
                    .or_else(|| by_id.get(&ev.id()))
                    .cloned()
                    .ok_or_else(|| {
                        RepositoryError::Other(format!(
                            "event {} was neither inserted nor found (a conflicting row vanished meanwhile); retry the write",
                            ev.id()
                        ))
                    })?,
                inserted: false,
            },
        };
        firsts.insert(i, res);
    }
    Ok(plan
        .first
        .iter()
        .enumerate()
        .map(|(i, &f)| {
            let r = &firsts[&f];
            WriteResult {
                event: r.event.clone(),
                inserted: r.inserted && i == f,
            }
        })
        .collect())
}

/// Checks the isolation level that [`sql::Statements::idempotency_lock`] returned (partitioned
/// layout, R17): the per-key locks make a second writer of a key see the first one's row only
/// when its next statement takes a fresh snapshot (READ COMMITTED) or when the database aborts
/// one of the two (SERIALIZABLE). Under REPEATABLE READ the transaction's snapshot can predate
/// the other writer's commit, and the key would be stored twice, so the write is refused.
pub fn check_write_isolation(
    table: &sql::TableName,
    isolation: &str,
) -> Result<(), RepositoryError> {
    if isolation == "repeatable read" {
        return Err(RepositoryError::Other(format!(
            "writing events with idempotency keys to the partitioned outbox table {table} needs a READ COMMITTED or SERIALIZABLE transaction, not REPEATABLE READ (its snapshot can miss a concurrent writer's row of the same key, R17); nothing was written: write in a READ COMMITTED transaction, or leave the keys out"
        )));
    }
    Ok(())
}
