//! The inbox backend contract (contract sections 14, 20 to 22): [`InboxRepository`] for the
//! processor and the operator, [`InboxTransaction`] for the runner's T and the processor's
//! T_row, and [`InboxBackend`], which ties a backend to its transaction type (and so to the type
//! its handlers get, R181). The scenario IDs after each method name the conformance scenarios
//! that check it (`txoutbox_conformance::inbox`).
//!
//! Times are on the backend clock (R72, R105). The rules of a fetch are the outbox's (R149,
//! R150: [`crate::ordering`]) with the inbox key in place of (topic, partition_key).

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::error::{RepositoryError, ValidationError};
use crate::event::{Status, WorkerId};
use crate::inbox::model::{ConsumerGroup, InboxEvent, InboxKey, NewInboxEvent};
use crate::repository::{DEFAULT_LEASE_TTL, OnExhausted, ParkedTarget, Retry, args};

/// Default processor max_per_key (R151).
pub const DEFAULT_INBOX_MAX_PER_KEY: usize = 16;

/// What an inbox backend is and supports, as data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxCapabilities {
    /// A short name (`memory`, `postgres-sqlx`, …).
    pub name: &'static str,
    /// Whether "now" is the database's clock (R72).
    pub database_clock: bool,
    /// Whether the table can hold two rows of one dedup key (the partitioned table, R111,
    /// R164).
    pub siblings: bool,
    /// Whether stored rows can be undecodable (a table written by others, R106).
    pub undecodable_rows: bool,
}

/// One inbox fetch-and-lock (R148, R149): rows of one group, optionally of some sources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxFetchRequest {
    /// The worker taking the lease.
    pub worker: WorkerId,
    /// The group; no row of another group is ever fetched (R148).
    pub group: ConsumerGroup,
    /// Sources to fetch, or all of the group's.
    pub sources: Option<Vec<String>>,
    /// Batch size (≥ 1).
    pub limit: usize,
    /// The group's lease TTL (R116, R153).
    pub lease_ttl: Duration,
    /// Rows per key (≥ 1).
    pub max_per_key: usize,
    /// Whether rows of one inbox key hold each other (R147; false: every row is a key of its
    /// own).
    pub key_order: bool,
}

impl InboxFetchRequest {
    /// A request with the default lease (300 s), max_per_key 16 and key order on.
    pub fn new(worker: WorkerId, group: ConsumerGroup, limit: usize) -> Self {
        Self {
            worker,
            group,
            sources: None,
            limit,
            lease_ttl: DEFAULT_LEASE_TTL,
            max_per_key: DEFAULT_INBOX_MAX_PER_KEY,
            key_order: true,
        }
    }

    /// Checks the arguments as the outbox's fetch does (R19).
    pub fn validate(&self) -> Result<(), ValidationError> {
        crate::repository::FetchRequest {
            worker: self.worker.clone(),
            limit: self.limit,
            lease_ttl: self.lease_ttl,
            max_per_key: self.max_per_key,
            filter: Default::default(),
        }
        .validate()
    }

    /// Whether the row belongs to this request's group and sources.
    pub fn matches(&self, r: &InboxEvent) -> bool {
        r.consumer_group == self.group.as_str()
            && self.sources.as_ref().is_none_or(|s| s.contains(&r.source))
    }
}

/// A stored row a fetch handed out that cannot be decoded (R106): headers that are not a string
/// map, a column the driver cannot read (a timestamp beyond its time type, a number beyond
/// f64), …. The processor fails it as a counted failure without a handler run (Y-16).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UndecodableInboxRow {
    /// Row id.
    pub id: Uuid,
    /// Source, for its key.
    pub source: String,
    /// Partition key, for its key.
    pub partition_key: Option<String>,
    /// attempts_made before this failure.
    pub attempts_made: i32,
    /// What could not be decoded (the text after `undecodable row: `).
    pub reason: String,
}

/// A row handed out by an inbox fetch (the outbox's [`crate::repository::Fetched`] for the
/// inbox).
// Almost every fetched row decodes; boxing it would cost an allocation per row.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum InboxFetched {
    /// A decoded row, leased to the worker.
    Row(InboxEvent),
    /// A leased row that cannot be decoded (R106).
    Undecodable(UndecodableInboxRow),
}

impl InboxFetched {
    /// Row id.
    pub fn id(&self) -> Uuid {
        match self {
            InboxFetched::Row(r) => r.id,
            InboxFetched::Undecodable(u) => u.id,
        }
    }

