//! The in-memory reference inbox (contract R107 to R112, R116, R149 to R152, R161 to R163,
//! R181).
//!
//! [`InMemoryInbox`] keeps its rows, dedup index, locks and an application store under one
//! mutex. A [`MemInboxTx`] is its unit of work: it keeps a journal of its writes (rows and the
//! application's entries, [`MemInboxTx::record`]) and applies it at commit; a savepoint is a
//! position in the journal and a rollback to it truncates the journal there, so a failed
//! handler run is undone as on Postgres (R181). Locks behave as PostgreSQL's: the key lock of
//! R116 and a landing of a dedup key another open unit landed wait; a row lock is taken without
//! waiting (`SKIP LOCKED`). Dropping a unit rolls it back. The fetch runs the outbox's ordering
//! rules ([`crate::inbox::ordering`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde_json::Value;
use tokio::sync::Notify;
use uuid::Uuid;

use crate::clock::{Clock, SystemClock};
use crate::error::RepositoryError;
use crate::event::{Status, WorkerId, force_unlock_text, limits, normalize_error};
use crate::inbox::model::{ConsumerGroup, InboxEvent, InboxKey, NewInboxEvent};
use crate::inbox::ordering::{self as inbox_order, view};
use crate::inbox::repository::{
    Guard, InboxBackend, InboxBlockedKey, InboxCapabilities, InboxFetchRequest, InboxFetched,
    InboxRepository, InboxStatusCount, InboxTransaction, Landed, RowLock, RowWrite, WrittenState,
};
use crate::ordering;
use crate::repository::{
    BLOCKED_WAITING_CAP, FetchFilter, OnExhausted, ParkedTarget, Retry, args, check_discard_reason,
    discard_text, not_parked,
};

type DedupKey = (String, String);
type Hook = Box<dyn FnOnce() + Send>;

#[derive(Debug, Default)]
struct State {
    rows: BTreeMap<Uuid, InboxEvent>,
    dedup: HashMap<DedupKey, Uuid>,
    /// Dedup keys landed by open units, with the unit's number.
    claims: HashMap<DedupKey, u64>,
    row_locks: HashMap<Uuid, u64>,
    key_locks: HashMap<InboxKey, u64>,
    records: Vec<Value>,
    last_created: Option<DateTime<Utc>>,
}

struct Inner {
    state: Mutex<State>,
    clock: Arc<dyn Clock>,
    changed: Notify,
    next_tx: AtomicU64,
    fail_next_commit: AtomicBool,
    down: AtomicBool,
    before_next_begin: Mutex<Option<Hook>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InMemoryInbox").finish_non_exhaustive()
    }
}

/// The in-memory inbox. Cloning shares the store.
#[derive(Debug, Clone)]
pub struct InMemoryInbox {
    inner: Arc<Inner>,
}

impl Default for InMemoryInbox {
    fn default() -> Self {
        Self::new(Arc::new(SystemClock))
    }
}

fn chrono_dur(d: Duration) -> chrono::Duration {
    chrono::Duration::from_std(d).unwrap_or(chrono::Duration::MAX)
}

fn plus(t: DateTime<Utc>, d: Duration) -> DateTime<Utc> {
    t.checked_add_signed(chrono_dur(d))
        .unwrap_or(DateTime::<Utc>::MAX_UTC)
}

fn minus(t: DateTime<Utc>, d: chrono::Duration) -> DateTime<Utc> {
    t.checked_sub_signed(d).unwrap_or(DateTime::<Utc>::MIN_UTC)
}

fn dedup_key(r: &InboxEvent) -> DedupKey {
    (r.message_id.clone(), r.consumer_group.clone())
}

fn same_key(a: &InboxEvent, b: &InboxEvent) -> bool {
    a.partition_key.is_some()
        && a.partition_key == b.partition_key
        && a.consumer_group == b.consumer_group
        && a.source == b.source
}

