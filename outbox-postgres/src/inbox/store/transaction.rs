//! One open inbox transaction of the store: the runner's T and the processor's T_row (R181),
//! its landing, guard, savepoint and row writes.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use txoutbox_core::error::RepositoryError;
use txoutbox_core::event::{Status, WorkerId, limits, normalize_error};
use txoutbox_core::inbox::ordering as inbox_order;
use txoutbox_core::inbox::repository::{
    Guard, InboxTransaction, Landed, RowLock, RowWrite, WrittenState,
};
use txoutbox_core::inbox::{InboxEvent, InboxKey, NewInboxEvent};
use txoutbox_core::repository::{OnExhausted, Retry};
use uuid::Uuid;

use super::{Conn, InboxFaults, decoded, one};
use crate::driver::inbox::{
    InboxDriver, InboxRawRow, InboxRows, nullable_int8, nullable_text, nullable_timestamp,
};
use crate::driver::{Bind, Driver};
use crate::inbox::sql::InboxStatements;
use crate::sql::{Layout, micros};

/// One open inbox transaction over a driver transaction `T`.
///
/// Its round trips are counted (issue 21's benchmarks): the runner's landing of a new message
/// is one statement (`land_run.sql`: the insert, the earlier probe, the handler timeout), the
/// row it inserted is not locked or read again, the savepoint is not released by a statement
/// of its own (the commit releases it, R181 step 3) and the statement timeout is put back by
/// the outcome write (`write.sql`'s `$6`, R181 step 4).
pub struct PgInboxTx<D: Driver> {
    pub(super) tx: D::Tx,
    pub(super) stmts: Arc<InboxStatements>,
    pub(super) faults: Arc<InboxFaults>,
    /// The statement_timeout before the handler's was set, to put back (R181 step 4).
    pub(super) timeout_before: Option<String>,
    /// The handler timeout in whole milliseconds ([`InboxTransaction::plan_handler_timeout`]).
    pub(super) planned_timeout: Option<String>,
    /// Whether the handler timeout was set ahead, before the savepoint, by `land_run` or
    /// `lock_row_run` (a rollback to the savepoint then keeps it).
    pub(super) timeout_early: bool,
    /// A statement_timeout the next write puts back.
    pub(super) restore: Option<String>,
    /// The handler timeout of the run in progress (set by [`InboxTransaction::savepoint`]).
    pub(super) run_timeout: Option<Duration>,
    /// The row `land_run` inserted in this transaction, as inserted, and whether an earlier row
    /// of its key was in line then; cleared by a write.
    pub(super) inserted: Option<(InboxEvent, bool)>,
    /// created_at of the rows this transaction read decoded or was given (a guard): with the
    /// id, the primary key of both layouts, by which its by-id statements find them (on the
    /// partitioned table a lookup by id alone reads every partition).
    pub(super) known: HashMap<Uuid, DateTime<Utc>>,
    /// Whether the planned handler timeout is at least [`SHORT_HANDLER_TIMEOUT`].
    pub(super) planned_long: bool,
    /// A processor transaction of several rows (R189, [`InboxTransaction::guard_held`]) with a
    /// long handler timeout: the timeout is set once, before the first run's savepoint (so no
    /// rollback to a savepoint undoes it), bounds every run of the transaction and its outcome
    /// writes, and goes back before the commit (R181 steps 1 and 4, once per transaction
    /// instead of once per run).
    pub(super) batch: bool,
}

impl<D: Driver> std::fmt::Debug for PgInboxTx<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgInboxTx")
            .field("table", &self.stmts.table)
            .finish()
    }
}

fn error_text(e: &str) -> String {
    normalize_error(
        &e.replace('\0', "\u{FFFD}"),
        limits::DEFAULT_ERROR_MAX_LENGTH,
    )
}

/// Below this handler timeout, the statement_timeout goes back in a statement of its own right
/// after the run, before the outcome write (R181 step 4), instead of inside that write (which
/// then runs under the handler's timeout): a short handler timeout must not cancel the outcome
/// write of a run that ended in time, which would leave the message unhandled for good.
const SHORT_HANDLER_TIMEOUT: Duration = Duration::from_secs(5);

/// The handler timeout as R181 sets it: whole milliseconds rounded up, at least 1 (0 would turn
/// the bound off).
fn timeout_ms(timeout: Duration) -> String {
    timeout.as_micros().div_ceil(1000).max(1).to_string()
}