    /// The decoded row, if it decodes.
    pub fn row(&self) -> Option<&InboxEvent> {
        match self {
            InboxFetched::Row(r) => Some(r),
            InboxFetched::Undecodable(_) => None,
        }
    }

    /// Source.
    pub fn source(&self) -> &str {
        match self {
            InboxFetched::Row(r) => &r.source,
            InboxFetched::Undecodable(u) => &u.source,
        }
    }

    /// The key the processor runs the row under: (source, the view's partition key of
    /// [`crate::inbox::ordering::view_key`]).
    pub fn run_key(&self, key_order: bool) -> (String, String) {
        let (id, pk) = match self {
            InboxFetched::Row(r) => (r.id, r.partition_key.as_deref()),
            InboxFetched::Undecodable(u) => (u.id, u.partition_key.as_deref()),
        };
        (
            self.source().to_owned(),
            crate::inbox::ordering::view_key(id, pk, key_order),
        )
    }
}

/// A row's state after [`InboxTransaction::fail_undecodable`] wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WrittenState {
    /// Status as written (`failed` when the attempts ran out).
    pub status: Status,
    /// attempts_made as written.
    pub attempts_made: i32,
    /// last_error as written (normalized, R9).
    pub last_error: Option<String>,
    /// The next try.
    pub scheduled_at: DateTime<Utc>,
}

impl From<&InboxEvent> for WrittenState {
    fn from(r: &InboxEvent) -> Self {
        Self {
            status: r.status,
            attempts_made: r.attempts_made,
            last_error: r.last_error.clone(),
            scheduled_at: r.scheduled_at,
        }
    }
}

/// The result of landing one event (R107).
#[derive(Debug, Clone, PartialEq)]
pub struct Landed {
    /// The stored row (the one already there for a duplicate, R109).
    pub row: InboxEvent,
    /// Whether this call inserted it.
    pub inserted: bool,
}

/// What taking a row's lock found (R116 step 3, R152).
// A locked row is the usual answer; boxing it would cost an allocation per run.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum RowLock {
    /// Locked by this transaction; the row as it stands.
    Locked(InboxEvent),
    /// Row-locked by another open transaction: not waited for (`SKIP LOCKED`).
    Busy,
    /// No such row.
    Missing,
}

/// One write to a row inside a transaction (R126, R128, R154, R56). Every write sets
/// updated_at = now and releases the lease; last_error is normalized (R9, U+0000 replaced).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowWrite {
    /// status completed, completed_at = now; attempts_made and last_error kept (R56, R155).
    Complete,
    /// attempts_made + 1, last_error, next try (R38); when it reaches max_attempts `failed`,
    /// or with [`OnExhausted::Park`] still `pending`: parked (R191).
    Counted {
        /// The failure text.
        error: String,
        /// The next try.
        retry: Retry,
        /// What spending the last attempt writes (R191).
        exhausted: OnExhausted,
    },
    /// No attempt spent; last_error, next try (R43, R44).
    NotCounted {
        /// The failure text.
        error: String,
        /// The next try.
        retry: Retry,
    },
    /// attempts_made = max_attempts, last_error set, `failed` (R128), or with
    /// [`OnExhausted::Park`] still `pending`: parked (R191).
    Terminal {
        /// The failure text.
        error: String,
        /// What spending the last attempt writes (R191).
        exhausted: OnExhausted,
    },
    /// Only the release of an expired lease (a runner's takeover, R116).
    ClearLease,
}

/// The guard of a fresh outcome transaction (R126, R152): the row must still be as the failed
/// transaction found it.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq)]
pub enum Guard {
    /// The failed transaction inserted the row: land it again and write only if this landing
    /// inserts it.
    Reland(NewInboxEvent),
    /// The row existed: write only while it is pending, not held under a live lease, with
    /// these attempts and schedule.
    Unchanged {
        /// Row id.
        id: Uuid,
        /// The row's created_at: with the id, the primary key of both Postgres layouts.
        created_at: DateTime<Utc>,
        /// attempts_made as found.
        attempts_made: i32,
        /// scheduled_at as found.
        scheduled_at: DateTime<Utc>,
        /// The group's lease TTL.
        lease_ttl: Duration,
    },
    /// The processor's guard: pending and held by this worker (R152).
    HeldBy {
        /// Row id.
        id: Uuid,
        /// The row's created_at: with the id, the primary key of both Postgres layouts.
        created_at: DateTime<Utc>,
        /// The worker.
        worker: WorkerId,
    },
}