impl InMemoryInbox {
    /// An inbox on this clock.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        Self {
            inner: Arc::new(Inner {
                state: Mutex::new(State::default()),
                clock,
                changed: Notify::new(),
                next_tx: AtomicU64::new(1),
                fail_next_commit: AtomicBool::new(false),
                down: AtomicBool::new(false),
                before_next_begin: Mutex::new(None),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner.state.lock().expect("inbox store poisoned")
    }

    fn now_sync(&self) -> DateTime<Utc> {
        let now = self.inner.clock.now();
        match self.lock().last_created {
            Some(last) if last > now => last,
            _ => now,
        }
    }

    /// Begins a unit of work without the availability check (used by [`InboxBackend::begin`]).
    fn unit(&self) -> MemInboxTx {
        MemInboxTx {
            repo: self.clone(),
            id: self.inner.next_tx.fetch_add(1, Ordering::SeqCst),
            journal: Vec::new(),
            savepoints: Vec::new(),
            broken: false,
            done: false,
        }
    }

    /// Lands events in a unit of its own and commits it.
    pub async fn land_committed(
        &self,
        events: Vec<NewInboxEvent>,
    ) -> Result<Vec<Landed>, RepositoryError> {
        let mut tx = self.begin().await?;
        let r = tx.land(events).await?;
        tx.commit().await?;
        Ok(r)
    }

    /// Every stored row, in write order.
    pub fn rows(&self) -> Vec<InboxEvent> {
        let mut v: Vec<_> = self.lock().rows.values().cloned().collect();
        v.sort_by_key(inbox_order::write_order);
        v
    }

    /// The committed entries of the application store, in commit order (the handlers' own
    /// writes, [`MemInboxTx::record`]).
    pub fn records(&self) -> Vec<Value> {
        self.lock().records.clone()
    }

    /// Test fixture (cargo feature `testing`, for tests only): changes a stored row directly
    /// (the suite's `set`).
    #[cfg(any(test, feature = "testing"))]
    pub fn set(&self, id: Uuid, f: impl FnOnce(&mut InboxEvent)) -> bool {
        let mut st = self.lock();
        match st.rows.get_mut(&id) {
            Some(r) => {
                f(r);
                true
            }
            None => false,
        }
    }

    /// Test hook (cargo feature `testing`): the next unit of work fails when it commits.
    #[cfg(any(test, feature = "testing"))]
    pub fn fail_next_commit(&self) {
        self.inner.fail_next_commit.store(true, Ordering::SeqCst);
    }

    /// Test hook (cargo feature `testing`): while down, every new unit of work fails to begin
    /// and every fetch fails.
    #[cfg(any(test, feature = "testing"))]
    pub fn set_down(&self, down: bool) {
        self.inner.down.store(down, Ordering::SeqCst);
    }

    /// Test hook (cargo feature `testing`): runs `f` just before the next unit of work begins.
    #[cfg(any(test, feature = "testing"))]
    pub fn before_next_begin(&self, f: impl FnOnce() + Send + 'static) {
        *self.inner.before_next_begin.lock().expect("poisoned") = Some(Box::new(f));
    }

    fn check_up(&self) -> Result<(), RepositoryError> {
        if self.inner.down.load(Ordering::SeqCst) {
            return Err(RepositoryError::Unavailable {
                message: "the in-memory inbox is down (set_down)".into(),
            });
        }
        Ok(())
    }

    fn apply(row: &mut InboxEvent, w: &RowWrite, now: DateTime<Utc>) {
        let retry_at = |row: &InboxEvent, r: &Retry| match r {
            Retry::Keep => row.scheduled_at,
            Retry::After(d) => plus(now, *d),
            Retry::At(t) => *t,
        };
        let max = limits::DEFAULT_ERROR_MAX_LENGTH;
        let text = |e: &str| normalize_error(&e.replace('\0', "\u{FFFD}"), max);
        match w {
            RowWrite::Complete => {
                row.status = Status::Completed;
                row.completed_at = Some(now);
            }
            RowWrite::Counted {
                error,
                retry,
                exhausted,
            } => {
                row.attempts_made = row.attempts_made.saturating_add(1);
                if row.attempts_made >= row.max_attempts && *exhausted == OnExhausted::Release {
                    row.status = Status::Failed;
                }
                row.last_error = Some(text(error));
                row.scheduled_at = retry_at(row, retry);
            }
            RowWrite::NotCounted { error, retry } => {
                row.last_error = Some(text(error));
                row.scheduled_at = retry_at(row, retry);
            }
            RowWrite::Terminal { error, exhausted } => {
                if *exhausted == OnExhausted::Release {
                    row.status = Status::Failed;
                }
                row.attempts_made = row.max_attempts;
                row.last_error = Some(text(error));
            }
            RowWrite::ClearLease => {}
        }
        row.locked_at = None;
        row.locked_by = None;
        row.updated_at = Some(now);
    }

    fn group_rows<'a>(
        st: &'a State,
        group: &'a ConsumerGroup,
    ) -> impl Iterator<Item = &'a InboxEvent> + 'a {
        st.rows
            .values()
            .filter(move |r| r.consumer_group == group.as_str())
    }
}

