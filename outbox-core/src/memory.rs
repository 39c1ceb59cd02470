//! The in-memory reference backend: the contract's semantics with an injectable clock.
//!
//! [`InMemoryRepository`] implements [`OutboxRepository`] by running the rules of
//! [`crate::ordering`] over its rows under one lock, so every operation is atomic. Writes go
//! through a unit of work, [`MemTransaction`]: its events become visible at
//! [`commit`](MemTransaction::commit) and vanish at rollback or drop (R12). It is the backend of
//! the quick start and the first one the conformance suite checks.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use tokio::sync::Notify;
use uuid::Uuid;

use crate::clock::{Clock, SystemClock};
use crate::error::{ConfigError, RepositoryError};
use crate::event::{NewEvent, OutboxEvent, Status, WorkerId, force_unlock_text, normalize_error};
use crate::ordering;
use crate::repository::{
    BLOCKED_WAITING_CAP, BlockedKey, Capabilities, DEFAULT_BACKEND_BATCH_SIZE, Delivery,
    DeliveryBound, FetchRequest, Fetched, OnExhausted, OutboxRepository, Outcome, OutcomeKind,
    OutcomeResult, ParkedTarget, Retry, STALE_LOCK_MAX_BATCHES, StatusCount, WriteResult,
    WrittenOutcome, args, check_backend_batch_size, check_discard_reason, discard_text, not_parked,
};

#[derive(Debug, Default)]
struct State {
    rows: BTreeMap<Uuid, OutboxEvent>,
    /// Committed idempotency keys.
    idem: HashMap<String, Uuid>,
    /// Idempotency keys written by open transactions, with the transaction's number.
    claims: HashMap<String, u64>,
    last_created: Option<DateTime<Utc>>,
    /// Rows row-locked by open deliveries (R84), with the delivery's number: skipped by every
    /// fetch and holding their keys, as PostgreSQL's row locks are.
    row_locks: HashMap<Uuid, u64>,
}

impl State {
    /// The ids `select` picks, with row-locked rows seen as held under a live lease (in line,
    /// not fetchable), as a fetch with `SKIP LOCKED` sees them.
    fn select_ids(&self, req: &FetchRequest, now: DateTime<Utc>) -> Vec<Uuid> {
        let locked: Vec<OutboxEvent> = self
            .row_locks
            .keys()
            .filter_map(|id| self.rows.get(id))
            .map(|r| {
                let mut r = r.clone();
                r.locked_at = Some(now);
                r.locked_by = Some("(row-locked)".into());
                r
            })
            .collect();
        let view = self
            .rows
            .values()
            .filter(|r| !self.row_locks.contains_key(&r.id))
            .chain(locked.iter());
        ordering::select(
            view,
            now,
            req.limit,
            req.lease_ttl,
            req.max_per_key,
            &req.filter,
        )
        .into_iter()
        .map(|e| e.id)
        .collect()
    }
}

#[derive(Debug)]
struct Inner {
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    released: Notify,
    next_tx: AtomicU64,
    fail_next_commit: AtomicBool,
    batch_size: usize,
    error_max_length: usize,
}

/// The in-memory repository. Cloning shares the same store.
#[derive(Debug, Clone)]
pub struct InMemoryRepository {
    inner: Arc<Inner>,
}

impl Default for InMemoryRepository {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

/// Settings of the in-memory repository.
#[derive(Debug, Clone)]
pub struct MemoryConfig {
    batch_size: usize,
    error_max_length: usize,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        Self {
            batch_size: DEFAULT_BACKEND_BATCH_SIZE,
            error_max_length: crate::event::limits::DEFAULT_ERROR_MAX_LENGTH,
        }
    }
}

impl MemoryConfig {
    /// Maintenance batch size (1 to 10,000; R63).
    pub fn batch_size(mut self, n: usize) -> Result<Self, ConfigError> {
        self.batch_size = check_backend_batch_size(n)?;
        Ok(self)
    }
    /// `error_max_length` in bytes (16 to 2,000, the size of the backends' `last_error` column; R9).
    pub fn error_max_length(mut self, n: usize) -> Result<Self, ConfigError> {
        self.error_max_length = crate::event::check_error_max_length(n)?;
        Ok(self)
    }
}

