//! The repository trait: what every backend implements (contract sections 3, 7, 9, D8).
//!
//! Writing events is not part of this trait, because it takes the caller's own transaction,
//! whose type belongs to the backend (R12): each backend offers a `write` in its own style
//! (a sqlx transaction, a diesel-async connection, an in-memory unit of work) with the same
//! contract:
//!
//! * the events become visible to relays when, and only if, the caller commits (W-01);
//! * the result lists, per event, the stored row and whether this call inserted it (R13);
//! * created_at comes from the backend clock at insert, shared by one write call, later calls
//!   later (R14, R73; W-04, O-14);
//! * an absolute scheduled_at outside [created_at − 60 s, created_at + 365 days] refuses the
//!   call with [`ValidationError::ScheduleOutsideInsertWindow`] and writes nothing, since the
//!   ancestor could not load the row (R8, D2; W-06; see
//!   [`check_insert_window`](crate::event::check_insert_window));
//! * a repeated idempotency key returns the row already there, in any status, and inserts nothing;
//!   a key repeated in one call collapses to its first occurrence; a writer of a key another open
//!   transaction wrote waits for it (R16, R17; I-01 to I-04).
//!
//! Everything the relay and the operator need is in [`OutboxRepository`]; the scenario IDs
//! after each method name the conformance scenarios that check it.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::{RepositoryError, ValidationError};
use crate::event::{OutboxEvent, Status, WorkerId};

/// Default lease TTL (R19).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(300);
/// Default max_per_key (R74).
pub const DEFAULT_MAX_PER_KEY: usize = 16;
/// Default backend batch size for maintenance (R63).
pub const DEFAULT_BACKEND_BATCH_SIZE: usize = 1000;
/// Largest backend batch size (R63).
pub const MAX_BACKEND_BATCH_SIZE: usize = 10_000;
/// At most this many batches per release_stale_locks call (R63).
pub const STALE_LOCK_MAX_BATCHES: usize = 1000;
/// Default cleanup batch (R65).
pub const DEFAULT_CLEANUP_BATCH: usize = 1000;
/// Default cleanup iterations (R65).
pub const DEFAULT_CLEANUP_MAX_ITERATIONS: usize = 10_000;

/// Filters of a fetch (R19): each one value or a set; `None` means any.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FetchFilter {
    /// Topics to fetch.
    pub topics: Option<Vec<String>>,
    /// Aggregate types to fetch.
    pub aggregate_types: Option<Vec<String>>,
    /// Aggregate ids to fetch.
    pub aggregate_ids: Option<Vec<Uuid>>,
}

impl FetchFilter {
    /// No filter.
    pub fn none() -> Self {
        Self::default()
    }

    /// Only these aggregate types.
    pub fn aggregate_types<S: Into<String>>(types: impl IntoIterator<Item = S>) -> Self {
        Self {
            aggregate_types: Some(types.into_iter().map(Into::into).collect()),
            ..Self::default()
        }
    }

    /// Only these topics.
    pub fn topics<S: Into<String>>(topics: impl IntoIterator<Item = S>) -> Self {
        Self {
            topics: Some(topics.into_iter().map(Into::into).collect()),
            ..Self::default()
        }
    }

    /// Whether the row matches.
    pub fn matches(&self, e: &OutboxEvent) -> bool {
        self.topics.as_ref().is_none_or(|t| t.contains(&e.topic))
            && self
                .aggregate_types
                .as_ref()
                .is_none_or(|t| t.contains(&e.aggregate_type))
            && self
                .aggregate_ids
                .as_ref()
                .is_none_or(|t| t.contains(&e.aggregate_id))
    }
}

/// One fetch-and-lock call (R19).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchRequest {
    /// The worker taking the lease.
    pub worker: WorkerId,
    /// Batch size: at most this many rows (≥ 1).
    pub limit: usize,
    /// Lease TTL (> 0, at most 365 days, default 300 s).
    pub lease_ttl: Duration,
    /// Rows per key (≥ 1, default 16; 1 is the ancestor's head-only fetch).
    pub max_per_key: usize,
    /// Filters.
    pub filter: FetchFilter,
}