// Rows are most of a journal; boxing them would cost an allocation per write.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
enum Entry {
    Row(InboxEvent),
    Record(Value),
}

/// A unit of work of the in-memory inbox: the runner's T, the processor's T_row, and the
/// transaction a handler gets (R181).
#[derive(Debug)]
pub struct MemInboxTx {
    repo: InMemoryInbox,
    id: u64,
    journal: Vec<Entry>,
    savepoints: Vec<usize>,
    broken: bool,
    done: bool,
}

impl MemInboxTx {
    /// Writes one entry of the application store; it commits with the unit (R115, R119).
    pub fn record(&mut self, entry: Value) {
        self.journal.push(Entry::Record(entry));
    }

    /// Test hook (cargo feature `testing`, for tests only): makes the unit unusable, as a
    /// connection the handler ended (the suite's `break_tx`): every later statement fails, and so
    /// does the rollback to the savepoint.
    #[cfg(any(test, feature = "testing"))]
    pub fn break_transaction(&mut self) {
        self.broken = true;
    }

    /// The row as this unit sees it.
    pub fn row(&self, id: Uuid) -> Option<InboxEvent> {
        self.journal
            .iter()
            .rev()
            .find_map(|e| match e {
                Entry::Row(r) if r.id == id => Some(r.clone()),
                _ => None,
            })
            .or_else(|| self.repo.lock().rows.get(&id).cloned())
    }

    fn check(&self) -> Result<(), RepositoryError> {
        if self.broken {
            return Err(RepositoryError::Unavailable {
                message: "the unit of work is broken (its connection was ended)".into(),
            });
        }
        Ok(())
    }

    fn own_rows(&self) -> Vec<InboxEvent> {
        let mut out: BTreeMap<Uuid, InboxEvent> = BTreeMap::new();
        for e in &self.journal {
            if let Entry::Row(r) = e {
                out.insert(r.id, r.clone());
            }
        }
        out.into_values().collect()
    }

    fn release_all(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let mut st = self.repo.lock();
        let id = self.id;
        st.claims.retain(|_, t| *t != id);
        st.row_locks.retain(|_, t| *t != id);
        st.key_locks.retain(|_, t| *t != id);
        drop(st);
        self.repo.inner.changed.notify_waiters();
    }