/// A key whose head waits for a retry or is held under a live lease (R161).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct InboxBlockedKey {
    /// Source.
    pub source: String,
    /// Partition key.
    pub partition_key: String,
    /// The head's id.
    pub head_id: Uuid,
    /// The head's message_id.
    pub message_id: String,
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
    /// Whether the head is parked (R191, R193).
    pub parked: bool,
    /// When the head was parked (its updated_at), when parked.
    pub parked_at: Option<DateTime<Utc>>,
    /// Pending rows behind the head (capped as the outbox's, R85).
    pub waiting: i64,
}

/// Rows per (consumer_group, source, status) (R161).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
pub struct InboxStatusCount {
    /// Group.
    pub consumer_group: String,
    /// Source.
    pub source: String,
    /// Status.
    pub status: Status,
    /// Rows.
    pub count: i64,
}

/// The inbox operations outside a handler run.
#[async_trait]
pub trait InboxRepository: Send + Sync {
    /// What this backend is.
    fn capabilities(&self) -> InboxCapabilities;

    /// The backend clock's now (R72).
    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError>;

    /// One row by id.
    async fn get(&self, id: Uuid) -> Result<Option<InboxEvent>, RepositoryError>;

    /// The row R111 would return for the dedup key: the completed one if any, else the
    /// earliest by (created_at, id) (R112; E-10, D-05).
    async fn get_by_message_id(
        &self,
        message_id: &str,
        group: &ConsumerGroup,
    ) -> Result<Option<InboxEvent>, RepositoryError>;

    /// Fetch-and-lock for one group in its own committed transaction (R148 to R150): the
    /// outbox's rules of R19 to R29 and R74 with the inbox key; rows row-locked by an open
    /// transaction are skipped and hold their keys. Rows come grouped by key, keys in head
    /// order, each key in write order (Y-01, Y-04 to Y-09, G-07). A row that cannot be decoded
    /// is handed out in its place as [`InboxFetched::Undecodable`] and fails the fetch of no
    /// other row (R106; Y-16).
    async fn fetch_and_lock(
        &self,
        req: &InboxFetchRequest,
    ) -> Result<Vec<InboxFetched>, RepositoryError>;

    /// Releases these rows when `worker` holds them, untouched but for the lease (R77; Y-08,
    /// Y-13); returns how many it released.
    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError>;

    /// Moves a `failed` or parked row back to pending, attempts 0, last_error null,
    /// scheduled_at = now, released; false otherwise (R162, R64, R192; Y-14, Y-18).
    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError>;

    /// Redrives the parked rows of `group` that `target` selects (its topic is the source):
    /// R64 applied to each, so each is the head of its key again and runs before its
    /// successors (R192). Returns the ids, in write order. By id, a row that is not a parked row
    /// of the group is refused with [`RepositoryError::NotParked`] naming its state, and
    /// nothing changes. Checked by OP-06, OP-05.
    async fn redrive(
        &self,
        group: &ConsumerGroup,
        target: &ParkedTarget,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let _ = (group, target);
        Err(RepositoryError::Other(format!(
            "the {} inbox store does not support redrive (R192)",
            self.capabilities().name
        )))
    }

    /// Discards the parked rows of `group` that `target` selects (R192): each becomes
    /// `failed`, released, with last_error [`discard_text`](crate::repository::discard_text);
    /// its key resumes without it. Refusals as [`redrive`](Self::redrive). Checked by OP-05,
    /// OP-06.
    async fn discard(
        &self,
        group: &ConsumerGroup,
        target: &ParkedTarget,
        reason: &str,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let _ = (group, target, reason);
        Err(RepositoryError::Other(format!(
            "the {} inbox store does not support discard (R192)",
            self.capabilities().name
        )))
    }

    /// Releases pending rows whose lease is older than `timeout` (≥ 1 s) (R63).
    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError>;

    /// Releases a held row and sets last_error = `Force unlock: {reason}` (R66).
    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError>;

    /// Deletes up to `batch_size` completed rows of every group older than retention_days
    /// (R163; D-07, D-08).
    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError>;

