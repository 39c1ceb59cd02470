//! The lines a consumer's failures leave in the logs (R197, checked by OP-13): every failure a
//! runner or processor records at warn, every terminal failure (and park or discard) at error,
//! every delivery that cannot land at warn with its cause and what to do. Each line names the
//! message (message id, group, source, partition key), the attempt and the budget, the next try
//! and the error; error texts pass through [`secrets`] first, so a driver error that quotes a
//! connection URL prints no password.
//!
//! The runner ([`super::Runner`]) and the processor ([`super::Processor`]) call these at the
//! point where the outcome is known (after T or T_row wrote it); nothing else logs them, so a
//! failure is logged once.

use chrono::{DateTime, Utc};

use crate::error::RepositoryError;
use crate::inbox::model::{InboxEvent, NewInboxEvent};
use crate::redact::secrets;

/// Who wrote the outcome: the `by` field of a line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recorder {
    /// The runner, in the delivery's transaction T.
    Runner,
    /// The processor (standalone or embedded), in T_row.
    Processor,
}

impl Recorder {
    fn as_str(self) -> &'static str {
        match self {
            Recorder::Runner => "runner",
            Recorder::Processor => "processor",
        }
    }
}

/// How a row ended for good: the lines at error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // Discarded: a discard runs in the repository, outside runner and processor.
pub(crate) enum RowEnd {
    /// Its attempts are spent (or its failure was terminal): `failed`.
    Failed,
    /// Parked with its key behind it (R191).
    Parked,
    /// Discarded by an operator (R192).
    Discarded,
}

/// A failure written to a row.
#[derive(Debug)]
pub(crate) struct Recorded<'a> {
    /// Who wrote it.
    pub by: Recorder,
    /// The consumer group.
    pub group: &'a str,
    /// The row as the run found it (before the write).
    pub row: &'a InboxEvent,
    /// Whether the failure spent an attempt.
    pub counted: bool,
    /// The next try as written.
    pub next_try: DateTime<Utc>,
    /// Whether the row became `failed`.
    pub terminal: bool,
    /// Whether the row was parked (R191): still `pending` with its attempts spent.
    pub parked: bool,
    /// The failure's text.
    pub error: &'a str,
}

/// Logs a failure written to a row: at warn, or, when the row became `failed` or was parked,
/// at error (then through [`row_ended`]). `attempt` is the number of the attempt that failed (the row's
/// attempts before the run, plus one).
pub(crate) fn recorded(f: &Recorded<'_>) {
    if f.terminal {
        row_ended(RowEnd::Failed, f.by, f.group, f.row, f.error);
        return;
    }
    if f.parked {
        row_ended(RowEnd::Parked, f.by, f.group, f.row, f.error);
        return;
    }
    let r = f.row;
    tracing::warn!(
        by = %f.by.as_str(),
        message_id = %r.message_id,
        group = %f.group,
        source = %r.source,
        partition_key = %r.partition_key.as_deref().unwrap_or(""),
        attempt = r.attempts_made.saturating_add(1),
        max_attempts = r.max_attempts,
        counted = f.counted,
        next_try = %f.next_try.to_rfc3339(),
        error = %secrets(f.error),
        "inbox handler failed; the failure is recorded in its row and the message is tried again at next_try"
    );
}

/// Logs a row that ended for good, at error: `failed` (its attempts spent), parked or
/// discarded, with what an operator can do about it.
pub(crate) fn row_ended(end: RowEnd, by: Recorder, group: &str, row: &InboxEvent, error: &str) {
    let what = match end {
        RowEnd::Failed => {
            "inbox message failed for good (status failed, no further try); fix the cause, then \
             send it again with `outbox-relay inbox requeue-failed --id <row id>`"
        }
        RowEnd::Parked => {
            "inbox message parked: its key waits behind it; fix the cause, then redrive or \
             discard the key with `outbox-relay inbox`"
        }
        RowEnd::Discarded => "inbox message discarded: it will not be handled",
    };
    tracing::error!(
        by = %by.as_str(),
        message_id = %row.message_id,
        row_id = %row.id,
        group = %group,
        source = %row.source,
        partition_key = %row.partition_key.as_deref().unwrap_or(""),
        attempt = row.attempts_made.saturating_add(1),
        max_attempts = row.max_attempts,
        error = %secrets(error),
        "{what}"
    );
}

/// Logs a handler failure that the runner did not record but gave back to the broker (the
/// rewind path, R127): at warn, with the delivery number as the attempt.
pub(crate) fn rewound(
    group: &str,
    event: &NewInboxEvent,
    delivery: u32,
    delay: std::time::Duration,
    error: &str,
) {
    tracing::warn!(
        by = %Recorder::Runner.as_str(),
        message_id = %event.message_id(),
        group = %group,
        source = %event.source(),
        partition_key = %event.partition_key().unwrap_or(""),
        attempt = delivery,
        retry_in = ?delay,
        error = %secrets(error),
        "inbox handler failed; the delivery goes back to the broker and comes again after retry_in"
    );
}

/// Logs a delivery that cannot land (its transaction failed before a row held it): at warn,
/// with the cause and what to do.
pub(crate) fn unlandable(group: &str, event: &NewInboxEvent, error: &RepositoryError) {
    let what = match error {
        RepositoryError::Schema(_) => {
            "inbox delivery cannot land: the inbox table is missing or does not match; create it \
             with create_inbox_schema (or run the inbox migrations); the delivery is tried again \
             meanwhile"
        }
        RepositoryError::Unavailable { .. } => {
            "inbox delivery cannot land: the database is unreachable; the runner keeps the \
             delivery and reads nothing until the database answers"
        }
        _ => {
            "inbox delivery cannot land: its transaction failed; check the error (the database \
             user's rights, the table); the delivery is tried again"
        }
    };
    tracing::warn!(
        by = %Recorder::Runner.as_str(),
        message_id = %event.message_id(),
        group = %group,
        source = %event.source(),
        partition_key = %event.partition_key().unwrap_or(""),
        error = %secrets(&error.to_string()),
        "{what}"
    );
}