    async fn land_one(&mut self, e: NewInboxEvent) -> Result<Landed, RepositoryError> {
        let key = (e.message_id().to_owned(), e.consumer_group().to_owned());
        loop {
            let inner = self.repo.inner.clone();
            let notified = inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let repo = self.repo.clone();
                let mut st = repo.lock();
                if let Some(id) = st.dedup.get(&key).copied() {
                    drop(st);
                    let row = self.row(id).expect("dedup row exists");
                    return Ok(Landed {
                        row,
                        inserted: false,
                    });
                }
                if let Some(r) = self.own_rows().into_iter().find(|r| dedup_key(r) == key) {
                    return Ok(Landed {
                        row: r,
                        inserted: false,
                    });
                }
                let other = st.claims.get(&key).is_some_and(|t| *t != self.id);
                if !other {
                    let now = self.repo.inner.clock.now();
                    let created = match st.last_created {
                        Some(prev) if now <= prev => prev + chrono::Duration::microseconds(1),
                        _ => now,
                    };
                    st.last_created = Some(created);
                    st.claims.insert(key, self.id);
                    let row = e.into_row(created);
                    st.row_locks.insert(row.id, self.id);
                    drop(st);
                    self.journal.push(Entry::Row(row.clone()));
                    return Ok(Landed {
                        row,
                        inserted: true,
                    });
                }
            }
            notified.await;
        }
    }
}

impl Drop for MemInboxTx {
    fn drop(&mut self) {
        self.release_all();
    }
}

#[async_trait]
impl InboxTransaction for MemInboxTx {
    type Handle = MemInboxTx;

    fn handle(&mut self) -> &mut MemInboxTx {
        self
    }