impl InMemoryRepository {
    /// A repository on this clock with default settings.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self::with_config(clock, MemoryConfig::default())
    }

    /// A repository on this clock with these settings.
    pub fn with_config(clock: Arc<dyn Clock>, config: MemoryConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                clock,
                released: Notify::new(),
                next_tx: AtomicU64::new(1),
                fail_next_commit: AtomicBool::new(false),
                batch_size: config.batch_size,
                error_max_length: config.error_max_length,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().expect("memory store poisoned")
    }

    /// The backend clock: the injected clock, but never earlier than the last write's
    /// created_at (which is raised 1 µs per write call when the clock stands still).
    fn now_sync(&self) -> DateTime<Utc> {
        let now = self.inner.clock.now();
        match self.lock().last_created {
            Some(last) if last > now => last,
            _ => now,
        }
    }

    /// Begins a unit of work (the in-memory "transaction", R12).
    pub fn begin(&self) -> MemTransaction {
        MemTransaction {
            repo: self.clone(),
            id: self.inner.next_tx.fetch_add(1, Ordering::Relaxed),
            rows: Vec::new(),
            claims: HashSet::new(),
            started_at: None,
            done: false,
        }
    }

    /// Writes events in a unit of work of their own and commits it.
    pub async fn write_committed(
        &self,
        events: Vec<NewEvent>,
    ) -> Result<Vec<WriteResult>, RepositoryError> {
        let mut tx = self.begin();
        let r = tx.write(events).await?;
        tx.commit();
        Ok(r)
    }

    /// Test fixture (cargo feature `testing`): changes a stored row directly (the suite's
    /// `set`).
    #[cfg(any(test, feature = "testing"))]
    pub fn set(&self, id: Uuid, f: impl FnOnce(&mut OutboxEvent)) -> bool {
        let mut st = self.lock();
        match st.rows.get_mut(&id) {
            Some(r) => {
                f(r);
                true
            }
            None => false,
        }
    }

    /// Test hook (cargo feature `testing`): makes the next outcome write fail as a failed commit
    /// would (R57).
    #[cfg(any(test, feature = "testing"))]
    pub fn fail_next_outcome_commit(&self) {
        self.inner.fail_next_commit.store(true, Ordering::SeqCst);
    }

    /// Every stored row, in write order.
    pub fn rows(&self) -> Vec<OutboxEvent> {
        let mut v: Vec<_> = self.lock().rows.values().cloned().collect();
        v.sort_by_key(ordering::write_order);
        v
    }

    /// R64 on one row: pending, no attempts, no error, due now, released.
    fn requeue(r: &mut OutboxEvent, now: DateTime<Utc>) {
        r.status = Status::Pending;
        r.attempts_made = 0;
        r.last_error = None;
        r.scheduled_at = now;
        r.completed_at = None;
        Self::release(r, now);
    }

    /// The parked rows `target` selects, in write order; by id, a row that is not parked is
    /// refused (R192, OP-05).
    fn parked_ids(
        st: &State,
        target: &ParkedTarget,
        op: &str,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        if let ParkedTarget::Id(id) = target {
            return match st.rows.get(id) {
                Some(r) if ordering::is_parked(r) => Ok(vec![*id]),
                r => Err(not_parked(
                    *id,
                    op,
                    r.map(|r| (r.status, r.attempts_made, r.max_attempts)),
                )),
            };
        }
        let mut rows: Vec<&OutboxEvent> = st
            .rows
            .values()
            .filter(|r| ordering::is_parked(r) && target.matches(r.id, &r.topic, &r.partition_key))
            .collect();
        rows.sort_by_key(|r| ordering::write_order(r));
        Ok(rows.into_iter().map(|r| r.id).collect())
    }

    fn release(row: &mut OutboxEvent, now: DateTime<Utc>) {
        row.locked_at = None;
        row.locked_by = None;
        row.updated_at = Some(now);
    }

    /// Applies one outcome's fields (not the release of the lock).
    fn apply(row: &mut OutboxEvent, kind: &OutcomeKind, now: DateTime<Utc>, max: usize) {
        let apply_retry = |row: &mut OutboxEvent, retry: Retry| {
            row.scheduled_at = match retry {
                Retry::Keep => row.scheduled_at,
                Retry::After(d) => plus(now, d),
                Retry::At(t) => t,
            };
        };
        match kind {
            OutcomeKind::Completed => {
                row.status = Status::Completed;
                row.completed_at = Some(now);
            }
            OutcomeKind::Counted {
                error,
                retry,
                exhausted,
            } => {
                row.attempts_made += 1;
                if row.attempts_made >= row.max_attempts && *exhausted == OnExhausted::Release {
                    row.status = Status::Failed;
                }
                row.last_error = Some(normalize_error(error, max));
                apply_retry(row, *retry);
            }
            OutcomeKind::Transient { error, retry } => {
                row.last_error = Some(normalize_error(error, max));
                apply_retry(row, *retry);
            }
            OutcomeKind::Deferred { error } => {
                row.last_error = Some(normalize_error(error, max));
            }
            OutcomeKind::Released => {}
        }
    }

    fn held_by(row: &OutboxEvent, worker: &WorkerId) -> bool {
        row.status == Status::Pending && row.locked_by.as_deref() == Some(worker.as_str())
    }
}