fn retry_binds(retry: &Retry) -> (Bind, Bind) {
    match retry {
        Retry::Keep => (nullable_int8(None), nullable_timestamp(None)),
        Retry::After(d) => (nullable_int8(Some(micros(*d))), nullable_timestamp(None)),
        Retry::At(t) => (nullable_int8(None), nullable_timestamp(Some(*t))),
    }
}

impl<D: Driver> PgInboxTx<D>
where
    D::Conn: InboxRows,
{
    /// R181 step 4 ahead of the outcome write when the run's handler timeout is short
    /// ([`SHORT_HANDLER_TIMEOUT`]): the timeout to put back goes back now, in a statement of its
    /// own, so the outcome write does not run under the handler's timeout.
    async fn restore_if_short(&mut self) -> Result<(), RepositoryError> {
        if self
            .run_timeout
            .take()
            .is_some_and(|t| t < SHORT_HANDLER_TIMEOUT)
            && let Some(before) = self.restore.take()
        {
            let s = self.stmts.clone();
            self.c()
                .text(&s.statement_timeout, &[Bind::Text(before)])
                .await?;
        }
        Ok(())
    }

    fn c(&mut self) -> Conn<'_, D> {
        Conn {
            c: &mut *self.tx,
            table: &self.stmts.table,
        }
    }

    /// The statement `write` (R126, R128, R154): the row as written, undecoded.
    async fn write_raw(
        &mut self,
        id: Uuid,
        write: &RowWrite,
    ) -> Result<InboxRawRow, RepositoryError> {
        let s = self.stmts.clone();
        let (kind, error, (after, at)) = match write {
            RowWrite::Complete => ("complete", None, retry_binds(&Retry::Keep)),
            RowWrite::Counted {
                error,
                retry,
                exhausted,
            } => (
                match exhausted {
                    OnExhausted::Release => "counted",
                    OnExhausted::Park => "counted_park",
                },
                Some(error_text(error)),
                retry_binds(retry),
            ),
            RowWrite::NotCounted { error, retry } => {
                ("not_counted", Some(error_text(error)), retry_binds(retry))
            }
            RowWrite::Terminal { error, exhausted } => (
                match exhausted {
                    OnExhausted::Release => "terminal",
                    OnExhausted::Park => "terminal_park",
                },
                Some(error_text(error)),
                retry_binds(&Retry::Keep),
            ),
            RowWrite::ClearLease => ("clear_lease", None, retry_binds(&Retry::Keep)),
        };
        // The row is written: what `land_run` returned of it no longer stands.
        self.inserted = None;
        let binds = [
            Bind::Uuid(id),
            Bind::Text(String::from(kind)),
            nullable_text(error.as_deref()),
            after,
            at,
            // R181 step 4: the timeout goes back for the commit that follows.
            nullable_text(self.restore.take().as_deref()),
        ];
        let rows = match self.known.get(&id) {
            Some(at) => {
                let mut binds = binds.to_vec();
                binds.push(Bind::Timestamp(*at));
                self.c().rows(&s.write_at, &binds).await?
            }
            None => self.c().rows(&s.write, &binds).await?,
        };
        rows.into_iter()
            .next()
            .ok_or_else(|| RepositoryError::Other(format!("inbox row {id} does not exist")))
    }

    /// Lands one event ([`InboxTransaction::land`]); the row's created_at is known after.
    async fn land_one(&mut self, e: &NewInboxEvent) -> Result<Landed, RepositoryError> {
        let l = self.land_event(e).await?;
        self.known.insert(l.row.id, l.row.created_at);
        Ok(l)
    }

    async fn land_event(&mut self, e: &NewInboxEvent) -> Result<Landed, RepositoryError> {
        let s = self.stmts.clone();
        let key = [
            Bind::Text(String::from(e.message_id())),
            Bind::Text(String::from(e.consumer_group())),
        ];
        if s.layout == Layout::Partitioned {
            // A dedup key already stored needs no insert, so nothing to serialize: its row is
            // returned without the advisory lock, and a processor's T_row that holds the lock
            // while its handler runs (R152) is not waited for; the row lock that follows skips
            // that row (R116 step 3; G-05).
            if let Some(row) = one(self.c().rows(&s.by_message_id, &key).await?)? {
                return Ok(Landed {
                    row,
                    inserted: false,
                });
            }
            // R111: the dedup key's advisory lock, then the rows of the key.
            self.c().execute(&s.dedup_lock, &key).await?;
            if let Some(row) = one(self.c().rows(&s.by_message_id, &key).await?)? {
                return Ok(Landed {
                    row,
                    inserted: false,
                });
            }
        }
        let payload = serde_json::Value::Object(e.payload().clone()).to_string();
        let headers = e
            .headers()
            .map(|h| serde_json::to_string(h).expect("a string map serializes"));
        let row = e.clone().into_row(DateTime::<Utc>::MIN_UTC);
        let binds = [
            Bind::Uuid(e.id()),
            Bind::Text(String::from(e.event_type())),
            Bind::Text(payload),
            nullable_text(headers.as_deref()),
            nullable_text(row.trace_id.as_deref()),
            nullable_text(row.correlation_id.as_deref()),
            nullable_text(row.causation_id.as_deref()),
            nullable_text(row.schema_version.as_deref()),
            Bind::Int4(e.max_attempts()),
            Bind::Text(String::from(e.message_id())),
            Bind::Text(String::from(e.consumer_group())),
            Bind::Text(String::from(e.source())),
            nullable_text(e.partition_key()),
            nullable_text(self.planned_timeout.as_deref()),
        ];
        if let Some(raw) = self.c().rows(&s.land_run, &binds).await?.into_iter().next() {
            let earlier = raw.earlier.unwrap_or(false);
            if let Some(before) = raw.timeout_before.clone() {
                // land_run set the handler timeout (R181 step 1, ahead of the savepoint).
                self.timeout_before = Some(before);
                self.timeout_early = true;
            }
            let row = decoded(raw)?;
            self.inserted = Some((row.clone(), earlier));
            return Ok(Landed {
                row,
                inserted: true,
            });
        }
        match one(self.c().rows(&s.by_message_id, &key).await?)? {
            Some(row) => Ok(Landed {
                row,
                inserted: false,
            }),
            None => Err(RepositoryError::Other(format!(
                "landing message {} of group {} inserted nothing and found no row (an id conflict?)",
                e.message_id(),
                e.consumer_group()
            ))),
        }
    }
}