    async fn lock_key(&mut self, key: &InboxKey) -> Result<(), RepositoryError> {
        self.check()?;
        loop {
            let inner = self.repo.inner.clone();
            let notified = inner.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = self.repo.lock();
                match st.key_locks.get(key) {
                    Some(t) if *t != self.id => {}
                    _ => {
                        st.key_locks.insert(key.clone(), self.id);
                        return Ok(());
                    }
                }
            }
            notified.await;
        }
    }

    async fn land(&mut self, events: Vec<NewInboxEvent>) -> Result<Vec<Landed>, RepositoryError> {
        self.check()?;
        let mut out = Vec::with_capacity(events.len());
        for e in events {
            out.push(self.land_one(e).await?);
        }
        Ok(out)
    }

    async fn lock_row(&mut self, id: Uuid) -> Result<RowLock, RepositoryError> {
        self.check()?;
        {
            let mut st = self.repo.lock();
            match st.row_locks.get(&id) {
                Some(t) if *t != self.id => return Ok(RowLock::Busy),
                _ => {}
            }
            let exists = st.rows.contains_key(&id)
                || self
                    .journal
                    .iter()
                    .any(|e| matches!(e, Entry::Row(r) if r.id == id));
            if !exists {
                return Ok(RowLock::Missing);
            }
            st.row_locks.insert(id, self.id);
        }
        Ok(self.row(id).map_or(RowLock::Missing, RowLock::Locked))
    }

    async fn earlier_in_line(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError> {
        self.check()?;
        let now = self.repo.now_sync();
        // The table as this unit sees it: its own writes and inserts over the committed rows
        // (a batch's earlier rows, R185 step 3).
        let own: BTreeMap<Uuid, InboxEvent> =
            self.own_rows().into_iter().map(|r| (r.id, r)).collect();
        let st = self.repo.lock();
        let me = inbox_order::write_order(row);
        let mine = self.id;
        let held_elsewhere = |r: &InboxEvent| {
            r.status == Status::Pending && st.row_locks.get(&r.id).is_some_and(|t| *t != mine)
        };
        let earlier =
            |r: &InboxEvent| r.id != row.id && same_key(r, row) && inbox_order::write_order(r) < me;
        let committed = st
            .rows
            .values()
            .filter(|r| !own.contains_key(&r.id))
            .any(|r| earlier(r) && (inbox_order::in_line(r, now) || held_elsewhere(r)));
        Ok(committed
            || own
                .values()
                .any(|r| earlier(r) && inbox_order::in_line(r, now)))
    }

    async fn completed_sibling(&mut self, _row: &InboxEvent) -> Result<bool, RepositoryError> {
        // The dedup index holds one row per dedup key here (the plain table's rule, R164).
        self.check()?;
        Ok(false)
    }

    async fn savepoint(&mut self, _timeout: Duration) -> Result<(), RepositoryError> {
        self.check()?;
        self.savepoints.push(self.journal.len());
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), RepositoryError> {
        self.check()?;
        self.savepoints.pop();
        Ok(())
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), RepositoryError> {
        self.check()?;
        let at = self.savepoints.pop().unwrap_or(0);
        self.journal.truncate(at);
        Ok(())
    }

    async fn forget_landed(&mut self, id: Uuid) -> Result<(), RepositoryError> {
        self.check()?;
        let Some(key) = self.journal.iter().find_map(|e| match e {
            Entry::Row(r) if r.id == id => Some(dedup_key(r)),
            _ => None,
        }) else {
            return Err(RepositoryError::Other(format!(
                "inbox row {id} was not landed by this unit"
            )));
        };
        if self.repo.lock().rows.contains_key(&id) {
            return Err(RepositoryError::Other(format!(
                "inbox row {id} existed before this unit"
            )));
        }
        self.journal
            .retain(|e| !matches!(e, Entry::Row(r) if r.id == id));
        for at in &mut self.savepoints {
            *at = (*at).min(self.journal.len());
        }
        let mut st = self.repo.lock();
        st.claims.remove(&key);
        st.row_locks.remove(&id);
        drop(st);
        self.repo.inner.changed.notify_waiters();
        Ok(())
    }

    async fn write(&mut self, id: Uuid, write: RowWrite) -> Result<InboxEvent, RepositoryError> {
        self.check()?;
        let now = self.repo.now_sync();
        let mut row = self
            .row(id)
            .ok_or_else(|| RepositoryError::Other(format!("inbox row {id} does not exist")))?;
        InMemoryInbox::apply(&mut row, &write, now);
        self.journal.push(Entry::Row(row.clone()));
        Ok(row)
    }

    async fn guard(&mut self, guard: &Guard) -> Result<Option<InboxEvent>, RepositoryError> {
        self.check()?;
        let now = self.repo.now_sync();
        match guard {
            Guard::Reland(e) => {
                let l = self.land(vec![e.clone()]).await?.remove(0);
                Ok(l.inserted.then_some(l.row))
            }
            Guard::Unchanged {
                id,
                attempts_made,
                scheduled_at,
                lease_ttl,
                ..
            } => Ok(match self.lock_row(*id).await? {
                RowLock::Locked(r)
                    if r.status == Status::Pending
                        && (r.locked_at.is_none()
                            || inbox_order::lease_expired(&r, now, *lease_ttl))
                        && r.attempts_made == *attempts_made
                        && r.scheduled_at == *scheduled_at =>
                {
                    Some(r)
                }
                _ => None,
            }),
            Guard::HeldBy { id, worker, .. } => Ok(match self.lock_row(*id).await? {
                RowLock::Locked(r)
                    if r.status == Status::Pending
                        && r.locked_by.as_deref() == Some(worker.as_str()) =>
                {
                    Some(r)
                }
                _ => None,
            }),
        }
    }

    /// Rows here always decode: the guard and the write of any row.
    async fn fail_undecodable(
        &mut self,
        id: Uuid,
        worker: &WorkerId,
        error: &str,
        retry: Retry,
        exhausted: OnExhausted,
    ) -> Result<Option<WrittenState>, RepositoryError> {
        // R152's guard (Guard::HeldBy), by id: this store finds rows by id alone.
        let held = matches!(
            self.lock_row(id).await?,
            RowLock::Locked(r)
                if r.status == Status::Pending && r.locked_by.as_deref() == Some(worker.as_str())
        );
        if !held {
            return Ok(None);
        }
        let error = error.to_owned();
        let w = self
            .write(
                id,
                RowWrite::Counted {
                    error,
                    retry,
                    exhausted,
                },
            )
            .await?;
        Ok(Some(WrittenState::from(&w)))
    }

    async fn commit(mut self) -> Result<(), RepositoryError> {
        if self.broken {
            self.release_all();
            return Err(RepositoryError::Unavailable {
                message: "the unit of work is broken (its connection was ended)".into(),
            });
        }
        if self
            .repo
            .inner
            .fail_next_commit
            .swap(false, Ordering::SeqCst)
        {
            self.release_all();
            return Err(RepositoryError::Unavailable {
                message: "injected failure of the commit (fail_next_commit)".into(),
            });
        }
        {
            let repo = self.repo.clone();
            let mut st = repo.lock();
            for e in self.journal.drain(..) {
                match e {
                    Entry::Row(r) => {
                        st.dedup.entry(dedup_key(&r)).or_insert(r.id);
                        st.rows.insert(r.id, r);
                    }
                    Entry::Record(v) => st.records.push(v),
                }
            }
        }
        self.release_all();
        Ok(())
    }

    async fn rollback(mut self) {
        self.journal.clear();
        self.release_all();
    }
}

