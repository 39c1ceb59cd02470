//! The error vocabulary of `outbox-core`.
//!
//! * [`ValidationError`]: an event, a worker id or an argument broke a limit of the contract.
//!   Nothing was written.
//! * [`ConfigError`]: a relay, backoff, breaker or backend setting is out of range.
//! * [`RepositoryError`]: a backend operation failed; [`RepositoryError::is_transient`] says
//!   whether retrying later can help.
//! * [`BrokerError`]: a publish failed, either transiently (no attempt spent) or because the
//!   broker rejected the message (an attempt is spent).
//! * [`StepError`]: a pipeline step failed.
//! * [`RunError`]: a relay loop ([`crate::Relay::run`]) stopped on a failure that retrying
//!   cannot fix.

use thiserror::Error;

/// An input broke one of the contract's limits (R5 to R10, R19, R66). Nothing was written.
#[derive(Debug, Clone, PartialEq, Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// A required field was never given to the builder.
    #[error("{field} is required: set it on the event builder")]
    Missing {
        /// The field.
        field: &'static str,
    },
    /// A string that must not be empty is empty (after trimming).
    #[error("{field} must not be empty or blank")]
    Empty {
        /// The field.
        field: &'static str,
    },
    /// A string is longer than its limit (characters, after trimming; R7).
    #[error("{field} is {actual} characters long; the limit is {max}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// The limit in characters.
        max: usize,
        /// The length given.
        actual: usize,
    },
    /// The payload is not a JSON object (R5).
    #[error("payload must be a JSON object, got {kind}")]
    PayloadNotObject {
        /// What was given instead (`array`, `string`, …).
        kind: &'static str,
    },
    /// The payload is the empty object (R5).
    #[error("payload must be a non-empty JSON object")]
    PayloadEmpty,
    /// The payload holds NaN or an infinity (R5); it is never turned into null.
    #[error("payload holds a non-finite number ({value}); JSON cannot carry it")]
    PayloadNotFinite {
        /// The offending value as text.
        value: String,
    },
    /// The payload could not be serialized at all.
    #[error("payload could not be serialized to JSON: {0}")]
    PayloadSerialize(String),
    /// The payload's compact JSON is larger than 1,000,000 bytes (R5).
    #[error("payload is {bytes} bytes as compact JSON; the limit is {max} bytes")]
    PayloadTooLarge {
        /// The size given.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// More header entries than allowed (R6).
    #[error("headers have {count} entries; the limit is {max}")]
    TooManyHeaders {
        /// Entries given.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A header key or value breaks a rule of R6.
    #[error("header {key:?}: {problem}")]
    Header {
        /// The key (trimmed) the problem concerns.
        key: String,
        /// What is wrong with it.
        problem: String,
    },
    /// An absolute scheduled_at lies outside [t − skew, t + 365 days] (R8).
    #[error(
        "scheduled_at {at} is outside the allowed window [{earliest}, {latest}] (skew {skew_seconds} s back, 365 days ahead)"
    )]
    ScheduleOutOfWindow {
        /// The value given.
        at: chrono::DateTime<chrono::Utc>,
        /// The earliest allowed.
        earliest: chrono::DateTime<chrono::Utc>,
        /// The latest allowed.
        latest: chrono::DateTime<chrono::Utc>,
        /// The builder's skew setting.
        skew_seconds: u64,
    },
    /// An absolute scheduled_at lies outside [created_at − 60 s, created_at + 365 days], where
    /// created_at is the backend clock at insert (R8, D2). The ancestor refuses such a row when it
    /// loads it (with its default window), so the backend refuses the write instead (R78).
    #[error(
        "event {id}: scheduled_at {at} lies outside [created_at - 60 s, created_at + 365 days] for created_at {created_at}, the backend clock at insert (R8); the ancestor would refuse to load such a row, so nothing was written. Build the event again with a schedule nearer the backend's clock, or give a delay instead"
    )]
    ScheduleOutsideInsertWindow {
        /// The event.
        id: uuid::Uuid,
        /// Its scheduled_at.
        at: chrono::DateTime<chrono::Utc>,
        /// The backend clock at the insert.
        created_at: chrono::DateTime<chrono::Utc>,
    },
    /// A relative delay lies outside [0, 31,536,000 s] (R8).
    #[error("delay of {seconds} s is outside the allowed range 0 to 31536000 s")]
    DelayOutOfRange {
        /// The delay given, in seconds.
        seconds: f64,
    },
    /// max_attempts is negative (R4; 0 means the default 6).
    #[error("max_attempts must be >= 1 (0 means the default 6), got {0}")]
    MaxAttempts(i64),
    /// A worker id does not match `^[A-Za-z0-9.\-/:]+$` or is longer than 255 (R10).
    #[error("Invalid worker_id format: '{0}'")]
    WorkerId(String),
    /// A fetch batch size of 0 (R19).
    #[error("limit must be greater than 0")]
    Limit,
    /// A lease TTL of 0 (R19).
    #[error("lease_ttl must be positive")]
    LeaseTtl,
    /// max_per_key of 0 (R19, R74).
    #[error("max_per_key must be at least 1, got {0}")]
    MaxPerKey(usize),
    /// A maintenance argument out of range (R63, R65, R66).
    #[error("{0}")]
    Argument(String),
}