impl FetchRequest {
    /// A request with the default lease and max_per_key.
    pub fn new(worker: WorkerId, limit: usize) -> Self {
        Self {
            worker,
            limit,
            lease_ttl: DEFAULT_LEASE_TTL,
            max_per_key: DEFAULT_MAX_PER_KEY,
            filter: FetchFilter::default(),
        }
    }

    /// Sets max_per_key.
    pub fn max_per_key(mut self, n: usize) -> Self {
        self.max_per_key = n;
        self
    }

    /// Sets the lease TTL.
    pub fn lease_ttl(mut self, d: Duration) -> Self {
        self.lease_ttl = d;
        self
    }

    /// Sets the filter.
    pub fn filter(mut self, f: FetchFilter) -> Self {
        self.filter = f;
        self
    }

    /// Checks the arguments (R19; V-16). Backends call this before touching anything.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.limit == 0 {
            return Err(ValidationError::Limit);
        }
        if self.lease_ttl.is_zero() {
            return Err(ValidationError::LeaseTtl);
        }
        if self.lease_ttl > Duration::from_secs(crate::event::limits::SETTING_MAX_SECS) {
            return Err(ValidationError::Argument(format!(
                "lease_ttl must be at most {} s (365 days), got {:?}",
                crate::event::limits::SETTING_MAX_SECS,
                self.lease_ttl
            )));
        }
        if self.max_per_key == 0 {
            return Err(ValidationError::MaxPerKey(0));
        }
        Ok(())
    }
}

/// A fetched row that could not be decoded (R82): it is failed, counted, without a publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UndecodableRow {
    /// Row id.
    pub id: Uuid,
    /// Topic, for grouping.
    pub topic: String,
    /// Partition key, for grouping.
    pub partition_key: String,
    /// attempts_made before this failure.
    pub attempts_made: i32,
    /// What could not be decoded.
    pub reason: String,
}

/// A row handed out by a fetch.
// Almost every fetched row decodes; boxing it would cost an allocation per row.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Fetched {
    /// A decoded row, locked for the worker.
    Row(OutboxEvent),
    /// A locked row that cannot be decoded (R82).
    Undecodable(UndecodableRow),
}

impl Fetched {
    /// Row id.
    pub fn id(&self) -> Uuid {
        match self {
            Fetched::Row(e) => e.id,
            Fetched::Undecodable(u) => u.id,
        }
    }

    /// The ordering key.
    pub fn key(&self) -> crate::ordering::Key {
        match self {
            Fetched::Row(e) => e.key(),
            Fetched::Undecodable(u) => crate::ordering::Key::new(&u.topic, &u.partition_key),
        }
    }

    /// The decoded row, if any.
    pub fn row(&self) -> Option<&OutboxEvent> {
        match self {
            Fetched::Row(e) => Some(e),
            Fetched::Undecodable(_) => None,
        }
    }
}

/// The next try of a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Keep scheduled_at (base 0, or a non-counted failure without a time; R38, R44).
    Keep,
    /// now + this, on the backend clock (R72).
    After(Duration),
    /// This instant (an explicit retry time, R44).
    At(DateTime<Utc>),
}

/// What the relay decided for one row (R35).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutcomeKind {
    /// Acknowledged: completed (R56).
    Completed,
    /// Counted failure: attempts_made + 1; at max_attempts `failed` (R38) or, with
    /// [`OnExhausted::Park`], parked: still `pending` (R191).
    Counted {
        /// The failure text (normalized by the backend, R9).
        error: String,
        /// Next try.
        retry: Retry,
        /// What the failure that spends the last attempt writes (R191).
        exhausted: OnExhausted,
    },
    /// Failure without an attempt (R43, R44).
    Transient {
        /// The failure text.
        error: String,
        /// Next try.
        retry: Retry,
    },
    /// Deferred after the broker was found unreachable: no attempt, schedule kept (R47).
    Deferred {
        /// The failure text.
        error: String,
    },
    /// Released untouched (R77).
    Released,
}