#[async_trait]
impl InboxBackend for InMemoryInbox {
    type Tx = MemInboxTx;

    async fn begin(&self) -> Result<MemInboxTx, RepositoryError> {
        let hook = self
            .inner
            .before_next_begin
            .lock()
            .expect("poisoned")
            .take();
        if let Some(f) = hook {
            f();
        }
        self.check_up()?;
        Ok(self.unit())
    }
}

#[async_trait]
impl InboxRepository for InMemoryInbox {
    fn capabilities(&self) -> InboxCapabilities {
        InboxCapabilities {
            name: "memory",
            database_clock: false,
            siblings: false,
            undecodable_rows: false,
        }
    }

    async fn now(&self) -> Result<DateTime<Utc>, RepositoryError> {
        Ok(self.now_sync())
    }

    async fn get(&self, id: Uuid) -> Result<Option<InboxEvent>, RepositoryError> {
        Ok(self.lock().rows.get(&id).cloned())
    }

    async fn get_by_message_id(
        &self,
        message_id: &str,
        group: &ConsumerGroup,
    ) -> Result<Option<InboxEvent>, RepositoryError> {
        let st = self.lock();
        Ok(st
            .dedup
            .get(&(message_id.to_owned(), group.as_str().to_owned()))
            .and_then(|id| st.rows.get(id))
            .cloned())
    }

    async fn fetch_and_lock(
        &self,
        req: &InboxFetchRequest,
    ) -> Result<Vec<InboxFetched>, RepositoryError> {
        req.validate()?;
        self.check_up()?;
        let now = self.now_sync();
        let mut st = self.lock();
        let views: Vec<_> = st
            .rows
            .values()
            .filter(|r| req.matches(r))
            .map(|r| {
                let mut v = view(r, req.key_order);
                if st.row_locks.contains_key(&r.id) {
                    // Row-locked elsewhere: skipped, and in line for its key (SKIP LOCKED).
                    v.locked_at = Some(now);
                    v.locked_by = Some("(row-locked)".into());
                }
                v
            })
            .collect();
        let ids: Vec<Uuid> = ordering::select(
            views.iter(),
            now,
            req.limit,
            req.lease_ttl,
            req.max_per_key,
            &FetchFilter::none(),
        )
        .into_iter()
        .map(|v| v.id)
        .collect();
        Ok(ids
            .into_iter()
            .map(|id| {
                let r = st.rows.get_mut(&id).expect("selected row exists");
                r.locked_at = Some(now);
                r.locked_by = Some(req.worker.as_str().to_owned());
                r.updated_at = Some(now);
                InboxFetched::Row(r.clone())
            })
            .collect())
    }