    /// Repeats [`delete_old_completed`](Self::delete_old_completed) until a round deletes
    /// nothing or `max_iterations` rounds ran (R163, R65).
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
                break;
            }
        }
        Ok(total)
    }

    /// The group's parked keys and parked rows (R191, R193: `pending` with attempts_made >=
    /// max_attempts; a key counts when any of its rows is parked; keyless rows count as rows
    /// only), for the `inbox_parked_keys` and `inbox_parked_rows` gauges (OP-06).
    async fn parked_counts(&self, group: &ConsumerGroup) -> Result<(u64, u64), RepositoryError>;

    /// Keys of the group whose head waits for a retry or is held under a live lease, oldest
    /// head first, at most `limit`; rows without partition_key are not keys here (R161; A-01,
    /// Y-18).
    async fn blocked_keys(
        &self,
        group: &ConsumerGroup,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<InboxBlockedKey>, RepositoryError>;

    /// Row counts of the group per (source, status), sorted (R161; A-02).
    async fn counts(&self, group: &ConsumerGroup)
    -> Result<Vec<InboxStatusCount>, RepositoryError>;

    /// now − scheduled_at of the group's oldest due pending row, or none (R161; A-02).
    async fn oldest_due_age(
        &self,
        group: &ConsumerGroup,
    ) -> Result<Option<Duration>, RepositoryError>;
}

/// An open transaction of the inbox (the runner's T, the processor's T_row). Dropping it
/// without [`commit`](Self::commit) rolls it back.
#[async_trait]
pub trait InboxTransaction: Send + Sized {
    /// The type a handler gets (R181).
    type Handle: Send;

    /// The handler's view of this transaction.
    fn handle(&mut self) -> &mut Self::Handle;

    /// Tells the transaction the handler timeout of the run it may hold, before its first
    /// statement (R181, R165). A store may then set the statement timeout ahead, with a
    /// statement it sends anyway (a landing, a guard), instead of a round trip of its own after
    /// [`savepoint`](Self::savepoint); it must still bound every statement of the run by
    /// `timeout` and put the setting back before the commit (R181 step 4). The default does
    /// nothing: [`savepoint`](Self::savepoint) sets it.
    fn plan_handler_timeout(&mut self, timeout: Duration) {
        let _ = timeout;
    }

    /// Takes the key lock of R116 for the rest of the transaction, waiting for a transaction
    /// that holds it (G-09, F-22).
    async fn lock_key(&mut self, key: &InboxKey) -> Result<(), RepositoryError>;

    /// Takes the key locks of a batch (R185 step 1): every key once, in ascending order of the
    /// 64-bit hash that names its lock, so that two batches sharing keys wait in one order
    /// (BT-07). The default sorts by [`crate::inbox::ordering::key_lock_hash`] and takes each
    /// with [`lock_key`](Self::lock_key); a store whose locks are named by another hash (the
    /// PostgreSQL stores: `hashtextextended`) orders by that one.
    async fn lock_keys(&mut self, keys: &[InboxKey]) -> Result<(), RepositoryError> {
        let mut sorted: Vec<(u64, &InboxKey)> = keys
            .iter()
            .map(|k| (crate::inbox::ordering::key_lock_hash(k), k))
            .collect();
        sorted.sort_by_key(|(h, _)| *h);
        sorted.dedup_by(|a, b| a.1 == b.1);
        for (_, k) in sorted {
            self.lock_key(k).await?;
            // Lets a batch that takes its locks at the same moment interleave, as round trips
            // to a database would (BT-07 shows the order matters).
            tokio::task::yield_now().await;
        }
        Ok(())
    }

    /// Deletes a row this transaction inserted (R185: the row of a run that R127 rewinds in a
    /// batch, whose delivery goes back to the broker). The default refuses, and the batch then
    /// falls back to one message per transaction, where a rewound run's transaction simply
    /// rolls back (BT-02 with on_failure rewind).
    async fn forget_landed(&mut self, id: Uuid) -> Result<(), RepositoryError> {
        Err(RepositoryError::Other(format!(
            "this store cannot delete the row {id} it landed in the transaction"
        )))
    }

    /// Lands events (R107 to R111): for each, the stored row and whether this call inserted
    /// it; a dedup key landed by another open transaction waits for it; a repeat within the
    /// call collapses to its first occurrence (I-06, D-01, D-02, E-10).
    async fn land(&mut self, events: Vec<NewInboxEvent>) -> Result<Vec<Landed>, RepositoryError>;

    /// Takes the row's lock without waiting (`FOR UPDATE SKIP LOCKED`, R116; F-11).
    async fn lock_row(&mut self, id: Uuid) -> Result<RowLock, RepositoryError>;