/// What the failure that spends a row's last attempt writes (R191, D41; the relay's, the inbox
/// processor's and the runner's setting `on_exhausted`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnExhausted {
    /// R38: the row becomes `failed` and no longer holds its key (R31). The default.
    #[default]
    Release,
    /// The row stays `pending` with attempts_made = max_attempts: it is *parked* (never
    /// fetchable, in line, so it holds its key until an operator redrives or discards it,
    /// R192). Checked by OP-01, OP-06, OP-07.
    Park,
}

impl OnExhausted {
    /// The setting as written in configuration: `release` or `park`.
    pub fn as_str(self) -> &'static str {
        match self {
            OnExhausted::Release => "release",
            OnExhausted::Park => "park",
        }
    }
}

impl std::fmt::Display for OnExhausted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for OnExhausted {
    type Err = crate::error::ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "release" => Ok(OnExhausted::Release),
            "park" => Ok(OnExhausted::Park),
            other => Err(crate::error::ConfigError(format!(
                "unknown on_exhausted {other:?}: use release or park"
            ))),
        }
    }
}

/// Whether a row is parked (R191): `pending` with attempts_made ≥ max_attempts.
pub fn is_parked(status: Status, attempts_made: i32, max_attempts: i32) -> bool {
    status == Status::Pending && attempts_made >= max_attempts
}

/// Which parked rows an operator's redrive or discard acts on (R192). For an inbox table the
/// topic is the message's source, and the operation is of one consumer group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParkedTarget {
    /// One row; refused, naming its state, when it is not parked.
    Id(Uuid),
    /// Every parked row of a key.
    Key {
        /// Topic (the inbox: source).
        topic: String,
        /// Partition key.
        partition_key: String,
    },
    /// Every parked row of a topic (the inbox: source).
    Topic(String),
}

impl ParkedTarget {
    /// The selection as the three optional filters the backends bind: ids, topics, keys.
    #[allow(clippy::type_complexity)]
    pub fn filters(&self) -> (Option<Vec<Uuid>>, Option<Vec<String>>, Option<Vec<String>>) {
        match self {
            ParkedTarget::Id(id) => (Some(vec![*id]), None, None),
            ParkedTarget::Key {
                topic,
                partition_key,
            } => (
                None,
                Some(vec![topic.clone()]),
                Some(vec![partition_key.clone()]),
            ),
            ParkedTarget::Topic(t) => (None, Some(vec![t.clone()]), None),
        }
    }

    /// Whether a row of this topic (source), key and id is selected.
    pub fn matches(&self, id: Uuid, topic: &str, partition_key: &str) -> bool {
        match self {
            ParkedTarget::Id(i) => *i == id,
            ParkedTarget::Key {
                topic: t,
                partition_key: k,
            } => t == topic && k == partition_key,
            ParkedTarget::Topic(t) => t == topic,
        }
    }
}

/// The last_error of a discarded row (R192): `discarded: {reason}; ` followed by its
/// last_error, cut to `max_bytes` as R9 cuts. The reason is trimmed and must be 1 to 255
/// characters (R66's rules); nothing changes otherwise (OP-05).
pub fn discard_text(
    reason: &str,
    last_error: Option<&str>,
    max_bytes: usize,
) -> Result<String, ValidationError> {
    let r = crate::event::trim_ancestor(reason);
    let n = r.chars().count();
    if n == 0 || n > crate::event::limits::FORCE_UNLOCK_REASON_MAX {
        return Err(ValidationError::Argument(format!(
            "a discard needs a reason of 1 to {} characters, got {n}; nothing was changed",
            crate::event::limits::FORCE_UNLOCK_REASON_MAX
        )));
    }
    let text = format!("discarded: {r}; {}", last_error.unwrap_or(""));
    Ok(crate::event::normalize_error(&text, max_bytes))
}