    async fn release_locks(&self, ids: &[Uuid], worker: &WorkerId) -> Result<u64, RepositoryError> {
        let now = self.now_sync();
        let mut st = self.lock();
        let mut n = 0;
        for id in ids {
            if let Some(r) = st.rows.get_mut(id).filter(|r| {
                r.status == Status::Pending && r.locked_by.as_deref() == Some(worker.as_str())
            }) {
                Self::apply(r, &RowWrite::ClearLease, now);
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
                .filter(|r| r.status == Status::Failed || inbox_parked(r))
            {
                Some(r) => {
                    requeue_row(r, now);
                    true
                }
                None => false,
            },
        )
    }

    async fn redrive(
        &self,
        group: &ConsumerGroup,
        target: &ParkedTarget,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        let now = self.now_sync();
        let mut st = self.lock();
        let ids = parked_ids(&st, group, target, "redrive")?;
        for id in &ids {
            if let Some(r) = st.rows.get_mut(id) {
                requeue_row(r, now);
            }
        }
        Ok(ids)
    }

    async fn discard(
        &self,
        group: &ConsumerGroup,
        target: &ParkedTarget,
        reason: &str,
    ) -> Result<Vec<Uuid>, RepositoryError> {
        check_discard_reason(reason)?;
        let now = self.now_sync();
        let mut st = self.lock();
        let ids = parked_ids(&st, group, target, "discard")?;
        for id in &ids {
            if let Some(r) = st.rows.get_mut(id) {
                r.last_error = Some(discard_text(
                    reason,
                    r.last_error.as_deref(),
                    limits::DEFAULT_ERROR_MAX_LENGTH,
                )?);
                r.status = Status::Failed;
                r.locked_at = None;
                r.locked_by = None;
                r.updated_at = Some(now);
            }
        }
        Ok(ids)
    }

    async fn release_stale_locks(&self, timeout: Duration) -> Result<u64, RepositoryError> {
        args::stale_timeout(timeout)?;
        let now = self.now_sync();
        let cutoff = minus(now, chrono_dur(timeout));
        let mut st = self.lock();
        let State {
            rows, row_locks, ..
        } = &mut *st;
        let mut n = 0;
        for r in rows.values_mut() {
            if r.status == Status::Pending
                && r.locked_at.is_some_and(|t| t < cutoff)
                && !row_locks.contains_key(&r.id)
            {
                Self::apply(r, &RowWrite::ClearLease, now);
                n += 1;
            }
        }
        Ok(n)
    }

    async fn force_unlock(&self, id: Uuid, reason: &str) -> Result<(), RepositoryError> {
        let text = force_unlock_text(reason)?;
        let now = self.now_sync();
        let mut st = self.lock();
        match st.rows.get_mut(&id).filter(|r| r.locked_at.is_some()) {
            Some(r) => {
                Self::apply(r, &RowWrite::ClearLease, now);
                r.last_error = Some(text);
                Ok(())
            }
            None => Err(RepositoryError::NotLocked(id)),
        }
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
            if let Some(r) = st.rows.remove(id) {
                let k = dedup_key(&r);
                if st.dedup.get(&k) == Some(id) {
                    st.dedup.remove(&k);
                }
            }
        }
        Ok(victims.len() as u64)
    }

    async fn parked_counts(&self, group: &ConsumerGroup) -> Result<(u64, u64), RepositoryError> {
        let st = self.lock();
        let parked: Vec<&InboxEvent> = st
            .rows
            .values()
            .filter(|r| r.consumer_group == group.as_str() && inbox_parked(r))
            .collect();
        let keys: std::collections::HashSet<(&str, &str)> = parked
            .iter()
            .filter_map(|r| Some((r.source.as_str(), r.partition_key.as_deref()?)))
            .collect();
        Ok((keys.len() as u64, parked.len() as u64))
    }