    /// Whether an earlier row of the row's inbox key is in line (R145, R27), as this
    /// transaction sees the table (F-15, G-09).
    async fn earlier_in_line(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError>;

    /// Whether another row of the row's dedup key is completed (R164); false on a table that
    /// cannot hold siblings.
    async fn completed_sibling(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError>;

    /// Sets the savepoint of a handler run, bounding its statements by `timeout` (R181).
    async fn savepoint(&mut self, timeout: Duration) -> Result<(), RepositoryError>;

    /// Releases the savepoint after a success or a skip.
    async fn release_savepoint(&mut self) -> Result<(), RepositoryError>;

    /// Undoes the run's writes; an error means the transaction is unusable (R181; F-24).
    async fn rollback_to_savepoint(&mut self) -> Result<(), RepositoryError>;

    /// Writes the row (R126, R128, R154) and returns it as written.
    async fn write(&mut self, id: Uuid, write: RowWrite) -> Result<InboxEvent, RepositoryError>;

    /// Checks `guard` (R126, R152) and, when it holds, locks the row and returns it; none when
    /// the row changed meanwhile.
    async fn guard(&mut self, guard: &Guard) -> Result<Option<InboxEvent>, RepositoryError>;

    /// R152's guard of several rows at once, for a processor transaction T_b (R189): each row
    /// `(id, created_at)` row-locked without waiting (`FOR UPDATE SKIP LOCKED`) and returned
    /// when it is pending and held by `worker`, else none for that row alone (one it cannot
    /// lock, one another worker holds, one no longer pending). The answer is in `rows`' order.
    /// The default runs [`guard`](Self::guard) with [`Guard::HeldBy`] for each row; a store may
    /// lock them in one statement (BT-11).
    async fn guard_held(
        &mut self,
        rows: &[(Uuid, DateTime<Utc>)],
        worker: &WorkerId,
    ) -> Result<Vec<Option<InboxEvent>>, RepositoryError> {
        let mut out = Vec::with_capacity(rows.len());
        for (id, created_at) in rows {
            let g = Guard::HeldBy {
                id: *id,
                created_at: *created_at,
                worker: worker.clone(),
            };
            out.push(self.guard(&g).await?);
        }
        Ok(out)
    }

    /// Writes [`RowWrite::Complete`] to these rows the transaction holds, in as few statements
    /// as the store can (R154; R189: a processor transaction completes its rows together
    /// before its commit); an error when a row is not found. The default writes each (BT-11).
    async fn complete_rows(&mut self, ids: &[Uuid]) -> Result<(), RepositoryError> {
        for id in ids {
            self.write(*id, RowWrite::Complete).await?;
        }
        Ok(())
    }

    /// Takes the dedup advisory locks of R111 of these dedup keys `(message_id,
    /// consumer_group)` for the rest of the transaction, in ascending order of
    /// (hashtext(message_id), hashtext(consumer_group)), so that two transactions sharing keys
    /// wait in one order (R189, R185 step 2; BT-11 on the partitioned table). The default does
    /// nothing: a table that cannot hold siblings serializes landings by its unique index.
    async fn lock_dedup_keys(&mut self, keys: &[(String, String)]) -> Result<(), RepositoryError> {
        let _ = keys;
        Ok(())
    }

    /// The processor's write of a row it holds that cannot be decoded (R106), without decoding
    /// it: when the row is still pending and held by `worker` (the guard of R152), the write of
    /// [`RowWrite::Counted`] with `error` and `retry`; returns the row's state as written, or
    /// none when the guard fails. A store whose rows always decode may run
    /// [`guard`](Self::guard) and [`write`](Self::write) (Y-16).
    async fn fail_undecodable(
        &mut self,
        id: Uuid,
        worker: &WorkerId,
        error: &str,
        retry: Retry,
        exhausted: OnExhausted,
    ) -> Result<Option<WrittenState>, RepositoryError>;

    /// Commits (F-14, Y-11 inject a failure here).
    async fn commit(self) -> Result<(), RepositoryError>;

    /// Rolls back.
    async fn rollback(self);
}

/// A backend: its operations and its transaction type.
#[async_trait]
pub trait InboxBackend: InboxRepository + Clone + 'static {
    /// The backend's transaction.
    type Tx: InboxTransaction + 'static;

    /// Begins a transaction; an error is a persistence error (R132).
    async fn begin(&self) -> Result<Self::Tx, RepositoryError>;
}

/// The handler transaction type of a backend.
pub type HandlerTx<B> = <<B as InboxBackend>::Tx as InboxTransaction>::Handle;