/// An open delivery on the in-memory repository (R84): its rows are row-locked until it
/// commits or is dropped (rolled back).
#[derive(Debug)]
struct MemDelivery {
    repo: InMemoryRepository,
    number: u64,
    ids: Vec<Uuid>,
}

impl MemDelivery {
    fn unlock(&self, st: &mut State) {
        for id in &self.ids {
            if st.row_locks.get(id) == Some(&self.number) {
                st.row_locks.remove(id);
            }
        }
    }
}

impl Drop for MemDelivery {
    fn drop(&mut self) {
        let repo = self.repo.clone();
        let mut st = repo.lock();
        self.unlock(&mut st);
        drop(st);
        repo.inner.released.notify_waiters();
    }
}

#[async_trait]
impl Delivery for MemDelivery {
    async fn commit(
        self: Box<Self>,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        if self
            .repo
            .inner
            .fail_next_commit
            .swap(false, Ordering::SeqCst)
        {
            // Dropping self rolls back: the rows are free at once (TX-02).
            return Err(RepositoryError::Other(
                "injected failure of the outcome commit (fail_next_outcome_commit)".into(),
            ));
        }
        let now = self.repo.now_sync();
        let max = self.repo.inner.error_max_length;
        let mut st = self.repo.lock();
        let mut out = Vec::with_capacity(outcomes.len());
        for o in outcomes {
            let mine = st.row_locks.get(&o.id) == Some(&self.number);
            let Some(row) = st
                .rows
                .get_mut(&o.id)
                .filter(|r| mine && r.status == Status::Pending)
            else {
                out.push(WrittenOutcome {
                    id: o.id,
                    result: OutcomeResult::LeaseLost,
                });
                continue;
            };
            // Only completions and counted failures are written (R84).
            if matches!(o.kind, OutcomeKind::Completed | OutcomeKind::Counted { .. }) {
                InMemoryRepository::apply(row, &o.kind, now, max);
                InMemoryRepository::release(row, now);
            }
            out.push(WrittenOutcome {
                id: o.id,
                result: OutcomeResult::Applied {
                    status: row.status,
                    attempts_made: row.attempts_made,
                    scheduled_at: row.scheduled_at,
                },
            });
        }
        self.unlock(&mut st);
        Ok(out)
    }

    async fn rollback(self: Box<Self>) {}
}

/// A unit of work on the in-memory repository. Dropping it without commit rolls it back.
#[derive(Debug)]
pub struct MemTransaction {
    repo: InMemoryRepository,
    id: u64,
    rows: Vec<OutboxEvent>,
    claims: HashSet<String>,
    started_at: Option<DateTime<Utc>>,
    done: bool,
}

impl MemTransaction {
    /// Runs the unit of work's first statement, if it has not run yet: fixes its start instant
    /// ([`started_at`](Self::started_at)), as a database fixes `now()` at a transaction's first
    /// statement. created_at never comes from it: it is the clock at each write call (R73;
    /// conformance scenario W-04 advances the clock between a start and a later write).
    pub fn touch(&mut self) {
        if self.started_at.is_none() {
            self.started_at = Some(self.repo.now_sync());
        }
    }