/// Checks a discard reason before anything is read (OP-05).
pub fn check_discard_reason(reason: &str) -> Result<(), ValidationError> {
    discard_text(reason, None, crate::event::limits::ERROR_MAX_LENGTH_MAX).map(|_| ())
}

/// The refusal of a redrive or discard by id of a row that is not parked (R192, OP-05):
/// names the row's state; nothing was changed.
pub fn not_parked(id: Uuid, op: &str, state: Option<(Status, i32, i32)>) -> RepositoryError {
    let state = match state {
        None => "not in the table".to_owned(),
        Some((status, a, m)) => format!("{status} with {a} of {m} attempts spent"),
    };
    RepositoryError::NotParked {
        id,
        message: format!(
            "{op} refused: row {id} is {state}, not parked (pending with every attempt spent); nothing was changed"
        ),
    }
}

/// One outcome to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Row id.
    pub id: Uuid,
    /// What happened.
    pub kind: OutcomeKind,
}

/// What the outcome write did to one row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutcomeResult {
    /// Written. The row's state after the write.
    Applied {
        /// Status after the write.
        status: Status,
        /// attempts_made after the write.
        attempts_made: i32,
        /// scheduled_at after the write (the next try).
        scheduled_at: DateTime<Utc>,
    },
    /// The guard failed: the row is no longer pending and held by this worker (R55).
    LeaseLost,
}

/// The per-row result of [`OutboxRepository::write_outcomes`], in input order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenOutcome {
    /// Row id.
    pub id: Uuid,
    /// What happened.
    pub result: OutcomeResult,
}

/// The result of writing one event (R13).
#[derive(Debug, Clone, PartialEq)]
pub struct WriteResult {
    /// The stored row (the existing one for a duplicate idempotency key).
    pub event: OutboxEvent,
    /// Whether this call inserted it.
    pub inserted: bool,
}

/// A key whose first in-line row waits for a retry or is held under a live lease (R80).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct BlockedKey {
    /// Topic.
    pub topic: String,
    /// Partition key.
    pub partition_key: String,
    /// The head's id.
    pub head_id: Uuid,
    /// The head's attempts.
    pub attempts_made: i32,
    /// The head's budget.
    pub max_attempts: i32,
    /// The head's last error.
    pub last_error: Option<String>,
    /// The head's scheduled_at.
    pub next_try: DateTime<Utc>,
    /// The holder, when held.
    pub locked_by: Option<String>,
    /// The lock time, when held.
    pub locked_at: Option<DateTime<Utc>>,
    /// Whether the head is parked (R191, R193): it waits for an operator, not for a retry.
    pub parked: bool,
    /// When the head was parked (its updated_at), when parked.
    pub parked_at: Option<DateTime<Utc>>,
    /// Pending rows behind the head, counted up to [`BLOCKED_WAITING_CAP`] (a value equal to
    /// the cap means at least that many), so listing keys costs what it returns (R85).
    pub waiting: i64,
}

/// Where [`BlockedKey::waiting`] stops counting: listing a blocked key reads at most this many
/// rows behind its head, whatever the backlog (R85).
pub const BLOCKED_WAITING_CAP: i64 = 10_000;

/// Rows per topic and status (R80).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct StatusCount {
    /// Topic.
    pub topic: String,
    /// Status.
    pub status: Status,
    /// Rows.
    pub count: i64,
}

/// What a backend is and supports, as data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// A short name, e.g. `memory`, `postgres-sqlx`.
    pub name: &'static str,
    /// Whether "now" is the database's clock (true) or an injected clock (false), R72.
    pub database_clock: bool,
    /// Whether rows can be undecodable (a store written by others, R82).
    pub undecodable_rows: bool,
    /// Whether [`OutboxRepository::begin_delivery`] is implemented (delivery in one
    /// transaction, R84).
    pub transaction_delivery: bool,
}