    async fn blocked_keys(
        &self,
        group: &ConsumerGroup,
        lease_ttl: Duration,
        limit: usize,
    ) -> Result<Vec<InboxBlockedKey>, RepositoryError> {
        let now = self.now_sync();
        let st = self.lock();
        let keyed: Vec<&InboxEvent> = Self::group_rows(&st, group)
            .filter(|r| r.partition_key.is_some())
            .collect();
        let views: Vec<_> = keyed.iter().map(|r| view(r, true)).collect();
        let lines = ordering::lines(views.iter(), now);
        let mut out: Vec<(DateTime<Utc>, Uuid, InboxBlockedKey)> = lines
            .into_values()
            .filter(|line| ordering::head_is_blocked(line[0], now, lease_ttl))
            .map(|line| {
                let h = &st.rows[&line[0].id];
                let waiting = keyed
                    .iter()
                    .filter(|r| {
                        r.status == Status::Pending
                            && same_key(r, h)
                            && inbox_order::write_order(r) > inbox_order::write_order(h)
                    })
                    .count()
                    .min(BLOCKED_WAITING_CAP as usize) as i64;
                (
                    h.created_at,
                    h.id,
                    InboxBlockedKey {
                        source: h.source.clone(),
                        partition_key: h.partition_key.clone().unwrap_or_default(),
                        head_id: h.id,
                        message_id: h.message_id.clone(),
                        attempts_made: h.attempts_made,
                        max_attempts: h.max_attempts,
                        last_error: h.last_error.clone(),
                        next_try: h.scheduled_at,
                        locked_by: h.locked_by.clone(),
                        locked_at: h.locked_at,
                        parked: inbox_parked(h),
                        parked_at: inbox_parked(h).then_some(h.updated_at).flatten(),
                        waiting,
                    },
                )
            })
            .collect();
        out.sort_by_key(|(c, id, _)| (*c, *id));
        Ok(out.into_iter().take(limit).map(|(_, _, b)| b).collect())
    }

    async fn counts(
        &self,
        group: &ConsumerGroup,
    ) -> Result<Vec<InboxStatusCount>, RepositoryError> {
        let st = self.lock();
        let mut m: BTreeMap<(String, Status), i64> = BTreeMap::new();
        for r in Self::group_rows(&st, group) {
            *m.entry((r.source.clone(), r.status)).or_default() += 1;
        }
        Ok(m.into_iter()
            .map(|((source, status), count)| InboxStatusCount {
                consumer_group: group.as_str().to_owned(),
                source,
                status,
                count,
            })
            .collect())
    }

    async fn oldest_due_age(
        &self,
        group: &ConsumerGroup,
    ) -> Result<Option<Duration>, RepositoryError> {
        let now = self.now_sync();
        let st = self.lock();
        Ok(Self::group_rows(&st, group)
            .filter(|r| r.status == Status::Pending && r.scheduled_at <= now)
            .map(|r| r.scheduled_at)
            .min()
            .map(|t| (now - t).to_std().unwrap_or_default()))
    }
}

/// Whether an inbox row is parked (R191): pending with every attempt spent.
fn inbox_parked(r: &InboxEvent) -> bool {
    crate::repository::is_parked(r.status, r.attempts_made, r.max_attempts)
}

/// R64 on one inbox row: pending, no attempts, no error, due now, released.
fn requeue_row(r: &mut InboxEvent, now: DateTime<Utc>) {
    r.status = Status::Pending;
    r.attempts_made = 0;
    r.last_error = None;
    r.scheduled_at = now;
    r.completed_at = None;
    r.locked_at = None;
    r.locked_by = None;
    r.updated_at = Some(now);
}

/// The parked rows of `group` that `target` selects (the topic is the source), in write
/// order; by id, a row that is not parked (or of another group) is refused (R192, OP-05).
fn parked_ids(
    st: &State,
    group: &ConsumerGroup,
    target: &ParkedTarget,
    op: &str,
) -> Result<Vec<Uuid>, RepositoryError> {
    if let ParkedTarget::Id(id) = target {
        let r = st
            .rows
            .get(id)
            .filter(|r| r.consumer_group == group.as_str());
        return match r {
            Some(r) if inbox_parked(r) => Ok(vec![*id]),
            r => Err(not_parked(
                *id,
                op,
                r.map(|r| (r.status, r.attempts_made, r.max_attempts)),
            )),
        };
    }
    let mut rows: Vec<&InboxEvent> = st
        .rows
        .values()
        .filter(|r| {
            r.consumer_group == group.as_str()
                && inbox_parked(r)
                && target.matches(r.id, &r.source, r.partition_key.as_deref().unwrap_or(""))
        })
        .collect();
    rows.sort_by_key(|r| (r.created_at, r.id));
    Ok(rows.into_iter().map(|r| r.id).collect())
}