    /// The instant of the unit of work's first statement (a [`touch`](Self::touch) or a
    /// [`write`](Self::write)), or none before it.
    pub fn started_at(&self) -> Option<DateTime<Utc>> {
        self.started_at
    }

    /// Writes events (R13 to R17). created_at is the clock's now, raised to 1 µs after the
    /// previous write call's value; the call's events share it. An absolute schedule outside
    /// [created_at − 60 s, created_at + 365 days] refuses the call, which then changes nothing
    /// ([`check_insert_window`](crate::event::check_insert_window)).
    pub async fn write(
        &mut self,
        events: Vec<NewEvent>,
    ) -> Result<Vec<WriteResult>, RepositoryError> {
        self.touch();
        // Wait until no other open transaction claims one of our idempotency keys (R17).
        loop {
            let inner = self.repo.inner.clone();
            let notified = inner.released.notified();
            {
                let repo = self.repo.clone();
                let mut st = repo.lock();
                let blocked = events.iter().filter_map(|e| e.idempotency_key()).any(|k| {
                    !st.idem.contains_key(k) && st.claims.get(k).is_some_and(|tx| *tx != self.id)
                });
                if !blocked {
                    return self.write_locked(&mut st, events);
                }
            }
            notified.await;
        }
    }

    fn write_locked(
        &mut self,
        st: &mut State,
        events: Vec<NewEvent>,
    ) -> Result<Vec<WriteResult>, RepositoryError> {
        let now = self.repo.inner.clock.now();
        let created = match st.last_created {
            Some(prev) if now <= prev => prev + chrono::Duration::microseconds(1),
            _ => now,
        };
        // An absolute schedule must fit the window around this created_at (R8, D2); one that
        // does not refuses the whole call before anything changes.
        for e in &events {
            if let Some(at) = e.scheduled_at() {
                crate::event::check_insert_window(e.id(), at, created)?;
            }
        }
        st.last_created = Some(created);
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            if let Some(k) = e.idempotency_key() {
                if let Some(id) = st.idem.get(k) {
                    out.push(WriteResult {
                        event: st.rows[id].clone(),
                        inserted: false,
                    });
                    continue;
                }
                if let Some(r) = self
                    .rows
                    .iter()
                    .find(|r| r.idempotency_key.as_deref() == Some(k))
                {
                    out.push(WriteResult {
                        event: r.clone(),
                        inserted: false,
                    });
                    continue;
                }
                st.claims.insert(k.to_owned(), self.id);
                self.claims.insert(k.to_owned());
            }
            if let Some(existing) = st
                .rows
                .get(&e.id())
                .or_else(|| self.rows.iter().find(|r| r.id == e.id()))
            {
                out.push(WriteResult {
                    event: existing.clone(),
                    inserted: false,
                });
                continue;
            }
            let row = e.into_row(created);
            self.rows.push(row.clone());
            out.push(WriteResult {
                event: row,
                inserted: true,
            });
        }
        Ok(out)
    }

    /// Makes the written events visible.
    pub fn commit(mut self) {
        let mut st = self.repo.lock();
        for r in self.rows.drain(..) {
            if let Some(k) = &r.idempotency_key {
                st.idem.insert(k.clone(), r.id);
            }
            st.rows.insert(r.id, r);
        }
        for k in self.claims.drain() {
            st.claims.remove(&k);
        }
        drop(st);
        self.done = true;
        self.repo.inner.released.notify_waiters();
    }

    /// Discards the written events.
    pub fn rollback(mut self) {
        self.abort();
    }

    fn abort(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let mut st = self.repo.lock();
        for k in self.claims.drain() {
            st.claims.remove(&k);
        }
        drop(st);
        self.rows.clear();
        self.repo.inner.released.notify_waiters();
    }
}

impl Drop for MemTransaction {
    fn drop(&mut self) {
        self.abort();
    }
}