/// How a relay hands rows out and writes their outcomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeliveryMode {
    /// The lease mode (R76): the fetch stamps a lease and commits at once; publishing holds no
    /// transaction; outcomes are written in a second short transaction. A crashed relay's rows
    /// wait out their lease.
    #[default]
    Lease,
    /// Delivery in one transaction (R84): the fetch row-locks its rows without writing them,
    /// the transaction stays open while the cycle publishes (bounded, see
    /// [`DeliveryBound`]), and the outcomes are written in it before it commits. Each row is
    /// written once; a crash or a lost connection frees the rows at once; a transient failure
    /// writes nothing.
    Transaction,
}

impl std::fmt::Display for DeliveryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            DeliveryMode::Lease => "lease",
            DeliveryMode::Transaction => "transaction",
        })
    }
}

impl std::str::FromStr for DeliveryMode {
    type Err = crate::error::ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "lease" => Ok(DeliveryMode::Lease),
            "transaction" => Ok(DeliveryMode::Transaction),
            other => Err(crate::error::ConfigError(format!(
                "unknown delivery mode {other:?}: use lease or transaction"
            ))),
        }
    }
}

/// The bound of an open delivery transaction (R84): the backend makes the server end the
/// transaction when the relay stays silent for `server_timeout` (PostgreSQL: a per-transaction
/// `idle_in_transaction_session_timeout`), so a relay that hangs never pins its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeliveryBound {
    /// How long the transaction may stay idle before the server ends it.
    pub server_timeout: Duration,
}

/// An open delivery transaction (R84), from [`OutboxRepository::begin_delivery`]. Its rows are
/// row-locked (skipped by every other fetch, and holding their keys) until it ends. Dropping
/// it without [`Delivery::commit`] rolls it back: the rows are free at once, untouched.
#[async_trait]
pub trait Delivery: Send {
    /// Writes `outcomes` in the transaction and commits it (R84). Completed and counted
    /// outcomes are written as in [`OutboxRepository::write_outcomes`]; transient, deferred and
    /// released rows are not written at all (the row lock ends with the transaction). Returns
    /// one result per outcome, in input order (rows not written report their state as
    /// fetched). An error means the transaction rolled back: nothing was written and every row
    /// is free (TX-02). Checked by TX-01, TX-02, TX-04, TX-05.
    async fn commit(
        self: Box<Self>,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError>;

    /// Rolls back: nothing written, every row free at once.
    async fn rollback(self: Box<Self>);
}

/// The delivery of a fetch that found nothing: its transaction already ended, so it holds no
/// connection; any outcome given to it is reported as lost.
#[derive(Debug, Clone, Copy, Default)]
pub struct EmptyDelivery;

#[async_trait]
impl Delivery for EmptyDelivery {
    async fn commit(
        self: Box<Self>,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        Ok(outcomes
            .iter()
            .map(|o| WrittenOutcome {
                id: o.id,
                result: OutcomeResult::LeaseLost,
            })
            .collect())
    }

    async fn rollback(self: Box<Self>) {}
}

/// Validates a backend batch size (R63; V-17): 1 to 10,000.
pub fn check_backend_batch_size(n: usize) -> Result<usize, crate::error::ConfigError> {
    if !(1..=MAX_BACKEND_BATCH_SIZE).contains(&n) {
        return Err(crate::error::ConfigError(format!(
            "batch_size must be between 1 and {MAX_BACKEND_BATCH_SIZE}, got {n}"
        )));
    }
    Ok(n)
}

/// Validates maintenance arguments shared by every backend.
pub mod args {
    use super::*;

    /// release_stale_locks: timeout ≥ 1 s (R63; L-02).
    pub fn stale_timeout(timeout: Duration) -> Result<(), ValidationError> {
        if timeout < Duration::from_secs(1) {
            return Err(ValidationError::Argument(format!(
                "release_stale_locks timeout must be at least 1 s, got {:?}",
                timeout
            )));
        }
        Ok(())
    }