impl<D: InboxDriver> PgInboxTx<D> {
    /// R152's guard: the row locked, pending and held by `worker`.
    async fn guard_held_one(
        &mut self,
        id: Uuid,
        worker: &WorkerId,
    ) -> Result<Option<InboxEvent>, RepositoryError> {
        Ok(match self.lock_row(id).await? {
            RowLock::Locked(r)
                if r.status == Status::Pending
                    && r.locked_by.as_deref() == Some(worker.as_str()) =>
            {
                Some(r)
            }
            _ => None,
        })
    }
}

#[async_trait]
impl<D: InboxDriver> InboxTransaction for PgInboxTx<D> {
    type Handle = D::Handle;

    fn handle(&mut self) -> &mut D::Handle {
        D::handle(&mut self.tx)
    }

    fn plan_handler_timeout(&mut self, timeout: Duration) {
        self.planned_timeout = Some(timeout_ms(timeout));
        self.planned_long = timeout >= SHORT_HANDLER_TIMEOUT;
    }

    async fn lock_key(&mut self, key: &InboxKey) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        let binds = [
            Bind::Text(String::from(key.consumer_group.as_str())),
            Bind::Text(String::from(key.source.as_str())),
            Bind::Text(String::from(key.partition_key.as_str())),
        ];
        self.c().execute(&s.key_lock, &binds).await?;
        Ok(())
    }

    async fn lock_keys(&mut self, keys: &[InboxKey]) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        let col = |f: fn(&InboxKey) -> &str| keys.iter().map(|k| f(k).to_owned()).collect();
        let binds = [
            Bind::Texts(col(|k| k.consumer_group.as_str())),
            Bind::Texts(col(|k| k.source.as_str())),
            Bind::Texts(col(|k| k.partition_key.as_str())),
        ];
        self.c().int8(&s.key_locks, &binds).await?;
        Ok(())
    }

    async fn forget_landed(&mut self, id: Uuid) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        let at = *self.known.get(&id).ok_or_else(|| {
            RepositoryError::Other(format!("inbox row {id} was not landed by this transaction"))
        })?;
        if self.inserted.as_ref().is_some_and(|(r, _)| r.id == id) {
            self.inserted = None;
        }
        self.c()
            .execute(&s.forget, &[Bind::Uuid(id), Bind::Timestamp(at)])
            .await?;
        Ok(())
    }

    async fn land(&mut self, events: Vec<NewInboxEvent>) -> Result<Vec<Landed>, RepositoryError> {
        let s = self.stmts.clone();
        let batch = events.len() > 1;
        if batch && s.layout == Layout::Partitioned {
            // R185 step 2: the dedup locks of the keys to insert, in hash order, first.
            let binds = [
                Bind::Texts(events.iter().map(|e| e.message_id().to_owned()).collect()),
                Bind::Texts(
                    events
                        .iter()
                        .map(|e| e.consumer_group().to_owned())
                        .collect(),
                ),
            ];
            self.c().execute(&s.dedup_locks, &binds).await?;
        }
        let mut out = Vec::with_capacity(events.len());
        for e in &events {
            out.push(self.land_one(e).await?);
        }
        if batch {
            // land_run's earlier probe of the last row inserted was read before the batch's
            // runs; the batch asks again, as T then sees the table (R185 step 3).
            self.inserted = None;
        }
        Ok(out)
    }

    async fn lock_row(&mut self, id: Uuid) -> Result<RowLock, RepositoryError> {
        if let Some((row, _)) = self.inserted.as_ref().filter(|(r, _)| r.id == id) {
            // R116 step 3: this transaction inserted the row and holds it; no other
            // transaction sees it before T commits, and nothing wrote it since (a write clears
            // `inserted`), so it stands as land_run returned it.
            return Ok(RowLock::Locked(row.clone()));
        }
        let s = self.stmts.clone();
        // By the primary key (created_at, id) when this transaction knows the row's created_at
        // (it landed or read it, or a guard named it), else by id alone.
        let (lock, exists, binds) = match self.known.get(&id) {
            Some(at) => (
                &s.lock_row_at,
                &s.exists_at,
                vec![Bind::Uuid(id), Bind::Timestamp(*at)],
            ),
            None => (&s.lock_row, &s.exists, vec![Bind::Uuid(id)]),
        };
        if let Some(r) = one(self.c().rows(lock, &binds).await?)? {
            self.known.insert(r.id, r.created_at);
            return Ok(RowLock::Locked(r));
        }
        Ok(match self.c().int8(exists, &binds).await? {
            Some(n) if n > 0 => RowLock::Busy,
            _ => RowLock::Missing,
        })
    }

    async fn earlier_in_line(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError> {
        let Some(pk) = row.partition_key.as_deref() else {
            return Ok(false);
        };
        if let Some((_, earlier)) = self.inserted.as_ref().filter(|(r, _)| r.id == row.id) {
            // land_run's probe, read after the key lock in this transaction (R116, R145).
            return Ok(*earlier);
        }
        let s = self.stmts.clone();
        let binds = [
            Bind::Text(String::from(row.consumer_group.as_str())),
            Bind::Text(String::from(row.source.as_str())),
            Bind::Text(String::from(pk)),
            Bind::Timestamp(row.created_at),
            Bind::Uuid(row.id),
        ];
        Ok(self.c().int8(&s.earlier, &binds).await?.unwrap_or(0) > 0)
    }

    async fn completed_sibling(&mut self, row: &InboxEvent) -> Result<bool, RepositoryError> {
        if self.stmts.layout != Layout::Partitioned {
            // The unique index rules siblings out on the plain table (R164).
            return Ok(false);
        }
        let s = self.stmts.clone();
        let key = [
            Bind::Text(String::from(row.message_id.as_str())),
            Bind::Text(String::from(row.consumer_group.as_str())),
        ];
        self.c().execute(&s.dedup_lock, &key).await?;
        let binds = [key[0].clone(), key[1].clone(), Bind::Uuid(row.id)];
        Ok(self
            .c()
            .int8(&s.completed_sibling, &binds)
            .await?
            .unwrap_or(0)
            > 0)
    }

    async fn savepoint(&mut self, timeout: Duration) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        if self.batch {
            if !self.timeout_early {
                // The first run of the transaction: the timeout before the savepoint, for every
                // run of it (see `batch`).
                self.timeout_before = self
                    .c()
                    .text(&s.statement_timeout, &[Bind::Text(timeout_ms(timeout))])
                    .await?;
                self.timeout_early = true;
            }
            self.run_timeout = Some(timeout);
            self.c().execute(&s.savepoint, &[]).await?;
            return Ok(());
        }
        self.c().execute(&s.savepoint, &[]).await?;
        self.run_timeout = Some(timeout);
        let ms = timeout_ms(timeout);
        if self.timeout_early && self.planned_timeout.as_deref() == Some(ms.as_str()) {
            // R181 step 1: land_run or lock_row_run set this very timeout in T's previous
            // statement, and no statement has run since but the savepoint's.
            return Ok(());
        }
        let before = self
            .c()
            .text(&s.statement_timeout, &[Bind::Text(ms)])
            .await?;
        if !self.timeout_early {
            self.timeout_before = before;
        }
        Ok(())
    }

    async fn release_savepoint(&mut self) -> Result<(), RepositoryError> {
        if self.batch {
            // The timeout stays for the next run; the commit puts it back.
            return Ok(());
        }
        // R181 step 3 without a round trip: the savepoint stays until the commit, which
        // releases it with T (a released and an unreleased savepoint commit the same writes;
        // nothing rolls back to it after a success). The timeout goes back with the outcome
        // write (R181 step 4, write.sql's $6).
        self.restore = self.timeout_before.take();
        self.restore_if_short().await
    }

    async fn rollback_to_savepoint(&mut self) -> Result<(), RepositoryError> {
        let s = self.stmts.clone();
        self.c().execute(&s.rollback_to_savepoint, &[]).await?;
        if self.batch {
            // Set before the first savepoint, the timeout survives; the commit puts it back.
            return Ok(());
        }
        if self.timeout_early {
            // Set before the savepoint, the timeout survives the rollback: the outcome write
            // puts it back (R181 step 4).
            self.restore = self.timeout_before.take();
            self.restore_if_short().await?;
        } else {
            // Set after the savepoint, the rollback undid it.
            self.timeout_before = None;
        }
        Ok(())
    }

    async fn write(&mut self, id: Uuid, write: RowWrite) -> Result<InboxEvent, RepositoryError> {
        decoded(self.write_raw(id, &write).await?)
    }

    async fn guard(&mut self, guard: &Guard) -> Result<Option<InboxEvent>, RepositoryError> {
        let s = self.stmts.clone();
        match guard {
            Guard::Reland(e) => {
                let l = self.land_one(e).await?;
                Ok(l.inserted.then_some(l.row))
            }
            Guard::Unchanged {
                id,
                created_at,
                attempts_made,
                scheduled_at,
                lease_ttl,
            } => {
                self.known.insert(*id, *created_at);
                let now = self.c().now(&s.now).await?;
                Ok(match self.lock_row(*id).await? {
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
                })
            }
            Guard::HeldBy {
                id,
                created_at,
                worker,
            } if s.layout == Layout::Plain => {
                self.known.insert(*id, *created_at);
                let Some(ms) = self.planned_timeout.clone() else {
                    return self.guard_held_one(*id, worker).await;
                };
                // R152's guard and R181 step 1 in one round trip (lock_row_run.sql).
                let binds = [
                    Bind::Uuid(*id),
                    Bind::Text(ms),
                    Bind::Timestamp(*created_at),
                ];
                let Some(raw) = self
                    .c()
                    .rows(&s.lock_row_run, &binds)
                    .await?
                    .into_iter()
                    .next()
                else {
                    return Ok(None);
                };
                self.timeout_before = raw.timeout_before.clone();
                self.timeout_early = self.timeout_before.is_some();
                let r = decoded(raw)?;
                Ok(
                    (r.status == Status::Pending
                        && r.locked_by.as_deref() == Some(worker.as_str()))
                    .then_some(r),
                )
            }
            Guard::HeldBy {
                id,
                created_at,
                worker,
            } => {
                self.known.insert(*id, *created_at);
                self.guard_held_one(*id, worker).await
            }
        }
    }

    /// One statement for all the rows (`lock_rows.sql`), then R152's guard on each row it
    /// locked (BT-11).
    async fn guard_held(
        &mut self,
        rows: &[(Uuid, DateTime<Utc>)],
        worker: &WorkerId,
    ) -> Result<Vec<Option<InboxEvent>>, RepositoryError> {
        let s = self.stmts.clone();
        let binds = [
            Bind::Uuids(rows.iter().map(|(id, _)| *id).collect()),
            Bind::NullableTimestamps(rows.iter().map(|(_, at)| Some(*at)).collect()),
        ];
        self.batch = self.planned_long;
        let mut locked: HashMap<Uuid, InboxEvent> = HashMap::with_capacity(rows.len());
        for raw in self.c().rows(&s.lock_rows, &binds).await? {
            let r = decoded(raw)?;
            locked.insert(r.id, r);
        }
        Ok(rows
            .iter()
            .map(|(id, at)| {
                self.known.insert(*id, *at);
                locked.remove(id).filter(|r| {
                    r.status == Status::Pending && r.locked_by.as_deref() == Some(worker.as_str())
                })
            })
            .collect())
    }

    /// One statement (`complete_rows.sql`) by the primary key, for rows this transaction knows
    /// the created_at of (those its guard named); the others by [`write`](Self::write).
    async fn complete_rows(&mut self, ids: &[Uuid]) -> Result<(), RepositoryError> {
        let mut pk = (Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()));
        for id in ids {
            match self.known.get(id) {
                Some(at) => {
                    pk.0.push(*id);
                    pk.1.push(Some(*at));
                }
                None => {
                    self.write_raw(*id, &RowWrite::Complete).await?;
                }
            }
        }
        if pk.0.is_empty() {
            return Ok(());
        }
        let s = self.stmts.clone();
        let n = pk.0.len() as u64;
        let binds = [Bind::Uuids(pk.0), Bind::NullableTimestamps(pk.1)];
        // The row is written: what `land_run` returned of it no longer stands.
        self.inserted = None;
        let written = self.c().execute(&s.complete_rows, &binds).await?;
        if written != n {
            return Err(RepositoryError::Other(format!(
                "completing {n} inbox rows wrote {written}: a row this transaction holds was not found"
            )));
        }
        Ok(())
    }

    async fn lock_dedup_keys(&mut self, keys: &[(String, String)]) -> Result<(), RepositoryError> {
        if self.stmts.layout != Layout::Partitioned || keys.is_empty() {
            // The unique index serializes landings on the plain table (R111).
            return Ok(());
        }
        let s = self.stmts.clone();
        let binds = [
            Bind::Texts(keys.iter().map(|(m, _)| m.clone()).collect()),
            Bind::Texts(keys.iter().map(|(_, g)| g.clone()).collect()),
        ];
        self.c().execute(&s.dedup_locks, &binds).await?;
        Ok(())
    }

    /// Reads the row undecoded: the guard on its raw status and lease, then the write, whose
    /// returned row is read for its state only (R106; Y-16).
    async fn fail_undecodable(
        &mut self,
        id: Uuid,
        worker: &WorkerId,
        error: &str,
        retry: Retry,
        exhausted: OnExhausted,
    ) -> Result<Option<WrittenState>, RepositoryError> {
        let s = self.stmts.clone();
        let held = self
            .c()
            .rows(&s.lock_row, &[Bind::Uuid(id)])
            .await?
            .into_iter()
            .next()
            .is_some_and(|r| {
                r.status == Status::Pending.as_str()
                    && r.locked_by.as_deref() == Some(worker.as_str())
            });
        if !held {
            return Ok(None);
        }
        let error = error.to_owned();
        let w = self
            .write_raw(
                id,
                &RowWrite::Counted {
                    error,
                    retry,
                    exhausted,
                },
            )
            .await?;
        let status = w.status.parse().map_err(|_| {
            RepositoryError::Other(format!(
                "inbox row {id}: status {:?} is not one of the three",
                w.status
            ))
        })?;
        Ok(Some(WrittenState {
            status,
            attempts_made: w.attempts_made,
            last_error: w.last_error,
            scheduled_at: w.scheduled_at,
        }))
    }

    async fn commit(mut self) -> Result<(), RepositoryError> {
        let table = self.stmts.table.clone();
        if self.batch
            && let Some(before) = self.timeout_before.take()
        {
            // R181 step 4 for a processor transaction of several rows (see `batch`).
            let s = self.stmts.clone();
            if let Err(e) = self
                .c()
                .text(&s.statement_timeout, &[Bind::Text(before)])
                .await
            {
                let _ = D::rollback(&table, self.tx).await;
                return Err(e);
            }
        }
        if self.faults.take_fail_commit() {
            let _ = D::rollback(&table, self.tx).await;
            return Err(RepositoryError::Unavailable {
                message: "injected failure of the commit (fail_next_row_commit)".into(),
            });
        }
        D::commit(&table, self.tx).await
    }

    async fn rollback(self) {
        let _ = D::rollback(&self.stmts.table, self.tx).await;
    }
}