fn chrono_dur(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

/// `t + d`, saturating at the latest time chrono represents (no overflow panic on any input).
fn plus(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    t.checked_add_signed(chrono_dur(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

/// `t − d`, saturating at the earliest time chrono represents.
fn minus(t: DateTime<Utc>, d: chrono::Duration) -> DateTime<Utc> {
    t.checked_sub_signed(d).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

#[async_trait]
impl OutboxRepository for InMemoryRepository {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: "memory",
            database_clock: false,
            undecodable_rows: false,
            transaction_delivery: true,
        }
    }

    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        Ok(self.now_sync())
    }

    async fn get(&self, id: Uuid) -> Result<Option<OutboxEvent>, RepositoryError> {
        Ok(self.lock().rows.get(&id).cloned())
    }

    async fn fetch_and_lock(&self, req: &FetchRequest) -> Result<Vec<Fetched>, RepositoryError> {
        req.validate()?;
        let now = self.now_sync();
        let mut st = self.lock();
        let ids = st.select_ids(req, now);
        Ok(ids
            .into_iter()
            .map(|id| {
                let r = st.rows.get_mut(&id).expect("selected row exists");
                r.locked_at = Some(now);
                r.locked_by = Some(req.worker.as_str().to_owned());
                r.updated_at = Some(now);
                Fetched::Row(r.clone())
            })
            .collect())
    }

    async fn begin_delivery(
        &self,
        req: &FetchRequest,
        _bound: DeliveryBound,
    ) -> Result<(Vec<Fetched>, Box<dyn Delivery>), RepositoryError> {
        req.validate()?;
        let now = self.now_sync();
        let number = self.inner.next_tx.fetch_add(1, Ordering::SeqCst);
        let mut st = self.lock();
        let ids = st.select_ids(req, now);
        let rows: Vec<Fetched> = ids
            .iter()
            .map(|id| {
                st.row_locks.insert(*id, number);
                Fetched::Row(st.rows[id].clone())
            })
            .collect();
        Ok((
            rows,
            Box::new(MemDelivery {
                repo: self.clone(),
                number,
                ids,
            }),
        ))
    }

    async fn write_outcomes(
        &self,
        worker: &WorkerId,
        outcomes: &[Outcome],
    ) -> Result<Vec<WrittenOutcome>, RepositoryError> {
        if self.inner.fail_next_commit.swap(false, Ordering::SeqCst) {
            return Err(RepositoryError::Other(
                "injected failure of the outcome commit (fail_next_outcome_commit)".into(),
            ));
        }
        let now = self.now_sync();
        let max = self.inner.error_max_length;
        let mut st = self.lock();
        let mut out = Vec::with_capacity(outcomes.len());
        for o in outcomes {
            let Some(row) = st.rows.get_mut(&o.id).filter(|r| Self::held_by(r, worker)) else {
                out.push(WrittenOutcome {
                    id: o.id,
                    result: OutcomeResult::LeaseLost,
                });
                continue;
            };
            Self::apply(row, &o.kind, now, max);
            Self::release(row, now);
            out.push(WrittenOutcome {
                id: o.id,
                result: OutcomeResult::Applied {
                    status: row.status,
                    attempts_made: row.attempts_made,
                    scheduled_at: row.scheduled_at,
                },
            });
        }
        Ok(out)
    }

    async fn refresh_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        let now = self.now_sync();
        let mut st = self.lock();
        Ok(
            match st.rows.get_mut(&id).filter(|r| Self::held_by(r, worker)) {
                Some(r) => {
                    r.locked_at = Some(now);
                    r.updated_at = Some(now);
                    true
                }
                None => false,
            },
        )
    }

    async fn release_lock(&self, id: Uuid, worker: &WorkerId) -> Result<bool, RepositoryError> {
        let now = self.now_sync();
        let mut st = self.lock();
        Ok(
            match st.rows.get_mut(&id).filter(|r| Self::held_by(r, worker)) {
                Some(r) => {
                    Self::release(r, now);
                    true
                }
                None => false,
            },
        )
    }

    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError> {
        let now = self.now_sync();
        let mut st = self.lock();
        let unique: HashSet<Uuid> = ids.iter().copied().collect();
        let held = unique
            .iter()
            .filter(|id| st.rows.get(id).is_some_and(|r| Self::held_by(r, worker)))
            .count() as u64;
        if held != ids.len() as u64 {
            return Err(RepositoryError::ReleaseMismatch {
                changed: held,
                expected: ids.len() as u64,
            });
        }
        for id in unique {
            Self::release(st.rows.get_mut(&id).expect("checked"), now);
        }
        Ok(held)
    }

    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError> {
        args::stale_timeout(timeout)?;
        let now = self.now_sync();
        let cutoff = minus(now, chrono_dur(timeout));
        let mut st = self.lock();
        let cap = self.inner.batch_size.saturating_mul(STALE_LOCK_MAX_BATCHES);
        let mut n = 0u64;
        let State {
            rows, row_locks, ..
        } = &mut *st;
        for r in rows.values_mut() {
            if (n as usize) >= cap {
                break;
            }
            if r.status == Status::Pending
                && r.locked_at.is_some_and(|t| t < cutoff)
                && !row_locks.contains_key(&r.id)
            {
                Self::release(r, now);
                n += 1;
            }
        }
        Ok(n)
    }

    async fn requeue_failed(&self, id: Uuid) -> Result<bool, RepositoryError> {
        let now = self.now_sync();
        let mut st = self.lock();
        Ok(
            match st
                .rows
                .get_mut(&id)
                .filter(|r| r.status == Status::Failed || ordering::is_parked(r))
            {
                Some(r) => {
                    Self::requeue(r, now);
                    true
                }
                None => false,
            },
        )
    }

    async fn redrive(&self, target: &ParkedTarget) -> Result<Vec<Uuid>, RepositoryError> {
        let now = self.now_sync();
        let mut st = self.lock();
        let ids = Self::parked_ids(&st, target, "redrive")?;
        for id in &ids {
            if let Some(r) = st.rows.get_mut(id) {
                Self::requeue(r, now);
            }
        }
        drop(st);
        self.inner.released.notify_waiters();
        Ok(ids)
    }

    async fn discard(
        &self,
        target: &ParkedTarget,
        reason: &str,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        check_discard_reason(reason)?;
        let now = self.now_sync();
        let max = self.inner.error_max_length;
        let mut st = self.lock();
        let ids = Self::parked_ids(&st, target, "discard")?;
        for id in &ids {
            if let Some(r) = st.rows.get_mut(id) {
                r.last_error = Some(discard_text(reason, r.last_error.as_deref(), max)?);
                r.status = Status::Failed;
                Self::release(r, now);
            }
        }
        Ok(ids)
    }

    async fn delete_old_completed(
        &self,
        retention_days: u32,
        batch_size: usize,
    ) -> Result<u64, RepositoryError> {
        args::cleanup(retention_days, batch_size)?;
        let cutoff = minus(
            self.now_sync(),
            chrono::Duration::days(i64::from(retention_days)),
        );
        let mut st = self.lock();
        let victims: Vec<Uuid> = st
            .rows
            .values()
            .filter(|r| r.status == Status::Completed && r.completed_at.is_some_and(|t| t < cutoff))
            .take(batch_size)
            .map(|r| r.id)
            .collect();
        for id in &victims {
            if let Some(r) = st.rows.remove(id)
                && let Some(k) = r.idempotency_key
            {
                st.idem.remove(&k);
            }
        }
        Ok(victims.len() as u64)
    }

    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError> {
        let text = force_unlock_text(reason)?;
        let now = self.now_sync();
        let mut st = self.lock();
        match st.rows.get_mut(&id).filter(|r| r.locked_at.is_some()) {
            Some(r) => {
                Self::release(r, now);
                r.last_error = Some(text);
                Ok(())
            }
            None => Err(RepositoryError::NotLocked(id)),
        }
    }

    async fn blocked_keys(
        &self,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<BlockedKey>, RepositoryError> {
        let now = self.now_sync();
        let st = self.lock();
        let lines = ordering::lines(st.rows.values(), now);
        let mut out: Vec<BlockedKey> = lines
            .into_iter()
            .filter(|(_, line)| ordering::head_is_blocked(line[0], now, lease_ttl))
            .map(|(key, line)| {
                let h = line[0];
                let waiting = st
                    .rows
                    .values()
                    .filter(|r| {
                        r.status == Status::Pending
                            && r.topic == key.topic
                            && r.partition_key == key.partition_key
                            && ordering::write_order(r) > ordering::write_order(h)
                    })
                    .count()
                    .min(BLOCKED_WAITING_CAP as usize) as i64;
                BlockedKey {
                    topic: key.topic,
                    partition_key: key.partition_key,
                    head_id: h.id,
                    attempts_made: h.attempts_made,
                    max_attempts: h.max_attempts,
                    last_error: h.last_error.clone(),
                    next_try: h.scheduled_at,
                    locked_by: h.locked_by.clone(),
                    locked_at: h.locked_at,
                    parked: ordering::is_parked(h),
                    parked_at: ordering::is_parked(h).then_some(h.updated_at).flatten(),
                    waiting,
                }
            })
            .collect();
        out.sort_by_key(|b| {
            let h = &st.rows[&b.head_id];
            ordering::write_order(h)
        });
        out.truncate(limit);
        Ok(out)
    }

    async fn counts(&self) -> Result<Vec<StatusCount>, RepositoryError> {
        let st = self.lock();
        let mut m: BTreeMap<(String, Status), i64> = BTreeMap::new();
        for r in st.rows.values() {
            *m.entry((r.topic.clone(), r.status)).or_default() += 1;
        }
        Ok(m.into_iter()
            .map(|((topic, status), count)| StatusCount {
                topic,
                status,
                count,
            })
            .collect())
    }

    async fn parked_rows(&self) -> Result<u64, RepositoryError> {
        let st = self.lock();
        Ok(st.rows.values().filter(|r| ordering::is_parked(r)).count() as u64)
    }

    async fn oldest_due_age(&self) -> Result<Option<Duration>, RepositoryError> {
        let now = self.now_sync();
        let st = self.lock();
        Ok(st
            .rows
            .values()
            .filter(|r| r.status == Status::Pending && r.scheduled_at <= now)
            .map(|r| r.scheduled_at)
            .min()
            .map(|t| (now - t).to_std().unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn event(idempotency_key: &str) -> NewEvent {
        NewEvent::builder()
            .event_type("thing.done")
            .aggregate("thing", Uuid::new_v4())
            .topic("things")
            .partition_key("k")
            .payload_json(serde_json::json!({ "n": 1 }))
            .idempotency_key(idempotency_key)
            .build()
            .unwrap()
    }

    fn repo() -> (InMemoryRepository, ManualClock) {
        let clock = ManualClock::starting_now();
        (InMemoryRepository::new(Arc::new(clock.clone())), clock)
    }

    /// The first statement fixes the unit of work's start; later ones leave it.
    #[tokio::test]
    async fn touch_fixes_the_start_once() {
        let (repo, clock) = repo();
        let mut tx = repo.begin();
        assert_eq!(tx.started_at(), None);
        let t0 = repo.now_sync();
        tx.touch();
        assert_eq!(tx.started_at(), Some(t0));
        clock.advance(Duration::from_secs(1));
        tx.touch();
        tx.write(vec![event("a")]).await.unwrap();
        assert_eq!(tx.started_at(), Some(t0));
        let mut other = repo.begin();
        other.write(vec![event("b")]).await.unwrap();
        assert_eq!(other.started_at(), Some(t0 + chrono::Duration::seconds(1)));
    }

    /// A unit of work dropped without commit rolls back: its rows never show and its idempotency
    /// key is free for the next writer, which does not wait (R12, R17).
    #[tokio::test]
    async fn drop_rolls_back_and_frees_the_idempotency_key() {
        let (repo, _clock) = repo();
        let mut tx = repo.begin();
        let first = tx.write(vec![event("ik")]).await.unwrap();
        drop(tx);
        assert!(repo.rows().is_empty());
        let again = tokio::time::timeout(
            Duration::from_secs(5),
            repo.write_committed(vec![event("ik")]),
        )
        .await
        .expect("the write waited for a dropped unit of work")
        .unwrap();
        assert!(again[0].inserted);
        assert_ne!(again[0].event.id, first[0].event.id);
        assert_eq!(
            repo.rows().iter().map(|r| r.id).collect::<Vec<_>>(),
            vec![again[0].event.id]
        );
    }
}