    /// Cleanup: retention_days ≥ 1 and batch_size ≥ 1 (R65; C-02).
    pub fn cleanup(retention_days: u32, batch_size: usize) -> Result<(), ValidationError> {
        if retention_days < 1 {
            return Err(ValidationError::Argument(format!(
                "retention_days must be at least 1, got {retention_days}"
            )));
        }
        if batch_size < 1 {
            return Err(ValidationError::Argument(
                "cleanup batch_size must be at least 1".into(),
            ));
        }
        Ok(())
    }
}

/// The backend contract for relays and operators.
///
/// Times are on the backend clock (R72): the database clock for Postgres, the injected clock
/// for the in-memory backend. Every method that takes a worker id gets a validated
/// [`WorkerId`] (R10).
#[async_trait]
pub trait OutboxRepository: Send + Sync {
    /// What this backend is (capabilities as data).
    fn capabilities(&self) -> Capabilities;

    /// The backend clock's now (R72).
    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError>;

    /// Delivery in one transaction (R84): opens a transaction bounded by `bound`, selects and
    /// row-locks rows exactly as [`OutboxRepository::fetch_and_lock`] does but writes nothing
    /// (no lease stamp), and returns them with the open transaction. Rows under a live lease
    /// and rows row-locked by another delivery are skipped and hold their keys. Backends that
    /// do not support it say so in [`Capabilities::transaction_delivery`] and return an error
    /// here. Checked by TX-01 to TX-05 and the whole suite in transaction mode.
    async fn begin_delivery(
        &self,
        req: &FetchRequest,
        bound: DeliveryBound,
    ) -> Result<(Vec<Fetched>, Box<dyn Delivery>), RepositoryError> {
        let _ = (req, bound);
        Err(RepositoryError::Other(format!(
            "the {} backend does not support delivery in one transaction (R84); use DeliveryMode::Lease",
            self.capabilities().name
        )))
    }

    /// One row by id, or none.
    async fn get(&self, id: Uuid) -> Result<Option<OutboxEvent>, RepositoryError>;

    /// Fetch-and-lock in its own committed transaction (R19 to R23, R28, R29, R74, R76, R81).
    ///
    /// Validates the request first (V-16). Selects at most `limit` heads ordered by
    /// `(scheduled_at, created_at, id)`, extends them breadth-first into runs of at most
    /// `max_per_key` rows, locks every returned row (`locked_at = locked_by`-now,
    /// `updated_at = now`), skips rows row-locked elsewhere without waiting, and returns them
    /// grouped by key, keys in head order, rows in write order. The head rule ignores filters.
    /// A lease exactly `lease_ttl` old still holds; it has expired once it is older.
    /// Checked by O-01 to O-23, Q-01 to Q-11, L-07, L-10, S-01, S-02.
    async fn fetch_and_lock(&self, req: &FetchRequest) -> Result<Vec<Fetched>, RepositoryError>;