/// A setting out of its allowed range. The message names the setting and the range.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{0}")]
pub struct ConfigError(pub String);

impl ConfigError {
    pub(crate) fn new(msg: impl Into<String>) -> Self {
        Self(msg.into())
    }
}

/// A backend operation failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RepositoryError {
    /// The arguments were invalid; nothing changed.
    #[error(transparent)]
    Validation(#[from] ValidationError),
    /// The backend could not be reached, timed out, or its pool is exhausted. Retrying later can
    /// help; the relay treats it as transient and spends no attempt.
    #[error("backend unavailable: {message}")]
    Unavailable {
        /// What the driver said.
        message: String,
    },
    /// A write broke an integrity rule of the table; the message names the rule.
    #[error("constraint violated: {message}")]
    Constraint {
        /// Which rule, and what the driver said.
        message: String,
    },
    /// The bulk lock release changed another number of rows than it was given ids (R24).
    #[error(
        "release changed {changed} rows, expected {expected}: some rows were not held by this worker"
    )]
    ReleaseMismatch {
        /// Rows changed.
        changed: u64,
        /// Ids given.
        expected: u64,
    },
    /// force_unlock on a row that is not held, or not there (R66).
    #[error("event {0} is not locked: nothing to force-unlock")]
    NotLocked(uuid::Uuid),
    /// A redrive or discard of a row that is not parked (R192; OP-05): the message names the
    /// row's state. Nothing was changed.
    #[error("{message}")]
    NotParked {
        /// The row.
        id: uuid::Uuid,
        /// What was refused and the row's state.
        message: String,
    },
    /// The table or schema is missing or does not match; run the migrations.
    #[error("schema problem: {0}")]
    Schema(String),
    /// A stored row that cannot be decoded (R106): a row written by others whose headers are
    /// not a string map, whose status is not one of the three, or with a column the driver
    /// cannot read. Nothing was written. The inbox runner leaves such a row to the processor
    /// and commits the delivery (R130) instead of treating this as a persistence error.
    #[error("undecodable row: row {id}: {reason}")]
    Undecodable {
        /// The row's id.
        id: uuid::Uuid,
        /// Its status, when that column reads as one of the three.
        status: Option<crate::event::Status>,
        /// What could not be decoded.
        reason: String,
    },
    /// Any other backend failure.
    #[error("backend error: {0}")]
    Other(String),
}

impl RepositoryError {
    /// Whether retrying later can help (a connection, pool or timeout problem).
    pub fn is_transient(&self) -> bool {
        matches!(self, RepositoryError::Unavailable { .. })
    }
}

/// A publish failed (R36, R52). Its display is exactly the text given.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BrokerError {
    /// The broker could not be reached or did not answer in time: no attempt is spent, the row
    /// is retried after 1.0 s and the rest of the cycle is deferred (R43, R47).
    #[error("{0}")]
    Transient(String),
    /// The broker answered and refused this message: an attempt is spent (R38).
    #[error("{0}")]
    Rejected(String),
}

impl BrokerError {
    /// A transient failure with this text.
    pub fn transient(text: impl Into<String>) -> Self {
        Self::Transient(text.into())
    }

    /// A rejection with this text.
    pub fn rejected(text: impl Into<String>) -> Self {
        Self::Rejected(text.into())
    }

    /// Whether no attempt is spent.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Transient(_))
    }
}

/// A pipeline step failed (R37). Counted unless marked transient; the display becomes last_error.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{message}")]
pub struct StepError {
    /// The text stored as last_error.
    pub message: String,
    /// Whether the failure spends no attempt (retry after 1.0 s).
    pub transient: bool,
}

impl StepError {
    /// A counted step error.
    pub fn counted(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transient: false,
        }
    }

    /// A transient step error.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            transient: true,
        }
    }
}

/// Why a relay loop ([`crate::Relay::run`]) stopped. Failures that retrying can fix (the
/// database or the broker unreachable) never end the loop; it waits and retries with backoff.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RunError {
    /// The fetch failed in a way retrying cannot fix (missing table or column, missing
    /// permission, a constraint or another non-transient backend error), `tries` times in a
    /// row.
    #[error(
        "the relay stopped after {tries} failed fetches in a row: {source}; retrying cannot fix this: check that the outbox table exists (run the migrations) and that the database user may read and update it"
    )]
    Repository {
        /// Consecutive failed fetches.
        tries: u32,
        /// The last error.
        #[source]
        source: RepositoryError,
    },
}