    /// Writes a cycle's outcomes in one transaction (R54 to R57).
    ///
    /// Each row is written only while it is pending and locked by `worker`; otherwise it is
    /// reported [`OutcomeResult::LeaseLost`] and left alone (L-03, O-08). Every write sets
    /// updated_at = now and releases the lock. last_error is normalized (R9). If the
    /// transaction fails nothing applies and an error returns (P-06). Checked by B-14, L-03.
    async fn write_outcomes(
        &self,
        worker: &WorkerId,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError>;

    /// Sets locked_at = now when `worker` holds the row, so its lease runs from now; false
    /// otherwise (R24; L-06, L-11).
    async fn refresh_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError>;

    /// Releases the row when `worker` holds it; false otherwise (R24; L-06).
    async fn release_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError>;

    /// Releases these rows held by `worker`; fails with
    /// [`RepositoryError::ReleaseMismatch`] (and changes nothing) when not every id was held
    /// (R24; L-12).
    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError>;

    /// Releases pending rows with locked_at < now − timeout (timeout ≥ 1 s), in batches of the
    /// backend batch size, at most 1000 batches; returns the count (R63; L-01, L-02).
    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError>;

    /// Moves a `failed` or parked row back to pending with attempts_made 0, last_error null and
    /// scheduled_at = now, released; false for any other row or an unknown id (R64, R192;
    /// O-10, OP-02).
    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError>;

    /// Deletes up to `batch_size` completed rows with completed_at < now − retention_days
    /// (R65; C-01).
    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError>;

    /// Repeats [`delete_old_completed`](Self::delete_old_completed) until a round deletes
    /// nothing or `max_iterations` rounds ran (then logs a warning); returns the total
    /// (R65; C-01, C-02). retention_days ≥ 1; pending and failed rows are never deleted, however
    /// old (C-03).
    async fn cleanup_old_events(
        &self,
        retention_days: u32,
        batch_size: usize,
        max_iterations: usize,
    ) -> Result<u64, RepositoryError> {
        args::cleanup(retention_days, batch_size)?;
        let mut total = 0;
        for _ in 0..max_iterations {
            let n = self
                .delete_old_completed(retention_days, batch_size)
                .await?;
            total += n;
            if n == 0 {
                return Ok(total);
            }
        }
        tracing::warn!(
            max_iterations,
            deleted = total,
            "cleanup_old_events stopped at its iteration cap; run it again to delete the rest"
        );
        Ok(total)
    }

    /// Releases a held row whoever holds it and sets last_error = `Force unlock: {reason}`
    /// (reason trimmed, 1 to 255 characters). A row that is not held is an error (R66; L-06,
    /// O-13).
    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError>;

    /// Redrives parked rows (R192): R64 applied to each (pending, attempts_made 0, last_error
    /// null, scheduled_at = now, released), so each is the head of its key again and goes out
    /// before its successors. Returns the ids redriven, in write order. By id, a row that is
    /// not parked is refused with [`RepositoryError::NotParked`] naming its state, and nothing
    /// changes; by key or topic only parked rows are touched. Checked by OP-02, OP-05, OP-07.
    async fn redrive(&self, target: &ParkedTarget) -> Result<Vec<Uuid>, RepositoryError> {
        let _ = target;
        Err(RepositoryError::Other(format!(
            "the {} backend does not support redrive (R192)",
            self.capabilities().name
        )))
    }

    /// Discards parked rows (R192): each becomes `failed`, released, with last_error
    /// [`discard_text`]; its key resumes without it. The reason is checked first (1 to 255
    /// characters). Returns the ids discarded, in write order; refusals as
    /// [`redrive`](Self::redrive). Checked by OP-03, OP-05.
    async fn discard(
        &self,
        target: &ParkedTarget,
        reason: &str,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let _ = (target, reason);
        Err(RepositoryError::Other(format!(
            "the {} backend does not support discard (R192)",
            self.capabilities().name
        )))
    }

    /// Keys whose first in-line row waits for a retry, is held under a live lease or is parked
    /// (marked [`BlockedKey::parked`]), oldest head first, at most `limit` (R80, R193; M-01,
    /// L-10, OP-01).
    async fn blocked_keys(
        &self,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<BlockedKey>, RepositoryError>;

    /// Row counts per topic and status, sorted (R80; M-02).
    async fn counts(&self) -> Result<Vec<StatusCount>, RepositoryError>;

    /// now − scheduled_at of the oldest due pending row, or none (R80; M-02).
    async fn oldest_due_age(&self) -> Result<Option<Duration>, RepositoryError>;

    /// The parked rows (R191, R193: `pending` with attempts_made >= max_attempts), keyless rows
    /// included, for the `outbox_parked_rows` gauge (OP-01).
    async fn parked_rows(&self) -> Result<u64, RepositoryError>;
}
